"""Choose a mesh, sequence parallelism, recomputation and microbatch for a device budget.

For every factorisation data x fsdp x context x tensor of the device count, SP on/off, context strategy (ring,
all_gather, all_to_all), ZeRO-1 on/off, remat policy and gradient-accumulation count, predict per-device memory
(parameters, gradients and optimizer state from the exact shardings; activations from `accounting.activation_memory`;
FSDP's gathered layer weights) and step time from a roofline (GEMMs at peak, the attention core at its kernel's own
fraction of peak (`attention_rates`: a named, sourced constant per kernel and device kind; plan rows say "unmeasured"
where meshlm has not run the kernel there), plus tensor-parallel, context-parallel and data/FSDP collectives at the
device kind's link bandwidths, not overlapped - except the ring's K/V hops, which overlap the attention they feed),
then rank the layouts that fit. Where a device kind has measured rates (`CALIBRATIONS`: A100, from P2 Table 4), a
calibrated step time is shown beside the roofline (`calibrated_time`; within 7% of P2 Table 5 for its four models).

Explicit attention is also planned as `model.attention=blockwise` (which ring needs, and all_gather unless `fused` takes
a causal offset on the device; all_to_all runs either; such plans say so), the loss in chunks where its logits do not
fit. `plan_report` presents the plans (table, JSON, why the best one splits the sequence or not). Pure arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing
from dataclasses import dataclass, field

import jax

from meshlm import accounting
from meshlm import axes as ax
from meshlm.axes import MESH_AXES
from meshlm.config import ConfigError, ContextStrategy, ParallelConfig, RunConfig
from meshlm.insight.attention_rates import attention_kernel, expert_kernel_rate
from meshlm.insight.pipeline_costs import (
    pad_slots,
    per_flops_key,
    pipeline_overhead,
    pipeline_schedules,
    pipeline_send_bytes,
    plannable_stages,
    regroup_bytes,
    stage_extra_flops,
)
from meshlm.insight.step_peak import planned_loss_chunks, transient_terms
from meshlm.model.moe_costs import expert_exchange_bytes, expert_hardware_flops
from meshlm.model.params import ParamSpec, param_specs
from meshlm.parallel import rules, schedules, stage_layout
from meshlm.parallel.mesh import abstract_layout
from meshlm.platform.hardware import Accelerator, matmul_precision, peak_for
from meshlm.validation import validate

GiB = 2**30


def device_peak(device: Accelerator, cfg: RunConfig) -> float:
    """Peak FLOP/s per device for this config's compute dtype (fp32 runs at TF32 / one bf16 pass
    by default: `hardware.matmul_precision`)."""
    return peak_for(device, matmul_precision(cfg.model.dtype, device.platform))


# fp32 master weights, fp32 gradients and AdamW's two fp32 moments (Megatron's mixed-precision Adam: 18)
MESHLM_BYTES_PER_PARAM = 16


@dataclass
class Plan:
    cfg: RunConfig
    pipeline: int = 1
    memory: dict[str, float] = field(default_factory=dict)  # bytes per device by category
    time: dict[str, float] = field(default_factory=dict)  # seconds per step by part
    mfu: float = 0.0
    rejected: str = ""  # why it does not fit or cannot run; empty when feasible
    calibrated: dict[str, float] | None = None  # seconds per step by part, where the device is calibrated

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def expected_time(self) -> float:
        """The calibrated step time where the device kind has one, else the roofline's."""
        return sum(self.calibrated.values()) if self.calibrated else self.step_time

    def describe(self) -> str:
        p, r = self.cfg.parallel, self.cfg.remat.policy
        sp = "+SP" if p.sequence_parallel else ""
        pp = f" pipe={self.pipeline}" if self.pipeline > 1 and p.stage == 1 else ""
        if p.stage > 1:
            pp = f" {p.pipeline_schedule}" + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
            pp += " single-ticks" if p.pipeline_ticks == "single" else ""
        cp = f" {p.context_strategy}" if p.context > 1 else ""
        kernel = " blockwise" if self.cfg.model.attention == "blockwise" else ""
        zero = " ZeRO-1" if p.shard_optimizer else ""
        zero += " offload" if self.cfg.optim.offload_state else ""
        zero += f" loss-chunks={self.cfg.remat.loss_chunks}" if self.cfg.remat.loss_chunks > 1 else ""
        return f"{p.describe()}{sp}{cp}{pp}{kernel}{zero} remat={r} micro={self.cfg.train.microbatches}"


