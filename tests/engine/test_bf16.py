"""bfloat16 matrices: the product sums in float32, the params' layout, and the paged steps equal
forward with them.

    python -m pytest tests/engine/test_bf16.py -q
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minagent import bf16, model
from minagent.batch import Batch, Status
from minagent.runner import RunnerConfig

V = 40


def tiny_model(tie_embeddings=True):
    """Random weights scaled up (as in test_batch) so that greedy decoding does not repeat one token."""
    cfg = model.Config(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       tie_embeddings=tie_embeddings)
    params = model.init(jax.random.PRNGKey(0), cfg)
    return jax.tree.map(lambda w: 4.0 * w if w.ndim > 1 else w, params), cfg


def test_dense_with_a_bfloat16_matrix_sums_the_rounded_operands_in_float32():
    """x (float32) @ w (bfloat16): x rounded to bfloat16, the products summed in float32, the result
    in x's dtype: the float64 product of the rounded operands to float32 rounding, where bfloat16
    sums (8 mantissa bits) would be off by far more."""
    rng = np.random.default_rng(0)
    x_BxTxI = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    w_IxO = jnp.asarray(rng.standard_normal((256, 48)), jnp.bfloat16)
    got = model.dense(x_BxTxI, w_IxO)
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 48)
    x64 = np.asarray(x_BxTxI.astype(jnp.bfloat16), np.float64).reshape(6, 256)
    exact = (x64 @ np.asarray(w_IxO, np.float64)).reshape(2, 3, 48)
    bound = 258 * 2.0**-24 * (np.abs(x64) @ np.abs(np.asarray(w_IxO, np.float64))).reshape(2, 3, 48)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)
    # activations in bfloat16 too (Config.dtype): a bfloat16 result, as before bf16.matrices; the
    # output head's float32 logits summed in float32
    assert model.dense(x_BxTxI.astype(jnp.bfloat16), w_IxO).dtype == jnp.bfloat16
    head = model.dense(x_BxTxI.astype(jnp.bfloat16), w_IxO, jnp.float32)
    assert head.dtype == jnp.float32 and np.all(np.abs(np.asarray(head, np.float64) - exact) <= bound)


def test_matrices_keeps_the_layout_and_rounds_each_matrix_to_bfloat16():
    for tie in (True, False):
        params, cfg = tiny_model(tie)
        b = bf16.matrices(params)
        assert b["embed"] is params["embed"] and b["final_norm"] is params["final_norm"]
        for name, w in params["layers"].items():
            if name.endswith("norm"):
                assert b["layers"][name] is w
                continue
            assert b["layers"][name].dtype == jnp.bfloat16 and b["layers"][name].shape == w.shape
            np.testing.assert_array_equal(np.asarray(b["layers"][name]), np.asarray(w.astype(jnp.bfloat16)))
        head = params["embed"].T if tie else params["unembed"]
        assert b["unembed"].dtype == jnp.bfloat16 and b["unembed"].shape == head.shape
        tokens = jnp.arange(20)[None] % V                   # the logits move by bfloat16's rounding only
        ref = np.asarray(model.forward(params, cfg, tokens))
        got = np.asarray(model.forward(b, cfg, tokens))
        assert got.dtype == np.float32
        assert 0 < np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.slow
@pytest.mark.parametrize("per_layer", [True, False])
def test_paged_steps_with_bfloat16_matrices_equal_forward_with_them(per_layer):
    """The Batch with bf16.matrices' params (per layer and stacked) gives forward's logits with the
    same params, and greedy decoding follows them."""
    params, cfg = tiny_model()
    b = bf16.matrices(params)
    prompts = [[7], [5, 6, 7, 8, 9], [(3 * j) % V for j in range(23)]]
    batch = Batch(b, cfg, slots=2, n_pages=30, page_size=4, max_len=64, keep_logits=True,
                  runner=RunnerConfig(buckets=(4, 16), per_layer=per_layer))
    layers = batch.runner.params["layers"]
    assert (layers[0] if per_layer else layers)["wq"].dtype == jnp.bfloat16
    ids = [batch.add(p, 10) for p in prompts]
    while batch.running():
        batch.step()
        for i in ids:
            if batch.seqs[i].status is Status.LENGTH:
                batch.finish(i)
    for i, p in zip(ids, prompts):
        tokens = batch.seqs[i].tokens
        ref_TxV = np.asarray(model.forward(b, cfg, np.array([tokens])))[0, len(p) - 1:-1]
        np.testing.assert_allclose(np.stack(batch.seqs[i].logits), ref_TxV, atol=1e-3, rtol=0)
        assert tokens[len(p):] == list(ref_TxV.argmax(-1))
