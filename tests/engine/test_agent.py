"""The agent loop: the design documents' baseline test, budgets, no recompilation, the view hook.

    python -m pytest tests/engine/test_agent.py -q

The baseline: a tiny two-layer model trained on a single trace until it knows
it by heart replays it identically in the loop (call, result and answer
included), with and without the cache.

The loop's edges run on a rote model (minagent/tasks/rote.py): a transformer whose
weights make it write a fixed script, so the episodes are known exactly. A view
that changes an old result must reuse the cache of everything before it; the
stored history keeps everything; a refusing view ends the episode; past max_len
an episode ends, it does not raise.
"""

import jax
import numpy as np
import pytest

from minagent import agent, chat, model, train
from minagent.chat import Message
from minagent.runner import RunnerConfig
from minagent.tasks.calculator import missions
from minagent.tools import Toolbox

from conftest import READER, Parts, part

FMT = chat.MINAGENT


@pytest.fixture(scope="module")
def memorised(tok):
    """A 2-layer model trained on one two-call mission until it knows it by heart."""
    mission = missions.generate(1, seed=3, families=["together"])[0]
    tokens, authors = chat.render(mission.trace, tok)
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    params = model.init(jax.random.PRNGKey(0), cfg)
    tcfg = train.TrainConfig(steps=60, batch_size=1, seq_len=len(tokens), lr=1e-2, warmup=10,
                             weight_decay=0.0)
    params, history = train.train(params, cfg, [(tokens, authors)], tcfg, progress=False)
    assert history[-1]["loss"] < 0.01
    return mission, tokens, authors, params, cfg


@pytest.mark.parametrize("cache", [True, False])
def test_memorised_trace_replays_identically(tok, memorised, cache):
    mission, tokens, authors, params, cfg = memorised
    batch = agent.new_batch(params, cfg, tok, FMT, slots=2, max_len=128, reuse_cache=cache)
    (r,) = agent.run(batch, tok, FMT, [mission.trace[0]], [Toolbox(mission.seed)])
    assert r.status == "done"
    np.testing.assert_array_equal(r.tokens, tokens)       # call, result and answer included
    np.testing.assert_array_equal(r.authors, authors)     # and who wrote each token
    assert r.answer == mission.answer
    assert [call for call, _ in r.calls] == list(mission.calls)
    assert batch.pool.n_used == 0                          # every page went back


def test_cache_pushes_each_position_once(tok, memorised):
    """With the cache every token goes through the model once; without it, each resume re-reads the episode."""
    mission, tokens, _, params, cfg = memorised
    positions = {}
    for cache in (True, False):
        batch = agent.new_batch(params, cfg, tok, FMT, slots=2, max_len=128, reuse_cache=cache)
        (r,) = agent.run(batch, tok, FMT, [mission.trace[0]], [Toolbox(mission.seed)])
        positions[cache] = r.positions
    # every token but the last (<|end|>, sampled and never fed back) went through the model once
    assert positions[True] == len(tokens) - 1
    assert positions[False] > positions[True]


def test_an_episode_alone_writes_its_stretch_in_one_call(tok, memorised, monkeypatch):
    """Alone in the loop, an episode writes each stretch in one device call (Batch.steps): the
    record is the one that one token a call gives, in fewer calls."""
    mission, tokens, authors, params, cfg = memorised
    records, calls = {}, {}
    for how in ("stretch", "token"):
        if how == "token":
            monkeypatch.setattr(agent.Loop, "step", lambda self: bool(self.batch.step()))
        batch = agent.new_batch(params, cfg, tok, FMT, slots=2, max_len=128)
        calls[how] = counted = {"decode": 0, "decode_n": 0}
        for name in counted:
            def count(*args, name=name, real=getattr(batch.runner, name), **kw):
                counted[name] += 1
                return real(*args, **kw)
            setattr(batch.runner, name, count)
        (records[how],) = agent.run(batch, tok, FMT, [mission.trace[0]], [Toolbox(mission.seed)])
    a, b = records["stretch"], records["token"]
    np.testing.assert_array_equal(a.tokens, tokens)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.authors, b.authors)
    assert (a.status, a.answer, a.calls, a.positions) == (b.status, b.answer, b.calls, b.positions)
    # a stretch for each call and one for the answer. Each stretch's first token is sampled from
    # its prefill's logits; the rest take one decode_n call a stretch, or a decode step each.
    stretches, written = len(a.calls) + 1, int(np.sum(np.asarray(a.authors) == chat.MODEL))
    assert a.status == "done" and stretches == 4
    assert calls["stretch"] == {"decode": 0, "decode_n": stretches}
    assert calls["token"] == {"decode": written - stretches, "decode_n": 0}


def test_budgets_hold_and_no_recompilation_after_warm_up(tok):
    """50 episodes of varied lengths on a random-weights model: budgets hold, nothing recompiles."""
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    params = model.init(jax.random.PRNGKey(1), cfg)
    ms = missions.generate(70, seed=7)
    # three buckets, so that chunks of several lengths meet warm-up's shapes (fewer to compile than
    # the default eight); prefill calls of 4 rows, and of 16 for chunks of up to 8 tokens
    batch = agent.new_batch(params, cfg, tok, FMT, slots=16, max_len=128, temperature=1.0,
                            runner=RunnerConfig(buckets=(8, 32, 128), prefill_positions=128))
    limits = dict(max_calls=3, max_stretch=12)
    warm = agent.run(batch, tok, FMT, [m.trace[0] for m in ms[:20]], [Toolbox(m.seed) for m in ms[:20]], **limits)
    # every (bucket, page-table width) shape the batch can use, and the stretch in one call of the
    # loop's last episode
    batch.warmup(steps=(12,))
    compiles = batch.compiles
    records = agent.run(batch, tok, FMT, [m.trace[0] for m in ms[20:]], [Toolbox(m.seed) for m in ms[20:]],
                        **limits)
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

