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

`chunked_output_loss` runs the output layer and this loss over token chunks instead (`remat.loss_chunks`):
each chunk's logits, their gradient and the chunk's input and weight gradients are made in the
forward pass and the logits dropped, so no [b, t, v] tensor exists and backward only scales what
the forward kept: the input's gradient (like the input) and the output layer's (like the weight).
The same GEMMs run as without chunks (no recomputation), in a loop of `chunks` steps.
"""

from __future__ import annotations

from collections.abc import Callable

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


def _split(a: jax.Array, n: int) -> jax.Array:
    """[b, t, ...] -> [n, b, t/n, ...]: chunk j holds positions j, j + n, j + 2n... (strided, so a
    sequence sharded in contiguous blocks, over context or SP, is split alike in every chunk)."""
    b, t = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, t // n, n, *a.shape[2:]), 2, 0)


def _merge(a: jax.Array) -> jax.Array:
    """`_split`'s inverse."""
    n, b, tc = a.shape[:3]
    return jnp.moveaxis(a, 0, 2).reshape(b, tc * n, *a.shape[3:])


def _whole(run: Callable, x, w, t, m, with_w: bool):
    return run(x, w, t, m)


def chunked_output_loss(
    project: Callable,
    x_btd: jax.Array,
    w: jax.Array,
    targets_bt: jax.Array,
    mask_bt: jax.Array | None,
    chunks: int,
    split: Callable | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy_sum(project(x_btd, w), targets_bt, mask_bt)` over `chunks` token chunks:
    `project(x [b, t/n, d], w)` gives a chunk's fp32 logits. Its gradients are formed chunk by chunk in
    the forward pass (the weight's only when w is differentiated: LoRA's frozen output layer gets none).
    `split(run, x, w, t, m, with_w)` runs that loop on each device's own tokens and sums its results over
    the devices once (`collectives.over_tokens`); None runs it as is."""
    mask, w_dtype = None if mask_bt is None else mask_bt.astype(jnp.float32), w.dtype
    chunked = lambda x, t, m: (_split(x, chunks), _split(t, chunks), None if m is None else _split(m, chunks))

    @jax.custom_vjp
    def loss(x, w, t, m):  # without differentiation: the chunks' losses only
        def body(total, chunk):
            xj, tj, mj = chunk
            return total + _nll_sum_fwd(project(xj, w), tj, mj)[0], None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), chunked(x, t, m))[0]

    def forward(x, w, t, m):  # symbolic zeros: `.perturbed` says whether the weight needs a gradient
        with_w, w = w.perturbed, w.value

        def run(x, w, t, m):  # -> (summed loss, dx, summed dw or None)
            def body(carry, chunk):
                total, dw = carry
                xj, tj, mj = chunk
                logits, vjp = jax.vjp(project, xj, w) if with_w else jax.vjp(lambda a: project(a, w), xj)
                nll, res = _nll_sum_fwd(logits, tj, mj)
                grads = vjp(_nll_sum_bwd(res, jnp.ones((), jnp.float32))[0])
                return (total + nll, dw + grads[1].astype(jnp.float32) if with_w else dw), grads[0]

            dw0 = jnp.zeros(w.shape, jnp.float32) if with_w else None
            (total, dw), dx = jax.lax.scan(body, (jnp.zeros((), jnp.float32), dw0), chunked(x, t, m))
            return total, _merge(dx), dw

        total, dx, dw = (split or _whole)(run, x.value, w, t.value, m and m.value, with_w)
        return total, (dx, dw)

    def backward(res, g):
        dx, dw = res
        return (g * dx).astype(dx.dtype), None if dw is None else (g * dw).astype(w_dtype), None, None

    loss.defvjp(forward, backward, symbolic_zeros=True)
    count = jnp.float32(targets_bt.size) if mask is None else jnp.sum(mask)
    return loss(x_btd, w, targets_bt, mask), count
