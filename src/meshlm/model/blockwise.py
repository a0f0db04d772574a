"""Blockwise (memory-efficient) causal attention in pure JAX: online softmax over key/value blocks
with a custom VJP that keeps only the output and one fp32 log-sum-exp per query row.

One sequence (`blockwise_attention`): the tiles run folded (`folded_forward` / `folded_backward`,
described above them): about nb/2 rows of (query block, key block) pairs advance together for
nb+1 steps (nb when odd), one pair per row per step, so every causal pair runs once, in parallel
with the other rows' pairs, the only loop being over the steps. The tiles are laid out so that
every matmul has its batch axes (row, batch, KV head) leading (`_fold_tiles`): nothing is
transposed inside the loop. Forward: running max m, running sum l and an
unnormalised accumulator per query row, rescaled when the max grows (Milakov & Gimelshein's online
softmax; FlashAttention's schedule). Backward, folded by key block: the probabilities of each pair
are rebuilt from the saved log-sum-exp, P = exp(S - lse), and dS = P * (dP - D) with
D = rowsum(dO * O) (FlashAttention-2); dK, dV accumulate per row, dQ is scattered (added) into its
block. No s x s tensor exists at any time; the residuals are Q, K, V, O and lse.

Dropout on the probabilities (gpt family): the keep mask of block (i, j) is drawn from
fold_in(fold_in(key, i), j), so the backward pass regenerates exactly the forward's bits and
nothing mask-sized is stored. (The bits therefore differ from `causal_attention`'s, which draws
the whole s x s mask at once; `keep_mask` assembles the blockwise one for tests.)

Shapes: q [b, t, n, h], k and v [b, t, kv, h] (grouped heads: n = kv * g), segment ids [b, t].
The sequence is padded to a multiple of the block; padded keys lie after every query, so the
causal mask hides them.

`forward_blocks` / `backward_blocks` (context parallelism) take explicit positions in the original
sequence for queries and keys (a rank's own tokens in load-balanced order, or another rank's keys):
a loop over query blocks with a loop over key blocks inside, each pair with every key after every
query skipped by a `lax.cond`, since which pairs see each other is known only at run time; a query
that sees no key gets output 0 and lse -inf, and backward takes the log-sum-exp and D of the *whole*
row, so partial results over key sets can be merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.model.layers import global_keep_mask

NEG = -jnp.inf


def _pad(x: jax.Array, length: int, value=0) -> jax.Array:
    extra = length - x.shape[1]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _block_keep(key, i, j, rate: float, shape) -> jax.Array:
    return global_keep_mask(jax.random.fold_in(jax.random.fold_in(key, i), j), 1.0 - rate, shape)


def _scores(qi, kj, pos_q, pos_k, seg_q, seg_k, scale: float):
    """fp32 scores [b, kv, g, Bq, Bk] of a query block against a key block, masked to -inf where
    the key comes after the query (positions in the original sequence) or lies in another document."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    allowed = (pos_q[:, None] >= pos_k[None, :])[None]
    if seg_q is not None:
        allowed = allowed & (seg_q[:, :, None] == seg_k[:, None, :])
    return jnp.where(allowed[:, None, None], s, NEG)


