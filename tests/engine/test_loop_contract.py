"""The agent loop's contract: one test per promise of minagent/agent.py's docstring.

    python -m pytest tests/engine/test_loop_contract.py -q

Each test was written to fail on the loop as it was before the promise was kept: a deadline
that counted the time queued for a worker, a pool of 16 threads for 32 slots, a message cache
keyed by text, KeyboardInterrupt turned into a result, a lone surrogate that raised, an empty
view that ended the whole run. Episodes run on a rote model (minagent/tasks/rote.py) that calls
`look` after every <|assistant|>, so each makes max_calls calls and every call's tool is known.
"""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from minagent import agent, chat
from minagent.tools import Toolbox

from conftest import warm_caller

FMT = chat.MINAGENT


@pytest.fixture(scope="module")
def caller(stok):
    return warm_caller(stok)


def sleeper(seconds, text="ok"):
    def tool(call):
        time.sleep(seconds)
        return text
    return tool


def hangs(call):
    threading.Event().wait(30.0)          # as good as never, here
    return "late"


def instant(call):
    return "ok"


def test_a_faulty_tool_gives_only_its_own_episode_an_error(stok, caller):
    def raises(call):
        raise ConnectionError("down")
    records = agent.run(caller, stok, FMT, list("abc"), [raises, instant, lambda c: 7], max_calls=1)
    assert [r.calls for r in records] == [[("look", "error: look failed (ConnectionError)")], [("look", "ok")],
                                          [("look", "error: look returned int, not text")]]
    assert caller.pool.n_used == 0


def test_the_time_limit_starts_when_a_worker_starts_the_call(stok, caller):
    """Eight calls of 0.4 s, two workers, a 1 s limit: the last ones wait 1.2 s for a worker, which
    is no reason to time out (the old loop's deadline began at submission: 4 of 8 timed out)."""
    records = agent.run(caller, stok, FMT, [f"q{i}" for i in range(8)], [sleeper(0.4)] * 8, max_calls=1,
                        workers=2, timeout=1.0)
    assert [r.calls for r in records] == [[("look", "ok")]] * 8


def test_an_instant_tool_beside_hung_ones_answers(stok, caller):
    """Three hung tools hold the three workers; the instant tool's call waits, and once the hung
    calls time out their workers are replaced and it runs: it answers "ok", not "timed out"."""
    records = agent.run(caller, stok, FMT, list("abcd"), [hangs, hangs, hangs, instant], max_calls=1,
                        workers=3, timeout=0.5)
    assert [r.calls[0][1] for r in records] == ["error: look timed out after 0.5 s"] * 3 + ["ok"]


def test_inline_a_hung_call_does_not_time_out_the_later_ones(stok, caller):
    """workers=0: after one hung call, the next episodes' instant tools still answer."""
    records = agent.run(caller, stok, FMT, list("abc"), [hangs, instant, instant], max_calls=1, workers=0,
                        timeout=0.5)
    assert [r.calls[0][1] for r in records] == ["error: look timed out after 0.5 s", "ok", "ok"]


def test_by_default_there_is_a_worker_for_every_slot(stok, caller):
    """Eight calls of 0.5 s, one per slot, a 0.8 s limit: they all run at once, none times out."""
    loop = agent.Loop(caller, stok, FMT)
    assert loop.workers == caller.slots == 8
    records = agent.run(caller, stok, FMT, list("abcdefgh"), [sleeper(0.5)] * 8, max_calls=1, timeout=0.8)
    assert [r.calls for r in records] == [[("look", "ok")]] * 8


