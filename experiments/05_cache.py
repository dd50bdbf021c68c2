"""05: what the KV cache saves, counted by the engine itself.

The spec (section 1, "What the cache saves"): without a cache each resume re-reads the whole
episode from the start; for a mission of four calls the model goes through 57 positions with the
cache and 215 without, and the gap grows as the square of the number of calls.

The missions: chains of additions with exactly k calls, k = 1..8, in minagent's format with a BPE
trained on their text (digits split). The gold trace of a 2-call chain, one segment a line:

    PROGRAM  <|user|>Add up 12, 7 and 30.<|assistant|>
    MODEL    <|call|>add 12 7<|result|>
    PROGRAM  19<|assistant|>
    MODEL    <|call|>add 19 30<|result|>
    PROGRAM  49<|assistant|>
    MODEL    49<|end|>

A small model (demo.SMALL: 3 layers, d_model 128) is trained from scratch on such chains, then new
chains go through agent.run with cache=True and cache=False. Decoding is greedy, so both runs write
the same tokens (checked); record.positions is the engine's own count. Episodes are grouped by the
number of calls the model actually made, right answer or not. Each count is also checked against
the count by hand: a stretch ends on a token the model sampled and never pushed (each <|result|> it
wrote, and its last token). With the cache every other token is pushed once: T - 1. Without it the
stretch that ends at index e re-reads the episode from 0 and pushes e positions, so the total is the
sum of the stretch ends: with k rounds of r tokens each, a quadratic in k. The gold traces' counts
(by hand, no model) are printed too.

Then the wall time of the loop with and without the cache on 64 episodes of 4 and of 8 calls. The
time ratio is smaller than the positions ratio: both runs take the same decode steps (one token
per step for every episode); what the cache saves is the re-reading, which is prefill, many
positions per call. On 2 shared CPU cores these times vary by 2-4x with the load.

Run:
    python experiments/05_cache.py           # CPU (2 cores): ~13 min the first time (12 of them training,
                                             # 800 steps), 35 s once the model is cached
    python experiments/05_cache.py --quick   # CPU: ~30 s; a 2-layer d_model 64 model trained 150 steps,
                                             # 1 to 3 calls: the counts are whatever it does, right or wrong
No GPU needed.
The trained model is cached (git-ignored) in experiments/results/05_cache.ckpt; --retrain ignores it.
Writes experiments/results/05_cache.json and, if matplotlib is installed, 05_cache.png.
"""

import argparse
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from minagent import agent, chat, demo, model, train  # noqa: E402
from minagent import tokenizer as tk  # noqa: E402
from minagent.tools import Toolbox  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
FMT = chat.MINAGENT
SPEC_4_CALLS = (57, 215)   # positions with and without the cache, the design documents' 4-call mission


def chain(k, rng):
    """A mission of exactly k calls: (prompt, gold answer, gold trace)."""
    nums = [rng.randint(1, 99) for _ in range(k + 1)]
    question = "Add up " + ", ".join(map(str, nums[:-1])) + f" and {nums[-1]}."
    box, total = Toolbox(0), str(nums[0])
    trace = [chat.prompt(FMT, question)]
    for n in nums[1:]:
        call = f"add {total} {n}"
        total = box(call)
        trace += chat.tool_round(FMT, call, total)
    trace.append(chat.answer(FMT, total))
    return trace[0], total, trace


def chains(n_per_k, ks, seed):
    rng = random.Random(seed)
    return [(k,) + chain(k, rng) for k in ks for _ in range(n_per_k)]    # (k, prompt, answer, trace)


def by_hand(tokens, authors, result_id):
    """(positions with the cache, without) from an episode's tokens alone; see the docstring."""
    ends = {i for i, (t, a) in enumerate(zip(tokens, authors)) if t == result_id and a == chat.MODEL}
    ends.add(len(tokens) - 1)
    return len(tokens) - 1, sum(ends)


