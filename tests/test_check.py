"""`meshlm check`: a layout's raw gradients against one device's, for any configuration.

It must pass on the layouts the suite proves equal elsewhere, and fail - naming the parameter - on
bugs planted in code only the layout runs (a tensor-parallel region, the ring's backward pass, a
pipeline stage, the sequence-parallel gather). A fuzzer draws random valid combinations of the
compatibility matrix's options on every run (seed printed; MESHLM_FUZZ_SEED replays one).
"""

import json
import os
import random
import time

import jax
import jax.numpy as jnp
import pytest

from meshlm.cli import main
from meshlm.config import apply_overrides
from meshlm.exits import EXIT_CONFIG, EXIT_MISMATCH
from meshlm.insight import check, compat
from meshlm.parallel import collectives, context, pipeline

FUZZ_BUDGET_S = 10.0  # of the suite's time, per run (2-3 rows; the matrix test checks every pair)


def _cfg(family: str, *sets: str):
    """The family's recipe as the compatibility matrix runs it (one device), then `sets`."""
    row = {"family": family, "mesh": "data=2", "attention": "explicit", "remat": "elementwise", "dtype": "float32"}
    return apply_overrides(compat.config_for(row | {"document_mask": False}), ["parallel.data=1", *sets])


# The layouts the suite's gradient tests cover (test_gradients, test_context, test_pipeline), each
# once here through the check's own path: shrink, one step, compare.
SUITE_LAYOUTS = {
    "data=8": ("gpt", "parallel.data=8"),
    "fsdp=8": ("llama", "parallel.fsdp=8"),
    "fsdp=2 x tensor=4 + SP, selective": (
        "gpt",
        "parallel.fsdp=2",
        "parallel.tensor=4",
        "parallel.sequence_parallel=true",
        "remat.policy=selective",
    ),
    "data=2 x tensor=4, document masks": (
        "llama",
        "parallel.data=2",
        "parallel.tensor=4",
        "data.document_mask=true",
        "model.n_heads=8",
        "model.n_kv_heads=4",
    ),
    "context=4 ring x tensor=2 + SP": (
        "gpt",
        "parallel.context=4",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "model.attention=blockwise",
    ),
    "context=2 all_gather x data=2, unbalanced": (
        "llama",
        "parallel.context=2",
        "parallel.data=2",
        "parallel.context_strategy=all_gather",
        "parallel.context_load_balance=false",
        "model.attention=blockwise",
    ),
    "context=2 all_to_all x tensor=2 + SP, explicit, document masks": (
        "gpt",
        "parallel.context=2",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "parallel.context_strategy=all_to_all",
        "data.document_mask=true",
    ),
    "stage=2 x data=2 x tensor=2 + SP, 1f1b": (
        "gpt",
        "parallel.stage=2",
        "parallel.data=2",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "train.microbatches=4",
    ),
    "data=2 x tensor=4 + SP": (
        "llama",
        "parallel.data=2",
        "parallel.tensor=4",
        "parallel.sequence_parallel=true",
        "model.n_heads=8",
        "model.n_kv_heads=4",
    ),
    "context=8 ring": ("llama", "parallel.context=8", "model.attention=blockwise"),
    "context=2 all_gather x fsdp=2 x tensor=2 + SP": (
        "gpt",
        "parallel.context=2",
        "parallel.fsdp=2",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "parallel.context_strategy=all_gather",
        "model.attention=blockwise",
    ),
    "stage=4 x tensor=2, gpipe": (
        "gpt",
        "parallel.stage=4",
        "parallel.tensor=2",
        "parallel.pipeline_schedule=gpipe",
        "train.microbatches=4",
    ),
    "stage=4 x tensor=2, interleaved": (
        "llama",
        "parallel.stage=4",
        "parallel.tensor=2",
        "parallel.pipeline_schedule=interleaved",
        "parallel.virtual_stages=2",
        "train.microbatches=4",
        "model.n_layers=8",
    ),
}


@pytest.mark.parametrize("name", list(SUITE_LAYOUTS))
def test_check_passes_on_the_suites_layouts(name, devices):
    family, *sets = SUITE_LAYOUTS[name]
    result = check.run_check(_cfg(family, *sets))
    assert result.equal, "\n".join(check.format_result(result))
    assert result.sizes["shrunk"] and result.tolerance == check.TOLERANCES["float32"]
    assert max(e.error for e in result.leaves) < 1e-5


