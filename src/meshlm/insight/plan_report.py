"""What the planner says: its ranked table, its JSON, why the best plan splits the sequence (or
not), the closest miss when nothing fits, and a compile of the best plan on simulated devices.
The arithmetic is `plan`'s."""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from meshlm import accounting
from meshlm.axes import MESH_AXES
from meshlm.config import RunConfig
from meshlm.insight.attention_rates import attention_kernel, expert_kernel_rate
from meshlm.insight.plan import (
    CALIBRATIONS,
    CONTEXT_STRATEGIES,
    EXCHANGE,
    EXPERT_EXCHANGE,
    GiB,
    Plan,
    device_peak,
    estimate,
)
from meshlm.model.mla_costs import cache_bytes_per_token, cache_values_per_token
from meshlm.model.moe_costs import EXCHANGE_OP, expert_capacity
from meshlm.platform.hardware import Accelerator, matmul_precision


def explain_choice(plans: list[Plan]) -> str | None:
    """Why the best plan does or does not split the sequence over `context` (None when no plan
    with context > 1 was possible and none was chosen)."""
    feasible = [p for p in plans if not p.rejected]
    if not feasible:
        return None
    best = feasible[0]
    flat = [p for p in feasible if p.cfg.parallel.context == 1]
    split = [p for p in feasible if p.cfg.parallel.context > 1]
    s = best.cfg.train.seq_len
    if best.cfg.parallel.context > 1:
        c = best.cfg.parallel.context
        act = best.memory["activations"]
        if not flat:
            sized = [p for p in plans if p.memory and p.cfg.parallel.context == 1]
            need = min((p.total_memory for p in sized), default=0.0)
            return (
                f"context={c}: at s={s} no layout without context parallelism fits"
                + (f" (the closest needs {need / GiB:.1f} GiB per device)" if need else "")
                + f"; splitting the sequence {c} ways leaves {act / GiB:.1f} GiB of activations per device"
            )
        other = flat[0]
        parts = other.calibrated or other.time
        costs = {k: v for k, v in parts.items() if k not in ("compute", "GEMMs")}
        if other.cfg.remat.policy == "full":
            why = "it recomputes every layer in backward"
        elif costs:
            part, seconds = max(costs.items(), key=lambda kv: kv[1])
            why = f"its {part} take {seconds / other.expected_time:.0%} of the step"
        else:
            why = "it runs more GEMM FLOPs"
        hidden = "; the ring's K/V hops hide behind attention" if best.cfg.parallel.context_strategy == "ring" else ""
        return (
            f"context={c}: at s={s} it is {other.expected_time / best.expected_time:.2f}x faster than the best layout "
            f"without it ({other.describe()}: {why}){hidden}"
        )
    if split:
        ratio = split[0].expected_time / best.expected_time
        pace = "as fast" if ratio < 1.0005 else f"{ratio:.3f}x slower"
        rows = best.cfg.parallel.batch_shards
        instead = f"; the batch splits over data x fsdp = {rows} instead" if rows > 1 else ""
        return f"no context parallelism: at s={s} the best layout with it ({split[0].describe()}) is {pace}{instead}"
    return None


def _exchange_note(device: Accelerator) -> str:
    """How the grouped exchange moves its rows on `device` (`moe_costs.EXCHANGE_OP`)."""
    if EXCHANGE_OP[device.platform] == "ragged":
        return (
            " (the grouped exchange sends the routed rows by ragged_all_to_all: priced so, but meshlm has not "
            "run it across devices)"
        )
    return " (the grouped exchange sends worst-case buffers, `expert` x the routed rows)"


