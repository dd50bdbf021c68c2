"""What unstack_layers costs and buys: SmolLM2's decode step with its layers as a scan over stacked
weights (model.py's layout) against a Python loop over per-layer arrays (what Batch uses), on CPU.

    python benchmarks/bench_compile.py       # about 1 min on 2 CPU cores; needs the SmolLM2 GGUF file

For each layout: the time to trace and lower the jitted decode step, the time to compile it, and the
warm step time (median of --steps calls, alternating the two layouts so that other load on a shared
machine falls on both alike). The loop is traced layer by layer, so it compiles more slowly; the
scan slices each layer's weights out of the stacked arrays at every step, which on CPU is a copy.
Prints the ratios (loop / scan); writes benchmarks/results/compile.json.
"""

import argparse
import dataclasses
import json
import pathlib
import platform
import statistics
import time

import jax
import numpy as np

from minagent import decode, weights
from minagent.cache import init_cache
from minagent.runner import unstack_layers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pages-per-row", type=int, default=16, help="of 16 positions: the context width")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/compile.json")
    args = parser.parse_args()
    path = weights.smollm2_path()
    if not path.exists():
        raise SystemExit(f"{path} not found: `python -m minagent.weights fetch`")
    stacked, cfg = weights.load_params(path)
    B, W, Z = args.batch, args.pages_per_row, 16
    # Every slot active, each with W pages of its own; the length moves on by one each call.
    slots = dataclasses.replace(decode.Slots.idle(B, W), active_B=np.ones(B, bool),
                                page_table_BxW=np.arange(1, B * W + 1, dtype=np.int32).reshape(B, W))

    layouts = {"scan": stacked, "loop": unstack_layers(stacked)}
    steps, caches, res = {}, {}, {}
    for name, params in layouts.items():
        jax.clear_caches()
        caches[name] = init_cache(cfg, B * W + 1, Z)
        t0 = time.perf_counter()
        lowered = decode.decode_step.lower(params, cfg, caches[name], slots)
        t1 = time.perf_counter()
        steps[name] = lowered.compile()
        t2 = time.perf_counter()
        res[name] = {"trace_lower_s": t1 - t0, "compile_s": t2 - t1, "step_ms": []}

    for i in range(args.steps + 1):                 # the first call of each is a warm-up, not timed
        for name, params in layouts.items():
            t = time.perf_counter()
            later, _, caches[name] = steps[name](params, caches[name],
                                                 dataclasses.replace(slots, lengths_B=slots.lengths_B + i))
            later.tokens_B.block_until_ready()
            if i:
                res[name]["step_ms"].append(1000 * (time.perf_counter() - t))

    for name, r in res.items():
        r["step_ms_median"] = statistics.median(r.pop("step_ms"))
        print(f"{name:5} trace+lower {r['trace_lower_s']:5.2f} s   compile {r['compile_s']:5.2f} s   "
              f"step (batch {B}) {r['step_ms_median']:6.1f} ms")
    loop, scan = res["loop"], res["scan"]
    ratios = {"compile": (loop["trace_lower_s"] + loop["compile_s"]) / (scan["trace_lower_s"] + scan["compile_s"]),
              "step": loop["step_ms_median"] / scan["step_ms_median"]}
    print(f"loop / scan: {ratios['compile']:.1f}x the time to compile, {ratios['step']:.2f}x the step time")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(vars(args), layers=cfg.n_layers, machine=platform.processor() or platform.machine(),
                                   results=res, ratios=ratios), indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
