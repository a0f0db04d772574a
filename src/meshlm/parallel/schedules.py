"""Pipeline schedules as data: a static table of (tick, stage) -> action, built and checked in
plain Python before anything is compiled.

A pipeline of p stages runs m microbatches; with interleaving each stage holds v model chunks
(stage s holds chunks s, s+p, ..., s+(v-1)p of the p*v chunks, Megatron's virtual stages). An
action is the forward or backward pass of one microbatch through one chunk on one stage, and
takes one tick; stages run in lockstep and a result sent at one tick is usable at the next.

Each schedule is a per-stage *order* of actions (GPipe: all forwards, then all backwards; 1F1B:
p-s-1 warm-up forwards, then one forward / one backward alternately, then the remaining backwards;
interleaved 1F1B: Megatron's order over virtual chunks with (p-s-1)*2 + (v-1)*p warm-up forwards,
all of them when m = p).
`build` turns an order into a table by simulation: at every tick each stage runs its next action
if the action it depends on finished at an earlier tick, else idles. `validate` checks a table
independently: every stage runs m forwards and m backwards of each of its chunks, a forward
before its backward, every dependency one tick earlier. A schedule whose orders cannot finish
(a deadlock) is refused when built.

Derived numbers (`Schedule`): ticks, bubble fraction (idle over busy time: (p-1)/m for GPipe and
1F1B, (p-1)/(v m) interleaved) and the peak number of microbatch-chunks in flight per stage (whose
inputs must be kept: m for GPipe, min(p-s, m) for 1F1B, Megatron's warm-up + 1 interleaved, m v
when m = p).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Kind = Literal["F", "B"]
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule that cannot run (bad sizes, a deadlock, a broken invariant)."""


@dataclass(frozen=True, order=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int  # the model chunk: 0 .. p*v-1, stage = chunk % p

    def label(self, stages: int, virtual: int) -> str:
        """`F3` (forward of microbatch 3), with interleaving `F3/1` (through the stage's chunk 1)."""
        return f"{self.kind}{self.microbatch}" + (f"/{self.chunk // stages}" if virtual > 1 else "")

    def __str__(self) -> str:
        return f"{self.kind} microbatch {self.microbatch} chunk {self.chunk}"


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    microbatches: int  # m
    virtual: int  # v
    table: tuple[tuple[Action | None, ...], ...]  # [tick][stage]

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def busy_ticks(self) -> int:
        """Ticks each stage works: a forward and a backward per microbatch and chunk."""
        return 2 * self.microbatches * self.virtual

    @property
    def bubble_fraction(self) -> float:
        """Idle over busy time of a stage (P2 / Narayanan et al.'s bubble time fraction)."""
        return (self.ticks - self.busy_ticks) / self.busy_ticks

    def lockstep_time(self, forward: float, backward: float) -> float:
        """Wall time of the table when every tick lasts as long as its slowest action (stages
        exchange results every tick, so none runs ahead): sum over ticks of the max cost. With
        backward > forward, 1F1B's steady ticks pair a forward with a backward and each costs a
        backward, so 1F1B is slower than GPipe in lockstep (GPipe: (m v + p - 1)(f + b) exactly)."""
        cost = {"F": forward, "B": backward}
        return sum(max((cost[a.kind] for a in row if a is not None), default=0.0) for row in self.table)

    def lockstep_overhead(self, backward_over_forward: float) -> float:
        """Lockstep time over the busy time of one stage (m v (f + b)), minus 1: what the executor
        adds to a stage's work (the bubble (p-1)/(v m) for GPipe; more for 1F1B)."""
        busy = self.microbatches * self.virtual * (1.0 + backward_over_forward)
        return self.lockstep_time(1.0, backward_over_forward) / busy - 1.0

    def in_flight(self, stage: int) -> list[int]:
        """Microbatch-chunks forwarded but not yet backwarded on `stage`, after each tick."""
        out, live = [], 0
        for row in self.table:
            action = row[stage]
            if action is not None:
                live += 1 if action.kind == "F" else -1
            out.append(live)
        return out

    def peak_in_flight(self, stage: int) -> int:
        return max(self.in_flight(stage))

    def picture(self) -> str:
        """The table as text: one line per stage, one column per tick ('.' idle)."""
        label = lambda a: "." if a is None else a.label(self.stages, self.virtual)
        width = max(len(label(a)) for row in self.table for a in row)
        lines = []
        for s in range(self.stages):
            cells = [label(row[s]).ljust(width) for row in self.table]
            lines.append((f"stage {s}: " + " ".join(cells)).rstrip())
        return "\n".join(lines)


def check_sizes(name: str, stages: int, microbatches: int, virtual: int = 1, layers: int | None = None) -> None:
    """The combinations a schedule cannot run, as a ScheduleError naming what to change."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ScheduleError("pipeline stages, microbatches and virtual stages must be >= 1")
    if name != "interleaved" and virtual != 1:
        raise ScheduleError(f"parallel.virtual_stages={virtual} needs pipeline_schedule=interleaved (got {name})")
    if name == "interleaved" and microbatches % stages:
        raise ScheduleError(
            f"the interleaved schedule runs microbatches in groups of the stage count: train.microbatches="
            f"{microbatches} is not a multiple of stage={stages}"
        )
    if layers is not None and layers % (stages * virtual):
        raise ScheduleError(
            f"model.n_layers={layers} does not split into stage x virtual_stages = {stages * virtual} equal chunks"
        )


def first_stage_in_flight(name: str, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Stage 0's peak microbatch-chunks in flight (the most of any stage), in closed form - what
    `Schedule.peak_in_flight(0)` counts on the table (tests keep the two equal): GPipe m, 1F1B
    min(p, m), interleaved Megatron's warm-up + 1 = 2(p-1) + (v-1)p + 1 (all m v when m = p)."""
    p, m, v = stages, microbatches, virtual
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p, m)
    return m * v if m == p else min(2 * (p - 1) + (v - 1) * p + 1, m * v)


