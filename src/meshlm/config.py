"""Typed, frozen run configuration.

A run is described by one `RunConfig` made of a handful of sections. Recipes (`recipes.py`) build
whole configs; the CLI changes single fields with `--set section.key=value`, type-checked here.
This module holds checks only, no training logic.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshlm.axes import MESH_AXES

Family = Literal["gpt", "llama"]
DType = Literal["float32", "bfloat16"]
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what `meshlm convert --to-hf --dtype` writes
Attention = Literal["explicit", "blockwise", "fused"]
RopeScaling = Literal["none", "llama3", "yarn"]
OnNonFinite = Literal["stop", "skip"]
ContextStrategy = Literal["all_gather", "ring", "all_to_all"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zb1", "zbv"]
PipelineTicks = Literal["paired", "single"]
RematPolicy = Literal["elementwise", "selective", "full", "dots", "offload"]  # meaning: remat.POLICIES (tested)


class ConfigError(ValueError):
    """A configuration the user asked for cannot run; the message says why and what to change."""


def cache_home() -> Path:
    """meshlm's cache directory: $MESHLM_CACHE, else ~/.cache/meshlm (prepared data, the CPU peak
    probe, compiled programs)."""
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm"))


@functools.cache
def _layer_kinds(n_layers: int, first_k_dense: int, step: int, dense: tuple[int, ...]) -> tuple[tuple, tuple]:
    """(MoE layer ids, dense layer ids) of an MoE model, cached: the planner asks a million times a search."""
    moe = tuple(i for i in range(n_layers) if i >= first_k_dense and (i + 1) % step == 0 and i not in dense)
    return moe, tuple(i for i in range(n_layers) if i not in moe)


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer. `gpt` is the papers' architecture; `llama` is RoPE/RMSNorm/SwiGLU/GQA."""

    family: Family = "gpt"
    vocab_size: int = 2048
    d_model: int = 128  # h
    n_layers: int = 4  # L
    n_heads: int = 4  # a
    n_kv_heads: int = 0  # 0 means n_heads (multi-head attention); llama may use fewer (GQA)
    head_dim: int = 0  # 0 means d_model // n_heads
    d_ff: int = 0  # 0 means 4h for gpt, the SwiGLU 8h/3 rounded to 64 for llama
    max_seq_len: int = 128  # size of the learned position table (gpt); RoPE needs none
    dropout: float = 0.0  # gpt only: embedding, attention probabilities, attention out, MLP out
    dtype: DType = "float32"  # compute (activation) dtype; parameters are always fp32 masters
    # "explicit": softmax(QK^T)V with the score matrix materialised (the papers' assumption);
    # "fused": the device's own kernel (`model.kernels`: cuDNN or Pallas flash attention on NVIDIA
    # GPUs, splash on TPUs), else "blockwise" - the startup report says which and why;
    # "blockwise": online softmax over key/value blocks of `attention_block` tokens with a custom
    # VJP that keeps only the output and an fp32 log-sum-exp per row (no s x s tensor; any backend)
    attention: Attention = "explicit"
    attention_block: int = 128
    # explicit attention: queries `attention_chunk` rows at a time, each chunk against the keys up
    # to its last query, so only the score blocks on and below the diagonal are computed and kept
    # (t(t + chunk)/2 of the t^2 per head; at most 16 chunks, longer ones past 16 * chunk tokens);
    # 0: the whole s x s matrix at once, as P2's Table 2 assumes
    attention_chunk: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3's RoPE frequency scaling ("llama3"): wavelengths longer than original_len /
    # low_freq_factor are stretched by `rope_factor`, shorter than original_len / high_freq_factor
    # kept, and those between interpolated (Hugging Face rope_type "llama3").
    rope_scaling: RopeScaling = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_len: int = 8192
    # YaRN ("yarn", DeepSeek-V3's rope_scaling): frequencies blended between interpolated (/ rope_factor)
    # and kept by a ramp over the dimensions that turn beta_slow..beta_fast times in rope_original_len;
    # the rotated parts scaled by mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim), and
    # the softmax scale by mscale(factor, yarn_mscale_all_dim)^2 (mscale(f, m) = 0.1 m ln f + 1)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0  # 0: unset (then the rotated parts get mscale(factor, 1))
    yarn_mscale_all_dim: float = 0.0
    # llama: share the token embedding with the output layer (Llama 3.2 1B/3B); gpt always ties (GPT-2)
    tie_embeddings: bool = False
    # layers run in a lax.scan; unrolling k layers per iteration makes the program (and compile time)
    # grow with k, and was not faster than the scan end to end on CPU (BENCHMARKS-history.md). In
    # training and eval, k >= n_layers runs no loop at all: the layers called one after another on
    # the stacked weights split along the layer axis (decoding and pipeline chunks keep a scan);
    # on CPU that helped gpt medium most (1.26x tokens/s on one device), elsewhere mixed (BENCHMARKS.md)
    scan_unroll: int = 1
    init_std: float = 0.02
    # llama family: RMSNorm of queries and keys over head_dim before RoPE (Qwen3), biases on Q, K, V (Qwen2)
    qk_norm: bool = False
    qkv_bias: bool = False
    # Multi-head Latent Attention (DeepSeek-V2/V3, docs/deepseek.md; llama family): kv_lora_rank > 0
    # replaces Q, K, V by a query path through rank `q_lora_rank` (0: a full projection), a key-value
    # latent of rank kv_lora_rank (RMSNormed; the decoding cache holds it) up-projected per head to
    # keys of qk_nope_head_dim and values of v_head_dim, and one RoPE key of qk_rope_head_dim shared
    # by the heads beside each query's RoPE part (head_dim, n_kv_heads unused)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # multi-token prediction (DeepSeek-V3 2.2): `mtp_depth` modules, the k-th predicting token i+k+1
    # from the (k-1)-th's hidden state and token i+k's embedding; their mean loss x mtp_loss_coef
    mtp_depth: int = 0
    mtp_loss_coef: float = 0.3
    # Mixture of Experts (llama family, docs/moe.md): every layer's MLP becomes `n_experts` SwiGLU
    # experts of width `expert_d_ff` (0: d_ff), `experts_per_token` of them per token; 0: dense
    n_experts: int = 0
    experts_per_token: int = 2
    expert_d_ff: int = 0
    # always-on experts beside the routed ones (DeepSeekMoE, Qwen2-MoE), run as one SwiGLU of width
    # `shared_expert_d_ff` (0: n_shared_experts x the expert width); Qwen2-MoE scales it by sigmoid(x . w)
    n_shared_experts: int = 0
    shared_expert_d_ff: int = 0
    shared_expert_gate: bool = False
    # the chosen experts' weights: softmax over the k chosen logits (true: Mixtral, Qwen3-MoE with
    # norm_topk_prob) or the full softmax's probabilities of the chosen (false: Qwen-MoE's default)
    router_renormalize: bool = True
    # slots per expert in each capacity group (one sequence): min(t, ceil(factor t k / E)); 0: dropless
    expert_capacity_factor: float = 0.0
    # the routed experts' GEMMs (docs/moe.md): `buffers` (batched over capacity buffers: dropless runs
    # E/k x the routed FLOPs), or grouped over the routed assignments (dropless only): `tiled` (CPU),
    # `ragged_dot` (GPU, TPU), `megablox` (TPU; interpret mode elsewhere); `auto`: buffers with a finite
    # capacity, else the device's grouped kernel (buffers where they would run fewer rows)
    moe_kernel: Literal["auto", "buffers", "tiled", "ragged_dot", "megablox"] = "auto"
    # layers whose MLP stays a dense SwiGLU of width d_ff in an MoE model: the first `first_k_dense`
    # (DeepSeek's first_k_dense_replace), all but every `moe_layer_step`-th (Qwen's decoder_sparse_step:
    # layer i is MoE when (i + 1) % step == 0) and those listed in `dense_layers` (Qwen's mlp_only_layers)
    first_k_dense: int = 0
    moe_layer_step: int = 1
    dense_layers: tuple[int, ...] = ()
    # load-balancing loss (Switch/GShard, transformers' form) and router z-loss (ST-MoE) coefficients
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    # DeepSeek-V3's routing (docs/moe.md): sigmoid scores; a per-expert bias added to the scores for
    # the choice only (`router_bias`, HF's e_score_correction_bias), moved after each step by
    # router_bias_rate x sign(mean load - load) (0: kept as it is); the choice limited to the
    # `topk_group` of `n_group` expert groups with the largest sums of their best two scores; the
    # chosen weights x routed_scaling_factor; and the sequence-wise balance loss's coefficient
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    router_bias: bool = False
    router_bias_rate: float = 0.0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    moe_seq_aux_loss_coef: float = 0.0
    # LoRA (docs/finetune.md; also set as finetune.lora_*): rank > 0 freezes every weight and
    # trains, beside each projection named in `lora_targets`, adapters A [in, r] and B [r, out]
    # (B starts at zero), adding (lora_alpha / r) x dropout(x) A B to the projection of x;
    # gpt: wq wk wv wo w_fc w_proj, llama: wq wk wv wo w_gate w_up w_down (MoE: the attention
    # projections only). `lora_dropout`: PEFT's, on the adapters' input only, a mask per target
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")
    lora_dropout: float = 0.0

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    @property
    def stochastic(self) -> bool:
        """Training draws dropout bits (model.dropout, or LoRA's lora_dropout)."""
        return self.dropout > 0 or (self.lora_rank > 0 and self.lora_dropout > 0)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        """The query-key head size (MLA: the no-RoPE and RoPE parts together)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.n_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def value_dim(self) -> int:
        """The value head size (= dim_head but under MLA)."""
        return self.v_head_dim if self.mla else self.dim_head

    @property
    def ffn(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.family == "gpt":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def tied_embeddings(self) -> bool:
        return self.family == "gpt" or self.tie_embeddings

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.expert_d_ff or self.ffn

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The layers whose MLP is the MoE layer (all of an MoE model's but its dense layers)."""
        if not self.moe:
            return ()
        return self._kinds()[0]

    def _kinds(self) -> tuple[tuple, tuple]:
        return _layer_kinds(self.n_layers, self.first_k_dense, max(self.moe_layer_step, 1), tuple(self.dense_layers))

    @property
    def moe_stat_layer_ids(self) -> tuple[int, ...]:
        """The layers whose router statistics a step reports, in order: the MoE layers, then the
        multi-token-prediction modules' (numbered after the model's, n_layers + k - 1, as DeepSeek-V3's)."""
        return self.moe_layer_ids + (tuple(range(self.n_layers, self.n_layers + self.mtp_depth)) if self.moe else ())

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        """An MoE model's layers with a dense SwiGLU (stacked apart, as params["dense_layers"])."""
        if not self.moe:
            return ()
        return self._kinds()[1]

    @property
    def shared_ffn(self) -> int:
        """Width of the fused shared experts (0: none)."""
        return self.shared_expert_d_ff or self.n_shared_experts * self.expert_ffn


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh axis sizes; their product is the device count. Axes of size 1 shard nothing.

    `sequence_parallel` (P2 section 4.2.2) shards the LayerNorm/dropout/residual regions along the
    sequence over the `tensor` axis, with all-gather / reduce-scatter at the block boundaries.

    `context` (context parallelism) splits the sequence of the whole layer over its ranks; the
    attention core either all-gathers K/V over `context` (`context_strategy=all_gather`), passes
    K/V blocks around the ring (`ring`), or trades tokens for heads with an all-to-all before and
    after any kernel (`all_to_all`, Ulysses). `context_load_balance` (causal): rank i holds the
    sequence chunks i and 2c-1-i, so every rank does the same attention work (docs/long-sequences.md).

    `stage` (pipeline parallelism) splits the layers into `stage` x `virtual_stages` chunks (uneven: pads);
    stage s holds chunks s, s+p, ... (`zbv`: s and 2p - 1 - s) and `train.microbatches` flow through them in the
    order of `pipeline_schedule` (docs/pipeline.md): `1f1b`, `interleaved` (with `virtual_stages`),
    `zb1` (zero bubble: the backward split into B and W, a third of 1F1B's bubble at equal costs
    with m >= 2p - 1, for the pending weight passes' memory), `zbv` (ZB-V: two chunks per stage in a
    V, single ticks) or `gpipe`.
    """

    stage: int = 1
    data: int = 1
    fsdp: int = 1
    expert: int = 1  # MoE experts sharded over it; it splits the batch of every other layer (as data)
    context: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    context_strategy: ContextStrategy = "ring"
    context_load_balance: bool = True
    pipeline_schedule: PipelineSchedule = "1f1b"
    virtual_stages: int = 1  # model chunks per stage (interleaved; 2 for zbv)
    # `paired`: a tick pairs a backward with a forward (the textbook bubble in lockstep, 2(p-s)-1 in
    # flight); `single`: one action per tick, Megatron's p - s in flight (1f1b, zb1, zbv; docs/pipeline.md)
    pipeline_ticks: PipelineTicks = "paired"
    # ZeRO stage 1 (Megatron's distributed optimizer): Adam's moments sharded over the data-parallel
    # axes the weights are replicated on (data, context; fsdp where a weight does not use it), the
    # weights left replicated; each device updates its shard, the new weights are all-gathered
    shard_optimizer: bool = False
    # Several slices (TPU pods joined by DCN) or nodes (GPUs joined by InfiniBand): how many ways each
    # axis splits across them (`--dcn data=2`); the rest of the axis stays within a slice/node, on
    # the fast links. `tensor` never crosses (its collectives run in every layer)
    dcn_stage: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_context: int = 1
    dcn_expert: int = 1

    @property
    def n_devices(self) -> int:
        return math.prod(getattr(self, axis) for axis in MESH_AXES)

    @property
    def dcn(self) -> dict[str, int]:
        """How many ways each mesh axis splits across slices/nodes (1 for all: one slice)."""
        return {axis: getattr(self, f"dcn_{axis}", 1) for axis in MESH_AXES}

    @property
    def n_slices(self) -> int:
        return math.prod(self.dcn.values())

    def describe(self, sep: str = " ") -> str:
        """`data=2 fsdp=1 tensor=4` (stage and context only when > 1)."""
        axes = (["stage"] if self.stage > 1 else []) + ["data", "fsdp"] + (["expert"] if self.expert > 1 else [])
        axes += (["context"] if self.context > 1 else []) + ["tensor"]
        across = [f"{a}={n}" for a, n in self.dcn.items() if n > 1]
        return sep.join(f"{a}={getattr(self, a)}" for a in axes) + (f" (dcn {','.join(across)})" if across else "")

    @property
    def context_chunks(self) -> int:
        """How many equal pieces the sequence is cut into for `context` (2c when load-balanced)."""
        return self.context * (2 if self.context_load_balance and self.context > 1 else 1)

    @property
    def batch_shards(self) -> int:
        return self.data * self.fsdp * self.expert


@dataclass(frozen=True)
class RematConfig:
    """Activation recomputation policy: what each name keeps is in `meshlm.parallel.remat.POLICIES`.
    `loss_chunks` > 1: the output layer and loss run in that many token chunks, each chunk's logits and
    their gradient made and dropped in the forward pass (`model.loss`); the whole logits otherwise."""

    policy: RematPolicy = "elementwise"
    loss_chunks: int = 1


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`, and global-norm clipping."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    # Adam's moments in host memory (ZeRO-Offload's optimizer state; not the `offload` remat policy,
    # which moves activations): streamed to the device for the update and back; checkpoints unchanged
    offload_state: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from: one dataset made by `meshlm data prepare`, or raw
    inputs (text files, directories, JSONL, Parquet) prepared into a cache on first use. Empty
    `paths` means the built-in corpus (the Python standard library's source)."""

    paths: tuple[str, ...] = ()
    tokenizer: str = ""  # path to an existing tokenizer.json; empty = train a byte-level BPE
    field: str = "text"  # the JSONL field / Parquet column holding a document
    val_fraction: float = 0.05
    max_corpus_mb: float = 16.0  # cap on raw text read (the built-in corpus is ~30 MB)
    cache_dir: str = ""  # empty = $MESHLM_CACHE or ~/.cache/meshlm
    verify: bool = True  # check every shard's digest and ids at startup (reads the data once)
    # no attention across the end-of-text boundaries inside a packed sequence; positions restart
    # at every document (learned positions; RoPE is relative, so its scores need no restart)
    document_mask: bool = False
    # a weighted mixture instead of `paths`: "WEIGHT:PATH" entries (a prepared dataset, or raw inputs
    # prepared as `paths` would be), sampled with Megatron's blend rule (meshlm.data.mixture)
    mixture: tuple[str, ...] = ()
    # batches carry a loss mask (only trained tokens count): set by `meshlm train` when the data was
    # prepared with --format chat or completion (packed rows), together with document_mask
    loss_mask: bool = False

    def mixture_sources(self) -> list[tuple[float, str]]:
        """`mixture` as [(weight, path)]; a ConfigError names a malformed entry."""
        out = []
        for entry in self.mixture:
            weight, sep, path = entry.partition(":")
            try:
                w = float(weight)
            except ValueError:
                w = math.nan
            if not sep or not path or not (math.isfinite(w) and w > 0):
                raise ConfigError(
                    f"data.mixture entry {entry!r} is not WEIGHT:PATH with a positive weight "
                    "(e.g. data.mixture=0.7:data/web,0.3:data/code)"
                )
            out.append((w, path))
        return out


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 500
    global_batch: int = 16  # sequences per optimizer step (the papers' B)
    microbatches: int = 1  # gradient accumulation: the batch is split into this many
    seq_len: int = 128  # s
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    # A step whose loss or gradient is not finite is never applied. "stop": training stops at the
    # next log/eval/checkpoint step, names the step and checkpoints the last good state. "skip": the
    # batch is skipped (counted in metrics) and training goes on, unless more than
    # max_consecutive_skips steps in a row are non-finite, which stops it as "stop" does.
    on_nonfinite: OnNonFinite = "stop"
    max_consecutive_skips: int = 10
    # JAX's persistent compilation cache in <cache_home>/xla (`meshlm train`): a rerun of the same
    # program, in any run directory, loads the compiled step instead of compiling it again
    compile_cache: bool = True
    # "A:B": a jax.profiler trace of steps A..B-1 (numbered from 1, as the progress line counts)
    # into <run_dir>/profile; empty: none
    profile_steps: str = ""

    def profile_range(self) -> tuple[int, int] | None:
        """(first, end) step numbers to profile, end exclusive; None when off."""
        if not self.profile_steps:
            return None
        first, _, end = self.profile_steps.partition(":")
        try:
            a, b = int(first), int(end)
        except ValueError:
            raise ConfigError(f"train.profile_steps={self.profile_steps!r}: expected A:B, e.g. 20:25") from None
        if not 1 <= a < b:
            raise ConfigError(f"train.profile_steps={self.profile_steps!r}: need 1 <= A < B (steps A..B-1)")
        return a, b


