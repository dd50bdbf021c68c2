"""08: a tool the model has only read about. Does a pretrained model call `mul` when it is described?

The small model of experiments/04 never calls `mul` (0 of 500): it was trained from scratch on the
missions and knows no English, so a description means nothing to it. SmolLM2-135M-Instruct knows
English. Here it learns, with LoRA, to call the four tools of the calculator missions (add, reverse,
sort, lookup) from traces whose system text describes those four. Then 200 multiplications of two
2-digit numbers, a question no training trace asks, with two system texts:
  described       the four tools and "mul A B multiplies A by B."
  not described   the four tools only (the control: the same model, the same questions)
For each: how often it calls mul, calls it well-formed (`mul A B` with the question's numbers), and
answers right; which tool it reaches for first; the budget it spends.

    python -m minagent.weights fetch              # once: the SmolLM2 GGUF file
    python experiments/08_unseen_tool.py          # 76 min, 64 of them training (~12 with cached adapters)
    python experiments/08_unseen_tool.py --quick  # a tiny random model, few questions: a smoke test
Times on 2 CPU cores shared with other jobs; not run on a GPU. Writes experiments/results/08_unseen_tool.json;
the adapters: results/08_lora-*.ckpt (git-ignored), trained again when the recipe changes.
"""

import argparse
import collections
import dataclasses
import json
import sys
import time

import jax
import numpy as np

import common
from minagent import chat, lora, model, train, weights
from minagent import tokenizer as tk
from minagent.tasks.calculator import demo, missions
from minagent.tasks.show import show

FOUR = ("You can call these tools:\n"
        "add A B adds two numbers.\n"
        "reverse WORD spells a word backwards.\n"
        "sort N1 N2 ... puts numbers in increasing order.\n"
        "lookup NAME age or lookup NAME city reads a person's age or city.")
DESCRIBED = FOUR + "\nmul A B multiplies A by B."
SYSTEMS = {"described": DESCRIBED, "not described": FOUR}
FAMILIES = ("add",) * 10 + tuple(f for f in demo.FAMILIES if f != "add")      # as experiments/03's SmolLM2
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)        # --quick only
MAX_LEN = 1024      # room for the call budget's longest episode: see experiments/03


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=200, help="mul questions per system text")
    p.add_argument("--check", type=int, default=50, help="additions in held-out phrasings: did it learn the tools?")
    p.add_argument("--missions", type=int, default=800, help="training missions")
    p.add_argument("--steps", type=int, default=100, help="LoRA steps")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=192, help="tokens per row: a mission with the system text")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--slots", type=int, default=32, help="episodes decoded together")
    p.add_argument("--examples", type=int, default=2, help="transcripts kept per system text")
    p.add_argument("--retrain", action="store_true", help="train the adapters again, even if cached")
    p.add_argument("--quick", action="store_true", help="a tiny random model, few questions: a smoke test")
    p.add_argument("--out", default=None, help="the JSON file (default experiments/results/08_unseen_tool.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.check, args.missions, args.steps, args.slots, args.examples = 6, 4, 200, 3, 8, 1
    return args


def load(args):
    """-> (params, cfg, tok, fmt, new_rows): SmolLM2 with the call tokens added (as experiments/03),
    or for --quick a tiny random model with a BPE trained on the missions."""
    if args.quick:
        tok = demo.mission_tokenizer(missions.generate(200, seed=args.seed + 1, families=FAMILIES, system=DESCRIBED))
        cfg = model.Config(vocab_size=tok.n_vocab, **TINY)
        return model.init(jax.random.PRNGKey(args.seed), cfg), cfg, tok, chat.MINAGENT, 0
    fmt = chat.CHATML
    base, cfg, tok = weights.load_smollm2()
    tok = tk.add_special_tokens(tok, fmt.specials)                      # <|call|>, <|result|>
    new_rows = tok.n_vocab - cfg.vocab_size
    base = model.add_tokens(base, new_rows)
    return base, model.with_vocab(cfg, base), tok, fmt, new_rows


def adapters_for(base, cfg, tok, fmt, new_rows, args):
    """LoRA on args.missions missions whose system text is FOUR -> (adapters, stats). Cached by recipe."""
    ms = missions.generate(args.missions, seed=args.seed + 1, split="train", families=FAMILIES, fmt=fmt, system=FOUR)
    exs = demo.examples(ms, tok)
    tcfg = train.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             warmup=min(10, args.steps), weight_decay=0.0, seed=args.seed, log_every=5)
    like = lora.init(jax.random.PRNGKey(args.seed), base, args.rank, new_rows=new_rows)
    longest = max(len(t) for t, _ in exs)

    def train_fn(path):
        print(f"LoRA on {len(exs)} missions (longest {longest} tokens): {tcfg.steps} steps of "
              f"{tcfg.batch_size} x {tcfg.seq_len} tokens")
        (adapters, history), seconds = common.timed(lora.train_lora, base, cfg, exs, tcfg, rank=args.rank,
                                                    alpha=args.alpha, new_rows=new_rows, seed=args.seed, lora=like,
                                                    progress=not args.quick)
        done = dict(train_minutes=seconds / 60, loss=[(h["step"], round(h["loss"], 4)) for h in history])
        if path:
            train.save_checkpoint(path, adapters, None, cfg, tcfg, tcfg.steps, extra=done)
        return dict(params=adapters, extra=done)

    recipe = dict(missions=args.missions, system=FOUR, rank=args.rank, alpha=args.alpha, tcfg=dataclasses.asdict(tcfg))
    c = common.cached("08_lora", recipe, train_fn, retrain=args.retrain, quick=args.quick, params_like=like)
    return c["params"], dict(c["extra"], missions=len(exs), longest_tokens=longest, cached=c["cached"],
                             tcfg=dataclasses.asdict(tcfg), checkpoint=common.in_repo(c["path"]) if c["path"] else None)


