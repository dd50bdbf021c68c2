"""LoRA adapters: a zero adapter changes nothing, training moves only the adapters, merge is W + s A B.

Run: python -m pytest tests/engine/test_lora.py -q

Examples are (tokens, authors) arrays built directly: no tokenizer needed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minagent import lora, model
from minagent import train as tr

TINY = model.Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
TCFG = tr.TrainConfig(steps=8, batch_size=4, seq_len=32, lr=1e-2, warmup=1, log_every=1)


@pytest.fixture(scope="module")
def base():
    return model.init(jax.random.PRNGKey(0), TINY)


def examples(n=8, length=24, seed=0):
    """Random traces whose second half (the model's part) repeats the first (the program's): learnable."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        half = rng.integers(0, TINY.vocab_size, length // 2).astype(np.int32)
        out.append((np.concatenate([half, half]), np.repeat(np.array([0, 1], np.uint8), length // 2)))
    return out


def tokens(seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (2, 16), 0, TINY.vocab_size)


def test_zero_adapter_leaves_logits_exactly_unchanged(base):
    adapters = lora.init(jax.random.PRNGKey(1), base, rank=4, new_rows=2)
    assert set(adapters) == set(lora.TARGETS) | {"new_rows"}
    before = model.forward(base, TINY, tokens())
    after = model.forward(lora.merge(base, adapters, alpha=8.0), TINY, tokens())
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_merge_is_w_plus_scaled_a_times_b(base):
    adapters = lora.init(jax.random.PRNGKey(1), base, rank=4)
    b = jax.random.normal(jax.random.PRNGKey(2), adapters["w_up"]["b"].shape)
    adapters["w_up"] = {**adapters["w_up"], "b": b}
    merged = lora.merge(base, adapters, alpha=8.0)
    w, a = np.asarray(base["layers"]["w_up"], np.float64), np.asarray(adapters["w_up"]["a"], np.float64)
    expected = w + (8.0 / 4) * np.einsum("lir,lro->lio", a, np.asarray(b, np.float64))
    np.testing.assert_allclose(np.asarray(merged["layers"]["w_up"]), expected, rtol=1e-5, atol=1e-6)
    # the other leaves are the base's own arrays (B is still zero there: W + 0 == W)
    np.testing.assert_array_equal(np.asarray(merged["layers"]["wq"]), np.asarray(base["layers"]["wq"]))
    assert merged["layers"]["attn_norm"] is base["layers"]["attn_norm"]


def test_merge_known_answer():
    params = {"layers": {"wq": jnp.array([[[1.0, 0.0], [0.0, 1.0]]])}}
    adapters = {"wq": {"a": jnp.array([[[1.0], [2.0]]]), "b": jnp.array([[[3.0, 4.0]]])}}
    np.testing.assert_array_equal(lora.merge(params, adapters, alpha=1.0)["layers"]["wq"], [[[4.0, 4.0], [6.0, 9.0]]])


def test_new_rows_change_only_the_new_tokens(base):
    adapters = lora.init(jax.random.PRNGKey(1), base, rank=4, new_rows=2)
    adapters["new_rows"] = jnp.ones_like(adapters["new_rows"])
    embed = np.asarray(lora.merge(base, adapters)["embed"])
    np.testing.assert_array_equal(embed[:-2], np.asarray(base["embed"])[:-2])
    np.testing.assert_array_equal(embed[-2:], np.asarray(base["embed"])[-2:] + 1.0)


@pytest.mark.slow
def test_training_moves_only_the_adapters_and_lowers_the_loss(base):
    frozen_copy = jax.tree.map(np.array, base)
    start = lora.init(jax.random.PRNGKey(1), base, rank=4, new_rows=2)
    start_copy = jax.tree.map(np.array, start)
    trained, history = lora.train_lora(base, TINY, examples(), TCFG, rank=4, alpha=8.0, lora=start,
                                       progress=False)

    # the base params are bit-identical, every leaf
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), frozen_copy)
    # the adapters moved: every B and the new rows left zero (after one step already)
    assert set(trained) == set(start)
    for name in lora.TARGETS:
        assert np.abs(np.asarray(trained[name]["b"])).max() > 0, name
    assert np.abs(np.asarray(trained["new_rows"])).max() > 0
    # the two new rows, identical at the start, are now told apart
    new = np.asarray(lora.merge(base, trained)["embed"][-2:])
    assert not np.allclose(new[0], new[1])
    np.testing.assert_array_equal(start_copy["new_rows"], 0.0)   # the start was copied, not trained in place

    losses = [h["loss"] for h in history]
    assert len(losses) == TCFG.steps
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.slow
def test_one_step_changes_adapters_not_base(base):
    """A single step through train.train's hook: grads reach the adapters only."""
    frozen_copy = jax.tree.map(np.array, base)
    tcfg = tr.TrainConfig(steps=1, batch_size=4, seq_len=32, lr=1e-2, warmup=1)
    trained, history = lora.train_lora(base, TINY, examples(), tcfg, rank=4, progress=False)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), frozen_copy)
    assert np.abs(np.asarray(trained["wq"]["b"])).max() > 0
    assert lora.n_trained(trained) == sum(2 * 4 * (a + b) for a, b in
                                          [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)])


def test_custom_loss_refuses_eval_examples(base):
    with pytest.raises(ValueError, match="custom loss"):
        lora.train_lora(base, TINY, examples(), TCFG, eval_examples=examples(2), progress=False)
