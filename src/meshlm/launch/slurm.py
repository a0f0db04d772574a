"""SLURM tasks supervised by SLURM itself: heartbeats, and a requeue read as a restart after a failure.

`srun meshlm train --distributed` runs without `meshlm launch`, so nothing tells a requeued job what
the launcher tells a restarted group ($MESHLM_FAULT). Under SLURM (a task: $SLURM_PROCID set, and no
launcher's $MESHLM_HEARTBEAT) each task writes the launcher's heartbeat,
<run_dir>/.heartbeat/process-<SLURM_PROCID>, and a job that SLURM started again
($SLURM_RESTART_COUNT >= 1: `scontrol requeue`, a preemption, a node failure with `--requeue`) is a
restart after a failure: the failure's time is the newest heartbeat's (the last sign of progress),
the step reached their largest step (of processes 0 .. $SLURM_NTASKS - 1). So the group resumes from
the in-memory copies (`local_checkpoint`) where they are not older than the disk's newest checkpoint
(after a node failure: a host replaced gets its copy back from its peer), and logs the steps lost. A
requeue after SLURM's SIGTERM finds no copies (an orderly stop drops them) and resumes from the
checkpoint the SIGTERM saved, nothing lost.

$SLURM_RESTART_COUNT stays set for the rest of the job, so every start in a requeued job counts as
a restart after a failure (a `recovered` record; its `recovery_s` includes the time the job waited
in the queue). `meshlm launch` inside a job supervises on its own: it does not read the requeue.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from meshlm.launch.supervisor import reached, read_beat


def task_env(run_dir: Path, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a SLURM task adds to its environment before training (nothing outside SLURM, or under
    `meshlm launch`, which sets both itself): its heartbeat file, and after a requeue the fault
    ("time step") read from the heartbeats the job's previous run left. Read before the group
    forms: no process beats before every process has joined and finished a first step."""
    if "SLURM_PROCID" not in environ or "MESHLM_HEARTBEAT" in environ:
        return {}
    directory = run_dir / ".heartbeat"
    directory.mkdir(parents=True, exist_ok=True)
    add = {"MESHLM_HEARTBEAT": str(directory / f"process-{environ['SLURM_PROCID']}")}
    if int(environ.get("SLURM_RESTART_COUNT") or 0) >= 1 and "MESHLM_FAULT" not in environ:
        tasks = int(environ.get("SLURM_NTASKS") or 1)  # srun sets it
        beats = [directory / f"process-{i}" for i in range(tasks)]  # not an earlier, larger group's
        # the time written in them: the tasks' own clock, the one `recovery_s` is read with
        seen = [b[1] for b in map(read_beat, beats) if b]
        add["MESHLM_FAULT"] = f"{max(seen, default=time.time()):.3f} {reached(beats)}"
    return add