@dataclass(frozen=True)
class MetricsConfig:
    """Where a run's metrics go besides `<run_dir>/metrics.jsonl` and the console (process 0 only)."""

    tensorboard: bool = True  # event files in <run_dir>/tb (tensorboardX)
    wandb: str = ""  # a Weights & Biases project name; empty: off (needs the `wandb` extra)


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints of the whole train state in `<run_dir>/checkpoints` (or `dir`).

    Saved every `every` steps (0: only at the end and on SIGTERM/SIGINT), asynchronously unless
    `async_save` is off. Retention: the latest `keep`, plus every step divisible by `keep_every`
    (0: none). `resume` picks up the latest good checkpoint of the run directory. In-memory copies
    every `local_every` steps (0: off), on a tmpfs and a peer process: `local_checkpoint`.
    """

    every: int = 100
    keep: int = 2
    keep_every: int = 0
    async_save: bool = True
    resume: bool = True
    dir: str = ""  # empty = <run_dir>/checkpoints
    local_every: int = 0
    local_dir: str = ""  # empty = /dev/shm (the temporary directory where there is none)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
FINETUNE_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")  # `--set finetune.K` = model.K


def _section_class(name: str) -> type:
    return typing.get_type_hints(RunConfig)[name]


def from_dict(d: dict[str, Any]) -> RunConfig:
    """Inverse of `RunConfig.to_dict` (used to reload a run directory's config.json)."""
    sections = {}
    for name, values in d.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {name!r}; sections: {', '.join(SECTIONS)}")
        cls = _section_class(name)
        sections[name] = cls(**{k: _coerce(cls, k, v) for k, v in values.items()})
    return RunConfig(**sections)


# ----------------------------------------------------------------------------- overrides


def _field_type(cls: type, key: str) -> Any:
    hints = typing.get_type_hints(cls)
    if key not in hints:
        raise ConfigError(f"{cls.__name__} has no field {key!r}; fields: {', '.join(sorted(hints))}")
    return hints[key]


def _parse_scalar(tp: Any, raw: Any, where: str) -> Any:
    if typing.get_origin(tp) is Literal:
        allowed = typing.get_args(tp)
        if raw not in allowed:
            raise ConfigError(f"{where}={raw!r} is not one of {', '.join(map(str, allowed))}")
        return raw
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        low = str(raw).lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} expects a boolean (true/false), got {raw!r}")
    if tp is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{where} expects an integer, got {raw!r}")
        try:
            value = float(raw) if isinstance(raw, str) and "e" in raw.lower() else raw
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} expects an integer, got {raw!r}") from None
    if tp is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} expects a number, got {raw!r}") from None
    if tp is str:
        return str(raw)
    raise ConfigError(f"{where}: unsupported field type {tp}")


