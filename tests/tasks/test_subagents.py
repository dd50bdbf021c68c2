"""Sub-agents: `delegate BRIEF`, a layer on top of the agent loop (minagent/tasks/context/subagents.py).

    python -m pytest tests/tasks/test_subagents.py -q

The episodes run on a rote model (minagent/tasks/rote.py), so they are known exactly.
"""

import dataclasses

import numpy as np
import pytest

from minagent import agent, chat
from minagent.chat import Message
from minagent.tasks.context import fit
from minagent.tasks.context import subagents as sub
from minagent.tools import Toolbox

FMT = chat.MINAGENT
# The program writes the opening and the call marker: the model goes on from <|call|>.
CALLS_FIRST = chat.Segment(chat.PROGRAM, chat.markup(FMT, "<|user|>Add up.<|assistant|><|call|>"))


def run(params, cfg, stok, prompts, slots, max_len, brief_system=None, **kw):
    limits = {k: kw.pop(k) for k in ("max_depth", "max_subagents") if k in kw}
    batch = sub.new_batch(params, cfg, stok, FMT, n_prompts=len(prompts), slots=slots, max_len=max_len, **limits)
    records = sub.run(batch, stok, FMT, prompts, [Toolbox(i) for i in range(len(prompts))], brief_system=brief_system,
                      **limits, **kw)
    return records, batch


