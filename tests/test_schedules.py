"""Pipeline schedules as tables (pure Python): invariants, tick counts, lockstep bubbles and the
microbatches each stage keeps in flight, for GPipe, 1F1B, interleaved 1F1B and zb1 (paired cells),
and 1F1B and zb1 with one action per tick (Megatron's in-flight counts)."""

import dataclasses

import numpy as np
import pytest

from meshlm.parallel.schedules import (
    Action,
    ScheduleError,
    build,
    cell,
    check_sizes,
    first_stage_in_flight,
    orders,
    segments,
    validate,
)
from meshlm.parallel.slots import tables

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
RATIOS = (0.5, 1.0, 2.0, 3.0)  # backward / forward


@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_and_1f1b(p, m):
    for name in ("gpipe", "1f1b"):
        s = build(name, p, m)  # build validates the table
        assert s.ticks == (2 * (m + p - 1) if name == "gpipe" else m + 2 * p - 1)
        for r in RATIOS:  # the textbook bubble in lockstep, whatever a backward costs
            assert s.lockstep_overhead(r) == pytest.approx((p - 1) / m)
        assert s.bubble_fraction == pytest.approx((p - 1) / m)
        peaks = [s.peak_in_flight(i) for i in range(p)]
        assert peaks == ([m] * p if name == "gpipe" else [min(2 * (p - i - 1) + 1, m) for i in range(p)])
        assert first_stage_in_flight(name, p, m) == peaks[0] == max(peaks)
        assert all(x == 0 for x in [s.in_flight(i)[-1] for i in range(p)])  # everything drained


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved(p, m, v):
    s = build("interleaved", p, m, v)
    assert s.ticks == m * v + (v + 1) * p - 1
    for r in RATIOS:  # v times smaller than 1F1B's, whatever a backward costs
        assert s.lockstep_overhead(r) == pytest.approx((p - 1) / (v * m))
    # Megatron's warm-up (p - s - 1) * 2 + (v - 1) * p forwards, then one more before the first pair
    want = [min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) for i in range(p)]
    assert [s.peak_in_flight(i) for i in range(p)] == want
    assert first_stage_in_flight("interleaved", p, m, v) == want[0] == max(want)


@pytest.mark.parametrize("p, m", GRID)
def test_lockstep_time(p, m):
    """Ticks last as long as their slowest cell: GPipe's forward and backward phases are (m + p - 1)
    ticks each; 1F1B's steady ticks each hold a forward and a backward, so it costs the same."""
    for name in ("gpipe", "1f1b"):
        s = build(name, p, m)
        assert s.lockstep_time(1.0, 2.0) == (m + p - 1) * 3.0
    assert build("1f1b", p, m).lockstep_time(1.0, 1.0) == (m + p - 1) * 2.0  # not the tick count
    # unbranched (the ring inside the stages): every tick runs a backward and a forward, so the tick
    # count prices it; zb1's W passes stay in their ticks: one, its two W passes as a forward
    for name in ("gpipe", "1f1b"):
        s = build(name, p, m)
        assert s.lockstep_time(1.0, 2.0, unbranched=True) == s.ticks * 3.0 > s.lockstep_time(1.0, 2.0)
    zb = build("zb1", p, m)  # B 0.5 forced at every tick, W (1.5) where the table has them
    w_ticks = sum(
        max(sum(a.kind == "W" for a in seg[k]) for seg in map(segments, row)) for row in zb.table for k in (0, 1)
    )
    assert zb.lockstep_time(1.0, 2.0, 1.5, unbranched=True) == zb.ticks * 1.5 + w_ticks * 1.5
    assert zb.lockstep_overhead(2.0, unbranched=True) > zb.lockstep_overhead(2.0) == zb.bubble_fraction