def explain_experts(plans: list[Plan], device: Accelerator) -> str | None:
    """MoE: the expert kernel the plans price and at what rate, and why the best plan does or does
    not shard the experts over `expert` (against the best plan of the other kind)."""
    feasible = [p for p in plans if not p.rejected]
    if not feasible or not feasible[0].cfg.model.moe:
        return None
    best = feasible[0]
    m, par, t = best.cfg.model, best.cfg.parallel, best.cfg.train
    s = t.seq_len // par.context
    kernel, rate = expert_kernel_rate(best.cfg, device)
    if kernel == "buffers":
        said = [f"experts: capacity buffers (E x C slots per row, C = {expert_capacity(m, s)}) at the GEMM rate"]
    elif rate.fraction is not None:
        said = [
            f"experts: dropless, grouped GEMMs ({kernel} on {device.platform}) over the routed rows and their tile "
            f"padding, at {rate.fraction:.0%} of peak ({rate.source})"
        ]
    else:
        said = [
            f"experts: dropless, grouped GEMMs ({kernel} on {device.platform}) over the routed rows and their tile "
            f"padding, at the GEMM rate ({rate.source}; unmeasured: meshlm has not run it on {device.name}"
            + (
                "; whether XLA:GPU lowers ragged_dot to a grouped GEMM is unverified)"
                if kernel == "ragged_dot"
                else ")"
            )
        ]
    rivals = [p for p in feasible if (p.cfg.parallel.expert > 1) != (par.expert > 1)]
    if rivals:
        other = rivals[0]
        mine, theirs = best.calibrated or best.time, other.calibrated or other.time
        part, extra = max(((k, v - mine.get(k, 0.0)) for k, v in theirs.items()), key=lambda kv: kv[1])
        with_it = "with" if par.expert == 1 else "without"
        said.append(
            f"{'no expert parallelism' if par.expert == 1 else f'expert={par.expert}'}: the best layout {with_it} it "
            f"({other.describe()}) takes {other.expected_time / best.expected_time:.3f}x the time, its {part} "
            f"{extra:.3g} s more" + (_exchange_note(device) if part == EXPERT_EXCHANGE else "")
        )
    if par.expert > 1 and kernel != "buffers":
        said.append(f"expert={par.expert}'s all_to_all{_exchange_note(device)}")
    return "; ".join(said)


# layouts the models' own authors trained them on, printed beside meshlm's plans
PUBLISHED = {
    "deepseek-v3": "DeepSeek-V3's own layout (V3 3.2): 2048 H800s, PP16 (DualPipe) x EP64 over 8 nodes x ZeRO-1 "
    "data parallel, no tensor parallelism, FP8 GEMMs; meshlm's stages split the 58 MoE layers after the 3 dense "
    "ones (which run with the embedding) over 16 in uneven chunks of 3 and 4 (checked at small scale), but "
    "DualPipe and FP8 training are not built",
}


def decoding_cache(cfg: RunConfig) -> str:
    """The decoding cache per token (all layers, compute dtype): MLA's latent, else the KV heads'."""
    m = cfg.model
    size = cache_bytes_per_token(m, accounting.dtype_bytes(m.dtype))
    what = (
        f"MLA's latent, {m.kv_lora_rank} + {m.qk_rope_head_dim} values"
        if m.mla
        else f"keys and values of {m.kv_heads} KV heads, {cache_values_per_token(m)} values"
    )
    return f"decoding cache: {size:,} bytes per token ({what} per layer, {m.dtype})"


def explain_context_strategy(plans: list[Plan]) -> str | None:
    """Why the best plan's context strategy, against the best plan of each other strategy: what each
    receives per device per step and how long its exchange shows in the step (None without CP).
    The ring hides its hops behind the attention they feed and wins while that attention is long
    enough; all_to_all's volume falls as context grows (ring's and all_gather's grow) and it runs
    any kernel, but needs the heads to divide by context x tensor; all_gather is the simplest."""
    feasible = [p for p in plans if not p.rejected]
    if not feasible or feasible[0].cfg.parallel.context == 1:
        return None
    best = feasible[0]
    mib = lambda p: sum(accounting.context_comm_bytes(p.cfg).values()) / 2**20
    shown = lambda p: (p.calibrated or p.time).get(EXCHANGE, 0.0)
    said = [
        f"context_strategy={best.cfg.parallel.context_strategy}: receives {mib(best):,.0f} MiB per device per step, "
        f"{shown(best) * 1e3:.3g} ms of it in the step"
    ]
    for strategy in (s for s in CONTEXT_STRATEGIES if s != best.cfg.parallel.context_strategy):
        rivals = [p for p in feasible if p.cfg.parallel.context > 1 and p.cfg.parallel.context_strategy == strategy]
        refused = [
            p
            for p in plans
            if p.rejected and p.cfg.parallel.context > 1 and p.cfg.parallel.context_strategy == strategy
        ]
        if rivals:
            r = rivals[0]
            said.append(
                f"{strategy} at best ({r.describe()}) {r.expected_time / best.expected_time:.3g}x the time, "
                f"{mib(r):,.0f} MiB, {shown(r) * 1e3:.3g} ms"
            )
        elif refused:
            said.append(f"{strategy} refused ({refused[0].rejected})")
    return "; ".join(said)


