"""Greedy decode speed: minagent's paged engine vs Hugging Face transformers' `generate`, on CPU.

    python benchmarks/bench_decode.py              # about 5 minutes on 2 CPU cores
    python benchmarks/bench_decode.py --quick      # batch 1 and 4, 16 tokens; writes nothing
    python benchmarks/bench_decode.py --one-core   # one core, one thread each (a shared machine)
    python benchmarks/bench_decode.py --quick --no-ref   # minagent alone, no torch: about 1.5 min

SmolLM2-135M-Instruct, the same float32 weights on both sides (minagent
dequantizes the GGUF file itself; transformers' GGUF loader does the same),
the same chat prompt in every row, `--new` greedy tokens. Each timed run
covers everything from the prompt to the last token (prefill included, as
`generate` does); compiling happens in an untimed warm-up run. The two engines
take turns, `--repeats` times, so that load from other processes on the
machine hits both; the table reports the best run of each, and the median
decode step of the best run (steadier than a total under bursts of load).
Run it on an idle machine: with two threads each and other work running,
torch's threads slow down far more than XLA's, which flatters minagent.
The script warns when the load average is above 0.5.

Then the host overhead: a small random model at batch 64, where the model is
cheap and Python's bookkeeping shows: the share of the wall time of `step()`
spent outside the jitted calls (timed with block_until_ready).

Writes benchmarks/results/decode.json. Needs the `ref` extra (torch, transformers);
--no-ref runs minagent's side and the host overhead only (SmolLM2's chat template
rebuilt with minagent's tokenizer), prints them and writes nothing.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--one-core" in sys.argv:     # must be decided before jax starts its thread pool
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minagent import chat, decode, model, tokenfile, weights  # noqa: E402
from minagent.batch import Batch  # noqa: E402
from minagent.cache import pages_for  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "decode.json"
QUESTION = "Write a short story about a robot who learns to paint."
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"   # its template's default


def minagent_run(params, cfg, prompt, B, new):
    """B copies of `prompt`, `new` greedy tokens each -> (seconds, [time after each step], tokens of row 0, compiles)."""
    batch = Batch(params, cfg, slots=B, n_pages=1 + B * pages_for(len(prompt) + new, 16), page_size=16)
    t0 = time.perf_counter()
    ids = [batch.add(prompt, new) for _ in range(B)]
    stamps = []
    while batch.running():
        batch.step()
        stamps.append(time.perf_counter())
    return stamps[-1] - t0, [t - t0 for t in stamps], batch.seqs[ids[0]].tokens[len(prompt):], batch.compiles


def hf_run(hf_model, prompt, B, new):
    """The same with transformers' generate; a logits processor notes the time of each step."""
    import torch
    ids = torch.tensor([prompt] * B)
    stamps = []

    def stamp(input_ids, scores):     # called once per generated token, after the model's forward
        stamps.append(time.perf_counter())
        return scores

    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, pad_token_id=2, logits_processor=[stamp])
    return time.perf_counter() - t0, [t - t0 for t in stamps], out[0, len(prompt):].tolist()


def step_ms(stamps):
    """Median time of a decode step (after the first, which includes the prefill), in ms: robust to bursts
    of load from other processes, which a total time is not."""
    return 1e3 * statistics.median(np.diff(stamps))


def matmul_floor(params, B, repeats=5):
    """ms for the weight matmuls of one decode step at batch B and nothing else, in XLA and in torch.

    Every projection of every layer and the unembedding, [B, D] @ [D, *], on the same float32 weights
    (no attention, no norms, no cache). An engine built on these libraries cannot step faster than this, so
    transformers' step / floor bounds the speed-up any engine could show against it.
    """
    import torch
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    layers = [[np.asarray(params["layers"][n][l]) for n in names] for l in range(params["layers"]["wq"].shape[0])]
    unembed_DxV = np.asarray(params.get("unembed", params["embed"].T))
    D = unembed_DxV.shape[0]

    @jax.jit
    def dots_xla(ws, unembed_DxV, x_BxD):
        for wq, wk, wv, wo, wg, wu, wd in ws:
            q_BxNH, k, v = x_BxD @ wq, x_BxD @ wk, x_BxD @ wv
            x_BxD = x_BxD + (q_BxNH + k.sum() + v.sum()) @ wo
            x_BxD = x_BxD + (jax.nn.silu(x_BxD @ wg) * (x_BxD @ wu)) @ wd
        return jnp.argmax(x_BxD @ unembed_DxV, axis=-1)

    def dots_torch(ws, unembed_DxV, x_BxD):
        for wq, wk, wv, wo, wg, wu, wd in ws:
            q_BxNH, k, v = x_BxD @ wq, x_BxD @ wk, x_BxD @ wv
            x_BxD = x_BxD + (q_BxNH + k.sum() + v.sum()) @ wo
            x_BxD = x_BxD + (torch.nn.functional.silu(x_BxD @ wg) * (x_BxD @ wu)) @ wd
        return torch.argmax(x_BxD @ unembed_DxV, dim=-1)

    def best_ms(fn, *args):
        fn(*args)                                       # compile / warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    x_BxD = np.random.RandomState(0).randn(B, D).astype(np.float32) * 0.1
    with torch.no_grad():
        torch_args = ([[torch.from_numpy(w) for w in ws] for ws in layers], torch.from_numpy(unembed_DxV),
                      torch.from_numpy(x_BxD))
        return {"xla_ms": best_ms(dots_xla, layers, unembed_DxV, x_BxD), "torch_ms": best_ms(dots_torch, *torch_args)}


