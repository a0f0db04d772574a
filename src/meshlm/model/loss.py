"""Next-token cross-entropy in fp32.

The target logit is picked with a one-hot contraction rather than a gather, so a logits tensor
sharded over the vocabulary (tensor parallelism) is reduced shard-wise and never gathered whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.checkpoint
def token_nll(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per token. Keeps only the fp32 logits (P2's 4sbv/t bytes) and
    the targets for backward; the softmax is recomputed there."""
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    onehot_btv = jax.nn.one_hot(targets_bt, logits_btv.shape[-1], dtype=jnp.float32)
    return lse_bt - jnp.einsum("btv,btv->bt", logits_btv, onehot_btv)


def cross_entropy_sum(
    logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Returns (sum of token losses, number of counted tokens), both fp32 scalars.

    Summing (not averaging) lets gradient accumulation divide once by the whole batch's count,
    so k microbatches give exactly the gradient of one step on the whole batch.
    """
    loss_bt = token_nll(logits_btv.astype(jnp.float32), targets_bt)
    if mask_bt is None:
        mask_bt = jnp.ones_like(loss_bt)
    mask_bt = mask_bt.astype(jnp.float32)
    return jnp.sum(loss_bt * mask_bt), jnp.sum(mask_bt)
