"""What a config must satisfy: internal consistency and divisibility by its mesh.

`validate` is called once wherever a config enters (the CLI, the trainer, conversion, the planner,
`meshlm check`); every refusal is a `ConfigError` whose message names the field to change. Plain
Python: validating a config imports no JAX.
"""

from __future__ import annotations

import typing

from meshlm.axes import MESH_AXES
from meshlm.config import ConfigError, ContextStrategy, ModelConfig, RematPolicy, RunConfig
from meshlm.parallel.schedules import MAX_UNIT, SPLIT, pipeline_unit  # plain Python, no JAX


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _divides(value: int, what: str, size: int, axis: str) -> None:
    _need(
        size >= 1 and value % size == 0,
        f"{what}={value} is not divisible by mesh axis '{axis}' (size {size}); "
        f"choose a mesh whose '{axis}' size divides {value}",
    )


def validate(cfg: RunConfig) -> RunConfig:
    """Check a config for internal consistency and divisibility by its mesh. Returns it unchanged."""
    _validate_model(cfg.model)
    _validate_moe(cfg)
    _validate_parallel(cfg)
    _validate_run(cfg)
    _validate_divisibility(cfg)
    return cfg


ATTENTION_TARGETS = ("wq", "wk", "wv", "wo")
MLP_TARGETS = {"gpt": ("w_fc", "w_proj"), "llama": ("w_gate", "w_up", "w_down")}


def _validate_lora(m: ModelConfig) -> None:
    if not m.lora_rank:
        _need(m.lora_dropout == 0.0, "model.lora_dropout without a rank: set model.lora_rank (finetune.lora_rank)")
        return
    _need(m.lora_rank > 0 and m.lora_alpha > 0, "model.lora_rank and model.lora_alpha must be positive")
    _need(0.0 <= m.lora_dropout < 1.0, "model.lora_dropout must be in [0, 1)")
    mlp = MLP_TARGETS[m.family]
    allowed = ATTENTION_TARGETS + (() if m.moe else mlp)
    if m.mla:  # no wk/wv: the query path, the key-value latent's down-projection, the output
        allowed = ("wq_a", "wq_b") if m.q_lora_rank else ("wq",)
        allowed += ("wkv_a", "wo") + (() if m.moe else mlp)
    bad = [t for t in m.lora_targets if t not in allowed]
    mla_too = [f"model.{k}=0" for k in ("mtp_depth", "router_bias_rate") if m.mla and getattr(m, k)]
    _need(
        not bad and len(m.lora_targets) > 0 and len(set(m.lora_targets)) == len(m.lora_targets),
        f"model.lora_targets={','.join(m.lora_targets)}: each once, from {', '.join(allowed)}"
        + (" (Mixture of Experts: adapters on the experts are not built yet)" if m.moe and set(bad) & set(mlp) else "")
        + (f"; LoRA on this model also needs {' and '.join(mla_too)}" if mla_too else ""),
    )


def _validate_layer_kinds(m: ModelConfig) -> None:
    """Which layers of an MoE model stay dense: indices in range, and at least one MoE layer."""
    _need(m.first_k_dense >= 0 and m.moe_layer_step >= 1, "model.first_k_dense must be >= 0, moe_layer_step >= 1")
    bad = [i for i in m.dense_layers if not 0 <= i < m.n_layers]
    _need(not bad, f"model.dense_layers={list(m.dense_layers)}: {bad} not in [0, n_layers={m.n_layers})")
    _need(
        len(m.moe_layer_ids) > 0,
        f"model.first_k_dense={m.first_k_dense}, moe_layer_step={m.moe_layer_step} and dense_layers leave none of "
        f"the {m.n_layers} layers an MoE layer; use a dense model (model.n_experts=0)",
    )


