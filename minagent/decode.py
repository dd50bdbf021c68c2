"""The jitted steps over the paged KV cache: push new tokens, sample the next ones.

One core function, `extend`, pushes up to T new tokens per row through the
model, starting at each row's current length, and writes their keys and values
into the row's pages. Everything else is a use of it:

    prefill_step   extend with T from a few length buckets (16, 64, 256, ...)
                   over R rows: prompts and resumed tokens
    decode_step    extend with T = 1 over all B slots, then sample one token
                   per slot; n_new = 0 for paused and free slots (the pause mask)

Shapes are fixed by (R or B, T, page-table width M, cache size), so after the
first call of each bucket nothing recompiles, whatever the sequences' lengths.

A row with n_new == 0, and every padding position t >= n_new, writes its K/V to
the null page 0 and nowhere else: a paused sequence's pages stay bit-identical
while the others step.

Shape legend (as in model.py, plus): R rows   B slots   T new tokens per row
    P pages   S page size   M pages per row (page-table width)
    MS = M*S key positions of a row's gathered pages
"""

import collections
import functools

import jax
import jax.numpy as jnp

from minagent import model
from minagent.cache import NULL_PAGE

# How many times each jitted step was traced (= compiled): a trace runs this
# Python body once, a cached compile does not. The tests count these to show
# that nothing recompiles after warm-up.
TRACES = collections.Counter()


def n_traces():
    return sum(TRACES.values())


def extend(params, cfg, cache, tokens_RxT, start_R, n_new_R, page_table_RxM):
    """Push tokens_RxT[r, :n_new_R[r]] at positions start_R[r], start_R[r] + 1, ... of row r.

    Returns (logits_RxV of each row's last new token, the updated cache).
    Rows with n_new == 0 get meaningless (finite) logits and change nothing
    but the null page.
    """
    R, T = tokens_RxT.shape
    M = page_table_RxM.shape[1]
    S, K, H = cache["k"].shape[2:]
    MS = M * S

    positions_RxT = start_R[:, None] + jnp.arange(T)
    is_new_RxT = jnp.arange(T) < n_new_R[:, None]
    # Where each new token's K/V goes: page table[p // S], offset p % S; padding -> null page.
    # (The clip only matters for padding positions past the table, which go to page 0 anyway.)
    table_page_RxT = jnp.take_along_axis(page_table_RxM, jnp.minimum(positions_RxT // S, M - 1), axis=1)
    page_RxT = jnp.where(is_new_RxT, table_page_RxT, NULL_PAGE)
    offset_RxT = positions_RxT % S

    # Key j of the gathered pages is position j of the row. A query at position p
    # sees keys j <= p (causal, inside the chunk too) that the row really holds
    # (j < its new length). The rest of the gathered pages may be anything,
    # even NaN: the mask drops their scores, and zeroing their values keeps
    # softmax's 0 * NaN = NaN from leaking in.
    length_R = start_R + n_new_R
    key_pos_MS = jnp.arange(MS)
    holds_RxMS = key_pos_MS < length_R[:, None]
    mask_RxTxMS = (key_pos_MS <= positions_RxT[:, :, None]) & holds_RxMS[:, None, :]

    def layer(carry, lp_and_l):
        x_RxTxD, k_LxPxSxKxH, v_LxPxSxKxH = carry
        lp, l = lp_and_l
        q_RxTxNxH, k_RxTxKxH, v_RxTxKxH = model.qkv(lp, cfg, x_RxTxD, positions_RxT)
        # Write first, then read the row's pages back: the chunk attends to itself through the cache.
        # The cache is carried from layer to layer, so XLA updates it in place (no per-layer copies).
        k_LxPxSxKxH = k_LxPxSxKxH.at[l, page_RxT, offset_RxT].set(k_RxTxKxH.astype(k_LxPxSxKxH.dtype))
        v_LxPxSxKxH = v_LxPxSxKxH.at[l, page_RxT, offset_RxT].set(v_RxTxKxH.astype(v_LxPxSxKxH.dtype))
        keys_RxMSxKxH = k_LxPxSxKxH[l][page_table_RxM].reshape(R, MS, K, H)
        values_RxMSxKxH = v_LxPxSxKxH[l][page_table_RxM].reshape(R, MS, K, H)
        values_RxMSxKxH = jnp.where(holds_RxMS[:, :, None, None], values_RxMSxKxH, 0)
        attn_RxTxNH = model.attend(q_RxTxNxH, keys_RxMSxKxH, values_RxMSxKxH, mask_RxTxMS)
        return (model.finish_layer(lp, cfg, x_RxTxD, attn_RxTxNH), k_LxPxSxKxH, v_LxPxSxKxH), None

    carry = (model.embed(params, tokens_RxT), cache["k"], cache["v"])
    if isinstance(params["layers"], list):     # unstack_layers(params): one layer after another, in place
        for l, lp in enumerate(params["layers"]):
            carry, _ = layer(carry, (lp, l))
    else:                                       # stacked [L, ...] weights: a scan over the layers
        carry, _ = jax.lax.scan(layer, carry, (params["layers"], jnp.arange(cfg.n_layers)))
    x_RxTxD, k, v = carry
    last_R = jnp.maximum(n_new_R - 1, 0)
    x_last_Rx1xD = jnp.take_along_axis(x_RxTxD, last_R[:, None, None], axis=1)
    logits_RxV = model.unembed(params, cfg, x_last_Rx1xD)[:, 0]
    return logits_RxV, {"k": k, "v": v}


def unstack_layers(params):
    """params whose "layers" are stacked [L, ...] arrays (model.py's layout) -> the same params with
    "layers" a list of L per-layer dicts. Batch does this once; extend accepts both layouts.

    Why: a scan over stacked weights slices layer l's matrices out of the [L, ...] arrays at every
    step, and on CPU that slice is a copy (14 MB per SmolLM2 layer): about a third of a batch-1
    decode step (benchmarks/bench_decode.py). Separate arrays are read where they lie. The price:
    the step is traced layer by layer, so it compiles more slowly for deep models: SmolLM2's
    30-layer decode step takes 3.3 s to trace and compile against 0.5 s for the scan, and then
    steps 10 % faster at batch 8 (benchmarks/bench_compile.py).
    """
    layers = params["layers"]
    if isinstance(layers, list):
        return params
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda a: a[l], layers) for l in range(n_layers)]}


