"""The exit margin (minagent/tasks/shop/margin.py): the five tools' scores are the model's own
log-probabilities; the exit rule only ever moves an ask_human answer, and never to a tool that needs approval;
the refund rule only ever moves a refund answer, and only to ask_human.

    python -m pytest tests/tasks/test_margin.py -q

Hermetic: a tokenizer trained in-process on a few gold calls, a tiny model with random weights.
"""

import jax
import numpy as np
import pytest

from minagent import chat, model
from minagent import tokenizer as tk
from minagent.tasks.shop import data, gate, grammar, margin

GOLD = [data.gold_json(r) for r in data.train_set(40)]
TOK = tk.train("Where is my order? Please refund me. " * 10 + "\n".join(GOLD), vocab_size=350)
END = TOK.special("<|end|>")
CFG = model.Config(vocab_size=TOK.n_vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
PARAMS = jax.tree.map(lambda w: 4.0 * w if w.ndim > 1 else w, model.init(jax.random.PRNGKey(0), CFG))
REQS = data.test_set(0)[:3]
PROMPTS = [chat.Segment(chat.PROGRAM, r.text) for r in REQS]
ASK = '{"tool": "ask_human", "args": {"reason": "unclear request"}}'
STATUS = '{"tool": "order_status", "args": {"order_id": "A1234"}}'
REFUND = '{"tool": "refund", "args": {"order_id": "A1234", "amount": 20}}'


def reference_score(prompt, tool):
    """log p of opening(tool) after the prompt: one row, unpadded, its own forward pass."""
    ids = chat.encode(TOK, prompt)
    row = ids + TOK.encode_ordinary(margin.opening(tool))
    lp = jax.nn.log_softmax(model.forward(PARAMS, CFG, np.array([row], np.int32))[0], axis=-1)
    return sum(float(lp[j - 1, row[j]]) for j in range(len(ids), len(row)))


@pytest.mark.slow
def test_tool_scores_are_the_models_log_probabilities():
    """Five padded rows in one pass give what the model says one token at a time, for every tool."""
    got = margin.tool_scores(PARAMS, CFG, TOK, PROMPTS[0])
    assert set(got) == set(gate.TOOLS)
    for tool, score in got.items():
        assert score == pytest.approx(reference_score(PROMPTS[0], tool), abs=1e-4)


def test_forced_answers_begin_with_the_tool_and_continue_as_the_model_does():
    tools = ["refund", "book_repair"]
    texts, stopped = margin.forced(PARAMS, CFG, TOK, PROMPTS[:2], tools, END, limit=6)
    assert texts[0].startswith('{"tool": "refund",') and texts[1].startswith('{"tool": "book_repair",')
    given = [chat.Segment(chat.PROGRAM, p.parts + (margin.opening(t),)) for p, t in zip(PROMPTS[:2], tools)]
    rest, same_stopped = grammar.answers(PARAMS, CFG, TOK, given, END, limit=6)
    assert texts == [margin.opening(t) + r for t, r in zip(tools, rest)]
    assert stopped == same_stopped


def test_only_answers_that_take_the_exit_are_looked_at():
    """No ask_human answer: nothing to score, nothing replaced."""
    assert margin.exit_leads(PARAMS, CFG, TOK, PROMPTS, [STATUS, "not json", STATUS], END, below=100.0) == {}


@pytest.mark.slow
def test_the_rule_moves_exits_under_the_margin_to_the_best_movable_tool():
    texts = [ASK, STATUS, ASK]
    stopped = [True, True, True]
    leads = margin.exit_leads(PARAMS, CFG, TOK, PROMPTS, texts, END, below=float("inf"), limit=8)
    assert sorted(leads) == [0, 2]                       # the ask_human answers, and only those
    for i, lead in leads.items():
        scores = margin.tool_scores(PARAMS, CFG, TOK, PROMPTS[i])
        best = max(margin.MOVABLE, key=scores.get)
        assert lead.tool == best and lead.tool not in gate.NEEDS_APPROVAL
        assert lead.lead == pytest.approx(scores["ask_human"] - scores[best])
        assert lead.text.startswith(margin.opening(best))
    smallest = min(lead.lead for lead in leads.values())
    # A margin no lead is under keeps every answer; a margin above every lead replaces every exit.
    assert margin.with_margin(texts, stopped, leads, smallest) == (texts, stopped)
    moved, _ = margin.with_margin(texts, stopped, leads, max(lead.lead for lead in leads.values()) + 1)
    assert moved == [leads[0].text, STATUS, leads[2].text]
    # In between, exactly the exits leading by less than the margin move.
    m = (leads[0].lead + leads[2].lead) / 2
    moved, _ = margin.with_margin(texts, stopped, leads, m)
    assert [a != b for a, b in zip(moved, texts)] == [leads[0].lead < m, False, leads[2].lead < m]
    # below= leaves out the exits that lead by more: with_margin under it gives the same answers.
    some = margin.exit_leads(PARAMS, CFG, TOK, PROMPTS, texts, END, below=m, limit=8)
    assert set(some) == {i for i, lead in leads.items() if lead.lead < m}
    assert margin.with_margin(texts, stopped, some, m) == margin.with_margin(texts, stopped, leads, m)


def test_the_refund_rule_moves_only_refunds_and_only_to_ask_human():
    texts = [REFUND, ASK, REFUND]
    stopped = [True, True, False]
    doubts = margin.refund_leads(PARAMS, CFG, TOK, PROMPTS, texts, END, below=float("inf"), limit=8)
    assert sorted(doubts) == [0, 2]                      # the refund answers, and only those
    for i, lead in doubts.items():
        scores = margin.tool_scores(PARAMS, CFG, TOK, PROMPTS[i])
        assert lead.tool == "ask_human" and lead.text.startswith(margin.opening("ask_human"))
        assert lead.lead == pytest.approx(scores["refund"] - scores["ask_human"])
    assert margin.with_margin(texts, stopped, doubts, min(lead.lead for lead in doubts.values())) == (texts, stopped)
    moved, still = margin.with_margin(texts, stopped, doubts, max(lead.lead for lead in doubts.values()) + 1)
    assert moved == [doubts[0].text, ASK, doubts[2].text]
    assert still == [doubts[0].stopped, True, doubts[2].stopped]
