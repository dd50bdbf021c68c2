"""Tools run beside the batch: a slow tool holds only its own episode; a faulty one ends in its own error.

    python -m pytest tests/engine/test_tools_beside.py -q

Every episode runs on a rote model (minagent/tasks/rote.py) that calls `look` at once and again
after each result, so each makes max_calls calls, and each call's tool is known.
"""

import concurrent.futures as cf
import threading
import time
from types import SimpleNamespace

import pytest

from minagent import agent, chat

from conftest import warm_caller

FMT = chat.MINAGENT


@pytest.fixture(scope="module")
def caller(stok):
    return warm_caller(stok)


class Tool:
    """Answers `text` after `sleep` seconds, and notes when each call started and ended. With `first`
    (a threading.Event), it also waits up to 60 s for that event before it sleeps."""

    def __init__(self, sleep=0.0, text="ok", first=None):
        self.sleep, self.text, self.spans, self.first = sleep, text, [], first

    def __call__(self, call):
        start = time.monotonic()
        if self.first is not None:
            self.first.wait(timeout=60.0)
        time.sleep(self.sleep)
        self.spans.append((start, time.monotonic()))
        return self.text


class Fast(Tool):
    """Answers at once; `done` is set when every Fast of the group has answered `calls` times."""

    def __init__(self, group, done, calls):
        super().__init__()
        self.group, self.done, self.calls = group, done, calls

    def __call__(self, call):
        out = super().__call__(call)
        if all(len(tool.spans) >= self.calls for tool in self.group):
            self.done.set()
        return out


def test_a_slow_tool_holds_only_its_own_episode(stok, caller):
    """The slow tools wait until the fast episodes are done (at most 60 s: the first steps compile,
    which took over 10 s on a loaded machine), then sleep 1 s. If the batch waited for a slow call,
    the fast episodes could not move before it timed out."""
    done, fast = threading.Event(), []
    fast += [Fast(fast, done, calls=2) for _ in range(4)]
    slow = [Tool(sleep=1.0, first=done) for _ in range(4)]
    t0 = time.monotonic()
    records = agent.run(caller, stok, FMT, [f"q{i}" for i in range(8)], slow + fast, max_calls=2)
    wall = time.monotonic() - t0
    assert [r.status for r in records] == ["calls"] * 8 and all(r.calls == [("look", "ok")] * 2 for r in records)
    # the fast episodes did all their calls while the first slow call was still sleeping
    first_slow_ends = min(end for tool in slow for _, end in tool.spans)
    assert max(end for tool in fast for _, end in tool.spans) < first_slow_ends
    tool_time = sum(end - start for tool in slow + fast for start, end in tool.spans)    # over 8 s of waiting
    assert wall < 0.5 * tool_time, (wall, tool_time)                                    # about 2.5 s
    assert caller.pool.n_used == 0


def test_inline_tools_hold_the_batch(stok, caller):
    """workers=0, for comparison: each call runs in the loop, and every episode waits for it."""
    tools = [Tool(sleep=0.2) for _ in range(3)]
    t0 = time.monotonic()
    records = agent.run(caller, stok, FMT, ["a", "b", "c"], tools, max_calls=2, workers=0)
    assert time.monotonic() - t0 >= 6 * 0.2 and all(r.status == "calls" for r in records)


def hangs(call):
    threading.Event().wait(3.0)           # longer than the timeout below: as good as never, here
    return "late"


def raises(call):
    raise ConnectionError("the database is down")


def nothing(call):
    return None


def test_faulty_tools_give_their_own_episode_an_error(stok, caller):
    boxes = [hangs, raises, nothing, Tool(text="fine"), Tool(text="fine")]
    records = agent.run(caller, stok, FMT, list("abcde"), boxes, max_calls=1, timeout=0.5)
    assert [r.calls for r in records] == [
        [("look", "error: look timed out after 0.5 s")],
        [("look", "error: look failed (ConnectionError)")],
        [("look", "error: look returned NoneType, not text")],
        [("look", "fine")], [("look", "fine")]]
    assert all(r.status == "calls" and r.history[-2].kind == "result" for r in records)   # each read its result
    assert caller.pool.n_used == 0


def test_a_raising_tool_inline_is_an_error_too(stok, caller):
    (r,) = agent.run(caller, stok, FMT, ["a"], [raises], max_calls=1, workers=0)
    assert r.calls == [("look", "error: look failed (ConnectionError)")]


def test_a_tool_that_answers_before_the_loop_sleeps_wakes_it():
    """A tool may answer after run() looked at its episode and before run() sleeps: wait() must
    return at once, not sleep until another tool's deadline (a lost wake-up that once stalled a
    test for 60 s)."""
    answered, slow = agent.Job(None, ""), agent.Job(None, "")
    answered.future.set_result("ok")
    answered.started = slow.started = time.monotonic()
    live = [SimpleNamespace(job=slow), SimpleNamespace(job=answered)]
    t0 = time.monotonic()
    agent.Loop.wait(SimpleNamespace(live=live, timeout=30.0))
    assert time.monotonic() - t0 < 5.0


def test_the_tool_result_rules():
    done = cf.Future()
    done.set_result(42)
    assert agent.tool_result(done, "sum 1 2", 1.0) == "error: sum returned int, not text"
    assert agent.tool_result(cf.Future(), "sum", 2.5) == "error: sum timed out after 2.5 s"
    assert agent.tool_result(cf.Future(), "", 1.0) == "error: tool timed out after 1 s"