# Adam's two fp32 moments per parameter: what ZeRO-1 shards further and offload moves to the host.
MOMENT_BYTES = 8


def zero1_params(cfg: RunConfig) -> float:
    """Optimizer moments' elements one device holds under ZeRO-1 (`train_state.zero1_sharding` over
    an abstract mesh: exact)."""
    return _zero1_params(*_shapes_key(cfg), _rules_key())


# The planner weighs ~10^5 candidates that share a few thousand (model, mesh) pairs: the exact
# per-leaf shard counts are computed once per pair and rules table (a test may patch it). A mesh
# is keyed by its sharding fields: SP, the context strategy, the pipeline schedule and ZeRO-1 do
# not change a parameter's sharding (checked over the candidates for GPT-3 175B and Mixtral).
_SAME = ("sequence_parallel", "context_strategy", "context_load_balance", "pipeline_schedule", "virtual_stages")
_SAME += ("pipeline_ticks",)
_MESH_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.name not in (*_SAME, "shard_optimizer"))


def _shapes_key(cfg: RunConfig) -> tuple:
    return cfg.model, tuple(getattr(cfg.parallel, f) for f in _MESH_FIELDS)


def _rules_key() -> tuple:
    return tuple(rules.RULES.items())


@functools.lru_cache(maxsize=4096)
def _zero1_params(model, mesh: tuple, _rules: tuple) -> float:
    from meshlm.train_state import zero1_sharding

    layout = abstract_layout(ParallelConfig(**dict(zip(_MESH_FIELDS, mesh, strict=True))))
    specs = jax.tree.leaves(param_specs(model), is_leaf=lambda x: isinstance(x, ParamSpec))
    shard = lambda s: zero1_sharding(layout, layout.param_sharding(s.axes, s.shape), s.shape).shard_shape(s.shape)
    return float(sum(math.prod(shard(s)) for s in specs))


def sharded_params(cfg: RunConfig, experts_only: bool = False, part: str | None = None, trainable: bool = False):
    """Parameters one device holds, from the rules table and the mesh sizes (exact): the same
    `Layout.param_sharding` the trainer uses, over an abstract mesh (no devices needed). `experts_only`:
    of the MoE experts' stacked weights alone; `part`: "layers" (the stacked layer weights) or
    "top" (embeddings, final norm, output layer) alone; `trainable`: the adapters alone (LoRA)."""
    return _sharded_params(*_shapes_key(cfg), _rules_key(), experts_only, part, trainable)


@functools.lru_cache(maxsize=16384)
def _sharded_params(model, mesh: tuple, _rules: tuple, experts_only: bool, part: str | None, trainable: bool) -> float:
    layout = abstract_layout(ParallelConfig(**dict(zip(_MESH_FIELDS, mesh, strict=True))))
    tree = param_specs(model)
    if part is not None:  # in a pipeline, "layers": a slot's, units of (dense, MoE) layers too
        tree = stage_layout.staged_params(tree, model)
        tree = tree["layers"] if part == "layers" else {k: v for k, v in tree.items() if k != "layers"}
    specs = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, ParamSpec))
    specs = [s for s in specs if s.trainable or not trainable]
    if experts_only:
        specs = [s for s in specs if ax.EXPERT in s.axes]
    return float(sum(math.prod(layout.param_sharding(s.axes, s.shape).shard_shape(s.shape)) for s in specs))


