"""Pipeline parallelism: the executor routes every value where the schedule says, gives one
device's loss and raw gradients for every schedule on stage x tensor x data (+SP) and stage x
tensor meshes, with every remat policy, document masks and dropout; bubbles are inert; what an
extra microbatch costs stage 0 is what the formula says (GPipe grows with m, 1F1B does not);
checkpoints move between
pipelined and unpipelined meshes; bad pipelines are refused before compiling."""

import dataclasses
import json
import math
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import logged_losses, tiny_config
from meshlm import accounting
from meshlm.config import ConfigError, DataConfig, ParallelConfig, RematConfig, RunConfig
from meshlm.model.params import init_params, param_specs
from meshlm.parallel import pipeline, stage_layout
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.schedules import build, segments
from meshlm.parallel.slots import tables
from meshlm.step import _split_microbatches, abstract_batch, dropout_key, make_grad_step
from meshlm.train_state import state_shardings
from meshlm.validation import validate
from test_gradients import STEP, assert_leaves_close, assert_same_grads, assert_sgd_steps_equal, batch_for, grads

LAYERS = 8  # stage=4 x 2 virtual stages: one layer per chunk
MICRO = 4
LAYOUTS = {
    "stage2_tensor2_data2+sp": dict(stage=2, tensor=2, data=2, sequence_parallel=True),
    "stage4_tensor2": dict(stage=4, tensor=2),
}
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb1": 1, "zbv": 2}


def config(
    family: str, mesh: dict | None = None, schedule: str = "1f1b", *, policy="elementwise", layers=LAYERS, **data
) -> RunConfig:
    """The tiny model with 8 layers, batch 8 in 4 microbatches (gpt: dropout 0.1 everywhere)."""
    cfg = tiny_config(family, n_layers=layers, microbatches=MICRO)
    schedule, _, ticks = schedule.partition(":")  # "zb1:single": one action per tick
    par = dataclasses.replace(
        cfg.parallel,
        **(mesh or {}),
        pipeline_schedule=schedule,
        virtual_stages=SCHEDULES[schedule],
        pipeline_ticks=ticks or "paired",
    )
    if par.stage == 1:
        par = dataclasses.replace(par, pipeline_schedule="1f1b", virtual_stages=1, pipeline_ticks="paired")
    return validate(
        dataclasses.replace(cfg, parallel=par, remat=RematConfig(policy), data=dataclasses.replace(cfg.data, **data))
    )


@pytest.fixture(scope="module")
def params():
    out = {}
    for family in ("gpt", "llama"):
        p = init_params(param_specs(config(family).model), jax.random.key(0))
        leaves, tree = jax.tree.flatten(p)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        out[family] = jax.tree.unflatten(
            tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
        )
    return jax.device_get(out)


_REFERENCE: dict = {}


def reference(family: str, params: dict, document_mask: bool = False) -> dict:
    """One device, the same 4 microbatches accumulated (dropout key i for microbatch i)."""
    key = (family, document_mask)
    if key not in _REFERENCE:
        _REFERENCE[key] = grads(config(family, document_mask=document_mask), params[family])
    return _REFERENCE[key]


# ----------------------------------------------------------------------------- tables


