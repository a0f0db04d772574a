"""What a pipeline adds to a step, for the planner (`insight.plan`): its idle time as a fraction of
a stage's work, the bytes its sends carry, and the schedules weighed for a layout. Pure arithmetic
on the config and the schedule tables (`parallel.schedules`); nothing is compiled."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from meshlm import accounting
from meshlm.config import ParallelConfig, RunConfig
from meshlm.parallel.schedules import built as _schedule
from meshlm.parallel.schedules import pad_count, pipeline_unit, runs_unbranched, staged_units


def pipeline_send_bytes(cfg: RunConfig, interleave: int = 1) -> float:
    """Bytes one device sends per step between pipeline stages. Megatron (an explicit `pipeline`):
    an activation forward and a cotangent backward per microbatch and chunk, 1/t of each
    (scatter-gather). meshlm's executor (`parallel.stage`): both directions on every tick, idle ones
    included (a filler), each device its own copy of the [b, s, d] activation (1/t under SP; a context
    rank's 1/c of the sequence)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    b = t.global_batch // t.microbatches // par.batch_shards
    activation = t.seq_len // par.context * b * m.d_model * accounting.dtype_bytes(m.dtype)
    if par.stage > 1:
        shape = (par.pipeline_schedule, par.stage, t.microbatches, par.virtual_stages, par.pipeline_ticks)
        ticks = _schedule(*shape).ticks
        return 2 * ticks * activation / (par.tensor if par.sequence_parallel else 1)
    return 2 * t.microbatches * interleave * activation / par.tensor


# A step's FLOPs do not depend on how its layers are scheduled over the stages or on where the
# optimizer's moments live, so the planner's candidates, which differ in those fields by the
# hundred thousand, share them (`per_flops_key`; tests/test_plan.py checks the fields are free).
SCHEDULING = ("pipeline_schedule", "virtual_stages", "pipeline_ticks", "shard_optimizer")
_FLOP_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.name not in SCHEDULING)


def per_flops_key(fn):
    """`fn(cfg)`, a function of the step's FLOPs, remembered per config less its `SCHEDULING` fields
    (for the process: a test that patches what the counts read calls `cache_clear()` after)."""
    memo: dict = {}

    @functools.wraps(fn)
    def remembered(cfg: RunConfig):
        par = cfg.parallel
        key = (cfg.model, cfg.remat, cfg.train, cfg.data, tuple(getattr(par, f) for f in _FLOP_FIELDS))
        if key not in memo:
            if len(memo) >= 1 << 16:
                memo.clear()
            memo[key] = fn(cfg)
        return memo[key]

    remembered.cache_clear = memo.clear
    return remembered


@per_flops_key
def backward_over_forward(cfg: RunConfig) -> float:
    """What the layers' backward costs against their forward under the run's remat policy: 2 (the
    two gradient GEMMs per forward one; 1 with LoRA, whose frozen weights get no weight gradient
    and whose adapters' GEMMs are small) plus what the policy recomputes over the layers' forward
    FLOPs (the output layer is left out: it runs once, on the last stage) - 2 with nothing
    recomputed, about 3 with `full`."""
    m, t = cfg.model, cfg.train
    logits = 2 * t.global_batch * t.seq_len * m.d_model * m.vocab_size * (1 + m.mtp_depth)
    # every forward GEMM once
    dense = dataclasses.replace(cfg, model=dataclasses.replace(m, lora_rank=0)) if m.lora_rank else cfg
    layers = accounting.forward_flops_per_step(dense) - logits
    return (1.0 if m.lora_rank else 2.0) + accounting.recompute_flops_per_step(cfg) / layers


FIRST_LAYERS = "dense first layers on stage 0"  # the planner's parts for `stage_extra_flops`
MTP_MODULES = "MTP modules on the last stage"
PAD_SLOTS = "pad slots of uneven stages"


