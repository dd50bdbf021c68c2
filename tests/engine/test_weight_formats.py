"""Weight formats for decoding: int8 (int8.quantize), int8 with bfloat16 beside (int8.quantize(params,
bf16=True)) and bfloat16 matrices (bf16.matrices). Each product's error bound, the params' layout,
and the paged steps equal forward with the same weights.

    python -m pytest tests/engine/test_weight_formats.py -q
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minagent import bf16, int8, model
from minagent.batch import Batch, Status
from minagent.runner import RunnerConfig

V = 40


def tiny_model(tie_embeddings=True):
    """Random weights scaled up (as in test_batch) so that greedy decoding does not repeat one token."""
    cfg = model.Config(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       tie_embeddings=tie_embeddings)
    params = model.init(jax.random.PRNGKey(0), cfg)
    return jax.tree.map(lambda w: 4.0 * w if w.ndim > 1 else w, params), cfg


def as_float(w):
    """An Int8's matrix back in float32, in model.init's [..., I, O] layout."""
    return np.swapaxes(np.asarray(w.q, np.float32) * np.asarray(w.scale), -1, -2)


def converted_matrices(params, out):
    """What a format (int8.quantize, bf16.matrices) leaves alone is the same arrays: the embedding
    table, the final norm, each layer's norms. -> [(name, w, out's w)] for each layer's matrices."""
    assert out["embed"] is params["embed"] and out["final_norm"] is params["final_norm"]
    pairs = []
    for name, w in params["layers"].items():
        if name.endswith("norm"):
            assert out["layers"][name] is w
        else:
            pairs.append((name, w, out["layers"][name]))
    assert pairs
    return pairs


def test_dot_is_the_float_product_within_its_bound():
    """int8.dot(x, w) against x @ (q * scale) in float64: off by at most max|x_m| / 64,516 times
    sum_i |w_io| (x's two int8 parts; the int32 sums are exact); a row alone (x kept as it is, w
    converted) is that product to float32 rounding."""
    rng = np.random.default_rng(0)
    x_MxI = rng.standard_normal((6, 96)).astype(np.float32) * rng.uniform(0.01, 100, (6, 1)).astype(np.float32)
    x_MxI[2] = 0.0                                                       # a row of zeros
    w = int8.Int8(*int8._int8(jnp.asarray(rng.standard_normal((80, 96)), jnp.float32)))   # [O, I]
    got_MxO = np.asarray(int8.dot(jnp.asarray(x_MxI), w), np.float64)
    exact_MxO = x_MxI.astype(np.float64) @ as_float(w).astype(np.float64)
    bound_MxO = np.abs(x_MxI).max(1, keepdims=True) / 64_516 * np.abs(as_float(w)).sum(0) + 1e-5 * np.abs(exact_MxO)
    assert np.all(np.abs(got_MxO - exact_MxO) <= bound_MxO)
    assert np.all(got_MxO[2] == 0.0)
    one_row = np.stack([np.asarray(int8.dot(jnp.asarray(x_MxI[m:m + 1]), w), np.float64)[0]
                        for m in range(6)])
    rounding_MxO = 98 * 2.0**-24 * np.abs(x_MxI) @ np.abs(as_float(w))   # 96 terms, the scale
    assert np.all(np.abs(one_row - exact_MxO) <= rounding_MxO)
    assert np.all(np.abs(one_row - exact_MxO) <= bound_MxO)         # as close as six rows, or closer
    assert np.all(one_row[2] == 0.0)


def test_dot_with_bfloat16_beside_is_int8s_for_one_row_and_bfloat16s_for_more():
    """One row: the int8 product, bit for bit. More rows: x rounded to bfloat16 and w's bfloat16
    copy, summed in float32: the float64 product of the rounded operands to float32 rounding (far
    from int8's values: the copy is the matrix before rounding to int8)."""
    rng = np.random.default_rng(1)
    x_MxI = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    w_OxI = jnp.asarray(rng.standard_normal((80, 96)), jnp.float32)
    alone = int8.Int8(*int8._int8(w_OxI))
    w = int8.Int8(*int8._int8(w_OxI), w_OxI.astype(jnp.bfloat16))
    for m in range(5):
        np.testing.assert_array_equal(np.asarray(int8.dot(x_MxI[m:m + 1], w)),
                                      np.asarray(int8.dot(x_MxI[m:m + 1], alone)))
    got_MxO = np.asarray(int8.dot(x_MxI, w), np.float64)
    x64, w64 = (np.asarray(a.astype(jnp.bfloat16), np.float64) for a in (x_MxI, w_OxI))
    exact_MxO = x64 @ w64.T
    assert np.all(np.abs(got_MxO - exact_MxO) <= 98 * 2.0**-24 * np.abs(x64) @ np.abs(w64.T))
    assert np.abs(got_MxO - np.asarray(int8.dot(x_MxI, alone))).max() > 1e-3


