"""Tools beside the batch vs inline: 64 episodes whose tools take 50-200 ms each.

    python benchmarks/bench_tools.py              # about 1 minute on 2 CPU cores
    python benchmarks/bench_tools.py --quick      # 16 episodes, a few seconds

Each episode runs on a rote model (minagent/tasks/rote.py) that calls a tool at once and again
after each result, `--calls` times; each call sleeps 50 to 200 ms (a network call, a
database), drawn per call from a seeded stream, the same draws in both runs. Inline
(agent.run(..., workers=0)) every call holds the whole batch; beside the batch (the default,
a worker thread per slot) the other episodes go on. Prints both wall times and their ratio,
and the sum of the tools' sleeps, which bounds the inline run from below. A third run gives
the calls an eighth as many workers and a 0.6 s time limit: calls queue for a worker, and
since a limit starts only when a worker takes the call, none may time out.
"""

import argparse
import json
import random
import time

from minagent import agent, chat
from minagent import tokenizer as tk
from minagent.tasks import rote

FMT = chat.MINAGENT


class SlowTool:
    """Sleeps 50-200 ms (seeded), then answers."""

    def __init__(self, seed):
        self.rng, self.slept = random.Random(seed), 0.0

    def __call__(self, call):
        pause = self.rng.uniform(0.05, 0.2)
        time.sleep(pause)
        self.slept += pause
        return "42"


def run(batch, tok, n, calls, workers, timeout=agent.TIMEOUT):
    """-> (wall seconds, seconds the tools slept, calls that read "timed out")."""
    tools = [SlowTool(i) for i in range(n)]
    t0 = time.perf_counter()
    records = agent.run(batch, tok, FMT, [f"question {i}" for i in range(n)], tools, max_calls=calls,
                        workers=workers, timeout=timeout)
    wall = time.perf_counter() - t0
    timeouts = sum("timed out" in result for r in records for _, result in r.calls)
    assert timeouts or all(r.status == "calls" and len(r.calls) == calls for r in records)
    return wall, sum(t.slept for t in tools), timeouts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--calls", type=int, default=4, help="calls per episode")
    p.add_argument("--workers", type=int, default=agent.WORKERS, help="threads beside the batch")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.episodes, args.calls = 16, 2
    tok = tk.train("question " * 50 + "look 42 " * 50, 300, specials=tk.MINAGENT_SPECIALS)
    params, cfg = rote.rote(tok, "<|assistant|><|call|>look<|result|>")
    batch = agent.new_batch(params, cfg, tok, FMT, slots=args.episodes, max_len=128)
    run(batch, tok, 2, 1, args.workers)                      # compile the steps before timing
    inline, slept, _ = run(batch, tok, args.episodes, args.calls, workers=0)
    beside, _, _ = run(batch, tok, args.episodes, args.calls, workers=args.workers)
    # More calls than workers: a call waits for a worker, and its time limit (3x the slowest tool)
    # starts only when one takes it, so no call may time out however long the queue.
    few = max(args.episodes // 8, 1)
    queued, _, false_timeouts = run(batch, tok, args.episodes, args.calls, workers=few, timeout=0.6)
    workers = "one per slot" if args.workers is None else f"{args.workers} threads"
    print(f"{args.episodes} episodes x {args.calls} calls of 50-200 ms ({slept:.1f} s of tools in all)")
    print(f"  inline (workers=0)             {inline:6.2f} s")
    print(f"  beside the batch ({workers}) {beside:6.2f} s")
    print(f"  ratio                          {inline / beside:6.2f}x")
    print(f"  {few} workers, time limit 0.6 s  {queued:6.2f} s, {false_timeouts} calls timed out (of "
          f"{args.episodes * args.calls}; none should: no tool takes over 0.2 s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(episodes=args.episodes, calls=args.calls, workers=args.workers, tool_seconds=slept,
                           inline_s=inline, beside_s=beside, ratio=inline / beside, few_workers=few,
                           few_workers_s=queued, few_workers_timeouts=false_timeouts), f, indent=2)


if __name__ == "__main__":
    main()