def explain_optimizer(plans: list[Plan]) -> str | None:
    """Why the best plan shards the optimizer state (ZeRO-1) or the weights too (FSDP), against the
    best plan of the other kind (None when the best plan uses neither)."""
    feasible = [p for p in plans if not p.rejected]
    if not feasible:
        return None
    best = feasible[0]
    par = best.cfg.parallel
    zero1 = [p for p in feasible if p.cfg.parallel.shard_optimizer]
    fsdp = [p for p in feasible if p.cfg.parallel.fsdp > 1 and not p.cfg.parallel.shard_optimizer]
    mem = lambda p: f"{p.total_memory / GiB:.1f} GiB"
    if par.shard_optimizer:
        other = (
            f"; the best FSDP layout ({fsdp[0].describe()}, {mem(fsdp[0])}) takes {fsdp[0].expected_time:.4g} s"
            if fsdp
            else ""
        )
        return (
            f"ZeRO-1: Adam's moments sharded over the data-parallel axes ({mem(best)} per device), the weights "
            f"gathered once per step ({best.expected_time:.4g} s; its reduce-scatter + all-gather priced as the "
            f"all-reduce they replace), where FSDP regathers them in every microbatch's forward and backward "
            f"(once per step in meshlm's pipeline){other}"
        )
    if par.fsdp > 1 and zero1:
        return (
            f"FSDP: the best ZeRO-1 layout ({zero1[0].describe()}) needs {mem(zero1[0])} per device and takes "
            f"{zero1[0].expected_time:.4g} s; sharding the weights and gradients too fits in {mem(best)}"
        )
    return None


def closest_miss(cfg: RunConfig, plans: list[Plan], n_devices: int, device: Accelerator, limit: float) -> str:
    """For a request nothing satisfies: the plan needing least memory, and what would make it fit."""
    sized = [p for p in plans if p.memory]
    if not sized:
        return "no layout of this model divides over these devices: " + "; ".join(
            sorted({p.rejected for p in plans})[:3]
        )
    best = min(sized, key=lambda p: p.total_memory)
    need = best.total_memory
    hints = [f"{need / GiB:.1f} GiB per device (limit {limit / GiB:.1f} GiB)"]
    hints.append(f"about {math.ceil(n_devices * need / limit)} devices at this memory")
    seq = cfg.train.seq_len
    while seq > 128:
        seq //= 2
        shorter = dataclasses.replace(best.cfg, train=dataclasses.replace(best.cfg.train, seq_len=seq))
        if estimate(shorter, device, limit, time_unfit=False).total_memory <= limit:
            hints.append(f"or train.seq_len={seq}")
            break
    return f"nothing fits; closest: {best.describe()} needs " + ", ".join(hints)


def format_plans(plans: list[Plan], top: int, device: Accelerator, limit: float) -> list[str]:
    feasible = [p for p in plans if not p.rejected]
    links = f"links {device.intra_bw / 1e9:.0f} / {device.inter_bw / 1e9:.0f} GB/s"
    dtype = plans[0].cfg.model.dtype
    peak = f"{device_peak(device, plans[0].cfg) / 1e12:.1f} TFLOP/s, {matmul_precision(dtype, device.platform)}"
    lines = [
        f"{len(feasible)} of {len(plans)} layouts fit {limit / GiB:.0f} GiB on {device.name} "
        f"(peak {peak} matmuls; {links}); MFU here is the roofline bound",
        f"{'#':>3}  {'layout':68s} {'attention':>30s} {'memory GiB':>10s} {'step s':>9s} {'MFU':>6s}  time split",
    ]
    kernels = {attention_kernel(p.cfg, device) for p in feasible[:top]}
    lines[1:1] = [
        f"attention {k.name}: {'the GEMM rate' if k.rate.fraction is None else f'{k.rate.fraction:.0%} of peak'} "
        f"({k.rate.source}){'' if k.measured else f'; unmeasured: meshlm has not run it on {device.name}'}"
        for k in sorted(kernels, key=lambda k: k.name)
    ]
    calibrated = any(p.calibrated for p in feasible[:top])
    if calibrated:
        cal = CALIBRATIONS[device.name]
        lines[1] = lines[1].replace("  time split", f" {'calib. s':>9s} {'MFU':>6s}  time split")
        lines.insert(1, f"calibrated columns: achieved rates from {cal.source}; 'step s' / first MFU: roofline")
    lines.insert(1, "MFU: model FLOPs with causal attention's masked half not counted (P2 Eq. 7 counts s x s)")
    for i, p in enumerate(feasible[:top], 1):
        split = ", ".join(f"{k} {v / p.step_time:.0%}" for k, v in p.time.items())
        kernel = attention_kernel(p.cfg, device).label()
        row = f"{p.describe():68s} {kernel:>30s} {p.total_memory / GiB:10.2f} {p.step_time:9.4f} {p.mfu:6.1%}"
        if calibrated:
            seconds = sum(p.calibrated.values())
            mfu = p.mfu * p.step_time / seconds
            row += f" {seconds:9.4f} {mfu:6.1%}"
            split = ", ".join(f"{k} {v / seconds:.0%}" for k, v in p.calibrated.items())
        lines.append(f"{i:>3}  {row}  {split}")
    groups: dict[str, list[Plan]] = {}
    for p in plans:
        if p.rejected:
            key = "does not fit" if p.rejected.startswith("needs") else re.sub(r"\d+", "N", p.rejected)
            groups.setdefault(key, []).append(p)
    if groups:
        lines.append("rejected (count x reason, with one example):")
        for group in sorted(groups.values(), key=len, reverse=True):
            example = min(group, key=lambda p: p.total_memory)  # for memory misses: the closest
            lines.append(f"  {len(group):5d} x {example.describe()}: {example.rejected}")
    return lines


