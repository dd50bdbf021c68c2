"""Fitting a history into a budget (minagent/tasks/context/fit.py): invariants over random histories.

    python -m pytest tests/tasks/test_fit.py -q

Histories are random: a first message, then user turns, rounds (a call and its
result) and answers in any order, with results from a few characters to 60,000.
Tokens are counted as len(text) // 4 + 1. At the end, the fit as the agent
loop's view, on a rote model (minagent/tasks/rote.py).
"""

import copy
import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minagent import agent, chat
from minagent import tokenizer as tk
from minagent.chat import Message
from minagent.tasks.context import counting
from minagent.tasks.context import fit as cx
from minagent.tasks.context.fit import CLEARED, NOTE, REFUSED

from conftest import READER, Parts, part

SETTINGS = settings(deadline=None, max_examples=100)


def count(m):
    return len(m.text) // 4 + 1


# ---------------------------------------------------------------- random histories

# result sizes in characters: tiny (never cleared), small, medium, huge
SIZES = st.one_of(st.integers(0, 60), st.integers(60, 400), st.integers(400, 3000), st.integers(3000, 60_000))


@st.composite
def histories(draw, turns=True):
    """A well-formed history. Texts are unique ("3:xxxx"), so equal messages are the same message."""
    h = [Message("first", "0:" + "f" * draw(st.integers(0, 1000)))]
    # with turns, half the histories are sub-agent-like (one long turn) anyway: step 3's case
    events = ["round", "round", "round", "answer"] + (["user"] if turns and draw(st.booleans()) else [])
    for event in draw(st.lists(st.sampled_from(events), max_size=60)):
        if event == "round":
            h.append(Message("model", f"{len(h)}:<|call|>cat {'c' * draw(st.integers(0, 80))}<|result|>"))
            h.append(Message("result", f"{len(h)}:" + "r" * draw(SIZES)))
        elif event == "answer":
            h.append(Message("model", f"{len(h)}:" + "a" * draw(st.integers(0, 400)) + "<|end|>"))
        else:
            h.append(Message("user", f"{len(h)}:" + "u" * draw(st.integers(0, 4000))))
    return tuple(h)


@st.composite
def cases(draw, turns=True):
    """(history, budget): the budget is any number, a small one, a fraction of the history's
    tokens, or a little over about what step 3 or step 2 would send."""
    h = draw(histories(turns))
    total = sum(map(count, h))
    users = [i for i, m in enumerate(h) if m.kind == "user"] or [len(h) - 2]
    least = count(h[0]) + count(NOTE) + sum(map(count, h[-2:]))            # about the least step 3 sends
    turn = count(h[0]) + count(NOTE) + sum(map(count, h[users[-1]:])) // 2  # about what step 2 sends
    budget = draw(st.one_of(st.integers(1, 40_000), st.integers(1, 3_000),
                            st.floats(0.02, 1.1).map(lambda x: max(1, int(x * total))),
                            st.integers(0, 2_000).map(lambda k: least + k),
                            st.integers(0, 2_000).map(lambda k: turn + k)))
    return h, budget


def expected_view(h, f):
    """What the view must be, from the Fit's indices alone: the first message, the note when
    something was dropped, then every message not dropped, in order, cleared ones as the note."""
    rest = tuple(CLEARED if i in f.cleared else h[i] for i in range(1, len(h)) if i not in f.dropped)
    return (h[0],) + ((NOTE,) if f.dropped else ()) + rest


def whole_by_size(h, budget):
    """The results step 1 keeps whole, computed here again: the newest whose counts together
    fit in a quarter of the budget, and at least the newest one."""
    results = [i for i, m in enumerate(h) if m.kind == "result"]
    keep, used = [], 0
    for i in reversed(results):
        used += count(h[i])
        if keep and used > budget / 4:
            break
        keep.append(i)
    return set(keep)


# ---------------------------------------------------------------- fit: invariants

@SETTINGS
@given(cases())
def test_fit_invariants(case):
    h, budget = case
    before = copy.deepcopy(h)
    f = cx.fit(h, budget, count)
    assert h == before                                    # the stored history is unchanged
    if f.refused:
        assert f.view == () and f.tokens > budget
        return
    assert f.step in (0, 1, 2, 3)
    assert f.tokens == sum(count(m) for m in f.view) <= budget
    assert f.view[0] is h[0]                              # the first message is always kept
    assert f.view == expected_view(h, f)                  # nothing else is changed, nothing reordered
    assert len(h) - 1 not in f.dropped                    # the newest message is always sent
    assert not set(f.cleared) & set(f.dropped)
    assert (f.step == 0) == (f.view == h)
    assert (f.step in (2, 3)) == bool(f.dropped)