def _coerce(cls: type, key: str, raw: Any) -> Any:
    tp = _field_type(cls, key)
    where = f"{cls.__name__}.{key}"
    origin = typing.get_origin(tp)
    if origin is tuple:
        (elem, _) = typing.get_args(tp)
        items = raw if isinstance(raw, (list, tuple)) else [s for s in str(raw).split(",") if s]
        return tuple(_parse_scalar(elem, x, where) for x in items)
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{where}: union types are not supported in configs")
    return _parse_scalar(tp, raw, where)


def apply_overrides(cfg: RunConfig, overrides: list[str] | tuple[str, ...]) -> RunConfig:
    """Apply `section.key=value` strings, converting each value to the field's declared type."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        path, raw = item.split("=", 1)
        if path.count(".") != 1:
            raise ConfigError(f"--set key must be section.key (e.g. model.n_layers), got {path!r}")
        section, key = path.split(".")
        if section == "finetune":  # LoRA's settings, kept in the model section (the adapters are parameters)
            if key not in FINETUNE_KEYS:
                raise ConfigError(f"finetune.{key}: the finetune keys are {', '.join(FINETUNE_KEYS)} (model.lora_*)")
            section = "model"
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r}; sections: {', '.join(SECTIONS)}")
        sub = getattr(cfg, section)
        value = _coerce(type(sub), key, raw)
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sub, **{key: value})})
    return cfg


def parse_mesh(spec: str, dcn: bool = False) -> dict[str, int]:
    """`data=2,tensor=4` -> {'stage': 1, 'data': 2, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 4} (missing axes
    are 1); with `dcn` (`--dcn data=2`: ways across slices/nodes) -> {'dcn_data': 2}, tensor refused."""
    sizes, what = ({}, "--dcn") if dcn else (dict.fromkeys(MESH_AXES, 1), "mesh axis")
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if dcn and name == "tensor":
            raise ConfigError(
                "--dcn tensor: the tensor axis stays within a slice or node (its collectives run in every layer, "
                "P2 4.2); put data, fsdp, stage or context across slices"
            )
        if name not in MESH_AXES:
            raise ConfigError(f"unknown mesh axis {name!r}{' in --dcn' if dcn else ''}; axes: {', '.join(MESH_AXES)}")
        try:
            sizes[f"dcn_{name}" if dcn else name] = int(value)
        except ValueError:
            raise ConfigError(f"{what} {name} needs an integer size, got {value!r}") from None
    return sizes
