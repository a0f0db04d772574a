"""Where meshlm's train step spends its time on this CPU: a `jax.profiler` trace of a few steps,
each XLA operation's time joined with the compiled HLO (shape, the JAX operation it came from),
summed per step, and how busy XLA's worker threads were.

The trace (open it in Perfetto or TensorBoard) and the compiled HLO stay in --out. The model is
issue 11's "small" shape (4 layers, d=256, vocab 8192, seq 256, batch 8, fp32, one device), or with
`--size medium` its "medium" one (6 layers, d=384, 6 heads). Under `taskset -c 0` XLA runs one worker
thread, and the operation times add up to the step's.

    python benchmarks/profile_step.py [--family gpt] [--size small] [--chain] [--steps 3] [--top 12] [--write]

Operation times are thread time: independent operations run concurrently on the two cores, so
they add up to more than the step's wall time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
os.environ["XLA_FLAGS"] += " --xla_cpu_enable_xprof_traceme=true"  # one trace event per XLA operation
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# issue 11's configs, and (on import, before JAX starts threads) the host allocator settings `meshlm train` uses
import vs_pytorch as vs

# isort: split
import jax
import numpy as np

from _markdown import write_section
from meshlm.data.loader import WindowLoader, process_batch
from meshlm.parallel.mesh import make_layout
from meshlm.platform.hardware import cpu_description
from meshlm.step import abstract_batch, batch_sharding, make_train_step
from meshlm.train_state import abstract_state, init_state, placement, setup


def compiled_step(family: str, size: str = "small", chain: bool = False):
    """Issue 11's "small" or "medium" config, as benchmarks/vs_pytorch.py trains it, on one device
    (with `chain`, its layers unrolled into one chain instead of the default scan)."""
    cfg = vs.meshlm_config(family, size, unroll=vs.SIZES[size][0] if chain else 1)
    layout = make_layout(cfg.parallel, jax.devices()[:1])
    specs, tx, shardings = setup(cfg, layout)
    step = make_train_step(cfg, layout, tx, shardings)
    compiled = step.lower(abstract_state(specs, layout, tx, **placement(cfg)), abstract_batch(cfg, layout)).compile()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 100 * 8 * 257).astype(np.int32)
    loader = WindowLoader(tokens, cfg.train.seq_len, cfg.train.global_batch, seed=0)
    return compiled, init_state(specs, layout, tx, 0, **placement(cfg)), loader, batch_sharding(layout)


def hlo_ops(text: str) -> dict[str, tuple[str, str]]:
    """{operation name: (result shape, the JAX op_name it came from)} for the entry and loop bodies."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s+%([\w.\-]+) = (\w+\[[\d,]*\])", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            out[m.group(1)] = (m.group(2), op.group(1).removeprefix("jit(step)/") if op else "")
    return out


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for s, t in sorted(intervals):
        if t > end:
            total += t - max(s, end)
            end = t
    return total / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="gpt")
    ap.add_argument("--size", default="small", choices=sorted(vs.SIZES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "meshlm-profile"))
    ap.add_argument("--chain", action="store_true", help="layers unrolled into one chain (model.scan_unroll = layers)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    compiled, state, loader, sharding = compiled_step(args.family, args.size, args.chain)
    name = (args.family if args.size == "small" else f"{args.family}_{args.size}") + ("_chained" if args.chain else "")
    out = Path(args.out) / name
    shutil.rmtree(out, ignore_errors=True)  # one trace per directory: the parser reads the only one
    out.mkdir(parents=True)
    (out / "step.hlo.txt").write_text(compiled.as_text())
    ops = hlo_ops(compiled.as_text())
    for i in range(3):  # warm up
        state, m = compiled(state, process_batch(loader, i, sharding))
    jax.block_until_ready(m)
    t0, cpu0 = time.perf_counter(), time.process_time()  # unprofiled: how many cores the step keeps busy
    for i in range(args.steps):
        state, m = compiled(state, process_batch(loader, 3 + i, sharding))
    jax.block_until_ready(m)
    plain_wall = (time.perf_counter() - t0) / args.steps * 1e3
    cores = (time.process_time() - cpu0) / args.steps * 1e3 / plain_wall
    t0 = time.perf_counter()
    with jax.profiler.trace(str(out / "trace"), create_perfetto_trace=True):
        for i in range(args.steps):
            state, m = compiled(state, process_batch(loader, 3 + args.steps + i, sharding))
        jax.block_until_ready(m)
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    with gzip.open(next((out / "trace").rglob("*.trace.json.gz"))) as f:
        trace = json.load(f)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    per_op, per_kind, per_thread = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    for e in trace["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") != "X" or name not in ops:
            continue
        per_op[name] += e["dur"] / 1e3 / args.steps
        kind = re.sub(r"\.\d+$", "", name)
        per_kind["dots (and reductions): ynn_fusion" if kind == "ynn_fusion" else kind] += e["dur"] / 1e3 / args.steps
        per_thread[threads.get((e["pid"], e["tid"]), "?")].append((e["ts"], e["ts"] + e["dur"]))
    workers = {k: v for k, v in per_thread.items() if "Eigen" in k}
    busy = [busy_ms(v) / args.steps for v in workers.values()]
    command = " ".join(["python benchmarks/profile_step.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {cpu_description()}, "
        f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPU cores; "
        f"{args.family}, {vs.SIZES[args.size][0]} layers{' chained' if args.chain else ''}, "
        f"d={vs.SIZES[args.size][1]}, vocab 8192, seq 256, batch 8, fp32, 1 device; "
        f"{args.steps} profiled steps)",
        "",
        f"Unprofiled: {plain_wall:.0f} ms per step, process CPU time {cores:.2f} cores per wall second. "
        f"Profiled: step wall time {wall:.0f} ms; XLA's {len(busy)} worker threads busy "
        + ", ".join(f"{b:.0f} ms ({100 * b / wall:.0f}%)" for b in busy)
        + f"; operations' thread time {sum(per_op.values()):.0f} ms per step.",
        "",
        "| operation kind | thread ms / step |",
        "|---|---:|",
        *[f"| {k} | {v:.1f} |" for k, v in per_kind.most_common(8)],
        "",
        "| operation | thread ms / step | result | from |",
        "|---|---:|---|---|",
        *[f"| {n} | {t:.1f} | `{ops[n][0]}` | `{ops[n][1][-70:]}` |" for n, t in per_op.most_common(args.top)],
    ]
    table = "\n".join(lines)
    print(table)
    print(f"trace and HLO in {out}")
    if args.write:
        write_section(f"profile_step_{name}", table)


if __name__ == "__main__":
    main()
