"""Named, complete run configurations. `tiny` is the default job; the paper-scale recipes are
defined and validated (tests load every one) even where they cannot run on this machine.

Paper-scale shapes: GPT-3 family (Brown et al. 2020, Table 2.1) and P2 Table 3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshlm.config import (
    ConfigError,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)


def tiny() -> RunConfig:
    """~1M-parameter GPT on the built-in corpus: about a minute on 2 CPU cores (300 steps), visibly
    learns (validation loss 4.27 against the corpus's unigram entropy of 6.34)."""
    return RunConfig(
        model=ModelConfig(family="gpt", vocab_size=2048, d_model=128, n_layers=4, n_heads=4, max_seq_len=128),
        parallel=ParallelConfig(data=2),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        train=TrainConfig(steps=300, global_batch=16, seq_len=128, log_every=10, eval_every=100),
    )


def llama_tiny() -> RunConfig:
    """The `tiny` job with the llama family (RoPE, RMSNorm, SwiGLU, 2 kv heads for 4 query heads)."""
    model = ModelConfig(family="llama", vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2)
    return dataclasses.replace(tiny(), model=model)


def _paper_gpt(d_model: int, n_layers: int, n_heads: int, vocab: int, batch: int, mesh: ParallelConfig) -> RunConfig:
    return RunConfig(
        model=ModelConfig(
            family="gpt",
            vocab_size=vocab,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            max_seq_len=2048,
            dropout=0.1,
            dtype="bfloat16",
            attention_chunk=0,  # P2's explicit attention over the whole s x s, so its figures are the paper's
        ),
        parallel=mesh,
        optim=OptimConfig(lr=1.5e-4, warmup_steps=2000),
        train=TrainConfig(steps=100_000, global_batch=batch, seq_len=2048, log_every=10, eval_every=1000),
    )


def gpt_125m() -> RunConfig:
    cfg = _paper_gpt(768, 12, 12, 50304, 256, ParallelConfig(data=8))
    return dataclasses.replace(cfg, optim=OptimConfig(lr=6e-4, warmup_steps=2000))


def gpt_1_3b() -> RunConfig:
    cfg = _paper_gpt(2048, 24, 16, 50304, 512, ParallelConfig(data=2, fsdp=4))
    return dataclasses.replace(cfg, optim=OptimConfig(lr=2e-4, warmup_steps=2000))


def gpt_22b() -> RunConfig:
    """P2 Table 3: a=64, h=6144, L=48, TP=8, global batch 4, s=2048, v=51200."""
    return _paper_gpt(6144, 48, 64, 51200, 4, ParallelConfig(tensor=8))


def gpt_175b() -> RunConfig:
    """P2 Table 3 (GPT-3): a=96, h=12288, L=96, TP=8, 64 GPUs, global batch 64. P2 uses 8-way
    pipeline parallelism; this recipe gives that factor of 8 to FSDP instead (for P2's layout:
    --mesh stage=8,tensor=8 --set train.microbatches=16, docs/pipeline.md)."""
    return _paper_gpt(12288, 96, 96, 51200, 64, ParallelConfig(fsdp=8, tensor=8))


def llama_1b() -> RunConfig:
    """Llama-3.2-1B exactly (its Hugging Face config.json): 16 layers, h=2048, 32 heads, 8 kv heads,
    d_ff=8192, 128256 vocabulary, tied embeddings, RoPE theta 500000 with Llama 3 scaling (factor
    32, low/high frequency factors 1/4, original context 8192), RMSNorm eps 1e-5: 1,235,814,400
    parameters."""
    return RunConfig(
        model=ModelConfig(
            family="llama",
            vocab_size=128256,
            d_model=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            d_ff=8192,
            dtype="bfloat16",
            norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling="llama3",
            rope_factor=32.0,
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
            rope_original_len=8192,
            tie_embeddings=True,
        ),
        parallel=ParallelConfig(data=2, tensor=4),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000),
        train=TrainConfig(steps=100_000, global_batch=256, seq_len=2048, eval_every=1000),
    )


def moe_tiny() -> RunConfig:
    """`llama-tiny` with a Mixture of Experts in every layer: 8 experts of width 128, top-2, capacity
    factor 1.25 (GShard's), load-balancing and z losses, experts split over expert=2 (docs/moe.md)."""
    base = llama_tiny()
    model = dataclasses.replace(
        base.model,
        n_experts=8,
        experts_per_token=2,
        expert_d_ff=128,
        expert_capacity_factor=1.25,
        moe_aux_loss_coef=0.01,
        moe_z_loss_coef=1e-3,
    )
    return dataclasses.replace(base, model=model, parallel=ParallelConfig(expert=2))


def _moe_recipe(model: ModelConfig, mesh: ParallelConfig, batch: int, seq_len: int) -> RunConfig:
    return RunConfig(
        model=model,
        parallel=mesh,
        optim=OptimConfig(lr=3e-4, warmup_steps=2000),
        train=TrainConfig(steps=100_000, global_batch=batch, seq_len=seq_len, eval_every=1000),
    )


