"""The training state pytree, its abstract shapes and its shardings.

The state is created abstractly first (`jax.eval_shape`), its shardings derived from the
parameters' logical axes, and only then materialised by a jitted init whose outputs are already
sharded: no device ever holds an unsharded copy of the model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from meshlm.config import RunConfig
from meshlm.model.params import abstract_params, init_params, map_specs, param_specs
from meshlm.optim import make_optimizer
from meshlm.parallel.rules import Layout


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: batches consumed (the data position); updates = step - skipped
    params: dict  # fp32 master weights
    opt_state: Any  # optax state, sharded like params
    skipped: jax.Array  # int32 scalar: steps whose non-finite update was skipped (on_nonfinite=skip)
    streak: jax.Array  # int32 scalar: consecutive skipped steps up to `step`
    halted: jax.Array  # bool scalar: a non-finite step stopped the run; the state is its last good one


def param_shardings(specs: dict, layout: Layout) -> dict:
    return map_specs(lambda s: layout.sharding(s.axes), specs)


def state_shardings(specs: dict, layout: Layout, tx: optax.GradientTransformation) -> TrainState:
    params = param_shardings(specs, layout)
    opt_abstract = jax.eval_shape(tx.init, abstract_params(specs))
    opt = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        opt_abstract,
        params,
        transform_non_params=lambda _: layout.replicated(),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    scalar = layout.replicated()
    return TrainState(step=scalar, params=params, opt_state=opt, skipped=scalar, streak=scalar, halted=scalar)


def init_state(specs: dict, layout: Layout, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """Materialise a fresh state directly into its shards."""

    def _init(key: jax.Array) -> TrainState:
        params = init_params(specs, key)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, tx.init(params), zero, zero, jnp.zeros((), bool))

    shardings = state_shardings(specs, layout, tx)
    return jax.jit(_init, out_shardings=shardings)(jax.random.key(seed))


def abstract_state(specs: dict, layout: Layout, tx: optax.GradientTransformation) -> TrainState:
    """Shapes, dtypes and shardings of the state, without allocating it (AOT compile, restore)."""
    shapes = jax.eval_shape(lambda: init_state(specs, layout, tx, 0))
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        shapes,
        state_shardings(specs, layout, tx),
    )


def setup(cfg: RunConfig, layout: Layout) -> tuple[dict, optax.GradientTransformation, TrainState]:
    """(parameter specs, optimizer, state shardings): what every caller builds a step from."""
    specs = param_specs(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.train.steps, specs)
    return specs, tx, state_shardings(specs, layout, tx)