def test_lockstep_1f1b_example():
    # p = 4, m = 8, b = 2f (the picture): 4 forward-only warm-up ticks (stage 3 idle or starting),
    # 7 paired ticks, 4 backward-only ticks - 33 forward-times, GPipe's; one action per tick took 40
    s = build("1f1b", 4, 8)
    costs = [max(sum({"F": 1, "B": 2}[a.kind] for a in c) for c in row) for row in s.table]
    assert costs == [1] * 4 + [3] * 7 + [2] * 4
    assert s.lockstep_time(1.0, 2.0) == 33


@pytest.mark.parametrize("p, m", GRID)
def test_zero_bubble(p, m):
    """zb1 (ZB-H1 in lockstep): 1F1B's ticks and activations in flight; each backward's weight pass
    W apart from its B, and each stage s > 0 runs 2s of them in the s ticks where it would idle at
    the end. With m >= 2p - 1 the lockstep time is m(f + b) + (p-1)(max(f, w) + b - 2w) for any
    w <= b - w (ZB-H1's bubble (p-1)(F + B - W)): a third of 1F1B's when F, B and W cost the same.
    Pending weight passes (each holding its layers' matmul inputs and output gradients) peak at
    min(2p - 1, m) on every stage."""
    s, one = build("zb1", p, m), build("1f1b", p, m)
    assert s.splits_backward and not one.splits_backward
    assert s.ticks == one.ticks == m + 2 * p - 1
    assert [s.peak_in_flight(i) for i in range(p)] == [one.peak_in_flight(i) for i in range(p)]
    assert [max(s.pending_weights(i)) for i in range(p)] == [min(2 * p - 1, m)] * p
    assert tables(s).weight_slots == min(2 * p - 1, m) + 1 and tables(one).weight_slots == 0  # + a spare
    assert all(s.in_flight(i)[-1] == s.pending_weights(i)[-1] == 0 for i in range(p))
    for b in RATIOS:
        for w in (b / 4, b / 2):
            if m >= 2 * p - 1:
                assert s.lockstep_time(1.0, b, w) == pytest.approx(m * (1 + b) + (p - 1) * (max(1, w) + b - 2 * w))
            assert s.lockstep_time(1.0, b, w) < one.lockstep_time(1.0, b)
    if m >= 2 * p - 1:
        assert s.bubble_fraction == pytest.approx(one.bubble_fraction / 3) == pytest.approx((p - 1) / (3 * m))


@pytest.mark.parametrize("p, m", GRID)
def test_single_ticks_keep_megatrons_in_flight_counts(p, m):
    """pipeline_ticks=single: one action per tick, so a hop takes one action's time and stage s keeps
    Megatron's min(p - s, m) microbatches in flight under 1F1B - and under zb1, whose forwards whose
    W has not run stay within 1F1B's peak min(p, m) (ZB-H1's bound, pending weight passes inside it).
    A tick lasts its slowest stage's action: 1F1B p f + (2m + p - 2) b for b >= f (Megatron's
    (m + p - 1)(f + b) at b = f, more than paired ticks' once b > f); zb1 with F, B and W of one
    cost ZB-H1's bubble (p - 1)/(3m) for every m >= p (paired zb1 needs m >= 2p - 1 for it)."""
    one, zb = build("1f1b", p, m, ticks="single"), build("zb1", p, m, ticks="single")
    want = [min(p - s, m) for s in range(p)]
    assert [one.peak_in_flight(s) for s in range(p)] == [zb.peak_in_flight(s) for s in range(p)] == want
    assert first_stage_in_flight("1f1b", p, m, 1, "single") == first_stage_in_flight("zb1", p, m, 1, "single") == p
    assert max(max(zb.pending_weights(s)) for s in range(p)) == min(p, m)
    assert tables(one).stash_slots == tables(zb).stash_slots == p and tables(zb).weight_slots == p + 1
    for few in range(1, p):  # fewer microbatches than stages
        short = build("1f1b", p, few, ticks="single")
        assert [short.peak_in_flight(s) for s in range(p)] == [min(p - s, few) for s in range(p)]
        assert first_stage_in_flight("1f1b", p, few, 1, "single") == short.peak_in_flight(0) == few
    for r in (1.0, 2.0, 3.0):
        assert one.lockstep_time(1.0, r) == p + (2 * m + p - 2) * r
        assert one.lockstep_time(1.0, r) >= build("1f1b", p, m).lockstep_time(1.0, r)
    assert one.lockstep_time(1.0, 1.0) == 2 * (m + p - 1)
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m))
    assert zb.bubble_fraction <= build("zb1", p, m).bubble_fraction + 1e-12


