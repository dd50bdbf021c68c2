"""03: the calculator. A model that cannot add, given a calculator, adds.

Two models per part train on the same missions, the tool user taught to call the tools, the control
to answer directly; each runs in the agent loop on 200 additions of two 4-digit numbers with fresh
numbers, in the training phrasings and in held-out ones (the control has no tool). Also: accuracy
per mission family, calls per episode, budget exhaustions; "right" is exactly the gold answer.
(a) small models from scratch, the demo's model and training settings (minagent/tasks/calculator/demo.py),
    on the families' mix without the demo's extra 4-digit additions, for --steps steps;
(b) SmolLM2-135M-Instruct with <|call|> and <|result|> added, fine-tuned through LoRA (and a delta
    for the two new rows), and the same model before training. Checkpoints: experiments/results/03_*.ckpt.

    python experiments/03_calculator.py                  # both parts: ~41 min
    python experiments/03_calculator.py --only small     # part (a): 6-7 min
    python experiments/03_calculator.py --only smollm2   # part (b): ~35 min; needs `python -m minagent.weights fetch`
    python experiments/03_calculator.py --quick          # a tiny part (a): 20-30 s
Times on 2 CPU cores shared with other jobs; not run on a GPU. Writes experiments/results/03_calculator.json
(--only replaces that part of it) and, with matplotlib, 03_calculator.png: accuracy per family.
"""

import argparse
import collections
import dataclasses
import re
import sys
import time

import jax
import numpy as np

import common
from minagent import chat, lora, model, train, weights
from minagent import tokenizer as tk
from minagent.tasks.calculator import demo, missions
from minagent.tasks.show import show

