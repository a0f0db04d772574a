"""Next-token cross-entropy in fp32.

The target logit is picked by comparing the vocabulary index with the target and summing, not by
a gather, so a logits tensor sharded over the vocabulary (tensor parallelism) is reduced shard-wise
and never gathered whole; XLA fuses the compare into the reduction (no one-hot tensor exists).

The gradient is written by hand (a custom VJP): d loss / d logits = softmax - onehot is formed once
from the fp32 logits and the per-token log-sum-exp kept from the forward pass. Left to autodiff
(a `jax.checkpoint` that recomputed the log-sum-exp in backward),
XLA:CPU recomputed the softmax and built that vocabulary-sized gradient twice, once per consumer
(BENCHMARKS-history.md, "Where the step's time goes"). Kept for backward: the fp32 logits (P2's 4sbv/t
bytes), the log-sum-exp (4 bytes per token), the targets and the token mask if there is one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _target_mask(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """[b, t, v] bool, True at each token's target (vocabulary-sharding friendly: an iota compare)."""
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits_btv.shape, logits_btv.ndim - 1)
    return vocab == targets_bt[..., None]


@jax.custom_vjp
def _nll_sum(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array | None) -> jax.Array:
    return _nll_sum_fwd(logits_btv, targets_bt, mask_bt)[0]


def _nll_sum_fwd(logits_btv, targets_bt, mask_bt):
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    picked_bt = jnp.sum(jnp.where(_target_mask(logits_btv, targets_bt), logits_btv, 0.0), axis=-1)
    nll_bt = lse_bt - picked_bt
    total = jnp.sum(nll_bt if mask_bt is None else nll_bt * mask_bt)
    return total, (logits_btv, lse_bt, targets_bt, mask_bt)


def _nll_sum_bwd(res, g):
    logits_btv, lse_bt, targets_bt, mask_bt = res
    scale_bt = jnp.broadcast_to(g, lse_bt.shape) if mask_bt is None else g * mask_bt
    probs = jnp.exp(logits_btv - lse_bt[..., None])
    d_logits = (probs - _target_mask(logits_btv, targets_bt)) * scale_bt[..., None]
    return d_logits, None, None


_nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)


def cross_entropy_sum(
    logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Returns (sum of token losses, number of counted tokens), both fp32 scalars.

    Summing (not averaging) lets gradient accumulation divide once by the whole batch's count,
    so k microbatches give exactly the gradient of one step on the whole batch.
    """
    if mask_bt is None:
        return _nll_sum(logits_btv.astype(jnp.float32), targets_bt, None), jnp.float32(targets_bt.size)
    mask_bt = mask_bt.astype(jnp.float32)
    return _nll_sum(logits_btv.astype(jnp.float32), targets_bt, mask_bt), jnp.sum(mask_bt)
