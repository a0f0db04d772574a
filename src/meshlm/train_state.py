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
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict  # fp32 master weights
    opt_state: Any  # optax state, sharded like params


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
    return TrainState(step=layout.replicated(), params=params, opt_state=opt)


def init_state(specs: dict, layout: Layout, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """Materialise a fresh state directly into its shards."""

    def _init(key: jax.Array) -> TrainState:
        params = init_params(specs, key)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

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