def _validate_router(m: ModelConfig) -> None:
    """DeepSeek-V3's routing options (docs/moe.md): groups that split the experts evenly, at least two
    experts a group (a group's score is its best two), enough experts in the kept groups for k."""
    g, kept = m.n_group, m.topk_group
    _need(m.routed_scaling_factor > 0, "model.routed_scaling_factor must be > 0")
    _need(
        m.router_score == "sigmoid" or not (m.router_bias or g > 1),
        "model.router_bias and model.n_group > 1 are DeepSeek-V3's routing, on sigmoid scores: set "
        "model.router_score=sigmoid",
    )
    _need(
        m.router_bias_rate >= 0 and (m.router_bias or not m.router_bias_rate),
        "model.router_bias_rate moves the router bias: it must be >= 0, and needs model.router_bias=true",
    )
    _need(
        not (m.router_bias_rate and m.lora_rank),
        "model.router_bias_rate with LoRA: the bias moves during training, but a LoRA run's checkpoints hold "
        "its adapters only; set model.router_bias_rate=0 (the bias is then kept as loaded)",
    )
    _need(
        g >= 1 and m.n_experts % g == 0 and (g == 1 or m.n_experts // g >= 2) and 1 <= kept <= g,
        f"model.n_group={g} must divide n_experts={m.n_experts} into groups of 2 or more, and "
        f"1 <= topk_group={kept} <= n_group",
    )
    _need(
        m.experts_per_token <= kept * m.n_experts // g,
        f"model.experts_per_token={m.experts_per_token} is more than the {kept * m.n_experts // g} experts of "
        f"the topk_group={kept} groups kept",
    )


def _validate_mla(m: ModelConfig) -> None:
    _need(m.mtp_depth >= 0 and m.mtp_loss_coef >= 0, "model.mtp_depth and model.mtp_loss_coef must be >= 0")
    if m.mtp_depth:
        _need(m.family == "llama", "model.mtp_depth (multi-token prediction) is a llama-family option")
        _need(not m.lora_rank, "LoRA adapts the model's layers only: fine-tune an MTP model with model.mtp_depth=0")
    _need(m.kv_lora_rank >= 0, "model.kv_lora_rank must be >= 0 (0: no MLA)")
    if not m.mla:
        _need(m.q_lora_rank == 0, "model.q_lora_rank needs MLA: set model.kv_lora_rank > 0")
        return
    _need(m.family == "llama", "MLA (model.kv_lora_rank > 0) is a llama-family option")
    _need(
        m.q_lora_rank >= 0 and m.qk_nope_head_dim >= 0 and m.v_head_dim > 0,
        "MLA needs model.q_lora_rank >= 0 (0: a full query projection), qk_nope_head_dim >= 0 and v_head_dim > 0",
    )
    _need(
        m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0, "MLA needs an even model.qk_rope_head_dim > 0 for RoPE"
    )
    _need(
        m.n_kv_heads in (0, m.n_heads) and not m.head_dim,
        "MLA's keys and values are per query head, sized by qk_nope_head_dim + qk_rope_head_dim and v_head_dim: "
        "leave model.n_kv_heads and model.head_dim at 0",
    )
    _need(not (m.qk_norm or m.qkv_bias), "MLA normalises its latents itself: model.qk_norm and qkv_bias do not apply")


def _validate_model(m: ModelConfig) -> None:
    _validate_lora(m)
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "scan_unroll", "attention_block"):
        _need(getattr(m, name) > 0, f"model.{name} must be positive")
    _need(m.attention_chunk >= 0, "model.attention_chunk must be >= 0 (0: the whole sequence at once)")
    _need(m.n_heads % m.kv_heads == 0, f"model.n_heads={m.n_heads} must be a multiple of n_kv_heads={m.kv_heads}")
    _need(
        m.head_dim > 0 or m.d_model % m.n_heads == 0,
        f"model.d_model={m.d_model} is not divisible by n_heads={m.n_heads}; set model.head_dim",
    )
    _need(m.dim_head % 2 == 0 or m.family == "gpt" or m.mla, "llama needs an even head_dim for RoPE")
    if m.rope_scaling != "none":
        _need(m.family == "llama", "model.rope_scaling applies to the llama family (gpt has learned positions)")
    if m.rope_scaling == "yarn":
        _need(
            m.rope_factor >= 1 and m.rope_original_len > 0 and m.yarn_beta_fast >= m.yarn_beta_slow > 0,
            "model.rope_scaling=yarn needs rope_factor >= 1, rope_original_len > 0 and "
            "yarn_beta_fast >= yarn_beta_slow > 0",
        )
    _validate_mla(m)
    if m.rope_scaling == "llama3":
        _need(
            m.rope_factor >= 1 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor and m.rope_original_len > 0,
            "model.rope_scaling=llama3 needs rope_factor >= 1, 0 < rope_low_freq_factor < rope_high_freq_factor "
            "and rope_original_len > 0",
        )
    _need(0.0 <= m.dropout < 1.0, "model.dropout must be in [0, 1)")
    _need(m.family == "gpt" or m.dropout == 0.0, "model.dropout is only implemented for the gpt family")
    for flag in ("qk_norm", "qkv_bias"):
        _need(not getattr(m, flag) or m.family == "llama", f"model.{flag} is a llama-family option")
    _need(
        m.attention != "fused" or m.dropout == 0.0,
        "model.attention=fused has no attention-probability dropout; set model.dropout=0 or attention=explicit "
        "(or blockwise)",
    )


