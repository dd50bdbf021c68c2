"""Time one SmolLM2 forward pass (8 x 128 tokens): minagent (jitted) against transformers (torch), on CPU.

    pip install -e '.[ref]'       # transformers' GGUF loading also needs accelerate
    python benchmarks/bench_forward.py       # about 2 min on 2 CPU cores

Same weights on both sides (the GGUF file, dequantized to float32), logits for
every position. transformers runs under torch.no_grad with 2 torch threads;
minagent's forward is compiled once, then timed warm. The two are timed in
alternation, one call each per round, so that other load on a shared machine
falls on both alike. Prints best and median per call and the ratio; writes
benchmarks/results/forward.json.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from minagent import model, weights


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default="benchmarks/results/forward.json")
    args = parser.parse_args()
    path = weights.smollm2_path()
    torch.set_num_threads(args.threads)

    params, cfg = weights.load_params(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokens_BxT = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.length), dtype=np.int32)

    forward = jax.jit(model.forward, static_argnums=1)
    tokens_jax, tokens_torch = jnp.asarray(tokens_BxT), torch.from_numpy(tokens_BxT.astype(np.int64))

    def run_minagent():
        return forward(params, cfg, tokens_jax).block_until_ready()

    def run_hf():
        with torch.no_grad():
            return hf(tokens_torch).logits

    t0 = time.perf_counter()
    ours = np.asarray(run_minagent())
    compile_s = time.perf_counter() - t0
    theirs = run_hf().numpy()
    print(f"compile + first call {compile_s:.1f} s; max |logit difference| {np.abs(ours - theirs).max():.2e}")
    del ours, theirs

    times = {"minagent": [], "transformers": []}
    for r in range(args.rounds):
        for name, fn in (("minagent", run_minagent), ("transformers", run_hf)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        print(f"round {r}: minagent {times['minagent'][-1] * 1e3:.0f} ms, "
              f"transformers {times['transformers'][-1] * 1e3:.0f} ms")

    n_tokens = args.batch * args.length
    flops = model.flops_per_token(cfg, args.length / 2) * n_tokens   # a causal query sees T/2 keys on average
    summary = {name: {"best_s": min(t), "median_s": statistics.median(t), "runs_s": t,
                      "tokens_per_s": n_tokens / min(t), "gflops_per_s": flops / min(t) / 1e9}
               for name, t in times.items()}
    ratio_best = summary["transformers"]["best_s"] / summary["minagent"]["best_s"]
    ratio_median = summary["transformers"]["median_s"] / summary["minagent"]["median_s"]

    print(f"\nSmolLM2-135M forward, {args.batch} x {args.length} tokens, float32, CPU ({os.cpu_count()} cores)")
    print(f"{'':<13} {'best ms':>8} {'median ms':>9} {'tokens/s':>9} {'GFLOP/s':>8}")
    for name, s in summary.items():
        print(f"{name:<13} {s['best_s'] * 1e3:>8.0f} {s['median_s'] * 1e3:>9.0f} "
              f"{s['tokens_per_s']:>9.0f} {s['gflops_per_s']:>8.1f}")
    print(f"minagent is {ratio_best:.2f}x as fast as transformers (best), {ratio_median:.2f}x (median)")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "SmolLM2-135M-Instruct forward pass, float32, logits for every position",
        "batch": args.batch, "length": args.length, "rounds": args.rounds, "torch_threads": args.threads,
        "speedup_best": ratio_best, "speedup_median": ratio_median, "compile_s": compile_s, **summary,
        "load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "date": time.strftime("%Y-%m-%d"),
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
