"""The jitted steps over the paged KV cache: push new tokens, sample the next ones.

One core function, `extend`, pushes up to T new tokens per row through the
model, starting at each row's current length, and writes their keys and values
into the row's pages (`extend_groups`: several groups of rows, each its own T, in
one call). The jitted steps are uses of it:

    prefill_step   extend over B rows of T tokens, T from a few length buckets
                   (8, 16, 32, ...): prompts, and tokens appended on resume;
                   sample_step then samples each row's next token from its logits
    decode_step    extend with T = 1 over every slot, then sample one token per
                   slot; a slot whose pause mask is off pushes nothing
    decode_prefill_step
                   a decode step with a prefill's rows beside it: one pass over the
                   weights for both (extend_groups)
    decode_steps   up to n decode steps in one call, a slot stopping on its own when
                   it samples an end token, the call when all have: no trip to the
                   host between them

A row reads its pages one of two ways (`attention`): "gather" copies each row's
pages into one array and masks what the row does not hold (`gather_pages`, the
reference), "pallas" runs JAX's paged-attention kernel, which loads only the row's
own pages (`paged_attention`; one new token a row).

Shapes are fixed by (B, T, the page-table width W, the cache): after the first
call of each shape nothing recompiles, whatever the sequences' lengths. A row
with n_new == 0, and every padding position t >= n_new, writes its K/V to the
null page and nowhere else: a paused sequence's pages stay bit-identical while
the others step (docs/engine.md, "The pause mask"). Shape letters: the legend in
model.py.
"""

import collections
import dataclasses
import functools
import numbers

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
    """What the decode step reads of each of the B slots, and returns one token later. A
    free, paused or finished slot has active False: it pushes nothing; its pending token and
    length stay."""
    tokens_B: jax.Array         # int32 [B]     the pending token: pushed this step, at position
    #                                           lengths_B
    lengths_B: jax.Array        # int32 [B]     positions already in the cache
    active_B: jax.Array         # bool  [B]     the pause mask: True for the slots that advance
    seeds_B: jax.Array          # int32 [B]     each sequence's sampling stream
    page_table_BxW: jax.Array   # int32 [B, W]  each slot's pages in order, NULL_PAGE past its last

    @classmethod
    def idle(cls, B, W):
        """B slots on the host, none active, every page-table entry the null page."""
        zeros_B = np.zeros(B, np.int32)
        return cls(zeros_B, zeros_B.copy(), np.zeros(B, bool), zeros_B.copy(),
                   np.zeros((B, W), np.int32))


def extend(params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW, attention="gather"):
    """Push tokens_BxT[b, :n_new_B[b]] at positions start_B[b], start_B[b] + 1, ... of row b.

    Returns (logits_BxV of each row's last new token, the updated cache).
    Rows with n_new == 0 get meaningless (finite) logits and change nothing
    but the null page. attention: "gather" (the reference: gather the W pages of
    every row, mask) or "pallas" (T == 1 only: paged_attention, each row's own pages).
    params["layers"]: stacked [L, ...] arrays (model.py's layout), scanned over; or a list of
    per-layer dicts (runner.unstack_layers), run one after another.
    """
    group = (tokens_BxT, start_B, n_new_B, page_table_BxW)
    (logits_BxV,), cache = extend_groups(params, cfg, cache, [group], [attention])
    return logits_BxV, cache