@pytest.mark.slow
def test_a_hung_tool_does_not_keep_the_process_alive(tmp_path):
    """A program whose tool hangs for 120 s ends soon after run() returns (ThreadPoolExecutor's
    threads are joined at exit: the old loop's process waited the 120 s)."""
    script = tmp_path / "hung.py"
    script.write_text(textwrap.dedent("""
        import threading, time
        from minagent import agent, chat
        from minagent import tokenizer as tk
        from minagent.tasks.rote import rote
        tok = tk.train("look at this " * 50, vocab_size=300, specials=tk.MINAGENT_SPECIALS)
        params, cfg = rote(tok, "<|assistant|><|call|>look<|result|>")
        batch = agent.new_batch(params, cfg, tok, chat.MINAGENT, slots=2, max_len=64)
        hang = lambda call: threading.Event().wait(120.0) or "late"
        (r,) = agent.run(batch, tok, chat.MINAGENT, ["q"], [hang], max_calls=1, timeout=0.5)
        print(r.calls[0][1], flush=True)
        print("returned", time.monotonic(), flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    ended = time.monotonic()
    assert out.returncode == 0, out.stderr
    assert "timed out" in out.stdout
    returned = float(out.stdout.split("returned")[1])
    assert ended - returned < 10.0


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("workers", [None, 0])
def test_keyboard_interrupt_and_system_exit_propagate_with_the_pages_freed(stok, caller, error, workers):
    def interrupted(call):
        raise error()
    boxes = [Toolbox(tools={"look": interrupted}), instant, instant]
    with pytest.raises(error):
        agent.run(caller, stok, FMT, list("abc"), boxes, max_calls=2, workers=workers)
    assert caller.pool.n_used == 0 and not caller.running()
    assert boxes[0].calls == len(boxes[0].log) == 1               # counted and logged alike
    assert boxes[0].log[0] == ("look", f"error: interrupted ({error.__name__})")


def test_a_message_keeps_the_ids_it_was_sampled_as(stok, caller):
    """Two model turns with the same text and other ids: each is sent back as its own ids, so the
    whole view is exactly the tokens the sequence holds (the old cache, keyed by text, sent the
    second turn as the first one's ids: the context rewritten, and refills counted)."""
    loop = agent.Loop(caller, stok, FMT)
    ep = loop.start("q", instant)
    whole = stok.encode_ordinary("look")
    pieces = [t for ch in "look" for t in stok.encode_ordinary(ch)]       # the same text, other ids
    assert whole != pieces and stok.decode(whole) == stok.decode(pieces)
    seq = caller.seqs[ep.seq]
    for ids in (whole, pieces):                                      # as if the model had sampled them
        seq.tokens += ids
        loop.note_written(ep)
        ep.history += (chat.Message("result", "ok"),)
        seq.tokens += loop.encode(ep, ep.history[-1])[0]
        ep.authors += [chat.PROGRAM] * len(loop.encode(ep, ep.history[-1])[0])
    said = [m for m in ep.history if m.kind == "model"]
    assert said[0] == said[1]                                        # the same text...
    assert [loop.encode(ep, m)[0] for m in said] == [whole, pieces]  # ...each with its own ids
    view = [t for m in agent.whole(ep.history, None) for t in loop.encode(ep, m)[0]]
    assert view == seq.tokens                                        # nothing to refill
    caller.finish(ep.seq)


@pytest.mark.parametrize("where", ["result", "prompt", "system"])
def test_text_is_text_whatever_code_points_it_holds(stok, caller, where):
    """A lone surrogate (what surrogateescape or JSON's "\\ud800" gives) is sent as U+FFFD: nothing raises."""
    odd = "bad \ud800 byte <|end|>"
    prompt = odd if where == "prompt" else "q"
    system = odd if where == "system" else None
    tool = (lambda call: odd) if where == "result" else instant
    (r,) = agent.run(caller, stok, FMT, [prompt], [tool], max_calls=2, system=system)
    assert r.status == "calls" and len(r.calls) == 2
    assert stok.decode(stok.encode_ordinary(odd)) == odd.replace("\ud800", "\ufffd")
    if where == "result":
        assert r.calls[0][1] == odd                                  # the record keeps the text as it was
    assert caller.pool.n_used == 0


def test_an_empty_view_refuses_only_its_episode(stok, caller):
    def view(history, count):
        return () if history[0].text == "empty" else history
    records = agent.run(caller, stok, FMT, ["empty", "fine"], [instant, instant], max_calls=1, view=view)
    assert [r.status for r in records] == ["refused", "calls"]
    assert records[0].answer == "the view holds no message"
    assert caller.pool.n_used == 0


@pytest.mark.parametrize("seed", [2**31, -1, 2**40, 1.5, True, "7"])
def test_a_seed_outside_int32_is_refused_with_the_batch_unchanged(stok, caller, seed):
    before = (len(caller.seqs), list(caller._queue), caller.pool.n_used)
    with pytest.raises(ValueError, match="seed"):
        caller.add(stok.encode("<|user|>q<|assistant|>"), 4, seed=seed)
    assert (len(caller.seqs), list(caller._queue), caller.pool.n_used) == before
    i = caller.add(stok.encode("<|user|>q<|assistant|>"), 4, seed=2**31 - 1)    # the largest stream works
    while caller.running():
        caller.step()
    assert caller.seqs[i].status in ("paused", "stopped", "length")
    caller.finish(i)
