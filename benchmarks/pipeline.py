"""Pipeline parallelism on CPU (simulated devices): step time against the bubble, where the
executor's time goes, compile time against m and p.

1. Step time vs m at p = 4 for 1F1B, interleaved 1F1B (v = 2), zb1 and GPipe, and 1F1B, zb1 and
   ZB-V with single ticks (Megatron's in-flight counts): a llama of d=256,
   8 layers, fp32, s=256, 2 sequences per microbatch, m = 8 and 16 microbatches (so the batch
   grows with m), next to the schedule's ticks and lockstep bubble (p-1)/(v m), and one device
   accumulating the same microbatches. Untimed rounds until the host heap stops growing, then
   alternating rounds, medians; and the steps that still grew the heap (zb1's keeps growing for
   tens of steps under the host allocator settings: each such step zeroes ~300 MB of fresh pages),
   with the median of the other steps against one device's. 2 cores under 4 simulated
   devices: an idle stage's core goes to the busy ones, so a bubble shows only in part.
2. Where the time goes at m = 16 (1F1B, zb1 and zb1 with single ticks against one device): one profiled step each
   (`jax.profiler`), the device threads' time per microbatch by kind of XLA op - the chunk's
   compute, the stash and inbox slots, sends (collective-permute, which includes waiting for the
   slowest stage), buffer fills, the embeddings' gather. Thread time, summed over devices: 4
   devices contend for 2 cores, which stretches every row, compute included.
3. Compile time of the whole train step vs m (p = 4, 1F1B) and vs p (m = 8): the schedule is data
   (a table scanned over), so it must not grow with m.

The process runs under meshlm's host allocator settings (`meshlm.platform.host_memory`), as
`meshlm train` does on CPU.

    python benchmarks/pipeline.py [--rounds 5] [--write] [--ring] [--heap] [--memory] [--uneven]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from meshlm.platform import host_memory  # jax-free

# Before JAX starts threads: the host allocator settings `meshlm train` uses on CPU. Without them
# every step faults its temporary buffers in afresh (4 devices' worth here), and a variant with
# more temporary memory (zb1's weight slots) pays for it in system time, not in its schedule.
host_memory.apply()
host_memory.keep_freed(None)

import jax

from _markdown import write_section
from _timing import median_step_seconds
from meshlm.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.schedules import chunk_slots, schedule_for
from meshlm.step import abstract_batch, make_train_step
from meshlm.train_state import abstract_state, placement, setup
from meshlm.validation import validate

MICRO = 2  # sequences per microbatch
SETTLE = 15  # untimed rounds at most, until the host heap stops growing (`median_step_seconds`)


def config(m: int, mesh: dict, schedule: str = "1f1b", v: int = 1, ticks: str = "paired", layers: int = 8) -> RunConfig:
    model = ModelConfig(
        family="llama", vocab_size=4096, d_model=256, n_layers=layers, n_heads=8, n_kv_heads=4, max_seq_len=256
    )
    parallel = ParallelConfig(**mesh, pipeline_schedule=schedule, virtual_stages=v, pipeline_ticks=ticks)
    train = TrainConfig(global_batch=MICRO * m, microbatches=m, seq_len=256, steps=1000)
    return validate(RunConfig(model=model, parallel=parallel, optim=OptimConfig(warmup_steps=0), train=train))


def variants(m: int) -> dict[str, RunConfig]:
    return {
        "1 device": config(m, {}),
        "1f1b stage=4": config(m, dict(stage=4), "1f1b"),
        "interleaved stage=4 v=2": config(m, dict(stage=4), "interleaved", 2),
        "zb1 stage=4": config(m, dict(stage=4), "zb1"),
        "gpipe stage=4": config(m, dict(stage=4), "gpipe"),
        "1f1b stage=4 single ticks": config(m, dict(stage=4), "1f1b", ticks="single"),
        "zb1 stage=4 single ticks": config(m, dict(stage=4), "zb1", ticks="single"),
        "zbv stage=4 v=2 single ticks": config(m, dict(stage=4), "zbv", 2, ticks="single"),
    }


def step_rows(rounds: int) -> list[str]:
    lines = [
        "| m | layout | ticks | lockstep bubble | step s | ms per microbatch | vs 1 device | steps growing the heap"
        " | vs 1 device, other steps |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in (8, 16):
        cfgs = variants(m)
        runs = {k: (c, make_layout(c.parallel, jax.devices()[: c.parallel.n_devices])) for k, c in cfgs.items()}
        growth: dict = {}
        seconds = median_step_seconds(runs, rounds, settle=SETTLE, growth=growth)
        calm_one = growth["1 device"][1]
        for name, cfg in cfgs.items():
            if cfg.parallel.stage > 1:
                sched = schedule_for(cfg)
                ticks, bubble = str(sched.ticks), f"{sched.bubble_fraction:.1%}"
            else:
                ticks, bubble = "-", "-"
            s, (grew, calm) = seconds[name], growth[name]
            other = f"{calm_one / calm:.2f}x" if calm and calm_one else "-"
            lines.append(
                f"| {m} | {name} | {ticks} | {bubble} | {s:.3f} | {1e3 * s / m:.1f} | {seconds['1 device'] / s:.2f}x "
                f"| {grew} of {rounds} | {other} |"
            )
    return lines


# XLA op names (their numeric suffix dropped) by what they do; containers (while, conditional) and
# runtime events are left out, so nothing is counted twice
KINDS = [
    ("sends and lockstep waits (collective-permute, rendezvous)", ("ppermute", "collective-permute", "Rendezvous")),
    ("stash and inbox slots (dynamic-slice / dynamic-update-slice)", ("dynamic-slice", "dynamic-update-slice")),
    ("buffer fills (broadcast)", ("broadcast",)),
    ("copies and transposes", ("copy", "transpose")),
    ("embeddings' gather, gradient reductions", ("all-gather", "all-reduce", "reduce-scatter")),
    ("chunk compute (GEMMs, fused elementwise)", ("fusion", "dot", "convolution", "add", "multiply", "select")),
]
CONTAINERS = ("while", "conditional", "call", "PjitFunction")


def thread_ms(cfg: RunConfig) -> dict[str, float]:
    """Device-thread milliseconds of one profiled train step, by kind of op (`KINDS`)."""
    import gzip
    import json
    import re
    import tempfile
    from pathlib import Path

    from _timing import prepared_step

    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    fn, state, batch = prepared_step(cfg, layout)
    for _ in range(2):  # compile, then one warm step
        state, m = fn(state, batch)
        jax.block_until_ready(m)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            state, m = fn(state, batch)
            jax.block_until_ready(m)
        with gzip.open(next(Path(d).rglob("*.trace.json.gz"))) as f:
            events = json.load(f)["traceEvents"]
    out = dict.fromkeys([k for k, _ in KINDS] + ["other"], 0.0)
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(("$", *CONTAINERS)) or not re.match(r"[\w.-]+$", name):
            continue
        base = re.sub(r"\.\d+$", "", name)
        kind = next((k for k, words in KINDS if any(w in base for w in words)), "other")
        out[kind] += e["dur"] / 1e3
    return out


def tick_rows(m: int = 16) -> list[str]:
    one = thread_ms(config(m, {}))
    piped = {name: config(m, dict(stage=4), name) for name in ("1f1b", "zb1")}
    piped["zb1 single-tick"] = config(m, dict(stage=4), "zb1", ticks="single")
    ticks = {name: schedule_for(cfg).ticks for name, cfg in piped.items()}
    ms = {name: thread_ms(cfg) for name, cfg in piped.items()}
    head = " | ".join(f"{n} stage=4 ({ticks[n]} ticks), same | {n} added per tick" for n in piped)
    lines = [f"| op kind | 1 device, ms per microbatch | {head} |", "|---|---:" + "|---:|---:" * len(piped) + "|"]
    for kind in one:
        if max(one[kind], *(t[kind] for t in ms.values())) < 0.5 * m:  # under 0.5 ms per microbatch in all
            continue
        cells = " | ".join(f"{t[kind] / m:.1f} | {(t[kind] - one[kind]) / ticks[n]:+.1f} ms" for n, t in ms.items())
        lines.append(f"| {kind} | {one[kind] / m:.1f} | {cells} |")
    total = lambda t: sum(t.values())
    cells = " | ".join(f"{total(t) / m:.1f} | {(total(t) - total(one)) / ticks[n]:+.1f} ms" for n, t in ms.items())
    lines.append(f"| all | {total(one) / m:.1f} | {cells} |")
    return lines


def compile_seconds(cfg: RunConfig) -> float:
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    specs, tx, shardings = setup(cfg, layout)
    fn = make_train_step(cfg, layout, tx, shardings)
    t0 = time.perf_counter()
    fn.lower(abstract_state(specs, layout, tx, **placement(cfg)), abstract_batch(cfg, layout)).compile()
    return time.perf_counter() - t0


def compile_line() -> str:
    cases = [(4, m) for m in (4, 32)] + [(p, 8) for p in (2, 8)]
    cfgs = [config(m, dict(stage=p)) for p, m in cases]
    parts = [
        f"p = {c.parallel.stage}, m = {c.train.microbatches} ({schedule_for(c).ticks} ticks) {compile_seconds(c):.1f} s"
        for c in cfgs
    ]
    return "Compile time of the train step (1F1B): " + "; ".join(parts) + "."


def memory_rows() -> list[str]:
    """Compiled temp bytes per device of the gradient step (the pipeline's program) against
    `accounting.activation_memory`, at p = 4, m = 8 on the model of tests/test_pipeline.py's memory
    test (llama d=64, 8 layers, s=32, 2 sequences per microbatch): paired, single ticks and ZB-V."""
    import jax.numpy as jnp
    import optax

    from meshlm import accounting
    from meshlm.model.params import param_specs
    from meshlm.step import make_grad_step
    from meshlm.train_state import state_shardings

    lines = ["| schedule | compiled temp MB | formula MB |", "|---|---:|---:|"]
    model = ModelConfig(family="llama", vocab_size=256, d_model=64, n_layers=8, n_heads=8, n_kv_heads=4,
                        max_seq_len=32, attention_chunk=16)  # fmt: skip
    variants = [("1f1b", 1, "paired"), ("1f1b", 1, "single"), ("zb1", 1, "paired"), ("zb1", 1, "single")]
    for name, v, ticks in [*variants, ("zbv", 2, "single")]:
        par = ParallelConfig(stage=4, pipeline_schedule=name, virtual_stages=v, pipeline_ticks=ticks)
        cfg = validate(
            RunConfig(model=model, parallel=par, train=TrainConfig(global_batch=16, microbatches=8, seq_len=32))
        )
        layout = make_layout(cfg.parallel, jax.devices()[:4])
        shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), param_specs(cfg.model))
        compiled = make_grad_step(cfg, layout, shardings).lower(params, abstract_batch(cfg, layout), 0).compile()
        temp, formula = compiled.memory_analysis().temp_size_in_bytes, accounting.activation_memory(cfg)["total"]
        lines.append(f"| {name} {ticks} | {temp / 1e6:.2f} | {formula / 1e6:.2f} |")
    return lines


@contextlib.contextmanager
def whole_selects():
    """While a step is traced: the ring's unbranched phases as they were before their increments
    were masked - every output of both branches computed whole, then selected (`_Stage.phase`)."""
    import jax.numpy as jnp

    from meshlm.parallel import pipeline

    def phase(self, on, run, idle):
        on = on.astype(bool)
        if not self.unbranched:
            return jax.lax.cond(on, lambda: run(None), idle)
        return jax.tree.map(lambda a, b: jnp.where(on, a, b), run(None), idle())

    saved, pipeline._Stage.phase = pipeline._Stage.phase, phase
    try:
        yield
    finally:
        pipeline._Stage.phase = saved


def ring_rows(rounds: int, m: int = 8) -> list[str]:
    """The ring inside the stages (stage=2 x context=2, 1F1B, blockwise attention with 128-token
    blocks, 64 under context=2: a context chunk): its phases run unbranched, a backward and a
    forward on every stage at every tick, with masked increments, against the same run selecting
    whole outputs (before), all_gather's branched phases on the same mesh, one device, and both
    strategies on context=2 alone (the ring's own cost against all_gather's, without stages)."""
    blockwise = lambda c: dataclasses.replace(c.model, attention="blockwise", attention_block=128)
    cases = {"1 device": ({}, "all_gather"), "stage=2 x context=2 all_gather": (dict(stage=2, context=2), "all_gather")}
    cases |= {"stage=2 x context=2 ring": (dict(stage=2, context=2), "ring")}
    cases |= {f"context=2 {k}": (dict(context=2), k) for k in ("all_gather", "ring")}
    cfgs = {}
    for name, (mesh, strategy) in cases.items():
        cfg = config(m, {})
        par = dataclasses.replace(cfg.parallel, **mesh, context_strategy=strategy)
        cfgs[name] = validate(dataclasses.replace(cfg, model=blockwise(cfg), parallel=par))
    layout = lambda c: make_layout(c.parallel, jax.devices()[: c.parallel.n_devices])
    runs = {k: (c, layout(c)) for k, c in cfgs.items()}
    ring = cfgs["stage=2 x context=2 ring"]
    runs["stage=2 x context=2 ring, whole selects (before)"] = (ring, layout(ring), whole_selects())
    seconds = median_step_seconds(runs, rounds, settle=SETTLE)
    table = schedule_for(ring)
    head = f"| layout (m = {m}, 1F1B) | phases | predicted lockstep overhead | step s | ms per microbatch"
    lines = [head + " | vs 1 device |", "|---|---|---:|---:|---:|---:|"]
    for name, s in seconds.items():
        staged, unbranched = name.startswith("stage"), "ring" in name and name.startswith("stage")
        kind = "unbranched" if unbranched else "branched" if staged else "-"
        over = f"{table.lockstep_overhead(2.0, unbranched=unbranched):.1%}" if staged else "-"
        lines.append(f"| {name} | {kind} | {over} | {s:.3f} | {1e3 * s / m:.1f} | {seconds['1 device'] / s:.2f}x |")
    return lines


def uneven_rows(rounds: int, m: int = 8) -> list[str]:
    """Uneven stages (docs/pipeline.md): 1F1B at p = 4 over 7 layers (chunks of 1, 2, 2, 2: every stage
    runs 2 slots, stage 0's pad a zero-weight layer) and over 8, each against its own one-device
    baseline in the same rounds. Predicted: the even ratio x 7/8 (the pad slot costs a layer; the
    planner's "pad slots of uneven stages")."""
    cfgs = {
        f"{name}, {n} layers": config(m, mesh, layers=n)
        for n in (7, 8)
        for name, mesh in (("1 device", {}), ("1f1b stage=4", dict(stage=4)))
    }
    runs = {k: (c, make_layout(c.parallel, jax.devices()[: c.parallel.n_devices])) for k, c in cfgs.items()}
    seconds = median_step_seconds(runs, rounds, settle=SETTLE)
    ratio = {n: seconds[f"1 device, {n} layers"] / seconds[f"1f1b stage=4, {n} layers"] for n in (7, 8)}
    head = "| layers (m = 8) | slots a stage | 1 device ms / microbatch | 1F1B stage=4 ms / microbatch | vs 1 device"
    lines = [head + " | predicted |", "|---:|---:|---:|---:|---:|---:|"]
    for n in (7, 8):
        one, piped = (1e3 * seconds[f"{k}, {n} layers"] / m for k in ("1 device", "1f1b stage=4"))
        slots = chunk_slots(n, 4)
        lines.append(f"| {n} | {slots} | {one:.1f} | {piped:.1f} | {ratio[n]:.2f}x | {ratio[8] * n / 8:.2f}x |")
    return lines


def heap_lines(schedule: str = "zb1", m: int = 8, steps: int = 40) -> list[str]:
    """One schedule alone at p = 4 for `steps` steps: per step its seconds, the fresh pages it
    faulted in and the process's resident memory - whether the host heap keeps growing."""
    import resource

    from _timing import prepared_step

    cfg = config(m, dict(stage=4), schedule)
    fn, state, batch = prepared_step(cfg, make_layout(cfg.parallel, jax.devices()[:4]))
    lines = [f"{schedule} stage=4, m = {m}: step, seconds, minor faults, resident MiB"]
    for step in range(steps + 1):  # step 0 compiles
        faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        state, metrics = fn(state, batch)
        jax.block_until_ready(metrics)
        seconds, faults = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        if step:
            lines.append(f"{step} {seconds:.2f} {faults} {resident}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--memory", action="store_true", help="print the compiled memory table only (nothing written)")
    ap.add_argument("--ring", action="store_true", help="the ring inside the stages only (section pipeline_ring)")
    ap.add_argument("--heap", action="store_true", help="zb1 alone for 40 steps: heap growth per step (printed)")
    ap.add_argument("--uneven", action="store_true", help="1F1B over 7 layers and over 8 on 4 stages (printed)")
    args = ap.parse_args()
    if args.memory:
        print("\n".join(memory_rows()))
        return
    if args.heap:
        print("\n".join(heap_lines()))
        return
    if args.uneven:
        print("\n".join(uneven_rows(args.rounds)))
        return
    if args.ring:
        flags = f"--ring --rounds {args.rounds}{' --write' if args.write else ''}"
        when = time.strftime("%Y-%m-%d")
        head = f"Command: `python benchmarks/pipeline.py {flags}` ({when}, CPU, 2 cores; the model above)."
        text = "\n".join([head, "", *ring_rows(args.rounds)])
        print(text)
        if args.write:
            write_section("pipeline_ring", text)
        return
    text = "\n".join(
        [
            "Command: `python benchmarks/pipeline.py --rounds "
            f"{args.rounds}{' --write' if args.write else ''}` ({time.strftime('%Y-%m-%d')}, CPU, 8 simulated "
            "devices on 2 cores; llama d=256, 8 layers, fp32, s=256, 2 sequences per microbatch).",
            "",
            "Step time, p = 4:",
            "",
            *step_rows(args.rounds),
            "",
            "Where the time goes at m = 16 (device-thread time of one profiled step, summed over devices):",
            "",
            *tick_rows(),
            "",
            compile_line(),
        ]
    )
    print(text)
    if args.write:
        write_section("pipeline", text)


if __name__ == "__main__":
    main()