def stage_extra_flops(cfg: RunConfig) -> dict[str, float]:
    """FLOPs per step that one stage runs beyond an even share of the step's, by part; time on that
    stage's devices: this x p / (devices x rate). A run's own pipeline runs on stage 0 an MoE model's
    dense first layers (`model.first_k_dense`) with the embedding: forward, again in the first
    chunk's backward (`pipeline._Stage.embed`), and backward - (2 + b/f) x their forward FLOPs
    (b/f: `backward_over_forward`), of which the even share holds (1 + b/f)/p. On the last chunk's
    stage, the MTP modules (`model.mtp_depth`) with the loss: (1 + b/f)(1 - 1/p) x their forward
    FLOPs (their layers' and output layers'). In lockstep the two stages' extras fall in the same
    ticks (a steady tick runs chunk 0 on stage 0 and the last chunk on the last stage), so the step
    pays the larger: the MTP part is what it adds beyond the dense layers' (absent when not more).
    Stages of uneven layer counts (`schedules.chunk_layers`) run ceil(L/(pv)) slots a chunk on every
    stage, pads (zero-weight layers, or units of them: `schedules.pipeline_unit`) included:
    (pv ceil(L/(pv)) - L)/p x (1 + b/f) x a slot's forward FLOPs (the pads' collectives: `pad_slots`).
    All at the GEMM rate. {} without a pipeline."""
    if cfg.parallel.stage == 1:
        return {}
    out = _prefix_and_mtp_flops(cfg)
    if pads := pad_slots(cfg):
        out = out | {PAD_SLOTS: _slot_forward_flops(cfg) * (1 + backward_over_forward(cfg)) * pads / cfg.parallel.stage}
    return out


def plannable_stages(layers: int, stages: int) -> bool:
    """Whether the planner weighs `stages` for `layers` (those the stages split): each stage a layer
    at least, and uneven stages' pads at most 1/8 of them (96 layers over 64 stages would run 128
    slots; such a layout can still be configured)."""
    return layers >= stages and 8 * pad_count(layers, stages) <= layers


def pad_slots(cfg: RunConfig, layers: bool = False) -> int:
    """Uneven stages' pad slots (`schedules.chunk_layers`): p v ceil(L/(pv)) - L; each runs as a layer,
    or a unit of layers (`schedules.pipeline_unit`; `layers`: their layers)."""
    pads = pad_count(staged_units(cfg.model), cfg.parallel.stage * cfg.parallel.virtual_stages)
    return pads * len(pipeline_unit(cfg.model).kinds) if layers and pads else pads


def regroup_bytes(cfg: RunConfig, sharded_params: Callable) -> float:
    """Bytes one device sends per step regrouping a pipeline's stored layers into its chunks' order
    (`stage_layout.regroup_stored`): none for even stages of one chunk each. Uneven stages (one
    all_to_all over `stage` per weight) and interleaved or ZB-V chunks (GSPMD's regroup) move (p - 1)/p
    of a device's fp32 share of the staged layers (`sharded_params`: `insight.plan`'s) and of their pad
    slots, and as much of the trained ones' gradients back. The compiled step's all_to_all bytes equal
    it for uneven stages and for interleaving on 2 stages (tests/test_pipeline.py); on more stages and
    for ZB-V GSPMD adds collective-permutes (a lower bound there)."""
    par, pads = cfg.parallel, pad_slots(cfg)
    if not pads and par.virtual_stages == 1:
        return 0.0
    layers = sum(sharded_params(cfg, part="layers", trainable=t) for t in (False, True))  # weights, gradients
    return 4 * (par.stage - 1) / par.stage * (1 + pads / staged_units(cfg.model)) * layers


@per_flops_key
def _slot_forward_flops(cfg: RunConfig) -> float:
    """One pipeline slot's forward FLOPs per step: a staged layer's (an MoE model's: an MoE layer), or
    a unit's dense and MoE layers (`schedules.pipeline_unit`)."""
    m, t = cfg.model, cfg.train
    kinds, logits = accounting.layer_kinds(m), 2 * t.global_batch * t.seq_len * m.d_model * m.vocab_size
    one = lambda k: dataclasses.replace(k, n_layers=1, mtp_depth=0)
    layer = [accounting.forward_flops_per_step(dataclasses.replace(cfg, model=one(k))) - logits for k, _ in kinds]
    return sum(layer[i] for i in accounting.unit_kinds(m))


