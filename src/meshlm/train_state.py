"""The training state pytree, its abstract shapes and its shardings.

The state is created abstractly first (`jax.eval_shape`), its shardings derived from the
parameters' logical axes, and only then materialised by a jitted init whose outputs are already
sharded: no device ever holds an unsharded copy of the model.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from meshlm import axes as ax
from meshlm.config import RunConfig
from meshlm.model.params import abstract_params, init_params, map_specs, param_specs, trainable_mask
from meshlm.optim import make_optimizer
from meshlm.parallel.rules import Layout, as_part, part_names, spec_of


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: batches consumed (the data position); updates = step - skipped
    params: dict  # fp32 master weights
    opt_state: Any  # optax state, sharded like params
    skipped: jax.Array  # int32 scalar: steps whose non-finite update was skipped (on_nonfinite=skip)
    streak: jax.Array  # int32 scalar: consecutive skipped steps up to `step`
    halted: jax.Array  # bool scalar: a non-finite step stopped the run; the state is its last good one


def param_shardings(specs: dict, layout: Layout) -> dict:
    return map_specs(lambda s: layout.param_sharding(s.axes, s.shape), specs)


def zero1_sharding(layout: Layout, sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """ZeRO stage 1: the sharding of a weight's optimizer moments. The data-parallel axes the weight
    is replicated on (the batch's axes and `context`, of size > 1, that its spec does not use) are
    added to one of its dimensions, after the axes already there: as many of them as some dimension
    divides (the largest product first, then the largest dimension); a weight no dimension of which
    divides by any of them stays as it is (small ones: norms, biases under a wide mesh)."""
    mesh = layout.mesh
    parts = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {a for part in parts for a in part_names(part)}
    extra = tuple(a for a in (*layout.mesh_axes(ax.BATCH), *layout.mesh_axes(ax.SEQ)) if a not in used)
    subsets = [c for r in range(len(extra), 0, -1) for c in itertools.combinations(extra, r)]
    subsets.sort(key=lambda c: -math.prod(mesh.shape[a] for a in c))  # stable: more axes first among equals
    for axes_added in subsets:
        for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
            axes = part_names(parts[i]) + axes_added
            if shape[i] % math.prod(mesh.shape[a] for a in axes) == 0:
                parts[i] = as_part(axes)
                return NamedSharding(mesh, spec_of(parts), memory_kind=sharding.memory_kind)
    return sharding


def state_shardings(
    specs: dict,
    layout: Layout,
    tx: optax.GradientTransformation,
    *,
    shard_optimizer: bool = False,
    offload: bool = False,
) -> TrainState:
    """Where every leaf of the state lives. Optimizer leaves that mirror a parameter are sharded like
    it, or with `shard_optimizer` also over the data-parallel axes it is replicated on (ZeRO-1,
    `zero1_sharding`); with `offload` they live in host memory (`pinned_host`); the optimizer's
    scalars (its step count) are replicated, and stay on the device."""
    params = param_shardings(specs, layout)
    moments = params
    if shard_optimizer:
        shapes = abstract_params(specs)
        moments = jax.tree.map(lambda sh, a: zero1_sharding(layout, sh, a.shape), params, shapes)
    if offload:
        moments = jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"), moments)
    opt_abstract = jax.eval_shape(tx.init, abstract_params(specs))
    trainable = trainable_mask(specs)
    if not all(jax.tree.leaves(trainable)):  # LoRA: the moments exist for the trainable leaves only
        moments = jax.tree.map(lambda sh, t: sh if t else optax.MaskedNode(), moments, trainable)
    opt = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        opt_abstract,
        moments,
        transform_non_params=lambda _: layout.replicated(),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    scalar = layout.replicated()
    return TrainState(step=scalar, params=params, opt_state=opt, skipped=scalar, streak=scalar, halted=scalar)


def placement(cfg: RunConfig) -> dict[str, bool]:
    """The optimizer state's placement options of a run config, as `state_shardings` takes them."""
    return {"shard_optimizer": cfg.parallel.shard_optimizer, "offload": cfg.optim.offload_state}


def init_state(specs: dict, layout: Layout, tx: optax.GradientTransformation, seed: int, **placed: bool) -> TrainState:
    """Materialise a fresh state directly into its shards (`placed`: as `state_shardings` takes it)."""

    def _init(key: jax.Array) -> TrainState:
        params = init_params(specs, key)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, tx.init(params), zero, zero, jnp.zeros((), bool))

    shardings = state_shardings(specs, layout, tx, **placed)
    return jax.jit(_init, out_shardings=shardings)(jax.random.key(seed))


def abstract_state(specs: dict, layout: Layout, tx: optax.GradientTransformation, **placed: bool) -> TrainState:
    """Shapes, dtypes and shardings of the state, without allocating it (AOT compile, restore)."""
    shapes = jax.eval_shape(lambda: init_state(specs, layout, tx, 0))
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        shapes,
        state_shardings(specs, layout, tx, **placed),
    )


def setup(cfg: RunConfig, layout: Layout) -> tuple[dict, optax.GradientTransformation, TrainState]:
    """(parameter specs, optimizer, state shardings): what every caller builds a step from."""
    specs = param_specs(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.train.steps, specs)
    return specs, tx, state_shardings(specs, layout, tx, **placement(cfg))