def run_tables(schedule, tab) -> None:
    """Interpret the executor's tables in plain Python, with values that say what they are: every
    read must find exactly the microbatch-chunk its action needs, written by the action that made
    it, in the executor's order within a tick (backward, first weight pass, second weight pass,
    forward, then the receives). zb1's weight slots hold a forward's region inputs ("x"), to which
    B adds the output gradients ("x+g"), until the weight pass reads them. ZB-V: stage s holds
    chunks s and 2p - 1 - s, and a message goes to whichever stage holds the chunk that needs it -
    the next or the previous one, each over its own receive row, or its own stage."""
    p, chunks, r = schedule.stages, schedule.stages * schedule.virtual, tab.rows
    v_shape = schedule.name == "zbv"
    # the local chunk's global index, and where a message to chunk c lands (written out here, not
    # taken from the executor's tables): stage and receive row
    glob = lambda local, s: (s if local == 0 else 2 * p - 1 - s) if v_shape else local * p + s
    where = lambda c: c % p if not v_shape or c < p else 2 * p - 1 - c

    def lands(kind: str, s: int, c: int) -> tuple[int, str]:  # "y" of chunk c, "dy" for chunk c
        to = where(c + 1 if kind == "y" else c)
        if not v_shape:
            return to, "recv_act" if kind == "y" else "recv_grad"
        if to == s:
            return to, "keep_act" if kind == "y" else "keep_grad"
        if kind == "y":
            return to, "recv_act" if to == s + 1 else "recv_act_r"
        return to, "recv_grad" if to == s - 1 else "recv_grad_l"

    act = [dict() for _ in range(p)]
    grad = [dict() for _ in range(p)]
    stash = [dict() for _ in range(p)]
    weight = [dict() for _ in range(p)]
    at = lambda k, t, s: int(r[k][t, s])
    for t in range(schedule.ticks):
        send_act, send_grad = [None] * p, [None] * p
        for s in range(p):
            cell = {a.kind: a for a in schedule.table[t][s]}
            ws = [a for seg in segments(schedule.table[t][s]) for a in seg if a.kind == "W"]
            assert (at("b", t, s), at("f", t, s)) == ("B" in cell, "F" in cell)
            assert (at("w1", t, s), at("w2", t, s)) == (len(ws) == 2, len(ws) >= 1)
            if "B" in cell:
                i, c = cell["B"].microbatch, cell["B"].chunk
                assert (at("b_micro", t, s), glob(at("b_chunk", t, s), s), at("b_first", t, s)) == (i, c, c == 0)
                assert stash[s].pop(at("b_stash", t, s)) == ("res", i, c)
                assert grad[s].pop(at("grad_read", t, s)) == ("dy", i, c)
                if schedule.splits_backward:
                    assert weight[s][at("b_wslot", t, s)] == ("x", i, c)
                    weight[s][at("b_wslot", t, s)] = ("x+g", i, c)
                if c > 0:
                    send_grad[s] = ("dy", i, c - 1)
            elif schedule.splits_backward:  # an idle B writes its filler to the spare weight slot
                assert at("b_wslot", t, s) == tab.weight_slots - 1
            for a, w in zip(ws, ["w1", "w2"][2 - len(ws) :], strict=True):
                assert glob(at(f"{w}_chunk", t, s), s) == a.chunk
                assert weight[s].pop(at(f"{w}_slot", t, s)) == ("x+g", a.microbatch, a.chunk)
            if "F" in cell:
                i, c = cell["F"].microbatch, cell["F"].chunk
                assert (at("f_micro", t, s), glob(at("f_chunk", t, s), s)) == (i, c)
                assert (at("f_first", t, s), at("f_last", t, s)) == (c == 0, c == chunks - 1)
                if c > 0:
                    assert act[s].pop(at("act_read", t, s)) == ("y", i, c - 1)
                assert at("f_stash", t, s) not in stash[s]  # never over a live residual
                stash[s][at("f_stash", t, s)] = ("res", i, c)
                if schedule.splits_backward:
                    assert at("f_wslot", t, s) not in weight[s]
                    weight[s][at("f_wslot", t, s)] = ("x", i, c)
                if c == chunks - 1:
                    assert at("grad_write", t, s) not in grad[s]
                    grad[s][at("grad_write", t, s)] = ("dy", i, c)
                else:  # its filler cotangent goes to the spare slot
                    assert at("grad_write", t, s) == tab.grad_slots - 1
                    send_act[s] = ("y", i, c)
            else:  # an idle forward writes back the slot the backward read (zb1: its filler to the spare)
                assert at("f_stash", t, s) == at("b_stash", t, s)
                assert not schedule.splits_backward or at("f_wslot", t, s) == tab.weight_slots - 1
                assert at("grad_write", t, s) == tab.grad_slots - 1
        arriving = {}  # (stage, receive row) -> the message
        for s in range(p):
            for msg in (send_act[s], send_grad[s]):
                if msg is not None:
                    arriving[lands(msg[0], s, msg[2])] = msg
        rows = [("recv_act", act), ("recv_act_r", act), ("keep_act", act)]
        rows += [("recv_grad", grad), ("recv_grad_l", grad), ("keep_grad", grad)]
        for s in range(p):  # end of tick: what was sent lands where the receiver's row says
            for row, buf in rows:
                got, slot_ = arriving.get((s, row)), at(row, t, s)
                spare = (tab.act_slots if buf is act else tab.grad_slots) - 1
                assert (got is None) == (slot_ == spare), (t, s, row)
                if got is not None:
                    assert slot_ not in buf[s]
                    buf[s][slot_] = got
            for buf, n in ((act[s], tab.act_slots), (grad[s], tab.grad_slots)):
                assert all(0 <= k < n - 1 for k in buf)  # never the spare slot
            assert all(0 <= k < tab.stash_slots for k in stash[s])
            assert all(0 <= k < tab.weight_slots - 1 for k in weight[s])  # never the spare slot
    assert not any(act + grad + stash + weight)  # everything made was used
    assert tab.stash_slots == max(schedule.peak_in_flight(s) for s in range(p))
    if schedule.splits_backward:
        assert tab.weight_slots == max(max(schedule.pending_weights(s)) for s in range(p)) + 1


@pytest.mark.parametrize(
    "name, v, ticks",
    [
        *[("gpipe", 1, "paired"), ("1f1b", 1, "paired"), ("interleaved", 2, "paired"), ("zb1", 1, "paired")],
        *[("1f1b", 1, "single"), ("zb1", 1, "single"), ("zbv", 2, "single")],
    ],
)
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_tables_route_every_value(name, v, ticks, p, factor):
    schedule = build(name, p, p * factor, v, ticks)
    run_tables(schedule, tables(schedule))


def test_table_interpreter_catches_a_misrouted_slot():
    schedule = build("1f1b", 4, 8)
    tab = tables(schedule)
    broken = dataclasses.replace(tab, rows=dict(tab.rows, recv_act=np.roll(tab.rows["recv_act"], 1, axis=0)))
    with pytest.raises(AssertionError):
        run_tables(schedule, broken)
    schedule = build("zbv", 4, 8, 2, "single")  # ZB-V's messages that go the other way, and its turn
    tab = tables(schedule)
    for row in ("recv_grad_l", "recv_act_r", "keep_grad"):
        broken = dataclasses.replace(tab, rows=dict(tab.rows, **{row: np.roll(tab.rows[row], 1, axis=0)}))
        with pytest.raises(AssertionError):
            run_tables(schedule, broken)
    schedule = build("zb1", 4, 8)
    tab = tables(schedule)
    for row in ("w2_slot", "b_wslot"):
        broken = dataclasses.replace(tab, rows=dict(tab.rows, **{row: np.roll(tab.rows[row], 1, axis=0)}))
        with pytest.raises(AssertionError):
            run_tables(schedule, broken)


# ----------------------------------------------------------------------------- gradients


