"""The decode steps over a mesh of devices: what a Batch on several devices runs.

A Batch on a mesh (one axis, "data", of D devices) splits its slots into D blocks and its page
pool into D blocks: device d runs its rows against its own pages, alone. No row reads another
device's pages, so the steps need no communication at all; jax.shard_map runs each device's
part as the one-device step of decode.py. Page ids in the tables are global (device d's are
d * P to d * P + P - 1, P pages each, the first its null page), and each device reads them as
its own: id % P. (docs/DESIGN.md, "Several devices".)
"""

import dataclasses
import functools

import jax

from minagent import decode

WHOLE = jax.sharding.PartitionSpec()                     # the weights: on every device
ROWS = jax.sharding.PartitionSpec("data")                 # [B, ...]: slot blocks, one per device
PAGES = jax.sharding.PartitionSpec(None, None, "data")    # the cache [L, K, P, Z, H]: page blocks


@functools.partial(jax.jit, static_argnames=("mesh", "cfg"), donate_argnames=("cache",))
def prefill_step_on(mesh, params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW):
    """decode.prefill_step with rows and pages split over `mesh`: device d takes rows d * B / D ..."""
    def part(params, cache, tokens_BxT, start_B, n_new_B, page_table_BxW):
        P = cache["k"].shape[2]
        return decode.prefill_step(params, cfg, cache, tokens_BxT, start_B, n_new_B, page_table_BxW % P)
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS, ROWS, ROWS), out_specs=PAGES)(params, cache, tokens_BxT, start_B, n_new_B, page_table_BxW)


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
    """decode.decode_steps with slots and pages split over `mesh` (tokens_NxB: split along B)."""
    def part(params, cache, slots, left_B, ends_V):
        P = cache["k"].shape[2]
        local = dataclasses.replace(slots, page_table_BxW=slots.page_table_BxW % P)
        later, tokens_NxB, cache = decode.decode_steps(params, cfg, cache, local, left_B, ends_V, n,
                                                       temperature, top_k, attention)
        return dataclasses.replace(later, page_table_BxW=slots.page_table_BxW), tokens_NxB, cache
    return jax.shard_map(part, mesh=mesh, in_specs=(WHOLE, PAGES, ROWS, ROWS, WHOLE),
                         out_specs=(ROWS, jax.sharding.PartitionSpec(None, "data"), PAGES))(
                             params, cache, slots, left_B, ends_V)


# decode's step -> the same step over a mesh (Batch._run picks from here when it has a mesh)
ON_MESH = {decode.prefill_step: prefill_step_on, decode.decode_step: decode_step_on,
           decode.decode_steps: decode_steps_on}