def extend_groups(params, cfg, cache, groups, attentions, packed=None):
    """extend for several groups of rows in one call -> ([logits_BxV of each group], the cache).

    groups: (tokens_BxT, start_B, n_new_B, page_table_BxW) each, every group its own B, T and W;
    attentions: each group's way of reading its pages. A decode step's rows (T = 1) and a few
    rows of a prefill beside them (T = 12, say) go through the model together: the parts of a
    layer that treat each token alone (norms, projections, the MLP: the products, which read
    every weight once a call however many tokens they take) run once on every group's tokens,
    one after another in a single axis; attention runs group by group, each row over its own
    pages. The same numbers as a call per group up to rounding (the rows never meet: a product's
    sums may be blocked differently for more rows), one pass over the weights instead of one a
    group.

    packed: None, or J >= the number of real tokens (the n_new's summed over every row): the
    per-token parts take only the real tokens, packed into J positions (the rest padding that
    writes to the null page), instead of all M = the sum of B * T, most of whose padding
    positions (each row's chunk padded to T, idle rows) would cost the products as much as a
    real token. Attention still reads the rows as B x T: each layer's queries go back to that
    layout and their results come out of it (a gather, J x D numbers, not a product).
    """
    sizes = [tokens_BxT.shape for tokens_BxT, *_ in groups]      # (B, T) of each group
    for (B, T), attention in zip(sizes, attentions):
        if attention not in ("gather", "pallas") or (attention == "pallas" and T != 1):
            raise ValueError(f"attention={attention!r} with {T} new tokens a row: 'gather', or "
                             f"'pallas' for one")

    # Every group's tokens one after another in one row of M = the sum of B * T: the per-token
    # parts take them all at once (join); attention and the last tokens, group by group (split).
    def join(arrays_BxTx_):
        return jnp.concatenate([a.reshape(1, -1, *a.shape[2:]) for a in arrays_BxTx_], axis=1)

    def split(a_1xMx_):
        parts = jnp.split(a_1xMx_[0], np.cumsum([B * T for B, T in sizes])[:-1])
        return [a.reshape(B, T, *a.shape[1:]) for a, (B, T) in zip(parts, sizes)]

    places = [_place(cache["k"].shape[3], *group) for group in groups]
    # The positions the per-token parts take: all M, in order (J = M), or packed (J = packed):
    # the real ones first, in order, then a padding one repeated.
    M = sum(B * T for B, T in sizes)
    if packed is None or packed >= M:
        pack = unpack = lambda a: a
    else:
        is_new_M = join([place["is_new_BxT"] for place in places])[0]
        take_J = jnp.nonzero(is_new_M, size=packed, fill_value=jnp.argmin(is_new_M))[0]
        def pack(a_1xMx_):
            return a_1xMx_[:, take_J]
        def unpack(a_1xJx_):    # -> [1, M, ...], the B x T layout; padding positions hold 0s
            return jnp.zeros((1, M, *a_1xJx_.shape[2:]), a_1xJx_.dtype).at[:, take_J].set(a_1xJx_)
    positions_1xJ, page_1xJ, offset_1xJ = (pack(join([place[name] for place in places]))
                                           for name in ("positions_BxT", "page_BxT", "offset_BxT"))

    def layer(carry, lp_and_l):
        x_1xJxD, k_LxKxPxZxH, v_LxKxPxZxH = carry
        lp, l = lp_and_l
        q_1xJxNxH, k_1xJxKxH, v_1xJxKxH = model.qkv(lp, cfg, x_1xJxD, positions_1xJ)
        # Write first, then read the row's pages back: the chunk attends to itself through the
        # cache. The cache is carried from layer to layer, so XLA updates it in place (no
        # per-layer copies). `at`: layer l, every kv head, each new token's page and offset.
        # (NumPy's rule: index arrays split by a slice put their dims first, so the target is
        # [1, J, K, H].)
        # A non-finite key or value is written as 0: a row that overflows keeps its NaN in its own
        # logits (the residual stream carries it), and no other row can read it from a page it gets
        # later, nor from the null page; Pallas attention relies on that (paged_attention).
        k_1xJxKxH, v_1xJxKxH = (jnp.where(jnp.isfinite(a), a, 0) for a in (k_1xJxKxH, v_1xJxKxH))
        at = (l, slice(None), page_1xJ, offset_1xJ)
        k_LxKxPxZxH = k_LxKxPxZxH.at[at].set(k_1xJxKxH.astype(k_LxKxPxZxH.dtype))
        v_LxKxPxZxH = v_LxKxPxZxH.at[at].set(v_1xJxKxH.astype(v_LxKxPxZxH.dtype))
        attn = []
        for q_BxTxNxH, place, attention in zip(split(unpack(q_1xJxNxH)), places, attentions):
            table_BxW = place["page_table_BxW"]
            if attention == "pallas":
                attn_BxTxNH = paged_attention(q_BxTxNxH[:, 0], k_LxKxPxZxH, v_LxKxPxZxH, l,
                                              table_BxW, place["length_B"])[:, None]
            else:
                keys_BxSxKxH = gather_pages(k_LxKxPxZxH[l], table_BxW)
                values_BxSxKxH = gather_pages(v_LxKxPxZxH[l], table_BxW)
                values_BxSxKxH = jnp.where(place["holds_BxS"][:, :, None, None], values_BxSxKxH, 0)
                attn_BxTxNH = model.attend(q_BxTxNxH, keys_BxSxKxH, values_BxSxKxH,
                                           place["mask_BxTxS"])
            attn.append(attn_BxTxNH.reshape(*q_BxTxNxH.shape[:2], -1))
        # back to the residual stream's dtype (the cache's may be wider)
        attn_1xJxNH = pack(join(attn)).astype(x_1xJxD.dtype)
        return (model.finish_layer(lp, cfg, x_1xJxD, attn_1xJxNH), k_LxKxPxZxH, v_LxKxPxZxH), None

    tokens_1xJ = pack(join([tokens_BxT for tokens_BxT, *_ in groups]))
    carry = (model.embed(params, tokens_1xJ), cache["k"], cache["v"])
    if isinstance(params["layers"], list):     # runner.unstack_layers: layer by layer, in place
        for l, lp in enumerate(params["layers"]):
            carry, _ = layer(carry, (lp, l))
    else:                                       # stacked [L, ...] weights: a scan over the layers
        carry, _ = jax.lax.scan(layer, carry, (params["layers"], jnp.arange(cfg.n_layers)))
    x_1xJxD, k, v = carry
    # Each row's last new token, every group's rows together: one pass over the output head.
    lasts = [jnp.take_along_axis(x_BxTxD, jnp.maximum(place["n_new_B"] - 1, 0)[:, None, None], 1)
             for x_BxTxD, place in zip(split(unpack(x_1xJxD)), places)]
    logits_RxV = model.unembed(params, cfg, jnp.concatenate(lasts, axis=0))[:, 0]
    return jnp.split(logits_RxV, np.cumsum([B for B, _ in sizes])[:-1]), {"k": k, "v": v}


