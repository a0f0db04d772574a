"""`meshlm train` and `meshlm launch` (N processes of one train command, supervised)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from meshlm.cli.common import add_run_args, prepare, resolve_config
from meshlm.config import ConfigError, RunConfig
from meshlm.exits import EXIT_MISMATCH


def add_parsers(sub) -> dict:
    """The `train` and `launch` subcommands; returns their handlers by name."""
    train = sub.add_parser("train", help="train a model (default: the `tiny` recipe on the built-in corpus)")
    add_train_args(train)
    launch = sub.add_parser(
        "launch",
        help="run N processes of one train command, supervise and restart them (meshlm launch ... -- train ...)",
    )
    launch.add_argument("--processes", type=int, default=2, help="processes to start")
    launch.add_argument(
        "--devices-per-process",
        type=int,
        help="simulated CPU devices per process (omit to use each process's own accelerators)",
    )
    launch.add_argument("--max-restarts", type=int, default=3, help="restarts of the whole group before giving up")
    launch.add_argument("--hang-timeout", type=float, default=600, help="seconds without progress = hung")
    launch.add_argument("--startup-timeout", type=float, default=900, help="seconds allowed before the first step")
    launch.add_argument("--ray", metavar="ADDRESS", help="place one process per node of this Ray cluster")
    launch.add_argument(
        "--min-processes",
        type=int,
        help="elastic: when lost processes are not replaced within --replace-timeout, continue on as few as "
        "this many (a smaller data or fsdp axis, more microbatches), and regrow when capacity returns",
    )
    launch.add_argument("--replace-timeout", type=float, default=300, help="seconds to wait for lost processes")
    launch.add_argument(
        "--capacity-cmd",
        metavar="CMD",
        help="elastic: a shell command printing how many processes can run now (e.g. healthy nodes); "
        "under --ray, by default, the cluster's live nodes",
    )
    launch.add_argument(
        "--capacity-poll", type=float, default=5.0, help="elastic: seconds between capacity checks while shrunk"
    )
    return {"train": cmd_train, "launch": cmd_launch}


def add_train_args(train: argparse.ArgumentParser) -> None:
    add_run_args(train)
    train.add_argument("--run-dir", help="output directory (default: runs/<recipe>-<time>)")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument(
        "--init-from",
        metavar="PATH",
        help="start from another run's weights (run dir, checkpoints dir or step dir), or hf:DIR (a Hugging "
        "Face directory: its model config and, unless data.tokenizer is set, its tokenizer)",
    )
    train.add_argument(
        "--stop-after", type=int, metavar="STEP", help="checkpoint and exit after this step (resume later)"
    )
    dist = train.add_argument_group("multi-process (JAX distributed runtime; see docs/multihost.md)")
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (or MESHLM_COORDINATOR)")
    dist.add_argument("--num-processes", type=int, help="processes in the run (or MESHLM_NUM_PROCESSES)")
    dist.add_argument("--process-id", type=int, help="this process's index (or MESHLM_PROCESS_ID)")
    dist.add_argument(
        "--distributed", action="store_true", help="auto-detect the process group (SLURM, Cloud TPU, GKE)"
    )
    dist.add_argument("--init-timeout", type=int, default=60, help="seconds to wait for the group to form")
    train.add_argument(
        "--dry-run", action="store_true", help="build the mesh, compile the step, print the startup report, exit"
    )
    train.add_argument("--quiet", action="store_true", help="print nothing but errors")
    train.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="json: one JSON object per logged step on stdout (every other message on stderr)",
    )
    train.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="jax.profiler trace of steps A..B-1 into <run_dir>/profile (shorthand for --set train.profile_steps=A:B)",
    )
    train.add_argument(
        "--check",
        action="store_true",
        help="before the first step, check the layout against one device (meshlm check) and stop if it differs",
    )
    train.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (shorthand for --set train.compile_cache=false)",
    )


def cmd_train(args: argparse.Namespace) -> int:
    cfg = prepare(args, host_allocator=True)
    from meshlm.data.prepare import fit_config_to_data

    # packed chat data turns on the loss and document masks: before --print-config and --check see the config
    cfg = fit_config_to_data(cfg, log=(lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr)))
    if args.print_config:
        print(cfg.to_json())
        return 0
    if args.init_from and args.init_from.startswith("hf:"):  # no weights, or only pickles: say so now
        from meshlm.interop import hf

        hf.weight_files(hf.hf_path(args.init_from))
    from meshlm.parallel.mesh import init_distributed, process_group

    if args.run_dir:  # a SLURM task: heartbeats, and a requeue read as a restart after a failure
        from meshlm.launch import slurm

        os.environ.update(slurm.task_env(Path(args.run_dir)))
    group = process_group(args.coordinator, args.num_processes, args.process_id, args.distributed, args.init_timeout)
    if group.enabled and not args.run_dir:
        raise ConfigError("a multi-process run needs --run-dir (one directory that every process can reach)")
    init_distributed(group)
    _compile_cache(cfg.train.compile_cache)
    if args.check and not args.dry_run:
        from meshlm.insight import check

        result = check.run_check(cfg)
        if not args.quiet:  # stdout is the JSON records' with --log-format json
            out = sys.stderr if args.log_format == "json" else sys.stdout
            print("\n".join(check.format_result(result)), file=out, flush=True)
        if not result.equal:
            print("meshlm: training not started: the layout differs from one device (meshlm check)", file=sys.stderr)
            return EXIT_MISMATCH
    from meshlm.trainer import train

    run_dir = Path(args.run_dir or f"runs/{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    train(
        cfg,
        run_dir,
        quiet=args.quiet,
        log_format=args.log_format,
        dry_run=args.dry_run,
        init_from=args.init_from,
        stop_after=args.stop_after,
    )
    return 0


def _compile_cache(on: bool) -> None:
    """JAX's persistent compilation cache in <cache_home>/xla, set before anything compiles (JAX
    decides once per process whether to use it)."""
    if not on:
        return
    import jax

    from meshlm.config import cache_home
    from meshlm.platform.compile_cache import write_on_every_cpu_process

    jax.config.update("jax_compilation_cache_dir", str(cache_home() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # the train step, not small helpers
    write_on_every_cpu_process()  # a restarted CPU group finds its step on every process


def _train_command(train_args: list[str]) -> tuple[argparse.Namespace, RunConfig]:
    if not train_args or train_args[0] != "train":
        raise ConfigError("meshlm launch runs a train command: meshlm launch --processes N -- train [options]")
    parser = argparse.ArgumentParser(prog="meshlm")
    add_train_args(parser.add_subparsers(dest="command", required=True).add_parser("train"))
    parsed = parser.parse_args(train_args)
    return parsed, resolve_config(parsed)


def launch_plan(train_args: list[str], processes: int, devices_per_process: int | None) -> tuple[list[str], Path]:
    """Parse the train command `meshlm launch` will run and check it against the group size."""
    from meshlm.launch.supervisor import plan_launch

    parsed, cfg = _train_command(train_args)
    return plan_launch(train_args, cfg, parsed.run_dir, parsed.recipe, processes, devices_per_process)


def cmd_launch(args: argparse.Namespace) -> int:
    from meshlm.launch.supervisor import Supervisor

    train_args, run_dir = launch_plan(args.train_args, args.processes, args.devices_per_process)
    if args.max_restarts < 0 or args.hang_timeout <= 0 or args.replace_timeout < 0:
        raise ConfigError("--max-restarts and --replace-timeout must be >= 0 and --hang-timeout > 0")
    options = dict(max_restarts=args.max_restarts, hang_timeout=args.hang_timeout, startup_timeout=args.startup_timeout)
    if args.min_processes is not None:
        if not 1 <= args.min_processes <= args.processes:
            raise ConfigError(f"--min-processes must be between 1 and --processes {args.processes}")
        if not args.capacity_cmd and not args.ray:
            raise ConfigError(
                "--min-processes (elastic) needs --capacity-cmd with the local launcher: the command that says "
                "how many processes can run (this machine can always restart all of them; under --ray the "
                "cluster's live nodes say it)"
            )
        options |= dict(min_processes=args.min_processes, replace_timeout=args.replace_timeout)
        options |= dict(capacity_cmd=args.capacity_cmd, capacity_poll=args.capacity_poll)
        options["cfg"] = _train_command(train_args)[1]
    if args.ray:
        from meshlm.launch.ray_cluster import RaySupervisor

        sup = RaySupervisor(train_args, args.processes, args.devices_per_process, run_dir, address=args.ray, **options)
    else:
        sup = Supervisor(train_args, args.processes, args.devices_per_process, run_dir, **options)
    return sup.run()