@SETTINGS
@given(cases())
def test_a_call_is_never_separated_from_its_result(case):
    h, budget = case
    f = cx.fit(h, budget, count)
    for i, m in enumerate(h):
        if m.kind == "result":
            assert (i in f.dropped) == (i - 1 in f.dropped)
    for prev, m in zip(f.view, f.view[1:]):
        if m.kind == "result":
            assert prev.kind == "model" and "<|call|>" in prev.text


@SETTINGS
@given(cases())
def test_clearing_rules(case):
    h, budget = case
    f = cx.fit(h, budget, count)
    can = cx.clearable(h, budget, count)
    if f.step == 1:
        # the oldest 4j clearable results, or all of them when fewer than four would be left
        n = len(f.cleared)
        assert list(f.cleared) == can[:n]
        assert n % 4 == 0 or n == len(can)
        assert n in cx.group_sizes(len(can))
        smaller = [k for k in cx.group_sizes(len(can)) if k < n]   # the group before did not fit
        if smaller:
            saved = sum(count(h[i]) - count(CLEARED) for i in can[:smaller[-1]])
            assert sum(map(count, h)) - saved > budget
    if f.step in (2, 3):                                  # on top of all of step 1's clearing
        assert set(can) <= set(f.cleared) | set(f.dropped)
    for i in f.cleared:                                   # small results are left alone
        assert count(h[i]) > cx.SMALL_FACTOR * count(CLEARED)
    assert not whole_by_size(h, budget) & set(f.cleared)   # the newest, within a quarter, stay whole
    results = [m for m in f.view if m.kind == "result"]
    if results:                                            # at least one result stays whole
        assert any(m is not CLEARED for m in results)


@SETTINGS
@given(cases(), st.integers(0, 60_000))
def test_the_cleared_prefix_only_grows(case, size):
    h, budget = case
    """For the prefix cache: one more round never puts back a result that was cleared, and
    the cleared set changes only by whole groups (or by taking all clearable ones)."""
    longer = h + (Message("model", f"{len(h)}:<|call|>cat x<|result|>"), Message("result", f"{len(h) + 1}:" + "r" * size))
    f1, f2 = cx.fit(h, budget, count), cx.fit(longer, budget, count)
    assume(f1.step in (0, 1) and f2.step in (0, 1))
    assert set(f1.cleared) <= set(f2.cleared)


@SETTINGS
@given(histories(turns=False), st.data())
def test_old_trim_refuses_one_long_turn_that_fit_serves(h, data):
    """A sub-agent's history: one turn, its brief, then rounds. Over budget, old_trim has nowhere
    to cut; fit sends the newest rounds whenever the newest one fits next to the brief and note."""
    assume(h[-1].kind == "result")
    total = sum(map(count, h))
    need = count(h[0]) + count(NOTE) + count(h[-2]) + count(h[-1])
    assume(need < total)
    budget = data.draw(st.integers(need, total - 1))
    assert cx.old_trim(h, budget, count).refused
    f = cx.fit(h, budget, count)
    assert not f.refused and f.tokens <= budget and f.view[-2:] == h[-2:]


@SETTINGS
@given(cases())
def test_old_trim_cuts_only_where_a_user_message_starts(case):
    h, budget = case
    f = cx.old_trim(h, budget, count)
    assert f.cleared == ()
    if f.refused:
        return
    assert f.tokens == sum(map(count, f.view)) <= budget
    if f.dropped:
        assert f.view[:2] == (h[0], NOTE) and f.view[2].kind == "user"
        assert f.view[2:] == h[max(f.dropped) + 1:]


# ---------------------------------------------------------------- fit: known answers

def note5(m):
    """The docstring's counts: a note is 5 tokens, anything else one per character."""
    return 5 if m.text in (cx.CLEARED_NOTE, cx.TRIMMED_NOTE) else len(m.text)


def six_rounds():
    h = [Message("first", "f" * 10)]
    for k in range(6):
        h += [Message("model", f"c{k}"), Message("result", "abcdef"[k] * 20)]
    return tuple(h)


