"""A Llama-style transformer as pure functions over a params pytree.

    params = init(key, cfg)                      # nested dict of arrays
    logits_BxTxV = forward(params, cfg, tokens_BxT)

Llama's recipe: RMSNorm before each sub-block, rotary position embeddings
(RoPE), grouped-query attention (K key/value heads shared by N query heads),
a SwiGLU MLP, and an output head tied to the embedding table or not.

The layers' weights are stacked along a leading L axis and the forward pass
runs `jax.lax.scan` over them: one compiled layer instead of L copies, which
keeps compile time flat in depth (SmolLM2 has 30 layers). A shallow model is
unrolled instead: for a few layers the loop's bookkeeping (slicing each
layer's weights out, stacking their gradients) costs more than it saves.

The pieces of a layer (`qkv`, `attend`, `finish_layer`) are public because the
paged decode step (decode.py) runs the same layer with keys and values read
from the cache instead of computed for the whole sequence.

Shape legend, for every module of the engine: array names carry their shape as a suffix
(`k_LxKxPxZxH`, `page_table_BxW`, `active_B`), and each letter has one meaning.

    B        rows of a batch (training rows, prefill rows, decode slots)
    T        token positions along a row (a sequence, or the new tokens of a chunk: the queries)
    S        key positions a query attends to
    D N K    model width; query heads; key/value heads
    G H F    G = N / K query heads per key/value head; head dimension; MLP hidden width
    V L      vocabulary; layers
    P Z W    pages in the cache pool; positions per page (page size); pages per row
             (the page-table width)
    R I O E  LoRA rank; a projection's input and output widths; new embedding rows (LoRA)
    M        rows of a 2-D product (B * T folded into one axis, `dense`)
    Q        a kv head's queries, its G query heads at T positions as one axis (`attend`)
"""

import dataclasses

import jax
import jax.numpy as jnp

from minagent import int8


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 8197          # 8192 BPE pieces + 5 special tokens
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"          # bfloat16 halves memory on GPU; norms and softmax stay float32

    @property
    def head_dim(self):
        return self.d_model // self.n_heads


def init(key, cfg):
    """Random params: normal(0, 0.02) weights, the output projections scaled by depth
    (GPT-2's trick)."""
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    NH, KH = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    keys = iter(jax.random.split(key, 9))
    dtype = jnp.dtype(cfg.dtype)

    def normal(shape, std=0.02):
        return (std * jax.random.normal(next(keys), shape)).astype(dtype)

    out_std = 0.02 / (2 * L) ** 0.5   # residual branches add up over 2L sub-blocks
    params = {
        "embed": normal((V, D)),
        "layers": {
            "attn_norm": jnp.ones((L, D), dtype),
            "wq": normal((L, D, NH)), "wk": normal((L, D, KH)), "wv": normal((L, D, KH)),
            "wo": normal((L, NH, D), out_std),
            "mlp_norm": jnp.ones((L, D), dtype),
            "w_gate": normal((L, D, F)), "w_up": normal((L, D, F)),
            "w_down": normal((L, F, D), out_std),
        },
        "final_norm": jnp.ones((D,), dtype),
    }
    if not cfg.tie_embeddings:
        params["unembed"] = normal((D, V))
    return params


def add_tokens(params, n):
    """Grow the vocabulary by n rows, each the mean of the existing rows.

    A new token then starts as "an average token": its logit is the mean of the
    other logits, so adding it changes no existing logit (a test checks this).
    Returns new params; the caller updates cfg.vocab_size (see `with_vocab`).
    """
    params = dict(params)
    embed_VxD = params["embed"]
    mean_1xD = embed_VxD.mean(axis=0, keepdims=True)
    params["embed"] = jnp.concatenate([embed_VxD, jnp.repeat(mean_1xD, n, axis=0)], axis=0)
    if "unembed" in params:
        unembed_DxV = params["unembed"]
        mean_Dx1 = unembed_DxV.mean(axis=1, keepdims=True)
        params["unembed"] = jnp.concatenate([unembed_DxV, jnp.repeat(mean_Dx1, n, axis=1)], axis=1)
    return params


