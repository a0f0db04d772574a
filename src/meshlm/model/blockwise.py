"""Blockwise (memory-efficient) causal attention in pure JAX: online softmax over key/value blocks
with a custom VJP that keeps only the output and one fp32 log-sum-exp per query row.

Forward (per query block i, over key blocks j = 0..i only: causal block skipping): running max m,
running sum l and an unnormalised accumulator, rescaled when the max grows (Milakov & Gimelshein's
online softmax; FlashAttention's schedule). Backward (per key block j, over query blocks i >= j):
the probabilities of each block are rebuilt from the saved log-sum-exp, P = exp(S - lse), and
dS = P * (dP - D) with D = rowsum(dO * O) (FlashAttention-2). No s x s tensor exists at any time;
the residuals are Q, K, V, O and lse.

Dropout on the probabilities (gpt family): the keep mask of block (i, j) is drawn from
fold_in(fold_in(key, i), j), so the backward pass regenerates exactly the forward's bits and
nothing mask-sized is stored. (The bits therefore differ from `causal_attention`'s, which draws
the whole s x s mask at once; `keep_mask` assembles the blockwise one for tests.)

Shapes: q [b, t, n, h], k and v [b, t, kv, h] (grouped heads: n = kv * g), segment ids [b, t].
The sequence is padded to a multiple of the block; padded keys lie after every real query, so the
causal mask hides them.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

NEG = -jnp.inf


def _pad(x: jax.Array, length: int, value=0) -> jax.Array:
    extra = length - x.shape[1]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _block_keep(key, i, j, rate: float, shape) -> jax.Array:
    return jax.random.bernoulli(jax.random.fold_in(jax.random.fold_in(key, i), j), 1.0 - rate, shape)


def _scores(qi, kj, i, j, seg_q, seg_k, block: int, scale: float):
    """fp32 scores [b, kv, g, Bq, Bk] of query block i against key block j, masked to -inf."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    pos_q = i * block + jnp.arange(block)
    pos_k = j * block + jnp.arange(block)
    allowed = (pos_q[:, None] >= pos_k[None, :])[None]
    if seg_q is not None:
        allowed = allowed & (seg_q[:, :, None] == seg_k[:, None, :])
    return jnp.where(allowed[:, None, None], s, NEG)


def _blocks(q, k, v, seg, block):
    b, t, n, h = q.shape
    kv = k.shape[2]
    nb = -(-t // block)
    tp = nb * block
    q = _pad(q, tp).reshape(b, nb, block, kv, n // kv, h)
    k = _pad(k, tp).reshape(b, nb, block, kv, h)
    v = _pad(v, tp).reshape(b, nb, block, kv, h)
    seg = None if seg is None else _pad(seg, tp, -1).reshape(b, nb, block)
    return q, k, v, seg, nb


def _forward(q, k, v, seg, key, block: int, rate: float):
    b, t, n, h = q.shape
    scale = 1.0 / math.sqrt(h)
    qb, kb, vb, segb, nb = _blocks(q, k, v, seg, block)
    kv, g = kb.shape[3], n // kb.shape[3]
    dropout = key is not None and rate > 0

    def q_block(i):
        qi = qb[:, i]
        seg_q = None if segb is None else segb[:, i]

        def k_block(j, carry):
            m, denom, acc = carry
            s = _scores(qi, kb[:, j], i, j, seg_q, None if segb is None else segb[:, j], block, scale)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == NEG, 0.0, m_new)  # a row with nothing allowed yet
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(jnp.where(m == NEG, NEG, m - m_safe))
            denom = denom * corr + p.sum(-1)
            if dropout:
                p = jnp.where(_block_keep(key, i, j, rate, p.shape), p / (1.0 - rate), 0.0)
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(vb.dtype), vb[:, j], preferred_element_type=jnp.float32)
            return m_new, denom, acc * corr[..., None] + pv

        init = (
            jnp.full((b, kv, g, block), NEG, jnp.float32),
            jnp.zeros((b, kv, g, block), jnp.float32),
            jnp.zeros((b, kv, g, block, h), jnp.float32),
        )
        m, denom, acc = jax.lax.fori_loop(0, i + 1, k_block, init)  # causal: key blocks after i skipped
        out = acc / denom[..., None]
        lse = m + jnp.log(denom)
        return out, lse

    out, lse = jax.lax.map(q_block, jnp.arange(nb))  # [nb, b, kv, g, B, h], [nb, b, kv, g, B]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, nb * block, n, h)[:, :t].astype(q.dtype)
    return out, lse


