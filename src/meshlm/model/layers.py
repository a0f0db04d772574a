"""Pure math of a decoder layer: no parameters are created here and no mesh is known.

What the attention core and dropout keep for the backward pass is chosen here to match P2's
accounting (section 4.1): softmax keeps only its output, dropout a 1-byte mask (custom VJPs below).
Norms and GeLU/SwiGLU keep only their input(s) when the model wraps them in `jax.checkpoint`, as
every policy of `meshlm.parallel.remat` does (`RematPolicy.elementwise`): their backward pass then
recomputes element-wise work from the input, never a GEMM - what Megatron's fused kernels do.

Shape legend (einsum letters): b batch, t query positions, s key positions, d d_model,
n query heads, k kv heads, g query heads per kv head (n = k*g), h head_dim, f d_ff.
"""

from __future__ import annotations

import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike

from meshlm.accounting import query_chunks
from meshlm.axes import BATCH_AXES
from meshlm.parallel import taps


def layer_norm(x_btd: jax.Array, scale_d: jax.Array, bias_d: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with statistics in fp32; output in x's dtype."""
    x = x_btd.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale_d.astype(jnp.float32) + bias_d.astype(jnp.float32)).astype(x_btd.dtype)


def rms_norm(x_btd: jax.Array, scale_d: jax.Array, eps: float) -> jax.Array:
    x = x_btd.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
    return (y * scale_d.astype(jnp.float32)).astype(x_btd.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's tanh-approximate GeLU ("gelu_new" in Hugging Face)."""
    return jax.nn.gelu(x, approximate=True)


def lora_equations(equation: str) -> tuple[str, str]:
    """The two einsums of a projection's LoRA term: x A over the contracted dimensions, then (x A) B
    to the output's. "btd,dnh->btnh" -> ("btd,dr->btr", "btr,rnh->btnh")."""
    x, rest = equation.split(",")
    w, out = rest.split("->")
    contracted = "".join(c for c in w if c in x)
    produced = "".join(c for c in w if c not in x)
    kept = "".join(c for c in out if c not in produced)
    return f"{x},{contracted}r->{kept}r", f"{kept}r,r{produced}->{out}"


def lora_delta(equation: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """LoRA's term of the projection `equation` of x: scale x A B, through the rank (never the
    d_in x d_out product, so the frozen weight's gradient is never formed)."""
    to_rank, from_rank = lora_equations(equation)
    return (scale * jnp.einsum(from_rank, jnp.einsum(to_rank, x, a), b)).astype(x.dtype)


def with_lora(equation: str, x: jax.Array, outputs: list, weights: tuple[str, ...], p: dict, scale: float) -> list:
    """`outputs` (the projections `weights` of x by `equation`) plus their LoRA terms (`lora_delta`),
    where p has their adapters."""
    return [
        o + lora_delta(equation, x, p[f"{w}_lora_a"], p[f"{w}_lora_b"], scale) if f"{w}_lora_a" in p else o
        for o, w in zip(outputs, weights, strict=True)
    ]


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up."""
    return jax.nn.silu(gate) * up


def dense(equation: str, x: jax.Array, w: jax.Array, flat: bool = True, **kwargs) -> jax.Array:
    """`jnp.einsum(equation, x, w, **kwargs)` of an activation x [b, t, ...] and a weight, the output
    [b, t, ...] too; see `dense_shared`."""
    return dense_shared(equation, x, [w], flat, **kwargs)[0]


def dense_shared(equation: str, x: jax.Array, ws: list[jax.Array], flat: bool = True, **kwargs) -> tuple:
    """`jnp.einsum(equation, x, w)` for each weight w, the output [b, t, ...] like x. With `flat`
    the einsums run on x's b*t rows as one axis (x reshaped once, so backward stores one array for
    all the weights): then each weight gradient in backward is one 2-D contraction over the rows.
    Over separate b and t axes, XLA instead writes the activation gradient transposed inside the
    element-wise fusion that makes it, at a small fraction of memory bandwidth (BENCHMARKS-history.md,
    "Where the step's time goes"). On XLA:CPU that contraction runs as a plain GEMM against a
    transposed copy (`_dense_gradients`).

    Backward stores the rows view in place of x, so pass `flat=False` where x itself is stored for
    another consumer (it would be kept twice), or where the b*t rows are not one contiguous block
    per device (the sequence sharded over `context` under GSPMD: the reshape would move data)."""
    lhs, out = equation.split("->")
    x_axes, w_axes = lhs.split(",")
    if not flat or x_axes[:2] != "bt" or out[:2] != "bt":
        return tuple(jnp.einsum(equation, x, w, **kwargs) for w in ws)
    rows_eq = f"r{x_axes[2:]},{w_axes}->r{out[2:]}"
    x_rows = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    # a plain matmul: every weight axis is contracted with x or kept in the output, not both
    matmul = set(x_axes[2:]).isdisjoint(out[2:]) and sorted(w_axes) == sorted(x_axes[2:] + out[2:])
    # autodiff's gradients; also while zb1 records a forward, whose B pass takes no weight
    # gradient (the custom rule's residuals would keep x for one)
    if not (matmul and transposed_copy_gradients()) or taps.recording_forward():
        ys = [jnp.einsum(rows_eq, x_rows, w, **kwargs) for w in ws]
    else:  # the GEMMs, not differentiated; their gradients come from the zero-valued terms added
        # (recomputation policies see plain GEMMs; backward keeps x and the weights, as autodiff's)
        frozen = [jnp.einsum(rows_eq, jax.lax.stop_gradient(x_rows), jax.lax.stop_gradient(w), **kwargs) for w in ws]
        meta = tuple((y.shape, y.dtype, w.dtype) for y, w in zip(frozen, ws, strict=True))
        zeros = _dense_gradients(rows_eq, meta, x_rows, tuple(ws))
        ys = [y + z for y, z in zip(frozen, zeros, strict=True)]
    return tuple(y.reshape(*x.shape[:2], *y.shape[1:]) for y in ys)


def transposed_copy_gradients() -> bool:
    """Whether dense layers take their gradients from `_dense_gradients`: on XLA:CPU, whose GEMM
    runs autodiff's weight-gradient form at about half speed. GPU GEMMs read transposed operands in
    place, where a written-out copy would only add memory traffic. (Tests and a benchmark patch it.)"""
    return jax.default_backend() == "cpu"


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dense_gradients(equation: str, meta: tuple, x_rows: jax.Array, ws: tuple) -> tuple:
    """Zeros shaped like each output of the matmul `jnp.einsum(equation, x_rows, w)` (x's first
    axis the b*t rows), whose backward is those einsums' gradients: x's summed over the weights,
    and each weight's as a plain GEMM against the transpose of the smaller operand - x (once for
    all the weights) or the output gradient - written out (`optimization_barrier` keeps XLA from
    folding the transpose back into the GEMM). Autodiff's own weight gradient contracts the rows
    of x and of the output gradient in place, which XLA:CPU's GEMM ran at half speed for the output
    layer's shapes (BENCHMARKS-history.md, "Weight gradients against a transposed copy"). Kept for
    backward: x and the weights themselves, as autodiff keeps (a pipeline recognises the weights
    and does not stash them); x only when some weight is differentiated (symbolic zeros: LoRA's
    frozen base keeps none). `meta`: (output shape, output dtype, weight dtype) per weight.
    Reverse mode only: forward-mode derivatives of these zeros are not defined."""
    return tuple(jnp.zeros(shape, dtype) for shape, dtype, _ in meta)


def _dense_gradients_fwd(equation, meta, x_rows, ws):
    """Keeps x for the weights' gradients only when some weight is differentiated (LoRA's frozen
    base: the input gradient needs the weights alone, and x would be stored for nothing)."""
    x, w = x_rows.value, tuple(a.value for a in ws)
    kept = x if any(a.perturbed for a in ws) else jnp.zeros((0,), x.dtype)  # an empty marker of x's dtype
    return _dense_gradients(equation, meta, x, w), (kept, w)


def _dense_gradients_bwd(equation, meta, res, gs):
    x_rows, ws = res
    gs = [jnp.zeros(g.shape, g.dtype) if isinstance(g, SymbolicZero) else g for g in gs]
    lhs, out = equation.split("->")
    x_axes, w_axes = lhs.split(",")
    dxs = [jnp.einsum(f"{out},{w_axes}->{x_axes}", g, w) for g, w in zip(gs, ws, strict=True)]
    if x_rows.size == 0:  # frozen weights: the input gradient only
        return functools.reduce(jnp.add, dxs).astype(x_rows.dtype), tuple(None for _ in ws)
    rows_last = lambda a: jax.lax.optimization_barrier(jnp.moveaxis(a, 0, -1))  # written out
    x_t = rows_last(x_rows) if any(x_rows.size <= g.size for g in gs) else None

    def weight_grad(g, dtype):
        # transpose the smaller operand: x, or the output gradient (then the GEMM gives dW^T)
        if x_rows.size <= g.size:
            natural = "".join(a for a in x_axes[1:] + out[1:] if a in w_axes)
            dw = jnp.einsum(f"{x_axes[1:]}{x_axes[0]},{out}->{natural}", x_t, g)
        else:
            natural = "".join(a for a in out[1:] + x_axes[1:] if a in w_axes)
            dw = jnp.einsum(f"{out[1:]}{out[0]},{x_axes}->{natural}", rows_last(g), x_rows)
        # the GEMM's output is in its own axis order; the weight's order is a small transpose after
        # (asked for in the weight's order directly, XLA transposes the big operand instead)
        order = [natural.index(a) for a in w_axes]
        if order != sorted(order):
            dw = jax.lax.optimization_barrier(dw).transpose(order)
        return dw.astype(dtype)

    dws = tuple(weight_grad(g, dtype) for g, (_, _, dtype) in zip(gs, meta, strict=True))
    return functools.reduce(jnp.add, dxs).astype(x_rows.dtype), dws


_dense_gradients.defvjp(_dense_gradients_fwd, _dense_gradients_bwd, symbolic_zeros=True)


def dropout(
    x: jax.Array, rate: float, key: jax.Array | None, positions: jax.Array | None = None, axis: int = 1
) -> jax.Array:
    """Inverted dropout. The keep mask is a bool (1 byte/element), matching P2's accounting.
    Bits come from the global position of each element (partitionable threefry), so every shard
    of a sharded tensor draws different bits, the same ones on any layout, and recomputation
    regenerates them from the key rather than storing anything. `positions`: the original
    position of each index of `axis` when the sequence is stored permuted (context load
    balancing); the bits are then those of the unpermuted tensor (`positional_bernoulli`)."""
    if key is None or rate == 0.0:
        return x
    return _apply_keep_mask(x, global_keep_mask(key, 1.0 - rate, x.shape, positions, axis), rate)


def batch_shard() -> tuple[jax.Array, int] | None:
    """(this device's shard index, shard count) of the batch when a surrounding manual region
    (a pipeline stage, which is manual over the batch axes) holds only its rows; None when the
    batch is global here (GSPMD or no mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(a for a in BATCH_AXES if a in mesh.manual_axes)
    count = math.prod(mesh.shape[a] for a in names)
    if count > 1 and mesh.shape.get("tensor", 1) > 1 and "tensor" in mesh.manual_axes:
        # the bits would be global in the batch but local in the heads / features: say so
        raise NotImplementedError("dropout bits inside a region manual over the batch axes and `tensor`")
    return (jax.lax.axis_index(names), count) if count > 1 else None


def global_keep_mask(
    key: jax.Array, p: float, shape: tuple[int, ...], positions: jax.Array | None = None, axis: int = 1
) -> jax.Array:
    """`jax.random.bernoulli(key, p, shape)` of the global tensor, whatever part of it is here:
    `positions` gives the original position of each index of `axis` (a permuted sequence), and
    inside a region manual over the batch axes (`batch_shard`) axis 0 holds this shard's rows of
    the whole batch. Every layout draws the same bits for the same element."""
    at = {} if positions is None else {axis: (positions, shape[axis])}
    shard = batch_shard()
    if shard is not None:
        index, count = shard
        at[0] = (index * shape[0] + jnp.arange(shape[0]), shape[0] * count)
    return positional_bernoulli(key, p, shape, at) if at else jax.random.bernoulli(key, p, shape)


def _mul_wide(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) uint32 words of the 64-bit product of uint32 arrays, from 16-bit halves."""
    m = jnp.uint32(0xFFFF)
    a0, a1, b0, b1 = a & m, a >> 16, b & m, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1  # each < 2^32
    mid = (p00 >> 16) + (p01 & m) + (p10 & m)  # < 3 * 2^16
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), (mid << 16) | (p00 & m)


def flat_index_2x32(coords: list[jax.Array], shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The row-major flat index in `shape` of elements at (broadcastable uint32) coordinates, as
    (hi, lo) uint32 words - what JAX's partitionable threefry counts with (`iota_2x32_shape`)."""
    hi = lo = jnp.uint32(0)
    stride = 1
    for axis in reversed(range(len(shape))):
        coord = coords[axis].astype(jnp.uint32)
        p_hi, p_lo = _mul_wide(coord, jnp.uint32(stride & 0xFFFFFFFF))
        p_hi = p_hi + coord * jnp.uint32(stride >> 32)
        lo = lo + p_lo
        hi = hi + p_hi + (lo < p_lo).astype(jnp.uint32)  # the carry out of the low word
        stride *= shape[axis]
    return hi, lo


def positional_bernoulli(
    key: jax.Array, p: float, shape: tuple[int, ...], at: dict[int, tuple[jax.Array, int]]
) -> jax.Array:
    """`jax.random.bernoulli(key, p, whole)[...]` for the elements at `shape`, where `at` maps an axis
    to (the index in the whole tensor of each of its indices here, that axis's length in the whole
    tensor): the bits of the whole tensor at these coordinates, computed where each element lives
    (elementwise in its coordinates, so it partitions like any elementwise op). Reproduces JAX's
    partitionable threefry and its float conversion; `tests/test_context.py` checks it bit for bit."""
    from jax.extend.random import threefry2x32_p

    coords = [jax.lax.broadcasted_iota(jnp.uint32, shape, a) for a in range(len(shape))]
    total = list(shape)
    for axis, (positions, length) in at.items():
        along = [1] * len(shape)
        along[axis] = shape[axis]
        coords[axis] = jnp.broadcast_to(positions.astype(jnp.uint32).reshape(along), shape)
        total[axis] = length
    hi, lo = flat_index_2x32(coords, tuple(total))
    data = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(data[0], data[1], hi, lo)
    bits = bits1 ^ bits2
    one = jnp.uint32(0x3F800000)  # the float32 1.0: 23 random mantissa bits give [1, 2)
    floats = jax.lax.bitcast_convert_type((bits >> 9) | one, jnp.float32) - jnp.float32(1.0)
    return jnp.maximum(jnp.float32(0.0), floats) < jnp.float32(p)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _apply_keep_mask(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
    # A custom VJP so that backward keeps the bool mask and nothing else (a plain jnp.where also
    # keeps a broadcast zeros tensor, which lax.scan hoists out of the layer loop as a residual).
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


def _mask_fwd(x, keep, rate):
    return _apply_keep_mask(x, keep, rate), keep


def _mask_bwd(rate, keep, g):
    return jnp.where(keep, g * jnp.asarray(1.0 / (1.0 - rate), g.dtype), jnp.zeros((), g.dtype)), None


_apply_keep_mask.defvjp(_mask_fwd, _mask_bwd)


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None = None) -> jax.Array:
    """[head_dim/2] fp32 rotary frequencies theta^(-2i/h), scaled by `scaling` (`rotary.scaling`).
    ("llama3", factor, low_freq_factor, high_freq_factor, original_len): wavelengths above
    original_len/low_freq_factor are divided by `factor`, those below original_len/high_freq_factor
    kept, and those between blended linearly in original_len/wavelength. ("yarn", factor, beta_fast,
    beta_slow, original_len): YaRN's blend of the interpolated (/ factor) and kept frequencies by a
    linear ramp over the dimensions between those turning beta_fast and beta_slow times in
    original_len (floored and ceiled, as Hugging Face's default `truncate`)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    kind, factor, a, b, original = scaling
    if kind == "yarn":
        dim_of = lambda turns: head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = max(math.floor(dim_of(a)), 0), min(math.ceil(dim_of(b)), head_dim - 1)
        ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / max(high - low, 1e-3), 0.0, 1.0)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp)
    wavelength = 2 * math.pi / inv_freq
    blend = jnp.clip((original / wavelength - a) / (b - a), 0.0, 1.0)  # 0: long waves, 1: short
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def rope_tables(positions_t: ArrayLike, inv_freq: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """fp32 cos and sin of the rotary angles, [1 or b, t, 1, head_dim] for `positions_t` [t] or
    [b, t]."""
    angles = jnp.asarray(positions_t).astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    angles_bth = angles if angles.ndim == 3 else angles[None]
    return jnp.cos(angles_bth)[:, :, None, :], jnp.sin(angles_bth)[:, :, None, :]


# Longer sequences compute their tables in the program: constants of t * head_dim values each would
# grow every compiled step and its cache entry (2 x 16 MiB at t = 32768, head_dim 128).
CONSTANT_ROPE_MAX = 1 << 20


@functools.lru_cache(maxsize=16)
def constant_rope_tables(
    t: int, head_dim: int, theta: float, scaling: tuple | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`rope_tables` at positions 0..t-1 (training, evaluation), computed now by XLA (eagerly, also
    while a step is being traced) and kept on the host: the step reads them as constants, the same two arrays
    for q and k and every layer. Computed in the program instead, XLA:CPU fused cos and sin into
    every consumer of the rotated Q and K (each query chunk's slice of K, the backward's rotation)
    and evaluated them once per element there: [b, t, heads, h] transcendentals where the tables
    have [t, h] (BENCHMARKS-history.md, "RoPE's tables computed once")."""
    with jax.ensure_compile_time_eval():
        cos, sin = rope_tables(np.arange(t), rope_inv_freq(head_dim, theta, scaling))
    # Host copies: device arrays made here while a shard_map is traced (a pipeline stage) carry a mesh
    # of other axis types into it, and tracing fails (test_rope_tables_made_inside_one_mesh_serve_every_step).
    return np.asarray(cos), np.asarray(sin)


def rope(x_btnh: jax.Array, cos: ArrayLike, sin: ArrayLike) -> jax.Array:
    """Rotary embedding, "rotate half" convention (first half of head_dim pairs with the second),
    as in Hugging Face Llama, with fp32 tables from `rope_tables` / `constant_rope_tables`."""
    h = x_btnh.shape[-1]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_btnh.dtype)


def rotate(xs: tuple, positions, dim: int, theta: float, scaling: tuple | None, factor: float = 1.0) -> tuple:
    """RoPE on each of `xs` [b, t, heads, dim] at positions 0..t-1 (None) with the constant tables (up
    to `CONSTANT_ROPE_MAX` values per table), else at the traced `positions` ([t] or [b, t]), or
    0..t-1 for longer sequences, with tables computed in the program; times `factor` (YaRN's)."""
    t = xs[0].shape[1]
    if positions is None and t * dim <= CONSTANT_ROPE_MAX:
        cos, sin = constant_rope_tables(t, dim, theta, scaling)
    else:
        positions = jnp.arange(t) if positions is None else positions
        cos, sin = rope_tables(positions, rope_inv_freq(dim, theta, scaling))
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return tuple(rope(x, cos, sin) for x in xs)


def _causal_softmax(scores: jax.Array, same_doc: jax.Array | None = None) -> jax.Array:
    """Softmax over the last axis with a causal mask (and, if given, a same-document mask
    broadcastable to the scores), in fp32, returned in the scores' dtype."""
    t, s = scores.shape[-2:]
    allowed = jnp.tril(jnp.ones((t, s), dtype=bool), k=s - t)
    if same_doc is not None:
        allowed = allowed & same_doc
    return jax.nn.softmax(jnp.where(allowed, scores.astype(jnp.float32), -jnp.inf), axis=-1).astype(scores.dtype)


def same_document(segment_ids_bt: jax.Array) -> jax.Array:
    """[b, 1, 1, t, s] bool: query t and key s lie in the same document of a packed row."""
    return segment_ids_bt[:, None, None, :, None] == segment_ids_bt[:, None, None, None, :]


def _attention_equations(grouped: bool) -> tuple[str, str]:
    """(scores, attention over V) einsums on head-major operands (Q [b, k, (g,) t, h], K and V
    [b, k, s, h]): with query groups (GQA, g > 1) the scores are [b, k, g, t, s]; for MHA (g = 1)
    [b, k, t, s] - the same elements in the same order (so the same dropout bits), without a unit
    axis that makes XLA:CPU copy and transpose around its GEMMs."""
    if grouped:
        return "bkgth,bksh->bkgts", "bkgts,bksh->bkgth"
    return "bkth,bksh->bkts", "bkts,bksh->bkth"


def _grouped(n_heads: int, kv_heads: int) -> bool:
    """Whether the scores carry a query-group axis g: only under GQA (a benchmark patches it)."""
    return n_heads != kv_heads


def _operands(eq: str) -> tuple[str, str, str]:
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    return a, b, out


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _chunked_core(q, k, v, keep, same_doc, rate: float, chunks: tuple) -> jax.Array:
    """Causal softmax attention on head-major operands, one query chunk at a time: chunk [a, e)
    against keys [0, e + s - t) (queries are the last t of s positions). Each chunk's QK^T,
    softmax, softmax dropout and attention over V are P2's attention core restricted to the score
    blocks on and below the diagonal; everything above is masked to exactly zero anyway.

    One VJP for the whole core, so that backward keeps P2's tensors and no more: Q, K and V once
    (not a slice of K and V per chunk), and per chunk the softmax output, the dropout mask and its
    output (the probabilities once without dropout). The document mask needs no residual: masked
    probabilities are zero, so backward ignores them. `keep`/`same_doc` cover the whole
    [.., t, s] score matrix; each chunk reads its block, so the dropout bits are those of the
    unchunked computation."""
    return _chunked_core_fwd(q, k, v, keep, same_doc, rate, chunks)[0]


def _chunk_block(x, a, e, end):
    return None if x is None else x[..., a:e, :end]


def _chunked_core_fwd(q, k, v, keep, same_doc, rate, chunks):
    scores_eq, av_eq = _attention_equations(q.ndim == 5)
    off = k.shape[-2] - q.shape[-2]
    outs, saved = [], []
    for a, e in chunks:
        end = e + off
        scores = jnp.einsum(scores_eq, q[..., a:e, :], k[..., :end, :])
        probs = _causal_softmax(scores, _chunk_block(same_doc, a, e, end))
        kept = _chunk_block(keep, a, e, end)
        dropped = probs if kept is None else _apply_keep_mask(probs, kept, rate)
        outs.append(jnp.einsum(av_eq, dropped, v[..., :end, :]))
        saved.append((probs, kept, None if kept is None else dropped))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-2)
    return out, (q, k, v, tuple(saved))


