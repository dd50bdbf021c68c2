"""Every public entry point says what is wrong with a bad argument, instead of doing something else.

    python -m pytest tests/engine/test_bad_arguments.py -q

(Bad files: tests/engine/test_tokenizer.py, test_gguf.py and test_train.py.)
"""

import jax
import numpy as np
import pytest

from minagent import agent, chat, decode, model
from minagent.batch import Batch
from minagent.runner import RunnerConfig
from minagent.tools import Toolbox

CFG = model.Config(vocab_size=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
PARAMS = model.init(jax.random.PRNGKey(0), CFG)


@pytest.mark.parametrize("kw, name", [
    (dict(page_size=0), "page_size=0"), (dict(slots=0), "slots=0"), (dict(n_pages=1), "n_pages=1"),
    (dict(temperature=-0.5), "temperature=-0.5"), (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=-1), "top_k=-1"), (dict(max_len=2.5), "max_len=2.5"),
    (dict(runner=RunnerConfig(buckets=())), "buckets=()"), (dict(runner=RunnerConfig(prefill_rows=(0,))), "prefill_rows=(0,)"),
    (dict(runner=RunnerConfig(prefill_rows=())), "prefill_rows=()"),
    (dict(runner=RunnerConfig(prefill_positions=0)), "prefill_positions=0"),
    (dict(runner=RunnerConfig(beside_rows=0)), "beside_rows=0"),
    (dict(runner=RunnerConfig(prefill_rows=(2, 4), buckets=(8, 16), prefill_positions=16)), r"prefill_rows \[4\] serve no bucket"),
    (dict(runner=RunnerConfig(attention="flash")), "attention='flash'"),
    (dict(runner=RunnerConfig(mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",)))), "one axis, 'data'"),
])
def test_batch_settings(kw, name):
    with pytest.raises(ValueError, match=name.replace("(", r"\(").replace(")", r"\)")):
        Batch(PARAMS, CFG, **kw)


@pytest.mark.parametrize("n", [0, -2, 2.5, True])
def test_steps_a_call(n):
    with pytest.raises(ValueError, match=f"n={n!r}: the steps a call"):
        Batch(PARAMS, CFG, slots=1, n_pages=8, page_size=4, max_len=64).steps(n)


@pytest.mark.parametrize("tokens, limit, message", [
    ([1, 7.9], 4, r"token ids \[7.9\] are not integers"),      # stored as 7.9, pushed as 7: refused
    ([1, -1], 4, r"token ids \[-1\]"), ([1, 40], 4, r"token ids \[40\]"), ([True], 4, r"token ids \[True\]"),
    ([], 4, "no tokens"), ([1], 0, "limit=0"), ([1], 2.0, "limit=2.0"), ([1] * 30, 40, "longer than the cache"),
])
def test_batch_tokens_and_limits(tokens, limit, message):
    batch = Batch(PARAMS, CFG, slots=1, n_pages=8, page_size=4, max_len=64)
    with pytest.raises(ValueError, match=message):
        batch.add(tokens, limit)
    assert batch.seqs == {}                                   # nothing half-added
    i = batch.add([1, 2], 1)
    batch.step()
    with pytest.raises(ValueError, match=message):
        batch.send(i, tokens, limit)
    assert batch.seqs[i].tokens[:2] == [1, 2]                 # the sequence as it was


def test_numpy_integers_are_ids_too():
    batch = Batch(PARAMS, CFG, slots=1, n_pages=8, page_size=4, max_len=64)
    i = batch.add(np.array([1, 2, 3], np.int32), np.int64(2))
    assert batch.seqs[i].tokens == [1, 2, 3] and all(type(t) is int for t in batch.seqs[i].tokens)


@pytest.mark.parametrize("temperature, top_k, name", [(-1.0, 0, "temperature=-1.0"), (1.0, -3, "top_k=-3"),
                                                      (float("inf"), 0, "temperature=inf")])
def test_sample_refuses_a_negative_temperature(temperature, top_k, name):
    with pytest.raises(ValueError, match=name):
        decode.sample(np.zeros((1, 5), np.float32), np.zeros(1, np.int32), np.zeros(1, np.int32), temperature, top_k)


def test_decode_refuses_ids_it_does_not_have(tok):
    for ids in ([-1], [tok.n_vocab], [1.0], [None]):
        with pytest.raises(ValueError, match="not ids of this tokenizer"):
            tok.decode(ids)
    assert tok.decode([]) == ""


@pytest.fixture(scope="module")
def batch(tok):
    cfg = model.Config(vocab_size=tok.n_vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    return agent.new_batch(model.init(jax.random.PRNGKey(0), cfg), cfg, tok, chat.MINAGENT, slots=1, max_len=64)


@pytest.mark.parametrize("kw, message", [
    (dict(max_calls=-1), "max_calls=-1"), (dict(max_calls=1.5), "max_calls=1.5"), (dict(max_stretch=0), "max_stretch=0"),
    (dict(workers=-2), "workers=-2"), (dict(timeout=0), "timeout=0"), (dict(timeout=-1.0), "timeout=-1.0"),
])
def test_agent_run_settings(tok, batch, kw, message):
    with pytest.raises(ValueError, match=message):
        agent.run(batch, tok, chat.MINAGENT, ["Hi."], [Toolbox(0)], **kw)


def test_agent_run_needs_a_callable_toolbox_per_prompt(tok, batch):
    with pytest.raises(ValueError, match="2 prompts but 1 toolboxes"):
        agent.run(batch, tok, chat.MINAGENT, ["Hi.", "Bye."], [Toolbox(0)])
    with pytest.raises(ValueError, match="must be callable"):
        agent.run(batch, tok, chat.MINAGENT, ["Hi."], ["add"])
    assert batch.seqs == {}                                   # nothing started