def sample(logits_BxV, seq_seed_B, position_B, temperature=0.0, top_k=0):
    """One token per row: argmax if temperature == 0, else softmax(logits / temperature) over the top_k.

    Row b draws with key fold_in(fold_in(PRNGKey(0), seq_seed_B[b]), position_B[b]):
    a sequence's draws depend on its own seed and position only, not on its
    slot or on what else is in the batch. temperature and top_k are Python
    numbers (static under jit: a Batch keeps one setting, so one compile).
    """
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV.astype(jnp.float32) / temperature
    if top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV >= kth_Bx1, logits_BxV, -jnp.inf)
    root = jax.random.PRNGKey(0)
    keys_B = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(root, s), p))(seq_seed_B, position_B)
    return jax.vmap(jax.random.categorical)(keys_B, logits_BxV).astype(jnp.int32)


def mask_logits(logits_BxV, allowed_BxV):
    """Disallowed tokens get logit -inf, so neither argmax nor a draw can pick them.

    A row that allows nothing is left as it is (all allowed): softmax over all -inf is NaN.
    """
    allowed_BxV = allowed_BxV | ~allowed_BxV.any(axis=-1, keepdims=True)
    return jnp.where(allowed_BxV, logits_BxV, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_step(params, cfg, cache, tokens_RxT, start_R, n_new_R, page_table_RxM):
    """extend over R rows of T tokens -> the updated cache (the logits are not needed: XLA drops them)."""
    TRACES["prefill", tokens_RxT.shape] += 1
    _, cache = extend(params, cfg, cache, tokens_RxT, start_R, n_new_R, page_table_RxM)
    return cache


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_k"), donate_argnames=("cache",))
def decode_step(params, cfg, cache, tokens_B, lengths_B, active_B, page_table_BxM, seeds_B,
                temperature=0.0, top_k=0, allowed_BxV=None):
    """Push each active slot's one pending token, sample the next -> (next_B, logits_BxV, cache).

    active_B is the pause mask: slots that are paused, finished or free push
    nothing (their n_new is 0) and their cache pages are left untouched.
    The sampled token sits at position lengths_B + 1.
    allowed_BxV (bool, optional: constrain.py's token masks) limits what each row may sample;
    None compiles the step without it. The returned logits are the model's, unmasked.
    """
    TRACES["decode", tokens_B.shape, page_table_BxM.shape] += 1
    n_new_B = active_B.astype(jnp.int32)
    logits_BxV, cache = extend(params, cfg, cache, tokens_B[:, None], lengths_B, n_new_B, page_table_BxM)
    masked_BxV = logits_BxV if allowed_BxV is None else mask_logits(logits_BxV, allowed_BxV)
    next_B = sample(masked_BxV, seeds_B, lengths_B + 1, temperature, top_k)
    return next_B, logits_BxV, cache
