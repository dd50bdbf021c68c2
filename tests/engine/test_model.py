"""The transformer's invariants, on tiny random models (CPU; about 30 s on 2 cores).

    python -m pytest tests/engine/test_model.py -q

The checks: a slow numpy reference (one head at a time, RoPE as complex
rotations) gives the same logits; no position sees the future, by perturbation
and by gradients; packed segments behave as separate sequences; grouped-query
attention is multi-head attention with each kv head repeated; `add_tokens`
changes no existing logit; jit, no-jit and bfloat16 agree.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minagent import model

TINY = model.Config(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96)
T = 12

forward = jax.jit(model.forward, static_argnums=1)


def random_params(cfg, seed=0, std=0.2):
    """init's shapes with larger weights and random norm gains.

    init's 0.02 makes attention almost uniform and every logit almost 0, which
    would hide a wrong mask or a wrong rotation; std 0.2 gives peaked attention
    and logits of order 1. Norm gains away from 1 make a misplaced gain visible.
    """
    params = model.init(jax.random.PRNGKey(seed), cfg)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    new = [1.0 + 0.3 * jax.random.normal(k, x.shape) if "norm" in name else std * jax.random.normal(k, x.shape)
           for k, x, name in zip(keys, leaves, _leaf_names(params))]
    return jax.tree_util.tree_unflatten(treedef, [x.astype(cfg.dtype) for x in new])


def _leaf_names(params):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def random_tokens(cfg, shape, seed=0):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, cfg.vocab_size)


def assert_close(actual, expected, rel):
    """max |actual - expected| <= rel * max |expected|: float32 rounding grows with the logits' scale
    (a few ulps of the largest logit, ~5 here), so tolerances are relative to it."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    error, scale = np.abs(actual - expected).max(), np.abs(expected).max()
    assert error <= rel * scale, f"max error {error:.3g} > {rel:g} * max |logit| {scale:.3g}"


# ---------------------------------------------------------------- a slow reference

