"""A pipeline schedule's table as the executor reads it (`parallel.pipeline`): int32 arrays
[ticks, stages] of what each stage does at each tick and which buffer slot every read and write
uses, slots assigned in Python by interval colouring over quarter ticks (`QUARTERS`), so nothing
is searched at run time and every buffer is as large as the schedule needs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from meshlm.parallel.schedules import Action, Schedule, built, segments


@dataclass(frozen=True)
class Tables:
    """A schedule as int32 arrays [ticks, stages] plus the buffer sizes it needs (per stage: the
    largest over stages, since every stage runs the same program)."""

    rows: dict[str, np.ndarray]
    stash_slots: int  # residuals of microbatch-chunks forwarded, not yet backwarded (the peak)
    weight_slots: int  # zb1: region inputs and output gradients of pending weight passes (peak + 1 spare)
    act_slots: int  # activations arrived, not yet forwarded (+1 spare slot for idle sends)
    grad_slots: int  # cotangents arrived (or made by the loss), not yet backwarded (+1 spare)
    single: bool = False  # one action per tick: both sends at its end (`Schedule.single`)
    v_shape: bool = False  # ZB-V: messages go either way (`route`)


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


# The rows of `tables`: the backward phase's (b...), the forward phase's (f...), the receives.
ROWS = ("b", "b_micro", "b_chunk", "b_first", "b_stash", "grad_read")
ROWS += ("f", "f_micro", "f_chunk", "f_first", "f_last", "f_stash", "act_read", "grad_write", "recv_act", "recv_grad")
# zb1: the weight slot B writes and F writes, and the weight passes of each segment (w1 before the
# cotangent's send, w2 after it, before the forward): whether, which chunk, which slot
ROWS += ("b_wslot", "f_wslot", "w1", "w1_chunk", "w1_slot", "w2", "w2_chunk", "w2_slot")
# ZB-V, whose messages go either way (`route`): where an activation from the right neighbour and a
# cotangent from the left land, and the turn at the V's bottom (both permutes carry a stage's one
# message of the tick, and the receiver's rows say which arrival is real)
ROWS += ("recv_act_r", "recv_grad_l", "keep_act", "keep_grad")


# A tick's parts in the order the executor runs them (`pipeline._Stage.tick`), as the quarter ticks
# `tables` times every slot's write and read by (4 t + the part), stated here once for both modules:
# the backward reads its residuals and cotangent (and a first-segment W its weight slot); the forward
# reads its input (a second-segment W, before it, its weight slot); the forward writes its residuals,
# the loss's cotangent and zb1's region inputs; the receives file what the sends brought.
QUARTERS = {"backward": 0, "forward_read": 1, "forward_write": 2, "receive": 3}


def _quarter(tick: int, part: str) -> int:
    return 4 * tick + QUARTERS[part]


def route(schedule: Schedule, action: Action) -> str:
    """Where what a forward (its activation) or a backward (its input's cotangent) makes goes: to the
    next stage over the right permute ("right": every forward but ZB-V's), to the previous one over
    the left permute ("left": every backward but ZB-V's; both wrap around the ring), or to its own
    stage ("local": ZB-V's turn from chunk p - 1 to chunk p, both on the last stage)."""
    forward = action.kind == "F"
    if schedule.name != "zbv":
        return "right" if forward else "left"
    here, there = schedule.stage_of(action.chunk), schedule.stage_of(action.chunk + (1 if forward else -1))
    return "local" if there == here else "right" if there == here + 1 else "left"


_LANDS = {  # (route, the message's kind) -> the receiver's row
    ("right", "F"): "recv_act",
    ("left", "B"): "recv_grad",
    ("left", "F"): "recv_act_r",
    ("right", "B"): "recv_grad_l",
    ("local", "F"): "keep_act",
    ("local", "B"): "keep_grad",
}


def _lifetimes(schedule: Schedule) -> tuple[list, dict]:
    """Per buffer (stash, activation inbox, cotangent inbox, weight slots) and stage, the (write,
    read, (microbatch, chunk)) quarter-tick intervals of what it holds; and when each weight pass
    reads its slot."""
    p, v, m = schedule.stages, schedule.virtual, schedule.microbatches
    chunks = p * v
    when = {}  # (kind, microbatch, chunk) -> tick
    for t, row in enumerate(schedule.table):
        for c in row:
            for a in c:
                when[a.kind, a.microbatch, a.chunk] = t
    w_read = {}  # (microbatch, chunk) -> quarter tick its weight pass reads
    for t, row in enumerate(schedule.table):
        for c_ in row:
            for a, seg in ((a, k) for k, part in enumerate(segments(c_)) for a in part if a.kind == "W"):
                w_read[a.microbatch, a.chunk] = _quarter(t, ("backward", "forward_read")[seg])
    stash, act, grad, weight = ([[] for _ in range(p)] for _ in range(4))
    for i in range(m):
        for c in range(chunks):
            s, tf, tb = schedule.stage_of(c), when["F", i, c], when["B", i, c]
            stash[s].append((_quarter(tf, "forward_write"), _quarter(tb, "backward"), (i, c)))
            if (i, c) in w_read:
                weight[s].append((_quarter(tf, "forward_write"), w_read[i, c], (i, c)))
            if c > 0:
                act[s].append((_quarter(when["F", i, c - 1], "receive"), _quarter(tf, "forward_read"), (i, c)))
            last = c == chunks - 1  # the loss's cotangent, written by the forward; else received
            written = _quarter(tf, "forward_write") if last else _quarter(when["B", i, c + 1], "receive")
            grad[s].append((written, _quarter(tb, "backward"), (i, c)))
    return [stash, act, grad, weight], w_read


def tables(schedule: Schedule) -> Tables:
    """The per-tick actions and slots of every stage. Times are quarter ticks (`QUARTERS`), so a
    slot freed by a tick's backward takes that tick's forward. The inboxes have a spare last
    slot: a receive of nothing real (an idle neighbour's filler) and a forward that makes no loss
    cotangent write there. The stash has none: a tick without a forward writes back the slot its
    backward read (slot 0 when idle), so the buffer is exactly the peak in flight. zb1's weight
    slots live from the forward's write (4t+2) to the weight pass's read (4t in the first segment,
    4t+1 in the second, which runs before the forward); B writes its output gradients into its
    microbatch-chunk's slot; an idle B or forward writes into their spare last slot."""
    p, chunks = schedule.stages, schedule.stages * schedule.virtual
    (stash, act, grad, weight), w_read = _lifetimes(schedule)
    coloured = [[_colour(lists[s]) for s in range(p)] for lists in (stash, act, grad, weight)]
    n_stash, n_act, n_grad, n_weight = (max(1, max(n for _, n in col)) for col in coloured)
    rows = {k: np.zeros((schedule.ticks, p), np.int32) for k in ROWS}
    spares = [("act_read recv_act recv_act_r keep_act", n_act), ("b_wslot f_wslot", n_weight)]
    spares += [("grad_read grad_write recv_grad recv_grad_l keep_grad", n_grad)]
    for keys, spare in spares:
        for k in keys.split():
            rows[k][:] = spare
    slot = lambda which, s, i, c: coloured[which][s][0][i, c]

    def send(t: int, a: Action) -> None:  # file the message where it lands
        c = a.chunk + (1 if a.kind == "F" else -1)
        to = schedule.stage_of(c)
        rows[_LANDS[route(schedule, a), a.kind]][t, to] = slot(1 if a.kind == "F" else 2, to, a.microbatch, c)

    for t, row in enumerate(schedule.table):
        for s, cell_ in enumerate(row):
            r: dict[str, int] = {}
            first = segments(cell_)[0]
            for a in cell_:
                i, c = a.microbatch, a.chunk
                if a.kind == "W":
                    w = "w1" if a in first else "w2"
                    r |= {w: 1, f"{w}_chunk": c // p, f"{w}_slot": slot(3, s, i, c)}
                    continue
                if a.kind == "B":
                    r |= {"b": 1, "b_micro": i, "b_chunk": c // p, "b_first": c == 0}
                    r |= {"b_stash": slot(0, s, i, c), "grad_read": slot(2, s, i, c)}
                    if (i, c) in w_read:
                        r["b_wslot"] = slot(3, s, i, c)
                    if c > 0:
                        send(t, a)
                    continue
                r |= {"f": 1, "f_micro": i, "f_chunk": c // p, "f_first": c == 0, "f_last": c == chunks - 1}
                r["f_stash"] = slot(0, s, i, c)
                if (i, c) in w_read:
                    r["f_wslot"] = slot(3, s, i, c)
                if c > 0:
                    r["act_read"] = slot(1, s, i, c)
                if c == chunks - 1:
                    r["grad_write"] = slot(2, s, i, c)
                else:
                    send(t, a)
            if "f" not in r:  # write back what the backward read
                r["f_stash"] = r.get("b_stash", 0)
            for k, val in r.items():
                rows[k][t, s] = int(val)
    weight_slots = n_weight + 1 if w_read else 0
    v_shape = schedule.name == "zbv"
    return Tables(rows, n_stash, weight_slots, n_act + 1, n_grad + 1, schedule.single, v_shape)


@functools.lru_cache(maxsize=1024)
def slot_counts(name: str, stages: int, microbatches: int, virtual: int = 1, ticks: str = "paired") -> tuple:
    """(activation inbox, cotangent inbox, weight) slots of the schedule's `tables`, remembered."""
    tab = tables(built(name, stages, microbatches, virtual, ticks))
    return tab.act_slots, tab.grad_slots, tab.weight_slots