def estimate(
    cfg: RunConfig,
    device: Accelerator,
    memory_limit: float | None = None,
    *,
    pipeline: int = 1,
    interleave: int = 1,
    bytes_per_param: float = MESHLM_BYTES_PER_PARAM,
    time_unfit: bool = True,
) -> Plan:
    """Predicted memory and step time of one layout (`time_unfit=False`: a layout that does not fit is rejected
    untimed). A run's own pipeline (`parallel.stage`) is counted exactly (stage-sharded layers, embeddings stored
    split over stage and gathered for the step, the executor's first-stage activations, the layers' regroup).
    An explicit `pipeline` > 1 on an unpipelined config models P2's Table 3 layouts as Megatron runs them: states
    split p ways, P2's first-stage formula. Both add the pipeline's idle time (`pipeline_overhead`: Megatron's
    bubble, or meshlm's lockstep ticks) and its sends to the bound (idle ticks are the schedule's structure, not
    an efficiency)."""
    if cfg.parallel.stage > 1 and pipeline != 1:
        raise ValueError("estimate: an explicit pipeline models an unpipelined config (parallel.stage == 1)")
    own, pipeline, interleave, n = _pipeline_shape(cfg, pipeline, interleave)
    plan = Plan(cfg, pipeline)
    limit = device.memory if memory_limit is None else memory_limit
    plan.memory = _memory_parts(cfg, own, pipeline, interleave, bytes_per_param)
    if plan.total_memory > limit and pipeline == 1 and cfg.remat.loss_chunks == 1 < (k := planned_loss_chunks(cfg)):
        plan.cfg = cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, loss_chunks=k))  # no logits
        plan.memory = _memory_parts(cfg, own, pipeline, interleave, bytes_per_param)
    if plan.total_memory > limit:
        states = sum(v for k, v in plan.memory.items() if k.startswith(("parameters", "optimizer")))
        most = max(((v, k) for k, v in plan.memory.items() if not k.startswith(("activ", "param", "optim"))), default=0)
        parts = [("activations", plan.memory["activations"]), ("states", states), *([most[::-1]] if most else [])]
        listed = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in parts)  # and the largest other: it may not fit
        plan.rejected = f"needs {plan.total_memory / GiB:.1f} GiB > {limit / GiB:.1f} GiB ({listed})"
        if not time_unfit:
            return plan
    plan.time = _roofline_parts(cfg, device, own, pipeline, interleave)
    peak = device_peak(device, cfg)
    plan.mfu = accounting.causal_flops_per_step(cfg) / (plan.step_time * n * peak)
    plan.calibrated = calibrated_time(cfg, device, plan.time, pipeline, interleave, bytes_per_param)
    return plan


def _memory_parts(cfg: RunConfig, own: bool, pipeline: int, interleave: int, bytes_per_param: float) -> dict:
    """Bytes per device by category: states from the exact shardings, activations from the
    formula, and what FSDP gathers."""
    m, par = cfg.model, cfg.parallel
    act = (
        accounting.activation_memory(cfg)
        if own
        else accounting.activation_memory(cfg, pipeline=pipeline, interleave=interleave)
    )
    params, trainable = (sharded_params(cfg, trainable=t) / (1 if own else pipeline) for t in (False, True))
    out = _state_parts(cfg, params, trainable, bytes_per_param, own or pipeline == 1, act["total"])
    out["activations"] = act["total"]
    out |= transient_terms(cfg, trainable) if pipeline == 1 else {}  # beside them at the peak (`step_peak`)
    if own and par.stage > 1 and (copies := _pipeline_gathered(cfg)):
        # the executor gathers its fp32 weights once per step (a stage's layers over fsdp, the
        # embeddings and output layer over fsdp x stage) and accumulates their gradients unsharded
        out["gathered weights"] = 4 * sum(copies.values())
        lora = bool(m.lora_rank)  # LoRA: the adapters' accumulators only
        acc = {k: n - sharded_params(cfg, part=k, trainable=lora) for k, n in _pipeline_gathered(cfg, lora).items()}
        out["unsharded gradient accumulators"] = 4 * sum(acc.values())
    elif par.fsdp > 1:  # one layer's weights gathered in the compute dtype, forward and backward
        size = lambda k: accounting.param_count(dataclasses.replace(k, n_layers=1))  # the largest kind of layer
        layer = max(size(k) for k, _ in accounting.layer_kinds(m)) - accounting.param_count(
            dataclasses.replace(m, n_layers=0)
        )
        out["gathered weights"] = 2 * layer / par.tensor * accounting.dtype_bytes(m.dtype)
    return out


def _pipeline_gathered(cfg: RunConfig, trainable: bool = False) -> dict[str, float]:
    """The weights meshlm's pipeline step gathers, by part ("layers", "top"): parameters per device of each
    copy it makes - its stage's layers split over tensor alone (when stored split over fsdp, or uneven), the
    embeddings and output layer whole but for tensor (when stored split); `trainable`: LoRA's."""
    return _gathered(*_shapes_key(cfg), trainable, _rules_key(), pad_slots(cfg))


