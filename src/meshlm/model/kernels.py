"""The accelerator kernels behind `model.attention=fused`, one per device kind, chosen by
`fused_implementation` (the start-up report prints the choice and why):

- **cuDNN** flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) on NVIDIA GPUs
  of compute capability >= 8.0 under CUDA, for bf16 with head_dim a multiple of 8 up to 128 and no
  document mask;
- **Pallas GPU** flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`, Triton) on those
  GPUs where cuDNN is not taken: document masks (segment ids), fp32, other head sizes. It wants as
  many KV heads as query heads: grouped KV heads are repeated (their gradients summed back), so it
  keeps K and V g times over for backward (n/kv: more than the O(s) accounting below counts);
- **TPU splash** attention (`jax.experimental.pallas.ops.tpu.splash_attention`) on TPUs: a causal
  mask, segment ids for document masks, grouped KV heads as one multi-query kernel per KV head;
- else the blockwise kernel (`model.blockwise`).

Under all_gather context parallelism a rank's chunk of queries sits at a causal offset into the
gathered keys (`offset_kernel`): splash takes it in its mask (`splash_attention_at`), the Pallas GPU
kernel as a few calls merged by log-sum-exp (`pallas_gpu_attention_at`); cuDNN takes none.

All of them keep Q, K, V, the output and a log-sum-exp per row for backward (each has its own
custom VJP), so the O(s) accounting of the blockwise kernel applies. Sequences are padded to a
multiple of the kernel's block (padding is a document of its own, after every real token, so the
causal mask hides it from real queries; its rows are cut off). The Pallas kernels run on this CPU
in interpret mode (`interpret=True`), which is how tests/test_attention.py checks their outputs
and gradients against explicit attention; on a GPU or TPU they are unmeasured until one is lent.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax
from meshlm.parallel.collectives import manual_region
from meshlm.parallel.rules import Layout

PAD_DOCUMENT = -1  # the segment id of padding rows (real documents are numbered from 0)
LANES = 128  # the TPU vector width: splash tiles keys in multiples of it
# splash's smallest block under `model.attention=fused` (`model.attention_block` sizes the CPU's blockwise
# tiles): on a TPU v5e, forward + backward at 512 ran 4.7x (h=64, s=2048) and 5.7x (h=128, s=4096) faster
# than at 128, and a gpt-125m step 2.6x (BENCHMARKS.md, "TPU v5e"); capped by the padded sequence
SPLASH_BLOCK = 512


def fused_implementation(dtype: str, head_dim: int, document_mask: bool, device=None) -> tuple[str, str]:
    """What `model.attention=fused` runs on `device` (default: the first JAX device): ("cudnn" |
    "pallas-gpu" | "splash" | "blockwise", why)."""
    device = device or jax.devices()[0]
    if device.platform == "tpu":
        return "splash", "TPU splash attention (Pallas)"
    if device.platform != "gpu":
        return "blockwise", f"no cuDNN or Pallas GPU kernel on {device.platform}"
    version = str(getattr(getattr(device, "client", None), "platform_version", ""))
    if "cuda" not in version.lower():
        return "blockwise", f"not a CUDA GPU ({version or 'unknown platform'})"
    try:
        capability = float(getattr(device, "compute_capability", "0"))
    except ValueError:
        capability = 0.0
    if capability < 8.0:
        return "blockwise", f"flash attention kernels need compute capability >= 8.0, the device has {capability:g}"
    return gpu_kernel(dtype, head_dim, document_mask)


def gpu_kernel(dtype: str, head_dim: int, document_mask: bool) -> tuple[str, str]:
    """The flash kernel on a CUDA GPU of compute capability >= 8.0: ("cudnn" | "pallas-gpu", why).
    The planner asks this for GPUs it knows by their datasheet."""
    if dtype != "bfloat16":
        return "pallas-gpu", f"Pallas GPU flash attention (cuDNN's needs bf16, the model computes in {dtype})"
    if head_dim % 8 or head_dim > 128:
        return "pallas-gpu", f"Pallas GPU flash attention (cuDNN's needs head_dim % 8 = 0 up to 128, got {head_dim})"
    if document_mask:
        return "pallas-gpu", "Pallas GPU flash attention (document masks: segment ids)"
    return "cudnn", "cuDNN flash attention"


def offset_kernel(kind: str) -> tuple[str | None, str]:
    """The kernel that all_gather context parallelism runs per chunk of queries at its causal offset
    (`context.gathered_kernel_attention`), given what `fused_implementation` picks on the device:
    (name or None - the blockwise kernel then -, why). TPU splash takes the offset in its mask; on a
    GPU the Pallas kernel does, as calls merged (`pallas_gpu_attention_at`) - cuDNN's causal mask
    starts every query at key 0, and its backward in JAX takes no merged log-sum-exp."""
    if kind == "splash":
        return "splash", "causal offset per chunk"
    if kind not in ("cudnn", "pallas-gpu"):
        return None, ""
    why = "per chunk: its diagonal causal + the earlier keys, calls merged by log-sum-exp"
    return "pallas-gpu", why + ("; cuDNN's causal mask takes no offset" if kind == "cudnn" else "")


def fused_at_offset(dtype: str, head_dim: int, document_mask: bool, block: int):
    """The fused kernel all_gather context parallelism runs (`offset_kernel`), as `(q, k, v, seg_q,
    seg_k, offset) -> output` with the causal mask shifted by a static offset; None where the
    blockwise kernel runs instead."""
    kind, _ = fused_implementation(dtype, head_dim, document_mask)
    name, _ = offset_kernel(kind)
    if name is None:
        return None
    if name == "splash":
        return partial(splash_attention_at, block=max(block, SPLASH_BLOCK))
    return partial(pallas_gpu_attention_at, block=block)


def fused_attention(
    q_btnh: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    segment_ids_bt: jax.Array | None = None,
    block: int = 128,
    layout: Layout | None = None,
    heads: tuple[str, ...] = ("tensor",),
) -> jax.Array:
    """Causal attention [b, t, n, h] by the kernel `fused_implementation` picks for this device; a
    Pallas kernel on a mesh runs per device (`sharded`: batch over the data axes, heads over `heads`)."""
    from meshlm.model.blockwise import blockwise_attention

    dtype = jnp.dtype(q_btnh.dtype).name
    kind, _ = fused_implementation(dtype, q_btnh.shape[-1], segment_ids_bt is not None)
    if kind == "cudnn":
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, is_causal=True, implementation="cudnn")
    if kind in ("pallas-gpu", "splash"):
        fn = partial(pallas_gpu_attention, block=block)
        if kind == "splash":
            fn = partial(splash_attention, block=max(block, SPLASH_BLOCK))
        return sharded(layout, heads, fn)(q_btnh, k_bskh, v_bskh, segment_ids_bt)
    return blockwise_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, block=block)


def sharded(layout: Layout | None, heads: tuple[str, ...], fn):
    """`fn(q, k, v, segment_ids)` run on each device's rows and heads (a `shard_map` manual over the
    batch axes and `heads`; the sequence whole): the Pallas kernels have no partitioning rule of
    their own, so under GSPMD alone their operands would be gathered onto every device."""
    if layout is None or layout.mesh.size == 1:
        return fn
    batch = layout.mesh_axes(ax.BATCH) or None
    heads = tuple(a for a in heads if layout.mesh.shape[a] > 1) or None
    spec = P(batch, None, heads)

    def run(q, k, v, seg):
        # manual over every axis (inside a pipeline stage: every axis the stage left automatic), as the
        # tensor-parallel regions are; check_vma off: pallas_call's outputs do not declare how they vary
        if seg is None:
            return manual_region(layout, lambda q, k, v: fn(q, k, v, None), (spec,) * 3, spec)(q, k, v)
        return manual_region(layout, fn, (spec,) * 3 + (P(batch),), spec)(q, k, v, seg)

    return run


def _padded(q, k, v, segment_ids, block: int):
    """Q, K, V [b, t', ...] and segment ids [b, t'] with t' the next multiple of `block` (padding
    rows: zeros, document PAD_DOCUMENT; without a document mask every real row is document 0)."""
    b, t = q.shape[:2]
    size = -(-t // block) * block
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    return _pad_rows(q, size), _pad_rows(k, size), _pad_rows(v, size), _pad_rows(seg, size, PAD_DOCUMENT)


def _pad_rows(x, length: int, value=0):
    """[b, t, ...] padded with `value` to [b, length, ...]."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _pallas_blocks(t: int, block: int):
    """The Pallas GPU kernel's tile (a power of two, at least 16 rows: Triton's) and its BlockSizes."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    power_of_2 = lambda x: 1 << (x - 1).bit_length()
    size = max(16, min(power_of_2(block), power_of_2(t)))
    fields = ("block_q", "block_k", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")
    return size, pallas_attention.BlockSizes(**dict.fromkeys(fields, size))


def pallas_gpu_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=None, *, block: int = 128, interpret: bool = False):
    """Causal attention [b, t, n, h] by JAX's Pallas GPU flash attention (Triton), with segment ids;
    grouped KV heads repeated to the query heads."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    t, n, h = q_btnh.shape[1:]
    g = n // k_bskh.shape[2]
    size, sizes = _pallas_blocks(t, block)
    q, k, v, seg = _padded(q_btnh, k_bskh, v_bskh, segment_ids_bt, size)
    k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
    out = pallas_attention.mha(
        q, k, v, seg, sm_scale=1.0 / math.sqrt(h), causal=True, block_sizes=sizes, interpret=interpret
    )
    return out[:, :t]