def get_model(args):
    """The chain-trained model: from the cached checkpoint if it matches the arguments, else trained now."""
    ckpt, recipe = RESULTS / "05_cache.ckpt", dict(steps=args.steps, train=args.train, seed=args.seed,
                                                   ks=args.ks, vocab_size=args.vocab_size, seq_len=args.seq_len)
    if not args.quick and ckpt.exists() and not args.retrain:
        c = train.load_checkpoint(ckpt)
        if c["extra"] == recipe:
            print(f"model from {ckpt.relative_to(ROOT)}")
            return c["params"], c["cfg"], c["tokenizer"]
    data = chains(args.train // len(args.ks), args.ks, args.seed)
    tok = tk.train("\n".join(chat.text(t) for *_, t in data[::4]), args.vocab_size, pattern=tk.SMOLLM_PATTERN,
                   specials=tk.MINAGENT_SPECIALS)
    arch = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128) if args.quick else demo.SMALL
    cfg = model.Config(vocab_size=tok.n_vocab, **arch)
    exs = [chat.render(t, tok) for *_, t in data]
    tcfg = train.TrainConfig(steps=args.steps, batch_size=32, seq_len=args.seq_len, lr=3e-3,
                             warmup=min(50, args.steps // 5), seed=args.seed, log_every=25)
    params = model.init(jax.random.PRNGKey(args.seed), cfg)
    print(f"training {model.n_params(params):,} parameters on {len(exs)} chains for {args.steps} steps")
    params, _ = train.train(params, cfg, exs, tcfg, progress=not args.quick)
    if not args.quick:
        train.save_checkpoint(ckpt, params, None, cfg, tcfg, args.steps, tokenizer=tok, extra=recipe)
    return params, cfg, tok


def loop(params, cfg, tok, prompts, cache, batch=None):
    # max_len: room for 8 stretches of 40 tokens and 8 results, whatever the model writes (agent.run
    # raises if a resume would not fit); pages are taken only as the episode grows.
    return agent.run(params, cfg, tok, FMT, prompts, [Toolbox(0) for _ in prompts], slots=64, max_len=1024,
                     cache=cache, batch=batch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-calls", type=int, default=8, help="chains of 1 to this many calls (the loop allows 8)")
    ap.add_argument("--per-k", type=int, default=16, help="test chains for each number of calls")
    ap.add_argument("--train", type=int, default=8000, help="training chains, spread over 1..max-calls calls")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--vocab-size", type=int, default=320)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--timed", type=int, nargs="+", default=[4, 8], help="numbers of calls to time")
    ap.add_argument("--timed-episodes", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retrain", action="store_true", help="ignore the cached checkpoint")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 150 steps, 1 to 3 calls: about 30 s")
    ap.add_argument("--out", default=str(RESULTS / "05_cache.json"))
    args = ap.parse_args()
    if args.quick:
        args.max_calls, args.per_k, args.train, args.steps, args.seq_len = 3, 4, 600, 150, 128
        args.timed, args.timed_episodes, args.repeats = [3], 8, 1
    args.ks = list(range(1, args.max_calls + 1))
    t_start = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)

    params, cfg, tok = get_model(args)
    result_id = tok.special(FMT.result)
    test = chains(args.per_k, args.ks, args.seed + 1)        # another seed: chains it has not seen
    prompts = [p for _, p, _, _ in test]
    cached, _ = loop(params, cfg, tok, prompts, cache=True)
    uncached, _ = loop(params, cfg, tok, prompts, cache=False)
    same = all(np.array_equal(a.tokens, b.tokens) for a, b in zip(cached, uncached))
    checked = all((a.positions, b.positions) == by_hand(a.tokens, a.authors, result_id)
                  for a, b in zip(cached, uncached))
    print(f"\n{len(test)} test chains; same tokens with and without the cache: {same}; "
          f"engine counts == counts by hand: {checked}")

    rows = []
    for n_calls in sorted({len(r.calls) for r in cached}):
        idx = [i for i, r in enumerate(cached) if len(r.calls) == n_calls]
        gold = [by_hand(*chat.render(t, tok), result_id) for k, _, _, t in test if k == n_calls]
        rows.append(dict(calls=n_calls, episodes=len(idx),
                         right=sum(cached[i].answer == test[i][2] and test[i][0] == n_calls for i in idx),
                         cache=float(np.mean([cached[i].positions for i in idx])),
                         no_cache=float(np.mean([uncached[i].positions for i in idx])),
                         gold_cache=float(np.mean([g[0] for g in gold])) if gold else None,
                         gold_no_cache=float(np.mean([g[1] for g in gold])) if gold else None))
    print("\npositions per episode, by the calls the model made (gold: the gold traces of that many calls)")
    print(f"{'calls':>5} {'episodes':>8} {'right':>5} {'with cache':>10} {'without':>8} {'ratio':>6}"
          f" {'gold with':>9} {'gold without':>12}")
    for r in rows:
        gold = f"{r['gold_cache']:>9.1f} {r['gold_no_cache']:>12.1f}" if r["gold_cache"] else f"{'-':>9} {'-':>12}"
        print(f"{r['calls']:>5} {r['episodes']:>8} {r['right']:>5} {r['cache']:>10.1f} {r['no_cache']:>8.1f} "
              f"{r['no_cache'] / r['cache']:>6.2f} {gold}")
    print(f"(the spec, 4 calls with its tokens: {SPEC_4_CALLS[0]} with the cache, {SPEC_4_CALLS[1]} without)")

    fit = {}
    x = np.array([r["calls"] for r in rows], float)
    if len(rows) >= 3:
        quad = np.polyfit(x, [r["no_cache"] for r in rows], 2)
        line = np.polyfit(x, [r["cache"] for r in rows], 1)
        res_q = np.array([r["no_cache"] for r in rows]) - np.polyval(quad, x)
        res_l = np.array([r["cache"] for r in rows]) - np.polyval(line, x)
        fit = dict(no_cache=quad.tolist(), no_cache_residuals=res_q.tolist(), cache=line.tolist(),
                   cache_residuals=res_l.tolist())
        print(f"\nwithout the cache: {quad[0]:.2f} k^2 + {quad[1]:.2f} k + {quad[2]:.2f}, residuals "
              + " ".join(f"{v:+.1f}" for v in res_q))
        print(f"with the cache:    {line[0]:.2f} k + {line[1]:.2f}, residuals " + " ".join(f"{v:+.1f}" for v in res_l))
    else:
        print("\n(fewer than 3 distinct call counts: no fit)")

    # Wall time of the whole loop on the same episodes: the median of `repeats` runs on a warm Batch.
    # warmup() compiles every prefill and decode shape, and one untimed run of the same episodes comes
    # first: the first run after compilation is still slower (up to 2x here).
    timings = []
    for k in args.timed:
        ps = [p for _, p, _, _ in chains(args.timed_episodes, [k], args.seed + 2)]
        row = dict(calls=k, episodes=len(ps))
        for cache in (True, False):
            _, batch = loop(params, cfg, tok, ps, cache)
            batch.warmup()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                recs, _ = loop(params, cfg, tok, ps, cache, batch=batch)
                times.append(time.perf_counter() - t0)
            name = "cache" if cache else "no_cache"
            row[name + "_s"] = float(np.median(times))
            row[name + "_positions"] = sum(r.positions for r in recs)
            row["calls_made"] = float(np.mean([len(r.calls) for r in recs]))
        timings.append(row)
    print(f"\nwall time of agent.run, greedy, 64 slots, median of {args.repeats} warm runs")
    print(f"{'calls':>5} {'episodes':>8} {'calls made':>10} {'with cache':>10} {'without':>8} {'ratio':>6}")
    for r in timings:
        print(f"{r['calls']:>5} {r['episodes']:>8} {r['calls_made']:>10.2f} {r['cache_s']:>9.2f}s "
              f"{r['no_cache_s']:>7.2f}s {r['no_cache_s'] / r['cache_s']:>6.2f}")

    elapsed = time.perf_counter() - t_start
    print(f"\n{elapsed:.0f} s in all")
    out = pathlib.Path(args.out)
    results = dict(quick=args.quick, steps=args.steps, params=model.n_params(params), same_tokens=same,
                   engine_matches_by_hand=checked, spec_4_calls=SPEC_4_CALLS, rows=rows, fit=fit,
                   timings=timings, seconds=round(elapsed, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"-> {out}")
    plot(rows, fit, out.with_suffix(".png"))


def plot(rows, fit, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no figure: matplotlib is not installed)")
        return
    x = [r["calls"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(x, [r["no_cache"] for r in rows], "o", label="without the cache")
    ax.plot(x, [r["cache"] for r in rows], "s", label="with the cache")
    if fit:
        xs = np.linspace(min(x), max(x), 100)
        ax.plot(xs, np.polyval(fit["no_cache"], xs), "-", lw=1, label="quadratic fit")
        ax.plot(xs, np.polyval(fit["cache"], xs), "--", lw=1, label="linear fit")
    ax.set_xlabel("calls in the episode")
    ax.set_ylabel("positions through the model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
