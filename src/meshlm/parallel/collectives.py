"""The tensor-parallel region boundaries, written as explicit collectives over the `tensor` axis.

Megatron's conjugate operators (P2 section 4.2):

| region boundary           | TP only (f / f-bar)           | TP + SP (g / g-bar)                      |
|---------------------------|-------------------------------|------------------------------------------|
| block entry               | identity (bwd: all-reduce)    | all-gather along s (bwd: reduce-scatter) |
| block exit (row-parallel) | all-reduce (bwd: identity)    | reduce-scatter along s (bwd: all-gather) |

Only f-bar (the TP-only block exit) is left to GSPMD, which all-reduces the row-parallel partial
sums from the sharding constraint alone. The rest is written as `shard_map` collectives: block
entries (f and g, `column_parallel`) so the backward pass reduces the input gradient of all the
block's matmuls once - GSPMD all-reduces the Q, K and V partials separately - and the SP exit
(g-bar), because XLA's CPU pipeline lowers a reduce-scatter as all-reduce + dynamic-slice (only the
GPU and TPU pipelines fuse that pair back), which would hide exactly what P2 is about. JAX
differentiates `all_gather` into `psum_scatter` and back, giving the conjugates for free.

The shard_maps are manual over every mesh axis (inside a pipeline stage, which is already manual over
`stage` and the batch axes, over every remaining one). Activations enter with their full logical spec;
weights with their `tensor` spec only, so an FSDP-sharded weight is gathered by GSPMD on entry, as
it would be for any matmul. (Manual over `tensor` alone would be tidier, but XLA 0.10's CPU
all-reduce promotion aborts on a bf16 reduce-scatter in a partially manual computation.)

Shapes: b batch, t sequence, d d_model, v vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax
from meshlm.model.layers import dense, lora_delta
from meshlm.parallel import taps
from meshlm.parallel.rules import Layout, as_part, constrain, part_names


def region_weight_spec(layout: Layout, logical_axes: Sequence[str | None], keep: tuple[str, ...] = ("tensor",)) -> P:
    """A weight's partition spec restricted to the mesh axes in `keep` (default `tensor`; an MoE
    region also keeps `expert`), replicated over the others, which GSPMD gathers on entry."""
    parts = []
    for logical in logical_axes:
        parts.append(as_part([n for n in layout.mesh_axes(logical) if n in keep]))
    return P(*parts)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _without(spec: P, names: set[str]) -> P:
    """`spec` with the mesh axes in `names` removed."""
    return P(*(as_part([a for a in part_names(part) if a not in names]) for part in spec))


def manual_region(layout: Layout, fn, in_specs, out_specs, axes: set[str] | None = None):
    """A `shard_map` manual over `axes` (default: every mesh axis). Inside another manual region
    (a pipeline stage, manual over `stage` and the batch axes) it nests: over the axes named that
    the outer region left automatic (all of them by default), with the outer region's axes left
    out of the specs - they split these arrays already."""
    outer = jax.sharding.get_abstract_mesh()
    if outer.manual_axes:
        done = set(outer.manual_axes)
        rest = set(outer.axis_names if axes is None else axes) - done
        drop = lambda spec: _without(spec, done)
        in_specs, out_specs = (jax.tree.map(drop, s, is_leaf=_is_spec) for s in (in_specs, out_specs))
        return jax.shard_map(fn, mesh=outer, in_specs=in_specs, out_specs=out_specs, axis_names=rest, check_vma=False)
    names = set(layout.mesh.axis_names if axes is None else axes)
    return jax.shard_map(
        fn, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=names, check_vma=False
    )


def over_tokens(layout: Layout | None, fn: Callable, x_btd, w, t_bt, m_bt, with_w: bool):
    """`fn(x, w, t, m)` -> (summed loss, dx, summed dw if `with_w`) on each device's own tokens: manual over
    the mesh axes that split them (the batch axes and `context`; those an outer region, a pipeline stage,
    left automatic), so that what `fn` sums in a loop over token chunks is summed over the devices once,
    after it, by one all-reduce each, the same collective as the unchunked layer's weight gradient (left to
    GSPMD, the loop reduced dw in every iteration; a psum_scatter over fsdp here made GSPMD all-gather dw
    over `tensor` first). The weight enters whole over these axes, gathered as for any matmul. `m` may be None."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    free = lambda logical: tuple(a for a in layout.mesh_axes(logical) if a not in manual) if layout else ()
    batch, seq = free(ax.BATCH), free(ax.SEQ)
    if not batch + seq:  # one device, or inside a region already manual over them (a pipeline stage)
        return fn(x_btd, w, t_bt, m_bt)
    axes, tokens = (*batch, *seq), P(as_part(batch), as_part(seq))

    def local(x, w, t, *m):
        total, dx, dw = fn(x, w, t, m[0] if m else None)
        return (jax.lax.psum(total, axes), dx) + ((jax.lax.psum(dw, axes),) if with_w else ())

    masks = () if m_bt is None else (m_bt,)
    specs = (P(*tokens, None), P(), tokens) + ((tokens,) if masks else ())
    region = manual_region(layout, local, specs, (P(), P(*tokens, None)) + ((P(),) if with_w else ()), set(axes))
    out = region(x_btd, w, t_bt, *masks)
    return out if with_w else (*out, None)