def with_vocab(cfg, params):
    """cfg with vocab_size read from the embedding table (after add_tokens)."""
    return dataclasses.replace(cfg, vocab_size=params["embed"].shape[0])


# ---------------------------------------------------------------- the pieces

UNROLL = 4   # a model of at most this many layers is unrolled, not scanned


def dense(x_BxTxI, w_IxO, out_dtype=None):
    """x @ w with the leading axes folded into one: [B, T, I] -> [B*T, I] @ [I, O] -> [B, T, O].

    The same product. Why fold: on CPU, XLA's backward pass through a 3-D product writes its
    gradients through slow transposes; the 2-D one does not. w may be int8 (int8.quantize).
    out_dtype: the result's dtype and the sums' (default: x's); the output head asks for float32
    logits, summed in float32 even when x and w are bfloat16.

    A bfloat16 w and a float32 x (bf16.matrices): x is rounded to bfloat16 and the products
    summed in float32. Asked for float32 sums, XLA on CPU runs a product of bfloat16 operands
    as one (AVX512_BF16 where the CPU has it); asked for a bfloat16 result, it converts both
    operands to float32 first (SmolLM2's products at 16 rows on 2 cores of an AMD EPYC Zen 4:
    27 ms, against 192 ms, and 47 ms in float32).
    """
    *lead, I = x_BxTxI.shape
    x_MxI = x_BxTxI.reshape(-1, I)
    if isinstance(w_IxO, int8.Int8):
        y_MxO = int8.dot(x_MxI, w_IxO).astype(out_dtype or x_MxI.dtype)
    else:
        y_MxO = jnp.dot(x_MxI.astype(w_IxO.dtype), w_IxO,
                        preferred_element_type=out_dtype or x_MxI.dtype)
    return y_MxO.reshape(*lead, y_MxO.shape[-1])


def rms_norm(x_BxTxD, w_D, eps):
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * w_D.astype(jnp.float32)).astype(x_BxTxD.dtype)


def rope(x_BxTxNxH, positions_BxT, theta):
    """Rotate each adjacent pair (x[2i], x[2i+1]) by angle position * theta^(-2i/H).

    Why adjacent pairs and not Hugging Face's "rotate_half" (x[i], x[i+H/2])?
    GGUF files store q and k with their rows permuted so that llama.cpp can
    rotate adjacent pairs; choosing the same convention lets minagent load
    SmolLM2's GGUF weights as they are. (HF weights would need the rows
    un-permuted first; the wrong combination gives garbage.)
    """
    H = x_BxTxNxH.shape[-1]
    inv_freq_h = theta ** (-jnp.arange(0, H, 2, dtype=jnp.float32) / H)        # [H/2]
    angle_BxTxh = positions_BxT[..., None].astype(jnp.float32) * inv_freq_h     # [B, T, H/2]
    cos, sin = jnp.cos(angle_BxTxh)[:, :, None, :], jnp.sin(angle_BxTxh)[:, :, None, :]
    x = x_BxTxNxH.astype(jnp.float32)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]                                  # [B, T, N, H/2]
    out = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], axis=-1)
    return out.reshape(x.shape).astype(x_BxTxNxH.dtype)


