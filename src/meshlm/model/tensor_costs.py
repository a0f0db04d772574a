"""GEMM FLOPs that run beyond a layer's model count, as arithmetic on the config (no JAX): the work a
tensor-parallel layer does on every `tensor` rank, and what the remat policies run again of it and of
LoRA's adapters. `accounting.hardware_flops_per_step` adds them; tests/test_flops.py checks the sum
against compiled programs on tensor=2 and 4, with and without SP, LoRA and `lora_dropout`, per policy.

Under `tensor` a column-parallel projection's input is whole on every rank and its weight split by
output columns, a row-parallel one's the reverse: no GEMM runs twice. What is not split runs on each
rank - the `whole` part:

- MLA's down-projections W_DQ and W_DKV (replicated weights, `mla_costs.down_projection_flops`);
- of a LoRA adapter's (x A) B, the half whose weight is not split: x A of a column-parallel target
  (A is [in, r]), (x A) B of a row-parallel one, both of W_DQ's and W_DKV's adapters.

With `lora_dropout` the adapters run outside the regions under GSPMD (`lora.outside_regions`): on
the whole sequence without SP (so their `whole` parts again run on every rank), sequence-sharded
with SP (nothing runs twice), and W_DQ with them (MLA's query latent, `mla.outside`).

What runs again in backward, beyond `accounting.recompute_flops_per_step`'s model terms:

- elementwise / selective under SP: the region keeps only its input (`collectives.column_parallel`),
  so backward re-runs on every rank what its weight gradients read: MLA's latents (down-projections)
  and, of the adapters in it, x A (column-parallel) and W_DQ's / W_DKV's whole adapters;
- `lora_dropout`: x A of every target, redrawn from x and the key (`transformer._lora_terms`); under
  dots and offload x A is a saved matmul output and is not redrawn;
- full: each adapter's forward too, but the last MLP projection's (x A) B, whose output only feeds
  the residual (with dropout its x A too: the redrawn one is its only rerun); every rank re-runs its
  `whole` parts.
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
    widths = lora.widths(m)
    return {t: (2 * m.lora_rank * widths[t][0], 2 * m.lora_rank * widths[t][1]) for t in m.lora_targets}


def _whole(target: str, a: int, b: int) -> int:
    """The part of an adapter's forward every tensor rank runs."""
    return a * (target in COLUMN + WHOLE) + b * (target in ROW + WHOLE)


def extra_flops_per_token(m: ModelConfig, policy: str, tensor: int, sp: bool) -> int:
    """GEMM FLOPs per token (all layers) beyond `accounting`'s model and recompute terms: the `whole`
    parts on tensor - 1 more ranks (forward and backward; the frozen W_DQ, W_DKV without a weight
    gradient under LoRA), and what the policy runs again (module docstring)."""
    sp = sp and tensor > 1
    outside = lora.outside_regions(m)
    adapters = _adapters(m) if m.lora_rank else {}
    sharded = outside and sp  # the adapters (and W_DQ) run sequence-sharded under GSPMD
    down_q = 0 if (sharded and m.q_lora_rank) else 2 * m.d_model * m.q_lora_rank
    down_kv = mla_costs.down_projection_flops(m) - 2 * m.d_model * m.q_lora_rank
    down = (down_q + down_kv) * m.mla
    whole = 0 if sharded else sum(_whole(t, *ab) for t, ab in adapters.items())
    extra = (tensor - 1) * ((2 if m.lora_rank else 3) * down + 3 * whole)
    redrawn = sum(a for t, (a, _) in adapters.items() if t in COLUMN + WHOLE) if outside and not sp else 0
    if sharded and "wq_b" in adapters:  # measured: GSPMD redraws the query latent's x A on every rank
        redrawn = adapters["wq_b"][0]
    if policy in ("elementwise", "selective"):
        extra += (tensor - 1) * redrawn
        if sp:  # the region's rerun on every rank: the latents, x A of its column targets, W_DQ/W_DKV's adapters
            region = 0 if outside else sum(_whole(t, a, b * (t in WHOLE)) for t, (a, b) in adapters.items())
            extra += tensor * (down + region)
    elif policy == "full":
        last = {t: (a * outside, b) for t, (a, b) in adapters.items() if t in LAST}  # not rerun by the layer
        extra += sum(a + b for a, b in adapters.values()) - sum(a + b for a, b in last.values())
        rerun_whole = whole - sum(_whole(t, *ab) for t, ab in adapters.items() if t in LAST) * (not sharded)
        extra += (tensor - 1) * (down + rerun_whole + redrawn)
    return m.n_layers * extra
