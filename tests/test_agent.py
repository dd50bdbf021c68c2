"""The agent loop: the design documents' baseline test, budgets, and no recompilation.

    /work/venv/bin/python -m pytest tests/test_agent.py -q      # about 80 s on 2 CPU cores

The baseline: a tiny two-layer model trained on a single trace until it knows
it by heart replays it identically in the loop (call, result and answer
included), with and without the cache.

Context fitting and sub-agents run on a rote model (`rote_model`): a transformer
whose weights make it write a fixed script, so the episodes are known exactly.
A view that clears old results must reuse the cache of everything before the
first cleared one; the stored history must keep everything; a budget no view
fits ends with the refusal; past max_len an episode ends, it does not raise.
"""

import dataclasses

import jax
import numpy as np
import pytest

from minagent import agent, chat, missions, model, train
from minagent import context as cx
from minagent import tokenizer as tk
from minagent.context import Message
from minagent.tools import Toolbox

FMT = chat.MINAGENT


@pytest.fixture(scope="module")
def memorised(tok):
    """A 2-layer model trained on one two-call mission until it knows it by heart."""
    mission = missions.generate(1, seed=3, families=["together"])[0]
    tokens, authors = chat.render(mission.trace, tok)
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    params = model.init(jax.random.PRNGKey(0), cfg)
    tcfg = train.TrainConfig(steps=300, batch_size=1, seq_len=len(tokens), lr=1e-2, warmup=10,
                             weight_decay=0.0)
    params, history = train.train(params, cfg, [(tokens, authors)], tcfg, progress=False)
    assert history[-1]["loss"] < 0.01
    return mission, tokens, authors, params, cfg


@pytest.mark.parametrize("cache", [True, False])
def test_memorised_trace_replays_identically(tok, memorised, cache):
    mission, tokens, authors, params, cfg = memorised
    records, batch = agent.run(params, cfg, tok, FMT, [mission.trace[0]], [Toolbox(mission.seed)],
                               slots=2, cache=cache, max_len=128)
    (r,) = records
    assert r.status == "done"
    np.testing.assert_array_equal(r.tokens, tokens)       # call, result and answer included
    np.testing.assert_array_equal(r.authors, authors)     # and who wrote each token
    assert r.answer == mission.answer
    assert [call for call, _ in r.calls] == list(mission.calls)
    assert batch.pool.n_used == 0                          # every page went back


def test_cache_pushes_each_position_once(tok, memorised):
    """With the cache every token goes through the model once; without it, each resume re-reads the episode."""
    mission, tokens, _, params, cfg = memorised
    prompts, boxes = [mission.trace[0]], [Toolbox(mission.seed)]
    (with_cache,), _ = agent.run(params, cfg, tok, FMT, prompts, boxes, slots=2, cache=True, max_len=128)
    (without,), _ = agent.run(params, cfg, tok, FMT, prompts, [Toolbox(mission.seed)], slots=2, cache=False,
                              max_len=128)
    # every token but the last (<|end|>, sampled and never fed back) went through the model once
    assert with_cache.positions == len(tokens) - 1
    assert without.positions > with_cache.positions


def test_budgets_hold_and_no_recompilation_after_warm_up(tok):
    """200 episodes of varied lengths on a random-weights model: budgets hold, nothing recompiles."""
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    params = model.init(jax.random.PRNGKey(1), cfg)
    ms = missions.generate(220, seed=7)
    run = dict(slots=16, max_len=256, temperature=1.0, max_calls=3, max_stretch=12)
    warm, batch = agent.run(params, cfg, tok, FMT, [m.trace[0] for m in ms[:20]],
                            [Toolbox(m.seed) for m in ms[:20]], **run)
    batch.warmup()          # compiles every (bucket, page-table width) shape the batch can use
    compiles = batch.compiles
    records, batch = agent.run(params, cfg, tok, FMT, [m.trace[0] for m in ms[20:]],
                               [Toolbox(m.seed) for m in ms[20:]], batch=batch, **run)
    assert batch.compiles == compiles
    assert batch.pool.n_used == 0
    for r in warm + records:
        assert r.status in ("done", "stretch", "calls")
        assert len(r.calls) <= 3
        # no stretch of model-written tokens is longer than the budget
        runs = np.diff(np.flatnonzero(np.diff(np.r_[0, r.authors, 0])))[::2]
        assert runs.max(initial=0) <= 12
    assert {r.status for r in warm + records} >= {"stretch"}


# ---------------------------------------------------------------- a model that writes by rote

@pytest.fixture(scope="module")
def stok():
    """A tokenizer in which "delegate" is a few distinct pieces (a rote model needs distinct tokens)."""
    text = "\n".join(chat.text(m.trace) for m in missions.generate(300, seed=0))
    return tk.train(text + " delegate" * 300, vocab_size=400, specials=tk.MINAGENT_SPECIALS)


