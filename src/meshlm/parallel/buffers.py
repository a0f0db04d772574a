"""The pipeline executor's slot buffers (`parallel.pipeline`, sized by `parallel.slots`): made, and
read and written one slot at a time in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def slots(shape: tuple[int, ...], like: jax.ShapeDtypeStruct, fill: float, host: bool = False) -> jax.Array:
    """A slot buffer for values like `like`. Every slot an action uses is written before it is read
    (the table interpreter test), so with `fill` = 0 it is `lax.empty` (uninitialised on GPUs and
    TPUs); else floats hold `fill` (tests fill NaN), PRNG keys key(0). `host`: in host memory
    (the `offload` policy's residuals)."""
    if host:
        return jax.device_put(slots(shape, like, fill), jax.memory.Space.Host)
    if jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key):
        keys = jnp.broadcast_to(jax.random.key(0), shape + like.shape)
        if keys.dtype != like.dtype:
            raise TypeError(f"the pipeline stash holds keys of the default PRNG ({keys.dtype}), not {like.dtype}")
        return keys
    if fill == 0.0:
        return jax.lax.empty(shape + like.shape, like.dtype)
    if jnp.issubdtype(like.dtype, jnp.floating):
        return jnp.full(shape + like.shape, fill, like.dtype)
    return jnp.zeros(shape + like.shape, like.dtype)


def put(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    value = value if value.dtype == buf.dtype else value.astype(buf.dtype)
    return jax.lax.dynamic_update_index_in_dim(buf, value, slot, 0)


def take(buf: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)


CONSTANT = -1  # `residual_source`: a residual known while tracing


def residual_source(residual, weights: list) -> int | None:
    """Where B finds a residual of a chunk's vjp instead of a stash slot: the index of the chunk
    weight it is, CONSTANT for a value known while tracing (RoPE's tables: the same for every
    microbatch, so stashing them would hold a copy per microbatch-chunk in flight), else None (stashed)."""
    if not isinstance(residual, jax.core.Tracer):
        return CONSTANT
    return next((j for j, w in enumerate(weights) if w is residual), None)


def constants(leaves: list, where: tuple) -> list:
    """The CONSTANT residuals among a vjp's `leaves`, as they are (None for the others)."""
    return [r if j == CONSTANT else None for r, j in zip(leaves, where, strict=True)]


def same_constants(consts: list, leaves: list) -> bool:
    return all(c is None or np.array_equal(c, r) for c, r in zip(consts, leaves, strict=True))