def pallas_gpu_attention_at(
    q_btnh, k_bskh, v_bskh, seg_q_bt, seg_k_bs, offset: int, *, block: int = 128, interpret: bool = False
):
    """`pallas_gpu_attention` of queries at positions offset .. offset + t - 1 of the keys' sequence
    (the all_gather chunk of `splash_attention_at`; `offset` a multiple of t). The kernel's causal
    mask starts every query at key 0 and it reads the queries' and the keys' segment ids from one
    array, so a chunk is a few of its calls (`_offset_calls`) merged by their log-sum-exps; the
    backward pass is the kernel's own on each call, given the merged output and log-sum-exp (all a
    flash backward needs: the ring's merge). Document ids must not decrease along the sequence (as
    `data.loader.document_segments` numbers them): only the document before the chunk reaches it."""
    t = q_btnh.shape[1]
    if (seg_q_bt is None) != (seg_k_bs is None):
        raise ValueError("document ids for both the queries and the keys, or for neither")
    if offset % t or offset + t > k_bskh.shape[1]:
        raise ValueError(f"queries at offset {offset} must be whole {t}-row chunks of the {k_bskh.shape[1]} keys")
    return _pallas_at(q_btnh, k_bskh, v_bskh, seg_q_bt, seg_k_bs, offset, block, interpret)


