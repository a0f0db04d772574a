"""What an MoE layer runs and keeps, from shapes alone (no JAX): capacity, the expert kernel a
layer uses, the rows it executes, the FLOPs and the stored bytes. `model.moe`, `model.grouped` and
`accounting` all read them from here, so the formulas and the program agree by construction where
they can and by test where they cannot (tests/test_moe.py, test_memory.py, test_flops.py)."""

from __future__ import annotations

import math

from meshlm.config import ModelConfig, RunConfig
from meshlm.parallel.schedules import pad_count, pipeline_unit

TILE = 128  # grouped rows per tile: each expert's group is padded to a multiple (the padding runs)
# `model.moe_kernel=auto`, dropless. TPU: ragged_dot ran 1.5x megablox at Qwen3-30B-A3B's expert shapes on
# a v5e (45.3 vs 30.1 TFLOP/s, benchmarks/tpu.sh; BENCHMARKS.md "First accelerator")
DEVICE_KERNEL = {"cpu": "tiled", "gpu": "ragged_dot", "tpu": "ragged_dot"}
# how the grouped exchange moves its rows (`grouped.exchange`): the whole worst-case buffer, or
# `ragged_all_to_all` with the used rows only (XLA:CPU does not implement it; untested across devices)
EXCHANGE_OP = {"cpu": "all_to_all", "gpu": "ragged", "tpu": "ragged"}


def expert_capacity(cfg: ModelConfig, t: int) -> int:
    """Slots per expert in a capacity group of t tokens (one sequence): min(t, ceil(factor t k / E)),
    and t when dropless (`model.expert_capacity_factor` = 0): a token picks an expert at most once."""
    if cfg.expert_capacity_factor <= 0:
        return t
    return max(1, min(t, math.ceil(cfg.expert_capacity_factor * t * cfg.experts_per_token / cfg.n_experts)))


def grouped_rows(n: int, n_experts: int) -> int:
    """Static rows of the grouped buffer for n assignments over n_experts groups: the tiles the
    worst case needs (every group padded by TILE - 1)."""
    return math.ceil((n + n_experts * (TILE - 1)) / TILE) * TILE


