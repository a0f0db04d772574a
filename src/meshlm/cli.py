"""`meshlm` command line: train | launch | data | memory | plan | bench | report | recipes | convert |
generate | eval.

Only this entry point touches process-wide state (XLA_FLAGS, JAX_PLATFORMS, glibc's allocator
settings), and it does so before jax is imported: jax reads the device count once, at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from meshlm.config import EXIT_CONFIG, EXIT_NONFINITE, ConfigError, RunConfig, apply_overrides, parse_mesh
from meshlm.platform import host_memory, xla_flags  # jax-free
from meshlm.platform.hardware import ACCELERATORS  # a jax-free table

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
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (shorthand for --set train.compile_cache=false)",
    )
    memory = sub.add_parser(
        "memory", help="activation memory per device: formula (P2 Table 2, extended) vs measured, every policy"
    )
    _add_run_args(memory)
    memory.add_argument("--json", action="store_true", help="machine-readable output")
    memory.add_argument("--no-measure", action="store_true", help="formula only (no compilation)")
    memory.add_argument("--terms", type=int, default=4, help="largest per-layer terms to show per row")
    plan = sub.add_parser("plan", help="rank mesh / SP / remat / microbatch layouts for a device budget")
    plan.add_argument("--recipe", default="tiny")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    plan.add_argument("--devices", type=int, required=True, help="number of devices to plan for")
    plan.add_argument("--device", default="a100", help="device kind: " + ", ".join(ACCELERATORS))
    plan.add_argument("--device-memory", help="memory per device, e.g. 80GiB (default: the device kind's)")
    plan.add_argument("--top", type=int, default=10, help="feasible plans to show")
    plan.add_argument("--verify", action="store_true", help="compile the best plan (2 layers) on simulated devices")
    plan.add_argument("--json", action="store_true")
    bench = sub.add_parser("bench", help="sweep layouts x remat policies here: step time, MFU/HFU, activation bytes")
    bench.add_argument("--recipe", default="tiny")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    bench.add_argument("--devices", type=int, default=8, help="simulated CPU devices (each layout uses all)")
    bench.add_argument("--layouts", help="';'-separated meshes, '+sp' for sequence parallelism (default: a sweep)")
    bench.add_argument("--policies", default="elementwise,selective,full")
    bench.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    bench.add_argument("--run-dir", help="output directory (default: runs/bench-<time>)")
    sub.add_parser("recipes", help="list the named recipes")
    convert = sub.add_parser(
        "convert", help="Hugging Face checkpoints in and out: --from-hf DIR --to RUN_DIR, or --from RUN_DIR --to-hf DIR"
    )
    src = convert.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--from", dest="from_run", metavar="RUN_DIR", help="a meshlm run directory")
    convert.add_argument("--to", metavar="RUN_DIR", help="with --from-hf: the meshlm run directory to write")
    convert.add_argument("--to-hf", metavar="DIR", help="with --from: the Hugging Face directory to write")
    convert.add_argument("--step", type=int, help="with --from: this checkpoint step (default: the latest good one)")
    convert.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="with --to-hf: the stored weights' dtype",
    )
    convert.add_argument(
        "--max-shard-size", default="2GiB", help="with --to-hf: split the weights into files of this size"
    )
    convert.add_argument(
        "--mesh", help="with --from-hf: place the weights on this mesh while converting (default: 1 device)"
    )
    convert.add_argument("--devices", type=int, help="simulated CPU devices (default: the mesh size)")
    gen = sub.add_parser("generate", help="sample text from a run (or hf:DIR) with a KV cache")
    gen.add_argument("--run-dir", required=True, help="a meshlm run directory, or hf:DIR for a Hugging Face directory")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable: one batch)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=0.95, help="... and the smallest set reaching this mass (1: all)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--step", type=int, help="this checkpoint step (default: the latest good one)")
    gen.add_argument("--mesh", help="e.g. tensor=4 (default: 1 device)")
    gen.add_argument("--devices", type=int, help="simulated CPU devices (default: the mesh size)")
    gen.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")
    ev = sub.add_parser("eval", help="loss, perplexity and bits per byte of a run on a prepared split or text files")
    ev.add_argument("--run-dir", required=True, help="a meshlm run directory, or hf:DIR")
    ev.add_argument(
        "--data",
        nargs="+",
        default=[],
        help="a prepared dataset, or text/JSONL/Parquet files (default: the run's data)",
    )
    ev.add_argument("--split", default="val", choices=("train", "val"), help="split of a prepared dataset")
    ev.add_argument("--field", default="text", help="JSONL field / Parquet column of a document")
    ev.add_argument("--step", type=int)
    ev.add_argument("--seq-len", type=int, help="window length (default: the run's train.seq_len)")
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many tokens (0: all)")
    ev.add_argument("--mesh", help="e.g. data=2 or tensor=4 (default: 1 device)")
    ev.add_argument("--devices", type=int)
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    report = sub.add_parser("report", help="report.md + plots of a run (finished, running or interrupted)")
    report.add_argument("run_dir", help="a run directory (holds config.json, metrics.jsonl, run.json)")
    report.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR", help="overlay these runs' curves")
    report.add_argument("--out", help="output directory (default: <run_dir>/report)")
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
    data = sub.add_parser("data", help="prepare a tokenized dataset (token shards + index) or inspect one")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="text files, directories, JSONL, Parquet -> token shards")
    prep.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories")
    prep.add_argument("--out", required=True, help="output directory")
    tok = prep.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="an existing tokenizer.json (Hugging Face tokenizers)")
    tok.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this many tokens")
    prep.add_argument("--field", default="text", help="JSONL field / Parquet column holding a document")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="every round(1/f)-th document is held out")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    prep.add_argument("--workers", type=int, default=0, help="tokenizer threads (default: all cores)")
    prep.add_argument("--max-mb", type=float, default=0, help="stop after this much text (0: all)")
    info = data_sub.add_parser("info", help="summarise and verify a prepared dataset")
    info.add_argument("path")
    info.add_argument("--vocab-size", type=int, help="also check every id fits this model vocabulary")
    return parser


def resolve_config(args: argparse.Namespace) -> RunConfig:
    from meshlm import recipes

    cfg = recipes.get(args.recipe)
    init_from = getattr(args, "init_from", None)
    if init_from:  # the model (and, unless data.tokenizer is set, the tokenizer) are the source's
        cfg = _adopt_source(cfg, init_from)
    overrides = list(args.overrides)
    if args.mesh:
        overrides += [f"parallel.{k}={v}" for k, v in parse_mesh(args.mesh).items()]
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if getattr(args, "no_compile_cache", False):
        overrides.append("train.compile_cache=false")
    if getattr(args, "profile_steps", None):
        overrides.append(f"train.profile_steps={args.profile_steps}")
    return apply_overrides(cfg, overrides)


def _adopt_source(cfg: RunConfig, init_from: str) -> RunConfig:
    """`--init-from`: the model section of the source (a Hugging Face config.json, or the
    config.json of the meshlm run a checkpoint belongs to), keeping this run's dtype, attention
    kind and unrolling; and its tokenizer.json when data.tokenizer is not set. `--set model.*`
    still applies after this."""
    from meshlm.interop import hf

    if hf.is_hf_ref(init_from):
        root = hf.hf_path(init_from)
        model = hf.model_config(root)
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
    cfg = hf.with_model(cfg, model)
    if not cfg.data.tokenizer and (root / "tokenizer.json").is_file():
        tokenizer = str(root.absolute() / "tokenizer.json")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    return cfg


def _set_device_count(n: int, explicit: bool, host_allocator: bool = False) -> None:
    """Simulated host devices, the backend's XLA flags (`meshlm.platform.xla_flags`) and, for training, the
    host allocator's first half (`meshlm.platform.host_memory.apply`); must run before jax is imported."""
    if "jax" in sys.modules:
        return
    xla_flags.apply()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    if explicit:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if host_allocator:
        host_memory.apply()  # after JAX_PLATFORMS: it decides CPU vs GPU