# Every schedule on both layouts for both families (1F1B on each layout in one tick kind: paired for
# gpt on stage2 and llama on stage4, single for gpt on stage4; zb1 paired for gpt on stage2 and
# llama on stage4 - the latter with uneven stages, below - single for llama on stage2); each case also
# carries a remat policy (gpt, whose dropout masks must be replayed by the recomputation) or document
# masks (llama), so the policies and masks are covered without compiling more programs (`dots` with
# gpt's interleaved stage2 case: in the uneven stages' test).
CASES = [
    ("gpt", "gpipe", "stage2_tensor2_data2+sp", "elementwise", False),
    ("gpt", "1f1b", "stage2_tensor2_data2+sp", "selective", False),
    ("gpt", "gpipe", "stage4_tensor2", "full", False),
    ("gpt", "1f1b:single", "stage4_tensor2", "elementwise", False),
    ("gpt", "interleaved", "stage4_tensor2", "offload", False),
    ("llama", "gpipe", "stage2_tensor2_data2+sp", "elementwise", True),
    ("llama", "zb1:single", "stage2_tensor2_data2+sp", "elementwise", True),
    ("llama", "interleaved", "stage2_tensor2_data2+sp", "selective", True),
    ("llama", "gpipe", "stage4_tensor2", "dots", False),
    ("llama", "1f1b", "stage4_tensor2", "elementwise", True),
    ("llama", "interleaved", "stage4_tensor2", "elementwise", False),
    ("gpt", "zb1", "stage2_tensor2_data2+sp", "selective", False),
    ("gpt", "zbv:single", "stage4_tensor2", "selective", False),
    ("llama", "zbv:single", "stage2_tensor2_data2+sp", "elementwise", True),
]


@pytest.mark.parametrize("family, schedule, layout, policy, document_mask", CASES)
def test_every_schedule_gives_the_one_device_gradients(family, schedule, layout, policy, document_mask, params):
    """Raw gradients, loss and norm equal one device's, whatever the remat policy leaves for the
    stash and the backward tick to re-run."""
    cfg = config(family, LAYOUTS[layout], schedule, policy=policy, document_mask=document_mask)
    assert_same_grads(grads(cfg, params[family]), reference(family, params, document_mask))


# uneven stages (these also stand for CASES' llama zb1 on stage4_tensor2 and gpt interleaved with `dots`)
@pytest.mark.parametrize(
    "family, layers, schedule, layout, policy, document_mask",
    [
        ("llama", 6, "zb1", "stage4_tensor2", "elementwise", True),  # chunks of 1, 2, 2, 1 layers
        ("gpt", 7, "interleaved", "stage2_tensor2_data2+sp", "dots", False),  # 1, 2, 2, 2
        ("gpt", 7, "zbv:single", "stage2_fsdp2_tensor2", "elementwise", False),  # stage 0: the 1 and the last 2
        ("gpt", 6, "zbv:single", "stage2_tensor2_data2+sp", "selective", False),  # 1, 2, 2, 1: stored over stage
    ],
)
def test_uneven_stages_give_the_one_device_gradients(family, layers, schedule, layout, policy, document_mask, params):
    """Layers the chunks do not split evenly (`schedules.chunk_layers`): the lighter chunks' last slot
    is a pad of zero weights, the identity. Raw gradients, loss and norm equal one device's model of
    the same layers (with layer 0's weights in the pads instead, every case fails)."""
    cut = dict(params[family], layers={n: w[:layers] for n, w in params[family]["layers"].items()})
    mesh = LAYOUTS.get(layout, dict(stage=2, fsdp=2, tensor=2))  # ZB-V: the weights stored over fsdp x stage
    piped = config(family, mesh, schedule, policy=policy, layers=layers, document_mask=document_mask)
    assert (stage_layout.layer_slots(layers, piped.parallel.stage * piped.parallel.virtual_stages) < 0).any()
    key = (family, layers, document_mask)
    if key not in _REFERENCE:
        _REFERENCE[key] = grads(config(family, layers=layers, document_mask=document_mask), cut)
    assert_same_grads(grads(piped, cut), _REFERENCE[key])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv:single"])
def test_fsdp_inside_the_pipeline(schedule, params):
    """FSDP x tensor inside the stages: the stage's weights are gathered once per step and the
    gradients reduce-scattered back to their FSDP shards (ZB-V: the V's weights regrouped first)."""
    cfg = config("gpt", dict(stage=2, fsdp=2, tensor=2), schedule)
    assert_same_grads(grads(cfg, params["gpt"]), reference("gpt", params))


@pytest.mark.parametrize(
    "strategy, mesh, schedule",
    [
        ("all_gather", dict(stage=2, context=2, tensor=2), "1f1b"),
        ("all_to_all", dict(stage=2, data=2, context=2), "1f1b"),
        ("ring", dict(stage=2, context=2, tensor=2), "1f1b:single"),
        ("ring", dict(stage=2, context=2, tensor=2), "zb1"),
        ("ring", dict(stage=2, context=2, tensor=2), "zbv:single"),
    ],
)
def test_context_parallelism_inside_the_stages(strategy, mesh, schedule, params, monkeypatch):
    """gpt with dropout and blockwise attention (block 8, so a context rank's 16 tokens are two
    blocks), the sequence load-balanced: K/V all-gathered over the context ranks or passed round the
    ring on stage=2 x context=2 x tensor=2 (the ring's phases run unbranched: `_Stage.phase`), or
    Ulysses' tokens-for-heads exchange on stage=2 x data=2 x context=2 (the batch axis manual in the
    stage, so the dropout bits take both a row offset and original positions), inside each pipeline
    stage (regions nested in the stage's), with 1F1B (the ring: with single ticks), (ring) zb1's
    split backward and (ring) ZB-V; the raw gradients are one device's with the same kernel, dropout bits and all.
    The ring's idle cells compute on NaN-filled slots (its phases mask their increments)."""
    import meshlm.step

    if strategy == "ring":
        nan_bubbles = partial(pipeline.pipeline_gradients, idle_fill=jnp.nan)
        monkeypatch.setattr(meshlm.step, "pipeline_gradients", nan_bubbles)

    def blockwise(mesh):
        cfg = config("gpt")
        model = dataclasses.replace(cfg.model, attention="blockwise", attention_block=8)
        name, _, ticks = schedule.partition(":")
        piped = dict(pipeline_schedule=name, virtual_stages=SCHEDULES[name], pipeline_ticks=ticks or "paired")
        piped = piped if mesh else {}
        par = dataclasses.replace(cfg.parallel, **mesh, **piped, context_strategy=strategy)
        return validate(dataclasses.replace(cfg, model=model, parallel=par))

    got = grads(blockwise(mesh), params["gpt"])
    assert_same_grads(got, grads(blockwise({}), params["gpt"]))


