"""Activation recomputation policies, by name, in one registry.

A policy says two things: which `jax.checkpoint` policy wraps a whole layer (None: no layer-level
checkpoint), and whether the attention core (QK^T, softmax, softmax dropout, attention over V) is
recomputed in the backward pass - P2's selective recomputation, done as Megatron does it, by
checkpointing exactly that core. (Under sequence parallelism the all-gathered LayerNorm output is
never kept, whatever the policy: `parallel.collectives.column_parallel` sees to that.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

cp = jax.checkpoint_policies


@dataclass(frozen=True)
class RematPolicy:
    description: str
    layer: Callable | None = None
    attention_core: bool = False


POLICIES: dict[str, RematPolicy] = {
    "none": RematPolicy("store every activation the backward pass needs"),
    "selective": RematPolicy(
        "P2's selective recomputation: recompute QK^T, softmax, softmax dropout and attention over V",
        attention_core=True,
    ),
    "full": RematPolicy("store each layer's input only; recompute the whole layer", layer=cp.nothing_saveable),
    "dots": RematPolicy(
        "store only matmul outputs (no batch dims); recompute element-wise work",
        layer=cp.dots_with_no_batch_dims_saveable,
    ),
    "offload": RematPolicy(
        "like dots, but the saved matmul outputs live in pinned host memory",
        layer=cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
    ),
}


def wrap_layer(fn: Callable, name: str) -> Callable:
    """Checkpoint a whole layer with the policy's layer-level rule (identity when it has none)."""
    pol = POLICIES[name].layer
    return fn if pol is None else jax.checkpoint(fn, policy=pol)


def wrap_attention_core(fn: Callable, name: str) -> Callable:
    # prevent_cse stays on: without it XLA may merge the recomputed QK^T with the forward one
    # (seen with a single layer) and keep the score matrix alive after all.
    return jax.checkpoint(fn) if POLICIES[name].attention_core else fn
