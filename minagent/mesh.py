"""Meshes of devices: one axis, "data", over which training splits its rows and a Batch its slots.

    mesh = data_mesh()                       # every device of every process, in one row
    train.train(..., mesh=mesh)              # each step's rows split over the devices
    Batch(..., runner=RunnerConfig(mesh=mesh))   # slots and pages split over the devices

On a mesh of D devices a Batch gives device d its block of slots (d * B / D, ...) and its block
of the page pool: no row reads another device's pages, so each device runs the one-device step
on its own rows with no communication (runner.py). The partition specs below say which axis of
an array is split: the weights are whole on every device (WHOLE), per-row arrays are split along
their first axis (ROWS), the cache [L, K, P, Z, H] along its pages (PAGES).
"""

import jax
import numpy as np

WHOLE = jax.sharding.PartitionSpec()                     # the weights: on every device
ROWS = jax.sharding.PartitionSpec("data")                 # [B, ...]: slot blocks, one per device
PAGES = jax.sharding.PartitionSpec(None, None, "data")    # the cache [L, K, P, Z, H]: page blocks


def data_mesh(devices=None):
    """A one-axis mesh, "data", over `devices` (default: every device of every process)."""
    return jax.sharding.Mesh(np.array(devices or jax.devices()), ("data",))


def automatic(mesh):
    """The same devices and axes with XLA choosing how intermediate values are split ("auto" axes).

    jax.make_mesh gives "explicit" axes, where every operation must say how its result is split:
    the model's embedding lookup, written for one device, cannot. minagent's steps say nothing
    and leave it to XLA, as on one device, so a mesh is taken as an automatic one.
    """
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names)
