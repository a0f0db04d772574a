"""Typed, frozen run configuration.

A run is described by one `RunConfig` made of a handful of sections. Recipes (`recipes.py`) build
whole configs; the CLI changes single fields with `--set section.key=value`, type-checked here.
This module holds checks only, no training logic.
"""

from __future__ import annotations

import dataclasses
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
Attention = Literal["explicit", "blockwise", "fused"]
RopeScaling = Literal["none", "llama3"]
OnNonFinite = Literal["stop", "skip"]
# Recomputation policies: the names are owned here, their meaning by meshlm.parallel.remat.POLICIES
# (a test keeps the two equal), so validating a config imports no JAX.
ContextStrategy = Literal["all_gather", "ring", "all_to_all"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved"]
RematPolicy = Literal["elementwise", "selective", "full", "dots", "offload"]


class ConfigError(ValueError):
    """A configuration the user asked for cannot run; the message says why and what to change."""


def cache_home() -> Path:
    """meshlm's cache directory: $MESHLM_CACHE, else ~/.cache/meshlm (prepared data, the CPU peak
    probe, compiled programs)."""
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm"))


# Exit statuses of `meshlm` that `meshlm launch` never retries (a restart would fail the same way):
EXIT_CONFIG = 2  # a ConfigError: bad input
EXIT_NONFINITE = 3  # a non-finite step stopped training (train.on_nonfinite); the last good state is saved
EXIT_MISMATCH = 4  # `meshlm check` / `train --check`: the layout's gradients differ from one device's
FINAL_EXITS = {
    EXIT_CONFIG: "a configuration error",
    EXIT_NONFINITE: "a non-finite step (it would recur)",
    EXIT_MISMATCH: "a layout that differs from one device (meshlm check)",
}


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
    # llama: share the token embedding with the output layer (Llama 3.2 1B/3B); gpt always ties (GPT-2)
    tie_embeddings: bool = False
    # layers run in a lax.scan; unrolling k layers per iteration makes the program (and compile time)
    # grow with k, and was not faster than the scan end to end on CPU (BENCHMARKS-history.md). In
    # training and eval, k >= n_layers runs no loop at all: the layers called one after another on
    # the stacked weights split along the layer axis (decoding and pipeline chunks keep a scan);
    # on CPU that helped gpt medium most (1.26x tokens/s on one device), elsewhere mixed (BENCHMARKS.md)
    scan_unroll: int = 1
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

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

    `stage` (pipeline parallelism) splits the layers into `stage` x `virtual_stages` equal chunks;
    stage s holds chunks s, s+p, ... and `train.microbatches` microbatches flow through them in the
    order of `pipeline_schedule` (docs/pipeline.md).
    """

    stage: int = 1
    data: int = 1
    fsdp: int = 1
    context: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    context_strategy: ContextStrategy = "ring"
    context_load_balance: bool = True
    pipeline_schedule: PipelineSchedule = "1f1b"
    virtual_stages: int = 1  # model chunks per stage (interleaved schedule)
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
        axes = (["stage"] if self.stage > 1 else []) + ["data", "fsdp"]
        axes += (["context"] if self.context > 1 else []) + ["tensor"]
        across = [f"{a}={n}" for a, n in self.dcn.items() if n > 1]
        return sep.join(f"{a}={getattr(self, a)}" for a in axes) + (f" (dcn {','.join(across)})" if across else "")

    @property
    def context_chunks(self) -> int:
        """How many equal pieces the sequence is cut into for `context` (2c when load-balanced)."""
        return self.context * (2 if self.context_load_balance and self.context > 1 else 1)

    @property
    def batch_shards(self) -> int:
        return self.data * self.fsdp


@dataclass(frozen=True)
class RematConfig:
    """Activation recomputation policy: what each name keeps is in `meshlm.parallel.remat.POLICIES`."""

    policy: RematPolicy = "elementwise"


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
    (0: none). `resume` picks up the latest good checkpoint of the run directory.
    """

    every: int = 100
    keep: int = 2
    keep_every: int = 0
    async_save: bool = True
    resume: bool = True
    dir: str = ""  # empty = <run_dir>/checkpoints


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
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r}; sections: {', '.join(SECTIONS)}")
        sub = getattr(cfg, section)
        value = _coerce(type(sub), key, raw)
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sub, **{key: value})})
    return cfg


def parse_mesh(spec: str, dcn: bool = False) -> dict[str, int]:
    """`data=2,tensor=4` -> {'stage': 1, 'data': 2, 'fsdp': 1, 'context': 1, 'tensor': 4} (missing axes
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


# ----------------------------------------------------------------------------- validation


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
    _validate_parallel(cfg)
    _validate_run(cfg)
    _validate_divisibility(cfg)
    return cfg


def _validate_model(m: ModelConfig) -> None:
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "scan_unroll", "attention_block"):
        _need(getattr(m, name) > 0, f"model.{name} must be positive")
    _need(m.attention_chunk >= 0, "model.attention_chunk must be >= 0 (0: the whole sequence at once)")
    _need(m.n_heads % m.kv_heads == 0, f"model.n_heads={m.n_heads} must be a multiple of n_kv_heads={m.kv_heads}")
    _need(
        m.head_dim > 0 or m.d_model % m.n_heads == 0,
        f"model.d_model={m.d_model} is not divisible by n_heads={m.n_heads}; set model.head_dim",
    )
    _need(m.dim_head % 2 == 0 or m.family == "gpt", "llama needs an even head_dim for RoPE")
    if m.rope_scaling == "llama3":
        _need(m.family == "llama", "model.rope_scaling applies to the llama family (gpt has learned positions)")
        _need(
            m.rope_factor >= 1 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor and m.rope_original_len > 0,
            "model.rope_scaling=llama3 needs rope_factor >= 1, 0 < rope_low_freq_factor < rope_high_freq_factor "
            "and rope_original_len > 0",
        )
    _need(0.0 <= m.dropout < 1.0, "model.dropout must be in [0, 1)")
    _need(m.family == "gpt" or m.dropout == 0.0, "model.dropout is only implemented for the gpt family")
    _need(
        m.attention != "fused" or m.dropout == 0.0,
        "model.attention=fused has no attention-probability dropout; set model.dropout=0 or attention=explicit "
        "(or blockwise)",
    )


def _validate_parallel(cfg: RunConfig) -> None:
    """Sequence, context and pipeline parallelism: what each needs of the model and the sizes."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in MESH_AXES:
        _need(getattr(p, name) >= 1, f"parallel.{name} (mesh axis size) must be >= 1")
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
    if p.stage > 1 or p.virtual_stages > 1:
        from meshlm.parallel.schedules import ScheduleError, check_sizes  # plain Python, no JAX

        _need(p.stage > 1, f"parallel.virtual_stages={p.virtual_stages} needs a pipeline (parallel.stage > 1)")
        try:
            check_sizes(p.pipeline_schedule, p.stage, t.microbatches, p.virtual_stages, m.n_layers)
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
        _need(
            p.context == 1,
            "pipeline parallelism (parallel.stage > 1) does not compose with context parallelism yet; "
            "use parallel.context=1 (docs/pipeline.md)",
        )


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
    c = cfg.checkpoint
    _need(c.every >= 0 and c.keep_every >= 0, "checkpoint.every and checkpoint.keep_every must be >= 0")
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
        f"is not divisible by mesh axes data*fsdp={p.batch_shards}",
    )