@functools.lru_cache(maxsize=16384)
def _gathered(model, mesh: tuple, trainable: bool, rules_key: tuple, pads: int = 0) -> dict[str, float]:
    whole = lambda **sizes: tuple(sizes.get(f, v) for f, v in zip(_MESH_FIELDS, mesh, strict=True))
    count = lambda m, part: _sharded_params(model, m, rules_key, False, part, trainable)
    inside = {"layers": count(whole(fsdp=1), "layers"), "top": count(whole(fsdp=1, stage=1), "top")}
    if pads:  # uneven stages: a stage's L/p layers stored split over stage are its slots, pads too, regrouped whole
        inside["layers"] *= 1 + pads / schedules.staged_units(model)  # (`stage_layout.regroup_stored`)
    return {k: n for k, n in inside.items() if n > count(mesh, k)}


def _state_parts(cfg: RunConfig, params: float, trainable: float, bytes_per_param: float, exact_zero1: bool, act):
    """Device bytes of the weights, their gradients and the optimizer state: together without ZeRO-1
    or offload (P2's Megatron layouts keep that one line); else the moments apart, ZeRO-1's sharded
    over the data-parallel axes. Offloaded moments live in host memory but visit the device whole
    for the update, after the activations (`act`) are freed: only what they need beyond those is
    counted. LoRA: the frozen weights are their fp32 masters alone (4 bytes: no gradient, moments)."""
    par = cfg.parallel
    frozen = 4 * (params - trainable)
    if not (par.shard_optimizer or cfg.optim.offload_state):
        return {"parameters, gradients, optimizer": bytes_per_param * trainable + frozen}
    zero1 = par.shard_optimizer and exact_zero1 and not cfg.model.lora_rank
    moments = MOMENT_BYTES * (zero1_params(cfg) if zero1 else trainable)
    out = {"parameters, gradients": (bytes_per_param - MOMENT_BYTES) * trainable + frozen}
    if cfg.optim.offload_state:
        out["moments at the update, beyond the activations"] = max(0.0, moments - act)
    else:
        out["optimizer state (ZeRO-1)" if par.shard_optimizer else "optimizer state"] = moments
    return out


CONTEXT_STRATEGIES: tuple[str, ...] = typing.get_args(ContextStrategy)
EXCHANGE = "context-parallel exchange"  # the roofline part of K/V (ring, all_gather) or Q/K/V/output (all_to_all)
EXPERT_EXCHANGE = "expert all_to_all"  # MoE's dispatch and return over the expert axis
ATTENTION = "attention core"  # the part of the step the attention kernel takes, at its own rate
EXPERTS = "grouped expert GEMMs"  # dropless MoE's, where their kernel's rate is measured (`EXPERT_RATES`)


def _own_rate_flops(cfg: RunConfig, roofline: dict) -> int:
    """The FLOPs of the hardware count that the roofline's "attention core" part times at its
    kernel's own rate (none when the kernel runs at the GEMM rate, among the GEMMs)."""
    own = accounting.attention_core_flops(cfg) if roofline.get(ATTENTION) else 0
    return own + (expert_hardware_flops(cfg) if roofline.get(EXPERTS) else 0)


def expert_seconds(cfg: RunConfig, device: Accelerator, n: int) -> float:
    """Seconds per step of the grouped expert GEMMs at their kernel's measured rate (0 where it is the
    GEMM rate: then they are among the GEMMs). The rate is of routed FLOPs over a time that holds the
    measured shapes' tile padding, so it applies to the routed FLOPs; the executed ones (padding
    included) leave "compute" (`_own_rate_flops`)."""
    rate = expert_kernel_rate(cfg, device)[1]
    if rate.fraction is None:
        return 0.0
    return expert_hardware_flops(cfg, routed=True) / (n * device_peak(device, cfg) * rate.fraction)


def attention_seconds(cfg: RunConfig, device: Accelerator, n: int) -> float:
    """Seconds per step of the attention core at its kernel's fraction of peak (0 when it runs at
    the GEMM rate, among the GEMMs). A kernel at a causal offset under all_gather (splash, Pallas
    GPU) runs its forward once more in backward (`context.gathered_kernel_attention` is
    checkpointed): QK^T and attention over V again; Pallas GPU with document masks, some more."""
    kernel, par = attention_kernel(cfg, device), cfg.parallel
    if kernel.rate.fraction is None:
        return 0.0
    flops = accounting.attention_core_flops(cfg)
    if kernel.name in ("splash", "pallas-gpu") and par.context > 1 and par.context_strategy == "all_gather":
        flops += accounting.attention_forward_flops(cfg)
        if kernel.name == "pallas-gpu" and cfg.data.document_mask:
            # `kernels._offset_calls`: a chunk of t rows runs a discarded chunk of rows (t^2 / 2) and one
            # earlier chunk twice (t^2), against a rank's s^2 / 2c: 3 / chunks more, on the busiest rank
            flops *= 1 + 3 / (par.context * (2 if par.context_load_balance else 1))
    return flops / (n * device_peak(device, cfg) * kernel.rate.fraction)


