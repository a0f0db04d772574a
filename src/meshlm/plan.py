"""Choose a mesh, sequence parallelism, recomputation and microbatch for a device budget.

For every factorisation data x fsdp x tensor of the device count, SP on/off, remat policy and
gradient-accumulation count, predict per-device memory (parameters, gradients and optimizer state
from the exact shardings; activations from `accounting.activation_memory`; FSDP's gathered layer
weights) and step time from a roofline (GEMMs at peak, plus tensor-parallel and data/FSDP
collectives at the device kind's link bandwidths, not overlapped), then rank the layouts that fit.

Pure arithmetic on the config: nothing is compiled unless `verify` is asked for.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import jax

from meshlm import accounting
from meshlm.config import ConfigError, ParallelConfig, RematConfig, RunConfig, validate
from meshlm.hardware import Accelerator, matmul_precision, peak_for
from meshlm.model.params import ParamSpec, param_specs
from meshlm.parallel.mesh import abstract_layout

GiB = 2**30


def device_peak(device: Accelerator, cfg: RunConfig) -> float:
    """Peak FLOP/s per device for this config's compute dtype (fp32 runs at TF32 / one bf16 pass
    by default: `hardware.matmul_precision`)."""
    return peak_for(device, matmul_precision(cfg.model.dtype, device.platform))


# meshlm keeps fp32 master weights, fp32 gradients and AdamW's two fp32 moments: 16 bytes per
# parameter. (Megatron's mixed-precision Adam, P2's setting, is 18.)
MESHLM_BYTES_PER_PARAM = 16


@dataclass
class Plan:
    cfg: RunConfig
    pipeline: int = 1
    memory: dict[str, float] = field(default_factory=dict)  # bytes per device by category
    time: dict[str, float] = field(default_factory=dict)  # seconds per step by part
    mfu: float = 0.0
    rejected: str = ""  # why it does not fit or cannot run; empty when feasible

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    def describe(self) -> str:
        p, r = self.cfg.parallel, self.cfg.remat.policy
        sp = "+SP" if p.sequence_parallel else ""
        pp = f" pipe={self.pipeline}" if self.pipeline > 1 else ""
        return f"data={p.data} fsdp={p.fsdp} tensor={p.tensor}{sp}{pp} remat={r} micro={self.cfg.train.microbatches}"


def sharded_params(cfg: RunConfig) -> float:
    """Parameters one device holds, from the rules table and the mesh sizes (exact): the same
    `Layout.sharding` the trainer uses, over an abstract mesh (no devices needed)."""
    layout = abstract_layout(cfg.parallel)
    specs = jax.tree.leaves(param_specs(cfg.model), is_leaf=lambda x: isinstance(x, ParamSpec))
    return float(sum(math.prod(layout.sharding(s.axes).shard_shape(s.shape)) for s in specs))


def estimate(
    cfg: RunConfig,
    device: Accelerator,
    memory_limit: float | None = None,
    *,
    pipeline: int = 1,
    interleave: int = 1,
    bytes_per_param: float = MESHLM_BYTES_PER_PARAM,
) -> Plan:
    """Predicted memory and step time of one layout. With `pipeline` > 1 (P2's Table 3 layouts;
    meshlm itself does not pipeline) states are split p ways and activations follow P2's
    first-stage formula."""
    plan = Plan(cfg, pipeline)
    limit = device.memory if memory_limit is None else memory_limit
    m, par, t = cfg.model, cfg.parallel, cfg.train
    e = accounting.dtype_bytes(m.dtype)
    act = accounting.activation_memory(cfg, pipeline=pipeline, interleave=interleave)
    params = sharded_params(cfg) / pipeline
    plan.memory["parameters, gradients, optimizer"] = bytes_per_param * params
    plan.memory["activations"] = act["total"]
    if par.fsdp > 1:  # one layer's weights gathered in the compute dtype, forward and backward
        layer = accounting.param_count(dataclasses.replace(m, n_layers=1)) - accounting.param_count(
            dataclasses.replace(m, n_layers=0)
        )
        plan.memory["FSDP gathered weights"] = 2 * layer / par.tensor * e

    n = par.n_devices * pipeline
    peak = device_peak(device, cfg)
    plan.time["compute"] = accounting.hardware_flops_per_step(cfg) / (n * peak)
    b = t.global_batch // t.microbatches // par.batch_shards
    group_bw = device.intra_bw if par.tensor <= device.per_node else device.inter_bw
    if par.tensor > 1:
        # per layer: 4 all-reduces (TP) or 4 all-gathers + 4 reduce-scatters (SP, same bytes) of
        # s*b*h, plus SP's 2 backward re-gathers; ring cost (t-1)/t per gather or scatter
        volume = t.seq_len * b * m.d_model * e * (par.tensor - 1) / par.tensor
        per_layer = (8 + (2 if par.sequence_parallel else 0)) * volume
        layers_here = m.n_layers / pipeline
        plan.time["tensor-parallel collectives"] = t.microbatches * layers_here * per_layer / group_bw
    dp = par.data * par.fsdp
    if dp > 1:
        span = par.tensor * dp
        bw = device.intra_bw if span <= device.per_node else device.inter_bw
        replica = params * par.fsdp  # parameters of one tensor shard, summed over the data group
        # fp32 gradients: all-reduce (2x a reduce-scatter) without FSDP, reduce-scatter with it
        comm = (2 if par.fsdp == 1 else 1) * 4 * replica * (dp - 1) / dp
        if par.fsdp > 1:  # FSDP re-gathers weights (compute dtype) forward and backward, per microbatch
            comm += 2 * t.microbatches * e * replica * (par.fsdp - 1) / par.fsdp
        plan.time["data/FSDP collectives"] = comm / bw
    plan.mfu = accounting.model_flops_per_step(cfg) / (plan.step_time * n * peak)
    if plan.total_memory > limit:
        states = plan.memory["parameters, gradients, optimizer"]
        plan.rejected = (
            f"needs {plan.total_memory / GiB:.1f} GiB > {limit / GiB:.1f} GiB "
            f"(activations {act['total'] / GiB:.1f} GiB, states {states / GiB:.1f} GiB)"
        )
    return plan


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
    rejected ones with their reason."""
    plans = []
    for tensor in _divisors(n_devices):
        for fsdp in _divisors(n_devices // tensor):
            data = n_devices // tensor // fsdp
            for sp in (False, True) if tensor > 1 else (False,):
                par = ParallelConfig(data=data, fsdp=fsdp, tensor=tensor, sequence_parallel=sp)
                for policy in policies:
                    for k in _divisors(cfg.train.global_batch):
                        c = dataclasses.replace(
                            cfg,
                            parallel=par,
                            remat=RematConfig(policy),
                            train=dataclasses.replace(cfg.train, microbatches=k),
                        )
                        try:
                            validate(c)
                        except ConfigError as err:
                            plans.append(Plan(c, rejected=str(err).split(";")[0]))
                            continue
                        plans.append(estimate(c, device, memory_limit))
    # fastest first; equal roofline times prefer fewer microbatches (bigger GEMMs), then less memory
    plans.sort(
        key=lambda p: (bool(p.rejected), p.step_time if not p.rejected else 0, p.cfg.train.microbatches, p.total_memory)
    )
    return plans


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
        if estimate(shorter, device, limit).total_memory <= limit:
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
        f"{'#':>3}  {'layout':58s} {'memory GiB':>10s} {'step s':>9s} {'MFU':>6s}  time split",
    ]
    for i, p in enumerate(feasible[:top], 1):
        split = ", ".join(f"{k} {v / p.step_time:.0%}" for k, v in p.time.items())
        row = f"{p.describe():58s} {p.total_memory / GiB:10.2f} {p.step_time:9.4f} {p.mfu:6.1%}"
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