def test_the_rings_unbranched_phases_select_no_accumulator():
    """With the ring inside the stages every phase runs on every stage at every tick
    (`_Stage.phase`); its increments are masked, so the tick loop selects no whole gradient
    accumulator ([v, L/(pv), ...] per device) and no embedding or output-layer gradient, which
    selecting the phases' outputs did (each then a copy per phase per tick). Compile only:
    stage=2 x context=2 x tensor=2, 1F1B with single ticks (gradients: the test above; with v = 2
    XLA already narrows such a select to the chunk's slice)."""
    from meshlm.insight import hlo

    cfg = config("gpt")
    mesh = dict(stage=2, context=2, tensor=2, context_strategy="ring", pipeline_ticks="single")
    par = dataclasses.replace(cfg.parallel, **mesh)
    model = dataclasses.replace(cfg.model, attention="blockwise", attention_block=8)
    cfg = validate(dataclasses.replace(cfg, model=model, parallel=par))
    text, layout = compiled_grad_step(cfg)
    body = max(hlo.loop_bodies(text), key=len)  # the tick loop (the ring's loops nest in it)
    shapes = re.findall(r"= f32\[([\d,]*)\][^ ]* select\(", body)
    selected = {tuple(int(d) for d in dims.split(",") if d) for dims in shapes}
    assert selected  # the stash slot's select and the phases' own
    v, per_chunk = cfg.parallel.virtual_stages, LAYERS // (cfg.parallel.stage * cfg.parallel.virtual_stages)
    local = lambda spec: tuple(stage_layout.kept(layout, spec.axes).shard_shape(spec.shape))  # as the stage holds it
    specs = param_specs(cfg.model)
    accumulators = {(v, per_chunk, *local(spec)[1:]) for spec in specs["layers"].values()}
    top = {local(spec) for n, spec in specs.items() if n != "layers"}
    assert len(top) == 3 and not (selected & top), selected & top  # wte, wpe, the final norm
    assert not (selected & accumulators), selected & accumulators


def test_a_bf16_pipeline_with_sp(params):
    """bf16 (weights cast per chunk, activations, sends and stash in bf16) on stage=2 x data=2 x
    tensor=2 + SP, llama, zb1 with single ticks: loss within 1e-4 and every gradient leaf within 3%
    (norm-relative) of one bf16 device's - bf16 rounds differently in another reduction order."""

    def bf16(mesh):
        cfg = config("llama", schedule="zb1:single")
        model = dataclasses.replace(cfg.model, dtype="bfloat16")
        return validate(dataclasses.replace(cfg, model=model, parallel=dataclasses.replace(cfg.parallel, **mesh)))

    got = grads(bf16(LAYOUTS["stage2_tensor2_data2+sp"]), params["llama"])
    ref = grads(bf16({}), params["llama"])
    assert_leaves_close(got["grads"], ref["grads"], 0.03, "bf16 gradient leaves")
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-4)


def test_a_pallas_kernel_runs_inside_the_stages(params, monkeypatch):
    """`model.attention=fused` where the device's kernel is a Pallas one (TPU splash here, chosen as
    on a TPU and run in interpret mode): inside a pipeline stage it runs per device over the axes the
    stage left automatic, and stage=2 x data=2 x tensor=2 gives the same kernel's one-device gradients."""
    from meshlm.model import kernels

    monkeypatch.setattr(kernels, "fused_implementation", lambda *a: ("splash", "as on a TPU"))
    monkeypatch.setattr(kernels, "splash_attention", partial(kernels.splash_attention, interpret=True))

    def fused(mesh):
        cfg = config("llama", mesh)
        return validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="fused")))

    got = grads(fused(dict(stage=2, data=2, tensor=2)), params["llama"])
    assert_same_grads(got, grads(fused(None), params["llama"]))


def compiled_grad_step(cfg: RunConfig) -> tuple[str, object]:
    """The compiled gradient step's text (fp32 parameters) and its layout."""
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_specs(cfg.model))
    fn = make_grad_step(cfg, layout, shardings)
    return fn.lower(abstract, abstract_batch(cfg, layout), 0).compile().as_text(), layout


def reductions_by_axis(text: str, layout) -> dict[str, int]:
    """All-reduces and reduce-scatters in `text`, counted by the mesh axes their replica groups span
    (a group's devices differ in those coordinates of the mesh)."""
    from meshlm.insight import hlo

    shape, names = layout.mesh.devices.shape, layout.mesh.axis_names
    found: dict[str, int] = {}
    for kind in ("all-reduce", "reduce-scatter"):
        for groups in hlo.collective_groups(text, kind):
            if max(len(g) for g in groups) == 1:
                continue
            coords = np.array(np.unravel_index(np.asarray(groups[0]), shape)).T  # [group size, axes]
            spans = "+".join(n for n, col in zip(names, coords.T, strict=True) if len(set(col)) > 1)
            found[spans] = found.get(spans, 0) + 1
    return found


@pytest.mark.parametrize("schedule", ["1f1b", "zb1"])
def test_one_batch_reduction_per_step_after_the_tick_loop(schedule, monkeypatch):
    """stage=2 x data=2 x tensor=2 + SP, gpt with dropout: inside the tick loop (the `while` whose
    body sends with collective-permute) the only reductions are the tensor-parallel ones; the
    data-parallel gradient reduction runs after it, once. With the stage region manual over `stage`
    alone (the old executor) GSPMD reduces each backward tick's chunk gradients over `data` inside
    the loop - the check sees it. zb1's weight passes, in the loop too, reduce nothing over `data`."""
    from meshlm.insight import hlo

    cfg = config("gpt", LAYOUTS["stage2_tensor2_data2+sp"], schedule)

    def tick_loop_and_rest(text):
        loops = [body for body in hlo.loop_bodies(text) if "collective-permute" in body]
        assert len(loops) == 1
        return reductions_by_axis(loops[0], layout), reductions_by_axis(text, layout)

    text, layout = compiled_grad_step(cfg)
    in_loop, everywhere = tick_loop_and_rest(text)
    assert in_loop.get("tensor", 0) > 0 and set(in_loop) == {"tensor"}
    assert everywhere.get("data", 0) > 0  # after the loop
    assert not any("data" in axes for body in hlo.loop_bodies(text) for axes in reductions_by_axis(body, layout))
    # docs/pipeline.md, "Overlap": XLA:CPU runs collective-permute synchronously (no start/done
    # pair it could schedule around compute); if this starts failing, the overlap can be shown here
    assert "collective-permute-start" not in text and "collective-permute(" in text
    if schedule == "zb1":
        return
    monkeypatch.setattr(pipeline, "manual_batch_axes", lambda layout: ())
    in_loop, _ = tick_loop_and_rest(compiled_grad_step(cfg)[0])
    assert in_loop.get("data", 0) > 0