def _link(device: Accelerator, span: int, across: bool = False) -> float:
    """Bandwidth of a collective over `span` devices: inside one node, else across nodes - and
    across them whenever one of its axes is split over slices/nodes (`across`: `parallel.dcn_*`)."""
    return device.intra_bw if span <= device.per_node and not across else device.inter_bw


def _across(cfg: RunConfig, *axes: str) -> bool:
    """Whether a collective over these mesh axes crosses slices/nodes (`--dcn`)."""
    return any(cfg.parallel.dcn[a] > 1 for a in axes)


_hardware_flops = per_flops_key(accounting.hardware_flops_per_step)


def _roofline_parts(cfg: RunConfig, device: Accelerator, own: bool, pipeline: int, interleave: int) -> dict:
    """Seconds per step by part: GEMMs at peak, the attention core at its kernel's rate, each
    collective at its link's bandwidth, not overlapped (except the ring's K/V hops, which overlap the
    attention they feed)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    n = _pipeline_shape(cfg, pipeline, interleave)[3]
    peak = device_peak(device, cfg)
    attention, experts = attention_seconds(cfg, device, n), expert_seconds(cfg, device, n)
    out = ({ATTENTION: attention} if attention else {}) | ({EXPERTS: experts} if experts else {})
    out = {"compute": (_hardware_flops(cfg) - _own_rate_flops(cfg, out)) / (n * peak)} | out
    # a dense prefix on stage 0 alone, MTP modules on the last stage alone: beyond the even share
    out |= {part: flops * pipeline / (n * peak) for part, flops in stage_extra_flops(cfg).items()}
    if par.tensor > 1:
        layers_here = (accounting.attention_layers(m) + pad_slots(cfg, layers=True)) / pipeline  # with MTP's, pads
        out["tensor-parallel collectives"] = (
            t.microbatches * layers_here * tp_layer_bytes(cfg) / _link(device, par.tensor)
        )
    if par.context > 1:
        link = _link(device, par.context * par.tensor, _across(cfg, "context"))
        comm = sum(accounting.context_comm_bytes(cfg).values()) / link / pipeline
        if par.context_strategy == "ring":  # each hop overlaps the attention on the block in hand
            comm = max(0.0, comm - (attention or accounting.attention_core_flops(cfg) / (n * peak)))
        out[EXCHANGE] = comm
    if par.expert > 1:  # MoE: each layer's dispatch and return, forward and backward (`--dcn expert`: across nodes)
        link = _link(device, par.expert * par.tensor, _across(cfg, "expert"))
        out[EXPERT_EXCHANGE] = expert_exchange_bytes(cfg, device.platform) / link
    dp = par.data * par.fsdp * par.context * par.expert  # gradients are reduced over every replica of a weight
    if dp > 1:
        link = _link(device, par.tensor * dp, _across(cfg, "data", "fsdp", "context"))
        out["data/FSDP collectives"] = _data_parallel_bytes(cfg, own, pipeline) / link
    if pipeline > 1:
        # a cell's time: its compute and the collectives inside it (the context exchange too)
        inside = (ATTENTION, EXPERTS, "tensor-parallel collectives", EXCHANGE)
        stage_work = out["compute"] + sum(out.get(k, 0.0) for k in inside)
        out |= _pipeline_parts(cfg, pipeline, interleave, stage_work, _link(device, n, _across(cfg, "stage")))
    return out


def _data_parallel_bytes(cfg: RunConfig, own: bool, pipeline: int) -> float:
    """Bytes one device sends per step reducing gradients (and gathering FSDP weights) over the data-like axes.
    MoE: the experts' weights are reduced over data x fsdp only, every other weight over `expert` too."""
    par = cfg.parallel
    params = sharded_params(cfg) if own else sharded_params(cfg) / pipeline
    experts = sharded_params(cfg, experts_only=True) * (params / sharded_params(cfg)) if cfg.model.moe else 0.0
    dense_dp = par.data * par.fsdp * par.context * par.expert
    return _reduce_bytes(cfg, own, params - experts, dense_dp) + _reduce_bytes(
        cfg, own, experts, dense_dp // par.expert
    )


