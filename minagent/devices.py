"""Beyond the plain decode step (decode.py, the reference for all three): attention that reads only each
row's pages (Pallas), several steps a call, and the steps over a mesh of devices. On a mesh (one axis,
"data") device d runs its block of rows against its block of the page pool alone: no row reads another
device's pages, so jax.shard_map runs the one-device step with no communication. Page ids are global
(device d's: d * P to d * P + P - 1, the first its null page), each device reading them as id % P.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from minagent import decode


MIN_DOT = 16     # Triton's dot multiplies blocks of at least 16 along every dimension


def check_pallas(page_size, head_dim):
    """Raise ValueError unless the Pallas kernel can compile for these shapes on a GPU.

    The kernel multiplies a query block [16, head_dim] by a key block [head_dim, pages * page_size]
    with Triton's dot, which needs 16 or more along each dimension. A row of one page (the Batch's
    first table width) loads one page at a time, so page_size itself must be 16 or more. Checked on
    every backend: interpret mode would run a shape that a GPU then refuses to compile."""
    if page_size < MIN_DOT or head_dim < MIN_DOT:
        raise ValueError(f"Pallas attention needs page_size >= {MIN_DOT} and head_dim >= {MIN_DOT} (Triton's "
                         f"dot), not {page_size} and {head_dim}: use a larger page size, or attention='gather'")


def paged_attention(q_BxNxH, k_LxKxPxZxH, v_LxKxPxZxH, l, page_table_BxW, length_B):
    """Layer l's attention, one query per row over row b's first length_B[b] positions -> [B, N, H].

    The gather path's attention by JAX's Pallas paged-attention kernel, which loads only a row's pages
    (online softmax): Triton on a GPU, interpret mode elsewhere (slow: for checking). It multiplies the
    masked weights of positions past a row's length by their values, so it needs those values finite
    (0 * NaN is NaN): decode.extend never writes a non-finite key or value. A kernel takes whole
    buffers, so k[l] would be copied out each layer; instead the cache is one kv head of L * K * P pages
    (a reshape), row b's head k a kernel row on pages (l * K + k) * P + its table (docs/DESIGN.md).
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_ops
    (L, K, P, Z, H), (B, N, _), W = k_LxKxPxZxH.shape, q_BxNxH.shape, page_table_BxW.shape[1]
    check_pallas(Z, H)
    splits = next(s for s in (16, 8, 4, 2, 1) if W % s == 0)            # parts of a row read in parallel
    block = next(b for b in (8, 4, 2, 1) if (W // splits) % b == 0)    # pages loaded at a time
    q_BxNxH = (q_BxNxH.astype(jnp.float32) / jnp.sqrt(H).astype(jnp.float32)).astype(k_LxKxPxZxH.dtype)
    first_K = (l * K + jnp.arange(K)) * P                                # each kv head's first page, layer l
    table_BKxW = (first_K[None, :, None] + page_table_BxW[:, None, :]).reshape(B * K, W)
    out_BKxGxH = pallas_ops.paged_attention(
        q_BxNxH.reshape(B * K, N // K, H), k_LxKxPxZxH.reshape(1, L * K * P, Z, H),
        v_LxKxPxZxH.reshape(1, L * K * P, Z, H), table_BKxW, jnp.repeat(jnp.maximum(length_B, 1), K).astype(jnp.int32),
        block_h=16, pages_per_compute_block=block, k_splits=splits, interpret=jax.default_backend() != "gpu")
    return out_BKxGxH.reshape(B, N, H)


@functools.partial(jax.jit, static_argnames=("cfg", "n", "temperature", "top_k", "attention"),
                   donate_argnames=("cache",))
def decode_steps(params, cfg, cache, slots, left_B, ends_V, n, temperature=0.0, top_k=0, attention="gather"):
    """n decode steps in one call, no trip to the host between them -> (slots, tokens_NxB, cache).

    A slot's pause bit goes off once it samples an end token (ends_V: bool [V], the stop and
    pause tokens) or has sampled left_B[b] tokens, as the host would do after a step: the same
    tokens as n calls of decode_step. tokens_NxB[i, b] is what slot b sampled at step i, -1 once
    it had stopped. The page table must hold every position the n steps can write.
    """
    decode.TRACES["decode_steps", n, slots.page_table_BxW.shape] += 1

    def one(carry, _):
        slots, left_B, cache = carry
        went_B = slots.active_B
        later, _, cache = decode.decode_step(params, cfg, cache, slots, temperature, top_k, None, attention)
        left_B = left_B - went_B
        ended_B = ends_V[later.tokens_B] | (left_B <= 0)
        later = dataclasses.replace(later, active_B=went_B & ~ended_B)
        return (later, left_B, cache), jnp.where(went_B, later.tokens_B, -1)
    (slots, _, cache), tokens_NxB = jax.lax.scan(one, (slots, left_B, cache), length=n)
    return slots, tokens_NxB, cache


# ---------------------------------------------------------------- the steps over a mesh of devices

def automatic(mesh):
    """The same devices and axes with XLA choosing how intermediate values are split ("auto" axes).

    jax.make_mesh gives "explicit" axes, where every operation must say how its result is split: the
    model's embedding lookup cannot. minagent's steps leave it to XLA, so a mesh is taken as automatic.
    """
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names)


WHOLE = jax.sharding.PartitionSpec()                     # the weights: on every device
ROWS = jax.sharding.PartitionSpec("data")                 # [B, ...]: slot blocks, one per device
PAGES = jax.sharding.PartitionSpec(None, None, "data")    # the cache [L, K, P, Z, H]: page blocks


@functools.partial(jax.jit, static_argnames=("mesh", "cfg"), donate_argnames=("cache",))
def prefill_step_on(mesh, params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW):
    """decode.prefill_step with rows and pages split over `mesh`: device d takes rows d * B / D ..."""
    def part(params, cache, tokens_BxT, start_B, n_new_B, page_table_BxW):
        P = cache["k"].shape[2]
        return decode.prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW % P)
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS, ROWS, ROWS),
                         out_specs=PAGES)(params, cache, tokens_BxT, start_B, n_new_B, page_table_BxW)