def _double_the_gradient(w):
    @jax.custom_vjp
    def f(w):
        return w

    f.defvjp(lambda w: (w, None), lambda _, g: (2 * g,))
    return f(w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_doubled_gradient_inside_a_tensor_parallel_region_is_caught(monkeypatch, devices, dtype):
    """x2 on the first weight of every column-parallel block (Q of attention, the first MLP matrix),
    only where the block is a tensor-parallel region: the one-device reference never runs it. At bf16's
    looser tolerance too."""
    real = collectives.column_parallel

    def buggy(layout, fn, x, weights, *args, **kwargs):
        if layout is not None and layout.tensor_size > 1:
            weights = [_double_the_gradient(weights[0]), *weights[1:]]
        return real(layout, fn, x, weights, *args, **kwargs)

    monkeypatch.setattr("meshlm.model.transformer.column_parallel", buggy)
    result = check.run_check(_cfg("llama", "parallel.tensor=2", "parallel.data=2", f"model.dtype={dtype}"))
    assert not result.equal and result.tolerance == check.TOLERANCES[dtype]
    assert {"layers/wq", "layers/w_gate"} <= set(result.mismatched), result.mismatched
    text = "\n".join(check.format_result(result))
    assert "layers/wq" in text and "MISMATCH" in text and "DIFFERS" in text


def test_a_missing_context_reduction_in_the_ring_backward_is_caught(devices):
    """The ring's backward pass without its accumulators travelling: each rank's dK/dV hold only
    its own queries' share, never reduced over `context`."""

    def buggy_bwd(block, rate, size, res, d_out):
        q, k, v, seg, pos, key, out, lse = res
        delta = context.row_delta(out, d_out)
        dq, dk, dv = context.backward_blocks(q, k, v, seg, seg, pos, pos, key, lse, delta, d_out, block, rate)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None

    context._ring.defvjp(context._ring_fwd, buggy_bwd)
    try:
        result = check.run_check(_cfg("gpt", "parallel.context=2", "model.attention=blockwise"))
    finally:
        context._ring.defvjp(context._ring_fwd, context._ring_bwd)
    assert not result.equal and {"layers/wk", "layers/wv"} <= set(result.mismatched), result.mismatched


def test_a_pipeline_stage_whose_gradient_is_dropped_is_caught(monkeypatch, devices):
    """Stage 1's layers contribute no weight gradient (their weights behind a stop_gradient on that
    stage only); the check names the layers and, per stacked leaf, one of stage 1's (2 and 3)."""
    real = pipeline.run_layers

    def buggy(x, w, *args, **kwargs):
        on_stage_1 = jax.lax.axis_index("stage") == 1
        w = jax.tree.map(lambda a: jnp.where(on_stage_1, jax.lax.stop_gradient(a), a), w)
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_layers", buggy)
    result = check.run_check(_cfg("gpt", "parallel.stage=2", "train.microbatches=2"))
    assert not result.equal
    bad = {e.name: e for e in result.leaves if e.name in result.mismatched}
    assert {"layers/wq", "layers/w_fc"} <= bad.keys() and bad["layers/w_fc"].layer in (2, 3), result.mismatched


def test_a_sequence_parallel_gather_replaced_by_a_local_copy_is_caught(monkeypatch, devices):
    """g's all-gather along the sequence (the SP block entry) replaced by copies of the local shard."""

    class Lax:
        def __getattr__(self, name):
            return getattr(jax.lax, name)

        @staticmethod
        def all_gather(x, axis_name, *, axis=0, tiled=False):
            return jnp.concatenate([x, x], axis=axis)  # tensor=2: this rank's half, twice

    class Jax:
        lax = Lax()

        def __getattr__(self, name):
            return getattr(jax, name)

    monkeypatch.setattr(collectives, "jax", Jax())
    result = check.run_check(_cfg("gpt", "parallel.tensor=2", "parallel.sequence_parallel=true"))
    assert not result.equal and "layers/wq" in result.mismatched, result.mismatched


def test_check_cli_verdicts_exit_codes_and_json(monkeypatch, capsys, tmp_path, devices):
    args = ["check", "--recipe", "llama-tiny", "--mesh", "data=2,tensor=2", "--set", "train.seq_len=64"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "equal" and out["mismatched"] == [] and out["dtype"] == "float32"
    assert {"layout", "tolerance", "model", "loss", "grad_norm", "parameters"} <= out.keys()
    assert {"layout", "one_device", "relative_difference"} == out["loss"].keys()
    assert out["model"]["shrunk"] and out["parameters"][0].keys() == {"name", "relative_error", "layer"}
    # a refused combination: the validator's message, exit 2, nothing compiled
    assert main(["check", "--mesh", "context=2", "--set", "model.attention=explicit"]) == EXIT_CONFIG
    assert "context parallelism" in capsys.readouterr().err
    # a layout that differs: exit 4 (which `meshlm launch` never retries), and train --check stops
    real = collectives.column_parallel

    def buggy(layout, fn, x, weights, *a, **k):
        if layout is not None and layout.tensor_size > 1:
            weights = [_double_the_gradient(weights[0]), *weights[1:]]
        return real(layout, fn, x, weights, *a, **k)

    monkeypatch.setattr("meshlm.model.transformer.column_parallel", buggy)
    assert main(args) == EXIT_MISMATCH
    verdict = capsys.readouterr().out.split("verdict: ")[1]
    assert verdict.startswith("DIFFERS from one device:") and "layers/wq" in verdict
    run = tmp_path / "run"
    assert main(["train", *args[1:], "--check", "--steps", "1", "--run-dir", str(run)]) == EXIT_MISMATCH
    assert "training not started" in capsys.readouterr().err and not (run / "metrics.jsonl").exists()


def test_random_layouts_equal_one_device(devices):
    """Random valid rows of the compatibility matrix's option space, within a fixed time budget. A
    failure names its row and how to replay it alone: MESHLM_FUZZ_SEED=SEED:ROW (SEED alone replays
    the draw, as far as the budget reaches)."""
    seed, _, only = os.environ.get("MESHLM_FUZZ_SEED", "").partition(":")
    seed = int(seed) if seed else random.SystemRandom().randrange(2**31)
    print(f"layout fuzzer: MESHLM_FUZZ_SEED={seed}")
    rows = list(compat.all_rows())
    random.Random(seed).shuffle(rows)
    order = [int(only)] if only else range(len(rows))
    checked, t0 = [], time.time()
    for i in order:
        if not only and time.time() - t0 > FUZZ_BUDGET_S and checked:
            break
        if not compat.runs(rows[i]):
            continue  # a refused combination: the matrix lists those
        result = check.run_check(compat.config_for(rows[i]))
        replay = f"MESHLM_FUZZ_SEED={seed}:{i} (row {rows[i]})"
        assert result.equal, replay + "\n" + "\n".join(check.format_result(result))
        checked.append(i)
    assert checked
    print(f"layout fuzzer: {len(checked)} rows checked in {time.time() - t0:.0f}s")


def test_the_matrix_checks_every_pair_that_runs_and_lists_every_refused_one():
    """compat.all_pairs: every pair of option values that some valid row has is in a row that runs
    (so the matrix checks it), and a pair no valid row has is in a refused row. No JAX needed."""
    rows = compat.all_pairs()
    everything = list(compat.all_rows())
    runs = {i for i, r in enumerate(everything) if compat.runs(r)}
    valid_pairs = set().union(*(compat._pairs(everything[i]) for i in runs))
    chosen_valid = [r for r in rows if compat.runs(r)]
    assert valid_pairs <= set().union(*(compat._pairs(r) for r in chosen_valid))
    all_pairs = set().union(*(compat._pairs(r) for r in everything))
    assert all_pairs - valid_pairs <= set().union(*(compat._pairs(r) for r in rows if not compat.runs(r)))
    assert len(rows) < len(everything) / 10  # an all-pairs design, not the product


def test_moe_layouts_are_checked_and_a_lost_expert_reduction_is_caught(monkeypatch, capsys, devices):
    """An MoE layout (expert=2 x tensor=2 + SP) checks equal; in bf16 it is checked in float32, and
    the report says why. Then the experts' gradients doubled only where the layer's region runs
    sharded over `expert` (a psum over expert too many, say) make the check fail on them."""
    sets = ("parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true")
    result = check.run_check(_cfg("moe", *sets, "model.dtype=bfloat16"))
    assert result.equal and result.dtype == "float32" and "checked in float32" in result.note
    assert "checked in float32" in "\n".join(check.format_result(result))
    from meshlm.model import moe

    real = moe._moe_local

    def buggy(x, router, we_gate, *rest, ep, **kw):
        if ep is not None:
            we_gate = _double_the_gradient(we_gate)
        return real(x, router, we_gate, *rest, ep=ep, **kw)

    monkeypatch.setattr(moe, "_moe_local", buggy)
    result = check.run_check(_cfg("moe", *sets))
    assert not result.equal and "layers/we_gate" in result.mismatched


def test_a_bug_mixing_one_devices_rows_between_the_expert_exchanges_is_caught(monkeypatch, devices):
    """The shrunk check keeps two rows per batch shard and microbatch (`check.CHECK_ROWS`): the
    rows of each source device's buffer reversed between the two expert all_to_alls (every row then
    takes another row's expert outputs, but only on the layout) fail it. With one row per shard
    the reversal is the identity and the check would pass."""
    from meshlm.model import moe

    real = moe._swiglu_experts

    def mixed(buf, *ws, **kw):
        if jax.sharding.get_abstract_mesh().shape.get("expert", 1) > 1:  # between the two all_to_alls
            e, r, c, d = buf.shape
            buf = buf.reshape(e, 2, r // 2, c, d)[:, :, ::-1].reshape(e, r, c, d)  # each source's rows reversed
        return real(buf, *ws, **kw)

    monkeypatch.setattr(moe, "_swiglu_experts", mixed)
    cfg = _cfg("moe", "parallel.expert=2")
    assert check.shrink(check.validate(cfg)).train.global_batch == 2 * 2 * cfg.train.microbatches
    result = check.run_check(cfg)
    assert not result.equal


def test_the_matrix_goes_on_from_its_journal_after_a_crash(monkeypatch, tmp_path, capsys):
    """A matrix run that dies mid-way (XLA:CPU aborts a process whose collective waits too long)
    keeps the rows it finished in its journal; run again, it checks only the rest and the table has
    every row, its time the rows' sum."""
    rows = [{"family": "gpt", "mesh": f"data={i}", "attention": "explicit", "remat": "full", "dtype": "float32",
             "document_mask": False} for i in (1, 2, 3)]  # fmt: skip
    checked = []

    def fake(row):
        checked.append(row["mesh"])
        if row["mesh"] == "data=2" and checked.count("data=2") == 1:
            raise SystemExit("the process dies here")
        return {"result": "checked", "error": 1e-7, "tolerance": 1e-5, "dtype": "float32"}

    monkeypatch.setattr(compat, "all_pairs", lambda seed=0: rows)
    monkeypatch.setattr(compat, "check_row", fake)
    monkeypatch.setattr(compat, "_journal", lambda: tmp_path / "journal.jsonl")
    out = tmp_path / "matrix.md"
    with pytest.raises(SystemExit):
        compat.main(["--write", "--out", str(out)])
    assert compat.main(["--write", "--out", str(out)]) == 0
    assert checked == ["data=1", "data=2", "data=2", "data=3"]  # data=1 came from the journal
    assert out.read_text().count("| checked, 1.0e-07 (tol 1e-05) |") == 3


@pytest.mark.parametrize("layers, stages, shrunk", [(8, 4, 8), (7, 4, 5), (11, 4, 7), (58, 16, 31)])
def test_the_check_keeps_uneven_stages_uneven(layers, stages, shrunk):
    """`check.shrink` cuts a pipeline to two layers a chunk (one where the chunks have one); where the
    stages split the layers unevenly, the shrunk model does too (one pad slot), so the pads run."""
    from meshlm.parallel.stage_layout import layer_slots

    cfg = check.validate(_cfg("llama", f"model.n_layers={layers}", f"parallel.stage={stages}"))
    small = check.shrink(cfg)
    assert small.model.n_layers == shrunk
    assert (layer_slots(shrunk, stages) < 0).any() == bool(layers % stages)


def test_the_check_keeps_a_pipelines_units_of_dense_and_moe_layers():
    """Qwen's decoder_sparse_step=2 on 4 stages: 14 layers, 7 units of (dense, MoE) shrink to 5 units
    (one chunk's a pad still) of the same two layers; a dense first layer then 13 MoE ones, to it and
    7 MoE layers."""
    from meshlm.parallel.schedules import pipeline_unit

    for kinds, want in (("model.moe_layer_step=2", (0, (False, True), 5)), ("model.first_k_dense=1", (1, (True,), 7))):
        cfg = check.validate(_cfg("llama", "model.n_experts=8", "model.n_layers=14", "parallel.stage=4", kinds))
        small = pipeline_unit(check.shrink(cfg).model)
        assert (small.prefix, small.kinds, small.count) == want
    # without a pipeline, the two kinds as before: (dense, dense, MoE) units cut to 2 layers keep an MoE one
    cfg = check.validate(_cfg("llama", "model.n_experts=8", "model.n_layers=6", "model.moe_layer_step=3"))
    assert check.validate(check.shrink(cfg)).model.moe_layer_ids == (1,)