def test_rote_model_writes_its_script(stok, rote):
    params, cfg = rote(stok, "<|assistant|>ok<|end|>")
    batch = agent.new_batch(params, cfg, stok, FMT, slots=2, max_len=1024)
    (r,) = agent.run(batch, stok, FMT, ["Hi."], [Toolbox(0)])
    assert (r.status, r.answer, r.calls) == ("done", "ok", [])
    assert r.history == (Message("first", "Hi."), Message("model", "ok<|end|>"))


SHORT = Message("result", "[gone]")


def older_results_shortened(history, count):
    """A view that sends every result but the newest as SHORT: the start of the view changes."""
    newest = max(i for i, m in enumerate(history) if m.kind == "result")
    return tuple(SHORT if m.kind == "result" and i < newest else m for i, m in enumerate(history))


def test_the_view_is_sent_its_common_start_reused_and_the_history_kept(stok, rote):
    params, cfg = rote(stok, READER)
    render = lambda view: list(chat.render([chat.render_message(m, FMT) for m in view], stok)[0])  # noqa: E731
    batch = agent.new_batch(params, cfg, stok, FMT, slots=2, max_len=1024)
    (plain,) = agent.run(batch, stok, FMT, ["Read every part."], [Parts()], max_calls=4)
    (short,) = agent.run(batch, stok, FMT, ["Read every part."], [Parts()], max_calls=4,
                         view=older_results_shortened)
    assert plain.status == short.status == "calls" and plain.history == short.history   # the history: everything
    assert plain.refills == 0 and plain.positions == len(plain.tokens) - 1
    assert list(short.tokens) == render(older_results_shortened(short.history[:-1], None) + short.history[-1:])
    # After the first result, each view changes the result before the newest: the start up to the model's
    # call before it is reused, the rest pushed again (the changed result, the call, the new result).
    refills = 0
    for j in [i for i, m in enumerate(short.history) if m.kind == "result"][1:]:
        view = older_results_shortened(short.history[:j + 1], None)
        refills += len(render(view)) - len(render(view[:j - 2]))
    assert short.refills == refills > 0
    assert batch.pool.n_used == 0


def test_a_refusing_view_ends_the_episode(stok, rote):
    params, cfg = rote(stok, READER)

    def refuse(history, count):
        raise agent.Refused("too long")

    batch = agent.new_batch(params, cfg, stok, FMT, slots=2, max_len=1024)
    (r,) = agent.run(batch, stok, FMT, ["Read every part."], [Parts()], view=refuse)
    assert (r.status, r.answer, len(r.calls)) == ("refused", "too long", 1)
    assert r.history[-1] == Message("result", part(1)) and batch.pool.n_used == 0


def test_past_max_len_an_episode_ends_and_loses_nothing(stok, rote):
    params, cfg = rote(stok, READER)
    batch = agent.new_batch(params, cfg, stok, FMT, slots=1, max_len=512)
    (r,) = agent.run(batch, stok, FMT, ["Read every part."], [Parts()])
    render = lambda view: list(chat.render([chat.render_message(m, FMT) for m in view], stok)[0])  # noqa: E731
    assert r.status == "max_len"
    assert [m.text for m in r.history if m.kind == "result"] == [res for _, res in r.calls]
    assert list(r.tokens) == render(r.history[:-1])        # all but the result that did not fit
    assert batch.pool.n_used == 0


def test_default_pool_holds_a_sequence_of_max_len(stok, rote):
    """max_len=100, page_size=16: 100 tokens need pages_for(100 - 1, 16) = 7 pages, not 100 // 16 = 6."""
    params, cfg = rote(stok, "<|assistant|>ok<|end|>")
    n = len(stok.encode(chat.prompt(FMT, "Hi.").text))
    batch = agent.new_batch(params, cfg, stok, FMT, slots=1, max_len=100)
    (r,) = agent.run(batch, stok, FMT, ["Hi."], [Toolbox(0)], max_stretch=100 - n)
    assert (r.status, r.answer) == ("done", "ok") and batch.pool.n_pages == 1 + 7


def test_arguments_are_checked(stok, rote):
    params, cfg = rote(stok, "<|assistant|>ok<|end|>")
    batch = agent.new_batch(params, cfg, stok, FMT, slots=1, max_len=100)
    with pytest.raises(ValueError, match="one toolbox per episode"):
        agent.run(batch, stok, FMT, ["Hi.", "Bye."], [Toolbox(0)])
    with pytest.raises(ValueError, match="must pause on <\\|result\\|>"):
        agent.run(agent.Batch(params, cfg, slots=1), stok, FMT, ["Hi."], [Toolbox(0)])
    with pytest.raises(ValueError, match="max_calls"):
        agent.run(batch, stok, FMT, ["Hi."], [Toolbox(0)], max_calls=-1)


def test_opening():
    assert chat.opening(FMT, "Hi.") == (Message("first", "Hi."), chat.prompt(FMT, "Hi."))
    assert chat.opening(FMT, "Hi.", system="Be brief.")[1] == chat.prompt(FMT, "Hi.", system="Be brief.")
    assert chat.opening(FMT, chat.prompt(FMT, "Hi.")) == (Message("first", "Hi."), chat.prompt(FMT, "Hi."))
    with pytest.raises(ValueError, match="system"):
        chat.opening(FMT, chat.prompt(FMT, "Hi."), system="Be brief.")     # not silently ignored