# SmolLM2 trains on far fewer missions: half of them additions, the rest one of each other family.
SMOL_FAMILIES = ("add",) * 10 + tuple(f for f in demo.FAMILIES if f != "add")
# Room for the longest episode the budgets allow: a prompt, 8 calls of up to 40 tokens each followed by
# a result of up to 64 characters and the hand-back, and a last stretch of 40. (An episode that would
# outgrow max_len ends as "max_len", not as its model decided: an untrained model can call 8 times.)
MAX_LEN = 1024


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--additions", type=int, default=200, help="4-digit additions, per phrasing split")
    p.add_argument("--per-family", type=int, default=50, help="held-out-phrasing missions per family (small)")
    # (a) the small models: demo.train_small's numbers
    p.add_argument("--missions", type=int, default=20000, help="training missions (small models)")
    p.add_argument("--steps", type=int, default=500, help="training steps (small models)")
    # (b) SmolLM2 + LoRA
    p.add_argument("--smol-missions", type=int, default=800, help="training missions (SmolLM2)")
    p.add_argument("--smol-steps", type=int, default=100, help="LoRA steps of 4 rows x 128 tokens")
    p.add_argument("--smol-lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--smol-per-family", type=int, default=10, help="held-out-phrasing missions per family")
    p.add_argument("--base-stretch", type=int, default=128, help="SmolLM2 before training: stretch budget")
    p.add_argument("--slots", type=int, default=32, help="episodes decoded together (SmolLM2)")
    p.add_argument("--only", choices=("small", "smollm2"), default=None, help="run one part")
    p.add_argument("--quick", action="store_true", help="tiny part (a) only: a smoke test, under a minute")
    p.add_argument("--out", default=None, help="the JSON file (default experiments/results/03_calculator.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.missions, args.steps, args.additions, args.per_family, args.only = 200, 10, 8, 1, "small"
    return args


# ---------------------------------------------------------------- scoring

def score(records, ms, tok):
    """-> dict(right, n, accuracy, answer_written, calls_per_episode, exhausted{stretch, calls})."""
    right = sum(r.answer == m.answer for r, m in zip(records, ms))
    written = sum(_writes_answer(r, m.answer, tok) for r, m in zip(records, ms))
    statuses = collections.Counter(r.status for r in records)
    n = len(ms)
    return dict(right=right, n=n, accuracy=right / n, answer_written=written / n,
                calls_per_episode=sum(len(r.calls) for r in records) / n,
                exhausted={"stretch": statuses["stretch"], "calls": statuses["calls"]})


def _writes_answer(record, answer, tok):
    said = tok.decode([int(t) for t, a in zip(record.tokens, record.authors) if a == chat.MODEL])
    return re.search(rf"(?<![0-9]){re.escape(answer)}(?![0-9])", said) is not None


def by_family(records, ms, tok):
    groups = collections.defaultdict(list)
    for r, m in zip(records, ms):
        groups[m.family].append((r, m))
    return {f: score([r for r, _ in g], [m for _, m in g], tok) for f, g in groups.items()}


def transcript(record, tok):
    return show(record.tokens, record.authors, tok, color=False)


def evaluate(params, cfg, tok, ms, fmt, **kw):
    """Tool user (calculator and the other tools) and control (no tool) on the same missions."""
    out = {}
    for name, direct in (("tool", False), ("direct", True)):
        records, seconds = common.timed(demo.run_missions, params[name], cfg, tok, ms, direct=direct, fmt=fmt, **kw)
        out[name] = dict(score(records, ms, tok), seconds=seconds, example=transcript(records[0], tok))
    return out


def addition_sets(args, fmt):
    """200 additions in the training phrasings (fresh numbers) and 200 in held-out phrasings."""
    return {split: missions.additions(args.additions, seed=args.seed + 2, fmt=fmt, split=split)
            for split in ("train", "test")}


def family_scores(params, cfg, tok, per_family, seed, split, fmt, **kw):
    """-> {"tool" | "direct": {family: score}} on per_family missions of every family, `split` phrasings."""
    ms = missions.generate(per_family * len(missions.FAMILIES), seed=seed, split=split, fmt=fmt)
    return {name: by_family(demo.run_missions(params[name], cfg, tok, ms, direct=direct, fmt=fmt, **kw), ms, tok)
            if ms else {} for name, direct in (("tool", False), ("direct", True))}


# ---------------------------------------------------------------- (a) small models from scratch

def part_small(args):
    t0 = time.perf_counter()
    train_ms = missions.generate(args.missions, seed=args.seed + 1, split="train", families=demo.FAMILIES)
    tok = demo.mission_tokenizer(train_ms)
    cfg = model.Config(vocab_size=tok.n_vocab, **demo.SMALL)
    tcfg = demo.small_tcfg(args.steps, args.seed)
    params, minutes, paths = {}, {}, {}
    for name, direct in (("tool", False), ("direct", True)):
        print(f"small model, {'the control (direct answers)' if direct else 'the tool user'}: {args.steps} steps")
        start = model.init(jax.random.PRNGKey(args.seed), cfg)
        # Always trained (the training time is a result), and saved where experiments/04 looks for it.
        # --quick leaves the real checkpoints alone.
        paths[name] = None if args.quick else common.small_checkpoint(name, args.missions, args.steps, args.seed)
        (params[name], _), s = common.timed(train.train, start, cfg, demo.examples(train_ms, tok, direct), tcfg,
                                            checkpoint_path=paths[name], tokenizer=tok)
        minutes[name] = s / 60

    tests = addition_sets(args, demo.FMT)
    additions = {split: evaluate(params, cfg, tok, ms, demo.FMT, max_len=MAX_LEN) for split, ms in tests.items()}
    families = {split: family_scores(params, cfg, tok, args.per_family, args.seed + 4, split, demo.FMT,
                                     max_len=MAX_LEN) for split in ("test", "train")}
    checkpoints = None if args.quick else {k: common.in_repo(v) for k, v in paths.items()}
    return dict(model=dict(cfg=dataclasses.asdict(cfg), n_params=model.n_params(params["tool"]),
                           train_missions=args.missions, tcfg=dataclasses.asdict(tcfg), checkpoints=checkpoints),
                train_minutes=minutes, additions=additions, families=families["test"],
                families_train_phrasings=families["train"], minutes=(time.perf_counter() - t0) / 60)


# ---------------------------------------------------------------- (b) SmolLM2 + LoRA

def part_smollm2(args):
    t0 = time.perf_counter()
    fmt = chat.CHATML
    base, cfg, tok = weights.load_smollm2()
    tok = tk.add_special_tokens(tok, fmt.specials)                      # <|call|> 49152, <|result|> 49153
    n_new = tok.n_vocab - cfg.vocab_size
    base = model.add_tokens(base, n_new)                                # rows: the mean of the table's rows
    cfg = model.with_vocab(cfg, base)

    train_ms = missions.generate(args.smol_missions, seed=args.seed + 1, split="train", families=SMOL_FAMILIES,
                                 fmt=fmt)
    tcfg = train.TrainConfig(steps=args.smol_steps, batch_size=4, seq_len=128, lr=args.smol_lr, warmup=10,
                             weight_decay=0.0, seed=args.seed, log_every=5)
    params, minutes, n_trained, losses, speed, paths = {}, {}, None, {}, {}, {}
    for name, direct in (("tool", False), ("direct", True)):
        print(f"SmolLM2 + LoRA, {'the control (direct answers)' if direct else 'the tool user'}: "
              f"{args.smol_steps} steps")
        # The adapters, with their optimizer state; load with train.load_checkpoint(path,
        # params_like=lora.init(key, base, rank, new_rows=2)). Always trained: the training time is a result.
        paths[name] = common.checkpoint_path(f"03_smollm2_{name}_lora", dict(
            missions=args.smol_missions, rank=args.rank, alpha=args.alpha, tcfg=dataclasses.asdict(tcfg)))
        (adapters, history), s = common.timed(
            lora.train_lora, base, cfg, demo.examples(train_ms, tok, direct), tcfg, rank=args.rank,
            alpha=args.alpha, new_rows=n_new, seed=args.seed, checkpoint_path=paths[name], tokenizer=tok)
        params[name] = lora.merge(base, adapters, args.alpha)
        minutes[name], n_trained = s / 60, lora.n_trained(adapters)
        losses[name] = [(h["step"], round(h["loss"], 4)) for h in history]
        speed[name] = float(np.mean([h["tokens_per_s"] for h in history[1:]]))   # the first includes compiling

    tests = addition_sets(args, fmt)
    kw = dict(fmt=fmt, slots=args.slots, max_len=MAX_LEN)
    additions = {split: evaluate(params, cfg, tok, ms, **kw) for split, ms in tests.items()}
    for split, ms in tests.items():      # before training, with the calculator offered (it never calls)
        records, s = common.timed(demo.run_missions, base, cfg, tok, ms, max_stretch=args.base_stretch, **kw)
        additions[split]["before"] = dict(score(records, ms, tok), seconds=s, example=transcript(records[0], tok))

    families = family_scores(params, cfg, tok, args.smol_per_family, args.seed + 4, "test", **kw)
    return dict(model=dict(name="SmolLM2-135M-Instruct", n_params=model.n_params(base), lora_rank=args.rank,
                           lora_alpha=args.alpha, trained_params=n_trained, train_missions=args.smol_missions,
                           tcfg=dataclasses.asdict(tcfg), train_tokens_per_s=speed,
                           checkpoints={k: common.in_repo(v) for k, v in paths.items()}),
                train_minutes=minutes, train_loss=losses, additions=additions, families=families,
                minutes=(time.perf_counter() - t0) / 60)


# ---------------------------------------------------------------- tables

ROWS = (("tool", "with the calculator"), ("direct", "answering directly (control)"), ("before", "before training"))


def print_additions(title, res):
    n = res["additions"]["train"]["tool"]["n"]
    print(f"\n{title}: {n} additions of two 4-digit numbers")
    print(f"  {'':32} {'training phrasings':>20} {'held-out phrasings':>20}   answer written   calls/ep  exhausted")
    for key, label in ROWS:
        if key not in res["additions"]["train"]:
            continue
        tr_, te = res["additions"]["train"][key], res["additions"]["test"][key]
        ex = sum(tr_["exhausted"].values()) + sum(te["exhausted"].values())
        print(f"  {label:32} {tr_['right']:>4}/{n} {tr_['accuracy']:>7.1%}      {te['right']:>4}/{n} "
              f"{te['accuracy']:>7.1%}      {tr_['answer_written']:>5.1%} {te['answer_written']:>6.1%}"
              f"   {(tr_['calls_per_episode'] + te['calls_per_episode']) / 2:>7.2f}  {ex:>5}")


def print_families(title, res):
    fam, seen = res["families"], res.get("families_train_phrasings")
    print(f"\n{title}: held-out-phrasing missions by family, right / n"
          + (" (and the tool user on training phrasings)" if seen else ""))
    print(f"  {'family':10} {'with tools':>14} {'calls/ep':>9} {'exhausted':>9} {'control':>14}"
          + (f" {'tools, training phrasings':>26}" if seen else ""))
    for f, s in fam["tool"].items():
        d = fam["direct"][f]
        line = (f"  {f:10} {s['right']:>4}/{s['n']:<3} {s['accuracy']:>5.0%} {s['calls_per_episode']:>9.1f} "
                f"{sum(s['exhausted'].values()):>9} {d['right']:>4}/{d['n']:<3} {d['accuracy']:>5.0%}")
        if seen:
            t = seen["tool"][f]
            line += f" {t['right']:>16}/{t['n']:<3} {t['accuracy']:>5.0%}"
        print(line)


def plot_families(plt, results):
    """Accuracy per mission family: the tool user and the control, on held-out and training phrasings."""
    parts = [(key, title) for key, title in (("small", "small model from scratch"), ("smollm2", "SmolLM2 + LoRA"))
             if key in results]
    fig, axes = plt.subplots(len(parts), 1, figsize=(10, 3.2 * len(parts)), squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], parts):
        res = results[key]
        bars = [(who, split, f"{label}, {phrasings}", color)
                for who, label, colors in (("tool", "with tools", "C0 C9"), ("direct", "control", "C3 C1"))
                for (split, phrasings), color in zip((("families", "held-out phrasings"),
                                                      ("families_train_phrasings", "training phrasings")),
                                                     colors.split()) if split in res]
        families = list(res["families"]["tool"])
        width = 0.8 / len(bars)
        for j, (who, split, label, color) in enumerate(bars):
            x = np.arange(len(families)) + (j - (len(bars) - 1) / 2) * width
            ax.bar(x, [res[split][who][f]["accuracy"] for f in families], width, label=label, color=color)
        ax.set_xticks(np.arange(len(families)), families)
        ax.set_ylim(0, 1.2)                          # room for the legend above the bars
        ax.set_yticks(np.linspace(0, 1, 6))
        ax.set_ylabel("right")
        ax.set_title(f"{title}: right answers per mission family")
        ax.legend(fontsize=7, ncol=len(bars), loc="upper center")
    return fig


