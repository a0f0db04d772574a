"""How fast the planner takes each attention kernel to run on each device kind, and whether meshlm
has measured it there; also the grouped expert GEMMs of dropless MoE (`EXPERT_RATES`, at the end).

The attention core (QK^T, softmax, attention over V and their backward:
`accounting.attention_core_flops`) is not a plain GEMM. Flash kernels reach a fraction of the matmul
peak that their authors measured; meshlm's own blockwise tiles and the TPU splash kernel have no
published figure. Each (kernel, architecture) pair below names its fraction of the device's dense
peak (forward + backward) and where that number comes from; `None` means the GEMM rate: explicit
attention on the A100, whose calibration (P2 Table 4) measured Megatron's whole layer, attention
inside - the planner's reproduction of P2 Table 5 rests on it.

`MEASURED` lists the (kernel, device) pairs meshlm itself has run and timed (add one with the
figures from `benchmarks/tpu.sh` or `benchmarks/gpu.sh` in BENCHMARKS.md): the three TPU kernels on
a TPU v5e; their rates stand for every TPU generation, "unmeasured" on the others. No GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.config import RunConfig
from meshlm.platform.hardware import Accelerator


@dataclass(frozen=True)
class KernelRate:
    fraction: float | None  # of the dense matmul peak, forward + backward; None: the GEMM rate
    source: str


_FA2 = "FlashAttention-2 paper (Dao, 2023): 50-73% of A100 peak"
RATES: dict[tuple[str, str], KernelRate] = {
    ("explicit", "ampere"): KernelRate(None, "the GEMM rate: P2 Table 4 measured Megatron's layer, attention inside"),
    ("explicit", "any"): KernelRate(
        0.15,
        "assumption: the scores are materialised and the softmax is memory-bound; FlashAttention-1 (25-40%) "
        "runs several times faster (FlashAttention paper, Dao et al., 2022)",
    ),
    ("cudnn", "ampere"): KernelRate(0.50, f"{_FA2}; its low end (cuDNN's flash kernel is of that family)"),
    ("cudnn", "hopper"): KernelRate(
        0.50, "FlashAttention-3 paper (Shah et al., 2024): up to 75% of H100 peak forward; backward lower"
    ),
    ("pallas-gpu", "ampere"): KernelRate(
        0.35, f"assumption: between FlashAttention-1 (25-40%) and FlashAttention-2 ({_FA2}); Triton's is unmeasured"
    ),
    ("pallas-gpu", "hopper"): KernelRate(
        0.35, "FlashAttention-3 paper: FlashAttention-2-style kernels (no wgmma, no TMA; Triton's) reach 35% of H100"
    ),
    # measured on one TPU v5e (BENCHMARKS.md, "First accelerator"), b=4 s=4096 h=128 GQA, forward + backward
    ("splash", "tpu"): KernelRate(0.34, "measured on a TPU v5e at h=128, 512-row blocks (14% at h=64)"),
    ("blockwise", "tpu"): KernelRate(0.063, "measured on a TPU v5e at h=128, 128-row blocks (4.0% at h=64)"),
    ("explicit", "tpu"): KernelRate(0.136, "measured on a TPU v5e at h=128 (10% at h=64)"),
    ("blockwise", "any"): KernelRate(
        0.25, "assumption: XLA-compiled 128-wide tiles, no fused kernel; FlashAttention-1's low end (25%)"
    ),
}

# (kernel, device name) pairs meshlm has run and timed (benchmarks/tpu.sh, benchmarks/gpu.sh)
MEASURED: frozenset[tuple[str, str]] = frozenset(
    {("splash", "tpu-v5e"), ("blockwise", "tpu-v5e"), ("explicit", "tpu-v5e")}
)


@dataclass(frozen=True)
class AttentionKernel:
    name: str  # "explicit" | "blockwise" | "cudnn" | "pallas-gpu" | "splash"
    rate: KernelRate
    measured: bool  # meshlm has run this kernel on this device kind

    def label(self) -> str:
        rate = "GEMM rate" if self.rate.fraction is None else f"{self.rate.fraction:.0%}"
        return f"{self.name} {rate}" + ("" if self.measured else " unmeasured")


def architecture(device: Accelerator) -> str:
    """The kernels' architecture families: "ampere" (A100), "hopper" (H100, H200) or "tpu"."""
    if device.platform == "tpu":
        return "tpu"
    return "ampere" if device.name.startswith("a100") else "hopper"


def attention_kernel(cfg: RunConfig, device: Accelerator) -> AttentionKernel:
    """The kernel a run of `cfg` would execute on `device` (as `model.kernels.fused_implementation`
    picks it there; ring context parallelism runs blockwise, all_gather the kernel that takes a
    causal offset, `kernels.offset_kernel`: splash, Pallas GPU), with its rate."""
    from meshlm.model.kernels import gpu_kernel, offset_kernel

    m, par = cfg.model, cfg.parallel
    name, doc = m.attention, cfg.data.document_mask
    if name == "fused":
        name = "splash" if device.platform == "tpu" else gpu_kernel(m.dtype, m.dim_head, doc)[0]
        if par.context > 1 and par.context_strategy == "ring":
            name = "blockwise"
        elif par.context > 1 and par.context_strategy == "all_gather":
            name = offset_kernel(name)[0] or "blockwise"
    arch = architecture(device)
    rate = RATES.get((name, arch)) or RATES[(name, "any")]
    return AttentionKernel(name, rate, (name, device.name) in MEASURED)


# Dropless MoE's grouped expert GEMMs (`model.moe_costs.expert_kernel`), where meshlm has timed them:
# one TPU v5e chip at Qwen3-30B-A3B's expert shapes (benchmarks/tpu.sh, BENCHMARKS.md, 2026-12-05), as
# routed TFLOP/s over the chip's 197 peak (dense batched GEMMs of the same FLOPs: 149.6). Elsewhere the
# GEMM rate, an assumption with no source (GPUs: whether XLA lowers ragged_dot to a grouped GEMM is
# unverified). Capacity buffers are batched GEMMs: the GEMM rate.
_V5E = "measured on one TPU v5e chip at Qwen3-30B-A3B's expert shapes (benchmarks/tpu.sh, 2026-12-05)"
EXPERT_RATES: dict[tuple[str, str], KernelRate] = {
    ("ragged_dot", "tpu"): KernelRate(45.3 / 197, f"{_V5E}: 45.3 routed TFLOP/s; dense batched GEMMs 149.6"),
    ("megablox", "tpu"): KernelRate(30.1 / 197, f"{_V5E}: 30.1 routed TFLOP/s; dense batched GEMMs 149.6"),
}
GROUPED_ASSUMED = KernelRate(None, "assumption: a grouped GEMM as fast as a dense one, no source")


def expert_kernel_rate(cfg: RunConfig, device: Accelerator) -> tuple[str, KernelRate]:
    """(the MoE layers' expert kernel on `device`, its rate: `EXPERT_RATES`, else the GEMM rate)."""
    from meshlm.model.moe_costs import expert_kernel

    m, par, t = cfg.model, cfg.parallel, cfg.train
    b, s = t.global_batch // t.microbatches // par.batch_shards, t.seq_len // par.context
    kernel = expert_kernel(m, b, s, par.expert, device.platform)
    if kernel == "buffers":
        return kernel, KernelRate(None, "batched GEMMs over the capacity buffers")
    return kernel, EXPERT_RATES.get((kernel, device.platform), GROUPED_ASSUMED)