class _Call(NamedTuple):
    """One Pallas GPU call for a chunk at an offset, as indices per call row: `rows` [B'] its
    sequence, `queries` [B', Lq] chunk rows (t: a zero row), `keys` [B', Lk] key positions (s: a
    zero key), `seg` [B', Lk] segment ids (the call's queries read them at their own slots) or None,
    `visible` [B', Lq] the rows whose result counts."""

    rows: jax.Array
    queries: jax.Array
    keys: jax.Array
    seg: jax.Array | None
    visible: jax.Array
    causal: bool


def _offset_calls(b: int, t: int, tile: int, s: int, offset: int, seg_q, seg_k) -> list[_Call]:
    """The calls for a chunk of t queries at `offset` (its rows padded to whole tiles; a = offset / t
    chunks of keys before it):
    - its diagonal block, causal (with documents: their ids, the queries' own);
    - the a earlier chunks stacked on the batch axis, one non-causal call, every key visible;
    - with documents, only the document of key offset - 1 (ids run in order) can reach into the
      chunk, only its queries see earlier keys, and only the keys from its start. The earlier
      chunks after the one it starts in count for those queries; that one, p (one id array cannot
      show a query only a suffix of a chunk's keys), is joined to the diagonal as one causal call
      of two chunks in position order with their true ids - so the mask is right - whose first
      chunk's rows are discarded. Every earlier chunk up to p is computed and not counted."""
    a, i, batch = offset // t, np.arange(-(-t // tile) * tile), np.arange(b)
    real = i < t
    queries = np.where(real, i, t)
    keys_from = lambda start: jnp.where(real, start + i, s)
    row = lambda x: jnp.broadcast_to(x, (b, *np.shape(x)[-1:]))
    ids = lambda keys: jnp.pad(seg_k, ((0, 0), (0, 1)), constant_values=PAD_DOCUMENT)[batch[:, None], keys]
    diagonal = row(keys_from(offset))
    if seg_q is None or a == 0:
        seg = None if seg_q is None else ids(diagonal)
        calls = [_Call(batch, row(queries), diagonal, seg, row(real), True)]
    else:
        document = seg_k[:, offset - 1]
        p = jnp.argmax(seg_k[:, :offset] == document[:, None], axis=1) // t  # the chunk it starts in
        keys = jnp.concatenate([keys_from(p[:, None] * t), diagonal], 1)
        first = np.concatenate([np.full(i.size, t), queries]), np.concatenate([np.zeros(i.size, bool), real])
        calls = [_Call(batch, row(first[0]), keys, ids(keys), row(first[1]), True)]
    if a:
        piece, rows = np.repeat(np.arange(a), b), np.tile(batch, a)  # a-major
        keys = np.where(real, piece[:, None] * t + i, s)
        visible = np.broadcast_to(real, keys.shape)
        if seg_q is not None:
            in_document = jnp.pad(seg_q == document[:, None], ((0, 0), (0, i.size - t)))
            visible = (piece[:, None] > p[rows][:, None]) & in_document[rows]
        seg = None if i.size == t else np.broadcast_to(np.where(real, 0, PAD_DOCUMENT), keys.shape)  # padding apart
        calls.append(_Call(rows, np.broadcast_to(queries, keys.shape), keys, seg, visible, False))
    return calls