def main(argv=None):
    args = parse_args(argv)
    out = common.out_path("03_calculator", args.out, args.quick)
    results = dict(quick=args.quick, seed=args.seed, additions=args.additions)
    t0 = time.perf_counter()
    if args.only in (None, "small"):
        results["small"] = part_small(args)
        print_additions("small model from scratch", results["small"])
        print_families("small model", results["small"])
    if args.only in (None, "smollm2"):
        if not weights.smollm2_path().exists():
            sys.exit(f"{weights.smollm2_path()} not found: `python -m minagent.weights fetch`")
        results["smollm2"] = part_smollm2(args)
        res = results["smollm2"]
        print_additions("SmolLM2-135M-Instruct + LoRA", res)
        print_families("SmolLM2 + LoRA", res)
        print(f"\nSmolLM2 training: {res['train_minutes']['tool']:.1f} min (tool user), "
              f"{res['train_minutes']['direct']:.1f} min (control), "
              f"{res['model']['train_tokens_per_s']['tool']:.0f} tokens/s; "
              f"{res['model']['trained_params']:,} trained numbers")
    results["minutes_this_run"] = (time.perf_counter() - t0) / 60
    print(f"\n{results['minutes_this_run']:.1f} minutes")
    # With --only, the other part stays as the file has it, and the figure shows both.
    results = common.write_json(out, results, merge=bool(args.only) and not args.quick)
    for key in ("small", "smollm2"):
        if key in results:
            ex = results[key]["additions"]["test"]
            print(f"\n{key}, one held-out-phrasing episode ([program] / model):\n  {ex['tool']['example']}"
                  f"\n  control: {ex['direct']['example']}")
    common.save_figure(lambda plt: plot_families(plt, results), out.with_suffix(".png"))


if __name__ == "__main__":
    main()
