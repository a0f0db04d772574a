"""THE rules table: logical axis -> mesh axes. The model names logical axes only; this table is
the single place where a strategy becomes a sharding.

One table serves data parallel, FSDP (ZeRO-3), Megatron tensor parallelism and their
combinations, because the mesh always has all three axes and an axis of size 1 shards nothing:

- batch over (data, fsdp, expert): every data-like axis splits the batch;
- MoE experts (the stacked `expert` axis of their weights) over `expert` (`model.moe`);
- weight `embed` dims over fsdp: parameters (and, through `optim.py`, optimizer state) are split
  ZeRO-3 style and gathered by XLA just in time for each layer; and over `stage` for the weights
  without a layer axis (embeddings, final norm, output layer: 1/p of them per device, gathered by
  the pipeline once per step; `Layout.param_sharding` moves it off a width it does not divide);
- heads / kv_heads / mlp / vocab over tensor: QKV and MLP-in are column-parallel, attention-out
  and MLP-out row-parallel, the embedding and output layer vocabulary-parallel (Megatron, P2 4.2.1);
- with sequence parallelism (P2 4.2.2), `act_seq` - the sequence axis of the LayerNorm, dropout and
  residual regions - is also sharded over tensor (`rules_for`);
- with pipeline parallelism the stacked layer axis is split over `stage` (contiguous blocks of
  L/p layers; `parallel.pipeline` regroups them per schedule chunk inside the step);
- with context parallelism the sequence of the whole layer is sharded over `context` (`seq`,
  `act_seq`); under SP the residual's sequence is then split over (context, tensor). The rows are
  stored in the order `context_order` gives (load balancing), which `Layout.seq_index` names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax

MeshAxes = str | tuple[str, ...] | None

RULES: dict[str, MeshAxes] = {
    # parameters
    ax.LAYERS: "stage",
    ax.VOCAB: "tensor",
    ax.EMBED: ("fsdp", "stage"),  # layer weights take `stage` on LAYERS first; the embeddings and
    # output layer are stored split over it (a pipeline gathers them once per step)
    ax.POS: None,
    ax.HEADS: "tensor",
    ax.KV_HEADS: "tensor",
    ax.HEAD_DIM: None,
    ax.MLP: "tensor",
    ax.EXPERT: "expert",
    # activations
    ax.BATCH: ax.BATCH_AXES,
    ax.SEQ: "context",
    ax.ACT_SEQ: "context",
    ax.ACT_EMBED: None,
    ax.ACT_HEADS: "tensor",
    ax.ACT_KV_HEADS: "tensor",
    ax.ACT_MLP: "tensor",
    ax.ACT_VOCAB: "tensor",
}


def part_names(part: MeshAxes) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names (None, an axis, or a tuple of them)."""
    return (part,) if isinstance(part, str) else tuple(part or ())


def as_part(names: Sequence[str]) -> MeshAxes:
    """The PartitionSpec entry for these mesh axes: None, one axis, or the tuple."""
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def spec_of(parts: Sequence[MeshAxes]) -> P:
    """The PartitionSpec of these entries, trailing Nones left out (the spelling jax prints, which
    the golden shardings compare against)."""
    parts = list(parts)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def rules_for(sequence_parallel: bool) -> tuple[tuple[str, MeshAxes], ...]:
    """The rules table, with the sequence-parallel row switched on or off."""
    table = dict(RULES)
    if sequence_parallel:
        table[ax.ACT_SEQ] = ("context", "tensor")
    return tuple(table.items())


def context_order(context: int, load_balance: bool) -> tuple[int, ...]:
    """Which chunk of the sequence each stored chunk is, in storage order: rank r of `context`
    holds stored chunks 2r and 2r+1 = original chunks r and 2c-1-r when load-balanced (causal
    attention work then equals on every rank), else chunk r."""
    if not load_balance:
        return tuple(range(context))
    return tuple(c for r in range(context) for c in (r, 2 * context - 1 - r))


def sequence_index(length: int, order: Sequence[int] | None) -> np.ndarray:
    """int32 [length]: the original position of each stored position (0..length-1 without CP)."""
    if order is None:
        return np.arange(length, dtype=np.int32)
    chunk = length // len(order)
    if chunk * len(order) != length:
        raise ValueError(f"sequence length {length} does not split into {len(order)} context chunks")
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk, dtype=np.int32) for c in order])


def reorder_sequence(x: np.ndarray, order: Sequence[int] | None, axis: int = 1) -> np.ndarray:
    """Put a batch's sequence axis into storage order (the loader does this once per batch)."""
    return x if order is None else np.take(x, sequence_index(x.shape[axis], order), axis=axis)


