"""Activation recomputation policies by name (MaxText style): the model tags tensors with
`checkpoint_name`; a policy decides which tagged or untagged intermediates the backward pass keeps.

`None` means "no jax.checkpoint at all": every residual is stored.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# Names the model gives to the attention core's large, cheap tensors (P2 section 5, Fig. 3).
ATTN_CORE_NAMES = ("attn_scores", "attn_probs", "attn_probs_dropped")

POLICIES: dict[str, Callable | None] = {
    "none": None,
    # Store only each layer's input (the scan carry); recompute the whole layer in backward.
    "full": jax.checkpoint_policies.nothing_saveable,
    # P2's selective recomputation: keep everything except QK^T, softmax, softmax dropout
    # (their outputs are recomputed, as is attention over V which consumes them).
    "selective": jax.checkpoint_policies.save_anything_except_these_names(*ATTN_CORE_NAMES),
    # JAX-native: keep only matmul outputs without batch dimensions (weights-stationary GEMMs).
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def wrap(fn: Callable, policy: str, *, static_argnums: tuple[int, ...] = ()) -> Callable:
    """Apply the named policy to a layer function (identity for 'none')."""
    if policy not in POLICIES:
        raise KeyError(f"unknown remat policy {policy!r}; choose from {', '.join(POLICIES)}")
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[policy], static_argnums=static_argnums)