@pytest.mark.parametrize("p, m", GRID)
def test_zero_bubble_v(p, m):
    """ZB-V (`zbv`): stage s holds chunks s and 2p - 1 - s of L/(2p) layers, the loss on stage 0
    with the embedding. With one action per tick and F, B, W of one cost its bubble is (p - 1)/(6m):
    half of ZB-H1's (its chunks are half as long), in 6m + p - 1 ticks; every stage holds at most
    2p chunks' activations, and 2p forwards whose W has not run: 1F1B's peak, p microbatches of
    L/p layers (min(2p, 2m))."""
    z, zb = build("zbv", p, m, 2, "single"), build("zb1", p, m, 1, "single")
    assert [z.stage_of(c) for c in range(2 * p)] == [*range(p), *reversed(range(p))]
    assert z.ticks == 6 * m + p - 1
    assert z.bubble_fraction == pytest.approx((p - 1) / (6 * m)) == pytest.approx(zb.bubble_fraction / 2)
    assert (
        max(z.peak_in_flight(s) for s in range(p))
        == min(2 * p, 2 * m)
        == first_stage_in_flight("zbv", p, m, 2, "single")
    )
    assert max(max(z.pending_weights(s)) for s in range(p)) == min(2 * p, 2 * m)
    assert tables(z).stash_slots == min(2 * p, 2 * m)
    for few in range(1, p):  # fewer microbatches than stages: 2m chunks at most
        short = build("zbv", p, few, 2, "single")
        assert max(short.peak_in_flight(s) for s in range(p)) == 2 * few
    t = [list(r) for r in z.table]  # a chunk on the wrong arm of the V is refused
    i = next(i for i, r in enumerate(t) if Action("F", 0, 2 * p - 1) in r[0])
    t[i][0], t[i][p - 1] = (), (Action("F", 0, 2 * p - 1),)
    with pytest.raises(ScheduleError, match=f"chunk {2 * p - 1} lives on stage 0"):
        validate(dataclasses.replace(z, table=tuple(tuple(r) for r in t)))


@pytest.mark.parametrize("name, v, layers", [("1f1b", 1, 8), ("interleaved", 3, 24), ("zbv", 2, 16), ("zbv", 2, 13)])
def test_the_weights_are_regrouped_as_the_stages_hold_the_chunks(name, v, layers):
    """One statement of which chunks a stage holds (`Schedule.held_chunks`) serves the executor's
    layer ids; `stage_layout.regroup` puts each stage's weights there by a reshape, ZB-V's reversed
    second arm and a transpose, and `ungroup` undoes it: checked on layer numbers (p = 4, 2 layers
    a chunk; 13 layers: uneven, their pad slots zero, but an MoE router's and its norm's layer 0's)."""
    from meshlm.parallel.schedules import chunk_layers
    from meshlm.parallel.stage_layout import layer_slots, regroup, ungroup

    p = 4
    z = build(name, p, 8, v, "single" if name == "zbv" else "paired")
    layers_ = np.arange(1, layers + 1)  # layer j holds j + 1 (a pad slot 0)
    slots = layer_slots(layers, p * v)
    grouped = np.asarray(regroup(layers_, z, slots))
    chunks = {"1f1b": [[s] for s in range(p)], "interleaved": [[s, s + p, s + 2 * p] for s in range(p)]}
    chunks["zbv"] = [[s, 2 * p - 1 - s] for s in range(p)]
    assert [list(row) for row in z.held_chunks()] == chunks[name]
    table = chunk_layers(layers, p * v)
    for s, held in enumerate(z.held_chunks()):
        for lc, c in enumerate(held):
            assert list(grouped[s, lc]) == [j + 1 for j in table[c]] + [0] * (slots.shape[1] - len(table[c]))
    assert list(np.asarray(ungroup(grouped, z, slots))) == list(layers_)
    routers = np.asarray(regroup(layers_, z, slots, "w_router"))  # an MoE pad routes as layer 0 does
    assert (routers[grouped == 0] == 1).all() and (routers[grouped > 0] == grouped[grouped > 0]).all()


