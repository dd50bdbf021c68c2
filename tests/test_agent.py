"""The agent loop: the design documents' baseline test, budgets, and no recompilation.

    pytest tests/test_agent.py

The baseline: a tiny two-layer model trained on a single trace until it knows
it by heart replays it identically in the loop (call, result and answer
included), with and without the cache.
"""

import jax
import numpy as np
import pytest

from minagent import agent, chat, missions, model, train
from minagent import tokenizer as tk
from minagent.tools import Toolbox

FMT = chat.MINAGENT


@pytest.fixture(scope="module")
def tok():
    text = "\n".join(chat.text(m.trace) for m in missions.generate(300, seed=0))
    return tk.train(text, vocab_size=400, specials=tk.MINAGENT_SPECIALS)


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
