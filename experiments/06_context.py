"""06: keeping long agent turns inside the context window (SPEC part 2).

The missions (minagent/reading.py): "Which of chapters 1 to 20 mention a lighthouse?", one `read N`
call per chapter of a seeded book (minagent/book.py), a short note after each read ("chapter 3 of 20:
yes. so far: 3"), and in the last note the answer ("chapter 20 of 20: no. answer: 3 8 17"). One long
turn, like a sub-agent's: its brief, then rounds.

(a) The spec's sub-agent test, at the level of histories: 8 sub-agents, each asked to read 20 chapters
    with a budget of about four chapters (estimated tokens, context.estimate_counter). The model is
    scripted (reading.reader: it writes what the gold trace would, looking only at the view it is
    sent). Old trimming (context.old_trim: cuts only where a user message starts) has nowhere to cut
    in a single turn and refuses all 8; the three-step fit (context.fit) refuses none, and all 8 answer
    right: the notes carry what the cleared results held.
(b) What clearing in groups costs a prefix cache: scripted episodes of 30 chapters pushed through a
    Batch (a tiny random model: only the counts matter) with Batch.rewrite, which keeps the cache of
    the longest common prefix of the old and new views. Results cleared 1, 2, 4 or 8 at a time
    (context.fit's `group`): positions pushed through the model (the engine's count, checked by
    hand), requests whose start changed, tokens sent. Without a cache every request is read whole.
(c) A small model (3 layers, d_model 128) trained from scratch on the views the model really sees
    (reading.examples: views fitted to a budget of 160 tokens, with cleared results and dropped
    rounds; 3,000 missions of 3-12 chapters of 6 sentences, 2,000 steps of 16 x 192 tokens) reads
    missions of 8-12 chapters (609-974 tokens whole) in the agent loop: with fitting="fit", with
    fitting="old", without fitting at a max_len of about the budget, and without fitting with room.
    Three choices made it learnable; without them it wrote right notes and wrong lists (0 / 32): a
    GPT-2 pre-tokenizer, so that each chapter number " 14" is one piece (with digits split, 400 steps
    at budget 384: 0 / 32); notes that name the last chapter ("of 12"), so that the decision to stop
    compares two numbers side by side; and missions within chapters 1-24, fewer numbers to tell apart
    (with 1-40 and 1,200 steps: 0 / 32, the lists copied with neighbours swapped in, "16" for "15").

Found (seed 0, experiments/results/06_context.json):
    (a) old trimming: 8 / 8 refused (after 4.9 chapters); three-step fit: 0 refused, 8 / 8 right.
    (b) budget 2048: positions 208,564 / 160,021 / 91,084 / 63,373 clearing 1 / 2 / 4 / 8 at a time
        (357,111 without a cache, group 4); budget 1024, where dropping whole rounds (step 3) changes
        the start of most requests anyway: 155,527 / 136,443 / 120,143 / 119,628.
    (c) fit: 23 / 32 right, all 32 done, every yes/no note right (308 / 308); the 9 wrong: a number
        dropped or changed while copying the list (5), or the answer written a chapter or more early
        (4). old: 32 / 32 refused. No fitting, max_len 240: 32 / 32 "max_len". No fitting with room
        (max_len 1536): 3 / 32 right (it never trained on a view longer than 181 tokens).

Run:
    python experiments/06_context.py            # CPU (2 cores): ~10 min the first time (9.7 min training
                                                # at ~10,000 tokens/s on quiet cores; twice that with another
                                                # job running), 35 s once the model is cached
    python experiments/06_context.py --quick    # CPU: ~30 s, smaller everything, a model trained 20 steps
No GPU needed (not run on one). The model of (c) is cached (git-ignored) in
experiments/results/06_context.ckpt; --retrain ignores it. Writes experiments/results/06_context.json.
"""

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from minagent import agent, book, chat, context, model, reading, train  # noqa: E402
from minagent import tokenizer as tk  # noqa: E402
from minagent.batch import Batch  # noqa: E402
from minagent.tools import Toolbox  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
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
    p.add_argument("--out", default=str(RESULTS / "06_context.json"))
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
    (With digits split, a 3-layer model trained 400 steps wrote no right answer: 0 / 32.)
    """
    text = "\n".join(context.render_message(m, FMT).text for r in rs for m in r.history)
    notes = "\n".join([context.render_message(m, FMT).text for m in (context.CLEARED, context.NOTE)] * 50)
    tok = tk.train(text + "\n" + notes, vocab_size, pattern=tk.GPT2_PATTERN, specials=tk.MINAGENT_SPECIALS)
    split = [n for n in range(1, within + 1) if len(tok.encode(f" {n}")) > 1]
    if split:
        print(f"(chapter numbers split in more than one piece: {split})")
    return tok


# ---------------------------------------------------------------- (a) 8 sub-agents, one long turn each

def part_a(args):
    count = context.estimate_counter()
    subs = [reading.mission(seed=args.seed + 100 + i, first=1, last=args.chapters) for i in range(args.subagents)]
    whole = [sum(map(count, r.history)) for r in subs]
    rows = []
    for name, fitting in (("old trimming", context.old_trim), ("three-step fit", context.fit)):
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
    for view, i in reading.views(r.history, budget, count, lambda h, b, c: context.fit(h, b, c, group=group)):
        out.append(chat.render(context.render_view(view + (r.history[i],), FMT), tok)[0].tolist())
    return out


def through_batch(reqs_per_episode, params, cfg, max_len):
    """Push each episode's requests through a Batch, as the agent loop would -> (positions, kept by hand).

    The model's message is forced (the last request's tokens end with it): rewrite() keeps the cache of
    the longest common prefix with the last request and pushes the rest; one decode step pushes the last
    token and samples one more, which the next rewrite replaces.
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
                batch.rewrite(seq, new, 1)
        batch.step()
    return batch.total_positions, sum(by_hand), batch.total_reprefilled


