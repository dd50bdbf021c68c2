"""Decode and training on one accelerator against their rooflines (written for a GPU; --quick runs anywhere).

Decode: decode.decode_step on random SmolLM2-135M-shaped weights (the GGUF file is not needed), every
slot active, each row holding `context` positions in its own pages of 16; batch 1, 32, 256; context
128 and 2,048; bfloat16 and float32 (weights and cache); gather and Pallas attention; the layers as
the Batch holds them (stacked, a scan, off CPU), and for the two smaller batches at the shorter context
the other way too (on a GPU a list, one layer after another); each decode row also counts the kernels in its
compiled step (fusions and custom calls, a loop body's once). A step's floor is the larger of its bytes
over the memory bandwidth (the weights once, plus each row's keys and values) and its FLOPs over the matmul
peak, both measured in the same run (a large copy; a large matmul in the step's dtype). Steps per
call: 16 decode steps as 16 calls read back by the host, or as one call of decode.decode_steps.
Training: train.make_train_step, tokens/s and MFU against the peak. Decode rows print time, floor
and their ratio (1.0 is the roofline). Largest shapes first; a row that fails is recorded with its
error and the rest still run.

    python benchmarks/bench_gpu.py            # on an H200: under 2 minutes
    python benchmarks/bench_gpu.py --quick    # a small model and short contexts, any backend (~1 min on CPU)

Writes benchmarks/results/gpu.json (--out to change). Off a GPU the Pallas kernel runs in interpret
mode, so its times there mean nothing; --quick exists to check that the script runs.
"""

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from minagent import decode, model
from minagent.runner import unstack_layers
from minagent import train as tr
from minagent.cache import init_cache, pages_for

SMOLLM2 = model.Config(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536)
SMALL = model.Config(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
Z = 16


def timed(fn, repeats):
    """Median seconds of fn() (which blocks until its result is ready), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth(n_bytes, repeats):
    """Bytes per second of x * 2 over a large array: it reads and writes every byte once."""
    x = jnp.ones(n_bytes // 4, jnp.float32)
    double = jax.jit(lambda x: x * 2)
    return 2 * n_bytes / timed(lambda: double(x).block_until_ready(), repeats)


def matmul_peak(n, dtype, repeats):
    """FLOP/s of an n x n @ n x n matmul in `dtype` (float32 accumulation)."""
    a, b = jax.random.normal(jax.random.PRNGKey(0), (2, n, n), jnp.float32).astype(dtype)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / timed(lambda: mm(a, b).block_until_ready(), repeats)


def decode_row(cfg, params, B, context, attention, peak, bw, repeats):
    """One decode step of B rows that each hold `context` positions -> a result row."""
    W = pages_for(context, Z)
    cache = init_cache(cfg, 1 + B * W, Z)
    table_BxW = (1 + np.arange(B * W, dtype=np.int32)).reshape(B, W)
    # The pending token goes to position context - 1: after the step each row holds `context` positions.
    slots = decode.Slots(np.ones(B, np.int32), np.full(B, context - 1, np.int32), np.ones(B, bool),
                         np.arange(B, dtype=np.int32), table_BxW)
    slots = jax.device_put(slots)
    state = {"cache": cache}

    def step():
        _, logits, state["cache"] = decode.decode_step(params, cfg, state["cache"], slots, attention=attention)
        logits.block_until_ready()
    seconds = timed(step, repeats)
    hlo = decode.decode_step.lower(params, cfg, state["cache"], slots, attention=attention).compile().as_text()
    item = jnp.dtype(cfg.dtype).itemsize
    kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context * item * B
    weight_bytes = model.n_params(params) * item
    flops = B * model.flops_per_token(cfg, context)
    floor = max((weight_bytes + kv_bytes) / bw, flops / peak)
    return dict(kind="decode", dtype=cfg.dtype, attention=attention, batch=B, context=context,
                layers="list" if isinstance(params["layers"], list) else "stacked", kernels=kernels(hlo),
                ms=1e3 * seconds, floor_ms=1e3 * floor, ratio=seconds / floor,
                bound="memory" if (weight_bytes + kv_bytes) / bw >= flops / peak else "compute")


def kernels(hlo):
    """Device kernels in a compiled program's text: its fusions and custom calls (a library matmul,
    a Pallas kernel), each counted once where it is written, so a loop body's once, not per pass."""
    return sum(" fusion(" in line or " custom-call(" in line for line in hlo.splitlines())


def steps_row(cfg, params, B, context, n, repeats):
    """n decode steps from `context`: n calls of decode_step, each read back by the host as the Batch
    does, against one call of decode_steps -> ms per step each, and their ratio."""
    W = pages_for(context + n, Z)
    table_BxW = (1 + np.arange(B * W, dtype=np.int32)).reshape(B, W)
    start = decode.Slots(np.ones(B, np.int32), np.full(B, context - 1, np.int32), np.ones(B, bool),
                         np.arange(B, dtype=np.int32), table_BxW)
    state = {"cache": init_cache(cfg, 1 + B * W, Z)}

    def one_at_a_time():
        slots = start
        for _ in range(n):
            slots, _, state["cache"] = decode.decode_step(params, cfg, state["cache"], slots)
            np.asarray(slots.tokens_B)                     # the host reads each token
    def all_at_once():
        _, tokens, state["cache"] = decode.decode_steps(params, cfg, state["cache"], start, np.full(B, n, np.int32),
                                                        np.zeros(cfg.vocab_size, bool), n)
        np.asarray(tokens)
    single, many = timed(one_at_a_time, repeats) / n, timed(all_at_once, repeats) / n
    return dict(kind="steps", dtype=cfg.dtype, batch=B, context=context, n=n, ms_one_a_call=1e3 * single,
                ms_n_a_call=1e3 * many, speedup=single / many)


