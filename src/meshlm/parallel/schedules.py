"""Pipeline schedules as data: a static table of (tick, stage) -> the actions that stage runs in
that tick, built and checked in plain Python before anything is compiled.

A pipeline of p stages runs m microbatches; with interleaving each stage holds v model chunks
(stage s holds chunks s, s+p, ..., s+(v-1)p of the p*v chunks, Megatron's virtual stages; ZB-V
chunks s and 2p - 1 - s, `chunk_stage`). An action is the forward (F) or backward (B) pass of one
microbatch through one chunk on one stage; zb1 and ZB-V split the backward into B (the input
gradient) and W (the weight gradients). A tick's cell
holds at most one backward, up to two W (zb1), and one forward, run in that order; the executor
sends the cotangent after the cell's first segment (B and, with two, the first W) and the
activation after its second (the other W and F). Stages run in lockstep - a result sent at one
tick is usable at the next - so each segment lasts as long as the slowest stage's.

Each schedule is a per-stage *order* of cells:
- GPipe: m forward cells, then m backward cells (one action each);
- 1F1B: 2(p-s-1) + 1 warm-up forwards, then cells pairing the backward of the oldest microbatch
  with the forward of the next, then the remaining backwards;
- interleaved 1F1B: Megatron's order over virtual chunks (microbatches in groups of p) with
  2(p-s-1) + (v-1)p + 1 warm-up forwards, paired the same way (Megatron runs every forward
  first when m = p; the pairs need not);
- zb1 (ZB-H1, Qi et al. 2023, in lockstep): 1F1B's cells with each backward's W in the same
  cell, except 2s of them on stage s, run where it would idle at the end (`_weight_passes`).
A steady tick holds a forward *and* a backward, so the lockstep time is (m v + p - 1)(f + b), the
textbook bubble for every backward/forward ratio (tested); the price of pairing is that a
cotangent comes back one tick per hop, so stage 0 holds 2p - 1 microbatches in flight under 1F1B.

With single ticks (`pipeline_ticks=single`: 1F1B, zb1, ZB-V) a cell holds one action and both sends
come at the tick's end, so a hop takes one action's time and stage s keeps Megatron's p - s
microbatches in flight (zb1: ZB-H1's bound; ZB-V 2p chunks of half a stage); `single_ticks`
list-schedules those tables, and a tick lasts as long as its slowest stage's action.

`build` turns the orders into a table by simulation: at every tick each stage runs its next cell
if every action in it depends only on actions finished at earlier ticks, else idles. `validate`
checks a table independently: every stage runs m forwards and m backwards of each of its chunks,
a forward before its backward, every dependency one tick earlier, at most one action of a kind
per cell. A schedule whose orders cannot finish (a deadlock) is refused when built.

Derived numbers (`Schedule`): ticks, lockstep time and overhead (the bubble), and the peak number
of microbatch-chunks in flight per stage (docs/pipeline.md has the table of all of them).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Literal, NamedTuple

from meshlm.config import _layer_kinds  # (cached; plain Python)

Kind = Literal["F", "B", "W"]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1", "zbv")
SPLIT = ("zb1", "zbv")  # the schedules that split a backward into B and W
TICKS = ("paired", "single")  # what a tick holds: a backward paired with a forward, or one action


class ScheduleError(ValueError):
    """A schedule that cannot run (bad sizes, a deadlock, a broken invariant)."""


@dataclass(frozen=True, order=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int  # the model chunk: 0 .. p*v-1, on stage `chunk_stage(...)`, its local chunk chunk // p

    def label(self, stages: int, virtual: int) -> str:
        """`F3` (forward of microbatch 3), with interleaving `F3/1` (through the stage's chunk 1)."""
        return f"{self.kind}{self.microbatch}" + (f"/{self.chunk // stages}" if virtual > 1 else "")

    def __str__(self) -> str:
        return f"{self.kind} microbatch {self.microbatch} chunk {self.chunk}"


Cell = tuple[Action, ...]  # what one stage runs in one tick, in execution order
_PHASES = ("B", "W", "F")  # the order of a cell's actions: backward, weight passes, forward
_CELL_KINDS = {b + w + f for b in ("", "B") for w in ("", "W", "WW") for f in ("", "F")}


def cell(*actions: Action) -> Cell:
    """A cell in execution order: the backward, the weight passes (zb1), the forward."""
    return tuple(sorted(actions, key=lambda a: _PHASES.index(a.kind)))


def segments(c: Cell) -> tuple[Cell, Cell]:
    """A cell's two segments, split where the executor sends the cotangent: (the backward and,
    when the cell holds two weight passes, the first; the other weight pass and the forward)."""
    w = [a for a in c if a.kind == "W"]
    first = tuple(a for a in c if a.kind == "B") + tuple(w[:-1])
    return first, tuple(a for a in c if a not in first)


def chunk_stage(name: str, stages: int, chunk: int) -> int:
    """The stage a model chunk lives on: chunk % p (stage s holds chunks s, s+p, ...); ZB-V's V
    (`zbv`): chunk c < p on stage c, c >= p on stage 2p - 1 - c, so stage s holds chunks s and
    2p - 1 - s, stage 0 both the embedding's chunk and the loss's."""
    if name == "zbv" and chunk >= stages:
        return 2 * stages - 1 - chunk
    return chunk % stages


def runs_unbranched(parallel) -> bool:
    """Whether the executor runs the backward and forward on every stage at every tick
    (`ParallelConfig`): with the ring inside the stages, whose collective-permutes may not sit in a
    branch that only some stages take (`pipeline._Stage.phase`)."""
    return parallel.context > 1 and parallel.context_strategy == "ring"


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    microbatches: int  # m
    virtual: int  # v
    table: tuple[tuple[Cell, ...], ...]  # [tick][stage] -> the cell (empty: idle)
    single: bool = False  # one action per cell, both sends at the tick's end (`single_ticks`)

    @property
    def ticks(self) -> int:
        return len(self.table)

    def stage_of(self, chunk: int) -> int:
        return chunk_stage(self.name, self.stages, chunk)

    def held_chunks(self) -> tuple[tuple[int, ...], ...]:
        """[p][v]: the model chunks stage s holds, in its local order (local chunk = chunk // p):
        s, s + p, ... ; ZB-V s and 2p - 1 - s. The executor's layer ids read it, and
        `stage_layout.regroup` puts the weights so (a test checks the two agree)."""
        chunks = range(self.stages * self.virtual)
        return tuple(tuple(c for c in chunks if self.stage_of(c) == s) for s in range(self.stages))

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into the input-gradient pass (B) and the weight pass (W)."""
        return any(a.kind == "W" for row in self.table for c in row for a in c)

    def lockstep_time(
        self, forward: float, backward: float, weight: float | None = None, unbranched: bool = False
    ) -> float:
        """Wall time of the table when stages wait for each other at every send (the executor sends
        the cotangent after a cell's first segment and the activation after its second, and none
        runs ahead): sum over ticks and segments of the max over stages of the segment's cost.
        `backward` is a whole backward; `weight` (default half of it) the share that zb1's W pass
        takes, its B pass the rest. (m v + p - 1)(f + b) for GPipe, 1F1B and interleaved (GPipe's
        phases; the paired tables' warm-up forwards, steady pairs and cool-down backwards); zb1
        m(f + b) + (p-1)(max(f, w) + b - 2w) when w <= b - w (ZB-H1's bubble), tested.
        `unbranched` (`runs_unbranched`): every stage runs its backward (B) in the first segment and
        its forward in the second at every tick, busy or not; zb1's weight passes stay where the
        table puts them: ticks x (f + b) without them. Single ticks (`single`) have one segment:
        each lasts its slowest stage's action (unbranched: f + B + the slowest W)."""
        w = backward / 2 if weight is None else weight
        cost = {"F": forward, "B": backward - w if self.splits_backward else backward, "W": w}
        if self.single:  # one segment per tick: the slowest stage's action (unbranched: B and F everywhere)
            always = forward + cost["B"] if unbranched else 0.0
            skip = {"B", "F"} if unbranched else set()
            slowest = lambda row: max(sum(cost[a.kind] for a in c if a.kind not in skip) for c in row)
            return sum(always + slowest(row) for row in self.table)
        forced = ({"B"}, {"F"}) if unbranched else (set(), set())
        total = 0.0
        for row in self.table:
            parts = [segments(c) for c in row]
            for k in (0, 1):
                always = sum(cost[kind] for kind in forced[k])
                total += always + max(sum(cost[a.kind] for a in seg[k] if a.kind not in forced[k]) for seg in parts)
        return total

    def lockstep_overhead(
        self, backward_over_forward: float, weight_over_forward: float | None = None, unbranched: bool = False
    ) -> float:
        """Lockstep time over the busy time of one stage (m v (f + b)), minus 1: what the executor
        adds to a stage's work - the textbook bubble, (p-1)/m for GPipe and 1F1B, (p-1)/(v m)
        interleaved, whatever the ratio; zb1 (p-1)(f + b - 2w)/(m(f + b)) for w <= min(f, b - w):
        a third of 1F1B's when the forward, B and W cost the same (m >= 2p - 1; less saved below)."""
        busy = self.microbatches * self.virtual * (1.0 + backward_over_forward)
        return self.lockstep_time(1.0, backward_over_forward, weight_over_forward, unbranched) / busy - 1.0

    @property
    def bubble_fraction(self) -> float:
        """Idle over busy time of a stage (P2 / Narayanan et al.'s bubble time fraction), in lockstep
        with a backward costing two forwards (zb1: its B and W one forward each)."""
        return self.lockstep_overhead(2.0)

    def in_flight(self, stage: int) -> list[int]:
        """Microbatch-chunks forwarded but not yet backwarded on `stage`, after each tick."""
        out, live = [], 0
        for row in self.table:
            live += sum(1 if a.kind == "F" else -1 if a.kind == "B" else 0 for a in row[stage])
            out.append(live)
        return out

    def peak_in_flight(self, stage: int) -> int:
        return max(self.in_flight(stage))

    def pending_weights(self, stage: int) -> list[int]:
        """zb1: microbatch-chunks forwarded whose weight pass has not run, after each tick - each
        holds its layers' matmul inputs (from the forward) and output gradients (from B)."""
        out, live = [], 0
        for row in self.table:
            live += sum(1 if a.kind == "F" else -1 if a.kind == "W" else 0 for a in row[stage])
            out.append(live)
        return out if self.splits_backward else [0] * len(out)

    def picture(self) -> str:
        """The table as text: one line per stage, one column per tick ('.' idle, `B0+F4` a pair)."""
        label = lambda c: "+".join(a.label(self.stages, self.virtual) for a in c) or "."
        width = max(len(label(c)) for row in self.table for c in row)
        lines = []
        for s in range(self.stages):
            cells = [label(row[s]).ljust(width) for row in self.table]
            lines.append((f"stage {s}: " + " ".join(cells)).rstrip())
        return "\n".join(lines)


def check_sizes(
    name: str,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    layers: int | None = None,
    ticks: str = "paired",
    prefix: int = 0,
    unit: int = 1,
) -> None:
    """The combinations a schedule cannot run, as a ScheduleError naming what to change. `layers`: those
    the stages split, after `prefix` dense first layers that run with the embedding (`pipeline_unit`;
    units of `unit` layers each)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if ticks not in TICKS:
        raise ScheduleError(f"unknown parallel.pipeline_ticks={ticks!r}; choose from {', '.join(TICKS)}")
    if ticks == "single" and name not in ("1f1b", "zb1", "zbv"):
        raise ScheduleError(
            f"parallel.pipeline_ticks=single runs 1f1b, zb1 or zbv (Megatron's in-flight counts); {name} keeps "
            + ("Megatron's count with paired ticks already" if name == "interleaved" else "every microbatch in flight")
            + ": use pipeline_ticks=paired"
        )
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ScheduleError("pipeline stages, microbatches and virtual stages must be >= 1")
    if name == "zbv" and (virtual != 2 or ticks != "single"):
        raise ScheduleError(
            "pipeline_schedule=zbv (ZB-V) holds two chunks per stage in a V and runs one action per tick: "
            "set parallel.virtual_stages=2 and parallel.pipeline_ticks=single"
        )
    if name not in ("interleaved", "zbv") and virtual != 1:
        raise ScheduleError(
            f"parallel.virtual_stages={virtual} needs pipeline_schedule=interleaved (or zbv, v = 2; got {name})"
        )
    if name == "interleaved" and microbatches % stages:
        raise ScheduleError(
            f"the interleaved schedule runs microbatches in groups of the stage count: train.microbatches="
            f"{microbatches} is not a multiple of stage={stages}"
        )
    if layers is not None and layers < stages * virtual:
        what = f"model.n_layers={layers * unit + prefix}"
        if prefix:  # an MoE model's dense first layers run with the embedding
            what += f" less the {prefix} dense first layers (run with the embedding), {layers * unit},"
        if unit > 1:
            what += f" makes {layers} unit(s) of {unit} dense and MoE layers (a chunk holds whole units), which"
        raise ScheduleError(f"{what} leaves a chunk of stage x virtual_stages = {stages * virtual} without a layer")


class Unit(NamedTuple):
    """How pipeline stages split a model's layers (`pipeline_unit`): `prefix` dense first layers run
    with the embedding on the first chunk, then `count` repeats of `kinds` (True: an MoE layer), the
    slots the chunks hold."""

    prefix: int
    kinds: tuple[bool, ...]
    count: int


MAX_UNIT = 4  # the longest repeated unit of dense and MoE layers a pipeline splits


@functools.cache
def _unit(kinds: tuple[bool, ...]) -> Unit | None:
    dense_first = next(i for i, moe in enumerate(kinds) if moe)  # the longest prefix there can be
    for u in range(1, MAX_UNIT + 1):  # the shortest unit, after the fewest dense first layers
        for prefix in range(dense_first + 1):
            rest = kinds[prefix:]
            if len(rest) % u == 0 and rest == rest[:u] * (len(rest) // u):
                return Unit(prefix, rest[:u], len(rest) // u)
    return None


def pipeline_unit(m) -> Unit | None:
    """A `model` config's layers as a pipeline splits them: an MoE model's dense first layers, then one
    unit of dense and MoE layers (the shortest, at most `MAX_UNIT`; after it the fewest dense first
    layers) repeated - DeepSeek-V3: 3, then (MoE,) x 58; Qwen's decoder_sparse_step=2: (dense, MoE)
    x L/2; a dense model or an MoE model of MoE layers only: each layer a unit. None where the rest
    repeats no unit (dense_layers=(5,) among 24 MoE layers, say): a pipeline refuses it."""
    if not m.moe:
        return Unit(0, (False,), m.n_layers)
    return _model_unit(m.n_layers, m.first_k_dense, m.moe_layer_step, tuple(m.dense_layers))


@functools.cache  # the planner asks for every layout: keyed on the fields that choose the layers' kinds
def _model_unit(n_layers: int, first_k_dense: int, step: int, dense: tuple[int, ...]) -> Unit | None:
    ids = set(_layer_kinds(n_layers, first_k_dense, max(step, 1), dense)[0])
    if len(ids) == n_layers:
        return Unit(0, (True,), n_layers)
    return _unit(tuple(i in ids for i in range(n_layers)))


def staged_units(m) -> int:
    """The slots the pipeline chunks split (`pipeline_unit`'s count; the layers when no unit repeats)."""
    unit = pipeline_unit(m)
    return unit.count if unit else m.n_layers


def schedule_for(cfg) -> Schedule:
    """A run config's pipeline schedule (`parallel.pipeline_schedule` and the sizes it runs)."""
    par = cfg.parallel
    return build(par.pipeline_schedule, par.stage, cfg.train.microbatches, par.virtual_stages, par.pipeline_ticks)


def chunk_slots(layers: int, chunks: int) -> int:
    """The slots every pipeline chunk runs (`chunk_layers`): ceil(layers / chunks)."""
    return -(-layers // chunks)


def pad_count(layers: int, chunks: int) -> int:
    """Uneven stages' pad slots over all chunks (`chunk_layers`): chunks x `chunk_slots` - layers."""
    return chunk_slots(layers, chunks) * chunks - layers


def chunk_layers(layers: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Each pipeline chunk's layers (indices among the `layers` the stages split, in model order), by
    global chunk. Every chunk has `chunk_slots` slots. Where the chunks do not split the layers evenly,
    the `pad_count` chunks that hold one layer fewer (their last slot a pad, a zero-weight layer:
    `stage_layout.regroup`) are the first and the last, alternately inward - the stages that also
    embed and run the loss, should pads ever be skipped (they run at a layer's cost today).
    DeepSeek-V3's 58 MoE layers over 16 stages: 3, 3, 3, 4 x 10, 3, 3, 3."""
    per = chunk_slots(layers, chunks)
    ends = [j for pair in zip(range(chunks), range(chunks - 1, -1, -1), strict=True) for j in pair]
    short = set(list(dict.fromkeys(ends))[: pad_count(layers, chunks)])  # first, last, second, last but one, ...
    out, at = [], 0
    for c in range(chunks):
        n = per - (c in short)
        out.append(tuple(range(at, at + n)))
        at += n
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def first_stage_in_flight(name: str, stages: int, microbatches: int, virtual: int = 1, ticks: str = "paired") -> int:
    """Stage 0's peak microbatch-chunks in flight (the most of any stage; ZB-V: the most of any
    stage, from its table), in closed form - what
    `Schedule.peak_in_flight(0)` counts on the table (tests keep the two equal): GPipe m; 1F1B and
    interleaved the paired warm-up + 1 = 2(p-1) + (v-1)p + 1, at most m v; single ticks (1F1B,
    zb1) Megatron's min(p, m)."""
    if name == "gpipe":
        return microbatches
    if name == "zbv":  # every stage can hold the most (2p chunks of L/(2p) layers): the table's peak
        schedule = built(name, stages, microbatches, virtual, ticks)
        return max(schedule.peak_in_flight(s) for s in range(stages))
    if ticks == "single":
        return min(stages, microbatches)
    return _warm_up(0, stages, microbatches, virtual)  # the warm-up forwards, then each pair frees one


def megatron_in_flight(stages: int, microbatches: int, virtual: int = 1) -> int:
    """Stage 0's peak in flight under Megatron's asynchronous schedules (P2's pipelines, priced by
    the planner's explicit `pipeline`): 1F1B p (a cotangent hop takes a backward's time, not a
    tick), interleaved 2(p-1) + (v-1)p + 1; at most m v."""
    p, m, v = stages, microbatches, virtual
    return min(p if v == 1 else 2 * (p - 1) + (v - 1) * p + 1, m * v)


def _warm_up(stage: int, stages: int, microbatches: int, virtual: int) -> int:
    """Forwards a stage runs before its first paired cell: the round trip of a microbatch to the
    last stage and back, one tick per hop (interleaved: plus the other v-1 chunk groups)."""
    return min(2 * (stages - stage - 1) + (virtual - 1) * stages + 1, microbatches * virtual)


def orders(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Cell]]:
    """Each stage's cells in the order it runs them."""
    p, m, v = stages, microbatches, virtual
    out = []
    for s in range(p):

        def chunk_of(k: int, forward: bool, s: int = s) -> int:  # interleaved: groups of p per chunk
            c = (k // p) % v
            return (c if forward else v - 1 - c) * p + s

        def micro_of(k: int) -> int:
            return (k // (p * v)) * p + k % p

        total = m * v
        fwd = [Action("F", micro_of(k), chunk_of(k, True)) for k in range(total)]
        bwd = [Action("B", micro_of(k), chunk_of(k, False)) for k in range(total)]
        if name == "gpipe":
            out.append([cell(a) for a in fwd + bwd])
            continue
        warm = _warm_up(s, p, m, v)
        pairs = [cell(bwd[i], fwd[warm + i]) for i in range(total - warm)]
        tail = [cell(a) for a in bwd[total - warm :]]
        if name == "zb1":
            pairs, tail = _weight_passes(s, pairs, tail)
        out.append([cell(a) for a in fwd[:warm]] + pairs + tail)
    return out


def _weight_passes(stage: int, pairs: list[Cell], tail: list[Cell]) -> tuple[list[Cell], list[Cell]]:
    """ZB-H1 in lockstep (zb1): each backward's weight pass W runs in its backward's cell (in the
    second segment, before the forward) - except on stage s, the Ws of its first s pairs (while
    the first cotangent travels back to stage 0, whose ticks then cost a forward and a B) and of
    the pairs with its last s forwards (while stage 0 has no forward left and runs B + W). Those
    2s wait for the s ticks at the end where stage s would idle, two per tick (one in each
    segment), so stage 0 never waits for them."""
    weight = lambda c: next(Action("W", a.microbatch, a.chunk) for a in c if a.kind == "B")
    n, late = len(pairs), []
    out = []
    for i, c in enumerate(pairs):
        if i < stage or i >= n - stage:
            late.append(weight(c))
            out.append(c)
        else:
            out.append(cell(*c, weight(c)))
    tail = [cell(*c, weight(c)) for c in tail]
    tail += [cell(*late[i : i + 2]) for i in range(0, len(late), 2)]
    return out, tail


def _dependency(action: Action, stages: int, chunks: int) -> Action | None:
    """The action whose result this one needs (None: its input is the batch itself)."""
    if action.kind == "W":  # the output gradients its B pass made
        return Action("B", action.microbatch, action.chunk)
    if action.kind == "F":
        return None if action.chunk == 0 else Action("F", action.microbatch, action.chunk - 1)
    if action.chunk == chunks - 1:  # the loss: after this microbatch's last forward
        return Action("F", action.microbatch, action.chunk)
    return Action("B", action.microbatch, action.chunk + 1)


def single_ticks(name: str, stages: int, microbatches: int) -> list[tuple[Cell, ...]]:
    """1F1B, zb1 and ZB-V with one action per cell (`pipeline_ticks=single`): a result sent at a
    tick's end is used at the next, so a hop takes one action's time, as in Megatron's asynchronous
    1F1B, and stage s keeps Megatron's p - s microbatches in flight. Built by list scheduling: at
    every tick each stage runs a ready forward while it holds fewer than p - s activations (zb1: and
    fewer than p forwards whose W has not run - ZB-H1's bound, 1F1B's peak with the pending weight
    passes counted inside it), else a ready backward (B), else its oldest pending W (zb1), else
    idles. ZB-V (`zbv`, Qi et al.'s V-shape): each stage holds chunks s and 2p - 1 - s of L/(2p)
    layers, and both bounds are 2p of them on every stage (1F1B's peak, p microbatches of L/p
    layers); of two ready forwards or backwards the one of the later chunk goes first. 1F1B costs
    Megatron's (m + p - 1)(f + b) only when f = b (a tick lasts the slowest stage's action); zb1
    with F, B and W of equal cost has ZB-H1's bubble, (p-1)/(3m), ZB-V less (tested)."""
    p, m, split, v_shape = stages, microbatches, name in SPLIT, name == "zbv"
    chunks = 2 * p if v_shape else p
    own = [[c for c in range(chunks) if chunk_stage(name, p, c) == s] for s in range(p)]  # each stage's chunks
    ran: dict[Action, int] = {}
    forwards, backwards = ([dict.fromkeys(own[s], 0) for s in range(p)] for _ in range(2))
    weights: list[list[Action]] = [[] for _ in range(p)]
    done = lambda a, t: a is None or ran.get(a, t) < t  # at an earlier tick
    table: list[tuple[Cell, ...]] = []
    while any(min(backwards[s].values()) < m or weights[s] for s in range(p)):
        t, row = len(table), []
        for s in range(p):
            held, made = sum(forwards[s].values()), sum(backwards[s].values())
            weighed = made - len(weights[s])  # forwards whose W has run (1F1B: whose backward has)
            cap = 2 * p if v_shape else p - s
            room = held - made < cap and (not split or held - weighed < (cap if v_shape else p))
            ready_f = [Action("F", forwards[s][c], c) for c in reversed(own[s]) if forwards[s][c] < m]
            ready_f = [a for a in ready_f if room and done(_dependency(a, p, chunks), t)]
            ready_b = [Action("B", backwards[s][c], c) for c in reversed(own[s]) if backwards[s][c] < forwards[s][c]]
            ready_b = [a for a in ready_b if done(_dependency(a, p, chunks), t)]
            row.append(tuple((ready_f + ready_b + weights[s])[:1]))
        if not any(row):
            raise ScheduleError(f"{name} (p={p}, m={m}, single ticks) deadlocks at tick {t}")
        for s, c in enumerate(row):
            for a in c:
                ran[a] = t
                if a.kind == "F":
                    forwards[s][a.chunk] += 1
                if a.kind == "B":
                    backwards[s][a.chunk] += 1
                    weights[s] += [Action("W", a.microbatch, a.chunk)] if split else []
                if a.kind == "W":
                    weights[s].pop(0)
        table.append(tuple(row))
    return table


def build(name: str, stages: int, microbatches: int, virtual: int = 1, ticks: str = "paired") -> Schedule:
    """Simulate the per-stage orders in lockstep into a table (see module), or list-schedule one
    action per tick (`single_ticks`); validated."""
    check_sizes(name, stages, microbatches, virtual, ticks=ticks)
    if ticks == "single":
        schedule = Schedule(name, stages, microbatches, virtual, tuple(single_ticks(name, stages, microbatches)), True)
        validate(schedule)
        return schedule
    p, chunks = stages, stages * virtual
    queues = orders(name, stages, microbatches, virtual)
    done: dict[Action, int] = {}  # action -> tick it ran
    table: list[tuple[Cell, ...]] = []
    tick = 0

    def ready(c: Cell) -> bool:  # every need done at an earlier tick, or earlier in this cell
        needs = [(_dependency(a, stages, chunks), c[:k]) for k, a in enumerate(c)]
        return all(n is None or done.get(n, tick) < tick or n in before for n, before in needs)

    while any(queues):
        row = tuple(queues[s].pop(0) if queues[s] and ready(queues[s][0]) else () for s in range(p))
        if not any(row):
            waiting = ", ".join(f"stage {s}: {' + '.join(map(str, q[0]))}" for s, q in enumerate(queues) if q)
            raise ScheduleError(f"{name} (p={p}, m={microbatches}, v={virtual}) deadlocks at tick {tick}: {waiting}")
        for c in row:
            for a in c:
                done[a] = tick
        table.append(row)
        tick += 1
    schedule = Schedule(name, stages, microbatches, virtual, tuple(table))
    validate(schedule)
    return schedule


@functools.lru_cache(maxsize=256)
def built(name: str, stages: int, microbatches: int, virtual: int = 1, ticks: str = "paired") -> Schedule:
    """`build`, remembered: the planner and the memory formula weigh the same few tables many times."""
    return build(name, stages, microbatches, virtual, ticks)


def validate(schedule: Schedule) -> None:
    """Check a table's invariants independently of how it was built (ScheduleError if broken)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    chunks = p * v
    ran: dict[Action, tuple[int, int]] = {}  # action -> (tick, stage)
    for tick, row in enumerate(schedule.table):
        if len(row) != p:
            raise ScheduleError(f"tick {tick} has {len(row)} stages, not {p}")
        for stage, c in enumerate(row):
            kinds = "".join(a.kind for a in c)
            if schedule.single and len(c) > 1:
                raise ScheduleError(f"tick {tick} stage {stage}: {kinds} - a single tick holds one action")
            if kinds not in _CELL_KINDS or ("W" in kinds and schedule.name not in SPLIT):
                allowed = "at most one backward, then one forward" + (
                    ", with up to two W" if schedule.name in SPLIT else ""
                )
                raise ScheduleError(f"tick {tick} stage {stage}: {kinds} - a cell holds {allowed}")
            for action in c:
                if not (0 <= action.microbatch < m and 0 <= action.chunk < chunks):
                    raise ScheduleError(f"{action} is outside {m} microbatches x {chunks} chunks")
                if schedule.stage_of(action.chunk) != stage:
                    where = f"chunk {action.chunk} lives on stage {schedule.stage_of(action.chunk)}"
                    raise ScheduleError(f"{action} runs on stage {stage}, but {where}")
                if action in ran:
                    raise ScheduleError(f"{action} runs twice")
                ran[action] = (tick, stage)
    runs = Counter((a.kind, a.chunk) for a in ran)
    for stage in range(p):
        for c in (c for c in range(chunks) if schedule.stage_of(c) == stage):
            for kind in ("F", "B", "W") if schedule.name in SPLIT else ("F", "B"):
                got = runs[kind, c]
                if got != m:
                    raise ScheduleError(f"stage {stage} runs {got} {kind} of chunk {c}, not {m}")
    for action, (tick, _) in ran.items():
        # the data flow, restated here rather than shared with `build`: a forward needs the previous
        # chunk's forward, the last chunk's backward its own forward (the loss), any other backward
        # the next chunk's backward
        mb, c = action.microbatch, action.chunk
        if action.kind == "W":  # after its B: an earlier tick, or earlier in the same cell
            b_tick = ran[Action("B", mb, c)][0] if Action("B", mb, c) in ran else None
            if b_tick is None or b_tick > tick:
                raise ScheduleError(f"{action} at tick {tick} runs before its B pass ({b_tick or 'never'})")
            continue
        if action.kind == "F":
            need = Action("F", mb, c - 1) if c > 0 else None
        else:
            need = Action("F", mb, c) if c == chunks - 1 else Action("B", mb, c + 1)
        if need is not None and not (need in ran and ran[need][0] < tick):
            when = f"tick {ran[need][0]}" if need in ran else "never"
            raise ScheduleError(f"{action} at tick {tick} runs before {need} ({when}) has finished")
        if action.kind == "B" and not ran[Action("F", action.microbatch, action.chunk)][0] < tick:
            raise ScheduleError(f"{action} runs before its forward")


def pictures(stages: int = 4, microbatches: int = 8) -> str:
    """The pictures of docs/pipeline.md: each schedule at p = 4, m = 8 (interleaved with v = 2)."""
    parts = []
    named = [("gpipe", 1, "GPipe"), ("1f1b", 1, "1F1B"), ("interleaved", 2, "Interleaved 1F1B, v = 2")]
    named += [("zb1", 1, "Zero bubble (ZB-H1)")]
    single = [("1f1b", 1, "1F1B, single ticks"), ("zb1", 1, "Zero bubble (ZB-H1), single ticks")]
    single += [("zbv", 2, "ZB-V (chunks s and 2p - 1 - s on stage s), single ticks")]
    for (name, v, title), ticks in [(n, "paired") for n in named] + [(n, "single") for n in single]:
        s = build(name, stages, microbatches, v, ticks)
        peaks = ", ".join(str(s.peak_in_flight(i)) for i in range(stages))
        sizes = f"p = {stages}, m = {microbatches}" + (f", v = {v}" if v > 1 else "")
        head = f"### {title} ({sizes}): {s.ticks} ticks, bubble {s.bubble_fraction:.4g}, in flight per stage {peaks}"
        if s.splits_backward:
            head += ", pending W " + ", ".join(str(max(s.pending_weights(i))) for i in range(stages))
        parts.append(f"{head}\n\n```\n{s.picture()}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(pictures(), end="")
