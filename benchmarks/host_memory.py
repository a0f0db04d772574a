"""Host memory reuse (`meshlm.platform.host_memory`) on and off, side by side in one invocation.

glibc's allocator settings are per process and can only be chosen before threads start, so each
variant runs in its own worker process (`MESHLM_MALLOC_TUNING=0` or 1, applied before JAX or
PyTorch is imported), and this process alternates them: it asks one worker at a time for a round
of steps while the others wait. Each worker reports its step times, its minor page faults per step
(`getrusage`), and its peak resident memory (`ru_maxrss`, compile included).

Variants per config: meshlm's train step and data path on one device (`vs_pytorch.meshlm_stepper`,
what `meshlm train` runs; each step waited for before the next is dispatched, in both variants, which
bounds resident memory as the trainer's one step in flight does but does not overlap the next batch's
assembly) with glibc's defaults and with meshlm's settings, and `torch.compile`d
`transformers` (`vs_pytorch.torch_stepper`) under both, since PyTorch shares the process's allocator
when `vs_pytorch.py` runs both frameworks side by side. Workers switch reuse on before JAX starts
(compilation included, no memory guard), as `vs_pytorch.py` does; `meshlm train` switches it on
after compiling. Rounds run the variants in this order, then in reverse, alternately. Peak RSS is
the worker's lifetime peak (`ru_maxrss`), compilation included.

    python benchmarks/host_memory.py [--families gpt,llama] [--sizes small,medium] [--rounds 7] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _markdown import publish

HERE = Path(__file__).resolve().parent
VARIANTS = {  # name -> (framework, MESHLM_MALLOC_TUNING)
    "meshlm, glibc defaults": ("meshlm", "0"),
    "meshlm, reuse": ("meshlm", "1"),
    "PyTorch compiled, glibc defaults": ("torch", "0"),
    "PyTorch compiled, reuse": ("torch", "1"),
}


def worker(framework: str, family: str, size: str) -> None:
    """Build one stepper, then answer each line `N` on stdin with a JSON round of N steps."""
    import resource

    from meshlm.platform import host_memory

    host_memory.apply()  # before JAX or PyTorch is imported
    applied = host_memory.keep_freed(None)
    import vs_pytorch as vs  # imports JAX and PyTorch

    vs.torch.set_num_threads(os.cpu_count() or 2)
    run = vs.meshlm_config(family, size)
    if framework == "meshlm":  # each step waited for: bounds resident memory as the trainer's limit does
        step, sync = vs.meshlm_stepper(run)

        def one():
            step()
            sync()

    else:
        one, sync = vs.torch_stepper(run.model, compiled=True)
    for _ in range(3):  # compile and warm up
        one()
    sync()
    print(json.dumps({"ready": applied}), flush=True)
    for line in sys.stdin:
        steps = int(line)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        for _ in range(steps):
            one()
        sync()
        seconds = (time.perf_counter() - t) / steps
        usage = resource.getrusage(resource.RUSAGE_SELF)
        reply = {"s": seconds, "faults": (usage.ru_minflt - faults) / steps, "maxrss": usage.ru_maxrss * 1024}
        print(json.dumps(reply), flush=True)


def start(framework: str, tuning: str, family: str, size: str) -> subprocess.Popen:
    env = os.environ | {"MESHLM_MALLOC_TUNING": tuning}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", framework, "--families", family, "--sizes", size]
    return subprocess.Popen(cmd, env=env, cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def reply(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"worker exited with {proc.wait()} (its stderr is above)")


def measure(family: str, size: str, rounds: int, steps: int) -> dict[str, dict]:
    results = {}
    procs = {}
    try:
        for name, (framework, tuning) in VARIANTS.items():  # one at a time: compiles do not overlap
            procs[name] = start(framework, tuning, family, size)
            ready = reply(procs[name])["ready"]
            expected_on = tuning == "1"
            if ready.startswith("on") != expected_on:
                raise RuntimeError(f"{name}: host_memory.keep_freed() said {ready!r}")
        rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for r in range(rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                procs[name].stdin.write(f"{steps}\n")
                procs[name].stdin.flush()
                rows[name].append(reply(procs[name]))
        for name, got in rows.items():
            results[name] = {
                "ms": 1e3 * statistics.median(x["s"] for x in got),
                "faults": statistics.median(x["faults"] for x in got),
                "maxrss": max(x["maxrss"] for x in got),
            }
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="gpt,llama")
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--worker", choices=["meshlm", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.families, args.sizes)
    command = " ".join(["python benchmarks/host_memory.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores; vocab 8192, seq 256, "
        f"batch 8, fp32, 1 device; one worker process per variant, median of {args.rounds} alternating rounds of "
        f"{args.steps} steps; ms per step, minor page faults per step, peak resident memory of the worker "
        "including compilation)",
        "",
        "| family | size | meshlm: glibc defaults | meshlm: reuse | reuse / defaults | faults / step "
        "| peak RSS | PyTorch compiled: glibc defaults | PyTorch compiled: reuse | reuse / defaults |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            m = measure(family, size, args.rounds, args.steps)
            md, mr, td, tr = (m[name] for name in VARIANTS)
            mib = 2**20
            lines.append(
                f"| {family} | {size} | {md['ms']:.0f} | {mr['ms']:.0f} | {mr['ms'] / md['ms']:.2f}x "
                f"| {md['faults']:.0f} -> {mr['faults']:.0f} "
                f"| {md['maxrss'] / mib:.0f} -> {mr['maxrss'] / mib:.0f} MiB "
                f"| {td['ms']:.0f} | {tr['ms']:.0f} | {tr['ms'] / td['ms']:.2f}x |"
            )
            print(lines[-1], flush=True)
    publish("host_memory", lines, args.write)


if __name__ == "__main__":
    main()