def expert_kernel(m: ModelConfig, rows: int, tokens: int, expert: int = 1, platform: str = "cpu") -> str:
    """The kernel of an MoE layer over `rows` rows of `tokens` tokens per device (`expert` ways):
    `buffers` (capacity buffers) with a finite capacity or when asked, else the grouped kernel asked
    for, or under `auto` the device's (`DEVICE_KERNEL`) unless it would run as many rows as dropless
    capacity buffers' E x t slots per row (a decode step of a few tokens: each expert's tile is
    mostly padding). Rows run: the device's routed assignments and their padding, as if balanced.
    The exchange's worst-case buffer holds `expert` x those; once `expert` x k > E that is more
    than the buffers' slots (the memory formula and the planner count it)."""
    if m.expert_capacity_factor > 0 or m.moe_kernel == "buffers":
        return "buffers"
    if m.moe_kernel != "auto":
        return m.moe_kernel
    grouped = grouped_rows(rows * tokens * m.experts_per_token, m.n_experts // expert)
    return DEVICE_KERNEL[platform] if grouped < m.n_experts * rows * tokens else "buffers"


def expert_rows(m: ModelConfig, rows: int, tokens: int, expert: int = 1) -> int:
    """Rows one device's expert GEMMs run over per layer: E x C per row in capacity buffers; grouped,
    each device's routed assignments with their tile padding, as if the routing were balanced (the
    exchange's worst-case buffer holds `expert` x that, but the loop skips its empty tiles)."""
    if expert_kernel(m, rows, tokens, expert) == "buffers":  # the grouped kernels share one layout
        return m.n_experts * rows * expert_capacity(m, tokens)
    return grouped_rows(rows * tokens * m.experts_per_token, m.n_experts // expert)


def expert_slot_flops(cfg: RunConfig) -> tuple[int, int]:
    """Forward FLOPs per step of the routed experts' SwiGLUs: (as counted, k experts per token; as
    executed, over `expert_rows` of every device's microbatches). (0, 0) dense."""
    m, t, par = cfg.model, cfg.train, cfg.parallel
    if not m.moe:
        return 0, 0
    one = 2 * 3 * m.d_model * m.expert_ffn * len(m.moe_stat_layer_ids)  # with the MTP modules' MoE layers
    b, s = t.global_batch // t.microbatches // par.batch_shards, t.seq_len // par.context
    devices = t.microbatches * par.batch_shards * par.context  # every row of the step, once
    executed = devices * expert_rows(m, b, s, par.expert) * one
    return m.experts_per_token * t.seq_len * t.global_batch * one, executed


def expert_hardware_flops(cfg: RunConfig, routed: bool = False) -> int:
    """The routed experts' GEMM FLOPs a step executes, as `accounting.hardware_flops_per_step` counts
    them: forward and backward (3x; 2x frozen under LoRA: no weight gradient) over `expert_rows`,
    and once more forward where the remat policy recomputes them (`full`, `dots`, `offload`). 0 dense.
    `routed`: over the routed assignments only (k per token), the FLOPs a grouped kernel's measured
    rate is quoted in (its tile padding is inside the time it was measured in)."""
    counted, executed = expert_slot_flops(cfg)
    passes = (2 if cfg.model.lora_rank else 3) + (cfg.remat.policy in ("full", "dots", "offload"))
    return passes * (counted if routed else executed)


def moe_terms(m: ModelConfig, s: int, b: int, t: int, sequence_parallel: bool, expert: int = 1) -> dict[str, float]:
    """What an MoE layer keeps (`model.moe`; b rows per device, after the expert axis split them):
    the rows entering the experts (capacity buffers: all E x C slots of a row, the expert-parallel
    all_to_all's, the same bytes per device after it; grouped: the tiles the device runs, the
    exchange's worst case) and each expert SwiGLU's gate and up over them (buffers: and the
    down-projection input, which the grouped kernels recompute), the expert outputs each assignment
    reads back (`combine_input`), the router's fp32 logits and probabilities, the routing indices and
    weights, and the shared experts' SwiGLU (+ their gated output). The region replicates the tokens
    over `tensor`: only the experts' widths split by t, and under SP the region keeps its all-gathered
    input."""
    e, d, E, k, f = _bytes(m), m.d_model, m.n_experts, m.experts_per_token, m.expert_ffn
    n = s * b * k
    if expert_kernel(m, b, s, expert) == "buffers":
        slots = b * E * expert_capacity(m, s)
        terms = {"expert_input": e * slots * d, "expert_gate": e * slots * f / t, "expert_up": e * slots * f / t}
        terms["expert_down_input"] = e * slots * f / t
        index = 4 * slots  # the slot of each row's token (int32 per slot)
    else:
        rows = grouped_rows(expert * n, E // expert)
        terms = {"expert_input": e * rows * d, "expert_gate": e * rows * f / t, "expert_up": e * rows * f / t}
        # int32: the source of each row and each tile's expert; exchanged, the send buffer's source
        # and each received row's place, per slot of the worst-case buffer
        index = 4 * rows + 4 * rows // TILE + (8 * expert * n if expert > 1 else 0)
    terms["combine_input"] = e * n * d
    terms["router_logits_probs"] = (3 if m.router_score == "sigmoid" else 2) * 4 * s * b * E  # sigmoid: + scores
    # per assignment: expert and slot (int32), weight (fp32 and compute dtype); per token: fp32
    # softmax/logsumexp statistics (6) and a flag
    terms["routing"] = index + (12 + e) * n + 25 * s * b
    if sequence_parallel:  # the region keeps its all-gathered input instead of the local shard
        terms["mlp_input"] = e * s * b * d
    if m.shared_ffn:
        fs = m.shared_ffn
        terms |= {"shared_gate": e * s * b * fs / t, "shared_up": e * s * b * fs / t}
        terms["shared_down_input"] = e * s * b * fs / t
        if m.shared_expert_gate:  # the output and the sigmoid the gate multiplies it by
            terms["shared_gated_output"] = e * s * b * d + (4 + e) * s * b
    return terms


def expert_exchange_bytes(cfg: RunConfig, platform: str = "cpu") -> float:
    """Bytes one device sends per step in MoE's all_to_alls over `expert`: per layer (of its pipeline
    stage) and microbatch,
    out to the experts' devices and back, forward and again (as cotangents) backward, and once more
    forward where the policy recomputes the layer (`full`) or the experts (`dots`, `offload`);
    (X-1)/X of it leaves the device. Capacity buffers move [E, b, C, d]; the grouped exchange its
    worst-case [X, b t k, d] (`ragged` on `platform`, `EXCHANGE_OP`: the b t k routed rows) and, forward
    only, the assignments' expert ids (int32, worst case). On CPU the compiled step has exactly these
    all-to-alls (tests/test_moe.py); `ragged` adds a few int32 per layer (each peer's row count, and
    in the backward the offsets), not counted."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    if not m.moe or par.expert == 1:
        return 0.0
    b, s, e = t.global_batch // t.microbatches // par.batch_shards, t.seq_len // par.context, _bytes(m)
    again = cfg.remat.policy in ("full", "dots", "offload")
    if expert_kernel(m, b, s, par.expert) == "buffers":  # C of a context rank's tokens
        per_layer = (6 if again else 4) * b * m.n_experts * expert_capacity(m, s) * m.d_model * e
    else:
        n = par.expert * b * s * m.experts_per_token
        rows = n // par.expert if EXCHANGE_OP[platform] == "ragged" else n
        per_layer = (6 if again else 4) * rows * m.d_model * e + (2 if again else 1) * n * 4
    unit = pipeline_unit(m)  # uneven stages' pad slots exchange too (a unit's MoE layers each)
    pads = pad_count(unit.count, par.stage * par.virtual_stages) * sum(unit.kinds) if unit and par.stage > 1 else 0
    layers = (len(m.moe_stat_layer_ids) + pads) / par.stage  # MTP's too; a pipeline stage's share
    return t.microbatches * layers * per_layer * (par.expert - 1) / par.expert


def _bytes(m: ModelConfig) -> int:
    return 2 if m.dtype == "bfloat16" else 4