def _place(Z, tokens_BxT, start_B, n_new_B, page_table_BxW):
    """Where a group's new tokens go, and which keys each may see -> a dict of arrays."""
    B, T = tokens_BxT.shape
    W = page_table_BxW.shape[1]
    S = W * Z                     # key positions: every position of the row's gathered pages
    positions_BxT = start_B[:, None] + jnp.arange(T)
    is_new_BxT = jnp.arange(T) < n_new_B[:, None]
    # Where each new token's K/V goes: page table[p // Z], offset p % Z; padding -> null page.
    # (The clip only matters for padding positions past the table, which go to page 0 anyway.)
    column_BxT = jnp.minimum(positions_BxT // Z, W - 1)
    table_page_BxT = jnp.take_along_axis(page_table_BxW, column_BxT, axis=1)
    page_BxT = jnp.where(is_new_BxT, table_page_BxT, NULL_PAGE)

    # Key s of the gathered pages is position s of the row. A query at position p
    # sees keys s <= p (causal, inside the chunk too) that the row really holds
    # (s < its new length). The rest of the gathered pages may be anything,
    # even NaN: the mask drops their scores, and zeroing their values keeps
    # softmax's 0 * NaN = NaN from leaking in.
    length_B = start_B + n_new_B
    key_pos_S = jnp.arange(S)
    holds_BxS = key_pos_S < length_B[:, None]
    mask_BxTxS = (key_pos_S <= positions_BxT[:, :, None]) & holds_BxS[:, None, :]
    return dict(positions_BxT=positions_BxT, is_new_BxT=is_new_BxT, page_BxT=page_BxT,
                offset_BxT=positions_BxT % Z,
                page_table_BxW=page_table_BxW, n_new_B=n_new_B, length_B=length_B,
                holds_BxS=holds_BxS, mask_BxTxS=mask_BxTxS)


def gather_pages(pool_KxPxZxH, page_table_BxW):
    """Each row's W pages, in order, as its S = W * Z key positions -> [B, S, K, H]."""
    K, _, Z, H = pool_KxPxZxH.shape
    B, W = page_table_BxW.shape
    return pool_KxPxZxH[:, page_table_BxW].reshape(K, B, W * Z, H).transpose(1, 2, 0, 3)


MIN_DOT = 16     # Triton's dot multiplies blocks of at least 16 along every dimension


def check_pallas(page_size, head_dim):
    """Raise ValueError unless the Pallas kernel can compile for these shapes on a GPU.

    The kernel multiplies a query block [16, head_dim] by a key block [head_dim, pages * page_size]
    with Triton's dot, which needs 16 or more along each dimension. A row of one page (the Batch's
    first table width) loads one page at a time, so page_size itself must be 16 or more. Checked on
    every backend: interpret mode would run a shape that a GPU then refuses to compile."""
    if page_size < MIN_DOT or head_dim < MIN_DOT:
        raise ValueError(f"Pallas attention needs page_size >= {MIN_DOT} and head_dim >= {MIN_DOT} "
                         f"(Triton's dot), not {page_size} and {head_dim}: use a larger page "
                         f"size, or attention='gather'")


def paged_attention(q_BxNxH, k_LxKxPxZxH, v_LxKxPxZxH, l, page_table_BxW, length_B):
    """Layer l's attention: one query per row over the first length_B[b] positions of row b's pages
    -> [B, N, H].

    The same attention as the gather path, computed by JAX's Pallas paged-attention kernel
    (jax.experimental.pallas.ops.gpu), which loads only the pages a row holds, block by block,
    with an online softmax. On a GPU it compiles through Triton; elsewhere it runs in Pallas's
    interpret mode (slow: for checking it against the gather path). Unlike the gather path it
    multiplies the masked weights of positions past a row's length by their values, so it needs
    those values finite (0 * NaN is NaN): extend never writes a non-finite key or value.

    The kernel is handed the whole cache of every layer, not layer l's part of it: a kernel call
    takes its arguments as whole buffers, so k[l] would be copied out first, every layer, as many
    bytes as the kernel then reads. Read as one kv head of L * K * P pages (a reshape, no copy),
    layer l's head k's page p is page (l * K + k) * P + p, and each (row, kv head) pair becomes
    a row of its own with the G = N / K query heads that share that kv head.
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_ops
    L, K, P, Z, H = k_LxKxPxZxH.shape
    B, N, _ = q_BxNxH.shape
    W = page_table_BxW.shape[1]
    check_pallas(Z, H)
    splits = next(s for s in (16, 8, 4, 2, 1) if W % s == 0)         # parts of a row, in parallel
    block = next(b for b in (8, 4, 2, 1) if (W // splits) % b == 0)  # pages loaded at a time
    q_BxNxH = q_BxNxH.astype(jnp.float32) / jnp.sqrt(H).astype(jnp.float32)
    q_BxNxH = q_BxNxH.astype(k_LxKxPxZxH.dtype)
    first_K = (l * K + jnp.arange(K)) * P      # each kv head's first page, layer l
    table_BKxW = (first_K[None, :, None] + page_table_BxW[:, None, :]).reshape(B * K, W)
    out_BKxGxH = pallas_ops.paged_attention(
        q_BxNxH.reshape(B * K, N // K, H), k_LxKxPxZxH.reshape(1, L * K * P, Z, H),
        v_LxKxPxZxH.reshape(1, L * K * P, Z, H), table_BKxW,
        jnp.repeat(jnp.maximum(length_B, 1), K).astype(jnp.int32),
        block_h=16, pages_per_compute_block=block, k_splits=splits,
        interpret=jax.default_backend() != "gpu")
    return out_BKxGxH.reshape(B, N, H)


def check_sampling(temperature, top_k):
    """Raise ValueError unless temperature >= 0 (0: greedy) and top_k is an integer >= 0
    (0: all tokens). A negative temperature would invert the odds; an infinite one is
    no distribution."""
    if not (isinstance(temperature, numbers.Real) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature={temperature!r}: a number >= 0 (0 is greedy)")
    if not (isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k >= 0):
        raise ValueError(f"top_k={top_k!r}: an integer >= 0 (0: every token)")


def sample(logits_BxV, seeds_B, positions_B, temperature=0.0, top_k=0):
    """One token per row: argmax if temperature == 0, else a draw from softmax(logits /
    temperature) over the top_k.

    Row b draws with key fold_in(fold_in(PRNGKey(0), seeds_B[b]), positions_B[b]):
    a sequence's draws depend on its own seed and position only, not on its
    slot or on what else is in the batch. temperature and top_k are Python
    numbers (static under jit: a Batch keeps one setting, so one compile).
    """
    check_sampling(temperature, top_k)
    if temperature == 0:
        return argmax(logits_BxV)
    logits_BxV = logits_BxV.astype(jnp.float32) / temperature
    if top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV >= kth_Bx1, logits_BxV, -jnp.inf)
    root, fold = jax.random.PRNGKey(0), jax.random.fold_in
    keys_B = jax.vmap(lambda s, p: fold(fold(root, s), p))(seeds_B, positions_B)
    return jax.vmap(jax.random.categorical)(keys_B, logits_BxV).astype(jnp.int32)


def argmax(logits_BxV):
    """jnp.argmax along the last axis (the first largest value; the first NaN if a row has one),
    as two plain reductions: the largest value, then the first index that holds it. XLA on CPU
    runs argmax's own reduction, of (value, index) pairs, one element at a time; these two it
    runs on vectors (a greedy token for 64 rows of SmolLM2's 49,154 logits, 2 cores of an AMD
    EPYC Zen 4: 7.2 -> 2.8 ms)."""
    top_Bx1 = logits_BxV.max(axis=-1, keepdims=True)              # NaN if the row has one
    hit_BxV = jnp.where(jnp.isnan(top_Bx1), jnp.isnan(logits_BxV), logits_BxV == top_Bx1)
    V = logits_BxV.shape[-1]
    return jnp.where(hit_BxV, jnp.arange(V, dtype=jnp.int32), V).min(axis=-1)


def mask_logits(logits_BxV, allowed_BxV):
    """Disallowed tokens get logit -inf, so neither argmax nor a draw can pick them.

    A row that allows nothing is left as it is (all allowed): softmax over all -inf is NaN.
    """
    allowed_BxV = allowed_BxV | ~allowed_BxV.any(axis=-1, keepdims=True)
    return jnp.where(allowed_BxV, logits_BxV, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("cfg", "packed"), donate_argnames=("cache",))
def prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW, packed=None):
    """extend over B rows of T tokens -> (logits_BxV of each row's last new token, the updated
    cache). The Batch samples a sequence's next token from these logits (sample_step) when the
    row held the last of its pending tokens, rather than pushing that token through a decode
    step of its own: one model call fewer for every prompt and every tool result. packed: the
    products' positions (extend_groups), None for all B x T."""
    TRACES["prefill", tokens_BxT.shape, page_table_BxW.shape, packed] += 1
    group = (tokens_BxT, start_B, n_new_B, page_table_BxW)
    (logits_BxV,), cache = extend_groups(params, cfg, cache, [group], ["gather"], packed)
    return logits_BxV, cache


@functools.partial(jax.jit, static_argnames=("temperature", "top_k"))
def sample_step(logits_BxV, seeds_B, positions_B, temperature=0.0, top_k=0, allowed_BxV=None):
    """The token each row samples from its logits -> int32 [B]: what decode_step does after
    extend, for the logits of a prefill step. positions_B: the sampled token's position, which
    picks its draw (sample)."""
    TRACES["sample", logits_BxV.shape, allowed_BxV is None] += 1
    masked_BxV = logits_BxV if allowed_BxV is None else mask_logits(logits_BxV, allowed_BxV)
    return sample(masked_BxV, seeds_B, positions_B, temperature, top_k)


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_k", "attention", "packed"),
                   donate_argnames=("cache",))
