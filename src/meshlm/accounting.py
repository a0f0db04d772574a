"""Parameter counts and FLOPs, as pure arithmetic on the config (no JAX).

FLOPs count GEMMs only (multiply-add = 2 FLOPs), as P2 Appendix A and Narayanan et al. do.
Causal attention is *not* halved: the paper counts QK^T and attention-over-V as full s x s
matmuls, and so do we. With MHA, d_ff = 4h and a GeLU MLP this is exactly P2's Eq. 7:

    model FLOPs / step = 72 B L s h^2 (1 + s/(6h) + v/(12 h L))

and it generalises the way Megatron-LM's `num_floating_point_operations` does: GQA shrinks the K/V
projections, SwiGLU has three d x d_ff matrices instead of two.
"""

from __future__ import annotations

from meshlm.config import ModelConfig, RunConfig


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters `model.params.param_specs` creates (tested against it)."""
    d, n, k, h, f, v, L = (
        cfg.d_model,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.dim_head,
        cfg.ffn,
        cfg.vocab_size,
        cfg.n_layers,
    )
    attn = d * n * h + 2 * d * k * h + n * h * d
    if cfg.family == "gpt":
        per_layer = attn + (n * h + 2 * k * h + d) + 2 * d * f + f + d + 4 * d  # + biases, 2 LNs
        return v * d + cfg.max_seq_len * d + L * per_layer + 2 * d
    per_layer = attn + 3 * d * f + 2 * d
    return 2 * v * d + L * per_layer + d


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward GEMM FLOPs of one layer for one token, by term."""
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head, cfg.ffn
    n_mlp_mats = 2 if cfg.family == "gpt" else 3
    return {
        "qkv": 2 * d * (n + 2 * k) * h,
        "attn_scores": 2 * seq_len * n * h,  # QK^T, not halved for causality
        "attn_values": 2 * seq_len * n * h,  # probs @ V
        "attn_out": 2 * n * h * d,
        "mlp": 2 * n_mlp_mats * d * f,
    }


def model_flops_per_step(cfg: RunConfig) -> int:
    """P2 Eq. 7 (generalised): forward + backward (= 3x forward) GEMM FLOPs of one optimizer step,
    with B = sequences per step (global batch), as Table 5's MFU requires."""
    m, t = cfg.model, cfg.train
    per_token = m.n_layers * sum(layer_forward_flops_per_token(m, t.seq_len).values())
    per_token += 2 * m.d_model * m.vocab_size  # logits
    return 3 * t.global_batch * t.seq_len * per_token


def recompute_flops_per_step(cfg: RunConfig) -> int:
    """Extra forward GEMM FLOPs that the remat policy re-executes in the backward pass."""
    m, t = cfg.model, cfg.train
    terms = layer_forward_flops_per_token(m, t.seq_len)
    tokens_layers = t.global_batch * t.seq_len * m.n_layers
    policy = cfg.remat.policy
    if policy == "full":
        return tokens_layers * sum(terms.values())
    if policy == "selective":  # P2 Eq. 8: QK^T and attention over V once more
        return tokens_layers * (terms["attn_scores"] + terms["attn_values"])
    return 0  # "none" stores everything; "dots" recomputes only non-GEMM work


def hardware_flops_per_step(cfg: RunConfig) -> int:
    """GEMM FLOPs actually executed: model FLOPs plus the policy's recomputed forward.

    For selective recomputation this adds 4*B*s^2*h per layer (QK^T and attention over V once
    more), as P2's text says. Note: P2's printed Eq. 8, 72BLsh^2(1 + s/(3h) + v/(12hL)), adds
    12*B*s^2*h per layer, i.e. a forward *and* backward of the attention core; its Table 5 HFU uses
    that. We count what runs; the printed form is kept for reproducing the paper's table."""
    return model_flops_per_step(cfg) + recompute_flops_per_step(cfg)


def utilisation(flops_per_step: float, step_time_s: float, peak_flops_per_s: float) -> float:
    """MFU (with model FLOPs) or HFU (with hardware FLOPs): achieved / peak FLOP/s."""
    if step_time_s <= 0 or peak_flops_per_s <= 0:
        return 0.0
    return flops_per_step / step_time_s / peak_flops_per_s