def to_json(plans: list[Plan], verified: str | None = None) -> dict:
    def one(p: Plan) -> dict:
        par = p.cfg.parallel
        return {
            "data": par.data,
            "fsdp": par.fsdp,
            "tensor": par.tensor,
            "sequence_parallel": par.sequence_parallel,
            "remat": p.cfg.remat.policy,
            "microbatches": p.cfg.train.microbatches,
            "memory_bytes": p.memory,
            "total_memory_bytes": p.total_memory,
            "step_time_s": p.time,
            "mfu": p.mfu,
            "rejected": p.rejected,
        }

    return {"plans": [one(p) for p in plans], "verified": verified}


def verify(plan: Plan) -> str:
    """Compile the plan with 2 layers on simulated devices; compare stored activations and the
    state's bytes with the prediction."""
    from meshlm.memory import measure_activations
    from meshlm.parallel.mesh import make_layout

    n = plan.cfg.parallel.n_devices
    if n > len(jax.devices()):
        return f"verify: the plan needs {n} devices, {len(jax.devices())} are simulated here; not compiled"
    small = dataclasses.replace(plan.cfg, model=dataclasses.replace(plan.cfg.model, n_layers=2))
    measured = measure_activations(small, make_layout(small.parallel, jax.devices()[:n])).activation_bytes
    predicted = accounting.activation_memory(small)["total"]
    return (
        f"verify ({plan.describe()}, 2 layers, compiled on {n} simulated devices): activations measured "
        f"{measured / 2**20:.2f} MiB vs predicted {predicted / 2**20:.2f} MiB (ratio {measured / predicted:.3f})"
    )