def test_uneven_stages_put_their_pads_at_both_ends():
    """`chunk_layers`: every layer once, in order; chunk sizes differ by at most one; the lighter
    chunks are the first and the last, alternately inward; the pads number `pad_count`. DeepSeek-V3's
    58 MoE layers over 16 stages, and 4 over 3."""
    from meshlm.parallel.schedules import chunk_layers, chunk_slots, pad_count

    assert [len(c) for c in chunk_layers(58, 16)] == [3, 3, 3] + [4] * 10 + [3, 3, 3]
    assert chunk_layers(4, 3) == ((0,), (1, 2), (3,))
    for layers in range(4, 40):
        for chunks in range(1, layers + 1):
            table = chunk_layers(layers, chunks)
            assert [j for c in table for j in c] == list(range(layers))
            sizes = [len(c) for c in table]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
            short = [i for i, n in enumerate(sizes) if n < max(sizes)]
            assert len(short) == pad_count(layers, chunks) and max(sizes) == chunk_slots(layers, chunks)
            ends = sorted(min(i, chunks - 1 - i) for i in short)  # distance from the nearer end
            assert ends == [i // 2 for i in range(len(short))], (layers, chunks, sizes)


@pytest.mark.parametrize(
    "layers, kinds, unit",
    [
        (61, dict(first_k_dense=3), (3, (True,), 58)),  # DeepSeek-V3
        (48, dict(moe_layer_step=2), (0, (False, True), 24)),  # Qwen's decoder_sparse_step=2
        (7, dict(first_k_dense=1, moe_layer_step=2), (1, (True, False), 3)),
        (4, dict(first_k_dense=3), (3, (True,), 1)),  # not one unit of 4: the shortest unit first
        (4, dict(dense_layers=(2,)), (0, (True, True, False, True), 1)),
        (24, dict(dense_layers=(5,)), None),
        (24, dict(), (0, (True,), 24)),
    ],
)
def test_a_pipeline_splits_dense_and_moe_layers_in_units(layers, kinds, unit):
    """`pipeline_unit`: dense first layers, then the shortest unit that repeats, as a brute-force
    search over every prefix and unit of at most MAX_UNIT layers finds it; None where none does."""
    from meshlm.config import ModelConfig
    from meshlm.parallel.schedules import MAX_UNIT, pipeline_unit

    m = ModelConfig(family="llama", n_layers=layers, n_experts=4, **kinds)
    got = pipeline_unit(m)
    assert (got and (got.prefix, got.kinds, got.count)) == unit
    order = tuple(i in m.moe_layer_ids for i in range(layers))
    found = [
        (len(u), p, u)
        for p in range(layers)
        for n in range(1, MAX_UNIT + 1)
        if (u := order[p : p + n]) and not any(order[:p]) and order == order[:p] + u * ((layers - p) // n)
    ]
    assert (got is None) == (not found)
    if got:
        assert min(found)[1:] == (got.prefix, got.kinds)


def test_single_ticks_pictures():
    """Megatron's 1F1B: p - s - 1 warm-up forwards, then a forward and a backward in turn; zb1
    fills the bubbles with weight passes (ZB-H1, Qi et al. Figure 3)."""
    assert build("1f1b", 2, 3, ticks="single").picture().splitlines() == [
        "stage 0: F0 F1 .  B0 F2 B1 .  B2",
        "stage 1: .  F0 B0 F1 B1 F2 B2 .",
    ]
    assert build("zb1", 2, 3, ticks="single").picture().splitlines() == [
        "stage 0: F0 F1 .  B0 W0 F2 B1 W1 B2 W2",
        "stage 1: .  F0 B0 F1 B1 W0 F2 B2 W1 W2",
    ]


def test_1f1b_memory_is_flat_in_m_and_gpipe_grows():
    assert [build("1f1b", 4, m).peak_in_flight(0) for m in (4, 8, 16, 32)] == [4, 7, 7, 7]
    assert [build("gpipe", 4, m).peak_in_flight(0) for m in (4, 8, 16, 32)] == [4, 8, 16, 32]


def test_the_validator_catches_broken_tables():
    good = build("1f1b", 4, 8)
    rows = [list(r) for r in good.table]
    find = lambda t, s, pred: next(i for i, r in enumerate(t) if pred(r[s]))

    def broken(edit) -> dataclasses.replace:
        t = [list(r) for r in rows]
        edit(t)
        return dataclasses.replace(good, table=tuple(tuple(r) for r in t))

    def backward_with_its_forward(t):  # stage 3's first backward in the tick of its forward
        i = find(t, 3, lambda c: Action("B", 0, 3) in c)
        t[i - 1][3], t[i][3] = cell(Action("B", 0, 3), *t[i - 1][3]), cell(*(a for a in t[i][3] if a.kind == "F"))

    def drop_one(t):
        i = find(t, 2, bool)
        t[i][2] = ()

    def wrong_stage(t):
        i = find(t, 1, bool)
        t[i][0], t[i][1] = t[i][1], ()

    def too_early(t):  # stage 1 forwards microbatch 0 in the same tick as stage 0 does
        t[0][1], t[1][1] = t[1][1], ()

    def extra_chunk(t):  # a forward of a chunk that does not exist, in an idle cell of stage 3
        t[find(t, 3, lambda c: not c)][3] = cell(Action("F", 0, 4))

    def renumbered(t):
        i = find(t, 1, bool)
        t[i][1] = tuple(Action(a.kind, 9, a.chunk) for a in t[i][1])

    def two_forwards(t):  # stage 0's first two forwards in one cell
        t[0][0], t[1][0] = (t[0][0][0], t[1][0][0]), ()

    def forward_first(t):  # a pair in the wrong order: the forward before the backward
        i = find(t, 3, lambda c: len(c) == 2)
        t[i][3] = tuple(reversed(t[i][3]))

    for edit, message in [
        (extra_chunk, "outside 8 microbatches x 4 chunks"),
        (renumbered, "outside"),
        (backward_with_its_forward, "before"),
        (drop_one, "runs 7"),
        (wrong_stage, "lives on"),
        (too_early, "before"),
        (two_forwards, "at most one backward, then one forward"),
        (forward_first, "at most one backward, then one forward"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            validate(broken(edit))
    validate(good)
    single = build("1f1b", 4, 8, ticks="single")  # a paired cell in a single-tick table
    t = [list(r) for r in single.table]
    i = find(t, 3, lambda c: Action("B", 0, 3) in c)
    t[i][3], t[i + 1][3] = cell(*t[i][3], *t[i + 1][3]), ()
    with pytest.raises(ScheduleError, match="a single tick holds one action"):
        validate(dataclasses.replace(single, table=tuple(tuple(r) for r in t)))


def test_the_validator_catches_broken_zero_bubble_tables():
    """A W before its B, three W in a cell, a W in a 1F1B table, a missing W."""
    zb, good = build("zb1", 4, 8), build("1f1b", 4, 8)
    find = lambda t, s, pred: next(i for i, r in enumerate(t) if pred(r[s]))

    def weight_before_its_b(t):  # stage 3's last cell (two Ws) swapped with its first backward's tick
        i = find(t, 3, lambda c: Action("B", 1, 3) in c)
        t[i][3], t[-1][3] = cell(*t[i][3], *t[-1][3]), ()

    def three_weights(t):
        i = find(t, 3, lambda c: sum(a.kind == "W" for a in c) == 2)
        j = find(t, 3, lambda c: sum(a.kind == "W" for a in c) == 1)
        w = next(a for a in t[j][3] if a.kind == "W")
        t[i][3], t[j][3] = cell(*t[i][3], w), cell(*(a for a in t[j][3] if a.kind != "W"))

    def a_weight_in_1f1b(t):
        t[-1][0] = cell(*t[-1][0], Action("W", 7, 0))

    def one_weight_missing(t):
        i = find(t, 2, lambda c: sum(a.kind == "W" for a in c) == 2)
        t[i][2] = cell(*t[i][2][1:])

    for table, edit, message in [
        (zb, weight_before_its_b, "runs before its B pass"),
        (zb, three_weights, "up to two W"),
        (good, a_weight_in_1f1b, "at most one backward, then one forward"),
        (zb, one_weight_missing, "runs 7 W of chunk 2"),
    ]:
        t = [list(r) for r in table.table]
        edit(t)
        with pytest.raises(ScheduleError, match=message):
            validate(dataclasses.replace(table, table=tuple(tuple(r) for r in t)))
    validate(zb)


def test_a_deadlocking_order_is_refused(monkeypatch):
    """Orders whose dependencies can never be met are refused while building, naming the stalls."""
    import meshlm.parallel.schedules as sch

    def backwards_first(name, p, m, v=1):
        return [list(reversed(o)) for o in orders("gpipe", p, m, v)]

    monkeypatch.setattr(sch, "orders", backwards_first)
    with pytest.raises(ScheduleError, match="deadlocks at tick 0"):
        sch.build("gpipe", 2, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (("gpipe", 4, 8, 2), "virtual_stages=2 needs pipeline_schedule=interleaved"),
        (("interleaved", 4, 6, 2), "train.microbatches=6 is not a multiple of stage=4"),
        (("zero-bubble", 4, 8, 1), "unknown pipeline schedule"),
        (("1f1b", 4, 0, 1), "must be >= 1"),
        (("interleaved", 4, 8, 2, None, "single"), "keeps Megatron's count with paired ticks already"),
        (("gpipe", 4, 8, 1, None, "single"), "runs 1f1b, zb1 or zbv"),
        (("1f1b", 4, 8, 1, None, "half"), "unknown parallel.pipeline_ticks='half'"),
        (("zbv", 4, 8, 2, None, "paired"), "set parallel.virtual_stages=2 and parallel.pipeline_ticks=single"),
        (("zbv", 4, 8, 1, None, "single"), "holds two chunks per stage in a V"),
    ],
)
def test_schedules_that_cannot_run_are_refused(args, message):
    with pytest.raises(ScheduleError, match=message):
        check_sizes(*args)
    with pytest.raises(ScheduleError, match="n_layers=6 leaves a chunk of stage x virtual_stages = 8 without a layer"):
        check_sizes("interleaved", 4, 8, 2, layers=6)


def test_pictures():
    picture = build("1f1b", 2, 3).picture()
    assert picture.splitlines() == [
        "stage 0: F0    F1    F2    B0    B1    B2",
        "stage 1: .     F0    B0+F1 B1+F2 B2    .",
    ]
    assert "F0/1" in build("interleaved", 2, 2, 2).picture()


def test_the_docs_show_the_tables():
    from pathlib import Path

    from meshlm.parallel.schedules import pictures

    doc = (Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text()
    assert doc.endswith(pictures())