def score(records, ms, tok, n_examples):
    """What the model did with each mul question."""
    names = [[c.split()[0] if c.split() else "" for c, _ in r.calls] for r in records]
    a_b = [tuple(int(x) for x in m.calls[0].split()[1:]) for m in ms]
    n = len(ms)
    return dict(
        right=common.count(sum(r.answer == m.answer for r, m in zip(records, ms)), n),
        called=common.count(sum(bool(r.calls) for r in records), n),
        called_mul=common.count(sum("mul" in ns for ns in names), n),
        mul_well_formed=common.count(sum(m.calls[0] in [c.strip() for c, _ in r.calls]
                                         for r, m in zip(records, ms)), n),
        answered_sum=common.count(sum(r.answer == str(a + b) for r, (a, b) in zip(records, a_b)), n),
        first_tool=dict(collections.Counter(ns[0] if ns else "(no call)" for ns in names).most_common()),
        calls_per_episode=float(np.mean([len(r.calls) for r in records])),
        statuses=dict(collections.Counter(r.status for r in records)),
        examples=[show(r.tokens, r.authors, tok, color=False) for r in records[:n_examples]])


def run(params, cfg, tok, fmt, ms, args):
    return demo.run_missions(params, cfg, tok, ms, fmt=fmt, slots=args.slots, max_len=MAX_LEN)


def small_model_row():
    """experiments/04's small model on its own mul questions, if its results are here."""
    path = common.RESULTS / "04_recovery.json"
    if not path.exists():
        return None
    mul = json.loads(path.read_text())["mul"]
    return {"described": {k: mul[k] for k in ("right", "called", "called_mul", "mul_correct")},
            "not described": {k: mul["without_description"][k] for k in ("right", "called", "called_mul")}}


def pct(c):
    return f"{c['k']:>4}/{c['n']:<4} {c['rate']:>6.1%}" if c and c["n"] else f"{'-':>16}"


def print_table(res):
    print(f"\n08: mul, described only in the system text ({res['n']} questions per system text)")
    print(f"  {'':34} {'right':>16} {'called a tool':>16} {'called mul':>16} {'mul A B right':>16}")
    for system in SYSTEMS:
        r = res["smollm2"][system]
        print(f"  SmolLM2 + LoRA, {system:18} {pct(r['right'])} {pct(r['called'])} {pct(r['called_mul'])} "
              f"{pct(r['mul_well_formed'])}   first tool {r['first_tool']}")
    small = res.get("small_model")
    if small:
        for system, r in small.items():
            print(f"  small model (04), {system:16} {pct(r['right'])} {pct(r['called'])} {pct(r['called_mul'])} "
                  f"{pct(r.get('mul_correct'))}")
    c = res["check"]
    print(f"  the four tools learned? additions in held-out phrasings: {c['right']['k']} / {c['right']['n']} right")


def main(argv=None):
    args = parse_args(argv)
    if not args.quick and not weights.smollm2_path().exists():
        sys.exit(f"{weights.smollm2_path()} not found: `python -m minagent.weights fetch`")
    out = common.out_path("08_unseen_tool", args.out, args.quick)
    t0 = time.perf_counter()
    base, cfg, tok, fmt, new_rows = load(args)
    adapters, training = adapters_for(base, cfg, tok, fmt, new_rows, args)
    params = lora.merge(base, adapters, args.alpha)
    res = dict(quick=args.quick, seed=args.seed, n=args.n, systems=SYSTEMS, training=training,
               model=dict(name="tiny random" if args.quick else "SmolLM2-135M-Instruct", lora_rank=args.rank,
                          lora_alpha=args.alpha, trained_params=lora.n_trained(adapters)), smollm2={})
    for name, system in SYSTEMS.items():
        ms = missions.unseen_mul(args.n, seed=args.seed + 7, fmt=fmt, system=system)
        res["smollm2"][name] = score(run(params, cfg, tok, fmt, ms, args), ms, tok, args.examples)
        print(f"  {name}: {res['smollm2'][name]['called_mul']['k']} / {args.n} called mul, "
              f"{res['smollm2'][name]['right']['k']} right", flush=True)
    check = missions.additions(args.check, seed=args.seed + 2, fmt=fmt, split="test")
    check = [dataclasses.replace(m, trace=(chat.prompt(fmt, m.question, FOUR),) + m.trace[1:]) for m in check]
    records = run(params, cfg, tok, fmt, check, args)
    res["check"] = dict(right=common.count(sum(r.answer == m.answer for r, m in zip(records, check)), len(check)),
                        called_add=common.count(sum(m.calls[0] in [c.strip() for c, _ in r.calls]
                                             for r, m in zip(records, check)), len(check)))
    res["small_model"] = None if args.quick else small_model_row()
    res["minutes"] = (time.perf_counter() - t0) / 60
    common.write_json(out, res)
    print_table(res)
    trained = "cached" if training["cached"] else f"{training['train_minutes']:.1f} min"
    print(f"\n{res['minutes']:.1f} minutes (training: {trained})")


if __name__ == "__main__":
    main()
