"""The startup report of `meshlm train` (and all of `--dry-run`): how the model is laid out, what it
should cost per device, and what the compiled program says.

Predicted bytes come from the shardings (parameters, gradients, optimizer state: exact) and from
`accounting.activation_memory` (activations per microbatch). XLA's `memory_analysis()` of the
compiled step is printed next to them; note that on the CPU backend its temp figure does not track
rematerialisation, so only `meshlm memory` checks activations.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from meshlm import accounting, pipeline_memory
from meshlm.config import RunConfig
from meshlm.insight.memory import device_bytes
from meshlm.insight.pipeline_costs import pipeline_overhead
from meshlm.model import kernels
from meshlm.model.params import named_leaves, param_specs, trainable_mask
from meshlm.parallel.rules import Layout
from meshlm.parallel.schedules import SPLIT, runs_unbranched, schedule_for
from meshlm.train_state import TrainState


def _explicit_label(m, seq_len: int) -> str:
    chunks = accounting.query_chunks(seq_len, m.attention_chunk)
    if len(chunks) == 1:
        return "explicit (the s x s scores are stored)"
    rows = chunks[0][1]
    return f"explicit in {len(chunks)} query chunks of {rows} (the score blocks on and below the diagonal are stored)"


def _treedevice_bytes(abstract_tree, sharding_tree, memory_kind: str = "device") -> int:
    """Bytes one device's shards of the tree take in one memory (its own, or pinned host memory)."""
    leaves = jax.tree.leaves(abstract_tree)
    shardings = jax.tree.leaves(sharding_tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    pairs = zip(leaves, shardings, strict=True)
    return sum(device_bytes(a, s) for a, s in pairs if (s.memory_kind or "device") == memory_kind)


def startup_report(
    cfg: RunConfig, layout: Layout, abstract: TrainState, shardings: TrainState, compiled: Any, peak: float
) -> dict[str, Any]:
    """A JSON-able summary; `format_report` turns it into lines."""
    params = [
        {"name": name, "shape": list(a.shape), "spec": str(s.spec), "device_bytes": device_bytes(a, s)}
        for (name, a), s in zip(named_leaves(abstract.params).items(), jax.tree.leaves(shardings.params), strict=True)
    ]
    param_bytes = sum(p["device_bytes"] for p in params)
    trainable = jax.tree.leaves(trainable_mask(param_specs(cfg.model)))  # LoRA: the adapters only
    grad_bytes = sum(p["device_bytes"] for p, t in zip(params, trainable, strict=True) if t)
    act = accounting.activation_memory(cfg)
    pipeline = _pipeline(cfg)
    activations = "activations (per microbatch)"
    if pipeline is not None:
        activations = f"activations (stage 0, {pipeline_memory.pipeline_in_flight(cfg)} in flight)"
    predicted = {
        "parameters (fp32)": param_bytes,
        "gradients (fp32)": grad_bytes,
        "optimizer state": _treedevice_bytes(abstract.opt_state, shardings.opt_state),
        activations: act["total"],
    }
    if act["host_total"]:
        predicted["activations offloaded to host"] = act["host_total"]
    host_opt = _treedevice_bytes(abstract.opt_state, shardings.opt_state, "pinned_host")
    if host_opt:  # optim.offload_state: Adam's moments in host memory, not on the device
        predicted["optimizer state offloaded to host"] = host_opt
    analysis = compiled.memory_analysis()
    xla = {}
    if analysis is not None:
        for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes"):
            if hasattr(analysis, field):
                xla[field.removesuffix("_in_bytes")] = int(getattr(analysis, field))
    hardware_flops = accounting.hardware_flops_per_step(cfg)
    attention, context = _attention(cfg)
    return {
        "mesh": dict(layout.mesh.shape),
        "dcn": {axis: n for axis, n in cfg.parallel.dcn.items() if n > 1},
        "attention": attention,
        "context": context,
        "pipeline": pipeline,
        "sequence_parallel": layout.sequence_parallel,
        "remat": cfg.remat.policy,
        "parameters": params,
        "param_count": accounting.param_count(cfg.model),
        "active_param_count": accounting.active_param_count(cfg.model),  # MoE: k of E experts per token
        "trainable_param_count": sum(math.prod(p["shape"]) for p, t in zip(params, trainable, strict=True) if t),
        "lora": _lora_label(cfg.model),
        "predicted_device_bytes": predicted,
        "predicted_device_total": sum(v for k, v in predicted.items() if "host" not in k),
        "xla_memory_analysis": xla,
        "model_flops_per_step": accounting.causal_flops_per_step(cfg),  # what MFU divides by
        "eq7_flops_per_step": accounting.model_flops_per_step(cfg),
        "hardware_flops_per_step": hardware_flops,
        "peak_flops_per_s": peak,
        "min_step_time_s": hardware_flops / peak if peak else None,
    }


def _pipeline(cfg: RunConfig) -> dict | None:
    """The pipeline's schedule in numbers (None without one)."""
    par = cfg.parallel
    if par.stage == 1:
        return None
    schedule, unbranched = schedule_for(cfg), runs_unbranched(par)  # B and F on every stage at every tick
    return {
        "schedule": par.pipeline_schedule,
        "pipeline_ticks": par.pipeline_ticks,  # paired: a backward and a forward; single: one action
        "stages": par.stage,
        "virtual_stages": par.virtual_stages,
        "microbatches": cfg.train.microbatches,
        "ticks": schedule.ticks,
        "bubble_fraction": pipeline_overhead(cfg, par.stage),  # the planner's: the policy's backward/forward
        "unbranched": unbranched,  # (the ring inside the stages)
        "peak_in_flight": [schedule.peak_in_flight(s) for s in range(par.stage)],
        "peak_pending_weight_passes": [max(schedule.pending_weights(s)) for s in range(par.stage)],
    }


def _attention(cfg: RunConfig) -> tuple[str, dict | None]:
    """Which attention kernel runs (and why, for `fused`), and the context-parallel numbers."""
    m, par = cfg.model, cfg.parallel
    if par.context > 1:
        ulysses = par.context_strategy == "all_to_all"
        chunk = accounting.context_chunk(cfg)
        block = accounting.attention_block(m, cfg.train.seq_len, chunk)
        comm = accounting.context_comm_bytes(cfg)
        # Ulysses: every rank runs the whole sequence's kernel on its heads (equal work, by construction)
        balance = (
            None
            if ulysses
            else accounting.context_block_pairs(cfg.train.seq_len, par.context, par.context_load_balance, block)
        )
        context = {
            "strategy": par.context_strategy,
            "load_balance": par.context_load_balance,
            "tokens_per_rank": cfg.train.seq_len // par.context,
            "bytes_received_per_step": sum(comm.values()),
            "block_pairs_per_rank": balance,
        }
        if ulysses:
            kernel = _kernel_label(cfg)
            return f"{kernel} over context={par.context} (whole sequences, 1/{par.context} of the heads)", context
        fused = m.attention == "fused"
        kind = kernels.fused_implementation(m.dtype, m.dim_head, cfg.data.document_mask)[0] if fused else ""
        name, why = kernels.offset_kernel(kind)  # as `kernels.fused_at_offset`
        if par.context_strategy == "all_gather" and name:
            return f"{name} over context={par.context} (gathered K/V, {why})", context
        return f"blockwise (block {block}) over context={par.context}", context
    return _kernel_label(cfg), None


def _kernel_label(cfg: RunConfig) -> str:
    m = cfg.model
    if m.attention == "explicit":
        return _explicit_label(m, cfg.train.seq_len)
    if m.attention == "blockwise":
        return f"blockwise (block {m.attention_block})"
    kind, why = kernels.fused_implementation(m.dtype, m.dim_head, cfg.data.document_mask)
    return f"fused -> blockwise ({why})" if kind == "blockwise" else f"fused -> {why}"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_report(r: dict[str, Any]) -> list[str]:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    if r.get("dcn"):  # ways each axis splits across slices/nodes
        mesh += " (across slices/nodes: " + ", ".join(f"{k}={v}" for k, v in r["dcn"].items()) + ")"
    lines = [f"mesh {mesh}{' + sequence parallel' if r['sequence_parallel'] else ''}, remat {r['remat']}"]
    if "attention" in r:
        lines.append(f"attention: {r['attention']}")
    if r.get("context"):
        c = r["context"]
        pairs = c["block_pairs_per_rank"]
        work = f"attention block pairs per rank {min(pairs)}..{max(pairs)}" if pairs else "every rank the same work"
        sent = "Q/K/V/output" if c["strategy"] == "all_to_all" else "K/V"
        lines.append(
            f"context parallelism: {c['strategy']}, {c['tokens_per_rank']} tokens per rank"
            f"{', load-balanced (chunks i and 2c-1-i)' if c['load_balance'] else ''}; {work}; {sent} received per "
            f"device per step {_size(c['bytes_received_per_step'])}"
        )
    if r.get("pipeline"):
        p = r["pipeline"]
        chunks = f" x {p['virtual_stages']} chunks each" if p["virtual_stages"] > 1 else ""
        lines.append(
            f"pipeline: {p['schedule']} over {p['stages']} stages{chunks}, {p['microbatches']} microbatches in "
            f"{p['ticks']} {p['pipeline_ticks']} ticks, bubble {p['bubble_fraction']:.1%} of the busy time"
            + (
                " (the ring inside the stages: every backward and forward runs at every tick)"
                if p["unbranched"]
                else ""
            )
            + "; microbatch-chunks in flight "
            f"per stage {p['peak_in_flight']}"
            + (f", weight passes pending {p['peak_pending_weight_passes']}" if p["schedule"] in SPLIT else "")
        )
    active = r["active_param_count"]
    moe = f" ({active / 1e6:.2f}M active per token)" if active != r["param_count"] else ""
    frozen = ""
    if r.get("lora"):
        frozen = (
            f", {r['trainable_param_count'] / 1e6:.3f}M trainable ({r['lora']}; "
            "the rest frozen: no gradients, no optimizer state)"
        )
    lines.append(f"parameters: {r['param_count'] / 1e6:.2f}M{moe}{frozen}; per-device shards:")
    for p in r["parameters"]:
        lines.append(f"  {p['name']:18s} {tuple(p['shape'])!s:24s} {p['spec']:32s} {_size(p['device_bytes'])}")
    lines.append("predicted per device:")
    for k, v in r["predicted_device_bytes"].items():
        lines.append(f"  {k:32s} {_size(v)}")
    lines.append(f"  {'total on device':32s} {_size(r['predicted_device_total'])}")
    if r["xla_memory_analysis"]:
        lines.append("compiled train step, XLA memory_analysis per device:")
        lines.append("  " + ", ".join(f"{k} {_size(v)}" for k, v in r["xla_memory_analysis"].items()))
    lines.append(
        f"FLOPs per step: model {r['model_flops_per_step']:.3e} (causal attention's masked half not counted; "
        f"P2 Eq. 7: {r['eq7_flops_per_step']:.3e}), hardware {r['hardware_flops_per_step']:.3e} "
        "(GEMMs that run: Eq. 7 with the attention blocks the kernel executes, + recomputation)"
    )
    if r["min_step_time_s"]:
        lines.append(
            f"expected bound: >= {1e3 * r['min_step_time_s']:.1f} ms/step at 100% of peak "
            f"({r['peak_flops_per_s'] / 1e12:.3g} TFLOP/s); step time / this = 1 / HFU"
        )
    return lines


def _lora_label(m) -> str:
    if not m.lora_rank:
        return ""
    dropout = f", dropout {m.lora_dropout:g}" if m.lora_dropout else ""
    return f"LoRA r={m.lora_rank} on {','.join(m.lora_targets)}{dropout}"
