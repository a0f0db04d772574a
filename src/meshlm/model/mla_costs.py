"""Multi-head Latent Attention's costs as arithmetic on the config (no JAX): parameters, FLOPs,
the head sizes its attention kernel runs, stored activations and the latent cache
(`model/mla.py` is the model; `accounting` adds these to the rest of the layer); and what a
multi-token-prediction module (`model/mtp.py`) keeps beside its layer."""

from __future__ import annotations

from meshlm.config import ModelConfig


def padded(m: ModelConfig, explicit: bool) -> int:
    """The head size q, k and v are padded to for a kernel that needs one size for all three (0: none).
    The explicit kernel takes v_head_dim != the query-key size as it is; the blockwise, fused and
    context kernels get zero columns (exact: the padded output columns are zero and dropped)."""
    if explicit or not m.mla or m.value_dim == m.dim_head:
        return 0
    return max(m.value_dim, m.dim_head)


def core_sizes(m: ModelConfig, explicit: bool) -> tuple[int, int]:
    """(query-key, value) head sizes the attention kernel runs."""
    pad = padded(m, explicit)
    return (pad, pad) if pad else (m.dim_head, m.value_dim)


def attention_params(m: ModelConfig) -> int:
    """One layer's MLA weights: the down-projections and their norms, the up-projections, the output."""
    d, n, q, r, p = m.d_model, m.n_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    qk, v = m.dim_head, m.value_dim
    query = q * (d + 1 + n * qk) if q else d * n * qk
    return query + r * (d + 1 + n * (qk - p + v)) + d * p + n * v * d


def projection_flops(m: ModelConfig) -> int:
    """Forward GEMM FLOPs per token of the projections into q, k and v (Megatron's MLA terms)."""
    d, n, q, r, p = m.d_model, m.n_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    query = q * (d + n * m.dim_head) if q else d * n * m.dim_head
    return 2 * (query + d * (r + p) + r * n * (m.dim_head - p + m.value_dim))


def down_projection_flops(m: ModelConfig) -> int:
    """Forward FLOPs per token of the replicated down-projections, which a tensor-parallel region
    under SP recomputes in backward (it keeps only its input, and the latents come from it)."""
    return 2 * m.d_model * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)


def latent_terms(m: ModelConfig, e: int, s: int, b: int) -> dict[str, float]:
    """Bytes one device keeps of a layer's latents (replicated over `tensor`: every rank holds the
    whole sequence's): the query latent before and after its norm, the key-value latent's likewise."""
    terms = {"kv_latent": e * s * b * m.kv_lora_rank, "kv_latent_normed": e * s * b * m.kv_lora_rank}
    if m.q_lora_rank:
        terms |= {"q_latent": e * s * b * m.q_lora_rank, "q_latent_normed": e * s * b * m.q_lora_rank}
    return terms


def cache_values_per_token(m: ModelConfig) -> int:
    """Values a decoding cache holds per token and layer: MLA's latent and RoPE key
    (kv_lora_rank + qk_rope_head_dim), or the KV heads' keys and values."""
    if m.mla:
        return m.kv_lora_rank + m.qk_rope_head_dim
    return m.kv_heads * (m.dim_head + m.value_dim)


def cache_bytes_per_token(m: ModelConfig, itemsize: int) -> int:
    """Bytes a decoding cache holds per token over all layers, at `itemsize` bytes a value."""
    return m.n_layers * cache_values_per_token(m) * itemsize


def mtp_module_terms(m: ModelConfig, e: int, s: int, b: int, t: int, r: int, policy: str, chunks: int = 1) -> dict:
    """Bytes one device keeps per multi-token-prediction module beside its layer's terms under
    `policy` (`r`: the residual stream's split, t under SP): the inputs of the post norm and of the
    output layer, the fp32 logits (vocabulary split by t) and log-sum-exp, the targets and loss
    mask; without a module checkpoint (elementwise, selective) also the embedding and h^{k-1} (their
    norms' inputs), their projection's input [2d] and the tokens; under dots also the module's input
    (its layer's input being the projection's output). With loss `chunks` > 1 the output layer's
    input gradient instead of its input, no logits, log-sum-exp or targets, but the tokens on every
    policy (the first module's are the targets, which the whole loss keeps anyway: stored once)."""
    unit, row = e * s * b * m.d_model / r, 4 * s * b
    terms = {"mtp_head_inputs": 2 * unit}
    if chunks == 1:
        terms |= {"mtp_logits": 4 * s * b * m.vocab_size / t + row, "mtp_targets": 2 * row}
    else:
        terms["mtp_tokens"] = row
    if policy in ("elementwise", "selective"):
        terms |= {"mtp_norm_inputs": 2 * unit, "mtp_projection_input": 2 * unit, "mtp_tokens": row}
    elif policy == "dots":
        terms["mtp_input"] = unit
    return terms