def test_zb1_runs_each_gemm_once():
    """zb1's B pass has no weight-gradient GEMM and its W pass no input-gradient GEMM: the compiled
    step's dot FLOPs (each computation counted once: a stage's forward, its B, and the two weight
    passes, one per segment, whose code is the same) exceed 1F1B's (forward, whole backward) by
    exactly one weight pass - 2 x rows x the layer's matmul weights per device (the layer scan's
    body is counted once). Were W to re-run the cotangent chain, or B to keep its weight GEMMs,
    the difference would be larger (llama, stage=4 x tensor=2)."""
    from meshlm.insight import hlo

    flops = {
        s: hlo.dot_flops(compiled_grad_step(config("llama", LAYOUTS["stage4_tensor2"], s))[0])
        for s in SCHEDULES
        if s in ("1f1b", "zb1")
    }
    cfg = config("llama", LAYOUTS["stage4_tensor2"], "zb1")
    specs = param_specs(cfg.model)["layers"]
    weights = sum(math.prod(specs[n].shape[1:]) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")) // 2
    rows = cfg.train.global_batch // cfg.train.microbatches * cfg.train.seq_len
    assert flops["zb1"] - flops["1f1b"] == 2 * rows * weights


def test_bubbles_are_inert(params):
    """Idle stages send NaN and every empty slot holds NaN: none of it reaches a gradient."""
    cfg = config("gpt", LAYOUTS["stage4_tensor2"], "interleaved")
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    split = lambda b, m: _split_microbatches(b, m, layout)

    @jax.jit
    def run(p, batch):
        g, loss, count, _ = pipeline.pipeline_gradients(p, batch, dropout_key(cfg, STEP), cfg, layout, split, jnp.nan)
        return jax.tree.map(lambda x: x / count, g), loss / count

    g, loss = jax.device_get(run(jax.device_put(params["gpt"], shardings), batch_for(cfg)))
    ref = reference("gpt", params)
    assert np.isfinite(loss) and all(np.all(np.isfinite(x)) for x in jax.tree.leaves(g))
    assert_leaves_close(g, ref["grads"], 1e-5, "gradients with NaN bubbles")


def test_sgd_steps_equal_one_device(params):
    """Five steps of plain SGD through the train step (1F1B, stage x tensor x data + SP)."""
    pipelined = config("llama", LAYOUTS["stage2_tensor2_data2+sp"], "1f1b")
    assert_sgd_steps_equal(config("llama"), pipelined, params["llama"])


# ----------------------------------------------------------------------------- memory


def compiled_temp_bytes(
    schedule: str, m: int, p: int = 4, ticks: str = "paired", layers: int = LAYERS
) -> tuple[int, RunConfig]:
    """XLA's temp bytes per device of the compiled gradient step at microbatch size 2 (llama, s=32)."""
    mesh = dict(stage=p, pipeline_schedule=schedule, pipeline_ticks=ticks, virtual_stages=SCHEDULES[schedule])
    cfg = tiny_config("llama", mesh, n_layers=layers, global_batch=2 * m, microbatches=m)
    layout = make_layout(cfg.parallel, jax.devices()[:p])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_specs(cfg.model))
    fn = make_grad_step(cfg, layout, shardings)
    compiled = fn.lower(abstract, abstract_batch(cfg, layout), 0).compile()
    return compiled.memory_analysis().temp_size_in_bytes, cfg


