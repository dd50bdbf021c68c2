"""The jitted steps over the paged KV cache: push new tokens, sample the next ones.

One core function, `extend`, pushes up to T new tokens per row through the
model, starting at each row's current length, and writes their keys and values
into the row's pages. The two jitted steps are uses of it:

    prefill_step   extend over B rows of T tokens, T from a few length buckets
                   (16, 64, 256, ...): prompts, and tokens appended on resume
    decode_step    extend with T = 1 over every slot, then sample one token per
                   slot; a slot whose pause mask is off pushes nothing

Shapes are fixed by (B, T, W, the cache): after the first call of each shape nothing
recompiles. A row with n_new == 0, and every padding position, writes its K/V to the
null page only: a paused sequence's pages stay bit-identical while the others step
(docs/DESIGN.md, "The pause mask"). Shape letters: docs/DESIGN.md, "Shape legend".
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from minagent import model
from minagent.cache import NULL_PAGE

# How many times each jitted step was traced (= compiled): a trace runs the
# Python body once, a cached compile does not. Tests count these to show that
# nothing recompiles after warm-up.
TRACES = collections.Counter()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """What the decode step reads of each of the B slots, and returns one token later. A free, paused
    or finished slot has active False: it pushes nothing; its pending token and length stay."""
    tokens_B: jax.Array         # int32 [B]     the pending token: pushed this step, at position lengths_B
    lengths_B: jax.Array        # int32 [B]     positions already in the cache
    active_B: jax.Array         # bool  [B]     the pause mask: True for the slots that advance
    seeds_B: jax.Array          # int32 [B]     each sequence's sampling stream
    page_table_BxW: jax.Array   # int32 [B, W]  each slot's pages in order, NULL_PAGE past its last

    @classmethod
    def idle(cls, B, W):
        """B slots on the host, none active, every page-table entry the null page."""
        zeros_B = np.zeros(B, np.int32)
        return cls(zeros_B, zeros_B.copy(), np.zeros(B, bool), zeros_B.copy(), np.zeros((B, W), np.int32))


def extend(params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW, attention="gather"):
    """Push tokens_BxT[b, :n_new_B[b]] at positions start_B[b], start_B[b] + 1, ... of row b.

    Returns (logits_BxV of each row's last new token, the updated cache).
    Rows with n_new == 0 get meaningless (finite) logits and change nothing
    but the null page. attention: "gather" (the reference: gather the W pages of
    every row, mask) or "pallas" (T == 1 only: devices.paged_attention, each row's own pages).
    """
    B, T = tokens_BxT.shape
    W = page_table_BxW.shape[1]
    K, _, Z, H = cache["k"].shape[1:]
    if attention not in ("gather", "pallas") or (attention == "pallas" and T != 1):
        raise ValueError(f"attention={attention!r} with {T} new tokens a row: 'gather', or 'pallas' for one")
    S = W * Z                     # key positions: every position of the row's gathered pages

    positions_BxT = start_B[:, None] + jnp.arange(T)
    is_new_BxT = jnp.arange(T) < n_new_B[:, None]
    # Where each new token's K/V goes: page table[p // Z], offset p % Z; padding -> null page.
    # (The clip only matters for padding positions past the table, which go to page 0 anyway.)
    table_page_BxT = jnp.take_along_axis(page_table_BxW, jnp.minimum(positions_BxT // Z, W - 1), axis=1)
    page_BxT = jnp.where(is_new_BxT, table_page_BxT, NULL_PAGE)
    offset_BxT = positions_BxT % Z

    # Key s of the gathered pages is position s of the row. A query at position p
    # sees keys s <= p (causal, inside the chunk too) that the row really holds
    # (s < its new length). The rest of the gathered pages may be anything,
    # even NaN: the mask drops their scores, and zeroing their values keeps
    # softmax's 0 * NaN = NaN from leaking in.
    length_B = start_B + n_new_B
    key_pos_S = jnp.arange(S)
    holds_BxS = key_pos_S < length_B[:, None]
    mask_BxTxS = (key_pos_S <= positions_BxT[:, :, None]) & holds_BxS[:, None, :]

    def layer(carry, lp_and_l):
        x_BxTxD, k_LxKxPxZxH, v_LxKxPxZxH = carry
        lp, l = lp_and_l
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = model.qkv(lp, cfg, x_BxTxD, positions_BxT)
        # Write first, then read the row's pages back: the chunk attends to itself through the cache.
        # The cache is carried from layer to layer, so XLA updates it in place (no per-layer copies).
        # (NumPy's rule: index arrays split by a slice put their dims first, so the target is [B, T, K, H].)
        # A non-finite key or value is written as 0: a row that overflows keeps its NaN in its own
        # logits (the residual stream carries it), and no other row can read it from a page it gets
        # later, nor from the null page; Pallas attention relies on that (devices.paged_attention).
        k_BxTxKxH, v_BxTxKxH = (jnp.where(jnp.isfinite(a), a, 0) for a in (k_BxTxKxH, v_BxTxKxH))
        k_LxKxPxZxH = k_LxKxPxZxH.at[l, :, page_BxT, offset_BxT].set(k_BxTxKxH.astype(k_LxKxPxZxH.dtype))
        v_LxKxPxZxH = v_LxKxPxZxH.at[l, :, page_BxT, offset_BxT].set(v_BxTxKxH.astype(v_LxKxPxZxH.dtype))
        if attention == "pallas":
            from minagent import devices    # noqa: PLC0415  (devices.py builds on this module)
            attn_BxTxNH = devices.paged_attention(q_BxTxNxH[:, 0], k_LxKxPxZxH, v_LxKxPxZxH, l,
                                                  page_table_BxW, length_B)[:, None]
        else:
            keys_BxSxKxH = gather_pages(k_LxKxPxZxH[l], page_table_BxW)
            values_BxSxKxH = gather_pages(v_LxKxPxZxH[l], page_table_BxW)
            values_BxSxKxH = jnp.where(holds_BxS[:, :, None, None], values_BxSxKxH, 0)
            attn_BxTxNH = model.attend(q_BxTxNxH, keys_BxSxKxH, values_BxSxKxH, mask_BxTxS)
        attn_BxTxNH = attn_BxTxNH.reshape(B, T, -1).astype(x_BxTxD.dtype)   # the cache's dtype may be wider
        return (model.finish_layer(lp, cfg, x_BxTxD, attn_BxTxNH), k_LxKxPxZxH, v_LxKxPxZxH), None

    carry = (model.embed(params, tokens_BxT), cache["k"], cache["v"])
    if isinstance(params["layers"], list):     # unstack_layers(params): one layer after another, in place
        for l, lp in enumerate(params["layers"]):
            carry, _ = layer(carry, (lp, l))
    else:                                       # stacked [L, ...] weights: a scan over the layers
        carry, _ = jax.lax.scan(layer, carry, (params["layers"], jnp.arange(cfg.n_layers)))
    x_BxTxD, k, v = carry
    last_B = jnp.maximum(n_new_B - 1, 0)
    x_last_Bx1xD = jnp.take_along_axis(x_BxTxD, last_B[:, None, None], axis=1)
    logits_BxV = model.unembed(params, cfg, x_last_Bx1xD)[:, 0]
    return logits_BxV, {"k": k, "v": v}


def gather_pages(pool_KxPxZxH, page_table_BxW):
    """Each row's W pages, in order, as its S = W * Z key positions -> [B, S, K, H]."""
    K, _, Z, H = pool_KxPxZxH.shape
    B, W = page_table_BxW.shape
    return pool_KxPxZxH[:, page_table_BxW].reshape(K, B, W * Z, H).transpose(1, 2, 0, 3)


def unstack_layers(params):
    """params whose "layers" are stacked [L, ...] arrays (model.py's layout) -> the same params with
    "layers" a list of L per-layer dicts. The Batch does this once on CPU; extend accepts both layouts.

    Why: a scan slices layer l's matrices out of the [L, ...] arrays at every step, on CPU a
    copy; separate arrays are read where they lie. The price: a deep model compiles more slowly,
    and each call passes 9 arrays a layer, a dispatch cost a GPU would feel (there the Batch
    keeps them stacked).
    """
    layers = params["layers"]
    if isinstance(layers, list):
        return params
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda a: a[l], layers) for l in range(n_layers)]}


