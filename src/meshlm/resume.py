"""Where a run's first state comes from: its own latest good checkpoint (resume), else another
run's or a Hugging Face model's weights (`--init-from`), else a fresh initialisation - with the
checks that keep a resumed or adopted run meaningful (same tokenizer; config and data changes
reported)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax

from meshlm.checkpoint import Checkpointer, resolve_checkpoint
from meshlm.config import ConfigError, RunConfig
from meshlm.data import tokenizer as toks
from meshlm.interop import hf
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


def base_model(init_from: str | None, run_dir: Path) -> str:
    """The Hugging Face directory whose weights a run starts from, as an absolute path: `--init-from
    hf:DIR`, or the source of a `convert --from-hf` import given as `--init-from`; on a resume, what
    this run recorded before. "" otherwise: a trained meshlm run's weights are no Hugging Face
    model's (export it, and start from that)."""
    if not init_from:
        info = run_dir / "run.json"
        return json.loads(info.read_text()).get("base_model", "") if info.is_file() else ""
    if hf.is_hf_ref(init_from):
        return str(hf.hf_path(init_from).absolute())
    root = resolve_checkpoint(init_from)[0].parent
    if (root / "converted.json").is_file():
        return json.loads((root / "converted.json").read_text()).get("from", "")
    return ""


def restore_or_init(cfg, ckpt, abstract, specs, layout, tx, identity, init_from, log) -> TrainState:
    """Resume from the run's own latest good checkpoint, else `init_from`'s weights, else fresh."""
    if cfg.checkpoint.resume:
        restored = _resume(cfg, ckpt, abstract, identity, log)
        if restored is not None:
            return restored
    elif ckpt.steps():  # starting over must not mix with (or silently skip saving over) another run's steps
        raise ConfigError(
            f"checkpoint.resume=false but {ckpt.directory} holds checkpoints {ckpt.steps()} of an earlier run; "
            "use a new run dir or --set checkpoint.dir=..."
        )
    state = init_state(specs, layout, tx, cfg.train.seed, **placement(cfg))
    if init_from:
        state = state._replace(params=_adopted_params(cfg, abstract, identity, init_from, log, state.params))
    return state


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
    meta = restored.meta
    check_tokenizer(meta, identity, f"checkpoint {ckpt.directory}/{meta['step']}")
    log.print(f"resumed from {ckpt.directory}/{meta['step']} (saved by meshlm {meta['code_version']})")
    changes = config_changes(meta.get("config", {}), cfg)
    if changes:
        log.print("  config differs from the checkpoint's: " + "; ".join(changes))
    if meta.get("data_fingerprint") != identity["data_fingerprint"]:
        log.print("  warning: the training data differs from the checkpoint's; batches will not repeat")
    return restored.state


def _adopted_params(cfg, abstract, identity, init_from: str, log, fresh: dict) -> dict:
    """`--init-from`'s weights, sharded like this run's parameters, its tokenizer checked against
    this run's; optimizer state and step stay fresh. With LoRA the source is the base model (without
    adapters) and the adapters are this run's fresh ones (`fresh`: B = 0, so training starts from
    the source's function)."""
    if cfg.model.lora_rank:
        base_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=0))
        layers = {k: v for k, v in abstract.params["layers"].items() if "_lora_" not in k}
        params, source = source_params(init_from, base_cfg, abstract.params | {"layers": layers})
        adapters = {k: v for k, v in fresh["layers"].items() if "_lora_" in k}
        params = params | {"layers": params["layers"] | adapters}
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
    return params


def source_params(init_from: str, cfg: RunConfig, abstract: dict) -> tuple[dict, dict]:
    """The weights of `init_from` (a Hugging Face directory as hf:DIR, or a meshlm run, checkpoints
    directory or step), placed as `abstract` (ShapeDtypeStructs with shardings) says; and what is known
    of the source: {"where", "hf", "tokenizer_fingerprint" (when known)}."""
    if hf.is_hf_ref(init_from):
        root = hf.hf_path(init_from)
        params = hf.load_params(root, cfg.model, jax.tree.map(lambda a: a.sharding, abstract))
        source = {"where": str(root), "hf": True}
        if (root / "tokenizer.json").is_file():
            source["tokenizer_fingerprint"] = toks.fingerprint(toks.load(root / "tokenizer.json"))
        return params, source
    directory, step = resolve_checkpoint(init_from)
    reader = Checkpointer(directory, cfg.checkpoint, log=lambda _: None, read_only=True)
    try:
        params, meta = reader.restore_params(abstract, step)
    finally:
        reader.close()
    source = {"where": f"{directory}/{meta['step']}", "hf": False}
    if meta.get("tokenizer_fingerprint"):
        source["tokenizer_fingerprint"] = meta["tokenizer_fingerprint"]
    return params, source