def _chunked_core_bwd(rate, chunks, res, g):
    q, k, v, saved = res
    scores_eq, av_eq = _attention_equations(q.ndim == 5)
    p_axes, v_axes, o_axes = _operands(av_eq)
    q_axes, k_axes, _ = _operands(scores_eq)
    off = k.shape[-2] - q.shape[-2]
    dq, dk, dv, f32 = [], None, None, jnp.float32
    for (a, e), (probs, kept, dropped) in zip(chunks, saved, strict=True):
        end = e + off
        g_c, k_c, v_c = g[..., a:e, :], k[..., :end, :], v[..., :end, :]
        d_dropped = jnp.einsum(f"{o_axes},{v_axes}->{p_axes}", g_c, v_c)
        dv_c = jnp.einsum(
            f"{p_axes},{o_axes}->{v_axes}", probs if kept is None else dropped, g_c, preferred_element_type=f32
        )
        dv = _add_rows(dv, dv_c)
        d_probs = d_dropped if kept is None else _mask_bwd(rate, kept, d_dropped)[0]
        p, gp = probs.astype(jnp.float32), d_probs.astype(jnp.float32)
        d_scores = (p * (gp - jnp.sum(gp * p, axis=-1, keepdims=True))).astype(probs.dtype)
        dq.append(jnp.einsum(f"{p_axes},{k_axes}->{q_axes}", d_scores, k_c))
        dk_c = jnp.einsum(f"{p_axes},{q_axes}->{k_axes}", d_scores, q[..., a:e, :], preferred_element_type=f32)
        dk = _add_rows(dk, dk_c)
    # dK and dV are sums over the chunks: summed in fp32, rounded to the compute dtype once
    dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    return (dq[0] if len(dq) == 1 else jnp.concatenate(dq, axis=-2)), dk, dv, None, None