def train_row(cfg, params, batch_size, seq_len, peak, repeats):
    tcfg = tr.TrainConfig(steps=100, batch_size=batch_size, seq_len=seq_len)
    optimizer = tr.make_optimizer(tcfg)
    step = tr.make_train_step(cfg, optimizer)
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (batch_size, seq_len)), jnp.int32)
    batch = dict(tokens=tokens, targets=jnp.roll(tokens, -1, axis=1),
                 positions=jnp.broadcast_to(jnp.arange(seq_len), (batch_size, seq_len)),
                 segments=jnp.zeros((batch_size, seq_len), jnp.int32), mask=jnp.ones((batch_size, seq_len)))
    state = {"params": jax.tree.map(jnp.copy, params)}
    state["opt"] = optimizer.init(state["params"])

    def run():
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch)
        metrics["loss"].block_until_ready()
    seconds = timed(run, repeats)
    flops = batch_size * seq_len * 3 * model.flops_per_token(cfg, seq_len)
    return dict(kind="train", dtype=cfg.dtype, batch=batch_size, context=seq_len, ms=1e3 * seconds,
                floor_ms=1e3 * flops / peak, ratio=seconds * peak / flops,
                tokens_per_s=batch_size * seq_len / seconds, mfu=flops / seconds / peak)


def layout(params, other=False):
    """The layers as the Batch holds them: a list of per-layer arrays on CPU, stacked (a scan) elsewhere;
    other=True: the other way (the rows that compare the two)."""
    return unstack_layers(params) if (jax.default_backend() == "cpu") != other else params


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, short contexts, few repeats")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "gpu.json"))
    args = parser.parse_args()
    q = args.quick
    base = SMALL if q else SMOLLM2
    batches, contexts, repeats = ((1, 4), (32, 64), 3) if q else ((1, 32, 256), (128, 2048), 10)
    device = jax.devices()[0]
    bw = bandwidth(2 ** 24 if q else 2 ** 31, repeats)
    print(f"{device.platform} {device.device_kind}, jax {jax.__version__}: copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(name, make_row, show):
        """Run one row; a row that fails is recorded with its error and the others still run. The
        JSON file is written after every row, so a run stopped early keeps what it measured."""
        t = time.perf_counter()
        try:
            rows.append(make_row())
            print(show(rows[-1]), f"[{time.perf_counter() - t:.0f} s]", flush=True)
        except Exception as e:                                    # noqa: BLE001  (reported, not hidden)
            rows.append(dict(kind=name.split()[0], row=name, error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"{name}: FAILED {rows[-1]['error'][:300]}", flush=True)
        out.write_text(json.dumps(dict(device=f"{device.platform} {device.device_kind}", jax=jax.__version__,
                                       quick=q, bandwidth=bw, rows=rows), indent=1))

    for dtype in ("bfloat16", "float32"):
        cfg = dataclasses.replace(base, dtype=dtype)
        params = model.init(jax.random.PRNGKey(0), cfg)
        peak = matmul_peak(256 if q else 8192, dtype, repeats)
        print(f"{dtype}: matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
        for context in contexts[::-1]:
            for B in batches[::-1]:
                for attention in ("gather", "pallas"):
                    record(f"decode {dtype} {attention} B {B} context {context}",
                           lambda: decode_row(cfg, layout(params), B, context, attention, peak, bw, repeats),
                           lambda r: (f"decode {dtype:8} {attention:6} B {B:3} context {context:5}: "
                                      f"{r['ms']:8.3f} ms, floor {r['floor_ms']:7.3f} ms ({r['bound']}), "
                                      f"ratio {r['ratio']:6.2f}, layers {r['layers']}, {r['kernels']} kernels"))
        for B in (batches[0], batches[1]):          # the layers held the other way: a scan's cost per step
            record(f"decode {dtype} gather B {B} context {contexts[0]} other layers",
                   lambda: decode_row(cfg, layout(params, other=True), B, contexts[0], "gather", peak, bw, repeats),
                   lambda r: (f"decode {dtype:8} gather B {B:3} context {contexts[0]:5}, layers {r['layers']}: "
                              f"{r['ms']:8.3f} ms ({r['kernels']} kernels), ratio {r['ratio']:6.2f}"))
        record(f"train {dtype}", lambda: train_row(cfg, params, 4 if q else 8, 64 if q else 1024, peak, repeats),
               lambda r: (f"train  {dtype:8} {r['batch']} x {r['context']}: {r['ms']:8.1f} ms, "
                          f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.0f} %"))
        for B in (batches[0], batches[1]):
            record(f"steps {dtype} B {B}", lambda: steps_row(cfg, layout(params), B, contexts[0], 16, repeats),
                   lambda r: (f"steps  {dtype:8} B {B:3} context {r['context']:5}: {r['ms_one_a_call']:.3f} ms "
                              f"a step one a call, {r['ms_n_a_call']:.3f} ms {r['n']} a call ({r['speedup']:.2f}x)"))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