def _operands(call: _Call, q, k, v) -> tuple:
    """A call's (q, k, v, segment ids), gathered by its indices, KV heads repeated to the query heads."""
    g = q.shape[2] // k.shape[2]
    take = lambda x, index: jnp.pad(x, ((0, 0), (0, 1)) + ((0, 0),) * (x.ndim - 2))[call.rows[:, None], index]
    return take(q, call.queries), *(jnp.repeat(take(x, call.keys), g, axis=2) for x in (k, v)), call.seg


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _pallas_at(q, k, v, seg_q, seg_k, offset, block, interpret):
    return _pallas_at_fwd(q, k, v, seg_q, seg_k, offset, block, interpret)[0]


def _pallas_at_fwd(q, k, v, seg_q, seg_k, offset, block, interpret):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    b, t, n, h = q.shape
    tile, sizes = _pallas_blocks(t, block)
    call = partial(pallas_attention.mha, sm_scale=1 / math.sqrt(h), block_sizes=sizes, interpret=interpret)
    calls = _offset_calls(b, t, tile, k.shape[1], offset, seg_q, seg_k)
    found = [call(*_operands(c, q, k, v), causal=c.causal, return_residuals=True) for c in calls]
    # merged per chunk row (row t gathers the zero rows) by the log-sum-exps (base 2) of the rows that count
    at = [(c.rows[:, None], c.queries) for c in calls]
    lses = [jnp.where(c.visible[..., None], r[1].swapaxes(1, 2), -jnp.inf) for c, r in zip(calls, found, strict=True)]
    top = jnp.full((b, t + 1, n), -jnp.inf)
    for where, lse in zip(at, lses, strict=True):
        top = top.at[where].max(lse)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.zeros((b, t + 1, n))
    for where, lse in zip(at, lses, strict=True):
        total = total.at[where].add(jnp.exp2(lse - top[where]))
    lse = top + jnp.log2(total)
    out = jnp.zeros((b, t + 1, n, h))
    for c, where, part, (o, _) in zip(calls, at, lses, found, strict=True):
        weight = jnp.exp2(jnp.where(c.visible[..., None], part - lse[where], -jnp.inf))  # no -inf - -inf
        out = out.at[where].add(weight[..., None] * o.astype(jnp.float32))
    out, lse = out[:, :t].astype(q.dtype), lse[:, :t]
    return out, (q, k, v, seg_q, seg_k, out, lse)


