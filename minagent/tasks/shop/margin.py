"""Margins: an answer stands only when the model clearly prefers it, in two places the cost ranking picks.

Trained on the shop's phrasings, the model meets a request in new words and takes the exit: it
answers ask_human where a working tool was meant, often with that tool close behind. The greedy
answer names one tool, but the model scores all five: the log-probability of writing

    {"tool": "NAME",        after the prompt, for each NAME in gate.TOOLS   (`tool_scores`)

The exit rule: an answer that names ask_human stands when ask_human leads the best tool it may move to
by at least `margin` nats (margin 2: about 7 times as likely); otherwise the answer is written again
with that tool's name given to the model, which writes the arguments itself (`forced`). It moves an
exit only to a tool that runs without a person's approval (MOVABLE: not refund): code may overrule
the model's caution for a cheap action, never to start a costly one the model did not choose.

The refund rule is the same test the other way: an answer that names refund stands when refund leads
ask_human by at least its margin; otherwise it is written again as ask_human. A refund is the one
mistake that costs money, so the model must be sure of it; when it hesitates, a person is asked.
Measured in experiment 07, it cost more than it saved: the refunds asked for in new words lead by as
little as the ones called unasked (docs/applications.md, "Tool choice, the validator and the approval gate").
What was kept instead asks a second adapter (refund_check.py), and uses with_margin to apply its verdict.

Each rule only looks at answers that name its tool. The exit rule never writes a refund, so the refund
rule, applied after it, judges the model's own refunds only. The exit margin is chosen on the
validation split (experiments/07_tool_choice.py). The code after the model is unchanged: the new call
goes through gate.validate and gate.execute like any other.

    texts, stopped = grammar.answers(params, cfg, tok, prompts, end_id)
    leads = exit_leads(params, cfg, tok, prompts, texts, end_id, below=4.0)   # {i: Lead}, computed once
    texts, stopped = with_margin(texts, stopped, leads, 2.0)                   # the answers under the rule
    doubts = refund_leads(params, cfg, tok, prompts, texts, end_id, below=4.0)
    texts, stopped = with_margin(texts, stopped, doubts, 2.0)
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from minagent import chat, model, train
from minagent.tasks.shop import gate, grammar

EXIT = "ask_human"
MOVABLE = tuple(t for t in gate.TOOLS if t != EXIT and t not in gate.NEEDS_APPROVAL)    # where an exit may go
(REFUND,) = gate.NEEDS_APPROVAL            # the one tool that needs a person's approval: "refund"


@dataclasses.dataclass(frozen=True)
class Lead:
    lead: float     # log p(the answer's tool) - log p(the best tool it may move to), in nats
                    # (refund_check.doubts: the checker's log p("yes") - log p("no") instead)
    tool: str       # that tool
    text: str       # the answer written again with its name given
    stopped: bool   # whether that answer reached the end token


@functools.partial(jax.jit, static_argnums=2)
def _next_nll(params, tokens_BxT, cfg):
    """-log p of each next token: column t scores token t + 1 (train.token_nll, as in training)."""
    return train.token_nll(model.forward(params, cfg, tokens_BxT)[:, :-1], tokens_BxT[:, 1:])


def opening(tool):
    """The first characters of an answer that names `tool`, as data.gold_json writes them."""
    return f'{grammar.OPEN}{tool}",'


def scores(params, cfg, tok, prompt, endings, bucket=64):
    """A prompt (chat.Segment) -> {ending: log p of that text after it}, one forward pass of one row per ending."""
    head = chat.encode(tok, prompt)
    rows = [head + tok.encode_ordinary(e) for e in endings]
    width = -(-max(map(len, rows)) // bucket) * bucket          # a few shapes, a few compilations
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    nll = np.asarray(_next_nll(params, jnp.asarray(tokens), cfg))
    return {e: -float(nll[i, len(head) - 1:len(r) - 1].sum()) for i, (e, r) in enumerate(zip(endings, rows))}


def tool_scores(params, cfg, tok, prompt):
    """A prompt (chat.Segment) -> {tool: log p of opening(tool) after it}, one forward pass of five rows."""
    s = scores(params, cfg, tok, prompt, [opening(t) for t in gate.TOOLS])
    return {t: s[opening(t)] for t in gate.TOOLS}


def forced(params, cfg, tok, prompts, tools, end_id, **kw):
    """Answers that start with opening(tool), the rest written by the model (greedy) -> (texts, stopped)."""
    given = [chat.Segment(p.author, p.parts + (opening(t),)) for p, t in zip(prompts, tools)]
    texts, stopped = grammar.answers(params, cfg, tok, given, end_id, **kw)
    return [opening(t) + text for t, text in zip(tools, texts)], stopped


def _leads(params, cfg, tok, prompts, texts, end_id, below, tool, to, **kw):
    """For each answer that names `tool` and leads the best of `to` by under `below` nats -> {index: Lead}."""
    leads = {}
    for i, (p, text) in enumerate(zip(prompts, texts)):
        if gate.validate(text).tool == tool:
            s = tool_scores(params, cfg, tok, p)
            best = max(to, key=s.get)
            if s[tool] - s[best] < below:
                leads[i] = (s[tool] - s[best], best)
    idx = sorted(leads)
    if not idx:
        return {}
    again, stopped = forced(params, cfg, tok, [prompts[i] for i in idx], [leads[i][1] for i in idx], end_id, **kw)
    return {i: Lead(*leads[i], text, s) for i, text, s in zip(idx, again, stopped)}


def exit_leads(params, cfg, tok, prompts, texts, end_id, below, **kw):
    """For each answer that names ask_human with a lead under `below` nats over MOVABLE -> {index: Lead}.
    Compute once with the largest margin of interest; with_margin then applies any margin up to it."""
    return _leads(params, cfg, tok, prompts, texts, end_id, below, EXIT, MOVABLE, **kw)


def refund_leads(params, cfg, tok, prompts, texts, end_id, below, **kw):
    """For each answer that names refund with a lead under `below` nats over ask_human -> {index: Lead}."""
    return _leads(params, cfg, tok, prompts, texts, end_id, below, REFUND, (EXIT,), **kw)


def with_margin(texts, stopped, leads, margin):
    """The answers under a rule -> (texts, stopped): an answer in `leads` leading by under `margin` is replaced."""
    swap = {i for i, lead in leads.items() if lead.lead < margin}
    return ([leads[i].text if i in swap else t for i, t in enumerate(texts)],
            [leads[i].stopped if i in swap else s for i, s in enumerate(stopped)])
