"""Context parallelism: the attention core when the sequence is split over the `context` mesh axis.

Outside attention every layer is position-wise, so a sequence sharded over `context` needs no
communication there; only attention needs the other ranks' keys and values. Three strategies.
Two are `shard_map` regions (manual over `context` only) around the blockwise kernel
(`model.blockwise`), both with a custom VJP that keeps only this rank's Q, K, V, the output and an
fp32 log-sum-exp per row:

- `all_gather`: gather K and V (and their positions and document ids) over `context`, attend,
  and in the backward pass gather again and reduce-scatter dK, dV. Simple; holds the whole
  sequence's K/V for the duration of one layer's attention. (With `model.attention=fused` on a TPU
  it runs splash instead, on a GPU the Pallas kernel, per chunk of queries at its causal offset:
  `gathered_kernel_attention`, `kernels.offset_kernel`.)
- `ring` (Li et al. 2021; Liu et al.'s Ring Attention): c steps; at each, attend to the K/V block
  in hand while the next block travels one rank on (`ppermute` issued before the step's compute,
  which does not depend on it, so the two can overlap), merging partial results by their
  log-sum-exp. Backward: the blocks go round again (c-1 hops) with their dK/dV accumulators,
  which a c-th hop brings home. Holds two K/V blocks at a time (backward: also two fp32 dK/dV).

The third exchanges heads for tokens instead and leaves the kernel alone:

- `all_to_all` (DeepSpeed-Ulysses, Jacobs et al. 2023): one `all_to_all` over `context` turns
  Q, K and V (together, one collective) from [s/c tokens, the tensor rank's heads] into [all s
  tokens, 1/c of those heads]; the model's own kernel (explicit, blockwise or fused) runs on whole
  sequences, and a second `all_to_all` brings its output back to [s/c tokens, the heads]. Their
  transposes are the backward pass (two more). Each sends (c-1)/c of the rank's buffer, so the
  traffic per device falls as c grows, where the ring's stays that of the whole K/V. Needs the
  heads and the KV heads divisible by context x tensor (refused otherwise, not replicated).

Positions: each stored token carries its position in the original sequence (`Layout.seq_index`);
the causal mask, causal block skipping and the dropout blocks all follow them, so any storage
order works - in particular the load-balanced one (`rules.context_order`), under which every rank
skips the same number of blocks. Dropout masks are drawn per (query block, key block) of original
positions, so they equal the single-device kernel's when `model.attention_block` is at most one
chunk (the CP block is then the same block). Under `all_to_all` the exchanged sequence is put back
into original order on each rank (a local permutation), so the kernel and its dropout bits are
exactly the single-device ones, at any block.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax
from meshlm.model.blockwise import NEG, backward_blocks, blockwise_attention, forward_blocks, row_delta
from meshlm.parallel.collectives import manual_region
from meshlm.parallel.rules import Layout, part_names

AXIS = "context"
Kernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]


def kernel_block(block: int, chunk: int) -> int:
    """The kernel's block under CP: `model.attention_block`, at most one context chunk (s/2c when
    load-balanced), so that no block straddles two chunks (config validation requires that it
    divides the chunk)."""
    return min(block, chunk)


def _gather(x, axis=1):
    return jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)


# ----------------------------------------------------------------------------- all-gather


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _gathered(q, k, v, seg, pos, key, block, rate):
    return _gathered_fwd(q, k, v, seg, pos, key, block, rate)[0]


def _gathered_fwd(q, k, v, seg, pos, key, block, rate):
    seg_k = None if seg is None else _gather(seg)
    out, lse = forward_blocks(q, _gather(k), _gather(v), seg, seg_k, pos, _gather(pos, 0), key, block, rate)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, pos, key, out, lse)


def _gathered_bwd(block, rate, res, d_out):
    q, k, v, seg, pos, key, out, lse = res
    seg_k = None if seg is None else _gather(seg)
    delta = row_delta(out, d_out)
    dq, dk, dv = backward_blocks(
        q, _gather(k), _gather(v), seg, seg_k, pos, _gather(pos, 0), key, lse, delta, d_out, block, rate
    )
    scatter = lambda g: jax.lax.psum_scatter(g, AXIS, scatter_dimension=1, tiled=True)
    return dq.astype(q.dtype), scatter(dk).astype(k.dtype), scatter(dv).astype(v.dtype), None, None, None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def gathered_kernel_attention(
    layout: Layout, kernel_at: Callable, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, segment_ids_bt
) -> jax.Array:
    """`all_gather` running a kernel that takes a static causal offset (`kernel_at(q, k, v, seg_q,
    seg_k, offset)`: TPU splash, which skips the key blocks its mask hides, or Pallas GPU as a few
    merged calls): each rank gathers K, V
    (and document ids) over `context`, puts them in original order, and runs the kernel once per
    chunk of its queries against all the keys, at the chunk's offset - static in one `lax.switch`
    branch per rank. Every branch sees the same shapes, so differentiating the switch keeps one set
    of the kernel's residuals, not one per branch. Manual over the batch, `context` and `tensor`
    (per device, as `kernels.sharded`). Checkpointed: the backward pass re-gathers K/V and re-runs
    the kernel's forward, so a rank stores only its own Q, K and V (as the blockwise all_gather
    does), at one more forward of the attention core."""
    order, c = layout.context_order, layout.context_size
    per, t = len(order) // c, q_btnh.shape[1]
    n = t // len(order)
    to_original = np.argsort(layout.seq_index(t)) if layout.reordered else None

    def rank(chunks, q, k, v, seg_q, seg_k):
        outs = []
        for u, chunk in enumerate(chunks):
            rows = slice(u * n, (u + 1) * n)
            segs = (None, None) if seg_q is None else (seg_q[:, rows], seg_k)
            outs.append(kernel_at(q[:, rows], k, v, *segs, chunk * n))
        return jnp.concatenate(outs, axis=1)

    def local(q, k, v, *seg):
        whole = lambda x: _gather(x) if to_original is None else jnp.take(_gather(x), to_original, axis=1)
        segs = (seg[0], whole(seg[0])) if seg else (None, None)
        branches = [partial(rank, order[r * per : (r + 1) * per]) for r in range(c)]
        return jax.lax.switch(jax.lax.axis_index(AXIS), branches, q, whole(k), whole(v), *segs)

    tokens, _, manual = _specs(layout)
    args, specs = [q_btnh, k_btkh, v_btkh], [tokens] * 3
    if segment_ids_bt is not None:
        args.append(segment_ids_bt)
        specs.append(P(tokens[0], AXIS))
    return manual_region(layout, jax.checkpoint(local), tuple(specs), tokens, manual)(*args)


# ----------------------------------------------------------------------------- ring


def _merge(out, lse, out_s, lse_s):
    """Combine two partial softmax results over disjoint key sets by their log-sum-exps."""
    new = jnp.logaddexp(lse, lse_s)
    ref = jnp.where(new == NEG, 0.0, new)  # rows that have seen nothing yet stay (0, -inf)
    w, w_s = jnp.exp(lse - ref)[..., None], jnp.exp(lse_s - ref)[..., None]
    return out * w + out_s * w_s, new


def _hop(tree, size: int):
    """Send every array of `tree` to the next rank of the ring (rank r receives from r-1; a None
    leaf, e.g. absent document ids, stays None)."""
    perm = [(r, (r + 1) % size) for r in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), tree)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _ring(q, k, v, seg, pos, key, block, rate, size):
    return _ring_fwd(q, k, v, seg, pos, key, block, rate, size)[0]


def _ring_fwd(q, k, v, seg, pos, key, block, rate, size):
    b, t, n, h = q.shape

    def attend(acc, kv):
        k_s, v_s, seg_s, pos_s = kv
        out_s, lse_s = forward_blocks(q, k_s, v_s, seg, seg_s, pos, pos_s, key, block, rate)
        return _merge(*acc, out_s, lse_s)

    def step(carry, _):
        acc, kv = carry
        nxt = _hop(kv, size)  # in flight while this block is attended to
        return (attend(acc, kv), nxt), None

    acc = (jnp.zeros((b, t, n, h), jnp.float32), jnp.full((b, t, n), NEG, jnp.float32))
    (acc, kv), _ = jax.lax.scan(step, (acc, (k, v, seg, pos)), length=size - 1)
    out, lse = attend(acc, kv)  # the last block needs no onward hop
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, pos, key, out, lse)


def _ring_bwd(block, rate, size, res, d_out):
    q, k, v, seg, pos, key, out, lse = res
    delta = row_delta(out, d_out)

    def attend(dq, kv, dkv):
        k_s, v_s, seg_s, pos_s = kv
        dq_s, dk_s, dv_s = backward_blocks(q, k_s, v_s, seg, seg_s, pos, pos_s, key, lse, delta, d_out, block, rate)
        return dq + dq_s, (dkv[0] + dk_s, dkv[1] + dv_s)

    def step(carry, _):
        dq, kv, dkv = carry
        nxt = _hop(kv, size)  # in flight while this block's gradients are computed
        dq, dkv = attend(dq, kv, dkv)
        return (dq, nxt, _hop(dkv, size)), None

    zeros_kv = jnp.zeros(k.shape, jnp.float32)
    init = (jnp.zeros(q.shape, jnp.float32), (k, v, seg, pos), (zeros_kv, zeros_kv))
    (dq, kv, dkv), _ = jax.lax.scan(step, init, length=size - 1)
    dq, dkv = attend(dq, kv, dkv)
    dk, dv = _hop(dkv, size)  # the c-th hop brings every block's gradient home; K/V need not travel
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- all-to-all (Ulysses)


def _specs(layout: Layout) -> tuple[P, P, set[str]]:
    """The all-to-all regions' specs: [b, t, heads, h] split by tokens over `context` (heads over
    `tensor`), or whole along the sequence with heads over (tensor, context) - tensor-major, so a
    tensor rank's heads never leave it; the batch over its data axes either way. The regions are
    manual over every axis they name (left automatic, the batch axes would be gathered first)."""
    rows = layout.spec((ax.BATCH,))  # without the axes a surrounding pipeline stage made manual
    batch = rows[0] if len(rows) else None
    manual = {AXIS, "tensor", *part_names(batch)}
    return P(batch, AXIS, "tensor"), P(batch, None, ("tensor", AXIS)), manual


def _to_heads(layout: Layout, q, k, v):
    """[b, t/c, n, h] -> [b, t, n/c, h] for Q, K and V in one all_to_all (each rank's share of Q's,
    K's and V's heads side by side in one buffer), the sequence put back into original order."""
    c, order = layout.context_size, np.argsort(layout.seq_index(q.shape[1])) if layout.reordered else None
    sizes = [x.shape[2] // layout.tensor_size // c for x in (q, k, v)]

    def local(q, k, v):
        b, t = q.shape[:2]
        parts = [x.reshape(b, t, c, n, x.shape[-1]).astype(q.dtype) for x, n in zip((q, k, v), sizes, strict=True)]
        mixed = jax.lax.all_to_all(jnp.concatenate(parts, 3), AXIS, 2, 1, tiled=True)  # [b, c t, 1, sum(sizes), h]
        mixed = mixed[:, :, 0] if order is None else jnp.take(mixed[:, :, 0], order, axis=1)  # -> original order
        ends = np.cumsum(sizes)
        return tuple(mixed[:, :, e - n : e].astype(x.dtype) for x, n, e in zip((q, k, v), sizes, ends, strict=True))

    tokens, heads, manual = _specs(layout)
    return manual_region(layout, local, (tokens,) * 3, (heads,) * 3, manual)(q, k, v)


def _to_tokens(layout: Layout, out):
    """The inverse for the kernel's output: [b, t, n/c, h] in original order -> [b, t/c, n, h]."""
    c, stored = layout.context_size, layout.seq_index(out.shape[1]) if layout.reordered else None

    def local(o):
        o = o if stored is None else jnp.take(o, stored, axis=1)  # original order -> storage order
        b, t, n, h = o.shape
        return jax.lax.all_to_all(o.reshape(b, c, t // c, n, h), AXIS, 1, 3, tiled=True).reshape(b, t // c, c * n, h)

    tokens, heads, manual = _specs(layout)
    return manual_region(layout, local, (heads,), tokens, manual)(out)


def ulysses_attention(
    layout: Layout, kernel: Kernel, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, segment_ids_bt
) -> jax.Array:
    """`kernel(q, k, v, segment_ids)` on whole sequences of 1/c of the heads (`all_to_all` strategy):
    the kernel runs in the global view (GSPMD keeps its heads split over (tensor, context) and its
    batch over the data axes), in original order, so it draws the single-device dropout bits."""
    spec = _specs(layout)[1]
    batch, heads = spec[0], NamedSharding(layout.mesh, spec)
    q, k, v = (jax.lax.with_sharding_constraint(x, heads) for x in _to_heads(layout, q_btnh, k_btkh, v_btkh))
    if segment_ids_bt is not None:  # int32 per token: gathered whole (every rank attends over all of it)
        whole = jax.lax.with_sharding_constraint(segment_ids_bt, NamedSharding(layout.mesh, P(batch)))
        reorder = np.argsort(layout.seq_index(whole.shape[1]))
        segment_ids_bt = jnp.take(whole, reorder, axis=1) if layout.reordered else whole
    out = jax.lax.with_sharding_constraint(kernel(q, k, v, segment_ids_bt), heads)
    return _to_tokens(layout, out)


# ----------------------------------------------------------------------------- entry point


def context_attention(
    layout: Layout,
    q_btnh: jax.Array,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    segment_ids_bt: jax.Array | None,
    *,
    block: int,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
    kernel: Kernel | None = None,
    kernel_at: Callable | None = None,
) -> jax.Array:
    """Causal attention [b, t, n, h] with t sharded over `context` in the layout's storage order,
    by `layout.context_strategy` ("all_gather", "ring" or "all_to_all"; the last runs `kernel`,
    default the blockwise kernel at `block` with this dropout, on whole sequences; `all_gather`
    runs `kernel_at`, a kernel with a causal offset, where given, else the blockwise kernel)."""
    if layout.context_strategy == "all_to_all":
        if kernel is None:
            kernel = partial(blockwise_attention, block=block, dropout_rate=dropout_rate, key=key)
        return ulysses_attention(layout, kernel, q_btnh, k_btkh, v_btkh, segment_ids_bt)
    if layout.context_strategy == "all_gather" and kernel_at is not None:
        return gathered_kernel_attention(layout, kernel_at, q_btnh, k_btkh, v_btkh, segment_ids_bt)
    size = layout.context_size
    t = q_btnh.shape[1]
    block = kernel_block(block, t // len(layout.context_order))
    if key is None or dropout_rate == 0.0:
        key, dropout_rate = None, 0.0
    positions = jnp.asarray(layout.seq_index(t))
    strategy = layout.context_strategy

    def local(q, k, v, pos, *rest):
        rest = list(rest)
        seg = rest.pop(0) if segment_ids_bt is not None else None
        key_ = rest.pop(0) if key is not None else None
        if strategy == "ring":
            return _ring(q, k, v, seg, pos, key_, block, float(dropout_rate), size)
        return _gathered(q, k, v, seg, pos, key_, block, float(dropout_rate))

    # Manual over `context` only: batch and heads stay global inside (GSPMD keeps them sharded), so
    # the dropout blocks are drawn at their global shape and match every other layout's bits.
    seq = P(None, AXIS)
    args = [q_btnh, k_btkh, v_btkh, positions]
    specs = [seq, seq, seq, P(AXIS)]
    if segment_ids_bt is not None:
        args.append(segment_ids_bt)
        specs.append(seq)
    if key is not None:
        args.append(key)
        specs.append(P())
    return manual_region(layout, local, tuple(specs), seq, {AXIS})(*args)
