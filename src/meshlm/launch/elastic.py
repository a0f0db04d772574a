"""Elastic groups: the smaller group a layout shrinks to when processes are lost, and the train
command that runs it.

A group of N processes x D devices shrinks to n processes by cutting the `data` axis (else
`fsdp`) by N/n and raising `train.microbatches` by as much: the global batch, the per-device
microbatch and every model axis stay as they were, so the losses follow the full group's (to the
cross-layout tolerance: the batch's rows are summed in another order) and memory per device does not
grow. A layout whose batch axes cannot absorb the loss (no data or fsdp axis, or sizes that do not
divide) refuses, with the reason: losing a member of a tensor or stage group cannot be repaired by
fewer processes.
"""

from __future__ import annotations

import dataclasses
import math

from meshlm.axes import MESH_AXES
from meshlm.config import ConfigError, RunConfig
from meshlm.validation import validate


def shrunk(cfg: RunConfig, processes: int, to: int) -> RunConfig | str:
    """`cfg` for `to` processes instead of `processes` (the same devices each), or why it cannot be."""
    p, tc = cfg.parallel, cfg.train
    reasons = []
    for axis in ("data", "fsdp"):
        size = getattr(p, axis)
        if size == 1 or (size * to) % processes:
            reasons.append(f"{axis}={size} does not shrink by {processes}/{to}")
            continue
        new = size * to // processes
        if (tc.microbatches * size) % new:
            reasons.append(f"train.microbatches={tc.microbatches} x {size}/{new} is not whole")
            continue
        changes = {axis: new}
        dcn = getattr(p, f"dcn_{axis}")
        if dcn > 1:  # the axis's split across nodes shrinks with it
            if (dcn * to) % processes:
                reasons.append(f"--dcn {axis}={dcn} does not shrink by {processes}/{to}")
                continue
            changes[f"dcn_{axis}"] = dcn * to // processes
        micro = tc.microbatches * size // new
        candidate = dataclasses.replace(
            cfg, parallel=dataclasses.replace(p, **changes), train=dataclasses.replace(tc, microbatches=micro)
        )
        slices, before = math.prod(candidate.parallel.dcn.values()), math.prod(p.dcn.values())
        if before > 1 and slices * processes != before * to:  # as many processes per slice or node as before
            reasons.append(f"{axis}={new}: --dcn would leave {slices} slice(s) for {to} processes")
            continue
        try:
            return validate(candidate)
        except ConfigError as e:
            reasons.append(f"{axis}={new} with {micro} microbatches: {e}")
    return "; ".join(reasons)


def largest(cfg: RunConfig, processes: int, capacity: int, least: int) -> tuple[int, RunConfig] | str:
    """The largest group in [least, capacity] that `cfg` shrinks to: (its size, its config), or why none."""
    tried = []
    for n in range(min(capacity, processes - 1), least - 1, -1):
        got = shrunk(cfg, processes, n)
        if isinstance(got, RunConfig):
            return n, got
        tried.append(f"{n} processes: {got}")
    if not tried:
        return f"only {capacity} process(es) can run, fewer than --min-processes {least}"
    return "; ".join(tried)


def command(train_args: list[str], cfg: RunConfig) -> list[str]:
    """The train command `train_args` with `cfg`'s mesh, `--dcn` and microbatches in place of its own."""
    out, skip = [], False
    for arg in train_args:
        if skip:
            skip = False
            continue
        if arg in ("--mesh", "--dcn"):
            skip = True
            continue
        if arg.startswith(("--mesh=", "--dcn=")):
            continue
        out.append(arg)
    p = cfg.parallel
    mesh = ",".join(f"{a}={getattr(p, a)}" for a in MESH_AXES if getattr(p, a) > 1) or "data=1"
    # every split, 1 included: a user's own --set of one must not survive
    sets = [f"parallel.dcn_{a}={w}" for a, w in p.dcn.items() if hasattr(p, f"dcn_{a}")]
    sets.append(f"train.microbatches={cfg.train.microbatches}")
    return [*out, "--mesh", mesh, *[x for kv in sets for x in ("--set", kv)]]