def decode_step(params, cfg, cache, slots, temperature=0.0, top_k=0, allowed_BxV=None,
                attention="gather", packed=None):
    """Push each active slot's pending token and sample the next -> (slots one token later,
    logits_BxV, cache).

    In the returned Slots an active slot's pending token is the one just sampled,
    at position lengths_B + 1; the other slots are as they were. allowed_BxV
    (bool, optional) limits what each row may sample: a sequence's token mask
    (Batch.add's `mask`); None compiles the step without it. The returned logits
    are the model's, unmasked. attention: "gather" or "pallas" (extend). packed: the products'
    positions (extend_groups), None for every slot's.
    """
    TRACES["decode", slots.page_table_BxW.shape, allowed_BxV is None, packed] += 1
    later, logits_BxV, _, cache = _decode(params, cfg, cache, slots, temperature, top_k,
                                          allowed_BxV, attention, [], packed)
    return later, logits_BxV, cache


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "top_k", "attention", "packed"),
                   donate_argnames=("cache",))
def decode_prefill_step(params, cfg, cache, slots, tokens_RxT, start_R, n_new_R, page_table_RxW,
                        temperature=0.0, top_k=0, allowed_BxV=None, attention="gather",
                        packed=None):
    """A decode step and a prefill of R rows beside it, in one pass over the weights ->
    (slots one token later, logits_BxV, logits_RxV of each prefill row's last new token, cache).

    The same as prefill_step(tokens_RxT, ...) then decode_step(slots, ...), the prefill's rows
    on pages of their own (extend_groups). Why: an agent's tool results come back a few at a
    time while the other episodes decode, each a prefill of a dozen tokens, and a prefill call
    of a few rows costs about what a decode step does, most of it reading the weights (SmolLM2
    on 2 cores of an AMD EPYC Zen 4: a decode step of 32 rows and a prefill of 4 x 12 tokens,
    138 ms as two calls, 118 ms as one). packed: the products' positions (extend_groups)."""
    TRACES["decode+prefill", slots.page_table_BxW.shape, tokens_RxT.shape,
           allowed_BxV is None, packed] += 1
    later, logits_BxV, (logits_RxV,), cache = _decode(
        params, cfg, cache, slots, temperature, top_k, allowed_BxV, attention,
        [(tokens_RxT, start_R, n_new_R, page_table_RxW)], packed)
    return later, logits_BxV, logits_RxV, cache


