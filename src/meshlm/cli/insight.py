"""`meshlm memory`, `plan`, `bench`, `report`, `recipes` and `check`: looking at a configuration and at runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from meshlm.cli.common import add_run_args, mib, parse_bytes, prepare, set_device_count
from meshlm.config import ConfigError, apply_overrides, parse_mesh
from meshlm.exits import EXIT_CONFIG, EXIT_MISMATCH
from meshlm.platform.hardware import ACCELERATORS  # a jax-free table


def add_parsers(sub) -> dict:
    """The inspection subcommands; returns their handlers by name."""
    memory = sub.add_parser(
        "memory", help="activation memory per device: formula (P2 Table 2, extended) vs measured, every policy"
    )
    add_run_args(memory)
    memory.add_argument("--json", action="store_true", help="machine-readable output")
    memory.add_argument("--no-measure", action="store_true", help="formula only (no compilation)")
    memory.add_argument("--terms", type=int, default=4, help="largest per-layer terms to show per row")
    plan = sub.add_parser("plan", help="rank mesh / SP / remat / microbatch layouts for a device budget")
    plan.add_argument("--recipe", default="tiny")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    plan.add_argument("--devices", type=int, required=True, help="number of devices to plan for")
    plan.add_argument("--device", default="a100", help="device kind: " + ", ".join(ACCELERATORS))
    plan.add_argument("--device-memory", help="memory per device, e.g. 80GiB (default: the device kind's)")
    plan.add_argument("--dcn", help="mesh axes split across slices/nodes, e.g. data=2: priced at the slow links")
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
    report = sub.add_parser("report", help="report.md + plots of a run (finished, running or interrupted)")
    report.add_argument("run_dir", help="a run directory (holds config.json, metrics.jsonl, run.json)")
    report.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR", help="overlay these runs' curves")
    report.add_argument("--out", help="output directory (default: <run_dir>/report)")
    check = sub.add_parser(
        "check", help="prove this layout equal to one device: one step's raw gradients, loss and norm (docs/check.md)"
    )
    add_check_args(check)
    handlers = {"memory": cmd_memory, "plan": cmd_plan, "bench": cmd_bench, "report": cmd_report}
    return handlers | {"recipes": cmd_recipes, "check": cmd_check}


def add_check_args(check) -> None:
    add_run_args(check)
    check.add_argument(
        "--init-from", metavar="PATH", help="the model of a run or hf:DIR, as train's; with --full, its weights too"
    )
    check.add_argument("--full", action="store_true", help="the real sizes (needs their memory), not the check model")
    check.add_argument("--json", action="store_true", help="one JSON object")


def cmd_check(args: argparse.Namespace) -> int:
    cfg = prepare(args)
    from meshlm.insight import check

    params = check.source_params(cfg, args.init_from) if args.full and args.init_from else None
    result = check.run_check(cfg, full=args.full, params=params)
    print(json.dumps(check.to_json(result), indent=2) if args.json else "\n".join(check.format_result(result)))
    return 0 if result.equal else EXIT_MISMATCH


def cmd_memory(args: argparse.Namespace) -> int:
    cfg = prepare(args)
    from meshlm.insight.memory import memory_table

    pipelined = cfg.parallel.stage > 1  # the measurement is of an unpipelined forward/backward
    rows = memory_table(cfg, measure=not args.no_measure and not pipelined)
    if args.json:
        print(json.dumps([_memory_row_json(r) for r in rows], indent=2))
        return 0
    if pipelined:
        print(_pipeline_note(cfg))
    _print_memory_table(args, cfg, rows)
    return 0


def _memory_row_json(r) -> dict:
    item = {"policy": r.policy, "sequence_parallel": r.sequence_parallel, "formula": r.formula}
    if r.measured is not None:
        item["measured"] = {
            "activation_bytes": r.measured.activation_bytes,
            "host_bytes": r.measured.host_bytes,
            "compiled_output_bytes": r.measured.compiled_output_bytes,
            "residuals": [vars(x) for x in r.measured.residuals],
        }
        item["ratio"] = r.ratio
    return item


def _pipeline_note(cfg) -> str:
    from meshlm import pipeline_memory
    from meshlm.parallel.schedules import chunk_slots, pad_count, pipeline_unit

    par, m = cfg.parallel, cfg.model
    unit, chunks = pipeline_unit(m), par.stage * par.virtual_stages
    per = chunk_slots(unit.count, chunks)  # uneven: pads too; no dense first layers
    what = "a layer each" if len(unit.kinds) == 1 else f"a unit of {len(unit.kinds)} layers each"
    if pads := pad_count(unit.count, chunks):  # uneven stages
        what += f"; pad slots, of zero weights: {pads} of {chunks * per}"
    held = pipeline_memory.pipeline_in_flight(cfg)
    return (
        f"pipeline: {par.pipeline_schedule} ({par.pipeline_ticks} ticks), {par.stage} stages x "
        f"{par.virtual_stages} chunks of {per} slots ({what}), "
        f"{cfg.train.microbatches} microbatches; stage 0 (the largest) holds {held} microbatch-chunks' stored "
        f"activations = {held * per} slots' worth, plus its buffers (formula = stage 0). Not measured here "
        "(the measurement is an unpipelined program); tests/test_pipeline.py checks stage 0 against the "
        "compiled pipeline."
    )


def _print_memory_table(args: argparse.Namespace, cfg, rows) -> None:
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
    for r in rows:
        terms = sorted(r.formula["per_layer"].items(), key=lambda kv: -kv[1])[: args.terms]
        host = r.formula["host_total"]
        table.add_row(
            r.policy,
            "on" if r.sequence_parallel else "off",
            mib(r.formula["layer_total"]),
            mib(r.formula["total"]),
            "-" if r.measured is None else mib(r.measured.activation_bytes),
            "-" if r.ratio is None else f"{r.ratio:.3f}",
            f"{mib(host)} / {mib(r.measured.host_bytes) if r.measured else '-'}" if host else "",
            ", ".join(f"{k} {mib(v)}" for k, v in terms),
        )
    console = Console()
    if not console.is_terminal:
        console.width = 220
    console.print(table)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.device not in ACCELERATORS:
        raise ConfigError(f"unknown device kind {args.device!r}; choose from {', '.join(ACCELERATORS)}")
    if args.devices < 1:
        raise ConfigError("--devices must be >= 1")
    limit = parse_bytes(args.device_memory) if args.device_memory else None
    from meshlm import recipes

    dcn = [f"parallel.{k}={v}" for k, v in parse_mesh(args.dcn, dcn=True).items()] if args.dcn else []
    cfg = apply_overrides(recipes.get(args.recipe), [*args.overrides, *dcn])
    set_device_count(min(args.devices, 8) if args.verify else 1, explicit=True)
    from meshlm.accounting import dtype_bytes
    from meshlm.insight import plan as planner
    from meshlm.insight import plan_report
    from meshlm.model.mla_costs import cache_bytes_per_token

    device = ACCELERATORS[args.device]
    limit = device.memory if limit is None else limit
    plans = planner.enumerate_plans(cfg, args.devices, device, limit)
    feasible = [p for p in plans if not p.rejected]
    verified = plan_report.verify(feasible) if args.verify and feasible else None
    miss = None if feasible else plan_report.closest_miss(cfg, plans, args.devices, device, limit)
    why, optimizer = plan_report.explain_choice(plans), plan_report.explain_optimizer(plans)
    strategy, experts = plan_report.explain_context_strategy(plans), plan_report.explain_experts(plans, device)
    if args.json:
        extra = {"error": miss, "context_choice": why, "context_strategy_choice": strategy}
        extra |= {"optimizer_choice": optimizer, "expert_choice": experts}
        extra |= {"cache_bytes_per_token": cache_bytes_per_token(cfg.model, dtype_bytes(cfg.model.dtype))}
        extra |= {"published_layout": plan_report.PUBLISHED.get(args.recipe)}
        print(json.dumps(plan_report.to_json(plans, device, verified) | extra, indent=2))
        return 0 if feasible else EXIT_CONFIG
    for line in plan_report.format_plans(plans, args.top, device, limit):
        print(line)
    for reason in (
        why,
        strategy,
        optimizer,
        experts,
        plan_report.decoding_cache(cfg),
        plan_report.PUBLISHED.get(args.recipe),
    ):
        if reason:
            print(reason)
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
    set_device_count(args.devices, explicit=True)
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


def cmd_recipes(args: argparse.Namespace) -> int:
    from meshlm import accounting, recipes

    for name, fn in recipes.RECIPES.items():
        c = fn()
        m, p = c.model, c.parallel
        moe = f"  E={m.n_experts} k={m.experts_per_token} ({accounting.active_param_count(m) / 1e6:.1f}M active)"
        print(
            f"{name:13s} {m.family:5s} {accounting.param_count(m) / 1e6:10.1f}M params  "
            f"L={m.n_layers} h={m.d_model} a={m.n_heads} kv={m.kv_heads} v={m.vocab_size}  "
            f"mesh {p.describe(',')}{moe if m.moe else ''}"
        )
    return 0
