"""GEMM FLOPs beyond a model's count, as arithmetic on the config (no JAX): what a tensor-parallel
layer runs on every `tensor` rank (`replicated_flops_per_token`, which
`accounting.hardware_flops_per_step` adds), and what the remat policies run again of it and of LoRA's
adapters (`rerun_flops_per_token`, which `accounting.recompute_flops_per_step` adds).
tests/test_flops.py compiles tensor=2 programs and checks the sum exactly (cases in
`TENSOR_CASES` there); notes on the by-hand grids: docs/flops-and-planning.md.

Under `tensor` a column-parallel projection's input is whole on every rank and its weight split by
output columns, a row-parallel one's the reverse: no GEMM runs twice. What is not split runs on each
rank - the `whole` part:

- MLA's down-projections W_DQ and W_DKV (replicated weights, `mla_costs.down_projection_flops`), in
  every layer and MTP module; an MoE layer's router (all its experts' scores, on every row);
- of a LoRA adapter's (x A) B, the half whose weight is not split: x A of a column-parallel target
  (A is [in, r]), (x A) B of a row-parallel one, both of W_DQ's and W_DKV's adapters;
- without SP, an MTP module's [2d, d] projection (under GSPMD: its input is whole on every rank).

With `lora_dropout` the adapters run outside the regions under GSPMD (`lora.outside_regions`): on
the whole sequence without SP (their `whole` parts again run on every rank), sequence-sharded with
SP, and W_DQ with them (MLA's query latent, `mla.outside`).

What runs again in backward, beyond `accounting.recompute_flops_per_step`'s model terms:

- elementwise / selective under SP: the region keeps only its input (`collectives.column_parallel`),
  so backward reruns on every rank what its weight gradients read: MLA's latents (down-projections)
  and, of the adapters in it, x A (column-parallel) and W_DQ's / W_DKV's whole adapters. In the
  layer loop only: an MTP module's region runs once, and XLA merges its rerun with the forward pass;
- `lora_dropout`: x A of every target, redrawn from x and the key (`transformer._lora_terms`), on
  every rank where it is whole; and with SP, measured, GSPMD redraws wq_b's on every rank too. Under
  dots and offload x A is a saved matmul output and is not redrawn;
- full: each adapter's forward, but the last MLP projection's (x A) B, whose output only feeds the
  residual (with dropout its x A too: the redrawn one is its only rerun); every rank reruns its
  `whole` parts.

Known gap (measured, not counted): MLA under `full` + SP with LoRA runs wo's x A once more at
tensor=2 and twice at tensor=4 (0.1-0.2% of those steps' FLOPs).
"""

from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.model import lora, mla_costs

COLUMN = ("wq", "wk", "wv", "wq_b", "w_fc", "w_gate", "w_up")  # input whole on every tensor rank
ROW = ("wo", "w_proj", "w_down")  # input split; (x A) B whole
WHOLE = ("wq_a", "wkv_a")  # MLA's replicated down-projections: x A and (x A) B whole
LAST = ("w_proj", "w_down")  # the last MLP projection: its output only feeds the residual


def _adapters(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Forward FLOPs per token and layer of each target's x A and (x A) B."""
    if not m.lora_rank:
        return {}
    widths = lora.widths(m)
    return {t: (2 * m.lora_rank * widths[t][0], 2 * m.lora_rank * widths[t][1]) for t in m.lora_targets}


def _whole(target: str, a: int, b: int) -> int:
    """The part of an adapter's forward every tensor rank runs."""
    return a * (target in COLUMN + WHOLE) + b * (target in ROW + WHOLE)


def _down(m: ModelConfig, sp: bool) -> tuple[int, int]:
    """(W_DQ's, W_DKV's) forward FLOPs per token and layer that run whole on every rank; W_DQ's 0 where
    it runs sequence-sharded (`lora_dropout` with SP: outside the region, under GSPMD)."""
    if not m.mla:
        return 0, 0
    query = 2 * m.d_model * m.q_lora_rank
    return (0 if lora.outside_regions(m) and sp else query), mla_costs.down_projection_flops(m) - query


def _counts(m: ModelConfig) -> tuple[int, int, int]:
    """(MLA layers, with the MTP modules; router layers, likewise; MTP modules' [2d, d] FLOPs each)."""
    routers = (len(m.moe_layer_ids) + m.mtp_depth) if m.moe else 0
    return (m.n_layers + m.mtp_depth) * m.mla, routers, 2 * 2 * m.d_model**2 * m.mtp_depth


def replicated_flops_per_token(m: ModelConfig, tensor: int, sp: bool) -> int:
    """The `whole` parts' forward and backward on tensor - 1 more ranks, per token (all layers);
    frozen weights (LoRA) have no weight-gradient GEMM."""
    sp = sp and tensor > 1
    mla_layers, routers, mtp = _counts(m)
    passes = 2 if m.lora_rank else 3
    weights = mla_layers * sum(_down(m, sp)) + routers * 2 * m.d_model * m.n_experts + mtp * (not sp)
    sharded = lora.outside_regions(m) and sp  # the adapters run sequence-sharded under GSPMD
    adapters = 0 if sharded else m.n_layers * sum(_whole(t, a, b) for t, (a, b) in _adapters(m).items())
    return (tensor - 1) * (passes * weights + 3 * adapters)


def rerun_flops_per_token(m: ModelConfig, policy: str, tensor: int, sp: bool) -> int:
    """What `policy` runs again per token (all layers) of the `whole` parts, on every rank, and of the
    adapters (module docstring): with `lora_dropout`, on one device too, x A of every target
    (`lora.recompute_flops_per_token`), which dots and offload keep instead."""
    sp = sp and tensor > 1
    outside, adapters = lora.outside_regions(m), _adapters(m)
    down = sum(_down(m, sp))
    redrawn = sum(a for t, (a, _) in adapters.items() if t in COLUMN + WHOLE) if outside and not sp else 0
    if outside and sp and "wq_b" in adapters:  # measured: GSPMD redraws the query latent's x A whole
        redrawn = adapters["wq_b"][0]
    if policy in ("dots", "offload"):  # they keep matmul outputs: nothing of these runs again
        return 0
    one_device = lora.recompute_flops_per_token(m)  # `lora_dropout`'s x A, redrawn
    if policy in ("elementwise", "selective"):
        region = 0  # the SP region's rerun, on every rank: the latents and the adapters in it
        if sp:
            in_region = {t: ab for t, ab in adapters.items() if not outside}
            region = tensor * (down + sum(a + b * (t in WHOLE) for t, (a, b) in in_region.items() if t not in ROW))
        return one_device + m.n_layers * ((tensor - 1) * redrawn + region)
    rerun = {t: (a * (t not in LAST or not outside), b * (t not in LAST)) for t, (a, b) in adapters.items()}
    whole = 0 if outside and sp else sum(_whole(t, a, b) for t, (a, b) in rerun.items())
    mla_layers, routers, mtp = _counts(m)
    again = mla_layers * down + routers * 2 * m.d_model * m.n_experts + mtp * (not sp)
    whole_reruns = (tensor - 1) * (again + m.n_layers * (whole + redrawn))
    return one_device + m.n_layers * sum(a + b for a, b in rerun.values()) + whole_reruns
