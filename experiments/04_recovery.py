"""04: error recovery and an unseen tool, measured on the small tool-using model of experiments/03.

A malformed call does not crash an episode: the tool answers a short `error: ...` that the model
reads like any result (docs/engine.md, "The agent loop"). On fresh missions, in the training phrasings and in held-out
ones, this counts: (1) transient failures: with Toolbox(fail_first=True) the first call answers
"error: tool busy, try again"; does the model call again, and still answer right? (2) malformed
calls: the program writes a question, a malformed call and its error; does the model go on with a
well-formed call and the right answer? And how often did the model itself write a call that got an
error, and recover? (3) `mul`, never in training, described in a system line: is it used? (4) calls
per episode and budget exhaustions. Every count is {k, n, rate}: k episodes of the n it applies to.
The model: 03's checkpoint (`03_calculator.py --only small`); if missing, trained here, not saved.

    python experiments/04_recovery.py            # 500 missions per split and measure: ~30 s (+3 min to train)
    python experiments/04_recovery.py --quick    # a tiny model trained here: 10-20 s
Times on 2 CPU cores shared with other jobs; not run on a GPU. Writes experiments/results/04_recovery.json
and, with matplotlib, 04_recovery.png: right answers per condition, training vs held-out phrasings.
"""

import argparse
import collections
import dataclasses
import pathlib
import time

import jax
import numpy as np

import common
from minagent import agent, chat, model, train
from minagent.tasks.calculator import demo, missions
from minagent.tasks.show import show
from minagent.tools import BUSY, Toolbox

