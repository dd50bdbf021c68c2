"""06: keeping long agent turns inside the context window (docs/applications.md, "Context").

The missions (minagent/tasks/context/reading.py) ask which of chapters A to B of a seeded book mention
a motif: one `read N` call and a short note per chapter, the answer in the last note; one long turn.
(a) 8 scripted sub-agents read 20 chapters each within a budget of about four: old trimming
    (fit.old_trim) against the three-step fit (fit.fit), which clears old results.
(b) What clearing results 1, 2, 4 or 8 at a time costs a prefix cache: scripted episodes of 30
    chapters pushed through a Batch (send() keeps the cache of the common start of two views):
    positions pushed, the engine's count checked by hand, against the same without a cache.
(c) A small model (3 layers, d_model 128) trained on fitted views of short missions reads longer
    ones in the agent loop: with fit, with old trimming, without fitting, and without with room.

    python experiments/06_context.py           # ~10-16 min the first time (training (c)), ~35 s cached
    python experiments/06_context.py --quick   # ~30 s: everything smaller, a model trained 20 steps
Times on 2 CPU cores; not run on a GPU. The model of (c) is cached (git-ignored) in results/06_context-*.ckpt;
--retrain ignores it. Writes experiments/results/06_context.json and, with matplotlib, 06_context.png.
"""

import argparse
import collections
import dataclasses
import functools
import re
import time

import jax
import numpy as np

import common
from minagent import agent, chat, model, train
from minagent import tokenizer as tk
from minagent.batch import Batch
from minagent.tasks.context import book, counting, fit, reading
from minagent.tasks.show import show

