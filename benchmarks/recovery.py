"""What a failure costs: the disk checkpoint vs in-memory copies (`checkpoint.local_every`).

`tiny` on mesh data=2 x tensor=4 as 2 processes x 4 simulated CPU devices, through `meshlm launch`
and the built-in corpus. A faulted run is SIGKILLed in process 1 once its heartbeat reports step
`--kill-at`; the launcher restarts the group, which resumes from the disk checkpoint
(`checkpoint.every`) or from the in-memory copies (`checkpoint.local_every=1`), and logs a
`recovered` record: the steps lost and the time from the failure to the first step after it.
"Back at the step reached" is estimated, not measured: that time plus the lost steps redone at the
run's median step time. Uninterrupted
runs with and without the copies give their cost per step (median step time over logged
intervals; every run logs every step, so each step is a sync point in both). Rounds alternate the
variants; the table gives medians over rounds.

    python benchmarks/recovery.py [--steps 80 --every 20 --kill-at 37 --rounds 2] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _markdown import publish

MESH = "data=2,tensor=4"


def launch(run: Path, steps: int, every: int, local: int, kill_at: int | None) -> tuple[list[dict], int]:
    """(metrics.jsonl records, bytes of process 1's own in-memory copy when it was killed)."""
    train = ["train", "--mesh", MESH, "--steps", str(steps), "--run-dir", str(run)]
    settings = ["train.eval_every=0", "train.log_every=1", f"checkpoint.every={every}"]
    for kv in [*settings, f"checkpoint.local_every={local}"]:
        train += ["--set", kv]
    cmd = [sys.executable, "-m", "meshlm", "launch", "--processes", "2", "--devices-per-process", "4", "--", *train]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    copy_bytes = 0
    if kill_at is not None:
        beat = run / ".heartbeat" / "process-1"
        while True:
            assert proc.poll() is None, "the run ended before the fault"
            parts = beat.read_text().split() if beat.exists() else []
            if len(parts) == 3 and int(parts[0]) >= kill_at:
                break
            time.sleep(0.02)
        if local:
            from meshlm import local_checkpoint as lc

            store = lc.store_dir(lc.default_root(), run, lc.run_id(run, first=False))
            copy_bytes = max((p.stat().st_size for p in (store / "process-1" / "own").glob("*.ckpt")), default=0)
        os.kill(int(parts[2]), signal.SIGKILL)
    assert proc.wait(timeout=900) == 0, f"launch failed: {cmd}"
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], copy_bytes


def step_time(records: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in records if "step_time_s" in r and "event" not in r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--every", type=int, default=20, help="checkpoint.every (disk)")
    ap.add_argument("--kill-at", type=int, default=37)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    plain, copies, faults = [], [], {"disk": [], "memory": []}
    copy_bytes = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            plain.append(step_time(launch(Path(tmp, f"plain{r}"), args.steps, args.every, 0, None)[0]))
            copies.append(step_time(launch(Path(tmp, f"copies{r}"), args.steps, args.every, 1, None)[0]))
            for source, local in (("disk", 0), ("memory", 1)):
                records, size = launch(Path(tmp, f"{source}{r}"), args.steps, args.every, local, args.kill_at)
                copy_bytes = max(copy_bytes, size)
                (event,) = [x for x in records if x.get("event") == "recovered"]
                assert event["source"] == source, event
                faults[source].append((event["lost_steps"], event["recovery_s"], step_time(records)))
    base, with_copies = statistics.median(plain), statistics.median(copies)
    lines = [
        f"Command: `python benchmarks/recovery.py --steps {args.steps} --every {args.every} --kill-at {args.kill_at} "
        f"--rounds {args.rounds}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores): `tiny` on {MESH}, 2 processes "
        f"x 4 simulated CPU devices, process 1 SIGKILLed at step {args.kill_at}, disk checkpoints every {args.every} "
        f"steps; medians over {args.rounds} rounds. In-memory copy: {copy_bytes / 2**20:.1f} MiB per process (and as "
        "much held for its peer).",
        "",
        "| resumed from | steps lost | failure -> next step (s) | back at the step reached (s, estimated) |",
        "|---|---:|---:|---:|",
    ]
    for source, runs in faults.items():
        lost = statistics.median(x[0] for x in runs)
        took = statistics.median(x[1] for x in runs)
        back = statistics.median(x[1] + x[0] * x[2] for x in runs)
        lines.append(f"| {source} | {lost:g} | {took:.1f} | {back:.1f} |")  # a median of 0 and 1 is 0.5
    lines += [
        "",
        f"Cost per step of in-memory copies every step: {1e3 * base:.1f} ms without, {1e3 * with_copies:.1f} ms with "
        f"({with_copies / base:.2f}x).",
    ]
    publish("recovery", lines, args.write)


if __name__ == "__main__":
    main()