def test_stage_zero_memory_follows_the_formula():
    """What an extra microbatch costs, compiled vs `accounting.activation_memory` (stage 0: its
    microbatch-chunks in flight x L/(p v) layers' stored activations, plus inboxes and token ids;
    zb1 its weight slots).
    GPipe keeps every microbatch's residuals until its backward: each costs stage 0 its L/p layers'
    activations plus the loss cotangent waiting for it - exactly (RoPE's tables, the same for every
    microbatch, are not stashed: 0.2% more if they were). 1F1B keeps at most 2p - 1 in
    flight (the paired table's warm-up + 1): flat in m from there, in the compiled program and in
    the formula; single ticks (Megatron's p) save what the formula says."""
    gpipe = {m: compiled_temp_bytes("gpipe", m) for m in (4, 8)}
    formula = {m: accounting.activation_memory(cfg)["total"] for m, (_, cfg) in gpipe.items()}
    per_layer = accounting.activation_memory(gpipe[4][1])["layer_total"]
    measured = gpipe[8][0] - gpipe[4][0]
    assert formula[8] - formula[4] > 4 * (LAYERS // 4) * per_layer  # the stash grows by 4 x L/p layers
    assert measured == pytest.approx(formula[8] - formula[4], rel=1e-4)
    one_f_one_b = {m: compiled_temp_bytes("1f1b", m) for m in (8, 16)}
    flat = {m: accounting.activation_memory(cfg)["total"] for m, (_, cfg) in one_f_one_b.items()}
    grown = one_f_one_b[16][0] - one_f_one_b[8][0]
    assert abs(grown - (flat[16] - flat[8])) < 0.01 * measured  # token ids only, in both
    assert accounting.activation_memory(one_f_one_b[16][1])["layers"] == 7 * (LAYERS // 4) * per_layer
    # zb1: its stash without the region inputs, plus its weight slots (the regions' inputs and
    # output gradients, + one chunk's inputs in the loop carry) - within 3% of the compiled difference
    zb1, cfg = compiled_temp_bytes("zb1", 8)
    extra = accounting.activation_memory(cfg)["total"] - flat[8]
    assert extra > 0.2 * one_f_one_b[8][0]
    assert zb1 - one_f_one_b[8][0] == pytest.approx(extra, rel=0.03)
    # single ticks: Megatron's p = 4 in flight on stage 0 instead of 2p - 1 = 7 (zb1: and p + 1
    # weight slots instead of 2p): what the compiled program saves is what the formula says, within 3%
    for name, paired_bytes, paired_cfg in (("1f1b", *one_f_one_b[8]), ("zb1", zb1, cfg)):
        single, single_cfg = compiled_temp_bytes(name, 8, ticks="single")
        formula = {n: accounting.activation_memory(c) for n, c in (("paired", paired_cfg), ("single", single_cfg))}
        assert formula["single"]["layers"] == pytest.approx(4 / 7 * formula["paired"]["layers"])
        saved = formula["paired"]["total"] - formula["single"]["total"]
        assert saved > 0.2 * paired_bytes
        assert paired_bytes - single == pytest.approx(saved, rel=0.03), name
    # ZB-V: 2p = 8 one-layer chunks in flight and as many weight slots (+ a spare), against paired zb1's
    # seven two-layer ones: it saves at least what the formula says (observed 3.73 MB against 3.18:
    # a tick's transients, which the formula leaves out, scale with the chunk, half as long here)
    zbv, zbv_cfg = compiled_temp_bytes("zbv", 8, ticks="single")
    saved = accounting.activation_memory(cfg)["total"] - accounting.activation_memory(zbv_cfg)["total"]
    assert saved > 0.2 * zb1 and zb1 - zbv >= 0.97 * saved


def test_uneven_stages_stash_their_pad_slots():
    """7 layers over 4 stages (chunks of 1, 2, 2, 2): every chunk runs 2 slots, the pad included, so
    under GPipe 4 more microbatches cost stage 0 (the lighter chunk) 4 x 2 layers' activations - the
    compiled growth within 5% of the formula's (ceil(L/p) slots a chunk), and more than 10% above
    4 x L/p = 7 layers' worth."""
    (small, cfg), (big, _) = (compiled_temp_bytes("gpipe", m, layers=7) for m in (4, 8))
    per_layer = accounting.activation_memory(cfg)["layer_total"]
    formula = {m: accounting.activation_memory(c)["total"] for m, c in ((4, cfg), (8, _with_micro(cfg, 8)))}
    assert formula[8] - formula[4] > 4 * 2 * per_layer
    assert big - small == pytest.approx(formula[8] - formula[4], rel=0.05)
    assert big - small > 1.1 * (formula[8] - formula[4] - 4 * 2 * per_layer + 4 * 7 / 4 * per_layer)


def test_uneven_stages_gather_their_own_chunks():
    """6 layers over 4 stages x fsdp=2: the layer axis is stored whole, `stage` on the width, and
    the step trades that split for the chunks' with one all_to_all over `stage` per weight, and the
    gradients come back the same way (`stage_layout.regroup_stored`, `ungroup_stored`): no collective
    of the compiled gradient step moves an array as long as the layer stack (6) or the padded one (8)
    - GSPMD alone brought the gradients back as an all-reduce of the [6, d/2, ...] stacks. Their bytes
    are the planner's "layers' regroup", which even stages of one chunk do not pay; interleaved ones do
    (GSPMD's regroup: on 2 stages its all_to_all bytes are the same formula's)."""
    from meshlm.insight import hlo
    from meshlm.insight.pipeline_costs import regroup_bytes
    from meshlm.insight.plan import estimate, sharded_params
    from meshlm.platform.hardware import ACCELERATORS

    h100 = ACCELERATORS["h100"]

    cfg = tiny_config("llama", dict(stage=4, fsdp=2), n_layers=6, microbatches=4)
    layout = make_layout(cfg.parallel, jax.devices()[:8])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    assert shardings["layers"]["wq"].spec == P(None, ("fsdp", "stage"))
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_specs(cfg.model))
    text = make_grad_step(cfg, layout, shardings).lower(abstract, abstract_batch(cfg, layout), 0).compile().as_text()
    kinds = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    moved = [m.group(1) for m in re.finditer(rf"= (.*?) (?:{kinds})(?:-start)?\(", text)]
    lengths = {d.split(",")[0] for t in moved for d in re.findall(r"f32\[([\d,]+)\]", t)}
    assert lengths and not lengths & {"6", "8"}, lengths
    assert hlo.collectives(text)["all-to-all"] >= 2 * len(shardings["layers"])  # each weight's, both ways
    # what they send is what the planner prices (`pipeline_costs.regroup_bytes`: the padded stack's share, both ways)
    want = regroup_bytes(cfg, sharded_params)
    assert want and hlo.all_to_all_bytes(text) == pytest.approx(want)
    assert estimate(cfg, h100).time["layers' regroup"] > 0
    even = tiny_config("llama", dict(stage=4, fsdp=2), n_layers=8, microbatches=4)
    assert regroup_bytes(even, sharded_params) == 0 and "layers' regroup" not in estimate(even, h100).time
    # two chunks a stage (interleaved, even): GSPMD's regroup, the same bytes on 2 stages
    two = tiny_config(
        "llama", dict(stage=2, pipeline_schedule="interleaved", virtual_stages=2), n_layers=8, microbatches=4
    )
    layout = make_layout(two.parallel, jax.devices()[:2])
    shardings = state_shardings(param_specs(two.model), layout, optax.sgd(1.0)).params
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_specs(two.model))
    text = make_grad_step(two, layout, shardings).lower(abstract, abstract_batch(two, layout), 0).compile().as_text()
    want = regroup_bytes(two, sharded_params)
    assert want and hlo.all_to_all_bytes(text) == pytest.approx(want)


