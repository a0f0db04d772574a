"""`meshlm` command line: train | recipes.

Only this entry point touches process-wide state (XLA_FLAGS, JAX_PLATFORMS), and it does so
before jax is imported: jax reads the device count once, at import.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from meshlm.config import ConfigError, RunConfig, apply_overrides, parse_mesh

EXIT_CONFIG, EXIT_TRAINING = 2, 1


def _add_run_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="Train language models on a device mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: the `tiny` recipe on the built-in corpus)")
    _add_run_args(train)
    train.add_argument("--run-dir", help="output directory (default: runs/<recipe>-<time>)")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    sub.add_parser("recipes", help="list the named recipes")
    return parser


def resolve_config(args: argparse.Namespace) -> RunConfig:
    from meshlm import recipes

    cfg = recipes.get(args.recipe)
    overrides = list(args.overrides)
    if args.mesh:
        overrides += [f"parallel.{k}={v}" for k, v in parse_mesh(args.mesh).items()]
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    return apply_overrides(cfg, overrides)


def _set_device_count(n: int, explicit: bool) -> None:
    """Simulated host devices; must run before jax is imported."""
    if "jax" in sys.modules:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    if explicit:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cmd_train(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if args.devices is not None and args.devices < 1:
        raise ConfigError("--devices must be >= 1")
    _set_device_count(args.devices or cfg.parallel.n_devices, explicit=args.devices is not None)
    from meshlm.config import validate

    validate(cfg)
    if args.print_config:
        print(cfg.to_json())
        return 0
    from meshlm.trainer import train

    run_dir = Path(args.run_dir or f"runs/{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    train(cfg, run_dir)
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from meshlm import accounting, recipes

    for name, fn in recipes.RECIPES.items():
        c = fn()
        m, p = c.model, c.parallel
        print(
            f"{name:12s} {m.family:5s} {accounting.param_count(m) / 1e6:10.1f}M params  "
            f"L={m.n_layers} h={m.d_model} a={m.n_heads} kv={m.kv_heads} v={m.vocab_size}  "
            f"mesh data={p.data},fsdp={p.fsdp},tensor={p.tensor}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": cmd_train, "recipes": cmd_recipes}[args.command](args)
    except ConfigError as e:
        print(f"meshlm: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("meshlm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from meshlm.trainer import TrainingError

        if isinstance(e, TrainingError):
            print(f"meshlm: training stopped: {e}", file=sys.stderr)
            return EXIT_TRAINING
        raise


if __name__ == "__main__":
    sys.exit(main())