def _pallas_at_bwd(offset, block, interpret, res, d_out):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    q, k, v, seg_q, seg_k, out, lse = res
    (b, t, n, h), (s, kv) = q.shape, k.shape[1:3]
    tile, sizes = _pallas_blocks(t, block)
    grads = partial(pallas_attention._mha_backward, 1 / math.sqrt(h))  # private: the kernel's own backward pass
    grads = partial(grads, block_sizes=sizes, backward_pass_impl="triton", num_warps=None, num_stages=2, grid=None)
    grads = partial(grads, interpret=interpret, debug=False, return_residuals=False)
    one_more = lambda x, fill: jnp.concatenate([x, jnp.full_like(x[:, :1], fill)], 1)  # row t
    out, d_out, lse = one_more(out, 0), one_more(d_out, 0), one_more(lse, jnp.inf)
    heads = lambda x: x.astype(jnp.float32).reshape(*x.shape[:2], kv, n // kv, h).sum(3)  # a KV head's g copies
    dq = jnp.zeros((b, t + 1, n, h))
    dk = dv = jnp.zeros((b, s + 1, kv, h))
    for c in _offset_calls(b, t, tile, s, offset, seg_q, seg_k):
        where, keys, counts = (c.rows[:, None], c.queries), (c.rows[:, None], c.keys), c.visible[..., None]
        # rows that do not count: no cotangent, and an infinite log-sum-exp (probabilities 0)
        lse_c = jnp.where(counts, lse[where], jnp.inf).swapaxes(1, 2)
        out_c, do_c = (jnp.where(counts[..., None], x[where], 0) for x in (out, d_out))
        res_c = (*_operands(c, q, k, v), out_c, lse_c)
        dq_c, dk_c, dv_c, _ = grads(causal=c.causal, res=res_c, do=do_c)
        dq = dq.at[where].add(dq_c.astype(jnp.float32))
        dk, dv = dk.at[keys].add(heads(dk_c)), dv.at[keys].add(heads(dv_c))
    return dq[:, :t].astype(q.dtype), dk[:, :s].astype(k.dtype), dv[:, :s].astype(v.dtype), None, None


_pallas_at.defvjp(_pallas_at_fwd, _pallas_at_bwd)


def splash_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=None, *, block: int = 128, interpret: bool = False):
    """Causal attention [b, t, n, h] by JAX's TPU splash attention: per sequence and KV head, one
    multi-query kernel over its g query heads (queries scaled by 1/sqrt(h) first, as splash expects)."""
    return splash_attention_at(
        q_btnh, k_bskh, v_bskh, segment_ids_bt, segment_ids_bt, 0, block=block, interpret=interpret
    )


def splash_attention_at(
    q_btnh, k_bskh, v_bskh, seg_q_bt, seg_k_bs, offset: int, *, block: int = 128, interpret: bool = False
):
    """`splash_attention` of queries that sit at positions offset .. offset + t - 1 of the keys'
    sequence (s >= offset + t keys; query i sees keys 0 .. offset + i): splash's causal mask shifted
    by the static `offset`, the blocks it hides skipped (all_gather context parallelism: a rank's
    chunk of queries against the whole sequence's keys). Queries and keys are padded to whole
    128-lane blocks; padded keys are a document of their own after every real one, padded query
    rows (cut off) take the first key's document."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, t, n, h = q_btnh.shape
    s, kv = k_bskh.shape[1:3]
    g = n // kv
    size = -(-block // LANES) * LANES  # splash's key blocks are whole multiples of the TPU's 128 lanes
    size_q, size_k = (min(size, -(-n // LANES) * LANES) for n in (t, s))  # no block past the padded rows
    tq, tk = -(-t // size_q) * size_q, -(-s // size_k) * size_k
    seg_k = jnp.zeros((b, s), jnp.int32) if seg_k_bs is None else seg_k_bs.astype(jnp.int32)
    seg_k = _pad_rows(seg_k, tk, PAD_DOCUMENT)
    seg_q = jnp.zeros((b, t), jnp.int32) if seg_q_bt is None else seg_q_bt.astype(jnp.int32)
    seg_q = jnp.concatenate([seg_q, jnp.broadcast_to(seg_k[:, :1], (b, tq - t))], 1)
    mask = masks.MultiHeadMask([masks.CausalMask((tq, tk), offset=offset) for _ in range(g)])
    sizes = splash.BlockSizes(
        block_q=size_q,
        block_kv=size_k,
        block_q_dkv=size_q,
        block_kv_dkv=size_k,
        block_q_dq=size_q,
        block_kv_dq=size_k,
    )
    kernel = splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    q = (_pad_rows(q_btnh, tq) / math.sqrt(h)).astype(q_btnh.dtype).reshape(b, tq, kv, g, h).transpose(0, 2, 3, 1, 4)
    k, v = (_pad_rows(x, tk).transpose(0, 2, 1, 3) for x in (k_bskh, v_bskh))  # [b, kv, s, h]

    def one(q_gsh, k_sh, v_sh, seg_q_s, seg_k_s):
        return kernel(q_gsh, k_sh, v_sh, segment_ids=splash.SegmentIds(q=seg_q_s, kv=seg_k_s))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))  # over KV heads
    out = jax.vmap(per_head)(q, k, v, seg_q, seg_k)  # over sequences: [b, kv, g, t, h]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tq, n, h)[:, :t]
