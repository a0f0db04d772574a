"""Mixture-of-Experts feed-forward layer: top-k routing, capacity buffers, expert parallelism.

Each token's router logits r = x W_r pick its k experts (top-k of the logits); the layer output is
the sum over the chosen experts of weight_e * SwiGLU_e(x), plus always-on shared experts where the
model has them. The weights are the softmax over the k chosen logits (`router_renormalize`,
Mixtral; the same as renormalising the full softmax's top-k) or the full softmax's probabilities
of the chosen (Qwen-MoE without `norm_topk_prob`).

**Capacity groups.** Tokens compete for an expert's slots within one *group*: one sequence (a row
of the batch). Each expert has C slots per group, C = min(t, ceil(factor * t * k / E)), or t
(dropless: no token can be refused, since a token picks an expert at most once). Slots are filled
in priority order: all first choices of the row in token order, then all second choices, and so on
(GShard's rule: a token's first choice outranks anyone's second). An assignment past C is dropped:
it adds nothing, and the residual stream carries the token past the layer. Because a group is one
row, every layout that keeps rows whole (data, fsdp, expert, tensor, sequence parallelism) routes
and drops exactly the same assignments as one device; splitting a row (context parallelism) would
change the groups, so a finite capacity refuses `context` > 1. Dropless, nothing is dropped
wherever a token stands: each context rank routes its own tokens (a group of them, C = its t) and
the rows' router statistics are summed over `context`.

**Expert GEMMs** (`moe_costs.expert_kernel`). With a finite capacity (or `moe_kernel=buffers`)
the tokens are gathered into capacity buffers [E, rows, C, d] (an index gather, no one-hot einsum),
and every expert's SwiGLU runs as one batched GEMM over its C slots per row: capacity x the active
FLOPs, E/k x dropless. Dropless, the assignments are grouped by expert instead and multiplied as
groups (`model.grouped`: a tiled CPU kernel, `ragged_dot`, megablox): the routed rows and their
tile padding.

**Expert parallelism.** Experts are sharded over the `expert` mesh axis, which also splits the
batch for every other layer. Inside one `shard_map` region each device routes its own rows, then an
`all_to_all` over `expert` sends each expert's slots to the device that holds it ([E, rows, C, d]
-> [E/expert, expert x rows, C, d]; grouped: `grouped.exchange`'s worst-case buffers), the local
experts run, and a second `all_to_all` brings the outputs back to their rows. With a tensor axis
each expert's FFN is split Megatron-style (gate/up column-parallel, down row-parallel) and the
partial sums are reduced once at the region's exit (an all-reduce, or a reduce-scatter along the
sequence under SP, whose entry all-gathers it).

Shapes: b rows, t tokens, d d_model, E experts, k experts per token, C slots, f expert width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshlm import axes as ax
from meshlm.config import ConfigError, ModelConfig
from meshlm.model import grouped, layers
from meshlm.model.moe_costs import EXCHANGE_OP, expert_capacity, expert_kernel, grouped_rows
from meshlm.parallel import remat
from meshlm.parallel.collectives import manual_region, region_weight_spec
from meshlm.parallel.rules import Layout

EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")
SHARED_WEIGHTS = ("ws_gate", "ws_up", "ws_down")
MOE_METRICS = ("moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss", "expert_load", "expert_counts", "dropped_fraction")
# summed over a step's microbatches (exact integers; MTP's loss sums); the others are averaged
SUMMED_METRICS = ("expert_counts", "mtp_loss_sum")


class RouterStats(NamedTuple):
    """Per row (capacity group) of one MoE layer, summed over its tokens; the step turns them into
    the auxiliary losses and the load metrics over the whole microbatch (`moe_losses`)."""

    counts: jax.Array  # [b, E] assignments routed to each expert (before any drop)
    prob_sum: jax.Array  # [b, E] router probabilities summed over the row's tokens
    z_sum: jax.Array  # [b] sum over tokens of logsumexp(logits)^2
    dropped: jax.Array  # [b] assignments past their expert's capacity


def route(
    logits: jax.Array,
    k: int,
    renormalize: bool,
    *,
    score: str = "softmax",
    bias: jax.Array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights [.., k] fp32, experts [.., k] int32, probabilities [.., E] fp32) of fp32 logits.

    softmax (Mixtral, Qwen-MoE): the top-k logits; their weights the softmax over the chosen
    (`renormalize`) or the full softmax's probabilities. sigmoid (DeepSeek-V3): scores s =
    sigmoid(logits); the top-k of s + `bias` (the bias for the choice only); the weights s of the
    chosen, divided by their sum (+1e-20) with `renormalize`. Group-limited (`n_group` > 1): the
    experts split into n_group equal groups, each scored by the sum of its best two s + bias, and
    the choice made within the `topk_group` best groups (sigmoid only). The weights are then x `scale`
    (routed_scaling_factor). The probabilities (the load-balancing losses' P) are the softmax's, or
    s normalised over the experts."""
    if score == "softmax":  # validation keeps the bias and the groups to sigmoid scoring
        assert bias is None and n_group == 1, "the router bias and groups go with sigmoid scores"
        probs, choice = jax.nn.softmax(logits, axis=-1), logits  # top-k of the logits = of the softmax
    else:
        scores = jax.nn.sigmoid(logits)
        probs, choice = scores / jnp.sum(scores, axis=-1, keepdims=True), scores
        choice = choice if bias is None else choice + bias.astype(jnp.float32)
    if n_group > 1:
        grouped = choice.reshape(*choice.shape[:-1], n_group, -1)
        best = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [.., groups]
        kept = jnp.any(jax.lax.top_k(best, topk_group)[1][..., None] == jnp.arange(n_group), axis=-2)
        choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(choice, k)[1]
    if score == "softmax":
        top = jnp.take_along_axis(logits, experts, axis=-1)
        weights = jax.nn.softmax(top, axis=-1) if renormalize else jnp.take_along_axis(probs, experts, axis=-1)
    else:
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) if renormalize else weights
    return weights * scale if scale != 1.0 else weights, experts, probs


