"""Tokens/s and MFU of the `tiny` recipe on this machine, for several layouts side by side.

Each layout runs in its own process (the simulated device count is fixed at jax import) through the
real CLI, one after another in one invocation, so the ratios between rows are comparable even on a
shared, noisy machine. Steady-state figures are the median over logged intervals after the first
(which includes compilation).

    python benchmarks/tiny_throughput.py --steps 100 [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _markdown import publish

LAYOUTS = ["data=1", "data=2", "fsdp=2", "tensor=2", "data=2,tensor=2", "data=8", "data=2,fsdp=2,tensor=2"]
ROOT = Path(__file__).resolve().parent.parent


def run_layout(mesh: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "meshlm", "train", "--mesh", mesh, "--steps", str(steps), "--run-dir", tmp]
        cmd += ["--set", "train.eval_every=0", *extra]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        records = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        info = json.loads((Path(tmp) / "run.json").read_text())
    steady = [r for r in records if "tokens_per_s" in r]
    return {
        "mesh": mesh,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "final_loss": steady[-1]["loss"],
        "peak": info["peak_source"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layouts", default=";".join(LAYOUTS))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--write", action="store_true", help="replace the tiny section of BENCHMARKS.md")
    args = ap.parse_args()
    extra = [x for o in args.overrides for x in ("--set", o)]
    rows = [run_layout(m, args.steps, extra) for m in args.layouts.split(";")]
    base = rows[0]["tokens_per_s"]
    cmd = "python benchmarks/tiny_throughput.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, "
        f"{args.steps} steps per layout, medians after the first logged interval)",
        f"Peak: {rows[0]['peak']}",
        "",
        "| mesh | tokens/s | step time (ms) | MFU | vs data=1 | loss at last step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mesh']} | {r['tokens_per_s']:.0f} | {1e3 * r['step_time_s']:.1f} | {100 * r['mfu']:.1f}% | "
            f"{r['tokens_per_s'] / base:.2f}x | {r['final_loss']:.3f} |"
        )
    publish("tiny_throughput", lines, args.write)


if __name__ == "__main__":
    main()