def test_worked_example():
    h = six_rounds()                                       # 10 + 6 * (2 + 20) = 142 tokens
    assert cx.fit(h, 200, note5) == cx.Fit(h, 0, (), (), 142)
    f = cx.fit(h, 100, note5)                              # r1..r4 cleared, four at once, not three
    assert (f.step, f.cleared, f.dropped, f.tokens) == (1, (2, 4, 6, 8), (), 82)
    f = cx.fit(h, 100, note5, group=1)                     # one at a time: three are enough
    assert (f.step, f.cleared, f.dropped, f.tokens) == (1, (2, 4, 6), (), 97)
    assert cx.group_sizes(10, group=3) == [3, 6, 9, 10] and cx.group_sizes(0) == []
    with pytest.raises(ValueError, match="group"):
        cx.group_sizes(10, group=0)
    f = cx.fit(h, 60, note5)                               # all five cleared is 67: drop rounds too
    assert (f.step, f.cleared, f.dropped, f.tokens) == (3, (6, 8, 10), (1, 2, 3, 4), 58)
    assert f.view[:2] == (h[0], NOTE) and f.view[-2:] == h[-2:]
    f = cx.fit(h, 30, note5)                               # first + note + newest round = 37
    assert (f.step, f.tokens, f.view) == (REFUSED, 37, ())
    assert cx.old_trim(h, 100, note5).refused              # one turn: nowhere to cut


def test_whole_user_turns():
    h = (Message("first", "f" * 10), Message("model", "hi"), Message("user", "u" * 30),
         Message("model", "c1"), Message("result", "r" * 8), Message("user", "v" * 10),
         Message("model", "c2"), Message("result", "s" * 8))
    f = cx.fit(h, 50, note5)             # 72 tokens; results of 8 are too small to clear
    assert (f.step, f.dropped, f.tokens) == (2, (1, 2, 3, 4), 10 + 5 + 10 + 2 + 8)
    f = cx.fit(h, 20, note5)             # even the newest turn (10 + 5 + 20) is too big
    assert f.refused
    g = cx.fit(h[:5] + (Message("user", "v" * 10),), 30, note5)   # ends on a user message
    assert (g.step, g.view) == (2, (h[0], NOTE, Message("user", "v" * 10)))


def test_rounds_of_the_newest_turn_keep_its_user_message():
    h = (Message("first", "f" * 10), Message("user", "u" * 10),
         *[m for k in range(4) for m in (Message("model", f"c{k}"), Message("result", "r" * 9))])
    f = cx.fit(h, 40, note5)             # first 10 + note 5 + request 10 + newest round 11 = 36
    assert f.step == 3 and f.view == (h[0], NOTE, h[1]) + h[-2:]


def test_malformed_histories_are_rejected():
    with pytest.raises(ValueError, match="first"):
        cx.fit((Message("user", "hi"),), 10, count)
    with pytest.raises(ValueError, match="result must follow"):
        cx.fit((Message("first", "hi"), Message("result", "x")), 10, count)
    with pytest.raises(ValueError, match="kind"):
        cx.fit((Message("first", "hi"), Message("first", "again")), 10, count)


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Message("first", "hi").text = "changed"


def test_the_agent_is_told_about_clearing():
    assert "cleared" in cx.INSTRUCTIONS and "do not stop" in cx.INSTRUCTIONS and "again" in cx.INSTRUCTIONS
    assert cx.REFUSAL_MESSAGE.startswith("This conversation got too long for the model to read at once.")


def test_render_view_and_exact_counts():
    f = cx.fit(six_rounds(), 60, note5)
    trace = cx.render_view(f.view, chat.MINAGENT)
    assert chat.text(trace[:4]) == ("<|user|>ffffffffff<|assistant|><|user|>" + cx.TRIMMED_NOTE + "<|assistant|>"
                                    "c2" + cx.CLEARED_NOTE + "<|assistant|>")
    assert [s.author for s in trace] == [chat.PROGRAM, chat.PROGRAM] + [chat.MODEL, chat.PROGRAM] * 4
    tok = tk.train("the mill by the river turns; " * 50 + cx.CLEARED_NOTE + cx.TRIMMED_NOTE, 300)
    counter = counting.exact_counter(tok, chat.MINAGENT)        # counts each message as rendered
    tokens, _ = chat.render(trace, tok)
    assert sum(map(counter, f.view)) == len(tokens)