def restore_sequence(x: np.ndarray, order: Sequence[int] | None, axis: int = 1) -> np.ndarray:
    """The inverse of `reorder_sequence` (tests and tools; training never needs it)."""
    return x if order is None else np.take(x, np.argsort(sequence_index(x.shape[axis], order)), axis=axis)


@dataclass(frozen=True)
class Layout:
    """A mesh plus the rules table: turns logical axis names into shardings and constraints."""

    mesh: Mesh
    rules: tuple[tuple[str, MeshAxes], ...] = tuple(RULES.items())
    context_strategy: str = "ring"
    context_order: tuple[int, ...] | None = None  # storage order of the sequence chunks (context > 1)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """Mesh axes of size > 1 that a logical axis maps to (size-1 axes are dropped)."""
        if logical is None:
            return ()
        table = dict(self.rules)
        if logical not in table:
            raise KeyError(f"logical axis {logical!r} has no rule; add it to parallel/rules.py")
        target = table[logical]
        names = (target,) if isinstance(target, str) else tuple(target or ())
        return tuple(n for n in names if self.mesh.shape[n] > 1)

    def spec(self, logical_axes: Sequence[str | None]) -> P:
        """The PartitionSpec of logical axes. Inside a manual region (a pipeline stage is manual over
        `stage` and the batch axes) the axes it made manual are left out: the array here is already
        that region's piece."""
        parts: list[MeshAxes] = []
        used: set[str] = set(jax.sharding.get_abstract_mesh().manual_axes)
        for logical in logical_axes:
            names = tuple(n for n in self.mesh_axes(logical) if n not in used)
            used.update(names)
            parts.append(as_part(names))
        return spec_of(parts)

    def sharding(self, logical_axes: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes))

    def param_sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        """A parameter's storage sharding: `sharding`, except that `stage` is left off a dimension
        it does not divide (the embeddings' width is split over fsdp x stage where it divides - 1/p
        of them per device - and where it does not, e.g. d=20480 over 35 stages, the first other
        dimension it divides takes `stage`, else the weight is whole on every stage). A layer axis
        `stage` does not divide - an MoE model's dense first layers (`model.first_k_dense`), which
        every stage runs whole, or uneven stages' layers (`schedules.chunk_layers`) - takes it on its
        width instead, as the embeddings do, or where it has none (MLA's up-projections [L, r, heads,
        d]) on the first other dimension it divides."""
        spec = self.spec(logical_axes)
        parts, homeless = [], None
        size = lambda names: math.prod(self.mesh.shape[n] for n in names)
        for i, (dim, part, logical) in enumerate(
            zip(shape, (*spec, *[None] * (len(shape) - len(spec))), logical_axes, strict=True)
        ):
            names = part_names(part)
            if "stage" in names and dim % size(names):
                names, homeless = tuple(n for n in names if n != "stage"), i
            elif homeless is not None and logical == ax.EMBED and not dim % size((*names, "stage")):
                names, homeless = (*names, "stage"), None
            parts.append(names)
        fits = [i for i, d in enumerate(shape) if homeless not in (None, i) and not d % size((*parts[i], "stage"))]
        if fits:  # no width it divides: the first other dimension
            parts[fits[0]] = (*parts[fits[0]], "stage")
        return NamedSharding(self.mesh, spec_of([as_part(n) for n in parts]))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        """`with_sharding_constraint` by logical names; the model's only contact with the mesh."""
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes))

    @property
    def sequence_parallel(self) -> bool:
        return "tensor" in self.mesh_axes(ax.ACT_SEQ)

    @property
    def tensor_size(self) -> int:
        return self.mesh.shape["tensor"]

    @property
    def stage_size(self) -> int:
        return self.mesh.shape["stage"]

    @property
    def context_size(self) -> int:
        return self.mesh.shape["context"]

    @property
    def reordered(self) -> bool:
        """The sequence is stored in another order than the original (load-balanced CP)."""
        order = self.context_order
        return self.context_size > 1 and order is not None and tuple(order) != tuple(sorted(order))

    def seq_index(self, length: int) -> np.ndarray:
        """The original position of each stored sequence position (identity without CP)."""
        return sequence_index(length, self.context_order if self.context_size > 1 else None)


def constrain(layout: Layout | None, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Constrain `x` if a layout is given; single-device model code passes `None`."""
    return x if layout is None else layout.constrain(x, logical_axes)