@functools.partial(jax.jit, static_argnames=("mesh", "cfg", "temperature", "top_k", "attention"),
                   donate_argnames=("cache",))
def decode_step_on(mesh, params, cfg, cache, slots, temperature=0.0, top_k=0, allowed_BxV=None,
                   attention="gather"):
    """decode.decode_step with slots and pages split over `mesh`."""
    def part(params, cache, slots, allowed_BxV):
        P = cache["k"].shape[2]
        local = dataclasses.replace(slots, page_table_BxW=slots.page_table_BxW % P)
        later, logits_BxV, cache = decode.decode_step(params, cfg, cache, local, temperature, top_k,
                                                      allowed_BxV, attention)
        return dataclasses.replace(later, page_table_BxW=slots.page_table_BxW), logits_BxV, cache
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS),
                         out_specs=(ROWS, ROWS, PAGES))(params, cache, slots, allowed_BxV)


@functools.partial(jax.jit, static_argnames=("mesh", "cfg", "n", "temperature", "top_k", "attention"),
                   donate_argnames=("cache",))
def decode_steps_on(mesh, params, cfg, cache, slots, left_B, ends_V, n, temperature=0.0, top_k=0,
                    attention="gather"):
    """decode_steps with slots and pages split over `mesh` (tokens_NxB: split along B)."""
    def part(params, cache, slots, left_B, ends_V):
        P = cache["k"].shape[2]
        local = dataclasses.replace(slots, page_table_BxW=slots.page_table_BxW % P)
        later, tokens_NxB, cache = decode_steps(params, cfg, cache, local, left_B, ends_V, n, temperature,
                                                top_k, attention)
        return dataclasses.replace(later, page_table_BxW=slots.page_table_BxW), tokens_NxB, cache
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS, WHOLE),
                         out_specs=(ROWS, jax.sharding.PartitionSpec(None, "data"), PAGES))(
                             params, cache, slots, left_B, ends_V)


# decode's step -> the same step over a mesh (Batch._run picks from here when it has a mesh)
ON_MESH = {decode.prefill_step: prefill_step_on, decode.decode_step: decode_step_on,
           decode_steps: decode_steps_on}
