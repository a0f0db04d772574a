"""Pipeline schedules as tables (pure Python): invariants, tick counts, bubble fractions and the
microbatches each stage keeps in flight, for GPipe, 1F1B and interleaved 1F1B."""

import dataclasses

import pytest

from meshlm.parallel.schedules import (
    Action,
    ScheduleError,
    build,
    check_sizes,
    first_stage_in_flight,
    orders,
    validate,
)

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_and_1f1b(p, m):
    for name in ("gpipe", "1f1b"):
        s = build(name, p, m)  # build validates the table
        assert s.ticks == 2 * (m + p - 1)
        assert s.bubble_fraction == pytest.approx((p - 1) / m)
        peaks = [s.peak_in_flight(i) for i in range(p)]
        assert peaks == ([m] * p if name == "gpipe" else [min(p - i, m) for i in range(p)])
        assert first_stage_in_flight(name, p, m) == peaks[0] == max(peaks)
        assert all(x == 0 for x in [s.in_flight(i)[-1] for i in range(p)])  # everything drained


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("v", [1, 2])
def test_interleaved(p, m, v):
    s = build("interleaved", p, m, v)
    assert s.ticks == 2 * (m * v + p - 1)
    assert s.bubble_fraction == pytest.approx((p - 1) / (v * m))  # v times smaller than 1F1B's
    # Megatron's warm-up: (p - s - 1) * 2 + (v - 1) * p forwards, then one more before the first
    # backward; with m == p every forward first
    want = [m * v if m == p else min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) for i in range(p)]
    assert [s.peak_in_flight(i) for i in range(p)] == want
    assert first_stage_in_flight("interleaved", p, m, v) == want[0] == max(want)


@pytest.mark.parametrize("p, m", GRID)
def test_lockstep_time(p, m):
    """Ticks last as long as their slowest action: GPipe's forward and backward phases are
    (m + p - 1) ticks each; 1F1B's steady ticks each hold a backward, so it costs more."""
    gpipe, one = build("gpipe", p, m), build("1f1b", p, m)
    assert gpipe.lockstep_time(1.0, 2.0) == (m + p - 1) * 3.0
    assert gpipe.lockstep_overhead(2.0) == pytest.approx((p - 1) / m)
    assert one.lockstep_time(1.0, 1.0) == one.ticks  # equal costs: the tick count
    assert one.lockstep_time(1.0, 2.0) > gpipe.lockstep_time(1.0, 2.0)


def test_lockstep_1f1b_example():
    # p = 4, m = 8, b = 2f: 4 forward-only warm-up ticks + 18 ticks holding a backward (the picture)
    assert build("1f1b", 4, 8).lockstep_time(1.0, 2.0) == 4 * 1.0 + 18 * 2.0


def test_1f1b_memory_is_flat_in_m_and_gpipe_grows():
    assert [build("1f1b", 4, m).peak_in_flight(0) for m in (4, 8, 16, 32)] == [4, 4, 4, 4]
    assert [build("gpipe", 4, m).peak_in_flight(0) for m in (4, 8, 16, 32)] == [4, 8, 16, 32]


def test_the_validator_catches_broken_tables():
    good = build("1f1b", 4, 8)
    rows = [list(r) for r in good.table]

    def broken(edit) -> dataclasses.replace:
        t = [list(r) for r in rows]
        edit(t)
        return dataclasses.replace(good, table=tuple(tuple(r) for r in t))

    def swap_first_backward_earlier(t):  # stage 3's first backward one tick before its forward
        i = next(i for i, r in enumerate(t) if r[3] == Action("B", 0, 3))
        t[i - 1][3], t[i][3] = t[i][3], t[i - 1][3]

    def drop_one(t):
        i = next(i for i, r in enumerate(t) if r[2] is not None)
        t[i][2] = None

    def wrong_stage(t):
        i = next(i for i, r in enumerate(t) if r[1] is not None)
        t[i][0], t[i][1] = t[i][1], None

    def too_early(t):  # stage 1 forwards microbatch 0 in the same tick as stage 0 does
        t[0][1] = t[1][1]
        t[1][1] = None

    def extra_chunk(t):  # a forward of a chunk that does not exist, in an idle slot of stage 0
        i = next(i for i, r in enumerate(t) if r[0] is None)
        t[i][0] = Action("F", 0, 4)

    def renumbered(t):
        i = next(i for i, r in enumerate(t) if r[1] is not None)
        t[i][1] = Action(t[i][1].kind, 9, t[i][1].chunk)

    for edit, message in [
        (extra_chunk, "outside 8 microbatches x 4 chunks"),
        (renumbered, "outside"),
        (swap_first_backward_earlier, "before"),
        (drop_one, "runs 7"),
        (wrong_stage, "lives on"),
        (too_early, "before"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            validate(broken(edit))
    validate(good)


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
    ],
)
def test_schedules_that_cannot_run_are_refused(args, message):
    with pytest.raises(ScheduleError, match=message):
        check_sizes(*args)
    with pytest.raises(ScheduleError, match="n_layers=10 does not split into stage x virtual_stages = 8"):
        check_sizes("interleaved", 4, 8, 2, layers=10)


def test_pictures():
    picture = build("1f1b", 2, 3).picture()
    assert picture.splitlines() == [
        "stage 0: F0 F1 .  B0 F2 B1 .  B2",
        "stage 1: .  F0 B0 F1 B1 F2 B2 .",
    ]
    assert "F0/1" in build("interleaved", 2, 2, 2).picture()


def test_the_docs_show_the_tables():
    from pathlib import Path

    from meshlm.parallel.schedules import pictures

    doc = (Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text()
    assert doc.endswith(pictures())