def column_parallel(
    layout: Layout | None,
    fn: Callable,
    x_btd: jax.Array,
    weights: Sequence[jax.Array],
    weight_axes: Sequence[Sequence[str | None]],
    out_axes: Sequence[Sequence[str | None]],
    residual_axes: Sequence[str | None],
    extras: Sequence[tuple[jax.Array, Sequence[str | None]]] = (),
):
    """Enter a tensor-parallel block: f (TP) or g (TP+SP), then `fn(x, *extras, *weights)` - the
    block's column-parallel matmuls - on the full sequence (of this context rank), returning a tuple
    of outputs laid out as `out_axes`. `extras`: (activation, logical axes) pairs the block also
    reads, such as RoPE's positions.

    With a tensor axis, `fn` runs inside one manual region on each rank's weight shards, so the
    backward pass sums the input-gradient contributions of all its matmuls locally and reduces them
    once: an all-reduce (f, TP) or a reduce-scatter (g-conjugate, SP). Left to GSPMD, each
    matmul's partial input-gradient is all-reduced on its own (3x the bytes for Q, K, V).

    Under SP the region all-gathers the sequence first and is checkpointed, so backward keeps only
    the local sequence shard and re-gathers it (P2 4.2.2; Megatron's
    LinearWithGradAccumulationAndAsyncCommunication). The recomputed matmul outputs are unused in
    backward and removed by XLA, so no GEMM runs twice.

    The region is where zb1 splits the backward (`parallel.taps`): the weights' gradients in W.
    """
    extra_arrays = [e for e, _ in extras]
    if layout is None or layout.tensor_size == 1:
        plain = lambda x, ws: tuple(
            constrain(layout, o, a) for o, a in zip(fn(x, *extra_arrays, *ws), out_axes, strict=True)
        )
        return taps.region(plain, x_btd, weights)
    sp = layout.sequence_parallel

    def local(x, *args):
        if sp:  # the sequence of this context rank (sharded over context x tensor outside)
            x = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
        return tuple(fn(x, *args))

    region = manual_region(
        layout,
        local,
        in_specs=(
            layout.spec(residual_axes),
            *(layout.spec(a) for _, a in extras),
            *(region_weight_spec(layout, a) for a in weight_axes),
        ),
        out_specs=tuple(layout.spec(a) for a in out_axes),
    )
    if sp:
        region = jax.checkpoint(region)
    return taps.region(lambda x, ws: region(x, *extra_arrays, *ws), x_btd, weights)


def row_parallel(
    layout: Layout | None,
    equation: str,
    x: jax.Array,
    w: jax.Array,
    x_axes: Sequence[str | None],
    w_axes: Sequence[str | None],
    out_axes: Sequence[str | None],
    flat: bool = True,
    lora: tuple | None = None,
) -> jax.Array:
    """f-bar / g-bar: a row-parallel matmul (contraction over a tensor-sharded axis) leaving the block.

    TP only: the einsum, constrained to the residual layout; GSPMD all-reduces the partial sums.
    TP + SP: local partial sums reduce-scattered along the sequence (axis 1 of the output).
    `flat`: `layers.dense` may run it on the b*t rows - not under GSPMD with the sequence split over
    `context` (the reshape would move data) nor with a tensor axis (GSPMD would all-reduce the rows
    view: the same bytes, but no longer the [b, t, d] activation that the HLO checks recognise).
    `lora` = (A, B, A's axes, B's axes, scale): the LoRA term scale x A B added to the partial sums
    before they are reduced (x A is a partial sum over the same tensor-sharded axis).
    """
    weights = [w] if lora is None else [w, lora[0], lora[1]]

    def local(x, ws, flat):
        out = dense(equation, x, ws[0], flat)
        return out if lora is None else out + lora_delta(equation, x, ws[1], ws[2], lora[4])

    if layout is None or not layout.sequence_parallel:
        flat = flat and (layout is None or (layout.context_size == 1 and layout.tensor_size == 1))
        call = lambda x, ws: (constrain(layout, local(x, ws, flat), out_axes),)
    else:
        specs = [region_weight_spec(layout, w_axes)]
        specs += [] if lora is None else [region_weight_spec(layout, lora[2]), region_weight_spec(layout, lora[3])]
        region = manual_region(
            layout,
            lambda xl, *wl: jax.lax.psum_scatter(local(xl, wl, flat), "tensor", scatter_dimension=1, tiled=True),
            in_specs=(layout.spec(x_axes), *specs),
            out_specs=layout.spec(out_axes),
        )
        call = lambda x, ws: (region(x, *ws),)
    return taps.region(call, x, weights)[0]


def vocab_parallel_embed(
    layout: Layout | None,
    table_vd: jax.Array,
    table_axes: Sequence[str | None],
    tokens_bt: jax.Array,
    out_axes: Sequence[str | None],
) -> jax.Array:
    """Embedding lookup in a vocabulary-sharded table. Under SP each tensor rank looks up the
    tokens of its vocabulary slice, and the partial embeddings are reduce-scattered along the
    sequence (Megatron's VocabParallelEmbedding + scatter to the SP region)."""
    if layout is None or not layout.sequence_parallel or "tensor" not in layout.mesh_axes(table_axes[0]):
        return constrain(layout, jnp.take(table_vd, tokens_bt, axis=0), out_axes)

    def local(table, tokens):
        # Rows outside this rank's slice read as zeros (mode="fill"), so backward keeps only the ids.
        # take() wraps negative indices NumPy-style even in fill mode: send them past the end.
        rows = table.shape[0]
        local_ids = tokens - jax.lax.axis_index("tensor") * rows
        local_ids = jnp.where(local_ids < 0, rows, local_ids)
        x = jnp.take(table, local_ids, axis=0, mode="fill", fill_value=0)
        return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)

    tokens_spec = layout.spec((ax.BATCH, ax.SEQ))  # rows over (data, fsdp), sequence over context
    table_spec = region_weight_spec(layout, table_axes)
    return manual_region(layout, local, in_specs=(table_spec, tokens_spec), out_specs=layout.spec(out_axes))(
        table_vd, tokens_bt
    )
