"""Tokens/s of the same 8-device mesh run as 1, 2 and 4 processes (JAX distributed runtime, gloo).

The `tiny` recipe on mesh data=2 x tensor=4, the built-in corpus, through the real CLI: `meshlm
train --devices 8` for one process, `meshlm launch --processes P --devices-per-process 8/P` for
several. Rounds alternate between the variants so the ratios are comparable on a noisy machine;
each figure is the median over the logged intervals of all rounds (the first interval of a run,
which includes warm-up, is not logged with a rate).

    python benchmarks/multiprocess_throughput.py [--steps 60 --rounds 2] [--write]
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

MESH = "data=2,tensor=4"


def run(processes: int, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        train = ["train", "--mesh", MESH, "--steps", str(steps), "--run-dir", tmp]
        train += ["--set", "train.eval_every=0", "--set", "checkpoint.every=0"]
        if processes == 1:
            cmd = [sys.executable, "-m", "meshlm", *train, "--devices", "8"]
        else:
            cmd = [sys.executable, "-m", "meshlm", "launch", "--processes", str(processes)]
            cmd += ["--devices-per-process", str(8 // processes), "--", *train]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        records = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in records if "tokens_per_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    variants = [1, 2, 4]
    rates: dict[int, list[float]] = {p: [] for p in variants}
    for _ in range(args.rounds):
        for p in variants:
            rates[p] += run(p, args.steps)
    base = statistics.median(rates[1])
    lines = [
        f"Command: `python benchmarks/multiprocess_throughput.py --steps {args.steps} --rounds {args.rounds}` "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores): `tiny` on mesh {MESH}, 8 simulated CPU devices "
        "in total, median tokens/s over logged intervals.",
        "",
        "| processes x devices | tokens/s | vs 1 x 8 |",
        "|---|---:|---:|",
    ]
    for p in variants:
        r = statistics.median(rates[p])
        lines.append(f"| {p} x {8 // p} | {r:,.0f} | {r / base:.2f}x |")
    publish("multiprocess_throughput", lines, args.write)


if __name__ == "__main__":
    main()