def test_delegate_answer_becomes_the_result(stok, rote):
    """A root episode delegates; its sub-agent answers; the answer is the root's tool result.

    One slot: the root must give it up (park) while it waits, or the sub-agent could never run.
    """
    params, cfg = rote(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    batch = sub.new_batch(params, cfg, stok, FMT, n_prompts=1, slots=1, max_len=256)
    (r,) = sub.run(batch, stok, FMT, [CALLS_FIRST], [Toolbox(0)], brief_system=fit.INSTRUCTIONS)
    assert (r.status, r.answer, r.calls) == ("done", "ok", [("delegate sum", "ok")])
    (child,) = r.subagents
    assert (child.status, child.answer, child.calls, child.subagents) == ("done", "ok", [], [])
    assert child.history[0] == Message("first", "sum")                 # its only user message: the brief
    assert list(child.tokens) == stok.encode(chat.prompt(FMT, "sum", system=fit.INSTRUCTIONS).text + "ok<|end|>")
    assert list(r.tokens) == stok.encode(CALLS_FIRST.text + "delegate sum<|result|>ok<|assistant|>ok<|end|>")
    assert list(sub.every_record([r])) == [r, child]
    assert batch.pool.n_free == batch.pool.n_pages - 1


@pytest.mark.slow
def test_delegation_limits(stok, rote):
    """An agent that always delegates: sub-agents cannot delegate (depth 1), and a root starts at most two."""
    params, cfg = rote(stok, "<|assistant|><|call|>delegate sum<|result|>")
    (r,), batch = run(params, cfg, stok, ["Add up."], slots=2, max_len=256, max_calls=3, max_subagents=2)
    depth_error = sub.delegation("delegate sum", 1, 0)[1]
    assert r.status == "calls" and len(r.subagents) == 2
    for child in r.subagents:
        assert child.status == "calls" and child.calls == [("delegate sum", depth_error)] * 3
    assert [result for _, result in r.calls] == [sub.subagent_result(r.subagents[0])] * 2 + [
        sub.delegation("delegate sum", 0, 2, max_subagents=2)[1]]
    assert all(result.startswith("error: ") for _, result in r.calls)
    assert batch.pool.n_free == batch.pool.n_pages - 1


def test_parked_callers_have_pages_by_default(stok, rote):
    """Two callers, one slot: both park (pages kept) before either sub-agent runs. The default pool
    has room for them and the running sequence: (1 slot + 2 parked) x 4 pages, not 1 x 4 (OutOfPages)."""
    params, cfg = rote(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    records, batch = run(params, cfg, stok, [CALLS_FIRST, CALLS_FIRST], slots=1, max_len=64)
    for r in records:
        assert (r.status, r.answer, r.calls) == ("done", "ok", [("delegate sum", "ok")])
        assert [child.status for child in r.subagents] == ["done"]
    assert batch.pool.n_pages == 1 + (1 + 2) * 4 and batch.pool.n_used == 0


def test_a_brief_too_long_is_an_error_for_the_caller(stok, rote):
    """The sub-agent's opening (INSTRUCTIONS and the brief: 167 tokens) + a stretch > max_len: no sub-agent."""
    params, cfg = rote(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    (r,), batch = run(params, cfg, stok, [CALLS_FIRST], slots=1, max_len=128, brief_system=fit.INSTRUCTIONS)
    assert (r.status, r.answer, r.calls, r.subagents) == ("done", "ok", [("delegate sum",
                                                                          "error: the brief is too long")], [])
    assert len(batch.seqs) == 1 and batch.pool.n_used == 0


def test_without_the_layer_delegate_is_a_toolbox_call(stok, rote):
    """The plain loop knows no `delegate`: the toolbox has no such tool, and says so."""
    params, cfg = rote(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    batch = agent.new_batch(params, cfg, stok, FMT, slots=1, max_len=256)
    records = agent.run(batch, stok, FMT, [CALLS_FIRST, CALLS_FIRST], [Toolbox(0), Toolbox(1)])
    for r in records:
        assert (r.status, r.answer, r.subagents) == ("done", "ok", [])
        assert r.calls == [("delegate sum", Toolbox(0)("delegate sum"))] and r.calls[0][1].startswith("error: ")
    assert batch.pool.n_pages == 1 + 1 * 16 and len(batch.seqs) == 2


def test_delegate_is_split_on_any_whitespace():
    """As Toolbox splits a call: "delegate\tRead ch01" is a delegation, not an unknown tool."""
    assert sub.delegation("delegate\tRead ch01", 0, 0) == ("Read ch01", None)
    assert sub.delegation(" delegate\n Read ch01\n", 0, 0) == ("Read ch01", None)
    assert sub.delegation("delegate\t", 0, 0) == (None, "error: delegate takes a brief")
    assert sub.delegation("delegates x", 0, 0) == (None, None)


def test_delegation_rule():
    assert sub.delegation("delegate read ch01 ", 0, 0) == ("read ch01", None)
    assert sub.delegation("add 2 3", 0, 0) == (None, None)                    # the toolbox's call
    assert sub.delegation("delegate x", 1, 0)[1].startswith("error: ")       # depth limit
    assert sub.delegation("delegate x", 1, 0, max_depth=2) == ("x", None)
    assert sub.delegation("delegate x", 0, 8)[1].startswith("error: ")       # 8 already started
    assert sub.delegation("delegate", 0, 0)[1].startswith("error: ")         # no brief
    assert sub.delegation("delegate say <|end|>", 0, 0) == ("say <|end|>", None)    # kept; sent as text
    done = agent.Record("done", "42", [], np.zeros(0), np.zeros(0), 0, 0, ())
    refused = dataclasses.replace(done, status="refused", answer=fit.REFUSAL_MESSAGE)
    assert sub.subagent_result(done) == "42"
    assert sub.subagent_result(refused) == fit.REFUSAL_MESSAGE
    assert sub.subagent_result(dataclasses.replace(done, status="stretch")).startswith("error: ")


@pytest.mark.slow
def test_sub_agents_of_sub_agents_with_a_deeper_limit(stok, rote):
    """max_depth=2: a sub-agent may delegate once more; the chain of parked callers all come back."""
    params, cfg = rote(stok, "<|assistant|><|call|>delegate sum<|result|>")
    (r,), batch = run(params, cfg, stok, ["Add up."], slots=1, max_len=256, max_calls=1, max_depth=2,
                      max_subagents=2)
    chain = list(sub.every_record([r]))
    assert len(chain) == 3 and [len(c.subagents) for c in chain] == [1, 1, 0]
    assert batch.pool.n_used == 0