def mixtral_8x7b() -> RunConfig:
    """Mixtral-8x7B's shapes (its config.json): 32 layers, h=4096, 32 heads, 8 kv heads, 8 SwiGLU
    experts of width 14336, top-2, vocabulary 32000, RoPE theta 1e6: 46,702,792,704 parameters,
    12,879,925,248 active per token. Planner-sized (bf16, dropless)."""
    model = ModelConfig(
        family="llama",
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=32768,
        dtype="bfloat16",
        rope_theta=1e6,
        n_experts=8,
        experts_per_token=2,
        moe_aux_loss_coef=0.02,
    )
    return _moe_recipe(model, ParallelConfig(expert=8, tensor=8), 256, 4096)


def qwen3_30b_a3b() -> RunConfig:
    """Qwen3-30B-A3B's shapes (its config.json): 48 layers, h=2048, 32 heads of 128, 4 kv heads,
    q/k norms, 128 experts of width 768, top-8 renormalised, vocabulary 151936, RoPE theta 1e6, RMSNorm
    eps 1e-6: 30,532,122,624 parameters, 3,353,032,704 active. Planner-sized (bf16, dropless)."""
    model = ModelConfig(
        family="llama",
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        max_seq_len=40960,
        dtype="bfloat16",
        norm_eps=1e-6,
        rope_theta=1e6,
        qk_norm=True,
        n_experts=128,
        experts_per_token=8,
        expert_d_ff=768,
        moe_aux_loss_coef=0.001,
    )
    return _moe_recipe(model, ParallelConfig(data=4, expert=16), 256, 4096)


def deepseek_tiny() -> RunConfig:
    """`llama-tiny` made a DeepSeek-V3 (docs/deepseek.md): MLA (q rank 64, KV latent 32, query-key
    heads of 32 + 16, values of 32), a dense first layer, then 8 experts of width 128 and a shared one,
    sigmoid routing over 4 groups (top 2 of them) with the loss-free bias and the sequence-wise loss,
    dropless, one MTP module (weight 0.3); experts split over expert=2."""
    base = llama_tiny()
    model = dataclasses.replace(
        base.model,
        n_kv_heads=0,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_experts=8,
        experts_per_token=2,
        expert_d_ff=128,
        n_shared_experts=1,
        first_k_dense=1,
        router_score="sigmoid",
        router_bias=True,
        router_bias_rate=1e-3,
        n_group=4,
        topk_group=2,
        moe_aux_loss_coef=0.0,
        moe_seq_aux_loss_coef=1e-4,
        mtp_depth=1,
        mtp_loss_coef=0.3,
    )
    train = dataclasses.replace(base.train, steps=500)  # BENCHMARKS.md's figures
    return dataclasses.replace(base, model=model, parallel=ParallelConfig(expert=2), train=train)


def deepseek_v3() -> RunConfig:
    """DeepSeek-V3's shapes (its config.json; V3 2.1-2.2, 4.2): 61 layers (3 dense), h=7168, 128 heads,
    MLA (q rank 1536, KV latent 512, query-key heads 128 + 64, values 128), 256 routed experts of width
    2048 + 1 shared, top-8 of 4 of 8 groups, sigmoid routing with the bias, routed scaling 2.5,
    vocabulary 129280, one MTP module (pre-training at 4K: no YaRN, which V3 added for its long-context
    extension): 671B parameters (37B active) and
    11.6B more in the MTP module. Its pre-training batch: 15360 sequences of 4096. Planner-sized (bf16;
    V3 trained in FP8)."""
    model = ModelConfig(
        family="llama",
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        d_ff=18432,
        max_seq_len=4096,
        dtype="bfloat16",
        norm_eps=1e-6,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_experts=256,
        experts_per_token=8,
        expert_d_ff=2048,
        n_shared_experts=1,
        first_k_dense=3,
        router_score="sigmoid",
        router_bias=True,
        router_bias_rate=1e-3,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        moe_aux_loss_coef=0.0,
        moe_seq_aux_loss_coef=1e-4,
        mtp_depth=1,
        mtp_loss_coef=0.3,
    )
    mesh = dataclasses.replace(ParallelConfig(data=16, expert=64), tensor=2)  # 2048 devices, 15 rows each
    return _moe_recipe(model, mesh, 15360, 4096)


RECIPES: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "llama-tiny": llama_tiny,
    "gpt-125m": gpt_125m,
    "gpt-1.3b": gpt_1_3b,
    "llama-1b": llama_1b,
    "gpt-22b": gpt_22b,
    "gpt-175b": gpt_175b,
    "moe-tiny": moe_tiny,
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "deepseek-tiny": deepseek_tiny,
    "deepseek-v3": deepseek_v3,
}


def get(name: str) -> RunConfig:
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name]()
