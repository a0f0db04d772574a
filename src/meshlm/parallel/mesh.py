"""Build the device mesh from `ParallelConfig`. Axes are always (data, fsdp, tensor); an axis of
size 1 shards nothing, so every strategy is a choice of sizes, never a different code path.

Axis types are `Auto`: shardings are declared with `NamedSharding`/`with_sharding_constraint` and
GSPMD propagates the rest (the FAX model: declared partitioning, compiler-inserted collectives).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from meshlm.config import ConfigError, ParallelConfig
from meshlm.parallel.rules import Layout, rules_for

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """A `Mesh` of shape (data, fsdp, tensor) over `devices` (default: the global devices).

    `tensor` is the innermost (fastest-varying) axis so that it maps onto the closest devices
    (same host / NVLink / ICI neighbours), as both papers require of the model-parallel group.
    """
    shape = (parallel.data, parallel.fsdp, parallel.tensor)
    if devices is None:
        devices = jax.devices()
        # One process may run a smaller mesh on the first devices (e.g. a 2-device job on an 8-GPU
        # box); across processes every device must take part.
        if jax.process_count() == 1 and int(np.prod(shape)) < len(devices):
            devices = devices[: int(np.prod(shape))]
    devices = list(devices)
    if int(np.prod(shape)) != len(devices):
        raise ConfigError(
            f"mesh data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} needs {int(np.prod(shape))} "
            f"devices but {len(devices)} are available (use --devices N on CPU, or change --mesh)"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def make_layout(parallel: ParallelConfig, devices: list | None = None) -> Layout:
    """The mesh plus the rules table for this parallel config (sequence parallelism included)."""
    return Layout(make_mesh(parallel, devices), rules_for(parallel.sequence_parallel))
