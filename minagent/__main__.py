"""The demo: a model that cannot add, given a calculator.

    python -m minagent               # about 6 minutes on 2 CPU cores, nothing to download
    python -m minagent --steps 100   # a rougher, faster run

1. Generate training missions and train a BPE on their text.
2. Train two small models from scratch (3 layers, d_model 128): one on the
   tool-using traces (the loss covers only what the model writes: its calls and
   its answers), the control on the same questions answered directly.
3. Run 200 additions of two 4-digit numbers through the agent loop: the first
   model with the calculator, the control without.
4. Print both accuracies, one transcript with the program's tokens told apart
   from the model's, and how many positions the paged KV cache saved.
"""

import argparse
import json
import pathlib
import time

from minagent import agent, chat, demo, missions
from minagent.tools import Toolbox


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="training steps for each model")
    p.add_argument("--missions", type=int, default=20000, help="training missions")
    p.add_argument("--additions", type=int, default=200, help="4-digit additions to test on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the numbers to this JSON file")
    args = p.parse_args()
    t_start = time.perf_counter()

    train_ms = missions.generate(args.missions, seed=args.seed + 1, split="train", families=demo.FAMILIES)
    tok = demo.mission_tokenizer(train_ms)
    # The 200 additions use the training phrasings ("Add 3959 and 3360."), with fresh numbers: a model
    # that has read only these missions knows no other English. Held-out phrasings: experiments/03.
    test_ms = missions.additions(args.additions, seed=args.seed + 2, split="train")
    print(f"{len(train_ms)} training missions, BPE of {tok.n_vocab} ids, {len(test_ms)} additions to test")

    print(f"\ntraining the tool user ({args.steps} steps)")
    tool_params, cfg, _ = demo.train_small(demo.examples(train_ms, tok), tok, args.steps, args.seed)
    print(f"training the control, which answers directly ({args.steps} steps)")
    direct_params, _, _ = demo.train_small(demo.examples(train_ms, tok, direct=True), tok, args.steps, args.seed)

    with_tool = demo.run_missions(tool_params, cfg, tok, test_ms)
    control = demo.run_missions(direct_params, cfg, tok, test_ms, direct=True)
    acc_tool, acc_direct = demo.accuracy(with_tool, test_ms), demo.accuracy(control, test_ms)
    n = len(test_ms)
    print(f"\n4-digit additions right, {n} questions:")
    print(f"  with the calculator   {round(acc_tool * n):>4} / {n}   ({acc_tool:.1%})")
    print(f"  answering directly    {round(acc_direct * n):>4} / {n}   ({acc_direct:.1%})")

    r, m = with_tool[0], test_ms[0]
    print("\none episode ([program] / model):")
    print("  " + chat.show(r.tokens, r.authors, tok))
    c = control[0]
    print("the control on the same question (right answer " + m.answer + "):")
    print("  " + chat.show(c.tokens, c.authors, tok))

    # The cache: the same four-call missions with and without it (greedy: the same tokens either way).
    four = missions.generate(20, seed=args.seed + 3, split="train", families=["sort_ages"])
    prompts = [x.trace[0] for x in four]
    cached, _ = agent.run(tool_params, cfg, tok, demo.FMT, prompts, [Toolbox(x.seed) for x in four])
    uncached, _ = agent.run(tool_params, cfg, tok, demo.FMT, prompts, [Toolbox(x.seed) for x in four],
                            cache=False)
    pos_c = sum(x.positions for x in cached) / len(cached)
    pos_u = sum(x.positions for x in uncached) / len(uncached)
    calls = sum(len(x.calls) for x in cached) / len(cached)
    print(f"\nthe paged KV cache, {len(four)} missions of {calls:.1f} calls on average:")
    print(f"  positions through the model per episode: {pos_c:.0f} with the cache, {pos_u:.0f} without "
          f"({pos_u / pos_c:.1f}x)")
    elapsed = time.perf_counter() - t_start
    print(f"\n{elapsed / 60:.1f} minutes")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(
            steps=args.steps, missions=args.missions, additions=n, accuracy_tool=acc_tool,
            accuracy_direct=acc_direct, positions_cache=pos_c, positions_no_cache=pos_u,
            calls_per_episode=calls, minutes=elapsed / 60), indent=2))


if __name__ == "__main__":
    main()