def update_router_bias(params: dict, expert_counts: jax.Array, cfg: ModelConfig) -> dict:
    """DeepSeek-V3's auxiliary-loss-free balancing, after a step: each layer's router bias moves
    by router_bias_rate x sign(mean load - load) per expert, outside the gradient; unchanged when
    the rate is 0. `expert_counts` [L, E] int32: the step's assignments per expert (every
    microbatch's), so the sign is exact: sign(sum of counts - E x count_e)."""
    if not (cfg.router_bias and cfg.router_bias_rate):
        return params
    error = jnp.sum(expert_counts, axis=-1, keepdims=True) - cfg.n_experts * expert_counts
    step = cfg.router_bias_rate * jnp.sign(error)
    n = len(cfg.moe_layer_ids)  # then the multi-token-prediction modules' MoE layers (`model.mtp`)
    out = params | {"layers": params["layers"] | {"router_bias": params["layers"]["router_bias"] + step[:n]}}
    if "router_bias" in params.get("mtp", {}):
        out["mtp"] = params["mtp"] | {"router_bias": params["mtp"]["router_bias"] + step[n:]}
    return out


def assign_slots(experts_btk: jax.Array, n_experts: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """(slot [b, k*t], kept [b, k*t]) of each assignment in priority order (choice-major: all first
    choices of the row by token, then the second, ...): its flat slot e*C + position among the
    assignments to e so far, or E*C (out of range) when past the capacity."""
    b, t, k = experts_btk.shape
    order = experts_btk.transpose(0, 2, 1).reshape(b, k * t)
    position = grouped.rank_within(order, n_experts, axis=1)[0]
    kept = position < slots
    return jnp.where(kept, order * slots + position, n_experts * slots), kept


def _swiglu_experts(buf_ercd: jax.Array, w_gate, w_up, w_down, act) -> jax.Array:
    """Every local expert's SwiGLU on its slots [E, rows, C, d]: one batched GEMM per weight over
    each expert's rows x C slots (expert-major, so the batch axis leads and XLA:CPU runs the GEMMs
    in place: 1.58x faster than rows-major buffers at moe-tiny's shapes, BENCHMARKS.md)."""
    e, r, c, d = buf_ercd.shape
    x = buf_ercd.reshape(e, r * c, d)
    gate = jnp.einsum("emd,edf->emf", x, w_gate)
    up = jnp.einsum("emd,edf->emf", x, w_up)
    return jnp.einsum("emf,efd->emd", act(gate, up), w_down).reshape(e, r, c, d)


def dispatch(x_btd: jax.Array, slot: jax.Array, n_experts: int, slots: int) -> jax.Array:
    """The capacity buffers [E, b, C, d], expert-major: slot e*C + c of row r holds the token that
    `slot` ([b, k*t], `assign_slots`) put there, zeros where none did; one gather of x's rows."""
    b, t, d = x_btd.shape
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    token = rows * t + jnp.arange(slot.shape[1], dtype=jnp.int32) % t  # assignment n is token n mod t
    filler = jnp.full((b, n_experts * slots), b * t, jnp.int32).at[rows, slot].set(token, mode="drop")
    filler = filler.reshape(b, n_experts, slots).transpose(1, 0, 2)  # b*t: no token (reads zeros)
    return jnp.take(x_btd.reshape(b * t, d), filler, axis=0, mode="fill", fill_value=0)


def combine(out_ebcd: jax.Array, slot: jax.Array, weights_btk: jax.Array) -> jax.Array:
    """Each token's output [b, t, d]: its kept assignments' expert outputs (slot e*C + c of row r
    is out[e, r, c]; a dropped one reads zeros) weighted and summed - a weighted sum, not an einsum,
    so the program's dots stay the model's GEMMs (tests/test_flops.py)."""
    E, b, C, d = out_ebcd.shape
    t, k = weights_btk.shape[1:]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    at = jnp.where(slot < E * C, (slot // C) * (b * C) + rows * C + slot % C, E * b * C)
    picked = jnp.take(out_ebcd.reshape(E * b * C, d), at, axis=0, mode="fill", fill_value=0)
    w_bkt = weights_btk.transpose(0, 2, 1).astype(out_ebcd.dtype)
    return jnp.sum(picked.reshape(b, k, t, d) * w_bkt[..., None], axis=1)


def _moe_local(x_btd, router, we_gate, we_up, we_down, *shared, cfg: ModelConfig, ep, ways: int, policy: str):
    """The MoE layer on one device's rows (all of them without a mesh): routes, runs the experts on
    the assignments (capacity buffers or grouped, `moe_costs.expert_kernel`; exchanged over `ep`,
    the expert axis of `ways` devices, if sharded), combines. Returns (partial output [b, t, d]
    (partial over `tensor` if sharded), RouterStats)."""
    E, k = cfg.n_experts, cfg.experts_per_token
    b, t = x_btd.shape[:2]
    bias, shared = (shared[-1], shared[:-1]) if cfg.router_bias else (None, shared)  # moe_names' order
    logits = jnp.einsum("btd,de->bte", x_btd, router, preferred_element_type=jnp.float32)
    weights, experts, probs = route(
        logits,
        k,
        cfg.router_renormalize,
        score=cfg.router_score,
        bias=bias,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        scale=cfg.routed_scaling_factor,
    )
    act = remat.wrap_elementwise(layers.swiglu, policy)  # keeps gate and up only, as the dense MLP
    kernel = expert_kernel(cfg, b, t, ways, jax.default_backend())
    if kernel == "buffers":
        C = expert_capacity(cfg, t)
        slot, kept = assign_slots(experts, E, C)
        buf = dispatch(x_btd, slot, E, C)
        if ep is not None:  # each expert's slots to the device holding it: [E/X, X b, C, d]
            buf = jax.lax.all_to_all(buf, ep, split_axis=0, concat_axis=1, tiled=True)
        out = _swiglu_experts(buf, we_gate, we_up, we_down, act)
        if ep is not None:
            out = jax.lax.all_to_all(out, ep, split_axis=1, concat_axis=0, tiled=True)
        y, dropped = combine(out, slot, weights), jnp.sum(1.0 - kept.astype(jnp.float32), axis=1)
    else:
        # the plain activation: the grouped kernels keep gate and up and recompute it themselves
        picked = _grouped_experts(x_btd, experts, we_gate, we_up, we_down, layers.swiglu, kernel, ep, ways)
        w = weights.astype(picked.dtype)[..., None]  # a weighted sum, not an einsum (see `combine`)
        y, dropped = jnp.sum(picked.reshape(b, t, k, -1) * w, axis=2), jnp.zeros((b,), jnp.float32)
    if shared:
        y = y + _shared_expert(x_btd, *shared, act=act)
    counts = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=(1, 2))
    lse = jax.nn.logsumexp(logits, axis=-1)
    stats = RouterStats(
        counts=counts,
        prob_sum=jnp.sum(probs, axis=1),
        z_sum=jnp.sum(jnp.square(lse), axis=1),
        dropped=dropped,
    )
    return y, stats


def _grouped_experts(x_btd, experts_btk, w_gate, w_up, w_down, act, kernel: str, ep, ways: int) -> jax.Array:
    """Dropless at the routed FLOPs (`model.grouped`): each assignment's expert output [b t k, d],
    token-major, from the grouped kernel; over `ep` through the exchange's worst-case buffers (their
    used rows only where `moe_costs.EXCHANGE_OP` says ragged)."""
    b, t, d = x_btd.shape
    n, local = experts_btk.size, w_gate.shape[0]
    expert = experts_btk.reshape(n)
    source = jnp.arange(n, dtype=jnp.int32) // experts_btk.shape[-1]
    backend = jax.default_backend()
    if kernel == "megablox" and backend not in ("tpu", "cpu"):  # interpret mode: a CPU reference, for tests
        raise ConfigError(f"model.moe_kernel=megablox is JAX's TPU kernel; on {backend} use ragged_dot (or auto)")
    interpret = backend != "tpu"

    def run(x_nd, ids, source):
        g = grouped.Groups(ids, local, grouped_rows(ids.shape[0], local))
        out = grouped.expert_swiglu(g.gather(x_nd, source), g, w_gate, w_up, w_down, act, kernel, interpret)
        return g.scatter(out)

    if ep is None:
        return run(x_btd.reshape(b * t, d), expert, source)
    received = functools.partial(run, source=jnp.arange(ways * n, dtype=jnp.int32))  # rows in arrival order
    ragged = EXCHANGE_OP[backend] == "ragged"
    return grouped.exchange(x_btd.reshape(b * t, d), expert, source, ep, ways, local, received, ragged)


def _shared_expert(x_btd, w_gate, w_up, w_down, gate=None, *, act):
    """The always-on experts, fused into one SwiGLU (Qwen2-MoE: scaled by sigmoid(x . gate))."""
    gate_btf = layers.dense("btd,df->btf", x_btd, w_gate, False)
    up_btf = layers.dense("btd,df->btf", x_btd, w_up, False)
    y = layers.dense("btf,fd->btd", act(gate_btf, up_btf), w_down, False)
    if gate is None:
        return y
    g = jax.nn.sigmoid(jnp.einsum("btd,d->bt", x_btd, gate, preferred_element_type=jnp.float32))
    return y * g[..., None].astype(y.dtype)


def moe_names(cfg: ModelConfig) -> list[str]:
    """The layer's MoE weights, in the order `_moe_local` takes them."""
    names = ["w_router", *EXPERT_WEIGHTS]
    if cfg.shared_ffn:
        names += [*SHARED_WEIGHTS] + (["ws_router"] if cfg.shared_expert_gate else [])
    return names + (["router_bias"] if cfg.router_bias else [])


def moe_ffn(
    layout: Layout | None,
    x_btd: jax.Array,
    p: dict,
    cfg: ModelConfig,
    weight_axes: dict,
    residual_axes,
    remat_policy: str = "elementwise",
):
    """The MoE feed-forward of one layer on the residual stream's normed input: (output laid out
    like the residual, RouterStats with rows over the batch axes)."""
    names = moe_names(cfg)
    weights = [p[n] for n in names]
    if layout is None:
        return _moe_local(x_btd, *weights, cfg=cfg, ep=None, ways=1, policy=remat_policy)
    ep = "expert" if layout.mesh.shape["expert"] > 1 else None
    tp = layout.tensor_size > 1
    sp = layout.sequence_parallel
    cp = layout.context_size > 1  # a row's tokens over `context` (dropless only: validation)

    def local(x, *ws):
        if sp:
            x = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
        y, stats = _moe_local(x, *ws, cfg=cfg, ep=ep, ways=layout.mesh.shape["expert"], policy=remat_policy)
        if cp:  # each row's statistics over all of its tokens, as one device counts them
            stats = jax.tree.map(lambda a: jax.lax.psum(a, "context"), stats)
        if sp:
            y = jax.lax.psum_scatter(y, "tensor", scatter_dimension=1, tiled=True)
        elif tp:
            y = jax.lax.psum(y, "tensor")
        return y, stats

    rows = layout.spec((ax.BATCH,))
    stats_specs = RouterStats(rows, rows, rows, rows)
    weight_specs = [region_weight_spec(layout, weight_axes[n], ("expert", "tensor")) for n in names]
    region = manual_region(
        layout,
        local,
        in_specs=(layout.spec(residual_axes), *weight_specs),
        out_specs=(layout.spec(residual_axes), stats_specs),
    )
    return region(x_btd, *weights)


def without_capacity(cfg: ModelConfig) -> ModelConfig:
    """The model as evaluation and generation run it: MoE routes dropless. A capacity group is a
    sequence, so a finite capacity would depend on how a call cuts the text (a decode step is a
    group of one token, a prefill's left padding takes slots): dropless, every token gets its k
    experts wherever it stands. Training keeps its capacity (the load-balancing pressure)."""
    return dataclasses.replace(cfg, expert_capacity_factor=0.0) if cfg.moe else cfg


def router_objective_share(
    stats: RouterStats, counts_total: jax.Array, count: jax.Array, cfg: ModelConfig, rows: int
) -> jax.Array:
    """One group of a microbatch's MoE layers and rows (a pipeline chunk on one device) - its share
    of the objective's router term count x (aux_coef x aux + z_coef x z + seq_coef x seq)
    (`step.objective_sum`, `moe_losses`). `counts_total` [E]: the microbatch's assignments per
    expert over all its MoE layers and rows, which fix the load-balancing loss's f (counts carry no
    gradient, so f is a constant of the step's gradient too); `rows`: the microbatch's rows. Every
    layer routes every token (counts are taken before drops), so each layer's tokens are the total's
    1/L. The shares of all chunks and rows sum to the router term; the gradient of a chunk's share
    with respect to its statistics is the cotangent a pipeline's backward feeds the chunk."""
    k, E, L = cfg.experts_per_token, cfg.n_experts, len(cfg.moe_stat_layer_ids)  # the model's and MTP's
    pairs = jnp.sum(counts_total) / k  # (token, layer) pairs of the microbatch
    f = jax.lax.stop_gradient(counts_total / pairs)
    aux = E * jnp.sum(f * stats.prob_sum.sum(axis=(0, 1))) / pairs
    z = stats.z_sum.sum() / (pairs / L) / L
    share = cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * z
    if cfg.moe_seq_aux_loss_coef:
        # at least 1: a pipeline's pad slot has none (`stage_layout.routed`), a real row its tokens
        row_tokens = jnp.maximum(stats.counts.sum(axis=-1, keepdims=True) / k, 1.0)
        seq = jnp.sum(E / k * stats.counts * stats.prob_sum / jnp.square(row_tokens)) / (L * rows)
        share += cfg.moe_seq_aux_loss_coef * seq
    return count * share


def over_microbatches(per_micro: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A step's MoE metrics from each microbatch's [k, ...]: summed (`SUMMED_METRICS`) or averaged."""
    return {k: (jnp.sum if k in SUMMED_METRICS else jnp.mean)(a, 0) for k, a in per_micro.items()}


def moe_losses(stats: RouterStats, cfg: ModelConfig) -> dict[str, jax.Array]:
    """From the per-layer, per-row statistics [L, b, ...] of one microbatch: the load-balancing loss
    (Switch/GShard) in `transformers`' form (`load_balancing_loss_func`), pooled over the layers:
    E * sum_e f_e P_e with f_e the fraction of (token, layer) pairs that route to e (sums to k) and
    P_e its mean probability over them - not the mean of each layer's loss, which weighs a layer's
    imbalance against its own probabilities only; k when perfectly balanced. The router z-loss
    (ST-MoE: mean of logsumexp^2 over tokens and layers); the load of every layer's experts (the
    fraction of routed assignments each receives; [L, E]) and the fraction of assignments dropped.
    DeepSeek-V3's sequence-wise balance loss: per sequence (row) and layer, sum_e f_e P_e with f_e =
    E / (k T) x the row's assignments to e and P_e the mean of its normalised scores over the row's
    T tokens (1 when balanced), averaged over rows and layers."""
    k, E = cfg.experts_per_token, cfg.n_experts
    tokens = stats.counts.sum(axis=(1, 2)) / k  # [L]
    f = stats.counts.sum(axis=(0, 1)) / tokens.sum()
    mean_p = stats.prob_sum.sum(axis=(0, 1)) / tokens.sum()
    aux = E * jnp.sum(f * mean_p)
    row_tokens = stats.counts.sum(axis=-1, keepdims=True) / k  # [L, b, 1]
    seq = jnp.mean(jnp.sum(E / k * stats.counts * stats.prob_sum / jnp.square(row_tokens), axis=-1))
    seq = seq if cfg.moe_seq_aux_loss_coef else jax.lax.stop_gradient(seq)  # logged only: keeps no residual
    z = jnp.mean(stats.z_sum.sum(axis=1) / tokens)
    routed = stats.counts.sum(axis=(1, 2))
    return {
        "moe_aux_loss": aux,
        "moe_seq_aux_loss": seq,
        "moe_z_loss": z,
        "expert_load": stats.counts.sum(axis=1) / routed[:, None],
        "expert_counts": jnp.round(stats.counts).astype(jnp.int32).sum(axis=1),  # exact past 2^24
        "dropped_fraction": stats.dropped.sum() / routed.sum(),
    }