def rote_model(tok, *scripts):
    """Params of a transformer that, greedily, writes after token a the token that follows a in `scripts`.

    The layers add nothing (their output projections are zero), so the last position's logits
    depend on its token only: token a is embedded as the one-hot of its state s(a), and the head
    maps state s(a) to the token that follows a. rote_model(tok, "<|assistant|>ok<|end|>") answers
    "ok<|end|>" to any prompt that ends with <|assistant|>. It runs through the real Batch, cache
    and decode step, so the loop can be tested on exact, known episodes.
    """
    rules = {}
    for script in scripts:
        ids = tok.encode(script)
        for a, b in zip(ids, ids[1:]):
            assert rules.setdefault(a, b) == b, f"{tok.decode([a])!r} is followed by two different tokens"
    D = 16                                          # one config for every script: its steps compile once
    assert len(rules) < D, "a state per rule, and state 0"
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                       tie_embeddings=False)
    params = model.init(jax.random.PRNGKey(0), cfg)
    layers = dict(params["layers"], wo=0 * params["layers"]["wo"], w_down=0 * params["layers"]["w_down"])
    state = {a: s for s, a in enumerate(rules, 1)}                  # state 0: every other token
    embed_VxD = np.zeros((cfg.vocab_size, D), np.float32)
    embed_VxD[np.arange(cfg.vocab_size), [state.get(a, 0) for a in range(cfg.vocab_size)]] = 1
    unembed_DxV = np.zeros((D, cfg.vocab_size), np.float32)
    for a, b in rules.items():
        unembed_DxV[state[a], b] = 10.0
    return dict(params, layers=layers, embed=jax.numpy.asarray(embed_VxD),
                unembed=jax.numpy.asarray(unembed_DxV)), cfg


def part(n):
    """A long tool result (184 tokens for stok): long enough to be worth clearing."""
    return f"part {n}: " + " ".join(str(100 + 7 * j) for j in range(60))


class Parts:
    """A toolbox whose n-th call returns part(n), whatever the call."""

    def __init__(self):
        self.n = 0

    def __call__(self, call):
        self.n += 1
        return part(self.n)


def test_rote_model_writes_its_script(stok):
    params, cfg = rote_model(stok, "<|assistant|>ok<|end|>")
    (r,), batch = agent.run(params, cfg, stok, FMT, ["Hi."], [Toolbox(0)], slots=1, max_len=256)
    assert (r.status, r.answer, r.calls, r.depth) == ("done", "ok", [], 0)
    assert r.history == (Message("first", "Hi."), Message("model", "ok<|end|>"))