def _decode(params, cfg, cache, slots, temperature, top_k, allowed_BxV, attention, beside,
            packed=None):
    """decode_step's work, with `beside` (prefill groups) pushed in the same call -> (later,
    logits_BxV, [each beside group's logits], cache)."""
    n_new_B = slots.active_B.astype(jnp.int32)
    step = (slots.tokens_B[:, None], slots.lengths_B, n_new_B, slots.page_table_BxW)
    (logits_BxV, *beside_logits), cache = extend_groups(
        params, cfg, cache, [step, *beside], [attention] + ["gather"] * len(beside), packed)
    masked_BxV = logits_BxV if allowed_BxV is None else mask_logits(logits_BxV, allowed_BxV)
    next_B = sample(masked_BxV, slots.seeds_B, slots.lengths_B + 1, temperature, top_k)
    later = dataclasses.replace(slots, tokens_B=jnp.where(slots.active_B, next_B, slots.tokens_B),
                                lengths_B=slots.lengths_B + n_new_B)
    return later, logits_BxV, beside_logits, cache


@functools.partial(jax.jit, static_argnames=("cfg", "n", "temperature", "top_k", "attention"),
                   donate_argnames=("cache",))
def decode_steps(params, cfg, cache, slots, left_B, ends_V, n, temperature=0.0, top_k=0,
                 attention="gather"):
    """n decode steps in one call, no trip to the host between them -> (slots, tokens_NxB, cache).

    A slot's pause bit goes off once it samples an end token (ends_V: bool [V], the stop and
    pause tokens) or has sampled left_B[b] tokens, as the host would do after a step: the same
    tokens as n calls of decode_step. tokens_NxB[i, b] is what slot b sampled at step i, -1 once
    it had stopped. The loop ends after n steps or as soon as every slot has stopped, so n is a
    bound, not a cost. The page table must hold every position the n steps can write.

    The weights pass through an optimization barrier with the step count at every step. Without
    it XLA sees that converting an int8 weight to the activations' dtype gives the same result
    at every step, and does it once before the loop: the loop then reads float32 copies, four
    times the bytes (SmolLM2 int8 on 2 cores of an AMD EPYC Zen 4: 21-25 ms a token, against
    8-9 ms for decode_step called once a token, and 7-8 ms with the barrier).
    """
    TRACES["decode_steps", n, slots.page_table_BxW.shape] += 1

    def one(carry):
        i, slots, left_B, cache, tokens_NxB = carry
        weights, _ = jax.lax.optimization_barrier((params, i))     # not hoisted out of the loop
        went_B = slots.active_B
        later, _, cache = decode_step(weights, cfg, cache, slots, temperature, top_k, None,
                                      attention)
        left_B = left_B - went_B
        ended_B = ends_V[later.tokens_B] | (left_B <= 0)
        later = dataclasses.replace(later, active_B=went_B & ~ended_B)
        tokens_NxB = tokens_NxB.at[i].set(jnp.where(went_B, later.tokens_B, -1))
        return i + 1, later, left_B, cache, tokens_NxB

    def going(carry):
        i, slots = carry[:2]
        return (i < n) & slots.active_B.any()

    # -1 everywhere, made from the slots: over a mesh it must vary by device, as the loop makes it
    tokens_NxB = jnp.broadcast_to(slots.tokens_B * 0 - 1, (n, slots.tokens_B.shape[0]))
    _, slots, _, cache, tokens_NxB = jax.lax.while_loop(going, one,
                                                        (0, slots, left_B, cache, tokens_NxB))
    return slots, tokens_NxB, cache