def qkv(lp, cfg, x_BxTxD, positions_BxT):
    """Normalise, project to queries, keys and values, rotate queries and keys."""
    B, T, _ = x_BxTxD.shape
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h_BxTxD = rms_norm(x_BxTxD, lp["attn_norm"], cfg.norm_eps)
    q_BxTxNxH = dense(h_BxTxD, lp["wq"]).reshape(B, T, N, H)
    k_BxTxKxH = dense(h_BxTxD, lp["wk"]).reshape(B, T, K, H)
    v_BxTxKxH = dense(h_BxTxD, lp["wv"]).reshape(B, T, K, H)
    q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, cfg.rope_theta)
    k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, cfg.rope_theta)
    return q_BxTxNxH, k_BxTxKxH, v_BxTxKxH


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS):
    """Softmax attention; each group of G = N/K query heads shares one kv head.

    A kv head's G query heads at T positions are one axis of Q = G * T queries, so each of the
    two products is one [Q, H] x [S, H] product per row and kv head: one free axis a side. The
    sums are those of G and T kept apart (added in another order, so rounding may differ); XLA
    on CPU runs this form faster, where otherwise a decode step's T = 1 is an axis of size 1 in
    each product (SmolLM2's decode step on 2 cores of an AMD EPYC Zen 2: 8 rows
    106 -> 91 ms, 32 rows 235 -> 204 ms; prefills and training a few percent).
    """
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxSxKxH.shape[2]
    G = N // K
    q_BxKxQxH = q_BxTxNxH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    scores_BxKxQxS = jnp.einsum("bkqh,bskh->bkqs", q_BxKxQxH, k_BxSxKxH,
                                preferred_element_type=jnp.float32)
    scores_BxKxGxTxS = scores_BxKxQxS.reshape(B, K, G, T, -1) / jnp.sqrt(H).astype(jnp.float32)
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, -1e30)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxH.dtype)
    out_BxKxQxH = jnp.einsum("bkqs,bskh->bkqh", probs_BxKxGxTxS.reshape(B, K, G * T, -1),
                             v_BxSxKxH)
    return out_BxKxQxH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N * H)


def finish_layer(lp, cfg, x_BxTxD, attn_BxTxNH):
    """The rest of a layer after attention: output projection, residual, SwiGLU MLP, residual."""
    x_BxTxD = x_BxTxD + dense(attn_BxTxNH, lp["wo"])
    h_BxTxD = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.norm_eps)
    gate_BxTxF = jax.nn.silu(dense(h_BxTxD, lp["w_gate"]))
    return x_BxTxD + dense(gate_BxTxF * dense(h_BxTxD, lp["w_up"]), lp["w_down"])


def embed(params, tokens_BxT):
    return params["embed"][tokens_BxT]


def unembed(params, cfg, x_BxTxD):
    """Final norm and output head -> float32 logits."""
    h_BxTxD = rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps)
    w_DxV = params["unembed"] if "unembed" in params else params["embed"].T
    return dense(h_BxTxD, w_DxV, jnp.float32)


# ---------------------------------------------------------------- whole sequences

def forward(params, cfg, tokens_BxT, positions_BxT=None, segments_BxT=None):
    """Logits for every position of whole sequences (training, evaluation, references).

    segments_BxT: optional ids of the documents packed into one row; a position
    attends only to earlier positions of its own segment, and of segment -1, a
    prefix they share. Pass positions that restart for each segment (train.pack).
    """
    B, T = tokens_BxT.shape
    if positions_BxT is None:
        positions_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal_TxS = jnp.tril(jnp.ones((T, T), dtype=bool))
    mask_BxTxS = jnp.broadcast_to(causal_TxS, (B, T, T))
    if segments_BxT is not None:
        seg_BxTx1, seg_Bx1xS = segments_BxT[:, :, None], segments_BxT[:, None, :]
        mask_BxTxS = mask_BxTxS & ((seg_BxTx1 == seg_Bx1xS) | (seg_Bx1xS == -1))

    def layer(x_BxTxD, lp):
        q, k, v = qkv(lp, cfg, x_BxTxD, positions_BxT)
        return finish_layer(lp, cfg, x_BxTxD, attend(q, k, v, mask_BxTxS)), None

    x_BxTxD, _ = jax.lax.scan(layer, embed(params, tokens_BxT), params["layers"],
                              unroll=cfg.n_layers <= UNROLL)
    return unembed(params, cfg, x_BxTxD)


def n_params(params):
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def flops_per_token(cfg, context):
    """Forward FLOPs per token: 2 per weight (multiply-add) plus attention over `context` keys.

    Training costs 3x this (forward + backward). The embedding lookup is free;
    the output head is a matmul and counts.
    """
    D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    NH, KH = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    weights = L * (D * NH + 2 * D * KH + NH * D + 3 * D * F) + D * V
    attention = L * 2 * NH * context   # q.k and probs.v
    return 2 * weights + 2 * attention