@per_flops_key
def _prefix_and_mtp_flops(cfg: RunConfig) -> dict[str, float]:
    m, par, t = cfg.model, cfg.parallel, cfg.train
    ratio, out = backward_over_forward(cfg), {}
    if k := pipeline_unit(m).prefix:
        dense = accounting.layer_kinds(m)[1][0]
        prefix = dataclasses.replace(dense, n_layers=k, mtp_depth=0)
        logits = 2 * t.global_batch * t.seq_len * m.d_model * m.vocab_size
        forward = accounting.forward_flops_per_step(dataclasses.replace(cfg, model=prefix)) - logits
        out[FIRST_LAYERS] = forward * (2 + ratio - (1 + ratio) / par.stage)
    if m.mtp_depth:
        without = dataclasses.replace(cfg, model=dataclasses.replace(m, mtp_depth=0))
        forward = accounting.forward_flops_per_step(cfg) - accounting.forward_flops_per_step(without)
        beyond = forward * (1 + ratio) * (1 - 1 / par.stage) - out.get(FIRST_LAYERS, 0.0)
        out |= {MTP_MODULES: beyond} if beyond > 0 else {}
    return out


def pipeline_overhead(cfg: RunConfig, pipeline: int, interleave: int = 1) -> float:
    """Time a pipeline adds, as a fraction of a stage's work. Megatron's asynchronous schedules (an
    explicit `pipeline`): the bubble (p-1)/(v m). meshlm's executor (`parallel.stage`) runs in
    lockstep, every tick as long as its slowest cell: the schedule table's lockstep overhead with
    the policy's backward/forward ratio (`backward_over_forward`; zb1's W a forward's GEMMs). Paired
    GPipe, 1F1B and interleaved lose the textbook bubble whatever that ratio (a steady tick pairs a
    forward with a backward); zb1 a third of 1F1B's with B and W a forward each and m >= 2p - 1.
    Single ticks (`pipeline_ticks=single`) last their slowest stage's action: 1F1B p f + (2m + p -
    2) b, zb1 ZB-H1's bubble when F, B and W cost the same. With the ring inside the stages every
    tick runs a backward and a forward (`Schedule.lockstep_time`'s `unbranched`)."""
    par, micro = cfg.parallel, cfg.train.microbatches
    if par.stage == 1:
        return (pipeline - 1) / (interleave * micro)
    ratio = round(backward_over_forward(cfg), 3)  # a few distinct values: the cache below stays small
    shape = (par.pipeline_schedule, par.stage, micro, par.virtual_stages, par.pipeline_ticks)
    return _overhead(*shape, ratio, runs_unbranched(par))


@functools.lru_cache(maxsize=2048)
def _overhead(name: str, stages: int, micro: int, virtual: int, ticks: str, ratio: float, unbranched: bool) -> float:
    schedule = _schedule(name, stages, micro, virtual, ticks)
    return schedule.lockstep_overhead(ratio, 1.0 if schedule.splits_backward else None, unbranched)


MAX_INTERLEAVE = 4  # virtual stages the planner tries (P2 ran 175B and 530B with 3)


def pipeline_schedules(cfg: RunConfig, stages: int) -> list[tuple[str, int, str]]:
    """The pipeline schedules weighed for `stages`, as (schedule, virtual stages, ticks): 1F1B and zb1
    with paired and with single ticks (paired: 2(p-s)-1 in flight; single: Megatron's p - s, 1F1B
    slower in lockstep when a backward outweighs a forward), paired before single (`enumerate_plans`
    prunes single-tick 1F1B by its paired twin's plan); zb1 (a third of 1F1B's bubble when B and W
    each cost a forward, for its weight slots' memory; not for MoE, whose W defers the attention's
    weights only, so that price would flatter it); interleaved with v = 2 .. MAX_INTERLEAVE chunks
    per stage where the layers split into p v chunks; ZB-V (single ticks, two chunks per stage in a
    V; not for MoE). GPipe is not: in lockstep it takes 1F1B's time and holds m microbatches in
    flight; the microbatch counts interleaving refuses are refused by validation."""
    if stages == 1:
        return [("1f1b", 1, "paired")]
    interleaved = [
        ("interleaved", v, "paired")
        for v in range(2, MAX_INTERLEAVE + 1)
        if staged_units(cfg.model) % (stages * v) == 0
    ]
    flat = [("1f1b", 1)] + ([] if cfg.model.moe else [("zb1", 1)])
    zbv = [("zbv", 2, "single")] if not cfg.model.moe and staged_units(cfg.model) % (2 * stages) == 0 else []
    return [(name, v, ticks) for name, v in flat for ticks in ("paired", "single")] + interleaved + zbv