def _reduce_bytes(cfg: RunConfig, own: bool, params: float, dp: int) -> float:
    """`_data_parallel_bytes` for `params` per device replicated over `dp` devices."""
    par, t = cfg.parallel, cfg.train
    if dp == 1 or params == 0:
        return 0.0
    replica = params * par.fsdp  # parameters of one tensor shard, summed over the data group
    if own:  # the executor all-reduces each backward tick's chunk gradients (fp32), m per step
        comm = t.microbatches * 2 * 4 * replica * (dp - 1) / dp
        if par.fsdp > 1:  # and gathers a stage's fp32 weights once per step
            comm += 4 * replica * (par.fsdp - 1) / par.fsdp
        return comm
    # fp32 gradients: all-reduce (2x a reduce-scatter) without FSDP, reduce-scatter with it
    comm = (2 if par.fsdp == 1 else 1) * 4 * replica * (dp - 1) / dp
    if par.fsdp > 1:  # FSDP re-gathers weights (compute dtype) forward and backward, per microbatch
        comm += 2 * t.microbatches * accounting.dtype_bytes(cfg.model.dtype) * replica * (par.fsdp - 1) / par.fsdp
    return comm


def _pipeline_parts(cfg: RunConfig, pipeline: int, interleave: int, stage_work: float, send_bw: float) -> dict:
    """The pipeline's idle time (`pipeline_overhead` of a stage's work), its sends and (a run's own: uneven
    or several chunks) the layers' regroup at `send_bw`: one derivation for roofline and calibrated time."""
    regroup = regroup_bytes(cfg, sharded_params) if cfg.parallel.stage > 1 else 0.0
    return {
        "pipeline bubble": pipeline_overhead(cfg, pipeline, interleave) * stage_work,
        "pipeline sends": pipeline_send_bytes(cfg, interleave) / send_bw,
    } | ({"layers' regroup": regroup / send_bw} if regroup else {})


@dataclass(frozen=True)
class Calibration:
    """Achieved (not datasheet) rates of one device kind in a Megatron-style run: dense GEMMs at
    `gemm_efficiency` of peak, tensor-parallel collectives at `tp_bandwidth` bytes/s per device
    (busbw, element-wise kernels folded in), pipeline sends over the inter-node link, and the
    optimizer update memory-bound at `hbm_bandwidth`."""

    gemm_efficiency: float
    tp_bandwidth: float
    hbm_bandwidth: float
    source: str


# A100 SXM4 80 GB: the two unknowns solved from P2 Table 4 (one 22B layer, s=2048, b=4, t=8, bf16):
# SP forward 7.2 ms and SP + selective forward+backward 20.3 ms = GEMM FLOPs / (312 TFLOP/s x e) +
# TP bytes / bw (tests/test_plan.py re-derives them); HBM from the datasheet (2,039 GB/s).
CALIBRATIONS = {
    "a100": Calibration(0.72, 124e9, 2.039e12, "P2 Table 4 (22B layer: SP forward 7.2 ms, SP+selective 20.3 ms)"),
}


