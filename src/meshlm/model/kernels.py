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
kernel as two calls merged by log-sum-exp (`pallas_gpu_attention_at`, not with document masks);
cuDNN takes none.

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

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax
from meshlm.parallel.collectives import manual_region
from meshlm.parallel.rules import Layout

PAD_DOCUMENT = -1  # the segment id of padding rows (real documents are numbered from 0)
LANES = 128  # the TPU vector width: splash tiles keys in multiples of it


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


def offset_kernel(kind: str, document_mask: bool) -> tuple[str | None, str]:
    """The kernel that all_gather context parallelism runs per chunk of queries at its causal offset
    (`context.gathered_kernel_attention`), given what `fused_implementation` picks on the device:
    (name or None - the blockwise kernel then -, why). TPU splash takes the offset in its mask; on a
    GPU the Pallas kernel does, as two calls merged (`pallas_gpu_attention_at`) - cuDNN's causal
    mask starts every query at key 0 and JAX returns no log-sum-exp from it to merge."""
    if kind == "splash":
        return "splash", "causal offset per chunk"
    if kind not in ("cudnn", "pallas-gpu"):
        return None, ""
    if document_mask:
        return None, "Pallas GPU reads queries' and keys' document ids from one array: no mask against earlier chunks"
    why = "per chunk: diagonal causal + earlier keys, merged by log-sum-exp"
    return "pallas-gpu", why + ("; cuDNN's causal mask takes no offset" if kind == "cudnn" else "")


