"""What every command family shares: the run arguments, the resolved config, and the process-wide
settings (simulated device count, XLA flags, host allocator) made before JAX is imported.

Nothing here imports JAX: jax reads the device count once, at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from meshlm.config import ConfigError, ParallelConfig, RunConfig, apply_overrides, parse_mesh
from meshlm.platform import host_memory, xla_flags  # jax-free
from meshlm.validation import validate

EXIT_TRAINING = 1


def parse_bytes(text: str) -> float:
    """'80GiB', '80GB', '512MiB' or a plain number of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
    low = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(unit):
            low, mult = low[: -len(unit)], scale
            break
    else:
        mult = 1
    try:
        return float(low) * mult
    except ValueError:
        raise ConfigError(f"cannot read a memory size from {text!r} (e.g. 80GiB)") from None


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="tiny", help="named configuration (see `meshlm recipes`)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field, type-checked (repeatable), e.g. --set model.n_layers=8",
    )
    p.add_argument("--mesh", help="mesh axis sizes, e.g. data=2,fsdp=1,tensor=4 (product = devices)")
    p.add_argument("--devices", type=int, help="number of simulated CPU devices (default: the mesh size)")
    p.add_argument(
        "--dcn",
        help="how many ways mesh axes split across TPU slices or GPU nodes, e.g. data=2 (docs/multihost.md)",
    )
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")


def resolve_config(args: argparse.Namespace) -> RunConfig:
    from meshlm import recipes

    cfg = recipes.get(args.recipe)
    init_from = getattr(args, "init_from", None)
    if init_from:  # the model (and, unless data.tokenizer is set, the tokenizer) are the source's
        cfg = adopt_source(cfg, init_from)
    overrides = list(args.overrides)
    if args.mesh:
        overrides += [f"parallel.{k}={v}" for k, v in parse_mesh(args.mesh).items()]
    if getattr(args, "dcn", None):
        overrides += [f"parallel.{k}={v}" for k, v in parse_mesh(args.dcn, dcn=True).items()]
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if getattr(args, "no_compile_cache", False):
        overrides.append("train.compile_cache=false")
    if getattr(args, "profile_steps", None):
        overrides.append(f"train.profile_steps={args.profile_steps}")
    return apply_overrides(cfg, overrides)


def adopt_source(cfg: RunConfig, init_from: str) -> RunConfig:
    """`--init-from`: the model section of the source (a Hugging Face config.json, or the
    config.json of the meshlm run a checkpoint belongs to), keeping this run's dtype, attention
    kind and unrolling; and its tokenizer.json when data.tokenizer is not set. `--set model.*`
    still applies after this."""
    from meshlm.interop import hf, hf_tables

    if hf.is_hf_ref(init_from):
        root = hf.hf_path(init_from)
        model = hf_tables.model_config(root)
    else:
        from meshlm.checkpoint import resolve_checkpoint
        from meshlm.config import from_dict

        directory, _ = resolve_checkpoint(init_from)
        root = directory.parent
        if not (root / "config.json").is_file():  # a checkpoint dir on its own: the recipe's model
            return cfg
        try:
            model = from_dict(json.loads((root / "config.json").read_text())).model
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {root / 'config.json'}: {e}") from None
    if model.lora_rank:
        raise ConfigError(
            f"--init-from {init_from}: a LoRA run (model.lora_rank={model.lora_rank}); fold its adapters first "
            "(meshlm convert --from RUN --to-hf DIR) and start from hf:DIR"
        )
    cfg = hf_tables.with_model(cfg, model)
    if not cfg.data.tokenizer and (root / "tokenizer.json").is_file():
        tokenizer = str(root.absolute() / "tokenizer.json")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    return cfg


def set_device_count(n: int, explicit: bool, host_allocator: bool = False) -> None:
    """Simulated host devices, the backend's XLA flags (`meshlm.platform.xla_flags`) and, for training, the
    host allocator's first half (`meshlm.platform.host_memory.apply`); must run before jax is imported."""
    if xla_flags.prepare_backend(n, cpu=explicit) and host_allocator:
        host_memory.apply()  # after JAX_PLATFORMS: it decides CPU vs GPU


def prepare(args: argparse.Namespace, host_allocator: bool = False) -> RunConfig:
    """Resolve and validate the config, and set the simulated device count before jax loads."""
    cfg = resolve_config(args)
    if args.devices is not None and args.devices < 1:
        raise ConfigError("--devices must be >= 1")
    set_device_count(args.devices or cfg.parallel.n_devices, args.devices is not None, host_allocator)
    return validate(cfg)


def inference_mesh(args: argparse.Namespace):
    """The ParallelConfig of --mesh (default 1 device), with the simulated device count set."""
    sizes = parse_mesh(args.mesh) if args.mesh else {}
    parallel = ParallelConfig(**sizes)
    if args.devices is not None and args.devices < parallel.n_devices:
        raise ConfigError(f"--devices {args.devices} is fewer than the mesh's {parallel.n_devices}")
    set_device_count(args.devices or parallel.n_devices, explicit=args.devices is not None or bool(args.mesh))
    return parallel


def mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"
