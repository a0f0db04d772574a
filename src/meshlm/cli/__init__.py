"""`meshlm` command line, one module per command family:

- `train`: train, launch;
- `insight`: memory, plan, bench, report, recipes, check;
- `models`: convert, generate, eval;
- `data`: data prepare, data info;
- `common`: the run arguments, the resolved config and the settings made before JAX loads.

Only this entry point touches process-wide state (XLA_FLAGS, JAX_PLATFORMS, glibc's allocator
settings), and it does so before jax is imported: jax reads the device count once, at import. So
no module of this package imports JAX at import time.
"""

from __future__ import annotations

import argparse
import os
import sys

from meshlm.cli import data, insight, models, train
from meshlm.cli.common import EXIT_TRAINING
from meshlm.config import ConfigError
from meshlm.exits import EXIT_CONFIG, EXIT_NO_SPACE, EXIT_NONFINITE

FAMILIES = (train, insight, models, data)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser of every subcommand, and each subcommand's handler by name."""
    parser = argparse.ArgumentParser(prog="meshlm", description="Train language models on a device mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    handlers: dict = {}
    for family in FAMILIES:
        handlers |= family.add_parsers(sub)
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if argv[:1] == ["launch"]:  # everything after `--` is the train command, passed through untouched
        if "--" not in argv:
            print("meshlm: error: usage: meshlm launch [options] -- train [train options]", file=sys.stderr)
            return EXIT_CONFIG
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1 :]
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    args.train_args = train_args
    args.argv = argv
    try:
        return handlers[args.command](args)
    except ConfigError as e:
        print(f"meshlm: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("meshlm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code = _exit_code(e, args.command)
        if code is None:
            raise
        _exit_now_if_abandoned(code)
        return code


def _exit_now_if_abandoned(code: int) -> None:
    """After a multi-process save failed, exit without joining Orbax's save threads: they wait on a
    barrier that the failed process never reaches (`checkpoint.ABANDONED_THREADS`)."""
    checkpoint = sys.modules.get("meshlm.checkpoint")
    if checkpoint is not None and checkpoint.ABANDONED_THREADS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(e: Exception, command: str) -> int | None:
    """The exit status of a known failure (printing its message), None for an unexpected one."""
    from meshlm.checkpoint import CheckpointError, CheckpointSpace
    from meshlm.train_loop import NonFiniteStep, Preempted, TrainingError

    if isinstance(e, Preempted):
        print(f"meshlm: {e}", file=sys.stderr)
        return 128 + e.signum
    if isinstance(e, NonFiniteStep):
        print(f"meshlm: training stopped: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    if isinstance(e, CheckpointSpace):
        print(f"meshlm: training stopped: {e}", file=sys.stderr)
        return EXIT_NO_SPACE
    if isinstance(e, (TrainingError, CheckpointError)):
        what = "training stopped" if command in ("train", "launch") else "error"
        print(f"meshlm: {what}: {e}", file=sys.stderr)
        return EXIT_TRAINING
    return None