def to_json(plans: list[Plan], device: Accelerator, verified: str | None = None) -> dict:
    def one(p: Plan) -> dict:
        par = p.cfg.parallel
        return {axis: getattr(par, axis) for axis in MESH_AXES} | {
            "shard_optimizer": par.shard_optimizer,
            "offload_state": p.cfg.optim.offload_state,
            "pipeline_schedule": par.pipeline_schedule if par.stage > 1 else None,
            "pipeline_ticks": par.pipeline_ticks if par.stage > 1 else None,
            "context_strategy": par.context_strategy if par.context > 1 else None,
            "attention": p.cfg.model.attention,
            "attention_kernel": dataclasses.asdict(attention_kernel(p.cfg, device)),
            "sequence_parallel": par.sequence_parallel,
            "remat": p.cfg.remat.policy,
            "loss_chunks": p.cfg.remat.loss_chunks,
            "microbatches": p.cfg.train.microbatches,
            "memory_bytes": p.memory,
            "total_memory_bytes": p.total_memory,
            "step_time_s": p.time,
            "calibrated_step_time_s": p.calibrated,
            "mfu": p.mfu,
            "rejected": p.rejected,
        }

    return {"plans": [one(p) for p in plans], "verified": verified}


def verify(feasible: list[Plan]) -> str:
    """Compile the best plan with 2 layers on simulated devices; compare stored activations with
    the prediction. The measurement is of one unpipelined forward/backward, so a pipelined best
    plan is not compiled here (tests/test_pipeline.py measures stage 0 against its formula): the
    best plan without a pipeline is verified instead, and the answer says so."""
    from meshlm.insight.memory import measure_activations
    from meshlm.parallel.mesh import make_layout

    plan, note = feasible[0], ""
    if plan.cfg.parallel.stage > 1:
        flat = [p for p in feasible if p.cfg.parallel.stage == 1]
        if not flat:
            return "verify: every feasible plan is pipelined; their memory is checked by tests, not compiled here"
        plan, note = flat[0], " (the best plan is pipelined: verified the best one without a pipeline)"

    n = plan.cfg.parallel.n_devices
    if n > len(jax.devices()):
        return f"verify: the plan needs {n} devices, {len(jax.devices())} are simulated here; not compiled"
    one_slice = {f"dcn_{axis}": 1 for axis, ways in plan.cfg.parallel.dcn.items() if ways > 1}  # devices here
    small = dataclasses.replace(
        plan.cfg,
        model=accounting.with_layers(plan.cfg.model, 2),
        parallel=dataclasses.replace(plan.cfg.parallel, **one_slice),
    )
    measured = measure_activations(small, make_layout(small.parallel, jax.devices()[:n])).activation_bytes
    predicted = accounting.activation_memory(small)["total"]
    return (
        f"verify ({plan.describe()}, 2 layers, compiled on {n} simulated devices): activations measured "
        f"{measured / 2**20:.2f} MiB vs predicted {predicted / 2**20:.2f} MiB (ratio {measured / predicted:.3f}){note}"
    )
