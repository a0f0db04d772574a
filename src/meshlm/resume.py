"""Where a run's first state comes from: its own latest good checkpoint (resume), else another
run's or a Hugging Face model's weights (`--init-from`), else a fresh initialisation - with the
checks that keep a resumed or adopted run meaningful (same tokenizer; config and data changes
reported)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from meshlm.checkpoint import resolve_checkpoint
from meshlm.config import ConfigError, RunConfig
from meshlm.interop import hf
from meshlm.model import lora
from meshlm.sources import base_run_config, checksums, source_params, with_base
from meshlm.train_loop import TrainingError
from meshlm.train_state import TrainState, init_state, placement


def checkpoint_dir(cfg: RunConfig, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else run_dir / "checkpoints"


def config_changes(saved: dict, cfg: RunConfig) -> list[str]:
    now = json.loads(cfg.to_json())
    return [
        f"{section}.{k}: {saved.get(section, {}).get(k)!r} -> {v!r}"
        for section, values in now.items()
        for k, v in values.items()
        if saved.get(section, {}).get(k, v) != v
    ]


def check_tokenizer(meta: dict, identity: dict, where: str) -> None:
    saved, now = meta.get("tokenizer_fingerprint"), identity["tokenizer_fingerprint"]
    if saved and saved != now:
        raise ConfigError(
            f"{where} was trained with tokenizer {saved}, but this run's data uses tokenizer {now}: token ids "
            "would mean different things. Use the same tokenizer (data.tokenizer) or a new run"
        )


def copy_side_files(init_from: str | None, run_dir: Path) -> None:
    """A run started from a Hugging Face model (directly or via `convert`) keeps that model's
    tokenizer_config, generation config (stop ids) and chat template, for generate and export."""
    if not init_from:
        return
    root = hf.hf_path(init_from) if hf.is_hf_ref(init_from) else resolve_checkpoint(init_from)[0].parent
    for name in hf.SIDE_FILES:
        if (root / name).is_file() and not (run_dir / name).exists():
            shutil.copyfile(root / name, run_dir / name)


def restore_or_init(cfg, ckpt, abstract, specs, layout, tx, identity, init_from, log, local=None) -> TrainState:
    """Resume from the run's in-memory copies (`local`, when they are at least as new as the disk's),
    else its own latest good checkpoint, else `init_from`'s weights, else fresh.
    A LoRA run's checkpoints hold its adapters only: `identity["base"]` (the meta every save
    carries) is set here to where its frozen base comes from, with the base's checksums."""
    if cfg.checkpoint.resume:
        restored = _from_memory(cfg, ckpt, abstract, identity, log, local) if local is not None else None
        if restored is None:
            restored = _resume(cfg, ckpt, abstract, identity, log)
        if restored is not None:
            return restored
    elif ckpt.steps():  # starting over must not mix with (or silently skip saving over) another run's steps
        raise ConfigError(
            f"checkpoint.resume=false but {ckpt.directory} holds checkpoints {ckpt.steps()} of an earlier run; "
            "use a new run dir or --set checkpoint.dir=..."
        )
    state, source = init_state(specs, layout, tx, cfg.train.seed, **placement(cfg)), "init"
    if init_from:
        params, source = _adopted_params(cfg, abstract, identity, init_from, log, state.params)
        state = state._replace(params=params)
    if cfg.model.lora_rank:
        sums = checksums(lora.without_adapters(state.params))
        identity["base"] = {"source": source, "seed": cfg.train.seed, "checksums": sums}
    return state


def _from_memory(cfg, ckpt, abstract, identity, log, local) -> TrainState | None:
    """The in-memory copies' newest common step (`local_checkpoint`), when not older than the
    disk's; only when `meshlm launch` restarts a group after a failure, or SLURM a requeued job
    ($MESHLM_FAULT, `launch.slurm`): any other
    start (by hand, a regrow, after a preemption) uses the disk and drops the copies."""
    if not os.environ.get("MESHLM_FAULT"):
        local.discard()
        return None
    steps = ckpt.steps()
    restored = local.restore(abstract, steps[-1] if steps else None)
    if restored is None:
        return None
    meta = restored.meta
    check_tokenizer(meta, identity, f"the in-memory copy of step {restored.step}")
    if meta.get("base"):
        identity["base"] = meta["base"]
    peers = f" (process {', '.join(map(str, restored.from_peer))} from its peer's copy)" if restored.from_peer else ""
    disk = f"; the disk's newest is step {steps[-1]}" if steps else "; no disk checkpoint"
    log.print(f"resumed from the in-memory copies of step {restored.step}{peers}{disk}")
    _report_differences(meta, cfg, identity, log)
    return restored.state


def _report_differences(meta: dict, cfg, identity: dict, log) -> None:
    """What a resumed run changed: config fields, and the data (batches will not repeat)."""
    changes = config_changes(meta.get("config", {}), cfg)
    if changes:
        log.print("  config differs from the checkpoint's: " + "; ".join(changes))
    if meta.get("data_fingerprint") != identity["data_fingerprint"]:
        log.print("  warning: the training data differs from the checkpoint's; batches will not repeat")


def _resume(cfg, ckpt, abstract, identity, log) -> TrainState | None:
    """The run's latest good checkpoint (None if it has none; an error if none is readable)."""
    had = ckpt.steps()
    restored = ckpt.restore_latest(abstract)
    if restored is None:
        if had:
            raise TrainingError(
                f"no readable checkpoint left in {ckpt.directory} (steps {had} were moved to "
                f"{ckpt.directory}.corrupt); to start over, use a new run dir or --set checkpoint.resume=false"
            )
        return None
    meta, state = restored.meta, restored.state
    check_tokenizer(meta, identity, f"checkpoint {ckpt.directory}/{meta['step']}")
    if meta.get("base"):  # a LoRA run: its adapters, on the base they were trained on
        state = state._replace(params=with_base(state.params, meta, cfg, abstract.params))
        identity["base"] = meta["base"]
        log.print(f"  LoRA adapters on the frozen base {meta['base']['source']} (checksums equal)")
    log.print(f"resumed from {ckpt.directory}/{meta['step']} (saved by meshlm {meta['code_version']})")
    _report_differences(meta, cfg, identity, log)
    return state


def _adopted_params(cfg, abstract, identity, init_from: str, log, fresh: dict) -> tuple[dict, str]:
    """(`--init-from`'s weights, sharded like this run's parameters, its tokenizer checked against
    this run's; the source as a LoRA base pointer: hf:DIR or a checkpoint step directory).
    Optimizer state and step stay fresh. With LoRA the source is the base model (without adapters)
    and the adapters are this run's fresh ones (`fresh`: B = 0, so training starts from the
    source's function)."""
    if cfg.model.lora_rank:
        params, source = source_params(init_from, base_run_config(cfg), lora.without_adapters(abstract.params))
        params = lora.with_adapters(params, fresh)
        log.print(f"  LoRA r={cfg.model.lora_rank} on {', '.join(cfg.model.lora_targets)}: the base weights are frozen")
    else:
        params, source = source_params(init_from, cfg, abstract.params)
    if "tokenizer_fingerprint" in source:
        check_tokenizer(source, identity, f"--init-from {source['where']}")
    elif source["hf"]:
        log.print(
            f"  warning: {source['where']} has no tokenizer.json; make sure data.tokenizer is the model's tokenizer"
        )
    kind = "Hugging Face " if source["hf"] else ""
    log.print(f"initialised parameters from {kind}{source['where']} (optimizer state and step are fresh)")
    return params, (hf.HF_PREFIX if source["hf"] else "") + str(Path(source["where"]).absolute())
