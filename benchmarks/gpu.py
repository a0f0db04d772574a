"""Training steps of `llama-1b` and `gpt-1.3b` at their best planned layout on the GPUs at hand:
tokens/s, MFU, HFU, peak device memory (from the device's allocator) and compile time.

For each recipe (bf16 weights in compute, fp32 masters, as the recipes set): `meshlm plan`'s best
feasible plan for the visible devices (the device kind matched in `meshlm.platform.hardware`; its memory as
the limit), with `blockwise` attention promoted to `fused` (cuDNN flash attention where it applies);
the train step compiled (timed), two warm-up steps, then `--steps` timed steps on random tokens
(median; `_timing.timed_steps`). Peak memory is `memory_stats()["peak_bytes_in_use"]`, the largest over
local devices, beside the step program's own peak (`memory_analysis().peak_memory_in_bytes`): on a TPU
the allocator's figure counted no program's temporaries (BENCHMARKS-history.md, "Step memory on one TPU v5e").
The backend's XLA flags are `meshlm.platform.xla_flags` (set before JAX starts; `MESHLM_XLA_TUNING=0` for a
run without them).

    benchmarks/gpu.sh [--steps 10] [--write]          # on a GPU machine, under 10 minutes
    python benchmarks/gpu.py --recipes tiny --steps 2   # the same path on CPU (no MFU target)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from meshlm.platform import xla_flags

os.environ["XLA_FLAGS"] = xla_flags.flags_for()  # before JAX starts a backend

import jax

from _markdown import write_section
from _timing import timed_steps
from meshlm import accounting, recipes
from meshlm.config import RunConfig
from meshlm.insight import plan as planner
from meshlm.platform import hardware
from meshlm.validation import validate


def planned(cfg: RunConfig, n: int) -> tuple[RunConfig, str]:
    """The best feasible plan's config for n devices of the kind at hand (CPU: data=n as is)."""
    dev = jax.devices()[0]
    acc = hardware.BY_DEVICE_KIND.get(dev.device_kind)
    if acc is None:
        par = dataclasses.replace(cfg.parallel, data=n)
        return validate(dataclasses.replace(cfg, parallel=par)), f"{dev.device_kind}: not planned, data={n}"
    feasible = [p for p in planner.enumerate_plans(cfg, n, acc) if not p.rejected]
    if not feasible:
        sys.exit(f"no layout of {n} x {acc.name} fits this model; see `meshlm plan`")
    best = feasible[0].cfg
    if best.model.attention == "blockwise":  # fused = cuDNN flash attention where it applies
        best = dataclasses.replace(best, model=dataclasses.replace(best.model, attention="fused"))
    return validate(best), f"{acc.name}: the best of {len(feasible)} feasible plans"


def measure(name: str, steps: int, seq_len: int | None) -> dict:
    cfg = recipes.get(name)
    if seq_len:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len))
    n = len(jax.devices())
    cfg, how = planned(cfg, n)
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    compiled, m, step_s, compile_s = timed_steps(cfg, steps, warm=2)
    peak = hardware.peak_flops(cfg.model.dtype, n)
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peak_bytes = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    return {
        "recipe": name,
        "layout": planner.Plan(cfg).describe(),
        "how": how,
        "tokens_per_s": shape[0] * shape[1] / step_s,
        "step_s": step_s,
        # MFU as meshlm logs it: causal attention's masked half not counted (P2's Eq. 7 beside it)
        "mfu": accounting.utilisation(accounting.causal_flops_per_step(cfg), step_s, peak.flops),
        "mfu_eq7": accounting.utilisation(accounting.model_flops_per_step(cfg), step_s, peak.flops),
        "hfu": accounting.utilisation(accounting.hardware_flops_per_step(cfg), step_s, peak.flops),
        "peak_gib": peak_bytes / 2**30 if peak_bytes else None,
        "program_peak_gib": getattr(compiled.memory_analysis(), "peak_memory_in_bytes", 0) / 2**30 or None,
        "compile_s": compile_s,
        "loss": float(m["loss"]),
        "peak_source": peak.source,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["llama-1b", "gpt-1.3b"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    dev = jax.devices()[0]
    lines = [
        f"Command: `benchmarks/gpu.sh --steps {args.steps}` on {len(jax.devices())} x {dev.device_kind} "
        f"(jax {jax.__version__}).",
        "",
        "MFU: model FLOPs with causal attention's masked half not counted; Eq. 7 MFU: P2's count (s x s).",
        "",
        "| recipe | layout | tokens/s | step s | MFU | Eq. 7 MFU | HFU | peak memory GiB | compile s | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.recipes:
        r = measure(name, args.steps, args.seq_len)
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(
            f"| {name} | {r['layout']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {r['mfu']:.1%} | "
            f"{r['mfu_eq7']:.1%} | {r['hfu']:.1%} | {peak} | {r['compile_s']:.1f} | {r['loss']:.3f} |"
        )
        print(lines[-1], f"({r['how']}; peak FLOP/s: {r['peak_source']})", flush=True)
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("gpu", text)


if __name__ == "__main__":
    main()