def host_overhead(B=64, steps=64):
    """Share of step() wall time spent outside the jitted calls, small random model at batch B."""
    cfg = model.Config(vocab_size=8197, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192)
    params = model.init(jax.random.PRNGKey(0), cfg)
    inside = [0.0]
    real = decode.decode_step, decode.prefill_step

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            inside[0] += time.perf_counter() - t0
            return out
        return wrapper

    batch = Batch(params, cfg, slots=B, n_pages=1 + B * 8, page_size=16, max_len=128)
    rng = np.random.RandomState(0)
    for _ in range(B):
        batch.add(list(rng.randint(5, cfg.vocab_size, rng.randint(4, 40))), steps)
    batch.warmup()
    batch.step()                     # prefill, untimed: the steady state is the decode step
    decode.decode_step, decode.prefill_step = timed(real[0]), timed(real[1])
    try:
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            batch.step()
        total = time.perf_counter() - t0
    finally:
        decode.decode_step, decode.prefill_step = real
    return {"batch": B, "steps": steps - 1, "ms_per_step": 1e3 * total / (steps - 1),
            "ms_in_jit_per_step": 1e3 * inside[0] / (steps - 1), "share_outside_jit": 1 - inside[0] / total}


def overhead_line(overhead):
    return (f"host overhead at batch {overhead['batch']} (d_model 64, 2 layers): {overhead['ms_per_step']:.2f} ms "
            f"per step, {overhead['ms_in_jit_per_step']:.2f} ms inside jit, "
            f"{100 * overhead['share_outside_jit']:.1f}% outside")