def test_delegate_answer_becomes_the_result(stok):
    """A root episode delegates; its sub-agent answers; the answer is the root's tool result.

    One slot: the root must give it up (park) while it waits, or the sub-agent could never run.
    """
    params, cfg = rote_model(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    prompt = chat.Segment(chat.PROGRAM, "<|user|>Add up.<|assistant|><|call|>")   # the model goes on from <|call|>
    (r,), batch = agent.run(params, cfg, stok, FMT, [prompt], [Toolbox(0)], slots=1, max_len=256,
                            system=cx.INSTRUCTIONS, subagents=True)
    assert (r.status, r.answer, r.calls) == ("done", "ok", [("delegate sum", "ok")])
    (sub,) = r.subagents
    assert (sub.status, sub.answer, sub.depth, sub.calls) == ("done", "ok", 1, [])
    assert sub.history[0] == Message("first", "sum")                 # its only user message: the brief
    assert list(sub.tokens) == stok.encode(chat.prompt(FMT, "sum", system=cx.INSTRUCTIONS).text + "ok<|end|>")
    assert list(r.tokens) == stok.encode(prompt.text + "delegate sum<|result|>ok<|assistant|>ok<|end|>")
    assert list(agent.every_record([r])) == [r, sub]
    assert batch.pool.n_free == batch.pool.n_pages - 1


def test_delegation_limits(stok):
    """An agent that always delegates: sub-agents cannot delegate (depth 1), and a root starts at most two."""
    params, cfg = rote_model(stok, "<|assistant|><|call|>delegate sum<|result|>")
    (r,), batch = agent.run(params, cfg, stok, FMT, ["Add up."], [Toolbox(0)], slots=2, max_len=256,
                            max_calls=3, subagents=True, max_subagents=2)
    depth_error = agent.delegation("delegate sum", 1, 0)[1]
    assert r.status == "calls" and len(r.subagents) == 2
    for sub in r.subagents:
        assert sub.status == "calls" and sub.calls == [("delegate sum", depth_error)] * 3
    assert [result for _, result in r.calls] == [agent.subagent_result(r.subagents[0])] * 2 + [
        agent.delegation("delegate sum", 0, 2, max_subagents=2)[1]]
    assert all(result.startswith("error: ") for _, result in r.calls)
    assert batch.pool.n_free == batch.pool.n_pages - 1


def test_parked_callers_have_pages_by_default(stok):
    """Two callers, one slot: both park (pages kept) before either sub-agent runs. The default pool
    has room for them and the running sequence: (1 slot + 2 parked) x 4 pages, not 1 x 4 (OutOfPages)."""
    params, cfg = rote_model(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    prompt = chat.Segment(chat.PROGRAM, "<|user|>Add up.<|assistant|><|call|>")
    records, batch = agent.run(params, cfg, stok, FMT, [prompt, prompt], [Toolbox(0), Toolbox(1)], slots=1,
                               max_len=64, subagents=True)
    for r in records:
        assert (r.status, r.answer, r.calls) == ("done", "ok", [("delegate sum", "ok")])
        assert [sub.status for sub in r.subagents] == ["done"]
    assert batch.pool.n_pages == 1 + (1 + 2) * 4 and batch.pool.n_used == 0


def test_a_brief_too_long_is_an_error_for_the_caller(stok):
    """The sub-agent's opening (INSTRUCTIONS and the brief: 167 tokens) + a stretch > max_len: no sub-agent."""
    params, cfg = rote_model(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    prompt = chat.Segment(chat.PROGRAM, "<|user|>Add up.<|assistant|><|call|>")
    (r,), batch = agent.run(params, cfg, stok, FMT, [prompt], [Toolbox(0)], slots=1, max_len=128,
                            system=cx.INSTRUCTIONS, subagents=True)
    assert (r.status, r.answer, r.calls, r.subagents) == ("done", "ok", [("delegate sum",
                                                                          "error: the brief is too long")], [])
    assert len(batch.seqs) == 1 and batch.pool.n_used == 0


def test_default_pool_holds_a_sequence_of_max_len(stok):
    """max_len=100, page_size=16: 100 tokens need pages_for(100 - 1, 16) = 7 pages, not 100 // 16 = 6."""
    params, cfg = rote_model(stok, "<|assistant|>ok<|end|>")
    n = len(stok.encode(chat.prompt(FMT, "Hi.").text))
    (r,), batch = agent.run(params, cfg, stok, FMT, ["Hi."], [Toolbox(0)], slots=1, max_len=100,
                            max_stretch=100 - n)      # no sub-agents (the default): a pool for 1 sequence
    assert (r.status, r.answer) == ("done", "ok") and batch.pool.n_pages == 1 + 7


def test_unknown_fitting_names_the_choices(stok):
    with pytest.raises(ValueError, match="'fit', 'old'"):
        agent.run(None, None, stok, FMT, ["Hi."], [Toolbox(0)], budget=100, fitting="new")


def test_delegate_is_split_on_any_whitespace():
    """As Toolbox splits a call: "delegate\tRead ch01" is a delegation, not an unknown tool."""
    assert agent.delegation("delegate\tRead ch01", 0, 0) == ("Read ch01", None)
    assert agent.delegation(" delegate\n Read ch01\n", 0, 0) == ("Read ch01", None)
    assert agent.delegation("delegate\t", 0, 0) == (None, "error: delegate takes a brief")
    assert agent.delegation("delegates x", 0, 0) == (None, None)


def test_delegation_rule():
    assert agent.delegation("delegate read ch01 ", 0, 0) == ("read ch01", None)
    assert agent.delegation("add 2 3", 0, 0) == (None, None)                    # the toolbox's call
    assert agent.delegation("delegate x", 1, 0)[1].startswith("error: ")       # depth limit
    assert agent.delegation("delegate x", 1, 0, max_depth=2) == ("x", None)
    assert agent.delegation("delegate x", 0, 8)[1].startswith("error: ")       # 8 already started
    assert agent.delegation("delegate", 0, 0)[1].startswith("error: ")         # no brief
    assert agent.delegation("delegate say <|end|>", 0, 0) == ("say < |end|>", None)   # no special smuggled
    done = agent.Record("done", "42", [], np.zeros(0), np.zeros(0), 0)
    refused = dataclasses.replace(done, status="refused", answer=cx.REFUSAL_MESSAGE)
    assert agent.subagent_result(done) == "42"
    assert agent.subagent_result(refused) == cx.REFUSAL_MESSAGE
    assert agent.subagent_result(dataclasses.replace(done, status="stretch")).startswith("error: ")


def test_opening():
    assert agent.opening(FMT, "Hi.") == (Message("first", "Hi."), chat.prompt(FMT, "Hi."))
    assert agent.opening(FMT, "Hi.", system="Be brief.")[1] == chat.prompt(FMT, "Hi.", system="Be brief.")
    assert agent.opening(FMT, chat.prompt(FMT, "Hi."), system="ignored") == (Message("first", "Hi."),
                                                                             chat.prompt(FMT, "Hi."))


# ---------------------------------------------------------------- context fitting in the loop

READER = "<|assistant|><|call|>cat x<|result|>"     # reads part after part, forever


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


def test_fitting_clears_old_results_reuses_the_prefix_and_keeps_the_history(stok):
    params, cfg = rote_model(stok, READER)
    kw = dict(slots=2, max_len=1024, max_calls=8)
    (plain,), _ = agent.run(params, cfg, stok, FMT, ["Read every part."], [Parts()], **kw)
    (fitted,), batch = agent.run(params, cfg, stok, FMT, ["Read every part."], [Parts()], budget=800, **kw)

    # Without a budget the episode outgrows max_len: it ends, and loses nothing (the history has every result).
    assert plain.status == "max_len" and (plain.refills, plain.view_steps) == (0, [])
    assert [m.text for m in plain.history if m.kind == "result"] == [r for _, r in plain.calls]
    render = lambda view: list(chat.render(cx.render_view(view, FMT), stok)[0])   # noqa: E731
    assert list(plain.tokens) == render(plain.history[:-1])                 # all but the result that did not fit

    # With a budget of 800 the oldest results are cleared four at a time (the counts above the test).
    count = cx.exact_counter(stok, FMT)
    assert fitted.status == "calls" and fitted.view_steps == [0, 0, 0, 0, 1, 1, 1, 1]
    assert fitted.history[:len(plain.history)] == plain.history               # the stored history: everything
    assert fitted.refills == refills_by_messages(fitted.history, 800, count, cx.fit, render) > 0
    last = cx.fit(fitted.history[:-1], 800, count).view                       # the last view sent
    sent_tokens, sent_authors = chat.render(cx.render_view(last + fitted.history[-1:], FMT), stok)
    np.testing.assert_array_equal(fitted.tokens, sent_tokens)              # the record holds the last view
    np.testing.assert_array_equal(fitted.authors, sent_authors)            # and who wrote each of its tokens
    assert fitted.positions == batch.positions[max(batch.seqs)] and batch.pool.n_used == 0


@pytest.mark.parametrize("fitting", ["fit", "old"])
def test_refusal_is_final(stok, fitting):
    """A budget no view fits: the first result ends the episode with the refusal message."""
    params, cfg = rote_model(stok, READER)
    (r,), batch = agent.run(params, cfg, stok, FMT, ["Read every part."], [Parts()], slots=1, max_len=512,
                            budget=20, fitting=fitting)
    assert (r.status, r.answer, r.view_steps, len(r.calls)) == ("refused", cx.REFUSAL_MESSAGE, [cx.REFUSED], 1)
    assert r.history[-1] == Message("result", part(1)) and batch.pool.n_used == 0


def test_old_trimming_refuses_a_single_turn_that_fit_finishes(stok):
    """The SPEC's sub-agent in miniature: one user message, nowhere for the old trimming to cut."""
    params, cfg = rote_model(stok, READER)
    kw = dict(slots=2, max_len=1024, max_calls=8, budget=800)
    (old,), _ = agent.run(params, cfg, stok, FMT, ["Read every part."], [Parts()], fitting="old", **kw)
    (new,), _ = agent.run(params, cfg, stok, FMT, ["Read every part."], [Parts()], fitting="fit", **kw)
    assert old.status == "refused" and old.view_steps == [0, 0, 0, 0, cx.REFUSED]
    assert new.status == "calls" and len(new.calls) == 8


def test_without_subagents_delegate_is_a_toolbox_call(stok):
    """Sub-agents are opt-in: by default "delegate sum" goes to the toolbox, which has no such tool,
    and the pool holds the slots' sequences only (no room kept for parked callers)."""
    params, cfg = rote_model(stok, "<|call|>delegate sum<|result|>", "<|assistant|>ok<|end|>")
    prompt = chat.Segment(chat.PROGRAM, "<|user|>Add up.<|assistant|><|call|>")
    records, batch = agent.run(params, cfg, stok, FMT, [prompt, prompt], [Toolbox(0), Toolbox(1)], slots=1,
                               max_len=256)
    for r in records:
        assert (r.status, r.answer, r.subagents) == ("done", "ok", [])
        assert r.calls == [("delegate sum", Toolbox(0)("delegate sum"))] and r.calls[0][1].startswith("error: ")
    assert batch.pool.n_pages == 1 + 1 * 16 and len(batch.seqs) == 2
