"""Where weights come from when they are not a run's own full checkpoint: another run's checkpoint
or a Hugging Face directory (`train --init-from`, `check --init-from`), and the frozen base a LoRA
run's checkpoints point at (they hold the adapters only: `with_base` puts them back on it)."""

from __future__ import annotations

import dataclasses
import json

import jax

from meshlm.checkpoint import Checkpointer, describe, resolve_checkpoint
from meshlm.config import ConfigError, RunConfig
from meshlm.data import tokenizer as toks
from meshlm.interop import hf
from meshlm.model import lora
from meshlm.model.params import init_params, param_specs


def base_run_config(cfg: RunConfig) -> RunConfig:
    """The run without LoRA's adapters: the model its base weights belong to."""
    return dataclasses.replace(cfg, model=lora.base_config(cfg.model))


def checksums(params: dict) -> dict[str, list[int]]:
    """Every tensor's bit checksum (`checkpoint.describe`), by name."""
    return {name: d["checksum"] for name, d in describe(params).items()}


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


def hf_base(source: str) -> str:
    """The Hugging Face directory a LoRA run's base pointer (`meta["base"]["source"]`) leads to,
    for a PEFT adapter's base_model_name_or_path: hf:DIR itself, or the source of the `convert
    --from-hf` import that a checkpoint step belongs to; "" for `init` or a trained meshlm run
    (its weights are no Hugging Face model's)."""
    if hf.is_hf_ref(source):
        return str(hf.hf_path(source))
    if source in ("", "init"):
        return ""
    converted = resolve_checkpoint(source)[0].parent / "converted.json"
    return json.loads(converted.read_text()).get("from", "") if converted.is_file() else ""


def with_base(params: dict, meta: dict, cfg: RunConfig, abstract: dict) -> dict:
    """A restored step's parameters: as saved, or for a LoRA run's step (meta["base"]) its adapters
    on the frozen base the step points at - `train.seed`'s initialisation ("init"), hf:DIR, or a
    meshlm checkpoint step - which must be, bit for bit, the base the adapters were trained on."""
    pointer = meta.get("base")
    if not pointer:
        return params
    src = pointer["source"]
    try:
        if src == "init":
            shardings = jax.tree.map(lambda a: a.sharding, abstract)
            fresh = jax.jit(lambda k: init_params(param_specs(cfg.model), k), out_shardings=shardings)
            base = lora.without_adapters(fresh(jax.random.key(pointer["seed"])))
        else:
            base, _ = source_params(src, base_run_config(cfg), lora.without_adapters(abstract))
    except Exception as e:  # gone, unreadable, corrupt, another shape: all say which base
        raise ConfigError(
            f"this LoRA checkpoint holds its adapters only, and its base {src} cannot be read: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        ) from e
    sums = checksums(base)
    changed = sorted(n for n in sums.keys() | pointer["checksums"].keys() if sums.get(n) != pointer["checksums"].get(n))
    if changed:
        raise ConfigError(
            f"the LoRA base {src} is not the one this run's adapters were trained on: {len(changed)} of "
            f"{len(pointer['checksums'])} tensors differ ({', '.join(changed[:3])}); put that base back, or start "
            "a new run"
        )
    return lora.with_adapters(base, params)
