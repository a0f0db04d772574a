"""Pipeline parallelism on CPU (simulated devices): step time against the bubble, compile time
against m and p.

1. Step time vs m at p = 4 for GPipe, 1F1B and interleaved 1F1B (v = 2): a llama of d=256,
   8 layers, fp32, s=256, 2 sequences per microbatch, m = 4, 8, 16 microbatches (so the batch
   grows with m), next to the schedule's ticks and predicted bubble (p-1)/(v m), and two
   unpipelined baselines accumulating the same microbatches: one device, and data=2. Alternating
   rounds, medians. This machine has 2 cores under 4 simulated devices, so idle stages cost no CPU
   and the bubble cannot show as wall time here; what the rows measure is the executor's overhead
   per microbatch against the unpipelined step.
2. Compile time of the whole train step vs m (p = 4, 1F1B) and vs p (m = 8): the schedule is data
   (a table scanned over), so it must not grow with m.

    python benchmarks/pipeline.py [--rounds 3] [--write]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax

from _markdown import write_section
from _timing import median_step_seconds
from meshlm.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.pipeline import schedule_for
from meshlm.step import abstract_batch, make_train_step
from meshlm.train_state import abstract_state, placement, setup
from meshlm.validation import validate

MICRO = 2  # sequences per microbatch


def config(m: int, mesh: dict, schedule: str = "1f1b", v: int = 1, layers: int = 8) -> RunConfig:
    model = ModelConfig(
        family="llama", vocab_size=4096, d_model=256, n_layers=layers, n_heads=8, n_kv_heads=4, max_seq_len=256
    )
    parallel = ParallelConfig(**mesh, pipeline_schedule=schedule, virtual_stages=v)
    train = TrainConfig(global_batch=MICRO * m, microbatches=m, seq_len=256, steps=1000)
    return validate(RunConfig(model=model, parallel=parallel, optim=OptimConfig(warmup_steps=0), train=train))


def variants(m: int) -> dict[str, RunConfig]:
    return {
        "1 device": config(m, {}),
        "data=2": config(m, dict(data=2)),
        "gpipe stage=4": config(m, dict(stage=4), "gpipe"),
        "1f1b stage=4": config(m, dict(stage=4), "1f1b"),
        "interleaved stage=4 v=2": config(m, dict(stage=4), "interleaved", 2),
    }


def step_rows(rounds: int) -> list[str]:
    lines = [
        "| m | layout | ticks | predicted bubble | step s | ms per microbatch | vs 1 device |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for m in (4, 8, 16):
        cfgs = variants(m)
        runs = {k: (c, make_layout(c.parallel, jax.devices()[: c.parallel.n_devices])) for k, c in cfgs.items()}
        seconds = median_step_seconds(runs, rounds)
        for name, cfg in cfgs.items():
            if cfg.parallel.stage > 1:
                sched = schedule_for(cfg)
                ticks, bubble = str(sched.ticks), f"{sched.bubble_fraction:.1%}"
            else:
                ticks, bubble = "-", "-"
            s = seconds[name]
            lines.append(
                f"| {m} | {name} | {ticks} | {bubble} | {s:.3f} | {1e3 * s / m:.1f} | {seconds['1 device'] / s:.2f}x |"
            )
    return lines


def compile_seconds(cfg: RunConfig) -> float:
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    specs, tx, shardings = setup(cfg, layout)
    fn = make_train_step(cfg, layout, tx, shardings)
    t0 = time.perf_counter()
    fn.lower(abstract_state(specs, layout, tx, **placement(cfg)), abstract_batch(cfg, layout)).compile()
    return time.perf_counter() - t0


def compile_rows() -> list[str]:
    lines = ["| p | m | schedule | ticks | compile s |", "|---:|---:|---|---:|---:|"]
    cases = [(4, m, "1f1b", 1) for m in (4, 8, 16, 32)] + [(p, 8, "1f1b", 1) for p in (2, 8)]
    cases += [(4, m, "interleaved", 2) for m in (4, 16)]
    for p, m, schedule, v in cases:
        cfg = config(m, dict(stage=p), schedule, v)
        lines.append(f"| {p} | {m} | {schedule} | {schedule_for(cfg).ticks} | {compile_seconds(cfg):.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    text = "\n".join(
        [
            "Command: `python benchmarks/pipeline.py --rounds "
            f"{args.rounds}{' --write' if args.write else ''}` (CPU, 8 simulated devices on 2 cores).",
            "",
            "Step time vs m, p = 4 (llama d=256, 8 layers, fp32, s=256, 2 sequences per microbatch):",
            "",
            *step_rows(args.rounds),
            "",
            "Compile time of the train step:",
            "",
            *compile_rows(),
        ]
    )
    print(text)
    if args.write:
        write_section("pipeline", text)


if __name__ == "__main__":
    main()