def sample(logits_BxV, seeds_B, positions_B, temperature=0.0, top_k=0):
    """One token per row: argmax if temperature == 0, else softmax(logits / temperature) over the top_k.

    Row b draws with key fold_in(fold_in(PRNGKey(0), seeds_B[b]), positions_B[b]):
    a sequence's draws depend on its own seed and position only, not on its
    slot or on what else is in the batch. temperature and top_k are Python
    numbers (static under jit: a Batch keeps one setting, so one compile).
    """
    if not 0 <= temperature < float("inf") or top_k < 0:      # a negative temperature inverts the odds
        raise ValueError(f"temperature={temperature!r}, top_k={top_k!r}: need temperature >= 0, top_k >= 0")
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV.astype(jnp.float32) / temperature
    if top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV >= kth_Bx1, logits_BxV, -jnp.inf)
    root = jax.random.PRNGKey(0)
    keys_B = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(root, s), p))(seeds_B, positions_B)
    return jax.vmap(jax.random.categorical)(keys_B, logits_BxV).astype(jnp.int32)


def mask_logits(logits_BxV, allowed_BxV):
    """Disallowed tokens get logit -inf, so neither argmax nor a draw can pick them.

    A row that allows nothing is left as it is (all allowed): softmax over all -inf is NaN.
    """
    allowed_BxV = allowed_BxV | ~allowed_BxV.any(axis=-1, keepdims=True)
    return jnp.where(allowed_BxV, logits_BxV, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW):
    """extend over B rows of T tokens -> the updated cache (the logits are not needed: XLA drops them)."""
    TRACES["prefill", tokens_BxT.shape, page_table_BxW.shape] += 1
    _, cache = extend(params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW)
    return cache


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_k", "attention"),
                   donate_argnames=("cache",))
def decode_step(params, cfg, cache, slots, temperature=0.0, top_k=0, allowed_BxV=None, attention="gather"):
    """Push each active slot's pending token and sample the next -> (slots one token later, logits_BxV, cache).

    In the returned Slots an active slot's pending token is the one just sampled,
    at position lengths_B + 1; the other slots are as they were. allowed_BxV
    (bool, optional) limits what each row may sample: a sequence's token mask
    (Batch.add's `mask`); None compiles the step without it. The returned logits
    are the model's, unmasked. attention: "gather" or "pallas" (extend).
    """
    TRACES["decode", slots.page_table_BxW.shape, allowed_BxV is None] += 1
    n_new_B = slots.active_B.astype(jnp.int32)
    logits_BxV, cache = extend(params, cfg, cache, slots.tokens_B[:, None], slots.lengths_B, n_new_B,
                               slots.page_table_BxW, attention)
    masked_BxV = logits_BxV if allowed_BxV is None else mask_logits(logits_BxV, allowed_BxV)
    next_B = sample(masked_BxV, slots.seeds_B, slots.lengths_B + 1, temperature, top_k)
    later = dataclasses.replace(slots, tokens_B=jnp.where(slots.active_B, next_B, slots.tokens_B),
                                lengths_B=slots.lengths_B + n_new_B)
    return later, logits_BxV, cache
