"""Training throughput and model FLOPs utilisation (MFU) of train.make_train_step on this machine.

    MFU = model FLOP/s / peak FLOP/s
    model FLOPs per token = 3 x model.flops_per_token(cfg, seq_len)   (backward = 2 forwards)
    peak = best FLOP/s of one large float32 matmul (2n^3 / t), measured in the same run

The attention term counts every query against all seq_len keys, as PaLM's MFU
does (the causal mask is applied to full T x T scores, so that is what runs).
The optimizer update (a few FLOPs per weight) is timed but not counted.

Two models: a small one trained from scratch (d_model 256, 4 layers, the 8197-token
vocabulary) and SmolLM2-135M (its GGUF weights, dequantized to float32). Steps
are timed after warm-up (compilation and the first runs); the median is reported.

Huge pages: a training step allocates gigabytes of temporaries, and with 4 KB
pages the kernel faults each page in and the TLB misses. glibc can ask for
transparent huge pages instead (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, read
when the process starts, so the script re-executes itself with it): far fewer
page faults, more tokens/s (experiments/LOG.md). --no-hugepages turns it off.

Run:   python benchmarks/bench_train.py            # about 2 minutes on 2 idle CPU cores
       python benchmarks/bench_train.py --quick    # smaller batches, fewer steps, ~1 minute
Writes benchmarks/results/train.json and prints a table. The cores may be shared:
the table also gives the fastest step and FLOPs per CPU-second, which other
processes disturb less than the median wall time.
"""

import argparse
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from minagent import model
from minagent import train as tr
from minagent import weights