def part_b(args, tok):
    count = context.exact_counter(tok, FMT)
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
          f"pushed through a Batch with rewrite(); positions summed over the episodes")
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
    """(params, cfg, tok, info): from the cached checkpoint if its recipe matches, else trained now."""
    ckpt = RESULTS / "06_context.ckpt"
    if not args.quick and ckpt.exists() and not args.retrain:
        c = train.load_checkpoint(ckpt)
        if c["extra"]["recipe"] == recipe(args):
            print(f"model from {ckpt.relative_to(ROOT)}")
            return c["params"], c["cfg"], c["tokenizer"], c["extra"]
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
    if not args.quick:
        train.save_checkpoint(ckpt, params, None, cfg, tcfg, args.steps, tokenizer=tok, extra=info)
    return params, cfg, tok, info


def notes_right(record, r):
    """(right, written): the model's notes "chapter K of B: yes|no" against the book."""
    said = [m.text for m in record.history if m.kind == "model"]
    found = [re.match(r"chapter (\d+) of \d+: (yes|no)\.", t) for t in said]
    marks = [(int(f.group(1)), f.group(2) == "yes") for f in found if f]
    right = sum(1 <= n <= book.N_CHAPTERS and yes == (r.motif in book.motifs(r.seed, n)) for n, yes in marks)
    return right, len(marks)


def part_c(args, params, cfg, tok):
    rs = reading.generate(args.test, seed=args.seed + 2, lengths=tuple(args.test_lengths), sentences=args.sentences,
                          within=args.within)
    count = context.exact_counter(tok, FMT)
    whole = [sum(map(count, r.history)) for r in rs]
    room = args.budget_c + 2 * agent.MAX_STRETCH          # a view within the budget and a stretch after it
    conditions = (("fit", dict(budget=args.budget_c, fitting="fit", max_len=room)),
                  ("old", dict(budget=args.budget_c, fitting="old", max_len=room)),
                  ("none", dict(budget=None, max_len=room)),
                  ("none, room for all", dict(budget=None, max_len=-(-max(whole) // 256) * 256 + 512)))
    rows = []
    for name, kw in conditions:
        boxes = [Toolbox(r.seed, tools=["read"], sentences=args.sentences) for r in rs]
        t0 = time.perf_counter()
        recs, _ = agent.run(params, cfg, tok, FMT, [r.question for r in rs], boxes, slots=len(rs),
                            max_calls=book.N_CHAPTERS + 2, **kw)
        notes = [notes_right(rec, r) for rec, r in zip(recs, rs)]
        steps = collections.Counter(s for rec in recs for s in rec.view_steps)
        rows.append(dict(condition=name, budget=kw["budget"], max_len=kw["max_len"], n=len(rs),
                         right=sum(reading.answer_of(rec.answer) == r.answer for rec, r in zip(recs, rs)),
                         statuses=dict(collections.Counter(rec.status for rec in recs)),
                         calls=float(np.mean([len(rec.calls) for rec in recs])),
                         chapters=float(np.mean([r.last - r.first + 1 for r in rs])),
                         notes_right=sum(a for a, _ in notes), notes=sum(b for _, b in notes),
                         positions=float(np.mean([rec.positions for rec in recs])),
                         refills=float(np.mean([rec.refills for rec in recs])),
                         steps={int(k): v for k, v in sorted(steps.items())},
                         seconds=round(time.perf_counter() - t0, 1),
                         example=chat.show(recs[0].tokens, recs[0].authors, tok, color=False)))
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

def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = dict(quick=args.quick, seed=args.seed)
    results["a"] = part_a(args)
    params, cfg, tok, info = get_model(args)
    results["b"] = part_b(args, tok)
    results["c"] = dict(model=dict(info, cfg=dataclasses.asdict(cfg), params=model.n_params(params)),
                        **part_c(args, params, cfg, tok))
    results["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\n{results['seconds']:.0f} s in all")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
