"""05: what the KV cache saves, counted by the engine itself.

Without a cache each resume re-reads the whole episode from the start, so the positions pushed
through the model grow as the square of the number of calls (docs/engine.md, "What the cache saves"). The missions: chains
of additions with exactly k calls, k = 1..8 ("Add up 12, 7 and 30.": add 12 7, then add 19 30). A
small model (3 layers, d_model 128) trained from scratch on such chains (1,600 steps, peak rate
2e-3: the 800 steps at 3e-3 of earlier runs gave models that answered 107, then 6, of 128 chains,
as float rounding moved the run; experiments/LOG.md) runs new ones through the agent loop with
and without the cache. Greedy, so both write the same tokens (checked), and the
engine's counts (Record.positions) are checked against counts by hand from the tokens alone:
with the cache T - 1, without it the sum of the stretch ends. Then the loop's wall time with and
without the cache on 64 episodes of 4 and of 8 calls (on shared cores these vary by 2-4x).

    python experiments/05_cache.py           # ~25 min the first time on idle cores (training), ~2 min cached
    python experiments/05_cache.py --quick   # ~30 s: a 2-layer model trained 150 steps, 1 to 3 calls
Times on 2 CPU cores; not run on a GPU. The model is cached (git-ignored) in experiments/results/05_cache-*.ckpt;
--retrain ignores it. Writes experiments/results/05_cache.json and, with matplotlib, 05_cache.png.
"""

import argparse
import random
import time

import jax
import numpy as np

import common
from minagent import agent, chat, model, train
from minagent import tokenizer as tk
from minagent.tasks.calculator import demo
from minagent.tools import Toolbox

FMT = chat.MINAGENT
DESIGN_4_CALLS = (57, 215)   # positions with and without the cache, the first design document's 4-call mission


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
    """The chain-trained model -> (params, cfg, tok): cached under its recipe, or trained now."""
    arch = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128) if args.quick else demo.SMALL
    recipe = dict(steps=args.steps, train=args.train, seed=args.seed, ks=args.ks, vocab_size=args.vocab_size,
                  seq_len=args.seq_len, arch=arch, lr=args.lr)

    def train_fn(path):
        data = chains(args.train // len(args.ks), args.ks, args.seed)
        tok = tk.train("\n".join(chat.text(t) for *_, t in data[::4]), args.vocab_size,
                       pattern=tk.SMOLLM_PATTERN, specials=tk.MINAGENT_SPECIALS)
        cfg = model.Config(vocab_size=tok.n_vocab, **arch)
        exs = [chat.render(t, tok) for *_, t in data]
        tcfg = train.TrainConfig(steps=args.steps, batch_size=32, seq_len=args.seq_len, lr=args.lr,
                                 warmup=min(100, args.steps // 5), seed=args.seed, log_every=25)
        params = model.init(jax.random.PRNGKey(args.seed), cfg)
        print(f"training {model.n_params(params):,} parameters on {len(exs)} chains for {args.steps} steps")
        params, _ = train.train(params, cfg, exs, tcfg, progress=not args.quick)
        if path:
            train.save_checkpoint(path, params, None, cfg, tcfg, args.steps, tokenizer=tok, extra=recipe)
        return dict(params=params, cfg=cfg, tokenizer=tok)

    c = common.cached("05_cache", recipe, train_fn, retrain=args.retrain, quick=args.quick)
    return c["params"], c["cfg"], c["tokenizer"]


def new_batch(params, cfg, tok, reuse_cache):
    # max_len: room for 8 stretches of 40 tokens and 8 results, whatever the model writes (an episode
    # that would not fit ends as "max_len"); pages are taken only as the episode grows.
    return agent.new_batch(params, cfg, tok, FMT, slots=64, max_len=1024, reuse_cache=reuse_cache)


def loop(batch, tok, prompts):
    return agent.run(batch, tok, FMT, prompts, [Toolbox(0) for _ in prompts])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-calls", type=int, default=8, help="chains of 1 to this many calls (the loop allows 8)")
    ap.add_argument("--per-k", type=int, default=16, help="test chains for each number of calls")
    ap.add_argument("--train", type=int, default=8000, help="training chains, spread over 1..max-calls calls")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--lr", type=float, default=2e-3, help="the peak learning rate")
    ap.add_argument("--vocab-size", type=int, default=320)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--timed", type=int, nargs="+", default=[4, 8], help="numbers of calls to time")
    ap.add_argument("--timed-episodes", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retrain", action="store_true", help="ignore the cached checkpoint")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 150 steps, 1 to 3 calls: about 30 s")
    ap.add_argument("--out", default=None, help="the JSON file (default experiments/results/05_cache.json)")
    args = ap.parse_args()
    if args.quick:
        args.max_calls, args.per_k, args.train, args.steps, args.seq_len = 3, 4, 600, 150, 128
        args.timed, args.timed_episodes, args.repeats = [3], 8, 1
    args.ks = list(range(1, args.max_calls + 1))
    t_start = time.perf_counter()

    params, cfg, tok = get_model(args)
    result_id = tok.special(FMT.result)
    test = chains(args.per_k, args.ks, args.seed + 1)        # another seed: chains it has not seen
    prompts = [p for _, p, _, _ in test]
    cached = loop(new_batch(params, cfg, tok, reuse_cache=True), tok, prompts)
    uncached = loop(new_batch(params, cfg, tok, reuse_cache=False), tok, prompts)
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
    print(f"(the first design document, 4 calls with its tokens: {DESIGN_4_CALLS[0]} with the cache, "
          f"{DESIGN_4_CALLS[1]} without)")

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
    # first: the first run after compilation is still slower.
    timings = []
    for k in args.timed:
        ps = [p for _, p, _, _ in chains(args.timed_episodes, [k], args.seed + 2)]
        row = dict(calls=k, episodes=len(ps))
        for cache in (True, False):
            batch = new_batch(params, cfg, tok, cache)
            loop(batch, tok, ps)
            batch.warmup()
            times = []
            for _ in range(args.repeats):
                recs, seconds = common.timed(loop, batch, tok, ps)
                times.append(seconds)
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
    out = common.out_path("05_cache", args.out, args.quick)
    results = dict(quick=args.quick, steps=args.steps, params=model.n_params(params), same_tokens=same,
                   engine_matches_by_hand=checked, design_4_calls=DESIGN_4_CALLS, rows=rows, fit=fit,
                   timings=timings, seconds=round(elapsed, 1))
    common.write_json(out, results)
    common.save_figure(lambda plt: plot(plt, rows, fit), out.with_suffix(".png"))


def plot(plt, rows, fit):
    """Positions through the model per episode, by the calls it made: with and without the cache."""
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
    return fig


if __name__ == "__main__":
    main()