@pytest.mark.slow
def test_quantize_keeps_the_layout_and_each_weight_within_half_a_step():
    for tie in (True, False):
        params, cfg = tiny_model(tie)
        q = int8.quantize(params)
        beside = int8.quantize(params, bf16=True)                   # and w.T in bfloat16 beside
        for (name, w, got), (_, _, both) in zip(converted_matrices(params, q), converted_matrices(params, beside)):
            L, I, O = w.shape
            assert got.q.dtype == jnp.int8 and got.q.shape == (L, O, I) and got.scale.shape == (L, O, 1)
            step = np.swapaxes(np.asarray(got.scale), -1, -2)
            assert np.all(np.abs(as_float(got) - np.asarray(w)) <= step / 2 * (1 + 1e-6))
            assert got.bf16 is None
            np.testing.assert_array_equal(np.asarray(both.q), np.asarray(got.q))
            np.testing.assert_array_equal(np.asarray(both.bf16, np.float32),
                                          np.swapaxes(np.asarray(w.astype(jnp.bfloat16), np.float32), -1, -2))
        head = params["unembed"] if not tie else params["embed"].T
        step = np.asarray(q["unembed"].scale).T
        assert np.all(np.abs(as_float(q["unembed"]) - np.asarray(head)) <= step / 2 * (1 + 1e-6))
        np.testing.assert_array_equal(np.asarray(beside["unembed"].bf16, np.float32),
                                      np.asarray(head.T.astype(jnp.bfloat16), np.float32))
        if tie:
            tokens = jnp.arange(20)[None] % V                   # and the logits move by int8's error only
            ref = np.asarray(model.forward(params, cfg, tokens))
            assert np.abs(np.asarray(model.forward(q, cfg, tokens)) - ref).max() < 0.1 * np.abs(ref).max()


@pytest.mark.slow
@pytest.mark.parametrize("per_layer", [True, False])
@pytest.mark.parametrize("fmt", ["int8", "int8+bf16", "bf16"])
def test_paged_steps_with_each_format_equal_forward_with_it(per_layer, fmt):
    """The Batch with int8 params, or bfloat16 matrices (per layer and stacked), gives forward's logits
    with the same params: int8 splits each row of activations into int8 parts alone, and a bfloat16
    product rounds each row alone, so a token's product does not depend on how many tokens go through
    the model with it (to float rounding: 1e-3 of logits of scale 1). int8 with bfloat16 beside: two
    slots, so every step has two rows or more and reads the bfloat16 copies, as forward does."""
    params, cfg = tiny_model()
    q = bf16.matrices(params) if fmt == "bf16" else int8.quantize(params, bf16=fmt == "int8+bf16")
    prompts = [[7], [5, 6, 7, 8, 9], [(3 * j) % V for j in range(23)]]
    batch = Batch(q, cfg, slots=2, n_pages=30, page_size=4, max_len=64, keep_logits=True,
                  runner=RunnerConfig(buckets=(4, 16), per_layer=per_layer))
    layers = batch.runner.params["layers"]
    wq = (layers[0] if per_layer else layers)["wq"]
    assert wq.dtype == jnp.bfloat16 if fmt == "bf16" else isinstance(wq, int8.Int8)
    ids = [batch.add(p, 10) for p in prompts]
    while batch.running():
        batch.step()
        for i in ids:
            if batch.seqs[i].status is Status.LENGTH:
                batch.finish(i)
    for i, p in zip(ids, prompts):
        tokens = batch.seqs[i].tokens
        ref_TxV = np.asarray(model.forward(q, cfg, np.array([tokens])))[0, len(p) - 1:-1]
        np.testing.assert_allclose(np.stack(batch.seqs[i].logits), ref_TxV, atol=1e-3, rtol=0)
        assert tokens[len(p):] == list(ref_TxV.argmax(-1))


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
        for name, w, got in converted_matrices(params, b):
            assert got.dtype == jnp.bfloat16 and got.shape == w.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w.astype(jnp.bfloat16)))
        head = params["embed"].T if tie else params["unembed"]
        assert b["unembed"].dtype == jnp.bfloat16 and b["unembed"].shape == head.shape
        tokens = jnp.arange(20)[None] % V                   # the logits move by bfloat16's rounding only
        ref = np.asarray(model.forward(params, cfg, tokens))
        got = np.asarray(model.forward(b, cfg, tokens))
        assert got.dtype == np.float32
        assert 0 < np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