def _backward(q, k, v, seg, key, out, lse, d_out, block: int, rate: float):
    b, t, n, h = q.shape
    scale = 1.0 / math.sqrt(h)
    qb, kb, vb, segb, nb = _blocks(q, k, v, seg, block)
    kv, g = kb.shape[3], n // kb.shape[3]
    dob = _pad(d_out, nb * block).reshape(b, nb, block, kv, g, h)
    ob = _pad(out, nb * block).reshape(b, nb, block, kv, g, h)
    # D_i = rowsum(dO * O): [nb, b, kv, g, B]
    delta = jnp.transpose((dob.astype(jnp.float32) * ob.astype(jnp.float32)).sum(-1), (1, 0, 3, 4, 2))
    dropout = key is not None and rate > 0

    def k_block(j, dq):
        kj, vj = kb[:, j], vb[:, j]
        seg_k = None if segb is None else segb[:, j]

        def q_block(i, carry):
            dk, dv, dq = carry
            qi, doi = qb[:, i], dob[:, i]
            s = _scores(qi, kj, i, j, None if segb is None else segb[:, i], seg_k, block, scale)
            p = jnp.exp(s - lse[i][..., None])  # masked entries: exp(-inf) = 0
            dp = jnp.einsum("bqkgh,bskh->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            if dropout:
                keep = _block_keep(key, i, j, rate, p.shape)
                p_used = jnp.where(keep, p / (1.0 - rate), 0.0)
                dp = jnp.where(keep, dp / (1.0 - rate), 0.0)
            else:
                p_used = p
            # Matmul operands in the input dtype (bf16 runs at bf16 speed), accumulated in fp32.
            f32, dt = jnp.float32, qi.dtype
            dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p_used.astype(dt), doi, preferred_element_type=f32)
            ds = (p * (dp - delta[i][..., None]) * scale).astype(dt)
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, qi, preferred_element_type=f32)
            dqi = jnp.einsum("bkgqs,bskh->bqkgh", ds, kj, preferred_element_type=f32)
            dq = jax.lax.dynamic_update_index_in_dim(dq, dq[:, i] + dqi, i, 1)
            return dk, dv, dq

        zeros = jnp.zeros((b, block, kv, h), jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(j, nb, q_block, (zeros, zeros, dq))  # causal: queries from block j on
        return dq, (dk, dv)

    dq0 = jnp.zeros((b, nb, block, kv, g, h), jnp.float32)
    dq, (dk, dv) = jax.lax.scan(lambda dq, j: k_block(j, dq), dq0, jnp.arange(nb))
    dq = dq.reshape(b, nb * block, n, h)[:, :t].astype(q.dtype)
    unblock = lambda x: jnp.transpose(x, (1, 0, 2, 3, 4)).reshape(b, nb * block, kv, h)[:, :t]
    return dq, unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, seg, key, block, rate):
    return _forward(q, k, v, seg, key, block, rate)[0]


def _attention_fwd(q, k, v, seg, key, block, rate):
    out, lse = _forward(q, k, v, seg, key, block, rate)
    return out, (q, k, v, seg, key, out, lse)


def _attention_bwd(block, rate, res, d_out):
    q, k, v, seg, key, out, lse = res
    dq, dk, dv = _backward(q, k, v, seg, key, out, lse, d_out, block, rate)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
    q_btnh: jax.Array,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    segment_ids_bt: jax.Array | None = None,
    *,
    block: int = 128,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention [b, t, n, h] storing O(t) per row for the backward pass (see module)."""
    if key is None or dropout_rate == 0.0:
        key, dropout_rate = None, 0.0
    block = min(block, q_btnh.shape[1])
    return _attention(q_btnh, k_btkh, v_btkh, segment_ids_bt, key, block, float(dropout_rate))


def keep_mask(key: jax.Array, rate: float, shape_bkgts: tuple[int, ...], block: int) -> jax.Array:
    """The whole [b, kv, g, t, t] keep mask the blockwise kernel draws block by block (tests)."""
    b, kv, g, t, _ = shape_bkgts
    block = min(block, t)
    nb = -(-t // block)
    rows = [
        jnp.concatenate([_block_keep(key, i, j, rate, (b, kv, g, block, block)) for j in range(nb)], -1)
        for i in range(nb)
    ]
    return jnp.concatenate(rows, -2)[..., :t, :t]
