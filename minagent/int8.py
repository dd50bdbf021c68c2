"""int8 weights for decoding: a quarter of float32's bytes, and at small batches a decode step
is mostly reading every weight once. `params = int8.quantize(params)`, then Batch(params, ...)
as before: each matrix a token multiplies (projections, output head) becomes int8 values and a
float32 scale per output; the embedding table stays (a lookup reads one row). For decoding
only: rounding has no gradient.

`int8.quantize(params, bf16=True)` keeps each matrix in bfloat16 beside its int8 values: one
row (a decode step of one sequence) reads the int8 bytes, more rows (a prefill, a batch's step)
the bfloat16 ones, on CPUs with AVX512_BF16 the fastest product XLA has there for more than a
row (see dot). Three times int8's bytes (405 MB for SmolLM2), three quarters of float32's.
"""

import typing

import jax
import jax.numpy as jnp


class Int8(typing.NamedTuple):
    q: jax.Array         # [..., O, I] int8: w transposed, each output's weights in one row
    #                      (GGUF's layout)
    scale: jax.Array     # [..., O, 1] float32: w.T ~ q * scale
    bf16: jax.Array | None = None   # [..., O, I] bfloat16: w.T, for more rows than one; or None


def _int8(x, axis=-1):
    """Round to 127 steps each side of 0, the step set by the largest |value| along `axis` ->
    (q, scale)."""
    scale = jnp.maximum(jnp.abs(x).max(axis=axis, keepdims=True).astype(jnp.float32), 1e-30) / 127
    return jnp.round(x / scale).astype(jnp.int8), scale


def quantize(params, bf16=False):
    """params (model.init's layout) with each projection and the output head in int8 (bf16: and
    in bfloat16 beside)."""
    def matrix(w_OxI):
        return Int8(*_int8(w_OxI), w_OxI.astype(jnp.bfloat16) if bf16 else None)
    layers = {name: matrix(jnp.swapaxes(w_LxIxO, -1, -2)) if name.startswith("w") else w_LxIxO
              for name, w_LxIxO in params["layers"].items()}
    # tied: the table is w.T
    head_VxD = params["unembed"].T if "unembed" in params else params["embed"]
    return {**params, "layers": layers, "unembed": matrix(head_VxD)}


def dot(x_MxI, w):
    """x @ w for an Int8 w -> [M, O].

    One row (a decode step at batch 1): x stays as it is and w's values become x's dtype as the
    product reads them. XLA on CPU computes a vector's product as a sum along each row of w, and
    the conversion fuses into it: one pass over the int8 bytes. (SmolLM2's products at batch 1 on
    2 cores of an AMD EPYC with AVX2 and no VNNI: 9.7 ms, float32 weights 31.5 ms, the int8
    product below 27.5 ms.) x is written out first, as a sum with a row of zeros: XLA fuses
    whatever computes x into that loop otherwise, where it runs once for each output, and
    when x is a flattened [K, G, H] (attention's output, before the o projection) each of
    those reads works out its index in three axes: a product 8 times slower. A sum is not
    fused there. (SmolLM2's int8 decode step at batch 1, 2 cores of an AMD EPYC Zen 4:
    23.6 -> 12.9 ms.)

    More rows (prefill, batches), with w.bf16: x rounded to bfloat16, the products summed in
    float32, as model.dense does for a bfloat16 w (SmolLM2's products on 2 cores of an AMD EPYC
    Zen 4, 16 / 32 rows: 27 / 41 ms, against 43 / 85 ms for the int8 product below; the 64
    episodes of benchmarks/bench_agent.py one at a time: 18.4-18.9 s -> 15.8 s, in a script that
    ran them twice each way).

    More rows without w.bf16: one int8 product with int32 sums, x quantized too.
    x ~ s (q1 + q2 / 254), s a row's largest |value| / 127 and q2 what q1 missed (at most s / 2)
    in steps of s / 254: off by 1/64,516 of that value, where q1 alone is off by 1/254. Two rows
    for each of x's, as XLA on CPU converts w to int32 for one; w goes first for up to 4 rows of
    x (measured faster there).
    """
    M = x_MxI.shape[0]
    if M == 1:                                                   # one row: w converted as read
        x_MxI = jnp.stack([x_MxI, jnp.zeros_like(x_MxI)]).sum(0)  # x written out (x + 0)
        return (jnp.dot(x_MxI, w.q.astype(x_MxI.dtype).T) * w.scale.T).astype(x_MxI.dtype)
    rows = (([1], [1]), ([], []))                                # contract x's I with w's I
    if w.bf16 is not None:
        y_MxO = jax.lax.dot_general(x_MxI.astype(jnp.bfloat16), w.bf16, rows,
                                    preferred_element_type=jnp.float32)
        return y_MxO.astype(x_MxI.dtype)
    q1, s_Mx1 = _int8(x_MxI)
    # [q1; q2]
    x_2MxI = jnp.vstack([q1, jnp.round((x_MxI - q1 * s_Mx1) / s_Mx1 * 254).astype(jnp.int8)])
    if M <= 4:                                                   # w first: faster for a few rows
        y_Ox2M = jax.lax.dot_general(w.q, x_2MxI, rows, preferred_element_type=jnp.int32)
        return (((y_Ox2M[:, :M] + y_Ox2M[:, M:] / 254) * w.scale).T * s_Mx1).astype(x_MxI.dtype)
    y_2MxO = jax.lax.dot_general(x_2MxI, w.q, rows, preferred_element_type=jnp.int32)
    return (s_Mx1 * (y_2MxO[:M] + y_2MxO[M:] / 254) * w.scale.T).astype(x_MxI.dtype)