def reference_forward(params, cfg, tokens_T):
    """One sequence through the model in float64 numpy, one head at a time.

    Written independently of model.py: RoPE rotates the pair (x[2i], x[2i+1])
    as the complex number x[2i] + i x[2i+1] multiplied by e^(i t theta^(-2i/H)).
    """
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n_T = len(tokens_T)

    def norm(x_TxD, w_D):
        return x_TxD / np.sqrt((x_TxD ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * w_D

    def rotate(x_TxH):
        z_Txh = x_TxH[:, 0::2] + 1j * x_TxH[:, 1::2]
        freq_h = cfg.rope_theta ** (-2 * np.arange(H // 2) / H)
        z_Txh = z_Txh * np.exp(1j * np.arange(n_T)[:, None] * freq_h)
        out = np.empty_like(x_TxH)
        out[:, 0::2], out[:, 1::2] = z_Txh.real, z_Txh.imag
        return out

    x_TxD = p["embed"][np.asarray(tokens_T)]
    for layer in range(cfg.n_layers):
        lp = {name: w[layer] for name, w in p["layers"].items()}
        h_TxD = norm(x_TxD, lp["attn_norm"])
        q, k, v = h_TxD @ lp["wq"], h_TxD @ lp["wk"], h_TxD @ lp["wv"]
        heads = []
        for n in range(N):
            kv = n // (N // K)                      # query heads 0..G-1 share kv head 0, and so on
            q_TxH = rotate(q[:, n * H:(n + 1) * H])
            k_TxH = rotate(k[:, kv * H:(kv + 1) * H])
            scores_TxT = q_TxH @ k_TxH.T / np.sqrt(H)
            scores_TxT[np.triu_indices(n_T, 1)] = -np.inf
            probs = np.exp(scores_TxT - scores_TxT.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            heads.append(probs @ v[:, kv * H:(kv + 1) * H])
        x_TxD = x_TxD + np.concatenate(heads, axis=1) @ lp["wo"]
        h_TxD = norm(x_TxD, lp["mlp_norm"])
        gate = h_TxD @ lp["w_gate"]
        x_TxD = x_TxD + (gate / (1 + np.exp(-gate)) * (h_TxD @ lp["w_up"])) @ lp["w_down"]
    head_DxV = p["unembed"] if "unembed" in p else p["embed"].T
    return norm(x_TxD, p["final_norm"]) @ head_DxV


@pytest.mark.parametrize("tie,n_kv_heads", [(True, 2), (False, 1), *[pytest.param(*p, marks=pytest.mark.slow) for p in
                                                                    [(True, 1), (True, 4), (False, 2), (False, 4)]]])
def test_forward_matches_numpy_reference(tie, n_kv_heads):
    cfg = dataclasses.replace(TINY, tie_embeddings=tie, n_kv_heads=n_kv_heads)
    params = random_params(cfg)
    tokens_BxT = random_tokens(cfg, (2, T))
    logits_BxTxV = np.asarray(forward(params, cfg, tokens_BxT))
    assert np.abs(logits_BxTxV).max() > 1.0     # the weights are big enough for the test to bite
    for b in range(2):
        assert_close(logits_BxTxV[b], reference_forward(params, cfg, tokens_BxT[b]), rel=1e-5)  # seen: <= 2.3e-6


# ---------------------------------------------------------------- causality

@pytest.mark.slow
def test_changing_the_future_never_changes_the_past():
    params = random_params(TINY)
    tokens_T = random_tokens(TINY, (T,))
    logits_TxV = forward(params, TINY, tokens_T[None])[0]
    for t in range(T - 1):
        changed_T = tokens_T.at[t + 1:].set((tokens_T[t + 1:] + 1 + t) % TINY.vocab_size)
        new_TxV = forward(params, TINY, changed_T[None])[0]
        np.testing.assert_allclose(new_TxV[:t + 1], logits_TxV[:t + 1], atol=1e-6, rtol=0)
        assert np.abs(new_TxV[t + 1] - logits_TxV[t + 1]).max() > 1e-3   # and the present does change


def test_causality_by_gradients():
    """d logits[t] / d embedding[token at s] is exactly 0 for every s > t.

    Every position holds a different token, so a row of the embedding table is
    one position's input. The head is untied: tied, the same rows would also be
    the output head, which every logit depends on.
    """
    cfg = dataclasses.replace(TINY, tie_embeddings=False)
    params = random_params(cfg)
    tokens_T = jax.random.permutation(jax.random.PRNGKey(3), cfg.vocab_size)[:T]

    def logits_sum_T(embed_VxD):
        return forward({**params, "embed": embed_VxD}, cfg, tokens_T[None])[0].sum(-1)

    jac_TxVxD = np.asarray(jax.jacrev(logits_sum_T)(params["embed"]))
    per_position_TxS = np.abs(jac_TxVxD[:, np.asarray(tokens_T)]).max(-1)   # [t, s]: |d logits[t] / d x[s]|
    assert (per_position_TxS[np.triu_indices(T, 1)] == 0).all()
    assert (per_position_TxS[np.tril_indices(T)] > 0).all()


# ---------------------------------------------------------------- packed segments

def test_packed_segments_equal_separate_sequences():
    a_T, b_T = random_tokens(TINY, (5,), seed=1), random_tokens(TINY, (7,), seed=2)
    params = random_params(TINY)
    packed_1xT = jnp.concatenate([a_T, b_T])[None]
    segments_1xT = jnp.array([[0] * 5 + [1] * 7])
    positions_1xT = jnp.array([list(range(5)) + list(range(7))])   # restart at 0 in each segment
    packed_TxV = forward(params, TINY, packed_1xT, positions_1xT, segments_1xT)[0]
    assert_close(packed_TxV[:5], forward(params, TINY, a_T[None])[0], rel=1e-6)
    assert_close(packed_TxV[5:], forward(params, TINY, b_T[None])[0], rel=1e-6)


def test_positions_are_relative():
    """RoPE makes q.k depend on position differences only: shifting every position changes nothing."""
    params = random_params(TINY)
    tokens_1xT = random_tokens(TINY, (1, T))
    positions_1xT = jnp.arange(T)[None]
    assert_close(forward(params, TINY, tokens_1xT, positions_1xT + 37),
                 forward(params, TINY, tokens_1xT, positions_1xT), rel=1e-5)


# ---------------------------------------------------------------- grouped-query attention

def test_gqa_is_mha_with_repeated_kv_heads():
    """K kv heads shared by groups of G query heads == N kv heads where head n copies kv head n // G."""
    gqa = TINY                                                  # 4 query heads, 2 kv heads: G = 2
    mha = dataclasses.replace(TINY, n_kv_heads=TINY.n_heads)
    params = random_params(gqa)
    G, H = gqa.n_heads // gqa.n_kv_heads, gqa.head_dim

    def repeat_heads(w_LxDxKH):
        L, D, _ = w_LxDxKH.shape
        w_LxDxKxH = w_LxDxKH.reshape(L, D, gqa.n_kv_heads, H)
        return jnp.repeat(w_LxDxKxH, G, axis=2).reshape(L, D, gqa.n_heads * H)

    layers = dict(params["layers"], wk=repeat_heads(params["layers"]["wk"]),
                  wv=repeat_heads(params["layers"]["wv"]))
    tokens_BxT = random_tokens(gqa, (2, T))
    assert_close(forward({**params, "layers": layers}, mha, tokens_BxT), forward(params, gqa, tokens_BxT), rel=1e-5)


# ---------------------------------------------------------------- new tokens

@pytest.mark.parametrize("tie", [True, False])
def test_add_tokens_keeps_old_logits_and_new_logit_is_their_mean(tie):
    """A new row is the mean row, so its logit is h . mean(E) = mean over v of h . E_v."""
    cfg = dataclasses.replace(TINY, tie_embeddings=tie)
    params = random_params(cfg)
    tokens_BxT = random_tokens(cfg, (2, T))
    old_BxTxV = forward(params, cfg, tokens_BxT)

    grown = model.add_tokens(params, 2)
    grown_cfg = model.with_vocab(cfg, grown)
    assert grown_cfg.vocab_size == cfg.vocab_size + 2
    new_BxTxW = forward(grown, grown_cfg, tokens_BxT)

    np.testing.assert_allclose(new_BxTxW[..., :cfg.vocab_size], old_BxTxV, atol=1e-6, rtol=0)
    mean_BxT = old_BxTxV.mean(-1)
    for extra in (cfg.vocab_size, cfg.vocab_size + 1):
        np.testing.assert_allclose(new_BxTxW[..., extra], mean_BxT, atol=1e-5, rtol=0)
    # the new tokens can also be read: their input row is the mean embedding
    np.testing.assert_allclose(grown["embed"][-1], params["embed"].mean(0), atol=1e-7)


# ---------------------------------------------------------------- jit, dtype, cost

@pytest.mark.slow
def test_jit_and_no_jit_agree():
    params = random_params(TINY)
    tokens_BxT = random_tokens(TINY, (2, T))
    with jax.disable_jit():                 # every op eagerly, the scan as a Python loop
        eager_BxTxV = model.forward(params, TINY, tokens_BxT)
    assert_close(forward(params, TINY, tokens_BxT), eager_BxTxV, rel=5e-6)   # XLA fuses and reorders; seen: <= 1.1e-6


def test_bfloat16_is_close_to_float32():
    """Weights and activations in bfloat16 (8 mantissa bits), norms, softmax and logits in float32."""
    params = random_params(TINY, std=0.1)
    bf16 = dataclasses.replace(TINY, dtype="bfloat16")
    params_bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    tokens_BxT = random_tokens(TINY, (2, T))
    exact_BxTxV = np.asarray(forward(params, TINY, tokens_BxT))
    low_BxTxV = forward(params_bf16, bf16, tokens_BxT)
    assert low_BxTxV.dtype == jnp.float32
    scale = np.abs(exact_BxTxV).max()
    assert np.abs(np.asarray(low_BxTxV) - exact_BxTxV).max() < 0.05 * scale
    assert (np.asarray(low_BxTxV).argmax(-1) == exact_BxTxV.argmax(-1)).mean() > 0.9


def test_flops_per_token_counts_every_matmul_weight():
    """With no context, 2 FLOPs (multiply, add) per weight of every matmul: all params but the norms,
    plus the head (the embedding table again when tied; when untied the lookup table is free)."""
    for tie in (True, False):
        cfg = dataclasses.replace(TINY, tie_embeddings=tie)
        params = model.init(jax.random.PRNGKey(0), cfg)
        norms = sum(x.size for name, x in zip(_leaf_names(params), jax.tree_util.tree_leaves(params))
                    if "norm" in name)
        matmul_weights = model.n_params(params) - norms - (0 if tie else cfg.vocab_size * cfg.d_model)
        assert model.flops_per_token(cfg, 0) == 2 * matmul_weights
        # attention: q.k and probs.v, each N*H multiply-adds per key, in each layer
        extra = model.flops_per_token(cfg, 100) - model.flops_per_token(cfg, 0)
        assert extra == 2 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 100