def test_counter_counts_each_message_once():
    calls = []
    counter = counting.Counter(lambda m: calls.append(m) or len(m.text))
    m = Message("result", "x" * 100)
    assert counter(m) == counter(m) == counter(Message("result", "x" * 100)) == 100
    assert calls == [m]
    h = six_rounds()
    cx.fit(h, 60, counter)
    cx.fit(h, 60, counter)
    assert len(calls) == len(set(h) | {CLEARED, NOTE, m})   # once per distinct message, over both fits


# ---------------------------------------------------------------- the fit as the loop's view

FMT = chat.MINAGENT
def refills_by_messages(history, budget, count, fitter, render):
    """The loop's refills, recomputed message by message (a slow reference for its token-level reuse).

    After each result the new view is compared with what the sequence held: the last view and
    the model's call after it. A view that is not an extension of it is pushed again from its
    first changed message on; everything before that message is reused.
    """
    total, held = 0, history[:1]
    for j in range(len(history)):
        if history[j].kind != "result":
            continue
        before, view = held + (history[j - 1],), fitter(history[:j + 1], budget, count).view
        if view[:len(before)] != before:
            i = next(k for k, (a, b) in enumerate(zip(before, view)) if a != b)
            total += len(render(view)) - len(render(view[:i]))
        held = view
    return total


def run_reader(params, cfg, stok, slots=2, max_len=1024, max_calls=8, **view):
    batch = agent.new_batch(params, cfg, stok, FMT, slots=slots, max_len=max_len)
    kw = dict(view=functools.partial(cx.fitted_view, **view)) if view else {}
    (r,) = agent.run(batch, stok, FMT, ["Read every part."], [Parts()], max_calls=max_calls, **kw)
    assert batch.pool.n_used == 0
    return r


@pytest.mark.slow
def test_fitting_clears_old_results_reuses_the_prefix_and_keeps_the_history(stok, rote):
    params, cfg = rote(stok, READER)
    plain = run_reader(params, cfg, stok)
    fitted = run_reader(params, cfg, stok, budget=800)

    # Without a budget the episode outgrows max_len: it ends, and loses nothing (the history has every result).
    assert plain.status == "max_len" and plain.refills == 0
    assert [m.text for m in plain.history if m.kind == "result"] == [r for _, r in plain.calls]
    render = lambda view: list(chat.render(cx.render_view(view, FMT), stok)[0])   # noqa: E731
    assert list(plain.tokens) == render(plain.history[:-1])                 # all but the result that did not fit

    # With a budget of 800 the oldest results are cleared four at a time.
    count = counting.exact_counter(stok, FMT)
    results = [j for j, m in enumerate(fitted.history) if m.kind == "result"]
    assert [cx.fit(fitted.history[:j + 1], 800, count).step for j in results] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert fitted.status == "calls"
    assert fitted.history[:len(plain.history)] == plain.history               # the stored history: everything
    assert fitted.refills == refills_by_messages(fitted.history, 800, count, cx.fit, render) > 0
    last = cx.fit(fitted.history[:-1], 800, count).view                       # the last view sent
    sent_tokens, sent_authors = chat.render(cx.render_view(last + fitted.history[-1:], FMT), stok)
    np.testing.assert_array_equal(fitted.tokens, sent_tokens)              # the record holds the last view
    np.testing.assert_array_equal(fitted.authors, sent_authors)            # and who wrote each of its tokens


@pytest.mark.parametrize("fitting", [cx.fit, cx.old_trim])
def test_refusal_is_final(stok, rote, fitting):
    """A budget no view fits: the first result ends the episode with the refusal message."""
    params, cfg = rote(stok, READER)
    r = run_reader(params, cfg, stok, budget=20, fitting=fitting)
    assert (r.status, r.answer, len(r.calls)) == ("refused", cx.REFUSAL_MESSAGE, 1)
    assert r.history[-1] == Message("result", part(1))


def test_old_trimming_refuses_a_single_turn_that_fit_finishes(stok, rote):
    """The design document's sub-agent in miniature: one user message, nowhere for the old trimming to cut."""
    params, cfg = rote(stok, READER)
    old = run_reader(params, cfg, stok, budget=800, fitting=cx.old_trim)
    new = run_reader(params, cfg, stok, budget=800, fitting=cx.fit)
    assert old.status == "refused" and len(old.calls) == 5
    assert new.status == "calls" and len(new.calls) == 8