def _with_micro(cfg: RunConfig, m: int) -> RunConfig:
    train = dataclasses.replace(cfg.train, global_batch=2 * m, microbatches=m)
    return validate(dataclasses.replace(cfg, train=train))


def test_pipeline_buffers_hold_a_context_ranks_share_of_the_sequence():
    """Under context parallelism the executor's inboxes, token ids and zb1's weight slots hold each
    rank's 1/c of the sequence: the formula's buffer terms and the planner's send bytes halve at
    context=2 (they counted the whole sequence before). Compiled zb1-over-1F1B differences at these
    shapes follow the context kernels' transients (stage=2 x context=2 x tensor=2, 4 layers: all_gather
    1.16x, ring 0.61x the formula's, 0.48x / 0.25x the old one's), so the terms are checked as arithmetic."""
    from meshlm.insight.pipeline_costs import pipeline_send_bytes
    from meshlm.pipeline_memory import pipeline_buffer_terms

    cfg = config("gpt", dict(stage=2, tensor=2), "zb1")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="blockwise", attention_block=8))
    one = pipeline_buffer_terms(validate(cfg))
    split = validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context=2)))
    two = pipeline_buffer_terms(split)
    assert "weight_pass_output_gradients" in one and two == {k: v / 2 for k, v in one.items()}
    assert pipeline_send_bytes(split) == pipeline_send_bytes(validate(cfg)) / 2  # and so do the sends


@pytest.mark.parametrize(
    "model, dense_spec, policy",
    [
        (dict(n_layers=5, first_k_dense=1), P(None, "stage"), "elementwise"),
        (dict(n_layers=8, moe_layer_step=2), P("stage"), "elementwise"),
        (dict(n_layers=8, moe_layer_step=2), P("stage"), "full"),
    ],
    ids=["a dense first layer", "units of (dense, MoE)", "units of (dense, MoE), full"],
)
def test_a_dense_prefix_leaves_the_stages_moe_layers_to_stash(model, dense_spec, policy):
    """An MoE model's dense first layer runs with the embedding (recomputed in the first chunk's
    backward), so stage 0's stash holds its chunks' MoE layers only: under GPipe on stage=2 (1 dense
    + 4 MoE layers, dropless), 4 more microbatches cost 4 x 2 MoE layers' activations - the compiled
    program's growth within 2% of the formula's, and more than 5% off the mean-layer count
    (n_layers/p of the layers' mean) that the formula used before. The dense layer and its weights
    are stored split over `stage` on their width (1 layer does not split over 2 stages). Qwen's
    decoder_sparse_step=2 (4 units of a dense and an MoE layer): 4 x 2 units' (dense + MoE), and the
    dense stack split over `stage` on its layer axis; under `full` a unit is checkpointed whole, so
    it stores its input once, not each layer's."""
    from meshlm import recipes

    base = recipes.get("moe-tiny")
    model = dataclasses.replace(base.model, **model, expert_capacity_factor=0.0, vocab_size=256)
    cfgs = {
        m: validate(
            dataclasses.replace(
                base,
                model=model,
                parallel=ParallelConfig(stage=2, pipeline_schedule="gpipe"),
                train=dataclasses.replace(base.train, global_batch=2 * m, seq_len=32, microbatches=m),
                remat=RematConfig(policy),
            )
        )
        for m in (4, 8)
    }
    layout = make_layout(cfgs[4].parallel, jax.devices()[:2])
    specs = param_specs(model)
    shardings = state_shardings(specs, layout, optax.sgd(1.0)).params
    assert shardings["dense_layers"]["wq"].spec == dense_spec
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs)
    temp = {
        m: make_grad_step(c, layout, shardings).lower(abstract, abstract_batch(c, layout), 0).compile()
        for m, c in cfgs.items()
    }
    grown = temp[8].memory_analysis().temp_size_in_bytes - temp[4].memory_analysis().temp_size_in_bytes
    formula = {m: accounting.activation_memory(c) for m, c in cfgs.items()}
    slot = sum(formula[4]["per_layer"].values())  # an MoE layer, and a unit's dense layer (under full: its input once)
    slot += sum(formula[4]["dense_per_layer"].values()) if model.moe_layer_step == 2 and policy != "full" else 0
    assert formula[8]["layers"] - formula[4]["layers"] == pytest.approx(4 * 2 * slot)
    want = formula[8]["total"] - formula[4]["total"]
    # under full: 0.3% over, each MoE layer's router statistics (E floats a microbatch); 8% over while the
    # stash held RoPE's tables per microbatch (`buffers.residual_source`), 25% were a unit checkpointed per layer
    assert grown == pytest.approx(want, rel=0.005 if policy == "full" else 0.02)
    if model.first_k_dense:
        assert abs(grown - 4 * 5 / 2 * formula[4]["layer_total"]) > 0.05 * grown


