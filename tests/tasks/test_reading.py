"""Long reading missions: gold episodes a real Toolbox reproduces, a reader that needs only its notes
once old results are cleared, and training examples that are exactly the views the model sees.

Run: python -m pytest tests/tasks/test_reading.py -q
"""

import numpy as np
import pytest

from minagent import chat
from minagent.tasks.context import book, counting, reading
from minagent.tasks.context import fit as context
from minagent import tokenizer as tk
from minagent.chat import Message

FMT = chat.MINAGENT


def count(m):
    return len(m.text) // 4 + 1


@pytest.fixture(scope="module")
def tok():
    text = "\n".join(chat.render_message(m, FMT).text for r in reading.generate(40, seed=9) for m in r.history)
    return tk.train(text + context.CLEARED_NOTE + context.TRIMMED_NOTE, vocab_size=400,
                    pattern=tk.SMOLLM_PATTERN, specials=tk.MINAGENT_SPECIALS)


def test_gold_episode():
    r = reading.mission(seed=4, first=12, last=15)
    gold = book.mentions(4, "lighthouse", 12, 15)
    assert r.question == "Which of chapters 12 to 15 mention a lighthouse?"
    assert r.answer == reading.listed(gold)
    context.check(r.history)
    kinds = [m.kind for m in r.history]
    assert kinds == ["first"] + ["model", "result"] * 4 + ["model"]
    box = book.toolbox(4)
    for call, result in zip(r.history[1::2], r.history[2::2]):       # every result is the tool's
        assert result.text == box(call.text.split(FMT.call)[1].removesuffix(FMT.result))
    assert r.history[3].text == reading.note(12, 15, [k for k in gold if k <= 12]) + "<|call|>read 13<|result|>"
    assert r.history[-1].text.endswith(f". answer: {r.answer}<|end|>")
    assert reading.answer_of(r.history[-1].text.removesuffix("<|end|>")) == r.answer
    assert reading.note(14, 15, [13]) == "chapter 14 of 15: no. so far: 13"
    assert reading.note(15, 15, [13, 15]) == "chapter 15 of 15: yes. answer: 13 15"
    assert reading.note(3, 9, []) == "chapter 3 of 9: no. so far: none"
    assert reading.listed([]) == "none" and reading.answer_of("I give up") == "I give up"


def test_generate_is_deterministic_and_in_range():
    rs = reading.generate(30, seed=1, lengths=(2, 9), motifs=("lighthouse", "fox"))
    assert rs == reading.generate(30, seed=1, lengths=(2, 9), motifs=("lighthouse", "fox"))
    assert rs[:5] == reading.generate(5, seed=1, lengths=(2, 9), motifs=("lighthouse", "fox"))
    assert {r.motif for r in rs} == {"lighthouse", "fox"}
    for r in rs:
        assert 2 <= r.last - r.first + 1 <= 9 and 1 <= r.first and r.last <= book.N_CHAPTERS
    assert {r.answer == "none" for r in rs} == {True, False}        # both kinds of answer occur
    assert all(r.last <= 12 for r in reading.generate(30, seed=1, lengths=(2, 9), within=12))
    for lengths, within in (((2, 13), 12), ((0, 3), 20), ((5, 3), 20), ((2, 9), book.N_CHAPTERS + 1)):
        with pytest.raises(ValueError, match="lengths"):
            reading.generate(3, seed=1, lengths=lengths, within=within)


@pytest.mark.parametrize("budget", [None, 4000, 700, 450, 330])
def test_the_reader_needs_only_the_view(budget):
    """Played against fitted views, the reader writes the gold episode exactly: the notes carry it."""
    steps = set()
    for r in reading.generate(12, seed=2, lengths=(6, 20)):
        out = reading.scripted(r, budget, count)
        assert out["status"] == "done" and out["answer"] == r.answer
        assert out["history"] == r.history                           # the stored history keeps everything
        assert budget is None or max(out["sent"]) <= budget
        steps |= set(out["steps"])
    assert (steps == {0}) if budget in (None, 4000) else ({1, 3} <= steps)   # small budgets clear and drop


def test_old_trimming_refuses_a_long_single_turn():
    """The second design document's case: one user message, nowhere to cut: old trimming refuses once over budget."""
    r = reading.mission(seed=0, first=1, last=20)
    old = reading.scripted(r, 700, count, fitting=context.old_trim)
    new = reading.scripted(r, 700, count, fitting=context.fit)
    assert old["status"] == "refused" and old["answer"] == context.REFUSAL_MESSAGE
    assert old["refused_at"] > 700 and len(old["sent"]) < 10
    assert new["status"] == "done" and new["answer"] == r.answer


def test_examples_are_the_views_with_one_new_message_each(tok):
    budget = 400
    counter = counting.exact_counter(tok, FMT)
    for r in reading.generate(6, seed=3, lengths=(8, 14), sentences=8):
        exs = reading.examples(r, tok, budget, count=counter)
        vs = reading.views(r.history, budget, counter)
        assert any(m == context.CLEARED for v, _ in vs for m in v)       # the model sees cleared results
        assert len(exs) < len(vs)                                       # some views only grew: merged
        # Every model message is learned exactly once, after exactly the view it was written from.
        supervised = []
        for tokens, authors in exs:
            assert len(tokens) <= budget + 40                             # a view, plus one message
            runs = np.flatnonzero(np.diff(np.r_[0, authors, 0]))         # [start, end) of each MODEL run
            supervised += [(tuple(tokens[:s]), tok.decode(tokens[s:e])) for s, e in zip(runs[::2], runs[1::2])]
        assert len(supervised) == len(vs)
        for (prefix, text), (view, i) in zip(supervised, vs):
            assert text == r.history[i].text
            assert prefix == tuple(chat.render(context.render_view(view, FMT), tok)[0])


def test_examples_refuse_a_budget_too_small(tok):
    r = reading.mission(seed=0, first=1, last=5)
    with pytest.raises(ValueError):
        reading.examples(r, tok, 60)


def test_a_cleared_newest_result_would_fool_the_reader():
    """The reader trusts the newest result: fit must (and does) keep it whole."""
    r = reading.mission(seed=0, first=1, last=3)
    view = r.history[:2] + (Message("result", context.CLEARED_NOTE),)   # first, read 1, chapter 1 cleared
    assert "lighthouse" in r.history[2].text                           # book 0, chapter 1 has one...
    assert reading.reader(r.history[:3]) == r.history[3].text == "chapter 1 of 3: yes. so far: 1<|call|>read 2<|result|>"
    assert reading.reader(view).startswith("chapter 1 of 3: no. so far: none")   # ...that a cleared result hides
    for budget in range(60, 400, 20):
        f = context.fit(r.history[:3], budget, count)
        assert f.refused or f.view[-1] == r.history[2]