def orders(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Each stage's actions in the order it runs them."""
    p, m, v = stages, microbatches, virtual
    out = []
    for s in range(p):
        if name == "gpipe":
            order = [Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)]
        elif name == "1f1b":
            warm = min(p - s - 1, m)
            fwd = [Action("F", i, s) for i in range(m)]
            bwd = [Action("B", i, s) for i in range(m)]
            order = fwd[:warm]
            for i in range(m - warm):
                order += [fwd[warm + i], bwd[i]]
            order += bwd[m - warm :]
        else:  # interleaved: Megatron's order over virtual chunks, microbatches in groups of p
            total = m * v

            def chunk_of(k: int, forward: bool, s: int = s) -> int:
                c = (k // p) % v
                return (c if forward else v - 1 - c) * p + s

            def micro_of(k: int) -> int:
                return (k // (p * v)) * p + k % p

            fwd = [Action("F", micro_of(k), chunk_of(k, True)) for k in range(total)]
            bwd = [Action("B", micro_of(k), chunk_of(k, False)) for k in range(total)]
            # Megatron: with m == p every forward runs first ("all warm-up")
            warm = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
            order = fwd[:warm]
            for i in range(total - warm):
                order += [fwd[warm + i], bwd[i]]
            order += bwd[total - warm :]
        out.append(order)
    return out


def _dependency(action: Action, stages: int, chunks: int) -> Action | None:
    """The action whose result this one needs (None: its input is the batch itself)."""
    if action.kind == "F":
        return None if action.chunk == 0 else Action("F", action.microbatch, action.chunk - 1)
    if action.chunk == chunks - 1:  # the loss: after this microbatch's last forward
        return Action("F", action.microbatch, action.chunk)
    return Action("B", action.microbatch, action.chunk + 1)


def build(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Simulate the per-stage orders in lockstep into a table (see module); validated."""
    check_sizes(name, stages, microbatches, virtual)
    p, chunks = stages, stages * virtual
    queues = orders(name, stages, microbatches, virtual)
    done: dict[Action, int] = {}  # action -> tick it ran
    table: list[tuple[Action | None, ...]] = []
    tick = 0
    while any(queues):
        row: list[Action | None] = []
        for s in range(p):
            action = queues[s][0] if queues[s] else None
            need = None if action is None else _dependency(action, stages, chunks)
            if action is not None and (need is None or done.get(need, tick) < tick):
                row.append(queues[s].pop(0))
            else:
                row.append(None)
        if all(a is None for a in row):
            waiting = ", ".join(f"stage {s}: {q[0]}" for s, q in enumerate(queues) if q)
            raise ScheduleError(f"{name} (p={p}, m={microbatches}, v={virtual}) deadlocks at tick {tick}: {waiting}")
        for a in row:
            if a is not None:
                done[a] = tick
        table.append(tuple(row))
        tick += 1
    schedule = Schedule(name, stages, microbatches, virtual, tuple(table))
    validate(schedule)
    return schedule


def validate(schedule: Schedule) -> None:
    """Check a table's invariants independently of how it was built (ScheduleError if broken)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    chunks = p * v
    ran: dict[Action, tuple[int, int]] = {}  # action -> (tick, stage)
    for tick, row in enumerate(schedule.table):
        if len(row) != p:
            raise ScheduleError(f"tick {tick} has {len(row)} stages, not {p}")
        for stage, action in enumerate(row):
            if action is None:
                continue
            if not (0 <= action.microbatch < m and 0 <= action.chunk < chunks):
                raise ScheduleError(f"{action} is outside {m} microbatches x {chunks} chunks")
            if action.chunk % p != stage:
                where = f"chunk {action.chunk} lives on stage {action.chunk % p}"
                raise ScheduleError(f"{action} runs on stage {stage}, but {where}")
            if action in ran:
                raise ScheduleError(f"{action} runs twice")
            ran[action] = (tick, stage)
    for stage in range(p):
        for c in range(stage, chunks, p):
            for kind in ("F", "B"):
                got = sum(1 for a in ran if a.kind == kind and a.chunk == c)
                if got != m:
                    raise ScheduleError(f"stage {stage} runs {got} {kind} of chunk {c}, not {m}")
    for action, (tick, _) in ran.items():
        # the data flow, restated here rather than shared with `build`: a forward needs the previous
        # chunk's forward, the last chunk's backward its own forward (the loss), any other backward
        # the next chunk's backward
        mb, c = action.microbatch, action.chunk
        if action.kind == "F":
            need = Action("F", mb, c - 1) if c > 0 else None
        else:
            need = Action("F", mb, c) if c == chunks - 1 else Action("B", mb, c + 1)
        if need is not None and not (need in ran and ran[need][0] < tick):
            when = f"tick {ran[need][0]}" if need in ran else "never"
            raise ScheduleError(f"{action} at tick {tick} runs before {need} ({when}) has finished")
        if action.kind == "B" and not ran[Action("F", action.microbatch, action.chunk)][0] < tick:
            raise ScheduleError(f"{action} runs before its forward")


# ----------------------------------------------------------------------------- executor tables

IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclass(frozen=True)
class Tables:
    """A schedule as int32 arrays [ticks, stages] plus the buffer sizes it needs (per stage: the
    largest over stages, since every stage runs the same program)."""

    rows: dict[str, np.ndarray]
    stash_slots: int  # residuals of microbatch-chunks forwarded, not yet backwarded (the peak)
    act_slots: int  # activations arrived, not yet forwarded (+1 spare slot for idle sends)
    grad_slots: int  # cotangents arrived (or made by the loss), not yet backwarded (+1 spare)


def _colour(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Slots for (write time, read time, key) intervals: a slot is reused once its last read is
    earlier than the next write. Greedy in write order, so the count is the peak overlap."""
    free_at: list[int] = []
    slot_of = {}
    for write, read, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for k, last_read in enumerate(free_at):
            if last_read < write:
                free_at[k] = read
                slot_of[key] = k
                break
        else:
            slot_of[key] = len(free_at)
            free_at.append(read)
    return slot_of, len(free_at)


def tables(schedule: Schedule) -> Tables:
    """The per-tick actions and slots of every stage. Times are half ticks: 2t is tick t's
    branch (reads, the stash write, the loss's cotangent write), 2t+1 its end (receives).
    The inboxes have a spare last slot: a receive of nothing real (an idle neighbour's filler)
    and a forward that makes no loss cotangent write there."""
    p, v, m = schedule.stages, schedule.virtual, schedule.microbatches
    chunks = p * v
    when = {}  # (kind, microbatch, chunk) -> tick
    for t, row in enumerate(schedule.table):
        for a in row:
            if a is not None:
                when[a.kind, a.microbatch, a.chunk] = t
    stash, act, grad = ([[] for _ in range(p)] for _ in range(3))
    for i in range(m):
        for c in range(chunks):
            s, tf, tb = c % p, when["F", i, c], when["B", i, c]
            stash[s].append((2 * tf, 2 * tb, (i, c)))
            if c > 0:
                act[s].append((2 * when["F", i, c - 1] + 1, 2 * tf, (i, c)))
            written = 2 * tf if c == chunks - 1 else 2 * when["B", i, c + 1] + 1
            grad[s].append((written, 2 * tb, (i, c)))
    coloured = [[_colour(lists[s]) for s in range(p)] for lists in (stash, act, grad)]
    n_stash, n_act, n_grad = (max(1, max(n for _, n in col)) for col in coloured)
    names = ("kind", "micro", "chunk", "first", "last", "stash", "act_read", "grad_read")
    names += ("grad_write", "recv_act", "recv_grad")
    rows = {k: np.zeros((schedule.ticks, p), np.int32) for k in names}
    rows["kind"][:] = IDLE
    for keys, spare in (("act_read recv_act", n_act), ("grad_read grad_write recv_grad", n_grad)):
        for k in keys.split():
            rows[k][:] = spare
    # the stash has no spare slot: each tick reads and writes its one "stash" slot, and a tick that
    # stashes nothing writes back what it read (idle: slot 0, B: the slot it frees), so the buffer
    # is exactly the peak in flight
    slot = lambda which, s, i, c: coloured[which][s][0][i, c]
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is None:
                continue
            i, c = a.microbatch, a.chunk
            r = {"micro": i, "chunk": c // p, "first": c == 0, "last": c == chunks - 1}
            if a.kind == "F":
                r["kind"] = FORWARD
                r["stash"] = slot(0, s, i, c)
                if c > 0:
                    r["act_read"] = slot(1, s, i, c)
                if c == chunks - 1:
                    r["grad_write"] = slot(2, s, i, c)
                else:
                    rows["recv_act"][t, (s + 1) % p] = slot(1, (s + 1) % p, i, c + 1)
            else:
                r["kind"] = BACKWARD
                r["stash"] = slot(0, s, i, c)
                r["grad_read"] = slot(2, s, i, c)
                if c > 0:
                    rows["recv_grad"][t, (s - 1) % p] = slot(2, (s - 1) % p, i, c - 1)
            for k, val in r.items():
                rows[k][t, s] = int(val)
    return Tables(rows, n_stash, n_act + 1, n_grad + 1)


def pictures(stages: int = 4, microbatches: int = 8) -> str:
    """The pictures of docs/pipeline.md: each schedule at p = 4, m = 8 (interleaved with v = 2)."""
    parts = []
    for name, v, title in [("gpipe", 1, "GPipe"), ("1f1b", 1, "1F1B"), ("interleaved", 2, "Interleaved 1F1B, v = 2")]:
        s = build(name, stages, microbatches, v)
        peaks = ", ".join(str(s.peak_in_flight(i)) for i in range(stages))
        sizes = f"p = {stages}, m = {microbatches}" + (f", v = {v}" if v > 1 else "")
        head = f"### {title} ({sizes}): {s.ticks} ticks, bubble {s.bubble_fraction:.4g}, in flight per stage {peaks}"
        parts.append(f"{head}\n\n```\n{s.picture()}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(pictures(), end="")