def fused_at_offset(dtype: str, head_dim: int, document_mask: bool, block: int):
    """The fused kernel all_gather context parallelism runs (`offset_kernel`), as `(q, k, v, seg_q,
    seg_k, offset) -> output` with the causal mask shifted by a static offset; None where the
    blockwise kernel runs instead."""
    kind, _ = fused_implementation(dtype, head_dim, document_mask)
    name, _ = offset_kernel(kind, document_mask)
    if name is None:
        return None
    return partial(splash_attention_at if name == "splash" else pallas_gpu_attention_at, block=block)


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
        fn = partial(pallas_gpu_attention if kind == "pallas-gpu" else splash_attention, block=block)
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
    mask starts every query at key 0, so a chunk is two of its calls merged by their log-sum-exps:
    the diagonal block (keys offset .. offset + t - 1, causal) and the earlier keys 0 .. offset - 1,
    all visible (t-key pieces stacked on the batch axis: one non-causal call). The backward pass is
    the kernel's own on each call, given the merged output and log-sum-exp (what a flash backward
    needs: the ring's merge). No document masks: the kernel reads the queries' and the keys'
    segment ids from one array (the same positions), which cannot mask queries against earlier keys."""
    t = q_btnh.shape[1]
    if seg_q_bt is not None or seg_k_bs is not None:
        raise ValueError("the Pallas GPU kernel at an offset takes no document mask (one segment-id array)")
    if offset % t or offset + t > k_bskh.shape[1]:
        raise ValueError(f"queries at offset {offset} must be whole {t}-row chunks of the {k_bskh.shape[1]} keys")
    return _pallas_at(q_btnh, k_bskh, v_bskh, offset, block, interpret)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _pallas_at(q, k, v, offset, block, interpret):
    return _pallas_at_fwd(q, k, v, offset, block, interpret)[0]


def _pallas_calls(q, k, v, offset: int, block: int):
    """The two calls' operands, rows padded to whole tiles and KV heads repeated: (q, k, v, segment
    ids) of the diagonal block and of the earlier keys (None at offset 0); the kernel's sizes."""
    b, t, n = q.shape[:3]
    g, a = n // k.shape[2], offset // t
    size, sizes = _pallas_blocks(t, block)
    rows = -(-t // size) * size
    wide = lambda x: jnp.repeat(_pad_rows(x, rows), g, axis=2)
    q = _pad_rows(q, rows)
    diagonal = (q, wide(k[:, offset : offset + t]), wide(v[:, offset : offset + t]), None)  # causal: padding after
    if a == 0:
        return diagonal, None, sizes
    pieces = lambda x: x[:, :offset].reshape(b, a, t, *x.shape[2:]).swapaxes(0, 1).reshape(a * b, t, *x.shape[2:])
    # padded keys are a document of their own: invisible to real rows (whose segment id is 0)
    seg = None if rows == t else jnp.broadcast_to(jnp.where(jnp.arange(rows) < t, 0, PAD_DOCUMENT), (a * b, rows))
    earlier = (jnp.tile(q, (a, 1, 1, 1)), wide(pieces(k)), wide(pieces(v)), seg)
    return diagonal, earlier, sizes


def _pallas_at_fwd(q, k, v, offset, block, interpret):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    t, h = q.shape[1], q.shape[-1]
    diagonal, earlier, sizes = _pallas_calls(q, k, v, offset, block)
    call = partial(pallas_attention.mha, sm_scale=1 / math.sqrt(h), block_sizes=sizes, interpret=interpret)
    out, lse = call(*diagonal, causal=True, return_residuals=True)  # lse: [b, n, rows], base 2
    if earlier is not None:
        outs, lses = call(*earlier, causal=False, return_residuals=True)
        outs = jnp.concatenate([out[None], outs.reshape(-1, *out.shape)]).astype(jnp.float32)
        lses = jnp.concatenate([lse[None], lses.reshape(-1, *lse.shape)])
        lse = jax.nn.logsumexp(lses * math.log(2), axis=0) / math.log(2)  # over the calls
        weights = jnp.exp2(lses - lse).swapaxes(-1, -2)[..., None]  # [calls, b, rows, n, 1]
        out = (weights * outs).sum(0).astype(q.dtype)
    return out[:, :t], (q, k, v, out, lse)


def _pallas_at_bwd(offset, block, interpret, res, d_out):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    q, k, v, out, lse = res
    (b, t, n, h), kv = q.shape, k.shape[2]
    diagonal, earlier, sizes = _pallas_calls(q, k, v, offset, block)
    d_out = _pad_rows(d_out, out.shape[1])
    grads = partial(pallas_attention._mha_backward, 1 / math.sqrt(h))  # private: the kernel's own backward pass
    grads = partial(grads, block_sizes=sizes, backward_pass_impl="triton", num_warps=None, num_stages=2, grid=None)
    grads = partial(grads, interpret=interpret, debug=False, return_residuals=False)
    # per KV head: the sum over its g query heads' repeated copies, in fp32
    heads = lambda x: x[:, :t].astype(jnp.float32).reshape(x.shape[0], t, kv, n // kv, h).sum(3)
    dq, dk, dv, _ = grads(causal=True, res=(*diagonal[:3], None, out, lse), do=d_out)
    dq, dk, dv = dq.astype(jnp.float32), heads(dk), heads(dv)
    if earlier is not None:
        a = offset // t
        tiled = lambda x: jnp.tile(x, (a,) + (1,) * (x.ndim - 1))
        dqs, dks, dvs, _ = grads(causal=False, res=(*earlier, tiled(out), tiled(lse)), do=tiled(d_out))
        dq = dq + dqs.astype(jnp.float32).reshape(a, *dq.shape).sum(0)
        joined = lambda x: heads(x).reshape(a, b, t, kv, h).swapaxes(0, 1).reshape(b, offset, kv, h)
        dk, dv = (jnp.concatenate([joined(e), d], axis=1) for e, d in ((dks, dk), (dvs, dv)))
    later = lambda x: _pad_rows(x, k.shape[1]).astype(k.dtype)  # keys after the chunk: no gradient
    return dq[:, :t].astype(q.dtype), later(dk), later(dv)


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
    tq, tk = -(-t // size) * size, -(-s // size) * size
    seg_k = jnp.zeros((b, s), jnp.int32) if seg_k_bs is None else seg_k_bs.astype(jnp.int32)
    seg_k = _pad_rows(seg_k, tk, PAD_DOCUMENT)
    seg_q = jnp.zeros((b, t), jnp.int32) if seg_q_bt is None else seg_q_bt.astype(jnp.int32)
    seg_q = jnp.concatenate([seg_q, jnp.broadcast_to(seg_k[:, :1], (b, tq - t))], 1)
    mask = masks.MultiHeadMask([masks.CausalMask((tq, tk), offset=offset) for _ in range(g)])
    sizes = splash.BlockSizes(
        block_q=size, block_kv=size, block_q_dkv=size, block_kv_dkv=size, block_q_dq=size, block_kv_dq=size
    )
    kernel = splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    q = (_pad_rows(q_btnh, tq) / math.sqrt(h)).astype(q_btnh.dtype).reshape(b, tq, kv, g, h).transpose(0, 2, 3, 1, 4)
    k, v = (_pad_rows(x, tk).transpose(0, 2, 1, 3) for x in (k_bskh, v_bskh))  # [b, kv, s, h]

    def one(q_gsh, k_sh, v_sh, seg_q_s, seg_k_s):
        return kernel(q_gsh, k_sh, v_sh, segment_ids=splash.SegmentIds(q=seg_q_s, kv=seg_k_s))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))  # over KV heads
    out = jax.vmap(per_head)(q, k, v, seg_q, seg_k)  # over sequences: [b, kv, g, t, h]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tq, n, h)[:, :t]