def _blocked(x, block: int, value=0):
    """[b, t, ...] -> [b, t/block, block, ...], padded at the end with `value`."""
    nb = -(-x.shape[1] // block)
    return _pad(x, nb * block, value).reshape(x.shape[0], nb, block, *x.shape[2:])


def blocks_visible(pos_q_block, pos_k_block):
    """Some key of the block comes at or before some query of the block (else skip the pair)."""
    return pos_k_block.min() <= pos_q_block.max()


def _visible_blocks(n: int, visible, body, init):
    """Run `body(j, carry)` over the n blocks, skipping by a `lax.cond` those `visible(j)` rules out
    (context parallelism: positions arrive permuted or from other ranks, so which pairs see each
    other is known only at run time)."""
    skip_or_run = lambda j, c: jax.lax.cond(visible(j), body, lambda j, c: c, j, c)
    return jax.lax.fori_loop(0, n, skip_or_run, init)


def _tiles(q, k, v, seg, block: int):
    """Q [b, nq, B, kv, g, h], K and V [b, nk, B, kv, h] and document ids [b, n, B] (padding: -1)
    cut into blocks."""
    b, t, n, h = q.shape
    qb = _blocked(q.reshape(b, t, k.shape[2], n // k.shape[2], h), block)
    return qb, _blocked(k, block), _blocked(v, block), None if seg is None else _blocked(seg, block, -1)


def _block_operands(q, k, v, seg_q, seg_k, pos_q, pos_k, block: int):
    """`_tiles`, with the keys' document ids apart and positions [n, B] (whole blocks under CP)."""
    qb, kb, vb, segq = _tiles(q, k, v, seg_q, block)
    segk = None if seg_k is None else _blocked(seg_k, block, -1)
    return qb, kb, vb, segq, segk, pos_q.reshape(-1, block), pos_k.reshape(-1, block)


def forward_blocks(q, k, v, seg_q, seg_k, pos_q, pos_k, key, block: int, rate: float):
    """(out [b, t, n, h] fp32, lse [b, t, n] fp32) of queries q against keys k, v.

    `pos_q` [t] / `pos_k` [s]: each row's position in the original sequence (the causal mask and
    the dropout blocks follow them; whole blocks). A query that sees no key gets out 0 and lse -inf
    (a ring step where every key is in its future)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    scale = 1.0 / math.sqrt(h)
    qb, kb, vb, segq, segk, pq, pk = _block_operands(q, k, v, seg_q, seg_k, pos_q, pos_k, block)
    nq, nk = qb.shape[1], kb.shape[1]
    dropout = key is not None and rate > 0

    def q_block(i):
        qi = qb[:, i]
        seg_qi = None if segq is None else segq[:, i]

        def k_block(j, carry):
            m, denom, acc = carry
            s = _scores(qi, kb[:, j], pq[i], pk[j], seg_qi, None if segk is None else segk[:, j], scale)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == NEG, 0.0, m_new)  # a row with nothing allowed yet
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(jnp.where(m == NEG, NEG, m - m_safe))
            denom = denom * corr + p.sum(-1)
            if dropout:  # blocks named by their original position: the same bits on any layout
                p = jnp.where(
                    _block_keep(key, pq[i, 0] // block, pk[j, 0] // block, rate, p.shape), p / (1.0 - rate), 0.0
                )
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(vb.dtype), vb[:, j], preferred_element_type=jnp.float32)
            return m_new, denom, acc * corr[..., None] + pv

        init = (
            jnp.full((b, kv, g, block), NEG, jnp.float32),
            jnp.zeros((b, kv, g, block), jnp.float32),
            jnp.zeros((b, kv, g, block, h), jnp.float32),
        )
        visible = lambda j: blocks_visible(pq[i], pk[j])
        m, denom, acc = _visible_blocks(nk, visible, k_block, init)
        out = jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
        return out, m + jnp.log(denom)

    out, lse = jax.lax.map(q_block, jnp.arange(nq))  # [nq, b, kv, g, B, h], [nq, b, kv, g, B]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, nq * block, n, h)[:, :t]
    lse = jnp.transpose(lse, (1, 0, 4, 2, 3)).reshape(b, nq * block, n)[:, :t]
    return out, lse


def backward_blocks(q, k, v, seg_q, seg_k, pos_q, pos_k, key, lse, delta, d_out, block: int, rate: float):
    """(dq, dk, dv) in fp32 for `forward_blocks`' arguments, given each query row's log-sum-exp
    over *all* its keys and delta = rowsum(dO * O) of the final output (both [b, t, n] fp32)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    scale = 1.0 / math.sqrt(h)
    qb, kb, vb, segq, segk, pq, pk = _block_operands(q, k, v, seg_q, seg_k, pos_q, pos_k, block)
    nq, nk = qb.shape[1], kb.shape[1]
    dob = _blocked(d_out.reshape(b, t, kv, g, h), block)
    # [b, nq, B, kv, g] -> [nq, b, kv, g, B]; a row that sees nothing (lse -inf) has p = 0 anyway
    to_rows = lambda x: jnp.transpose(_blocked(x.reshape(b, t, kv, g), block), (1, 0, 3, 4, 2))
    lse_b = to_rows(jnp.where(lse == NEG, 0.0, lse))
    delta_b = to_rows(delta)
    dropout = key is not None and rate > 0

    def k_block(j, dq):
        kj, vj = kb[:, j], vb[:, j]
        seg_kj = None if segk is None else segk[:, j]

        def q_block(i, carry):
            dk, dv, dq = carry
            qi, doi = qb[:, i], dob[:, i]
            s = _scores(qi, kj, pq[i], pk[j], None if segq is None else segq[:, i], seg_kj, scale)
            p = jnp.exp(s - lse_b[i][..., None])  # masked entries: exp(-inf) = 0
            dp = jnp.einsum("bqkgh,bskh->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            if dropout:
                keep = _block_keep(key, pq[i, 0] // block, pk[j, 0] // block, rate, p.shape)
                p_used = jnp.where(keep, p / (1.0 - rate), 0.0)
                dp = jnp.where(keep, dp / (1.0 - rate), 0.0)
            else:
                p_used = p
            # Matmul operands in the input dtype (bf16 runs at bf16 speed), accumulated in fp32.
            f32, dt = jnp.float32, qi.dtype
            dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p_used.astype(dt), doi, preferred_element_type=f32)
            ds = (p * (dp - delta_b[i][..., None]) * scale).astype(dt)
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, qi, preferred_element_type=f32)
            dqi = jnp.einsum("bkgqs,bskh->bqkgh", ds, kj, preferred_element_type=f32)
            dq = jax.lax.dynamic_update_index_in_dim(dq, dq[:, i] + dqi, i, 1)
            return dk, dv, dq

        zeros = jnp.zeros((b, block, kv, h), jnp.float32)
        visible = lambda i: blocks_visible(pq[i], pk[j])
        dk, dv, dq = _visible_blocks(nq, visible, q_block, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq0 = jnp.zeros((b, nq, block, kv, g, h), jnp.float32)
    dq, (dk, dv) = jax.lax.scan(lambda dq, j: k_block(j, dq), dq0, jnp.arange(nk))
    dq = dq.reshape(b, nq * block, n, h)[:, :t]
    s = k.shape[1]
    unblock = lambda x: jnp.transpose(x, (1, 0, 2, 3, 4)).reshape(b, nk * block, kv, h)[:, :s]
    return dq, unblock(dk), unblock(dv)


# ----------------------------------------------------------------------------- folded tiles (one sequence)
#
# Causal attention over nb blocks has nb(nb+1)/2 block pairs; query block i needs key blocks 0..i.
# Fold the rows: pair query block r with query block nb-1-r, whose key blocks together number
# (r+1) + (nb-r) = nb+1 for every r (odd nb: r with nb-2-r, nb in all, and block nb-1 alone, also
# nb). So the rows advance in lockstep for nb+1 (odd: nb) steps, each step one (query block, key
# block) pair per row: every pair executed once, none wasted, and the only loop is over the steps -
# each a batched program over the rows. The backward folds key blocks the same way (key block j
# meets query blocks j..nb-1: pairs j and nb-1-j, or for odd nb j and nb-j, and block 0 alone).


@dataclass(frozen=True)
class _Folding:
    """Static plan of the fold: per row its first block `a`, its second block `b` (= `a` for a row
    that holds one block), how many steps the first takes (all of them for a one-block row), and the
    number of steps."""

    a: np.ndarray
    b: np.ndarray
    first_steps: np.ndarray
    steps: int

    @property
    def switching(self) -> np.ndarray:
        """The rows that move on to a second block (all but the one-block row of odd nb)."""
        return self.first_steps < self.steps


def _folding(nb: int, by_key: bool) -> _Folding:
    """Forward (by query block: block i takes i+1 steps) or backward (by key block: nb-j steps)."""
    size = (lambda j: nb - j) if by_key else (lambda i: i + 1)
    if nb % 2 == 0:
        a = np.arange(nb // 2)
        b = nb - 1 - a
    else:  # the lone block is the one with nb pairs (key block 0; query block nb-1)
        a = np.arange(1, (nb + 1) // 2) if by_key else np.arange((nb - 1) // 2)
        b = nb - a if by_key else nb - 2 - a
        lone = np.array([0 if by_key else nb - 1])
        a, b = np.concatenate([a, lone]), np.concatenate([b, lone])
    steps = nb + 1 if nb % 2 == 0 else nb
    first = np.where(a == b, steps, np.array([size(x) for x in a]))
    return _Folding(a, b, first, steps)


def _fold(plan: _Folding, t: jax.Array, by_key: bool):
    """Per row at step t: (the row's block, the other side's block, whether t is the step at which
    the row moves to its second block)."""
    first = t < plan.first_steps
    block = jnp.where(first, plan.a, plan.b)
    u = jnp.where(first, t, t - plan.first_steps)  # the step within the row's current block
    return block, (block + u) if by_key else u, t == plan.first_steps


def _unfold(plan: _Folding, firsts, lasts):
    """Per-block results [nb, ...] from the rows' first-block results (rows that switch) and their
    final ones (every row's second block, or its only one)."""
    blocks = np.concatenate([plan.a[plan.switching], plan.b])
    rows = jnp.concatenate([firsts[np.flatnonzero(plan.switching)], lasts])
    return rows[np.argsort(blocks)]


def _tile_scores(qi, kj, i, j, seg_i, seg_j, block: int):
    """Scores [r, b, kv, g B, B] of each row's (query block i, key block j) from fold tiles
    (`_fold_tiles`; queries already scaled by 1/sqrt(h)), causal and document masked."""
    s = jnp.einsum("rbkqh,rbksh->rbkqs", qi, kj, preferred_element_type=jnp.float32)
    g = qi.shape[3] // block
    pos_i = i[:, None] * block + jnp.tile(jnp.arange(block), g)  # [r, g B]: the query rows' positions
    pos_j = j[:, None] * block + jnp.arange(block)
    allowed = (pos_i[:, :, None] >= pos_j[:, None, :])[:, None, None]  # [r, 1, 1, g B, B]
    if seg_i is not None:
        same = jnp.tile(seg_i, (1, 1, g))[..., :, None] == seg_j[..., None, :]  # [r, b, g B, B]
        allowed = allowed & same[:, :, None]
    return jnp.where(allowed, s, NEG)


def _fold_tiles(q, k, v, seg, block: int):
    """The fold's operands, laid out so that every tile matmul has its batch axes (row, b, kv)
    leading and needs no transpose: Q [nb, b, kv, g B, h] (a KV head's g query heads' rows of one
    block, head-major), K and V [nb, b, kv, B, h], document ids [nb, b, B] (padding: -1)."""
    kb, vb = (jnp.transpose(_blocked(x, block), (1, 0, 3, 2, 4)) for x in (k, v))
    segb = None if seg is None else jnp.swapaxes(_blocked(seg, block, -1), 0, 1)
    return _fold_queries(q, k.shape[2], block), kb, vb, segb


def _fold_queries(x, kv: int, block: int):
    """Per-query-head values [b, t, n, ...] as the fold's query tiles [nb, b, kv, g B, ...]."""
    b, t, n = x.shape[:3]
    xb = _blocked(x.reshape(b, t, kv, n // kv, *x.shape[3:]), block)  # [b, nb, B, kv, g, ...]
    xb = jnp.transpose(xb, (1, 0, 3, 4, 2, *range(5, xb.ndim)))
    return xb.reshape(xb.shape[0], b, kv, -1, *x.shape[3:])


def _from_fold(x, t: int, heads: int):
    """Per-block results [nb, b, kv, g B, ...] (queries) or [nb, b, kv, B, ...] (keys) -> [b, t,
    heads, ...] in sequence order (heads = n for queries, kv for keys)."""
    nb, b, kv, rows = x.shape[:4]
    g = heads // kv
    x = x.reshape(nb, b, kv, g, rows // g, *x.shape[4:])
    x = jnp.transpose(x, (1, 0, 4, 2, 3, *range(5, x.ndim)))  # [b, nb, B, kv, g, ...]
    return x.reshape(b, nb * (rows // g), heads, *x.shape[5:])[:, :t]


def _tile_keep(key, i, j, rate: float, shape, g: int):
    """The keep masks [r, b, kv, g B, B] of each row's block pair: `_block_keep` per row at
    [b, kv, g, B, B] (the same bits as any kernel)."""
    b, kv, rows, cols = shape
    draw = lambda i, j: _block_keep(key, i, j, rate, (b, kv, g, rows // g, cols)).reshape(shape)
    return jax.vmap(draw)(i, j)


def _rows(x, blocks):
    """Blocks `blocks` [r] of a fold operand [nb, ...] -> [r, ...]."""
    return jnp.take(x, blocks, axis=0)


ROW_GROUPS = 2  # on CPU, the fold's rows split into this many independent chains per step (`_groups`)


def _groups(plan: _Folding) -> list[_Folding]:
    """The fold's rows in `ROW_GROUPS` contiguous groups, each a plan of its own whose step runs as
    separate ops: XLA:CPU runs independent ops on different cores, while one op over every row's
    element-wise work (the softmax's exp, the masks, the rescaling) runs on one. One group on
    accelerators, where a kernel launch is the cost to avoid."""
    groups = ROW_GROUPS if jax.default_backend() == "cpu" else 1
    rows = np.array_split(np.arange(len(plan.a)), min(groups, len(plan.a)))
    return [_Folding(plan.a[r], plan.b[r], plan.first_steps[r], plan.steps) for r in rows]


def _stash(part: _Folding, t: jax.Array, stored, current):
    """`stored` [rows + 1, ...] with the row that switches at step t (at most one per step) set to
    its `current` state; a step where none does writes the spare last slot."""
    at = np.full(part.steps + 1, len(part.a))
    moving = np.flatnonzero(part.first_steps < part.steps)
    assert len(set(part.first_steps[moving])) == len(moving), "one row switches per step"
    at[part.first_steps[moving]] = moving
    row = jnp.asarray(at)[t]
    taken = jax.lax.dynamic_index_in_dim(current, jnp.minimum(row, len(part.a) - 1), keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(stored, taken, row, 0)


def folded_forward(q, k, v, seg, key, block: int, rate: float):
    """(out [b, t, n, h] fp32, lse [b, t, n] fp32) of causal self-attention, by folded tiles."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    qb, kb, vb, segb = _fold_tiles(q * (1.0 / math.sqrt(h)), k, v, seg, block)  # scores come out scaled
    nb = qb.shape[0]
    plan = _folding(nb, by_key=False)
    groups = _groups(plan)
    dropout = key is not None and rate > 0

    def start(rows: int):
        stats = jnp.full((rows, b, kv, g * block), NEG, jnp.float32), jnp.zeros((rows, b, kv, g * block), jnp.float32)
        return (*stats, jnp.zeros((rows, b, kv, g * block, h), jnp.float32))

    def finish(state):
        m, denom, acc = state
        out = jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
        return out, m + jnp.log(denom)

    def rows_step(part: _Folding, carry, t):
        """One step of one group: the state of its rows' current query blocks, and the first-block
        state of the rows that have moved on (normalised once, after the loop)."""
        (m, denom, acc), first = carry
        i, j, switch = _fold(part, t, by_key=False)  # at `switch` the row's first query block is done
        first = jax.tree.map(lambda stored, now: _stash(part, t, stored, now), first, (m, denom, acc))
        m = jnp.where(_bcast(switch, m), NEG, m)  # a new block: corr = 0 below drops its sum and accumulator
        seg_i, seg_j = (None, None) if segb is None else (_rows(segb, i), _rows(segb, j))
        s = _tile_scores(_rows(qb, i), _rows(kb, j), i, j, seg_i, seg_j, block)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(m_new == NEG, 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(m == NEG, NEG, m - m_safe))
        denom = denom * corr + p.sum(-1)
        if dropout:
            p = jnp.where(_tile_keep(key, i, j, rate, p.shape[1:], g), p / (1.0 - rate), 0.0)
        pv = jnp.einsum("rbkqs,rbksh->rbkqh", p.astype(vb.dtype), _rows(vb, j), preferred_element_type=jnp.float32)
        return (m_new, denom, acc * corr[..., None] + pv), first

    def step(carry, t):
        return tuple(rows_step(part, c, t) for part, c in zip(groups, carry, strict=True)), None

    init = tuple((start(len(part.a)), start(len(part.a) + 1)) for part in groups)
    carry, _ = jax.lax.scan(step, init, jnp.arange(plan.steps))
    carry = tuple((state, jax.tree.map(lambda x: x[:-1], first)) for state, first in carry)  # the spare slot
    joined = lambda which: jax.tree.map(lambda *xs: jnp.concatenate(xs), *(c[which] for c in carry))
    (first_out, first_lse), (last_out, last_lse) = finish(joined(1)), finish(joined(0))
    out, lse = _unfold(plan, first_out, last_out), _unfold(plan, first_lse, last_lse)  # [nb, b, kv, g B(, h)]
    return _from_fold(out, t, n), _from_fold(lse, t, n)


def _bcast(rows: jax.Array, like: jax.Array) -> jax.Array:
    """A per-row flag [r] shaped to broadcast against an array whose first axis is the row."""
    return rows.reshape(rows.shape + (1,) * (like.ndim - 1))


def folded_backward(q, k, v, seg, key, lse, delta, d_out, block: int, rate: float):
    """(dq, dk, dv) in fp32 of `folded_forward`, given its lse and delta = rowsum(dO * O)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    scale = 1.0 / math.sqrt(h)
    qb, kb, vb, segb = _fold_tiles(q * scale, k, v, seg, block)  # scaled: dK comes out whole, dQ is scaled once
    dob = _fold_queries(d_out, kv, block)
    # [b, t, n] -> [nb, b, kv, g B] (the query tiles' rows); a row that sees nothing (lse -inf) has p = 0 anyway
    lse_b, delta_b = (_fold_queries(x, kv, block) for x in (jnp.where(lse == NEG, 0.0, lse), delta))
    nb = qb.shape[0]
    plan = _folding(nb, by_key=True)
    groups = _groups(plan)
    dropout = key is not None and rate > 0
    f32, dt = jnp.float32, q.dtype

    def rows_step(part: _Folding, carry, t):
        """One step of one group: its rows' dK, dV (current and finished first key blocks) and its
        own dQ accumulator (the groups' are summed after the loop)."""
        (dk, dv), (dk_first, dv_first), dq = carry
        j, i, switch = _fold(part, t, by_key=True)  # at `switch` the row's first key block is done
        dk_first, dv_first = _stash(part, t, dk_first, dk), _stash(part, t, dv_first, dv)
        dk, dv = (jnp.where(_bcast(switch, x), 0.0, x) for x in (dk, dv))
        qi, doi, kj, vj = _rows(qb, i), _rows(dob, i), _rows(kb, j), _rows(vb, j)
        seg_i, seg_j = (None, None) if segb is None else (_rows(segb, i), _rows(segb, j))
        s = _tile_scores(qi, kj, i, j, seg_i, seg_j, block)
        p = jnp.exp(s - _rows(lse_b, i)[..., None])
        dp = jnp.einsum("rbkqh,rbksh->rbkqs", doi, vj, preferred_element_type=f32)
        if dropout:
            keep = _tile_keep(key, i, j, rate, p.shape[1:], g)
            p_used, dp = jnp.where(keep, p / (1.0 - rate), 0.0), jnp.where(keep, dp / (1.0 - rate), 0.0)
        else:
            p_used = p
        dv = dv + jnp.einsum("rbkqs,rbkqh->rbksh", p_used.astype(dt), doi, preferred_element_type=f32)
        ds = (p * (dp - _rows(delta_b, i)[..., None])).astype(dt)  # dS / scale: qb is scaled
        dk = dk + jnp.einsum("rbkqs,rbkqh->rbksh", ds, qi, preferred_element_type=f32)
        dqi = jnp.einsum("rbkqs,rbksh->rbkqh", ds, kj, preferred_element_type=f32)
        dq = dq.at[i].add(dqi)  # rows in their second phase share a query block: the adds sum
        return (dk, dv), (dk_first, dv_first), dq

    def step(carry, t):
        return tuple(rows_step(part, c, t) for part, c in zip(groups, carry, strict=True)), None

    zeros = lambda part, spare=0: jnp.zeros((len(part.a) + spare, b, kv, block, h), f32)
    init = tuple(((zeros(p), zeros(p)), (zeros(p, 1), zeros(p, 1)), jnp.zeros(qb.shape, f32)) for p in groups)
    carry, _ = jax.lax.scan(step, init, jnp.arange(plan.steps))
    carry = tuple((last, tuple(x[:-1] for x in first), dq) for last, first, dq in carry)  # the spare slots
    joined = lambda pick: jnp.concatenate([pick(c) for c in carry])
    dk, dv = joined(lambda c: c[0][0]), joined(lambda c: c[0][1])
    dk_first, dv_first = joined(lambda c: c[1][0]), joined(lambda c: c[1][1])
    dq = sum(c[2] for c in carry) * scale
    s_len = k.shape[1]
    return (
        _from_fold(dq, t, n),
        _from_fold(_unfold(plan, dk_first, dk), s_len, kv),
        _from_fold(_unfold(plan, dv_first, dv), s_len, kv),
    )


def row_delta(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """D = rowsum(dO * O) in fp32, [b, t, n] (FlashAttention-2's backward term)."""
    return jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, seg, key, block, rate):
    return _attention_fwd(q, k, v, seg, key, block, rate)[0]


def _attention_fwd(q, k, v, seg, key, block, rate):
    out, lse = folded_forward(q, k, v, seg, key, block, rate)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, key, out, lse)


def _attention_bwd(block, rate, res, d_out):
    q, k, v, seg, key, out, lse = res
    delta = row_delta(out, d_out)
    dq, dk, dv = folded_backward(q, k, v, seg, key, lse, delta, d_out, block, rate)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


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