def _validate_moe(cfg: RunConfig) -> None:
    """Mixture of Experts: what the router needs, and the layouts it composes with."""
    m, p = cfg.model, cfg.parallel
    _need(m.n_experts >= 0, f"model.n_experts={m.n_experts} must be >= 0 (0: a dense model)")
    if not m.moe:
        _need(
            m.router_score == "softmax" and not m.router_bias and m.n_group == 1,
            "model.router_score, router_bias and n_group set a Mixture of Experts' routing, but the model is dense "
            "(model.n_experts=0)",
        )
        _need(
            p.expert == 1,
            f"parallel.expert={p.expert} shards MoE experts, but the model is dense (model.n_experts=0); "
            f"use parallel.data={p.expert * p.data} to split the batch",
        )
        _need(
            not (m.first_k_dense or m.moe_layer_step != 1 or m.dense_layers),
            "model.first_k_dense, moe_layer_step and dense_layers choose an MoE model's dense layers, but the model "
            "is dense (model.n_experts=0)",
        )
        return
    _need(m.family == "llama", "model.n_experts (Mixture of Experts) is implemented for the llama family")
    _validate_layer_kinds(m)
    _need(
        1 <= m.experts_per_token <= m.n_experts,
        f"model.experts_per_token={m.experts_per_token} must be in [1, n_experts={m.n_experts}]",
    )
    _need(m.expert_d_ff >= 0 and m.shared_expert_d_ff >= 0 and m.n_shared_experts >= 0, "MoE widths must be >= 0")
    _need(m.expert_capacity_factor >= 0, "model.expert_capacity_factor must be >= 0 (0: dropless)")
    _need(
        m.moe_kernel in ("auto", "buffers") or m.expert_capacity_factor == 0,
        f"model.moe_kernel={m.moe_kernel} is a dropless kernel (it runs the routed assignments, none dropped), but "
        f"model.expert_capacity_factor={m.expert_capacity_factor:g}; a finite capacity runs in capacity buffers "
        "(moe_kernel=auto or buffers)",
    )
    _need(
        min(m.moe_aux_loss_coef, m.moe_z_loss_coef, m.moe_seq_aux_loss_coef) >= 0,
        "model.moe_aux_loss_coef, moe_z_loss_coef and moe_seq_aux_loss_coef must be >= 0",
    )
    _validate_router(m)
    _need(
        not m.shared_expert_gate or m.shared_ffn > 0,
        "model.shared_expert_gate needs a shared expert (model.n_shared_experts or shared_expert_d_ff)",
    )
    _divides(m.n_experts, "model.n_experts", p.expert, "expert")
    _divides(m.expert_ffn, "model.expert_d_ff", p.tensor, "tensor")
    if m.shared_ffn:
        _divides(m.shared_ffn, "model.shared_expert_d_ff", p.tensor, "tensor")
    dense, unit = m.dense_layer_ids, pipeline_unit(m)
    _need(
        p.stage == 1 or unit is not None,
        f"an MoE model's dense layers {list(dense)} (model.first_k_dense, moe_layer_step, dense_layers) in a "
        "pipeline (parallel.stage > 1): the stages run the dense first layers with the embedding and split "
        f"the others in whole repeats of one unit of at most {MAX_UNIT} dense and MoE layers (Qwen's "
        "moe_layer_step=2: dense, MoE), and these repeat none; choose dense layers that do, or train it with "
        "the expert, data, fsdp, tensor and context axes (docs/moe.md)",
    )
    _need(
        p.stage == 1 or not unit or not unit.prefix or p.context == 1 or p.context_strategy != "ring",
        f"an MoE model's dense first layers ({unit and unit.prefix} before its repeated layers: model.first_k_dense, "
        "moe_layer_step, dense_layers) run with the embedding inside a branch that "
        "the first stage alone takes, and the ring's permutes (parallel.context_strategy=ring inside pipeline "
        "stages) must be entered by every stage; use context_strategy=all_gather or all_to_all (docs/moe.md)",
    )
    _need(
        p.context == 1 or m.expert_capacity_factor == 0,
        f"model.expert_capacity_factor={m.expert_capacity_factor:g}: a finite capacity is shared by one whole "
        "sequence, which context parallelism splits (parallel.context > 1), so other tokens would be dropped than "
        "on one device; route dropless (model.expert_capacity_factor=0) or use the expert, data, fsdp and tensor "
        "axes (docs/moe.md)",
    )