def cpu_seconds():
    """CPU time this process has used (all threads, user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def matmul_peak(n=2048, repeats=10):
    """-> (best FLOP/s, best FLOPs per CPU-second) of an n x n @ n x n float32 matmul.

    The first is the ceiling a training step can approach in wall time. The
    second does not drop when other processes take the cores: the same work
    just waits longer (this machine's 2 cores are shared).
    """
    a, b = jax.random.normal(jax.random.PRNGKey(0), (2, n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    best_wall, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), cpu_seconds()
        matmul(a, b).block_until_ready()
        best_wall, best_cpu = min(best_wall, time.perf_counter() - t), min(best_cpu, cpu_seconds() - c)
    return 2 * n ** 3 / best_wall, 2 * n ** 3 / best_cpu


def bench(name, params, cfg, batch_size, seq_len, steps, warmup):
    """Time `steps` training steps on random full-length traces (every target supervised)."""
    tcfg = tr.TrainConfig(batch_size=batch_size, seq_len=seq_len)
    optimizer = tr.make_optimizer(tcfg)
    step_fn = tr.make_train_step(cfg, optimizer)
    params = jax.tree.map(jnp.array, params)
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(0)
    examples = [(rng.integers(0, cfg.vocab_size, seq_len), np.ones(seq_len, np.uint8)) for _ in range(batch_size)]
    batch = {k: jnp.asarray(v) for k, v in tr.pack(examples, seq_len).items()}

    t = time.perf_counter()
    for _ in range(warmup):    # the first call compiles
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        metrics["loss"].block_until_ready()
    warmup_s = time.perf_counter() - t
    times, cpu_times = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), cpu_seconds()
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        metrics["loss"].block_until_ready()
        times.append(time.perf_counter() - t)
        cpu_times.append(cpu_seconds() - c)

    step_s = statistics.median(times)
    tokens = batch_size * seq_len
    flops = tokens * 3 * model.flops_per_token(cfg, seq_len)
    return dict(name=name, n_params=int(model.n_params(params)), batch_size=batch_size, seq_len=seq_len,
                step_s=step_s, step_s_min=min(times), step_cpu_s=statistics.median(cpu_times),
                warmup_s=warmup_s, tokens_per_s=tokens / step_s, train_flops_per_token=flops / tokens,
                model_flops_per_s=flops / step_s, model_flops_per_cpu_s=flops / statistics.median(cpu_times),
                loss=float(metrics["loss"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model (default 5, quick 2)")
    parser.add_argument("--smol-batch", type=int, default=None, help="SmolLM2 rows per step (default 4, quick 2)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--models", default="small,smollm2", help="which to run, comma-separated")
    parser.add_argument("--no-hugepages", action="store_true", help="keep glibc's default 4 KB pages")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "train.json"))
    args = parser.parse_args()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not args.no_hugepages and "glibc.malloc.hugetlb" not in tunables:
        env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, [tunables, "glibc.malloc.hugetlb=1"])))
        os.execve(sys.executable, [sys.executable] + sys.argv, env)   # glibc reads it only at start-up
    steps = args.steps or (2 if args.quick else 5)
    smol_batch = args.smol_batch or (2 if args.quick else 4)
    T = args.seq_len

    n = 1024 if args.quick else 2048
    small_cfg = model.Config(vocab_size=8197, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768)
    # The peak is measured before, between and after the models and the best is kept: the
    # most conservative MFU. A lower peak than the others means the cores were busy then.
    load_before, peaks, rows = os.getloadavg(), [matmul_peak(n)], []
    if "small" in args.models:
        rows.append(bench("small (from scratch)", model.init(jax.random.PRNGKey(0), small_cfg), small_cfg,
                          8 if args.quick else 32, T, steps, 2))
        peaks.append(matmul_peak(n))
    if "smollm2" in args.models:
        smol_params, smol_cfg = weights.load_params()
        rows.append(bench("SmolLM2-135M", smol_params, smol_cfg, smol_batch, T, steps, 2))
        peaks.append(matmul_peak(n))
    peak, peak_per_cpu_s = max(p for p, _ in peaks), max(c for _, c in peaks)
    for r in rows:
        r["mfu"] = r["model_flops_per_s"] / peak                       # wall clock: what was asked
        r["mfu_best_step"] = r["mfu"] * r["step_s"] / r["step_s_min"]
        r["mfu_cpu_time"] = r["model_flops_per_cpu_s"] / peak_per_cpu_s  # robust to busy cores

    print(f"float32 {n}^3 matmul: {', '.join(f'{p / 1e9:.1f}' for p, _ in peaks)} GFLOP/s "
          f"(before, between and after the models)\npeak = {peak / 1e9:.1f} GFLOP/s, "
          f"{peak_per_cpu_s / 1e9:.1f} GFLOP per CPU-second; {os.cpu_count()} cores, load average "
          f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    print(f"\n{'model':<22}{'params':>9}{'B x T':>10}{'step s':>8}{'best s':>8}{'tokens/s':>10}"
          f"{'GFLOP/s':>9}{'MFU':>7}{'best':>7}{'CPU-time':>10}{'cores':>7}")
    for r in rows:
        print(f"{r['name']:<22}{r['n_params'] / 1e6:>8.1f}M{r['batch_size']:>4} x {r['seq_len']:<4}"
              f"{r['step_s']:>8.2f}{r['step_s_min']:>8.2f}{r['tokens_per_s']:>10.0f}"
              f"{r['model_flops_per_s'] / 1e9:>9.1f}{r['mfu']:>7.1%}{r['mfu_best_step']:>7.1%}{r['mfu_cpu_time']:>10.1%}"
              f"{r['step_cpu_s'] / r['step_s']:>7.2f}")
    print("MFU: median step; best: fastest step; CPU-time: model FLOPs per CPU-second / the matmul's;\n"
          f"cores: CPU-seconds per second during a step (the peak matmul: {peak / peak_per_cpu_s:.2f}); "
          "fewer means other processes held a core and the wall-clock MFU is understated")
    if len(rows) == 2:
        print(f"ratios: small / SmolLM2 tokens/s = {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.1f}x, "
              f"SmolLM2 / small train FLOPs per token = "
              f"{rows[1]['train_flops_per_token'] / rows[0]['train_flops_per_token']:.1f}x")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.processor() or platform.machine(),
        device=str(jax.devices()[0]), cpu_count=os.cpu_count(), jax=jax.__version__,
        xla_flags=os.environ.get("XLA_FLAGS", ""), glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
        load_avg_before=load_before, load_avg_after=os.getloadavg(),
        quick=args.quick, matmul_n=n, matmul_flops=[p for p, _ in peaks], peak_flops=peak,
        peak_flops_per_cpu_s=peak_per_cpu_s, results=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