def _prepare(args: argparse.Namespace, host_allocator: bool = False) -> RunConfig:
    """Resolve and validate the config, and set the simulated device count before jax loads."""
    cfg = resolve_config(args)
    if args.devices is not None and args.devices < 1:
        raise ConfigError("--devices must be >= 1")
    _set_device_count(args.devices or cfg.parallel.n_devices, args.devices is not None, host_allocator)
    from meshlm.config import validate

    return validate(cfg)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _prepare(args, host_allocator=True)
    if args.print_config:
        print(cfg.to_json())
        return 0
    if args.init_from and args.init_from.startswith("hf:"):  # no weights, or only pickles: say so now
        from meshlm.interop import hf

        hf.weight_files(hf.hf_path(args.init_from))
    from meshlm.parallel.mesh import init_distributed, process_group

    group = process_group(args.coordinator, args.num_processes, args.process_id, args.distributed, args.init_timeout)
    if group.enabled and not args.run_dir:
        raise ConfigError("a multi-process run needs --run-dir (one directory that every process can reach)")
    init_distributed(group)
    _compile_cache(cfg.train.compile_cache)
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

    jax.config.update("jax_compilation_cache_dir", str(cache_home() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # the train step, not small helpers


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def cmd_memory(args: argparse.Namespace) -> int:
    cfg = _prepare(args)
    from meshlm import accounting
    from meshlm.insight.memory import memory_table

    pipelined = cfg.parallel.stage > 1  # the measurement is of an unpipelined forward/backward
    rows = memory_table(cfg, measure=not args.no_measure and not pipelined)
    if args.json:
        out = []
        for r in rows:
            item = {"policy": r.policy, "sequence_parallel": r.sequence_parallel, "formula": r.formula}
            if r.measured is not None:
                item["measured"] = {
                    "activation_bytes": r.measured.activation_bytes,
                    "host_bytes": r.measured.host_bytes,
                    "compiled_output_bytes": r.measured.compiled_output_bytes,
                    "residuals": [vars(x) for x in r.measured.residuals],
                }
                item["ratio"] = r.ratio
            out.append(item)
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    m, t = cfg.model, cfg.train
    b = t.global_batch // t.microbatches // cfg.parallel.batch_shards
    table = Table(
        title=f"activation memory per device: {args.recipe} ({m.family}, L={m.n_layers}, s={t.seq_len}, "
        f"b={b} per device, h={m.d_model}, a={m.n_heads}, {m.dtype}), mesh "
        f"{cfg.parallel.describe()}",
        title_justify="left",
    )
    for col in ("policy", "SP", "per layer MiB", "formula MiB", "measured MiB", "ratio", "host MiB (f/m)"):
        table.add_column(col, justify="left" if col in ("policy", "SP") else "right")
    table.add_column("largest per-layer terms (MiB)")
    if pipelined:
        par = cfg.parallel
        per = m.n_layers // (par.stage * par.virtual_stages)
        held = accounting.pipeline_in_flight(cfg)
        print(
            f"pipeline: {par.pipeline_schedule}, {par.stage} stages x {par.virtual_stages} chunks of {per} layers, "
            f"{t.microbatches} microbatches; stage 0 (the largest) holds {held} microbatch-chunks' stored "
            f"activations = {held * per} layers' worth, plus its buffers (formula = stage 0). Not measured here "
            "(the measurement is an unpipelined program); tests/test_pipeline.py checks stage 0 against the "
            "compiled pipeline."
        )
    for r in rows:
        terms = sorted(r.formula["per_layer"].items(), key=lambda kv: -kv[1])[: args.terms]
        table.add_row(
            r.policy,
            "on" if r.sequence_parallel else "off",
            _mib(r.formula["layer_total"]),
            _mib(r.formula["total"]),
            "-" if r.measured is None else _mib(r.measured.activation_bytes),
            "-" if r.ratio is None else f"{r.ratio:.3f}",
            f"{_mib(r.formula['host_total'])} / {_mib(r.measured.host_bytes) if r.measured else '-'}"
            if r.formula["host_total"]
            else "",
            ", ".join(f"{k} {_mib(v)}" for k, v in terms),
        )
    console = Console()
    if not console.is_terminal:
        console.width = 220
    console.print(table)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.device not in ACCELERATORS:
        raise ConfigError(f"unknown device kind {args.device!r}; choose from {', '.join(ACCELERATORS)}")
    if args.devices < 1:
        raise ConfigError("--devices must be >= 1")
    limit = parse_bytes(args.device_memory) if args.device_memory else None
    from meshlm import recipes

    cfg = apply_overrides(recipes.get(args.recipe), args.overrides)
    _set_device_count(min(args.devices, 8) if args.verify else 1, explicit=True)
    from meshlm.insight import plan as planner

    device = ACCELERATORS[args.device]
    limit = device.memory if limit is None else limit
    plans = planner.enumerate_plans(cfg, args.devices, device, limit)
    feasible = [p for p in plans if not p.rejected]
    verified = planner.verify(feasible) if args.verify and feasible else None
    miss = None if feasible else planner.closest_miss(cfg, plans, args.devices, device, limit)
    why = planner.explain_choice(plans)
    if args.json:
        print(json.dumps(planner.to_json(plans, verified) | {"error": miss, "context_choice": why}, indent=2))
        return 0 if feasible else EXIT_CONFIG
    for line in planner.format_plans(plans, args.top, device, limit):
        print(line)
    if why:
        print(why)
    if verified:
        print(verified)
    if miss:
        print(f"meshlm: error: {miss}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from meshlm import recipes

    base = apply_overrides(recipes.get(args.recipe), args.overrides)
    if args.devices < 1 or args.steps < 1:
        raise ConfigError("--devices and --steps must be >= 1")
    _set_device_count(args.devices, explicit=True)
    from meshlm.insight import bench

    layouts = args.layouts.split(";") if args.layouts else bench.default_layouts(base, args.devices)
    policies = [p for p in args.policies.split(",") if p]
    rows, _, peak_source = bench.run_bench(base, layouts, policies, args.steps)
    run_dir = Path(args.run_dir or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    m, t = base.model, base.train
    header = (
        f"Command: `meshlm {' '.join(args.argv)}` ({time.strftime('%Y-%m-%d')}): `{args.recipe}` ({m.family}, "
        f"L={m.n_layers}, h={m.d_model}, s={t.seq_len}, batch {t.global_batch}, {m.dtype}) on {args.devices} "
        f"simulated devices, median of {args.steps} interleaved steps"
    )
    text = bench.markdown(rows, peak_source, header)
    (run_dir / "bench.md").write_text(text + "\n")
    bench.chart(rows, run_dir / "bench.png")
    print(text)
    print(f"wrote {run_dir / 'bench.md'} and {run_dir / 'bench.png'}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from meshlm.observe.run_report import write_report

    print(write_report(args.run_dir, args.compare, args.out))
    return 0


def _inference_mesh(args: argparse.Namespace):
    """The ParallelConfig of --mesh (default 1 device), with the simulated device count set."""
    from meshlm.config import ParallelConfig

    sizes = parse_mesh(args.mesh) if args.mesh else {}
    parallel = ParallelConfig(**sizes)
    if args.devices is not None and args.devices < parallel.n_devices:
        raise ConfigError(f"--devices {args.devices} is fewer than the mesh's {parallel.n_devices}")
    _set_device_count(args.devices or parallel.n_devices, explicit=args.devices is not None or bool(args.mesh))
    return parallel


def cmd_convert(args: argparse.Namespace) -> int:
    if args.from_hf:
        if not args.to or args.to_hf:
            raise ConfigError("meshlm convert --from-hf DIR needs --to RUN_DIR (a meshlm run directory)")
        parallel = _inference_mesh(args)
        from meshlm.interop.convert import import_hf

        import_hf(args.from_hf, args.to, parallel)
        return 0
    if not args.to_hf or args.to:
        raise ConfigError("meshlm convert --from RUN_DIR needs --to-hf DIR (a Hugging Face directory)")
    if args.from_run.startswith("hf:"):
        raise ConfigError("--from hf:DIR is already a Hugging Face directory; --from takes a meshlm run directory")
    max_shard = parse_bytes(args.max_shard_size)
    parallel = _inference_mesh(args)
    from meshlm.interop.convert import export_hf

    export_hf(args.from_run, args.to_hf, args.step, args.dtype, int(max_shard), parallel)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        except OSError as e:
            raise ConfigError(f"cannot read --prompt-file: {e}") from None
    if not prompts:
        raise ConfigError("give at least one --prompt (or --prompt-file)")
    parallel = _inference_mesh(args)
    from meshlm.inference import Generator, TextStream, load_model

    model = load_model(args.run_dir, args.step, parallel)
    ids = [model.encode(p) for p in prompts]
    if any(not i for i in ids):
        raise ConfigError("a prompt encodes to no tokens; give some text")
    stream = len(prompts) == 1 and not args.json
    if stream:
        print(prompts[0], end="", flush=True)
    out = Generator(model).generate(
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        on_token=TextStream(model, lambda piece: print(piece, end="", flush=True)) if stream else None,
    )
    texts = [model.decode(t) for t in out.tokens]
    new_tokens = sum(len(t) for t in out.tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "model": model.source,
                    "completions": [
                        {"prompt": p, "completion": c, "tokens": t}
                        for p, c, t in zip(prompts, texts, out.tokens, strict=True)
                    ],
                    "prefill_s": out.prefill_s,
                    "decode_s": out.decode_s,
                }
            )
        )
        return 0
    if stream:
        print()
    else:
        for p, c in zip(prompts, texts, strict=True):
            print(f"{p}{c}\n---")
    rate = out.decode_steps * len(prompts) / out.decode_s if out.decode_s > 0 else float("nan")
    print(
        f"[{model.source}: {new_tokens} new tokens; prefill {out.prefill_s:.2f}s (incl. compile), "
        f"decode {rate:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.max_tokens < 0 or (args.seq_len is not None and args.seq_len < 1):
        raise ConfigError("--batch-size and --seq-len must be >= 1, --max-tokens >= 0")
    parallel = _inference_mesh(args)
    from meshlm.inference import eval_tokens, evaluate, load_model

    model = load_model(args.run_dir, args.step, parallel)
    run_dir = None if args.run_dir.startswith("hf:") else Path(args.run_dir)
    tokens, what = eval_tokens(model, args.data, args.split, run_dir, args.field)
    seq_len = args.seq_len or model.cfg.train.seq_len
    progress = None
    if sys.stderr.isatty() and not args.json:
        from rich.progress import Progress

        bar = Progress(transient=True)
        task = bar.add_task("evaluating", total=None)
        bar.start()
        progress = lambda done, total: bar.update(task, completed=done, total=total)
    try:
        result = evaluate(model, tokens, seq_len, args.batch_size, args.max_tokens, progress)
    finally:
        if progress is not None:
            bar.stop()
    result = {"model": model.source, "data": what, "seq_len": seq_len} | result
    if args.json:
        print(json.dumps(result))
    else:
        bpb = result["bits_per_byte"]
        print(
            f"{what}: {result['tokens']:,} tokens, {result['bytes']:,} bytes | loss {result['loss']:.4f} nats/token | "
            f"perplexity {result['perplexity']:.2f} | {'-' if bpb is None else f'{bpb:.4f}'} bits/byte"
        )
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from meshlm import accounting, recipes

    for name, fn in recipes.RECIPES.items():
        c = fn()
        m, p = c.model, c.parallel
        print(
            f"{name:12s} {m.family:5s} {accounting.param_count(m) / 1e6:10.1f}M params  "
            f"L={m.n_layers} h={m.d_model} a={m.n_heads} kv={m.kv_heads} v={m.vocab_size}  "
            f"mesh {p.describe(',')}"
        )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    if args.data_command == "info":
        from meshlm.data.prepare import load

        data = load(args.path)
        data.verify(args.vocab_size or data.meta["tokenizer_vocab_size"])
        m = data.meta
        print(
            f"{data.root}: format {m['format']}, {m['dtype']}, vocabulary {m['tokenizer_vocab_size']}, "
            f"end-of-text id {m['eot_id']}"
        )
        for split in ("train", "val"):
            shards = m["splits"][split]
            print(
                f"  {split}: {m[split + '_tokens']:,} tokens, {m['documents'][split]:,} documents, {len(shards)} shards"
            )
        print("  verified: sizes, BLAKE2b digests, ids < vocabulary")
        return 0
    if args.vocab_size is not None and args.vocab_size < 258:
        raise ConfigError("--vocab-size must be >= 258 (256 byte tokens + <|endoftext|> + at least one merge)")
    if args.shard_tokens < 1 or args.max_mb < 0:
        raise ConfigError("--shard-tokens must be >= 1 and --max-mb >= 0")
    if args.workers:
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # read by tokenizers when it starts its pool
    from meshlm.data import corpus
    from meshlm.data.prepare import fingerprint_files, write_dataset

    files = corpus.resolve_files(args.input)
    key, total = fingerprint_files(files, [args.field, args.max_mb])
    max_bytes = int(args.max_mb * 1e6)
    print(f"preparing {len(files)} files, {total / 1e6:.1f} MB -> {args.out}", file=sys.stderr)
    write_dataset(
        lambda: corpus.iter_documents(files, args.field, max_bytes),
        Path(args.out),
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        source_fingerprint=key,
        total_bytes=min(total, max_bytes) if max_bytes else total,
        progress=sys.stderr.isatty(),
        log=lambda m: print(m, file=sys.stderr),
    )
    return 0


def launch_plan(train_args: list[str], processes: int, devices_per_process: int | None) -> tuple[list[str], Path]:
    """Parse the train command `meshlm launch` will run and check it against the group size."""
    from meshlm.launch.supervisor import plan_launch

    if not train_args or train_args[0] != "train":
        raise ConfigError("meshlm launch runs a train command: meshlm launch --processes N -- train [options]")
    parsed = build_parser().parse_args(train_args)
    return plan_launch(
        train_args, resolve_config(parsed), parsed.run_dir, parsed.recipe, processes, devices_per_process
    )


def cmd_launch(args: argparse.Namespace) -> int:
    from meshlm.launch.supervisor import Supervisor

    train_args, run_dir = launch_plan(args.train_args, args.processes, args.devices_per_process)
    if args.max_restarts < 0 or args.hang_timeout <= 0:
        raise ConfigError("--max-restarts must be >= 0 and --hang-timeout > 0")
    options = dict(max_restarts=args.max_restarts, hang_timeout=args.hang_timeout, startup_timeout=args.startup_timeout)
    if args.ray:
        from meshlm.launch.ray_cluster import RaySupervisor

        sup = RaySupervisor(train_args, args.processes, args.devices_per_process, run_dir, address=args.ray, **options)
    else:
        sup = Supervisor(train_args, args.processes, args.devices_per_process, run_dir, **options)
    return sup.run()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if argv[:1] == ["launch"]:  # everything after `--` is the train command, passed through untouched
        if "--" not in argv:
            print("meshlm: error: usage: meshlm launch [options] -- train [train options]", file=sys.stderr)
            return EXIT_CONFIG
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    args.train_args = train_args
    args.argv = argv
    try:
        commands = {"train": cmd_train, "memory": cmd_memory, "plan": cmd_plan, "bench": cmd_bench}
        commands |= {"recipes": cmd_recipes, "data": cmd_data, "launch": cmd_launch, "report": cmd_report}
        commands |= {"convert": cmd_convert, "generate": cmd_generate, "eval": cmd_eval}
        return commands[args.command](args)
    except ConfigError as e:
        print(f"meshlm: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("meshlm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from meshlm.checkpoint import CheckpointError
        from meshlm.trainer import NonFiniteStep, Preempted, TrainingError

        if isinstance(e, Preempted):
            print(f"meshlm: {e}", file=sys.stderr)
            return 128 + e.signum
        if isinstance(e, NonFiniteStep):
            print(f"meshlm: training stopped: {e}", file=sys.stderr)
            return EXIT_NONFINITE
        if isinstance(e, (TrainingError, CheckpointError)):
            what = "training stopped" if args.command in ("train", "launch") else "error"
            print(f"meshlm: {what}: {e}", file=sys.stderr)
            return EXIT_TRAINING
        raise


if __name__ == "__main__":
    sys.exit(main())