SPLITS = {"train": "training phrasings", "test": "held-out phrasings"}
QUESTIONS = missions.SINGLE + missions.MULTI      # the families a retry or fix mission is built on
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)   # --quick only
MAX_LEN = 1024      # room for 8 calls of 40 tokens and their results: see experiments/03


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=500, help="missions per split, for each measure")
    p.add_argument("--ckpt", default=None, help="the small tool user (default: 03's checkpoint for --missions, "
                   "--steps and --seed); trained here if missing")
    p.add_argument("--missions", type=int, default=20000, help="training missions, if training here")
    p.add_argument("--steps", type=int, default=500, help="training steps, if training here")
    p.add_argument("--slots", type=int, default=64, help="episodes decoded together")
    p.add_argument("--examples", type=int, default=3, help="transcripts kept per measure and split")
    p.add_argument("--quick", action="store_true", help="a tiny model trained here, few missions: a smoke test")
    p.add_argument("--out", default=None, help="the JSON file (default experiments/results/04_recovery.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.missions, args.steps, args.n, args.slots, args.examples = 300, 20, 6, 16, 1
    args.ckpt = pathlib.Path(args.ckpt or common.small_checkpoint("tool", args.missions, args.steps, args.seed))
    return args


# ---------------------------------------------------------------- the model

def small_model(args):
    """-> params, cfg, tok, where they came from. experiments/03's checkpoint, or its recipe run here."""
    if not args.quick and args.ckpt.exists():
        c = train.load_checkpoint(args.ckpt)
        return c["params"], c["cfg"], c["tokenizer"], dict(checkpoint=common.in_repo(args.ckpt), step=c["step"],
                                                             tcfg=dataclasses.asdict(c["tcfg"]))
    print(f"no checkpoint at {common.in_repo(args.ckpt)}: training experiments/03's recipe ({args.steps} steps)"
          if not args.quick else f"--quick: a tiny model, {args.steps} steps on {args.missions} missions")
    train_ms = missions.generate(args.missions, seed=args.seed + 1, split="train", families=demo.FAMILIES)
    tok = demo.mission_tokenizer(train_ms)
    cfg = model.Config(vocab_size=tok.n_vocab, **(TINY if args.quick else demo.SMALL))
    tcfg = train.TrainConfig(steps=args.steps, batch_size=32, seq_len=128, lr=3e-3, warmup=min(50, args.steps),
                             seed=args.seed, log_every=25)
    params, _ = train.train(model.init(jax.random.PRNGKey(args.seed), cfg), cfg, demo.examples(train_ms, tok), tcfg)
    return params, cfg, tok, dict(checkpoint=None, step=args.steps, tcfg=dataclasses.asdict(tcfg))


class Runner:
    """agent.run over one Batch for the whole script: the decode steps compile once."""

    def __init__(self, params, cfg, tok, slots):
        self.batch = agent.new_batch(params, cfg, tok, demo.FMT, slots=slots, max_len=MAX_LEN)
        self.tok = tok
        self.all = []       # every record of the script, for the count of the model's own mistakes

    def __call__(self, prompts, boxes):
        records = agent.run(self.batch, self.tok, demo.FMT, prompts, boxes)
        self.all += records
        return records


def is_error(result):
    return result.startswith("error:")


def right(records, ms):
    return common.count(sum(r.answer == m.answer for r, m in zip(records, ms)), len(ms))


def budget(records):
    """Calls per episode and budget exhaustions."""
    statuses = collections.Counter(r.status for r in records)
    return dict(calls_per_episode=sum(len(r.calls) for r in records) / max(len(records), 1),
                stretch=common.count(statuses["stretch"], len(records)),
                calls=common.count(statuses["calls"], len(records)))


def own_mistakes(records, ms):
    """Episodes in which a call the model wrote got an error (BUSY is the toolbox's fault, not the model's)."""
    hit = [(r, m) for r, m in zip(records, ms) if any(is_error(res) and res != BUSY for _, res in r.calls)]

    def recovered(r):   # a call that worked after its first mistake
        first = next(i for i, (_, res) in enumerate(r.calls) if is_error(res) and res != BUSY)
        return any(not is_error(res) for _, res in r.calls[first + 1:])
    return dict(episodes=common.count(len(hit), len(records)),
                recovered=common.count(sum(recovered(r) for r, _ in hit), len(hit)),
                right=common.count(sum(r.answer == m.answer for r, m in hit), len(hit)),
                errors=dict(collections.Counter(_error_kind(res) for r, _ in hit for _, res in r.calls
                                                if is_error(res) and res != BUSY).most_common(8)))


def _error_kind(result):
    """"error: unknown person Zed" -> "unknown person": the message without the part that names the input."""
    kinds = ("unknown tool", "unknown person", "not a number", "number too long", "empty call")
    return next((k for k in kinds if result.startswith("error: " + k)), result.removeprefix("error: "))


def transcripts(records, tok, k):
    return [show(r.tokens, r.authors, tok, color=False) for r in records[:k]]


# ---------------------------------------------------------------- 1. transient failures

def transient(run, tok, args, split):
    ms = missions.generate(args.n, seed=args.seed + 5, split=split, families=QUESTIONS)
    prompts = [m.trace[0] for m in ms]
    plain = run(prompts, [Toolbox(m.seed) for m in ms])
    busy = run(prompts, [Toolbox(m.seed, fail_first=True) for m in ms])
    hit = [(r, m) for r, m in zip(busy, ms) if r.calls]              # its first call was answered BUSY
    again = [(r, m) for r, m in hit if len(r.calls) > 1]
    return dict(
        right_plain=right(plain, ms), right_fail_first=right(busy, ms),
        busy=common.count(len(hit), len(ms)),                                                # made a call at all
        called_again=common.count(len(again), len(hit)),
        same_call_again=common.count(sum(r.calls[1][0] == r.calls[0][0] for r, _ in again), len(hit)),
        right_after_busy=common.count(sum(r.answer == m.answer for r, m in hit), len(hit)),
        right_same_call=common.count(sum(r.answer == m.answer for r, m in again if r.calls[1][0] == r.calls[0][0]),
                             sum(r.calls[1][0] == r.calls[0][0] for r, _ in again)),
        busy_in_answer=common.count(sum("busy" in r.answer or "error" in r.answer for r, _ in hit), len(hit)),
        budget_plain=budget(plain), budget_fail_first=budget(busy), examples=transcripts(busy, tok, args.examples),
        _records=(plain + busy, ms + ms))


# ---------------------------------------------------------------- 2. malformed calls

def malformed(run, tok, args, split):
    """The prompt: a "fix" mission's first three segments, written by the program, as one Segment.

    [<|user|>Add 17 and 250.<|assistant|>][<|call|>add 17<|result|>][error: add takes two numbers<|assistant|>]
    then the model writes. The gold continuation is m.calls[1] ("add 17 250") and the answer.
    """
    ms = missions.generate(args.n, seed=args.seed + 6, split=split, families=("fix",))
    prompts = [chat.Segment(chat.PROGRAM, sum((s.parts for s in m.trace[:3]), ())) for m in ms]
    fixed = run(prompts, [Toolbox(m.seed) for m in ms])
    clean = run([m.trace[0] for m in ms], [Toolbox(m.seed) for m in ms])    # the same questions, no mistake
    called = [(r, m) for r, m in zip(fixed, ms) if r.calls]
    by_tool = collections.defaultdict(list)                  # by the malformed call's first word
    for r, m in zip(fixed, ms):
        by_tool[m.calls[0].split()[0] if m.calls[0].split() else ""].append(r.answer == m.answer)
    return dict(
        right_without_mistake=right(clean, ms), right=right(fixed, ms),
        called_after_error=common.count(len(called), len(ms)),
        first_call_ok=common.count(sum(not is_error(r.calls[0][1]) for r, _ in called), len(ms)),
        first_call_gold=common.count(sum(r.calls[0][0] == m.calls[1] for r, m in called), len(ms)),
        repeated_mistake=common.count(sum(r.calls[0][0] == m.calls[0] for r, m in called), len(ms)),
        right_by_mistaken_tool={t: common.count(sum(v), len(v)) for t, v in sorted(by_tool.items())},
        budget=budget(fixed), budget_without_mistake=budget(clean), examples=transcripts(fixed, tok, args.examples),
        _records=(fixed + clean, ms + ms))


# ---------------------------------------------------------------- 3. mul, never in training

def unseen(run, tok, args):
    """The mul questions with the tool described in the prompt, and (the comparison) without the description."""
    ms = missions.unseen_mul(args.n, seed=args.seed + 7)
    records = run([m.trace[0] for m in ms], [Toolbox(m.seed) for m in ms])
    bare = run([chat.prompt(demo.FMT, m.question) for m in ms], [Toolbox(m.seed) for m in ms])
    names = lambda r: [c.split()[0] if c.split() else "" for c, _ in r.calls]    # noqa: E731
    first_tool = lambda rs: dict(collections.Counter(   # noqa: E731
        names(r)[0] if r.calls else "(no call)" for r in rs).most_common())
    mul = [(r, m) for r, m in zip(records, ms) if "mul" in names(r)]
    a_b = [tuple(int(x) for x in m.calls[0].split()[1:]) for m in ms]
    return dict(
        right=right(records, ms),
        called=common.count(sum(bool(r.calls) for r in records), len(ms)),
        called_mul=common.count(len(mul), len(ms)),
        mul_correct=common.count(sum(m.calls[0] in [c for c, _ in r.calls] for r, m in mul), len(ms)),
        answered_sum=common.count(sum(r.answer == str(a + b) for r, (a, b) in zip(records, a_b)), len(ms)),
        answers=dict(collections.Counter(r.answer for r in records).most_common(5)),
        tools_called=dict(collections.Counter(n for r in records for n in names(r)).most_common()),
        first_tool=first_tool(records), budget=budget(records), examples=transcripts(records, tok, args.examples),
        examples_with_calls=transcripts([r for r in records if r.calls], tok, args.examples),
        without_description=dict(right=right(bare, ms), called=common.count(sum(bool(r.calls) for r in bare), len(ms)),
                                 called_mul=common.count(sum("mul" in names(r) for r in bare), len(ms)),
                                 answered_sum=common.count(sum(r.answer == str(a + b) for r, (a, b) in zip(bare, a_b)),
                                                   len(ms)),
                                 first_tool=first_tool(bare), budget=budget(bare)),
        _records=(records + bare, ms + ms))


# ---------------------------------------------------------------- the table

def pct(f):
    return f"{f['k']:>4}/{f['n']:<4} {f['rate']:>6.1%}" if f["n"] else f"{'-':>4}/{0:<4} {'':>6}"


def print_table(res):
    def row(label, get, splits=SPLITS):
        print(f"  {label:40}" + "".join(f"  {pct(get(res[s])):>18}" for s in splits))

    print(f"\n04: error recovery and an unseen tool, small model ({res['model']['checkpoint'] or 'trained here'})")
    print(f"  {'':40}" + "".join(f"  {SPLITS[s]:>18}" for s in SPLITS))
    t = lambda f: lambda r: r["transient"][f]    # noqa: E731
    print("1. transient failure: the first call answers 'error: tool busy, try again'")
    row("right, plain toolbox", t("right_plain"))
    row("right, fail_first", t("right_fail_first"))
    row("made a call (so was told busy)", t("busy"))
    row("  called again after busy", t("called_again"))
    row("  the same call again", t("same_call_again"))
    row("  right after busy", t("right_after_busy"))
    row("    of those that repeated the call", t("right_same_call"))
    row("  'busy'/'error' in its answer", t("busy_in_answer"))
    f = lambda k: lambda r: r["malformed"][k]    # noqa: E731
    print("2. a malformed call and its error written into the prompt")
    row("right, same questions without mistake", f("right_without_mistake"))
    row("right after the mistake", f("right"))
    row("made a call after the error", f("called_after_error"))
    row("  its first call well-formed", f("first_call_ok"))
    row("  its first call == the gold call", f("first_call_gold"))
    row("  repeated the mistake", f("repeated_mistake"))
    row("its own erroring calls: episodes", lambda r: r["own_mistakes"]["episodes"])
    row("  recovered (a later call worked)", lambda r: r["own_mistakes"]["recovered"])
    row("  right", lambda r: r["own_mistakes"]["right"])
    u = res["mul"]
    print("3. mul, never in training (held-out phrasings, the prompt describes the tool)")
    for label, k in (("right", "right"), ("made a call", "called"), ("called mul", "called_mul"),
                     ("called mul A B correctly", "mul_correct"), ("answered A + B instead", "answered_sum")):
        print(f"  {label:40}  {'':>18}  {pct(u[k]):>18}")
    print(f"  tools called: {u['tools_called']}; first call: {u['first_tool']}")
    print(f"  its most frequent answers: {u['answers']}")
    w = u["without_description"]
    print(f"  {'without the description: right':40}  {'':>18}  {pct(w['right']):>18}")
    print(f"  {'  made a call':40}  {'':>18}  {pct(w['called']):>18}")
    print(f"  {'  called mul':40}  {'':>18}  {pct(w['called_mul']):>18}")
    print(f"  {'  answered A + B instead':40}  {'':>18}  {pct(w['answered_sum']):>18}")
    print(f"  first call: {w['first_tool']}")
    print("4. calls per episode; budget exhaustions (stretch / calls)")
    def calls(b):
        return f"{b['calls_per_episode']:>5.2f}   {b['stretch']['k']:>3} / {b['calls']['k']:<3}"
    for label, part, key in (("plain", "transient", "budget_plain"), ("fail_first", "transient", "budget_fail_first"),
                             ("malformed call in the prompt", "malformed", "budget"),
                             ("same questions without it", "malformed", "budget_without_mistake")):
        print(f"  {label:40}" + "".join(f"  {calls(res[s][part][key]):>18}" for s in SPLITS))
    print(f"  {'mul':40}  {'':>18}  {calls(u['budget']):>18}")
    print(f"  {'mul, without the description':40}  {'':>18}  {calls(w['budget']):>18}")


FIGURE = (("transient", "right_plain", "right, plain toolbox"),
          ("transient", "right_fail_first", "right, first call answered busy"),
          ("transient", "called_again", "called again after busy"),
          ("malformed", "right_without_mistake", "right, no mistake in the prompt"),
          ("malformed", "right", "right after a malformed call"),
          ("malformed", "first_call_ok", "a well-formed call after the error"))


def plot_rates(plt, res):
    """The main rates of parts 1 and 2, on training and held-out phrasings."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    y = np.arange(len(FIGURE))
    for j, (split, label) in enumerate(SPLITS.items()):
        rates = [res[split][part][key]["rate"] or 0 for part, key, _ in FIGURE]
        ax.barh(y + (j - 0.5) * 0.4, rates, 0.4, label=label)
    ax.set_yticks(y, [label for *_, label in FIGURE])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"share of episodes (of {res['n']} per split, or of those it applies to)")
    ax.legend(fontsize=8, ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.0))    # above the bars
    return fig


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    params, cfg, tok, source = small_model(args)
    run = Runner(params, cfg, tok, args.slots)
    t_eval = time.perf_counter()
    res = dict(quick=args.quick, seed=args.seed, n=args.n,
               model=dict(source, cfg=dataclasses.asdict(cfg), n_params=model.n_params(params)))
    for split in SPLITS:
        tr, mf = transient(run, tok, args, split), malformed(run, tok, args, split)
        (r_tr, m_tr), (r_mf, m_mf) = tr.pop("_records"), mf.pop("_records")
        records, ms = r_tr + r_mf, m_tr + m_mf
        res[split] = dict(transient=tr, malformed=mf, own_mistakes=own_mistakes(records, ms))
    res["mul"] = unseen(run, tok, args)
    records, ms = res["mul"].pop("_records")
    res["mul"]["own_mistakes"] = own_mistakes(records, ms)
    res["episodes"] = len(run.all)
    res["eval_seconds"] = time.perf_counter() - t_eval
    res["minutes"] = (time.perf_counter() - t0) / 60
    print_table(res)
    for key, label in (("transient", "fail_first"), ("malformed", "malformed call in the prompt")):
        print(f"\n{label}, a held-out-phrasing episode ([program] / model):\n  {res['test'][key]['examples'][0]}")
    print(f"\nmul, an episode:\n  {res['mul']['examples'][0]}")
    for ex in res["mul"]["examples_with_calls"][:1]:
        print(f"mul, the first episode with a call:\n  {ex}")
    print(f"\n{res['episodes']} episodes, {res['eval_seconds']:.0f} s in the loop; {res['minutes']:.1f} minutes")
    out = common.out_path("04_recovery", args.out, args.quick)
    common.write_json(out, res)
    common.save_figure(lambda plt: plot_rates(plt, res), out.with_suffix(".png"))


if __name__ == "__main__":
    main()