def minagent_only(args, params, cfg, path):
    """--no-ref: minagent's side of each row and the host overhead, printed; nothing to compare with."""
    tok = tokenfile.from_gguf(path)         # the prompt SmolLM2's chat template makes, without transformers
    prompt = chat.encode(tok, chat.prompt(chat.CHATML, QUESTION, system=SMOLLM_SYSTEM))
    for B in args.batches:
        compiles = minagent_run(params, cfg, prompt, B, args.new)[-1]      # warm-up: compiles
        runs = [minagent_run(params, cfg, prompt, B, args.new) for _ in range(args.repeats)]
        best, n = min(r[0] for r in runs), B * args.new
        print(f"batch {B}: minagent {n / best:.1f} tok/s, decode step {min(step_ms(r[1]) for r in runs):.1f} ms, "
              f"first token {min(r[1][0] for r in runs):.2f} s; {compiles} compiles in the warm-up, "
              f"{runs[-1][-1]} after; runs {[r[0] for r in runs]} s", flush=True)
    print(overhead_line(host_overhead(steps=16 if args.quick else 64)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new", type=int, default=64, help="greedy tokens generated per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4, 16 tokens, 1 repeat")
    parser.add_argument("--one-core", action="store_true",
                        help="one core, one thread per engine: steadier on a machine shared with other work, "
                             "where two-thread runs (torch's above all) slow down erratically")
    parser.add_argument("--no-ref", action="store_true",
                        help="minagent alone, without torch and transformers: prints its numbers, writes nothing")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.new, args.repeats = [1, 4], 16, 1
    path = weights.smollm2_path()
    params, cfg = weights.load_params(path)
    if args.no_ref:
        return minagent_only(args, params, cfg, path)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if args.one_core:
        torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = list(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"])
    load_before = os.getloadavg()

    rows = []
    for B in args.batches:
        compiles = minagent_run(params, cfg, prompt, B, args.new)[-1]      # warm-up: compiles
        hf_run(hf_model, prompt, B, min(args.new, 4))
        ours, theirs = [], []
        for _ in range(args.repeats):                                       # take turns
            *run, ours_tokens, recompiles = minagent_run(params, cfg, prompt, B, args.new)
            ours.append(run)
            *run, their_tokens = hf_run(hf_model, prompt, B, args.new)
            theirs.append(run)
        floor = matmul_floor(params, B)
        agree = next((i for i, (a, b) in enumerate(zip(ours_tokens, their_tokens)) if a != b), args.new)
        n = B * args.new
        best_ours, best_theirs = min(s for s, _ in ours), min(s for s, _ in theirs)
        step_ours, step_theirs = min(step_ms(t) for _, t in ours), min(step_ms(t) for _, t in theirs)
        rows.append({"batch": B, "new_tokens": args.new, "prompt_tokens": len(prompt),
                     "minagent_tok_s": n / best_ours, "transformers_tok_s": n / best_theirs,
                     "ratio": best_theirs / best_ours,
                     "minagent_decode_step_ms": step_ours, "transformers_decode_step_ms": step_theirs,
                     "decode_step_ratio": step_theirs / step_ours,
                     "minagent_first_token_s": min(t[0] for _, t in ours),
                     "transformers_first_token_s": min(t[0] for _, t in theirs),
                     "matmul_floor_ms": floor, "best_possible_step_ratio": step_theirs / min(floor.values()),
                     "greedy_tokens_agree": agree, "warmup_compiles": compiles, "compiles_after_warmup": recompiles,
                     "minagent_runs_s": [s for s, _ in ours], "transformers_runs_s": [s for s, _ in theirs]})
        print(f"batch {B}: minagent {n / best_ours:.1f} tok/s, transformers {n / best_theirs:.1f} tok/s, ratio "
              f"{best_theirs / best_ours:.2f}; decode step {step_ours:.1f} vs {step_theirs:.1f} ms; greedy tokens "
              f"agree on {agree}/{args.new}; weight matmuls alone {floor['xla_ms']:.1f} ms (XLA), "
              f"{floor['torch_ms']:.1f} ms (torch); runs {rows[-1]['minagent_runs_s']} vs "
              f"{rows[-1]['transformers_runs_s']} s", flush=True)

    overhead = host_overhead(steps=16 if args.quick else 64)
    cores = "1 core (--one-core)" if args.one_core else f"{len(os.sched_getaffinity(0))} cores"
    result = {"device": f"{platform.processor() or platform.machine()}, {cores}",
              "jax": jax.__version__, "torch": torch.__version__, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "rows": rows, "host_overhead": overhead}
    result["machine_busy"] = max(load_before[0], result["load_average_after"][0]) > 0.5

    print(f"\nSmolLM2-135M greedy decode, float32, CPU ({result['device']}), load {load_before[0]:.1f}")
    if result["machine_busy"]:
        print("WARNING: the machine was busy with other work: these numbers are not reliable "
              "(two-thread torch suffers most); rerun on an idle machine or with --one-core")
    print("tok/s: prompt to last token, best run. step: median decode step, best run. first: prefill + 1 step.")
    print(f"{'batch':>5} {'minagent tok/s':>15} {'HF tok/s':>9} {'ratio':>6} | {'step ms':>8} {'HF step':>8} "
          f"{'ratio':>6} | {'first s':>8} {'HF first':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['minagent_tok_s']:>15.1f} {r['transformers_tok_s']:>9.1f} {r['ratio']:>6.2f} | "
              f"{r['minagent_decode_step_ms']:>8.1f} {r['transformers_decode_step_ms']:>8.1f} "
              f"{r['decode_step_ratio']:>6.2f} | {r['minagent_first_token_s']:>8.2f} "
              f"{r['transformers_first_token_s']:>8.2f}")
    print("floor: the weight matmuls of one step alone (XLA / torch, ms); best possible: HF step / the faster "
          "floor, the step ratio that an engine doing nothing but those matmuls would reach")
    for r in rows:
        print(f"{r['batch']:>5} floor {r['matmul_floor_ms']['xla_ms']:.1f} / {r['matmul_floor_ms']['torch_ms']:.1f} ms, "
              f"best possible step ratio {r['best_possible_step_ratio']:.2f}")
    print(overhead_line(overhead))
    if args.quick:                # a smoke test: keep the real results
        return
    out = RESULTS.with_name("decode_one_core.json") if args.one_core else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