def _validate_parallel(cfg: RunConfig) -> None:
    """Sequence, context and pipeline parallelism: what each needs of the model and the sizes."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in MESH_AXES:
        _need(getattr(p, name) >= 1, f"parallel.{name} (mesh axis size) must be >= 1")
    _need(
        not (m.lora_rank and p.stage > 1 and p.pipeline_schedule in SPLIT),
        f"parallel.pipeline_schedule={p.pipeline_schedule} with LoRA: it defers the weight-gradient GEMMs to fill the "
        "bubbles, and a LoRA run has none but the adapters' rank-r ones, while its weight slots would keep every "
        "region's inputs; use 1f1b or interleaved",
    )
    _need(
        not (m.moe and p.stage > 1 and p.pipeline_schedule == "zbv"),
        "parallel.pipeline_schedule=zbv with an MoE model is not built (the router counts ride one way, with the "
        "activations to the last stage); use zb1, 1f1b or interleaved",
    )
    _need(
        not (m.mtp_depth and p.stage > 1 and p.context > 1 and p.context_strategy == "ring"),
        "multi-token prediction (model.mtp_depth) runs with the loss inside a branch that the last chunk's stage "
        "alone takes, and the ring's permutes (parallel.context_strategy=ring inside pipeline stages) must be "
        "entered by every stage; use context_strategy=all_gather or all_to_all (docs/deepseek.md)",
    )
    for name, ways in p.dcn.items():
        _need(
            ways >= 1 and getattr(p, name) % ways == 0,
            f"parallel.dcn_{name}={ways} must be >= 1 and divide parallel.{name}={getattr(p, name)} "
            f"(the axis is {ways} ways across slices x {name}/{ways} within each)",
        )
    if p.sequence_parallel:
        _need(p.tensor > 1, "parallel.sequence_parallel needs a tensor axis > 1 (it shards over 'tensor')")
        _divides(t.seq_len, "train.seq_len", p.tensor, "tensor")
    if p.context > 1:
        _validate_context(cfg)
    if p.stage > 1 or p.virtual_stages > 1 or p.pipeline_ticks != "paired":
        from meshlm.parallel.schedules import ScheduleError, check_sizes  # plain Python, no JAX

        no_pipeline = "needs a pipeline (parallel.stage > 1)"
        _need(p.stage > 1 or p.virtual_stages == 1, f"parallel.virtual_stages={p.virtual_stages} {no_pipeline}")
        _need(p.stage > 1, f"parallel.pipeline_ticks={p.pipeline_ticks} {no_pipeline}")
        try:
            unit = pipeline_unit(m)  # an MoE model's dense first layers run with the embedding
            sizes = (p.pipeline_schedule, p.stage, t.microbatches, p.virtual_stages, unit and unit.count)
            check_sizes(*sizes, p.pipeline_ticks, unit.prefix if unit else 0, len(unit.kinds) if unit else 1)
        except ScheduleError as e:
            raise ConfigError(str(e)) from None


def _validate_context(cfg: RunConfig) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    strategies = typing.get_args(ContextStrategy)
    _need(
        p.context_strategy in strategies,
        f"parallel.context_strategy={p.context_strategy!r} unknown; choose from {', '.join(strategies)}",
    )
    ulysses = p.context_strategy == "all_to_all"
    _need(
        m.attention != "explicit" or ulysses,
        f"context parallelism (parallel.context > 1, context_strategy={p.context_strategy}) runs the blockwise "
        "attention kernel; set model.attention=blockwise (or fused), or context_strategy=all_to_all, which "
        "runs any kernel",
    )
    if ulysses:  # every rank attends with 1/(context x tensor) of the heads, over the whole sequence
        split = p.context * p.tensor
        for name, heads in (("model.n_heads", m.n_heads), ("the KV heads (model.n_kv_heads)", m.kv_heads)):
            _need(
                heads % split == 0,
                f"parallel.context_strategy=all_to_all splits {name}={heads} over context x tensor = {split}, "
                "which does not divide it (KV heads are not replicated); choose context and tensor sizes whose "
                "product divides the heads, or context_strategy=ring / all_gather",
            )
    what = "2 x context (load balancing: chunks i and 2c-1-i)" if p.context_load_balance else "context"
    _need(
        t.seq_len % p.context_chunks == 0,
        f"train.seq_len={t.seq_len} is not divisible by {what} = {p.context_chunks}; "
        "choose a seq_len or a 'context' size that divides it",
    )
    chunk = t.seq_len // p.context_chunks
    block = min(m.attention_block, chunk)
    _need(
        ulysses or chunk % block == 0,
        f"model.attention_block={m.attention_block} does not divide the context chunk of {chunk} tokens "
        f"(train.seq_len / {p.context_chunks}); choose a block that divides it",
    )
    if p.sequence_parallel:
        _divides(t.seq_len // p.context, "the per-rank sequence train.seq_len/context", p.tensor, "tensor")


def _validate_run(cfg: RunConfig) -> None:
    """Training, data, checkpoint, optimizer and metrics settings."""
    m, t = cfg.model, cfg.train
    if m.family == "gpt":
        _need(t.seq_len <= m.max_seq_len, f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    policies = typing.get_args(RematPolicy)
    _need(cfg.remat.policy in policies, f"remat.policy={cfg.remat.policy!r} unknown; choose from {', '.join(policies)}")
    chunks, par = cfg.remat.loss_chunks, cfg.parallel
    seq_split = par.context * (par.tensor if par.sequence_parallel else 1)  # the shards of a chunk's tokens
    _need(
        chunks >= 1 and t.seq_len % (chunks * seq_split) == 0,
        f"remat.loss_chunks={chunks} must be >= 1 and divide the tokens of each of the sequence's {seq_split} "
        f"shards (train.seq_len={t.seq_len} over context x tensor under sequence parallelism)",
    )
    _need(t.steps >= 0 and t.seq_len > 0 and t.global_batch > 0, "train.steps/seq_len/global_batch must be positive")
    _need(t.microbatches >= 1, "train.microbatches must be >= 1")
    _need(
        t.global_batch % t.microbatches == 0,
        f"train.global_batch={t.global_batch} is not divisible by train.microbatches={t.microbatches}",
    )
    _need(t.log_every >= 1 and t.eval_every >= 0, "train.log_every must be >= 1, eval_every >= 0")
    _need(t.max_consecutive_skips >= 0, "train.max_consecutive_skips must be >= 0")
    profile = t.profile_range()  # raises on a malformed A:B
    _need(
        profile is None or profile[0] <= t.steps,
        f"train.profile_steps={t.profile_steps!r} starts after the last step ({t.steps})",
    )
    if cfg.metrics.wandb:  # checked on every process before any work (importlib only looks, imports nothing)
        import importlib.util

        _need(
            importlib.util.find_spec("wandb") is not None,
            f"metrics.wandb={cfg.metrics.wandb!r} needs Weights & Biases: pip install 'meshlm[wandb]'",
        )
    _need(0.0 < cfg.data.val_fraction < 0.5, "data.val_fraction must be in (0, 0.5)")
    _need(
        not (cfg.data.mixture and cfg.data.paths),
        "data.mixture and data.paths are both set: a mixture names its sources itself (WEIGHT:PATH); drop data.paths",
    )
    cfg.data.mixture_sources()  # each entry WEIGHT:PATH
    c = cfg.checkpoint
    _need(
        c.every >= 0 and c.keep_every >= 0 and c.local_every >= 0,
        "checkpoint.every, checkpoint.keep_every and checkpoint.local_every must be >= 0",
    )
    _need(c.keep >= 1, "checkpoint.keep must be >= 1 (the latest checkpoint is always kept)")
    o = cfg.optim
    _need(o.lr > 0 and 0 <= o.min_lr_ratio <= 1 and o.warmup_steps >= 0, "optim: lr>0, 0<=min_lr_ratio<=1, warmup>=0")


def _validate_divisibility(cfg: RunConfig) -> None:
    """Every sharded dimension must divide by the product of its mesh axes. Named so the user
    knows which number to change."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _divides(m.n_heads, "model.n_heads", p.tensor, "tensor")
    _divides(m.kv_heads, "model.n_kv_heads", p.tensor, "tensor")
    _divides(m.ffn, "model.d_ff", p.tensor, "tensor")
    _divides(m.vocab_size, "model.vocab_size", p.tensor, "tensor")
    _divides(m.d_model, "model.d_model", p.fsdp, "fsdp")
    micro = t.global_batch // t.microbatches
    _need(
        micro % p.batch_shards == 0,
        f"microbatch size {micro} (train.global_batch={t.global_batch} / train.microbatches={t.microbatches}) "
        f"is not divisible by the batch axes data*fsdp*expert={p.batch_shards}",
    )