def tp_layer_bytes(cfg: RunConfig, forward_only: bool = False) -> float:
    """Bytes one device sends in one layer's tensor-parallel collectives for one microbatch: per
    pass 2 all-reduces (TP: 2 x reduce-scatter + all-gather volume) or 2 all-gathers + 2
    reduce-scatters (SP) of s*b*h, ring cost (t-1)/t each; backward the same plus SP's 2 re-gathers."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    if par.tensor == 1:
        return 0.0
    b = t.global_batch // t.microbatches // par.batch_shards
    volume = t.seq_len // par.context * b * m.d_model * accounting.dtype_bytes(m.dtype) * (par.tensor - 1) / par.tensor
    forward = 4 * volume
    return forward if forward_only else forward + 4 * volume + (2 * volume if par.sequence_parallel else 0)


def _pipeline_shape(cfg: RunConfig, pipeline: int, interleave: int) -> tuple[bool, int, int, int]:
    """(own pipeline?, stages, virtual stages, devices in all): a run's own pipeline
    (`parallel.stage`) is part of its mesh; an explicit `pipeline` (P2's layouts) multiplies it."""
    par = cfg.parallel
    if par.stage > 1:
        return True, par.stage, par.virtual_stages, par.n_devices
    return False, pipeline, interleave, par.n_devices * pipeline


def calibrated_time(
    cfg: RunConfig,
    device: Accelerator,
    roofline: dict[str, float],
    pipeline: int = 1,
    interleave: int = 1,
    bytes_per_param: float = MESHLM_BYTES_PER_PARAM,
) -> dict | None:
    """Predicted seconds per step by part, from achieved rates (`CALIBRATIONS`) instead of the
    roofline: GEMMs at the calibrated efficiency (the output layer on the last pipeline stage's
    critical path); every collective of the roofline (`roofline`: tensor-parallel, context-parallel,
    data/FSDP, each at its own link) slowed by the calibrated link efficiency (achieved TP bandwidth
    / NVLink datasheet); the pipeline's idle time (`pipeline_overhead`) of a stage's work; pipeline
    sends (`pipeline_send_bytes`) over NVLink at that efficiency inside a node, else the inter-node
    link; the optimizer update memory-bound. Never faster than the roofline. None for an uncalibrated device kind.
    Checked against P2 Table 5 for its four models (tests/test_plan.py)."""
    cal = CALIBRATIONS.get(device.name)
    if cal is None:
        return None
    link_efficiency = cal.tp_bandwidth / device.intra_bw
    m, t = cfg.model, cfg.train
    own, pipeline, interleave, n = _pipeline_shape(cfg, pipeline, interleave)
    last_stage = n // pipeline
    rate = device_peak(device, cfg) * cal.gemm_efficiency
    logits = (4 if m.lora_rank else 6) * t.global_batch * t.seq_len * m.d_model * m.vocab_size  # LoRA: frozen
    layers = _hardware_flops(cfg) - logits - _own_rate_flops(cfg, roofline)
    out: dict[str, float] = {"GEMMs": layers / (n * rate)}
    out |= {part: flops * pipeline / (n * rate) for part, flops in stage_extra_flops(cfg).items()}
    for part in (ATTENTION, EXPERTS):  # at its kernel's own rate, as in the roofline
        if roofline.get(part):
            out[part] = roofline[part]
    tp = roofline.get("tensor-parallel collectives", 0.0) / link_efficiency
    if tp:
        out["tensor-parallel collectives"] = tp
    # the output layer: spread over every device without a pipeline, on the last stage's t devices with one
    out["output layer"] = logits / (last_stage * rate)
    if pipeline > 1:
        # inside one node over NVLink at the calibrated link efficiency, else over the network
        bw = (
            device.intra_bw * link_efficiency if n <= device.per_node and not _across(cfg, "stage") else device.inter_bw
        )
        work = out["GEMMs"] + out.get(ATTENTION, 0.0) + out.get(EXPERTS, 0.0) + tp
        out |= _pipeline_parts(cfg, pipeline, interleave, work, bw)
    for part in (EXCHANGE, EXPERT_EXCHANGE, "data/FSDP collectives"):
        if roofline.get(part):
            out[part] = roofline[part] / link_efficiency
    states = sharded_params(cfg, trainable=True) / (1 if own else pipeline)  # LoRA: the adapters alone
    out["optimizer update"] = 2 * bytes_per_param * states / cal.hbm_bandwidth  # read + write
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(
    cfg: RunConfig,
    n_devices: int,
    device: Accelerator,
    memory_limit: float | None = None,
    policies: tuple[str, ...] = ("elementwise", "selective", "full"),
) -> list[Plan]:
    """Every layout x SP x policy x microbatch count, feasible ones first (fastest first), then the
    rejected ones with their reason (those that do not fit: their memory, untimed). 1F1B with single
    ticks is weighed only where paired ticks do not fit but would without their activations: it is never
    faster (`pipeline_costs.pipeline_overhead`: (m - 1)(b - f) more, more sends), and it saves activations only."""
    plans, no_single = [], set()  # paired 1F1B configs whose single-tick twin cannot help
    limit = device.memory if memory_limit is None else memory_limit
    for c in _candidates(cfg, n_devices, policies):
        par = c.parallel
        one_f_one_b = par.stage > 1 and par.pipeline_schedule == "1f1b"
        if one_f_one_b and par.pipeline_ticks == "single" and _paired(c) in no_single:
            continue
        try:
            validate(c)
        except ConfigError as err:
            plans.append(Plan(c, rejected=str(err).split(";")[0]))
            if one_f_one_b:  # its single-tick twin fails the same way
                no_single.add(c)
            continue
        plan = estimate(c, device, memory_limit, time_unfit=False)  # most candidates of a big model do not fit
        plans.append(plan)
        floor = plan.total_memory - plan.memory["activations"]  # what single ticks cannot shrink
        if one_f_one_b and par.pipeline_ticks == "paired" and (not plan.rejected or floor > limit):
            no_single.add(c)
    # fastest first (calibrated where the device kind has rates, else roofline); equal times prefer
    # fewer microbatches (bigger GEMMs), then less memory
    plans.sort(
        key=lambda p: (
            bool(p.rejected),
            p.expected_time if not p.rejected else 0,
            p.cfg.train.microbatches,
            p.total_memory,
        )
    )
    return plans


def _paired(cfg: RunConfig) -> RunConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_ticks="paired"))