def test_embeddings_are_stored_split_over_the_stages(monkeypatch):
    """The embeddings and output layer, with their Adam moments, are stored 1/p per device (their
    width split over stage): the compiled train step's arguments on stage=4 are smaller than with
    them whole on every stage (the rule before) by exactly 12 bytes x (1 - 1/p) of them, and equal
    the planner's count (exact, from the rules table). The price is the step's gathered copy: the
    compiled temp bytes grow by at most the planner's "gathered weights" (4 bytes each), within 15%
    (XLA reuses part of a buffer at p = 4; all of it is extra at p = 2)."""
    from meshlm import axes
    from meshlm.insight import plan as planner
    from meshlm.parallel import rules
    from meshlm.platform.hardware import ACCELERATORS
    from meshlm.step import make_train_step
    from meshlm.train_state import abstract_state, placement, setup

    cfg = tiny_config("llama", dict(stage=4), n_layers=LAYERS, global_batch=8, microbatches=4)

    def argument_and_temp_bytes() -> tuple[int, int]:
        layout = make_layout(cfg.parallel, jax.devices()[:4])
        specs, tx, shardings = setup(cfg, layout)
        state = abstract_state(specs, layout, tx, **placement(cfg))
        compiled = make_train_step(cfg, layout, tx, shardings).lower(state, abstract_batch(cfg, layout)).compile()
        return compiled.memory_analysis().argument_size_in_bytes, compiled.memory_analysis().temp_size_in_bytes

    (split, split_temp), params = argument_and_temp_bytes(), planner.sharded_params(cfg)
    gathered = planner.estimate(cfg, ACCELERATORS["a100"]).memory["gathered weights"]
    top = sum(math.prod(s.shape) for k, s in param_specs(cfg.model).items() if k != "layers")
    assert planner.sharded_params(cfg, part="top") == top / 4 and gathered == 4 * top
    monkeypatch.setitem(rules.RULES, axes.EMBED, "fsdp")
    whole, whole_temp = argument_and_temp_bytes()
    assert "gathered weights" not in planner.estimate(cfg, ACCELERATORS["a100"]).memory
    assert whole - split == 12 * top * 3 / 4  # fp32 weights + Adam's two moments
    assert split_temp - whole_temp == pytest.approx(gathered, rel=0.15)
    assert planner.sharded_params(cfg) - params == top * 3 / 4
    batch = 2 * 4 * cfg.train.global_batch * cfg.train.seq_len  # int32 inputs and targets
    assert split - batch == pytest.approx(12 * params, abs=64)  # + the step counter


# ----------------------------------------------------------------------------- configs and runs


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(stage=4, virtual_stages=3, pipeline_schedule="interleaved"), "n_layers=8 leaves a chunk of stage x"),
        (dict(stage=2, virtual_stages=2, pipeline_schedule="gpipe"), "needs pipeline_schedule=interleaved"),
        (dict(stage=4, virtual_stages=2, pipeline_schedule="interleaved", data=1), "not a multiple of stage=4"),
        (dict(virtual_stages=2), "needs a pipeline"),
        (dict(stage=2, pipeline_schedule="zb"), "unknown pipeline schedule 'zb'"),
        (dict(pipeline_ticks="single"), "parallel.pipeline_ticks=single needs a pipeline"),
        (dict(stage=2, pipeline_ticks="single", pipeline_schedule="gpipe"), "single runs 1f1b, zb1 or zbv"),
    ],
)
def test_bad_pipeline_configs_are_refused(change, message):
    change, cfg = dict(change), config("llama")
    train = dataclasses.replace(cfg.train, microbatches=6 if change.get("virtual_stages") == 2 else 4, global_batch=12)
    bad = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **change), train=train)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(bad)


def test_generation_refuses_a_stage_mesh():
    from meshlm.config import ParallelConfig
    from meshlm.inference import _inference_config

    with pytest.raises(ConfigError, match="do not run a pipeline over 'stage'"):
        _inference_config(config("llama"), ParallelConfig(stage=2))


def validation_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def test_train_moves_between_pipelined_and_unpipelined_meshes(corpus_dir, tmp_path):
    """Through the trainer: steps 1-2 on stage=2 x tensor=2 (zb1; 1F1B's steps are the SGD test's)
    with a validation pass, 3 on context=2 x tensor=2 (Ulysses; resumed from the pipeline's
    checkpoint), 4 on data=2 x fsdp=2 (resumed from the context mesh's): the losses are one
    device's."""
    from meshlm.trainer import train

    def cfg_for(mesh: dict) -> RunConfig:
        cfg = config("gpt")
        par = dataclasses.replace(cfg.parallel, **mesh, context_strategy="all_to_all")
        if par.stage > 1:
            par = dataclasses.replace(par, pipeline_schedule="zb1")
        cfg = dataclasses.replace(cfg, parallel=par)
        return validate(
            dataclasses.replace(
                cfg,
                model=dataclasses.replace(cfg.model, vocab_size=320, n_layers=2),
                train=dataclasses.replace(cfg.train, steps=4, log_every=1, eval_every=2, microbatches=2),
                data=DataConfig(paths=(str(corpus_dir),), cache_dir=str(tmp_path / "cache")),
            )
        )

    train(cfg_for({}), tmp_path / "one", quiet=True)
    run = tmp_path / "moved"
    train(cfg_for(dict(stage=2, tensor=2)), run, quiet=True, stop_after=2)
    report = json.loads((run / "run.json").read_text())["startup_report"]
    assert report["pipeline"] | {"bubble_fraction": None} == {
        "schedule": "zb1",
        "stages": 2,
        "virtual_stages": 1,
        "microbatches": 2,
        "ticks": 5,
        "pipeline_ticks": "paired",
        "bubble_fraction": None,
        "peak_in_flight": [2, 1],
        "peak_pending_weight_passes": [2, 2],
        "unbranched": False,
    }
    assert report["pipeline"]["bubble_fraction"] == pytest.approx(1 / 3)  # 1F1B's: 0.5
    assert any(k.startswith("activations (stage 0, 2 in flight)") for k in report["predicted_device_bytes"])
    train(cfg_for(dict(context=2, tensor=2)), run, quiet=True, stop_after=3)
    result = train(cfg_for(dict(data=2, fsdp=2)), run, quiet=True)
    assert result.final_step == 4
    one, moved = logged_losses(tmp_path / "one"), logged_losses(run)
    assert sorted(one) == sorted(moved) == [1, 2, 3, 4]
    np.testing.assert_allclose([moved[k] for k in one], [one[k] for k in one], rtol=2e-5)
    val = [validation_losses(tmp_path / name) for name in ("one", "moved")]
    assert sorted(val[0]) == [2, 4] and val[0].keys() == val[1].keys()  # step 2 ran on the stage mesh
    np.testing.assert_allclose([val[1][k] for k in val[0]], [val[0][k] for k in val[0]], rtol=2e-5)
