"""Activation recomputation policies, by name, in one registry.

A policy says three things:

- `elementwise`: norms and activation functions (LayerNorm/RMSNorm, GeLU/SwiGLU) are checkpointed,
  so each keeps only its input(s) and its backward pass recomputes the element-wise rest from
  them. This is the stored set of P2's Table 2 - Megatron's fused LayerNorm and bias-GeLU kernels
  keep exactly these inputs - and every policy here uses it: storing what JAX's autodiff would
  keep instead (normalised values and statistics in fp32, GeLU's intermediates) was measured
  slower *and* larger on CPU (BENCHMARKS.md, "Element-wise recomputation"), so no policy offers it.
  No GEMM is ever recomputed by it.
- `attention_core`: the attention core (QK^T, softmax, softmax dropout, attention over V) is
  recomputed in the backward pass - P2's selective recomputation, done as Megatron does it, by
  checkpointing exactly that core.
- `layer`: the `jax.checkpoint` policy that wraps a whole layer (None: no layer-level checkpoint).

Under sequence parallelism the all-gathered LayerNorm output is never kept, whatever the policy:
`parallel.collectives.column_parallel` sees to that. The cross-entropy always recomputes its
softmax from the fp32 logits and their log-sum-exp (`model.loss`): a vocabulary-sized tensor is
never stored twice.

The names are owned by `meshlm.config.RematPolicy` (a test keeps the two equal).
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
    elementwise: bool = True


POLICIES: dict[str, RematPolicy] = {
    "elementwise": RematPolicy(
        "recompute only element-wise work (norms, GeLU/SwiGLU) from their inputs: P2 Table 2's "
        "'no recomputation' stored set, Megatron's fused kernels"
    ),
    "selective": RematPolicy(
        "P2's selective recomputation: also recompute QK^T, softmax, softmax dropout and attention over V",
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


def wrap_elementwise(fn: Callable, name: str) -> Callable:
    """A norm or activation function that keeps only its array inputs (see `elementwise`)."""
    return jax.checkpoint(fn) if POLICIES[name].elementwise else fn