def _add_rows(total: jax.Array | None, part: jax.Array) -> jax.Array:
    """The running sum of the chunks' key (or value) gradients: `total` [.., r, h] over the first
    r keys (None before the first chunk) added onto the first r rows of this chunk's `part`
    [.., r' > r, h], in place (chunks end at increasing keys; the last at all of them, so the
    final sum covers every key). The sum then lives in one buffer, where padding each chunk to all
    keys and summing made XLA:CPU re-add the padded copies inside every consumer of the sum, each a
    strided transpose (BENCHMARKS-history.md, "dK and dV summed in place"). Same additions in the same
    order as that sum: the same fp32 result, bit for bit."""
    if total is None:
        return part
    r = total.shape[-2]
    return jax.lax.dynamic_update_slice(part, total + part[..., :r, :], (0,) * part.ndim)


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def masked_causal_attention(
    q_btnh: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    keep: jax.Array | None,
    same_doc: jax.Array | None,
    rate: float = 0.0,
    chunk: int = 0,
) -> jax.Array:
    """`causal_attention` with the dropout keep mask given ([b, k, t, s] for MHA, [b, k, g, t, s]
    under GQA; None: no dropout) and the document mask broadcastable to the scores."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    grouped = _grouped(n, kv)
    # 1/sqrt(h) on Q rather than on the scores: an element-wise pass over [b, t, n, h] instead of
    # two over the t x s scores (forward and backward); scaling the scores made the chunked core
    # ~1.7x slower on XLA:CPU (BENCHMARKS-history.md, "Explicit attention in query chunks")
    q_btnh = q_btnh * jnp.asarray(1 / math.sqrt(h), q_btnh.dtype)
    if grouped:
        q = q_btnh.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [b, k, g, t, h]
    else:
        q = q_btnh.transpose(0, 2, 1, 3)  # [b, k, t, h]
    k, v = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)  # [b, k, s, h]
    out = _chunked_core(q, k, v, keep, same_doc, rate, query_chunks(t, chunk))
    out = out.transpose(0, 3, 1, 2, 4) if grouped else out.transpose(0, 2, 1, 3)
    return out.reshape(b, t, n, v_bskh.shape[-1])  # MLA: the value head size may differ from h


def causal_attention(
    q_btnh: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    segment_ids_bt: jax.Array | None = None,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
    chunk: int = 0,
) -> jax.Array:
    """Explicit softmax attention with grouped KV heads (n = k*g; MHA is g = 1); with
    `segment_ids_bt`, no attention across documents of a packed row.

    The score matrix is materialised on purpose: P2's memory model and selective recomputation
    are about exactly these tensors (QK^T, softmax, softmax dropout, attention over V). With
    `chunk` > 0 the queries go `chunk` rows at a time, each chunk against the keys up to its last
    query: only the score blocks on and below the diagonal are computed and stored
    (`chunked_score_elements`; t(t + chunk)/2 of the t^2 per head). The dropout bits depend only
    on `key` and the element's position in the whole [.., t, s] matrix, so recomputation replays
    them exactly and every chunk size draws the same bits.
    """
    b, t, n, _ = q_btnh.shape
    kv = k_bskh.shape[2]
    grouped = _grouped(n, kv)
    s = k_bskh.shape[1]
    keep = None
    if key is not None and dropout_rate > 0:
        shape = (b, kv, n // kv, t, s) if grouped else (b, kv, t, s)
        keep = global_keep_mask(key, 1.0 - dropout_rate, shape)
    same_doc = None if segment_ids_bt is None else same_document(segment_ids_bt)
    if same_doc is not None and not grouped:
        same_doc = same_doc[:, :, 0]  # [b, 1, t, s]
    return masked_causal_attention(q_btnh, k_bskh, v_bskh, keep, same_doc, dropout_rate, chunk)


def cached_attention(
    q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, q_slots_t: jax.Array, start_b: jax.Array
) -> jax.Array:
    """Decoding attention over a preallocated KV cache of S slots: the query at slot q_slots[i]
    attends to slots start[b] .. q_slots[i] (left padding before start[b], unwritten slots after).
    Scores and softmax in fp32."""
    b, t, n, h = q_btnh.shape
    s, k = k_bskh.shape[1], k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32) / math.sqrt(h)
    slot = jnp.arange(s)
    q_slot = q_slots_t[None, :, None]
    # A padding query (slot < start) sees itself only: finite values that no real query reads.
    allowed = (slot <= q_slot) & ((slot >= start_b[:, None, None]) | (slot == q_slot))
    probs = jax.nn.softmax(jnp.where(allowed[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_bskh.dtype), v_bskh)
    return out.reshape(b, t, n, h)
