"""Where a pipeline's weights sit (`parallel.pipeline`): the stacked layers regrouped per stage, the
weights every stage keeps whole (the embeddings, the output layer and an MoE model's dense first
layers, which run with the embedding on the first chunk), and how the step's MoE metrics and token
counts come back from the stages.

The stacked layer axis [L, ...] is stored split over `stage` in contiguous blocks (checkpoints do
not depend on the pipeline) and regrouped in the step to [p, v, c, ...], c = L/(pv): stage s holds the
chunks `Schedule.held_chunks` names (a reshape, ZB-V's second arm reversed, a transpose). Stages of
uneven layer counts (`schedules.chunk_layers`: c = ceil(L/(pv)), pad slots in the lighter chunks)
store the layer axis whole and `stage` on another dimension (`Layout.param_sharding`; where p divides
L but p v does not, on the layer axis still, and GSPMD regroups), and the regroup fills the pad slots
with zero weights (but `ROUTING`'s): a pre-norm layer whose output projections are zero
adds exactly zero to the residual stream, so a pad slot is the identity, and its input gradient
passes through unchanged. Its routing statistics are dropped (`routed`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax
from meshlm.config import ModelConfig, RunConfig
from meshlm.model import moe
from meshlm.model.params import ParamSpec
from meshlm.parallel.collectives import region_weight_spec
from meshlm.parallel.rules import Layout, as_part, part_names, spec_of
from meshlm.parallel.schedules import Schedule, chunk_layers, pipeline_unit

AXIS = "stage"
ROUTING = ("w_router", "mlp_norm")  # what a pad slot takes from layer 0 (`regroup`): the MoE router and its input norm
PREFIX = "dense_layers"  # an MoE model's dense first layers (`model.first_k_dense`): with the embedding


def kept(layout: Layout, axes, staged: bool = True, keep: tuple[str, ...] = ("expert", "tensor")) -> NamedSharding:
    """The layout a weight keeps inside the pipeline: its `tensor` and `expert` splits (and `stage`
    on the staged layer axis, logical LAYERS); the fsdp split and the stage split of the weights
    every stage keeps whole (`staged=False`: embeddings, output layer, a dense prefix, MTP modules)
    are gathered."""
    spec = region_weight_spec(layout, axes, keep)
    return NamedSharding(layout.mesh, P(AXIS, *spec[1:]) if staged and axes[0] == ax.LAYERS else spec)


def top_specs(specs: dict) -> dict:
    return {n: s for n, s in specs.items() if n != "layers"}


def top_shardings(layout: Layout, specs: dict, inside: bool = False) -> dict:
    """`kept` of every weight but the staged layers', as a tree like the parameters'; `inside` the
    stage region (manual over the batch axes, `expert` among them): their `tensor` split only."""
    keep = ("tensor",) if inside else ("expert", "tensor")
    return jax.tree.map(lambda s: kept(layout, s.axes, staged=False, keep=keep), top_specs(specs))


def top_region_specs(layout: Layout, specs: dict) -> dict:
    """How every weight but the staged layers' enters the stage region: whole, but an MTP module's
    MoE expert weights split over `expert`, as the MoE region inside a layer expects."""
    return jax.tree.map(lambda s: region_weight_spec(layout, s.axes, ("expert",)), top_specs(specs))


def region_spec(layout: Layout, axes) -> P:
    """A stacked weight [p, v, c, ...] (logical `axes`) entering the stage region, which is manual over `stage`
    and the batch axes: split over `stage`, and an MoE expert weight over `expert` (a batch axis
    too), so that each device holds its own experts, as the MoE region inside a layer expects."""
    return P(AXIS, None, None, *region_weight_spec(layout, axes[3:], ("expert",)))


def _v(arms: jax.Array, schedule: Schedule) -> jax.Array:
    """[v, p, ...] arms of chunks: ZB-V's second arm reversed (stage s holds chunk 2p - 1 - s), its own
    inverse; the others as they are."""
    return jnp.stack([arms[0], arms[1][::-1]]) if schedule.name == "zbv" else arms


def layer_slots(layers: int, chunks: int) -> np.ndarray:
    """[chunks, c] the staged layer (index in params["layers"]), or unit of layers
    (`schedules.pipeline_unit`), each chunk's slot holds, by global chunk (`schedules.chunk_layers`);
    -1 a pad slot (uneven stages only)."""
    table = chunk_layers(layers, chunks)
    per = max(len(c) for c in table)
    return np.array([[*c, *[-1] * (per - len(c))] for c in table], np.int32)


def layer_ids(cfg: RunConfig, slots: np.ndarray) -> np.ndarray:
    """[chunks, c] each chunk slot's layer id in the whole model (`layer_slots` after an MoE model's
    dense first layers), -1 a pad slot; [chunks, c, u] with units of u layers (`staged_params`)."""
    unit = pipeline_unit(cfg.model)
    u = len(unit.kinds)
    ids = np.where(slots[..., None] >= 0, unit.prefix + slots[..., None] * u + np.arange(u), -1).astype(np.int32)
    return ids if u > 1 else ids[..., 0]


def routed(stats, ids: jax.Array):
    """A chunk's RouterStats [c x its unit's MoE layers, ...], or their cotangent, with its pad slots'
    (`ids` < 0) zeroed: a pad slot's zero-weight layer is the identity, but its router still picks experts."""
    if stats is None:
        return None
    live = ids >= 0 if ids.ndim == 1 else (ids >= 0).all(-1)  # [c]: a unit's layers are pads together
    keep = lambda a: jnp.repeat(live, a.shape[0] // live.shape[0]).reshape(-1, *[1] * (a.ndim - 1))
    return jax.tree.map(lambda a: jnp.where(keep(a), a, 0), stats)


def _positions(m: ModelConfig) -> list[tuple[str, int, int]] | None:
    """Units of several layers (`schedules.pipeline_unit`): each unit layer's (stack, layers of its
    kind a unit, its place among them); None where a unit is one layer."""
    unit = pipeline_unit(m)
    if len(unit.kinds) == 1:
        return None
    stack = lambda moe: "layers" if moe else PREFIX
    return [(stack(k), unit.kinds.count(k), unit.kinds[:j].count(k)) for j, k in enumerate(unit.kinds)]


def staged_params(tree: dict, m: ModelConfig) -> dict:
    """The parameters (or their ParamSpecs) as the stages split them. Units of several layers
    (Qwen's moe_layer_step=2: dense, MoE): "layers" holds each unit layer j's weights as "j:name"
    [units, ...] (a strided slice of its stack), PREFIX the dense first layers only; else `tree`."""
    places, unit = _positions(m), pipeline_unit(m)
    if places is None:
        return tree
    first = {"layers": 0, PREFIX: unit.prefix}  # where each stack's unit layers begin

    def take(w, stack, per, q):
        if isinstance(w, ParamSpec):
            return dataclasses.replace(w, shape=(unit.count, *w.shape[1:]))
        return w[first[stack] :].reshape(unit.count, per, *w.shape[1:])[:, q]

    layers = {f"{j}:{n}": take(w, *at) for j, at in enumerate(places) for n, w in tree[at[0]].items()}
    prefix = lambda w: (
        dataclasses.replace(w, shape=(unit.prefix, *w.shape[1:])) if isinstance(w, ParamSpec) else w[: unit.prefix]
    )
    out = {k: v for k, v in tree.items() if k not in ("layers", PREFIX)} | {"layers": layers}
    return out | (
        {PREFIX: jax.tree.map(prefix, tree[PREFIX], is_leaf=lambda x: isinstance(x, ParamSpec))} if unit.prefix else {}
    )


def unstaged(grads: dict, m: ModelConfig) -> dict:
    """`staged_params` reversed, for gradients: each stack's unit layers interleaved back in model
    order, the dense first layers' before the others."""
    places, unit = _positions(m), pipeline_unit(m)
    if places is None:
        return grads
    parts = {"layers": {}, PREFIX: {}}
    for name, g in sorted(grads["layers"].items(), key=lambda item: int(item[0].split(":")[0])):
        j, n = name.split(":", 1)
        parts[places[int(j)][0]].setdefault(n, []).append(g)  # in unit order
    joined = lambda gs: jnp.stack(gs, axis=1).reshape(-1, *gs[0].shape[1:])
    out = {k: v for k, v in grads.items() if k not in ("layers", PREFIX)}
    out["layers"] = {n: joined(gs) for n, gs in parts["layers"].items()}
    dense = {n: joined(gs) for n, gs in parts[PREFIX].items()}
    if unit.prefix:
        dense = {n: jnp.concatenate([grads[PREFIX][n], g]) for n, g in dense.items()}
    return out | {PREFIX: dense}


def regroup(w: jax.Array, schedule: Schedule, slots: np.ndarray, name: str = "") -> jax.Array:
    """[L, ...] -> [p, v, c, ...], stage s's the chunks `Schedule.held_chunks` names: a reshape,
    ZB-V's second arm reversed, a transpose (GSPMD moves it with permutes; no data moves at v = 1
    when the stages split the layers evenly). `slots`: `layer_slots`; its pads take zero weights (the
    identity), but for the weights `ROUTING` names layer 0's: a zero router, or a zero norm before
    it, would send every token to the experts its tie-break puts first, one device's, which would do
    the pad's expert work for the whole group (the experts' weights stay zero: the output too)."""
    p, v = schedule.stages, schedule.virtual
    if (slots < 0).any():
        flat = slots.reshape(-1)
        pad = w[:1] if name.split(":")[-1] in ROUTING else jnp.zeros_like(w[:1])  # ("j:name": `staged_params`)
        w = jnp.concatenate([w, pad])[np.where(flat >= 0, flat, w.shape[0])]
    return jnp.swapaxes(_v(w.reshape(v, p, slots.shape[1], *w.shape[1:]), schedule), 0, 1)


def _uneven_split(layout: Layout, spec: ParamSpec, slots: np.ndarray) -> tuple | None:
    """Uneven stages, a stored weight that `stage` splits on a dimension k > 0 (innermost there:
    `Layout.param_sharding`): (its storage spec, the spec of its [p, v, c, ...] regrouped with `stage`
    on the first axis instead, k + 2); None otherwise (even stages, `stage` splitting it nowhere, or
    the layer axis, which it divides when p v does not)."""
    if not (slots < 0).any():
        return None
    shape, spec = spec.shape, layout.param_sharding(spec.axes, spec.shape).spec
    parts = [part_names(p) for p in (*spec, *[None] * (len(shape) - len(spec)))]
    k = next((i for i, n in enumerate(parts) if AXIS in n), None)
    if not k:  # nowhere, or on the layer axis (p divides L, p v does not): GSPMD's regroup of the global array
        return None
    out = [(AXIS,), (), (), *[tuple(a for a in n if a != AXIS) for n in parts[1:]]]
    return spec, spec_of([as_part(n) for n in out]), k + 2


def regroup_stored(
    w: jax.Array, name: str, spec: ParamSpec, schedule: Schedule, slots: np.ndarray, layout: Layout
) -> jax.Array:
    """`regroup` of the weight `name` as stored (`spec`: its ParamSpec). Uneven stages store it whole on the layer axis
    and split over `stage` on another dimension; in a region manual over the mesh each device
    regroups its shard, and one all_to_all over `stage` trades that split for the chunks': a stage
    gets its own chunks, 1/p of every device's shard moving (`ungroup_stored`: the same way back).
    GSPMD alone brought the gradients back as an all-reduce of the whole stack (at the width's fsdp
    share). A leaf `stage` splits nowhere, or even stages: `regroup`."""
    split = _uneven_split(layout, spec, slots)
    if split is None:
        return regroup(w, schedule, slots, name)
    stored, grouped, k = split
    body = lambda x: jax.lax.all_to_all(regroup(x, schedule, slots, name), AXIS, 0, k, tiled=True)
    return jax.shard_map(body, mesh=layout.mesh, in_specs=stored, out_specs=grouped)(w)


def ungroup_stored(g: jax.Array, spec: ParamSpec, schedule: Schedule, slots: np.ndarray, layout: Layout) -> jax.Array:
    """`ungroup` of a stacked gradient into its weight's storage layout (`regroup_stored` reversed)."""
    split = _uneven_split(layout, spec, slots)
    if split is None:
        return ungroup(g, schedule, slots)
    stored, grouped, k = split
    body = lambda x: ungroup(jax.lax.all_to_all(x, AXIS, k, 0, tiled=True), schedule, slots)
    return jax.shard_map(body, mesh=layout.mesh, in_specs=grouped, out_specs=stored)(g)


def ungroup(g: jax.Array, schedule: Schedule, slots: np.ndarray) -> jax.Array:
    """`regroup`'s inverse: [p, v, c, ...] -> [L, ...], the pad slots dropped."""
    flat = _v(jnp.swapaxes(g, 0, 1), schedule).reshape(-1, *g.shape[3:])
    return flat[np.flatnonzero(slots.reshape(-1) >= 0)] if (slots < 0).any() else flat


def stats_specs(cfg: RunConfig, batch_axes: tuple[str, ...]) -> dict | None:
    """How the stage region returns the MoE router statistics: the staged layers' [p, m, v, c (x a
    unit's MoE layers), b, ...] and the MTP modules' [p, m, D, b, ...], each stage's own; None for a
    dense model."""
    if not cfg.model.moe:
        return None
    rows = batch_axes or None
    return {"stats": P(AXIS, None, None, None, rows)} | (
        {"mtp_stats": P(AXIS, None, None, rows)} if cfg.model.mtp_depth else {}
    )


def moe_metrics(stats: dict | None, cfg: RunConfig, schedule: Schedule) -> dict:
    """The step's MoE metrics from every stage's RouterStats (`stats`: [p, m, v, c, b, ...] of the
    staged layers, MTP's [p, m, D, b, ...] of which the last chunk's stage holds the real ones), put
    in layer order [m, L (+ D), b, ...] (global chunk j p + s's slots in order, pads dropped, then MTP's), as
    `step.gradients` computes them; {} dense. ZB-V's V would reorder the layers: MoE refuses it."""
    if stats is None:
        return {}
    m, unit = schedule.microbatches, pipeline_unit(cfg.model)
    units, per = layer_slots(unit.count, schedule.stages * schedule.virtual)[..., None], sum(unit.kinds)
    slots = np.where(units >= 0, units * per + np.arange(per), -1).reshape(len(units), -1)  # a unit's MoE layers
    real = np.flatnonzero(slots.reshape(-1) >= 0)  # uneven stages: the pad slots' stats dropped
    layer_major = lambda a: jnp.moveaxis(a, 0, 2).reshape(m, slots.size, *a.shape[4:])[:, real]
    layers = jax.tree.map(layer_major, stats["stats"])
    if "mtp_stats" in stats:
        chunks = schedule.stages * schedule.virtual
        last = next(s for s, held in enumerate(schedule.held_chunks()) if chunks - 1 in held)
        layers = jax.tree.map(lambda a, b: jnp.concatenate([a, b[last]], axis=1), layers, stats["mtp_stats"])
    per_micro = jax.vmap(lambda st: moe.moe_losses(st, cfg.model))(layers)
    return moe.over_microbatches(per_micro)


def unsplit(batch_axes: tuple[str, ...], spec: P) -> tuple[str, ...]:
    """The batch axes a weight entering the stage region as `spec` is not split over: its gradient is
    summed over them (an expert weight's: data x fsdp, not `expert`)."""
    named = {a for part in spec for a in part_names(part)}
    return tuple(a for a in batch_axes if a not in named)


def microbatch_tokens(micro: dict) -> jax.Array:
    """[m] the counted tokens of each microbatch (the loss's; MoE's router losses weigh by them)."""
    if "mask" in micro:
        return jnp.sum(micro["mask"].astype(jnp.float32), axis=tuple(range(1, micro["mask"].ndim)))
    m, *rest = micro["targets"].shape
    return jnp.full((m,), float(math.prod(rest)), jnp.float32)