def _meshes(cfg: RunConfig, n_devices: int) -> list[dict[str, int]]:
    """Every factorisation of the device count over the mesh axes (context inside pipeline stages
    too); pipelines over `plannable_stages` of `schedules.pipeline_unit`'s units (an MoE model's dense
    first layers run with the embedding; none where no unit repeats). MoE: `expert` over the sizes
    that divide E, context dropless only."""
    m, out, unit = cfg.model, [], schedules.pipeline_unit(cfg.model)
    for stage in (p for p in _divisors(n_devices) if p == 1 or (unit and plannable_stages(unit.count, p))):
        for tensor in _divisors(n_devices // stage):
            rest = n_devices // stage // tensor
            experts = [e for e in _divisors(rest) if m.n_experts % e == 0] if m.moe else [1]
            for expert in experts:
                contexts = _divisors(rest // expert) if not (m.moe and m.expert_capacity_factor) else [1]
                for context in contexts:
                    for fsdp in _divisors(rest // expert // context):
                        data = rest // expert // context // fsdp
                        out.append(dict(zip(MESH_AXES, (stage, data, fsdp, expert, context, tensor), strict=True)))
    return out


def _candidates(cfg: RunConfig, n_devices: int, policies: tuple[str, ...]):
    """The configs `enumerate_plans` weighs, unvalidated: mesh factorisations x attention kernel x
    SP x pipeline schedule x remat policy x microbatch count."""
    # explicit attention stores (causal blocks of) the s x s scores: offer blockwise next to it (CP needs it)
    kernels = ("explicit", "blockwise") if cfg.model.attention == "explicit" else (cfg.model.attention,)
    for sizes in _meshes(cfg, n_devices):
        # the three context strategies (all_to_all, where the heads divide, runs any kernel; the others blockwise)
        strategies = CONTEXT_STRATEGIES if sizes["context"] > 1 else (cfg.parallel.context_strategy,)
        for kernel, strategy in itertools.product(kernels, strategies):
            if sizes["context"] > 1 and kernel == "explicit" and strategy != "all_to_all":
                continue
            model = dataclasses.replace(cfg.model, attention=kernel)
            # the O(s) kernels store no scores: `selective` runs as `elementwise` (one row for both)
            pols = policies if kernel == "explicit" else tuple(p for p in policies if p != "selective") or policies
            for sp, (schedule, v, ticks) in itertools.product(
                (False, True) if sizes["tensor"] > 1 else (False,), pipeline_schedules(cfg, sizes["stage"])
            ):
                par = dataclasses.replace(
                    cfg.parallel,
                    **sizes,
                    sequence_parallel=sp,
                    pipeline_schedule=schedule,
                    virtual_stages=v,
                    pipeline_ticks=ticks,
                    context_strategy=strategy,
                )
                # ZeRO-1 where the weights are replicated over data or context (fsdp shards the moments already)
                zero1 = (False, True) if sizes["data"] * sizes["context"] > 1 else (False,)
                for policy, k, shard in itertools.product(pols, _divisors(cfg.train.global_batch), zero1):
                    train = dataclasses.replace(cfg.train, microbatches=k)
                    run = dataclasses.replace(par, shard_optimizer=shard)
                    remat = dataclasses.replace(cfg.remat, policy=policy)
                    yield dataclasses.replace(cfg, model=model, parallel=run, remat=remat, train=train)