FMT = chat.MINAGENT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    # (a)
    p.add_argument("--subagents", type=int, default=8)
    p.add_argument("--chapters", type=int, default=20, help="(a) chapters each sub-agent reads")
    p.add_argument("--budget-a", type=int, default=600, help="(a) estimated tokens: about four chapters")
    # (b)
    p.add_argument("--episodes-b", type=int, default=8)
    p.add_argument("--chapters-b", type=int, default=30)
    p.add_argument("--budgets-b", type=int, nargs="+", default=[2048, 1024], help="(b) budgets, in tokens")
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    # (c)
    p.add_argument("--sentences", type=int, default=6, help="(c) sentences a chapter: ~65 tokens")
    p.add_argument("--budget-c", type=int, default=160)
    p.add_argument("--train", type=int, default=3000, help="(c) training missions")
    p.add_argument("--lengths", type=int, nargs=2, default=[3, 12], help="(c) chapters per training mission")
    p.add_argument("--within", type=int, default=24, help="(c) missions read within chapters 1 to this")
    p.add_argument("--test", type=int, default=32, help="(c) test missions")
    p.add_argument("--test-lengths", type=int, nargs=2, default=[8, 12])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=768)
    p.add_argument("--retrain", action="store_true", help="(c) ignore the cached checkpoint")
    p.add_argument("--quick", action="store_true", help="a smoke test: everything smaller, ~30 s")
    p.add_argument("--out", default=None, help="the JSON file (default experiments/results/06_context.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.subagents, args.episodes_b, args.chapters_b, args.budgets_b, args.groups = 3, 2, 14, [700], [1, 4]
        args.train, args.test, args.steps, args.test_lengths = 40, 3, 20, [5, 7]
    return args


def book_tokenizer(rs, vocab_size, within):
    """A BPE trained on reading missions as the model sees them: chapters, notes, calls, and the notes of fit.

    The GPT-2 pre-tokenizer, not "smollm": chapter numbers are at most 40 and frequent, so with
    768 pieces each " 14" is one piece. Then the next call ("read 15" after "read 14") is a
    lookup, and "was that the last chapter?" compares one piece with one piece of the question.
    """
    text = "\n".join(chat.render_message(m, FMT).text for r in rs for m in r.history)
    notes = "\n".join([chat.render_message(m, FMT).text for m in (fit.CLEARED, fit.NOTE)] * 50)
    tok = tk.train(text + "\n" + notes, vocab_size, pattern=tk.GPT2_PATTERN, specials=tk.MINAGENT_SPECIALS)
    split = [n for n in range(1, within + 1) if len(tok.encode(f" {n}")) > 1]
    if split:
        print(f"(chapter numbers split in more than one piece: {split})")
    return tok


# ---------------------------------------------------------------- (a) 8 sub-agents, one long turn each

def part_a(args):
    count = counting.estimate_counter()
    subs = [reading.mission(seed=args.seed + 100 + i, first=1, last=args.chapters) for i in range(args.subagents)]
    whole = [sum(map(count, r.history)) for r in subs]
    rows = []
    for name, fitting in (("old trimming", fit.old_trim), ("three-step fit", fit.fit)):
        outs = [reading.scripted(r, args.budget_a, count, fitting) for r in subs]
        steps = collections.Counter(s for o in outs for s in o["steps"])
        rows.append(dict(fitting=name, n=len(subs),
                         refused=sum(o["status"] == "refused" for o in outs),
                         finished=sum(o["status"] == "done" for o in outs),
                         right=sum(o["answer"] == r.answer for o, r in zip(outs, subs)),
                         chapters_read=float(np.mean([sum(m.kind == "result" for m in o["history"]) for o in outs])),
                         requests=sum(len(o["sent"]) for o in outs),
                         largest_request=max(max(o["sent"]) for o in outs),
                         refused_at=[o.get("refused_at") for o in outs if o["status"] == "refused"],
                         steps={int(k): v for k, v in sorted(steps.items())}))
    print(f"\n(a) {args.subagents} sub-agents, each reading {args.chapters} chapters (whole history "
          f"{min(whole)}-{max(whole)} estimated tokens) with a budget of {args.budget_a}")
    print(f"{'fitting':<15} {'refused':>7} {'finished':>8} {'right':>5} {'chapters read':>13} {'requests':>8} "
          f"{'largest':>7}  fit steps used")
    for r in rows:
        print(f"{r['fitting']:<15} {r['refused']:>7} {r['finished']:>8} {r['right']:>5} {r['chapters_read']:>13.1f} "
              f"{r['requests']:>8} {r['largest_request']:>7}  {r['steps']}")
    return dict(budget=args.budget_a, chapters=args.chapters, whole_history=whole, rows=rows)


# ---------------------------------------------------------------- (b) clearing in groups vs the prefix cache

def requests(r, budget, count, group, tok):
    """The token lists the model reads, one per model message: the fitted view and the message."""
    out = []
    for view, i in reading.views(r.history, budget, count, functools.partial(fit.fit, group=group)):
        out.append(chat.render(fit.render_view(view + (r.history[i],), FMT), tok)[0].tolist())
    return out


def through_batch(reqs_per_episode, params, cfg, max_len):
    """Push each episode's requests through a Batch, as the agent loop would -> (positions, kept by hand).

    The model's message is forced (the last request's tokens end with it): send() keeps the cache of
    the longest common prefix with the last request and pushes the rest; one decode step pushes the last
    token and samples one more, which the next send replaces.
    """
    batch = Batch(params, cfg, slots=len(reqs_per_episode), n_pages=len(reqs_per_episode) * (max_len // 16 + 2),
                  page_size=16, max_len=max_len)
    seqs = [batch.add(reqs[0], 1) for reqs in reqs_per_episode]
    batch.step()
    by_hand = [len(reqs[0]) for reqs in reqs_per_episode]
    for k in range(1, max(map(len, reqs_per_episode))):
        for e, (seq, reqs) in enumerate(zip(seqs, reqs_per_episode)):
            if k < len(reqs):
                old, new = reqs[k - 1], reqs[k]
                keep = next((j for j, (a, b) in enumerate(zip(old, new[:-1])) if a != b), min(len(old), len(new) - 1))
                by_hand[e] += len(new) - keep
                batch.send(seq, new, 1)
        batch.step()
    seqs = batch.seqs.values()
    return sum(s.positions for s in seqs), sum(by_hand), sum(s.refilled for s in seqs)


def part_b(args, tok):
    count = counting.exact_counter(tok, FMT)
    eps = [reading.mission(seed=args.seed + 200 + i, first=1 + i % (book.N_CHAPTERS - args.chapters_b + 1),
                           last=i % (book.N_CHAPTERS - args.chapters_b + 1) + args.chapters_b)
           for i in range(args.episodes_b)]
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    params = model.init(jax.random.PRNGKey(0), cfg)
    whole = int(np.mean([sum(map(count, r.history)) for r in eps]))
    rows = []
    for budget in args.budgets_b:
        for group in args.groups:
            reqs = [requests(r, budget, count, group, tok) for r in eps]
            changed = sum(sum(1 for a, b in zip(q, q[1:]) if b[:len(a)] != a) for q in reqs)
            positions, by_hand, rewritten = through_batch(reqs, params, cfg, max_len=budget + 128)
            rows.append(dict(budget=budget, group=group, episodes=len(eps), requests=sum(map(len, reqs)),
                             changed_start=changed, positions=positions, by_hand=by_hand,
                             rewritten=rewritten, no_cache=sum(len(x) for q in reqs for x in q),
                             sent_mean=float(np.mean([len(x) for q in reqs for x in q]))))
            print(f"  budget {budget}, group {group}: {positions} positions", flush=True)
    print(f"\n(b) {len(eps)} scripted episodes of {args.chapters_b} chapters ({whole} tokens each, whole), "
          f"pushed through a Batch with send(); positions summed over the episodes")
    print(f"{'budget':>6} {'group':>5} {'requests':>8} {'start changed':>13} {'positions':>9} {'by hand':>8} "
          f"{'no cache':>8} {'mean request':>12}")
    for r in rows:
        print(f"{r['budget']:>6} {r['group']:>5} {r['requests']:>8} {r['changed_start']:>13} {r['positions']:>9} "
              f"{r['by_hand']:>8} {r['no_cache']:>8} {r['sent_mean']:>12.0f}")
    return dict(whole_episode_tokens=whole, rows=rows)


# ---------------------------------------------------------------- (c) a small model that reads past its budget

def recipe(args):
    return dict(train=args.train, lengths=list(args.lengths), within=args.within, sentences=args.sentences,
                budget=args.budget_c, steps=args.steps, batch_size=args.batch_size, vocab_size=args.vocab_size,
                seed=args.seed, arch=arch(args))


def arch(args):
    return (dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128) if args.quick else
            dict(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=384))      # demo.SMALL


def get_model(args):
    """(params, cfg, tok, info): cached under its recipe, or trained now."""
    c = common.cached("06_context", recipe(args), functools.partial(train_model, args), retrain=args.retrain,
                      quick=args.quick)
    return c["params"], c["cfg"], c["tokenizer"], c["extra"]


def train_model(args, path):
    """Train the model of (c) and save it at path (if not None) -> dict(params, cfg, tokenizer, extra=info)."""
    t0 = time.perf_counter()
    rs = reading.generate(args.train, seed=args.seed + 1, lengths=tuple(args.lengths), sentences=args.sentences,
                          within=args.within)
    tok = book_tokenizer(rs[:300], args.vocab_size, args.within)
    exs = [e for r in rs for e in reading.examples(r, tok, args.budget_c)]
    seq_len = -(-max(len(t) for t, _ in exs) // 32) * 32
    cfg = model.Config(vocab_size=tok.n_vocab, **arch(args))
    tcfg = train.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=seq_len, lr=3e-3,
                             warmup=min(50, args.steps // 5), seed=args.seed, log_every=25)
    params = model.init(jax.random.PRNGKey(args.seed), cfg)
    supervised = sum(int(a.sum()) for _, a in exs)
    print(f"\n(c) training {model.n_params(params):,} parameters: {len(rs)} missions -> {len(exs)} views "
          f"({sum(len(t) for t, _ in exs):,} tokens, {supervised:,} supervised), rows of {seq_len}, {args.steps} steps")
    params, history = train.train(params, cfg, exs, tcfg, progress=not args.quick)
    info = dict(recipe=recipe(args), views=len(exs), tokens=sum(len(t) for t, _ in exs), supervised=supervised,
                seq_len=seq_len, final_loss=history[-1]["loss"], train_minutes=(time.perf_counter() - t0) / 60)
    if path:
        train.save_checkpoint(path, params, None, cfg, tcfg, args.steps, tokenizer=tok, extra=info)
    return dict(params=params, cfg=cfg, tokenizer=tok, extra=info)


def notes_right(record, r):
    """(right, written): the model's notes "chapter K of B: yes|no" against the book."""
    said = [m.text for m in record.history if m.kind == "model"]
    found = [re.match(r"chapter (\d+) of \d+: (yes|no)\.", t) for t in said]
    marks = [(int(f.group(1)), f.group(2) == "yes") for f in found if f]
    right = sum(1 <= n <= book.N_CHAPTERS and yes == (r.motif in book.motifs(r.seed, n)) for n, yes in marks)
    return right, len(marks)


def tallied(fitting, steps):
    """fitting, counting the step of each Fit it returns in `steps` (a Counter)."""
    def counted(history, budget, count):
        f = fitting(history, budget, count)
        steps[f.step] += 1
        return f
    return counted


def part_c(args, params, cfg, tok):
    rs = reading.generate(args.test, seed=args.seed + 2, lengths=tuple(args.test_lengths), sentences=args.sentences,
                          within=args.within)
    count = counting.exact_counter(tok, FMT)
    whole = [sum(map(count, r.history)) for r in rs]
    room = args.budget_c + 2 * agent.MAX_STRETCH          # a view within the budget and a stretch after it
    conditions = (("fit", args.budget_c, fit.fit, room),                   # name, budget, fitting, max_len
                  ("old", args.budget_c, fit.old_trim, room),
                  ("none", None, None, room),
                  ("none, room for all", None, None, -(-max(whole) // 256) * 256 + 512))
    rows = []
    for name, budget, fitting, max_len in conditions:
        steps = collections.Counter()           # each fit's step (fit.REFUSED: -1), over every episode
        view = agent.whole if budget is None else functools.partial(
            fit.fitted_view, budget=budget, fitting=tallied(fitting, steps))
        boxes = [book.toolbox(r.seed, args.sentences) for r in rs]
        t0 = time.perf_counter()
        batch = agent.new_batch(params, cfg, tok, FMT, slots=len(rs), max_len=max_len)
        recs = agent.run(batch, tok, FMT, [r.question for r in rs], boxes, view=view, max_calls=book.N_CHAPTERS + 2)
        notes = [notes_right(rec, r) for rec, r in zip(recs, rs)]
        rows.append(dict(condition=name, budget=budget, max_len=max_len, n=len(rs),
                         right=sum(reading.answer_of(rec.answer) == r.answer for rec, r in zip(recs, rs)),
                         statuses=dict(collections.Counter(rec.status for rec in recs)),
                         calls=float(np.mean([len(rec.calls) for rec in recs])),
                         chapters=float(np.mean([r.last - r.first + 1 for r in rs])),
                         notes_right=sum(a for a, _ in notes), notes=sum(b for _, b in notes),
                         positions=float(np.mean([rec.positions for rec in recs])),
                         refills=float(np.mean([rec.refills for rec in recs])),
                         steps={int(k): v for k, v in sorted(steps.items())},
                         seconds=round(time.perf_counter() - t0, 1),
                         example=show(recs[0].tokens, recs[0].authors, tok, color=False)))
    print(f"\n(c) {len(rs)} test missions of {args.test_lengths[0]}-{args.test_lengths[1]} chapters "
          f"(whole: {min(whole)}-{max(whole)} tokens), budget {args.budget_c}, greedy")
    print(f"{'condition':<19} {'max_len':>7} {'right':>5} {'statuses':<28} {'calls':>5} {'notes right':>11} "
          f"{'positions':>9} {'refills':>7}  fit steps")
    for r in rows:
        st = ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items()))
        print(f"{r['condition']:<19} {r['max_len']:>7} {r['right']:>2}/{r['n']:<2} {st:<28} {r['calls']:>5.1f} "
              f"{r['notes_right']:>5}/{r['notes']:<5} {r['positions']:>9.0f} {r['refills']:>7.0f}  {r['steps']}")
    return dict(whole_tokens=whole, rows=rows)


# ---------------------------------------------------------------- main

def plot_groups(plt, b):
    """(b): positions through the model against the clearing group, one line per budget."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, budget in enumerate(sorted({r["budget"] for r in b["rows"]}, reverse=True)):
        rows = sorted((r for r in b["rows"] if r["budget"] == budget), key=lambda r: r["group"])
        groups = [r["group"] for r in rows]
        ax.plot(groups, [r["positions"] for r in rows], "o-", color=f"C{i}", label=f"budget {budget}")
        ax.plot(groups, [r["no_cache"] for r in rows], ":", color=f"C{i}", label=f"budget {budget}, no cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["group"] for r in b["rows"]}), [str(g) for g in sorted({r["group"] for r in b["rows"]})])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("results cleared at a time (group)")
    ax.set_ylabel("positions through the model")
    ax.legend(fontsize=8)
    return fig



def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    results = dict(quick=args.quick, seed=args.seed)
    results["a"] = part_a(args)
    params, cfg, tok, info = get_model(args)
    results["b"] = part_b(args, tok)
    results["c"] = dict(model=dict(info, cfg=dataclasses.asdict(cfg), params=model.n_params(params)),
                        **part_c(args, params, cfg, tok))
    results["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\n{results['seconds']:.0f} s in all")
    out = common.out_path("06_context", args.out, args.quick)
    common.write_json(out, results)
    common.save_figure(lambda plt: plot_groups(plt, results["b"]), out.with_suffix(".png"))


if __name__ == "__main__":
    main()
