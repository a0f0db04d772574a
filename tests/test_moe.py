"""Mixture of Experts: routing and capacity against NumPy, raw gradients on every expert-parallel
layout against one device (dropless and with drops), a training run's router metrics in
metrics.jsonl / TensorBoard / the report, checkpoints across layouts, and the configs it refuses."""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import loss_mask, random_batches, tiny_config
from meshlm import accounting, recipes
from meshlm.config import CheckpointConfig, ConfigError, DataConfig, ParallelConfig, RematConfig, RunConfig
from meshlm.model import moe, moe_costs
from meshlm.model.params import count_params, init_params, named_leaves, param_specs
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.remat import POLICIES
from meshlm.step import make_grad_step
from meshlm.train_state import state_shardings
from meshlm.validation import validate

RTOL = 1e-5  # per leaf, relative to the leaf's norm (test_gradients.py); fp32 summation order only


def moe_config(
    mesh: dict | None = None,
    sp: bool = False,
    factor: float = 0.0,
    policy: str = "elementwise",
    microbatches: int = 1,
    **model,
) -> RunConfig:
    """The gradient tests' tiny llama (GQA, 2 layers) with 8 experts of width 32, top-2, a gated
    shared expert, both router losses on."""
    cfg = tiny_config("llama")
    m = dataclasses.replace(
        cfg.model,
        n_experts=8,
        experts_per_token=2,
        expert_d_ff=32,
        expert_capacity_factor=factor,
        moe_z_loss_coef=1e-3,
        n_shared_experts=1,
        shared_expert_gate=True,
        **model,
    )
    par = dataclasses.replace(cfg.parallel, sequence_parallel=sp, **(mesh or {}))
    train = dataclasses.replace(cfg.train, microbatches=microbatches)
    return validate(dataclasses.replace(cfg, model=m, parallel=par, remat=RematConfig(policy), train=train))


# ------------------------------------------------------------------------------ routing vs NumPy


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_route(logits, k, renormalize, capacity):
    """A direct NumPy reading of docs/moe.md's rules, token by token: top-k, weights, then the
    slots in priority order (every first choice of the row in token order, then the second...)."""
    b, t, E = logits.shape
    probs = _np_softmax(logits)
    experts = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(logits, experts, -1)
    weights = _np_softmax(top) if renormalize else np.take_along_axis(probs, experts, -1)
    kept = np.zeros((b, t, k), bool)
    for r in range(b):
        used = [0] * E
        for j in range(k):
            for i in range(t):
                e = experts[r, i, j]
                kept[r, i, j] = used[e] < capacity
                used[e] += 1
    return probs, experts, weights, kept


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_capacity_and_router_losses_equal_numpy(renormalize):
    rng = np.random.default_rng(0)
    b, t, E, k, C = 3, 16, 8, 2, 3  # 32 assignments for 24 slots per row: drops certain
    logits = rng.normal(size=(b, t, E)).astype(np.float32) * 2
    probs, experts, weights, kept = np_route(logits, k, renormalize, C)
    w, ex, p = jax.device_get(moe.route(jnp.asarray(logits), k, renormalize))
    np.testing.assert_array_equal(ex, experts)
    np.testing.assert_allclose(w, weights, rtol=1e-6)
    np.testing.assert_allclose(p, probs, rtol=1e-6)
    slot, got_kept = jax.device_get(moe.assign_slots(jnp.asarray(ex), E, C))
    got_kept = got_kept.reshape(b, k, t).transpose(0, 2, 1)
    np.testing.assert_array_equal(got_kept, kept)
    assert (~kept).sum() > 0 and np.all(slot.reshape(b, k, t).transpose(0, 2, 1)[~kept] == E * C)
    # the losses over the whole microbatch, from the per-row statistics of two "layers"
    lse = np.log(np.exp(logits).sum(-1))
    counts = np.stack([(experts == e).sum(axis=(1, 2)) for e in range(E)], -1).astype(np.float32)
    stats = moe.RouterStats(counts, probs.sum(1), (lse**2).sum(1), (~kept).sum(axis=(1, 2)).astype(np.float32))
    stacked = moe.RouterStats(*[np.stack([a, a]) for a in stats])
    cfg = dataclasses.replace(moe_config().model, n_experts=E, experts_per_token=k)
    got = jax.device_get(moe.moe_losses(stacked, cfg))
    f = counts.sum(0) / (b * t)  # the fraction of tokens routing to each expert (sums to k)
    np.testing.assert_allclose(got["moe_aux_loss"], E * np.sum(f * probs.reshape(-1, E).mean(0)), rtol=1e-6)
    np.testing.assert_allclose(got["moe_z_loss"], np.mean(lse**2), rtol=1e-6)
    np.testing.assert_allclose(got["expert_load"][0], counts.sum(0) / (b * t * k), rtol=1e-6)
    np.testing.assert_allclose(got["dropped_fraction"], (~kept).mean(), rtol=1e-6)


def test_the_load_balancing_loss_is_transformers_pooled_over_layers():
    """Layers that route differently: the auxiliary loss equals `transformers`' own
    `load_balancing_loss_func` on the same router logits (counts and probabilities pooled over the
    layers, then one product), which the mean of per-layer losses does not (checked: they differ)."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rng = np.random.default_rng(1)
    b, t, E, k = 2, 16, 8, 2
    skew = np.zeros(E, np.float32)
    skew[:2] = 3.0  # the second layer prefers two experts: its imbalance is not the first's
    logits = [rng.normal(size=(b, t, E)).astype(np.float32), rng.normal(size=(b, t, E)).astype(np.float32) + skew]
    per_layer = []
    for lg in logits:
        probs, experts, _, _ = np_route(lg, k, True, t)
        counts = np.stack([(experts == e).sum(axis=(1, 2)) for e in range(E)], -1).astype(np.float32)
        lse = np.log(np.exp(lg).sum(-1))
        per_layer.append(moe.RouterStats(counts, probs.sum(1), (lse**2).sum(1), np.zeros(b, np.float32)))
    stacked = moe.RouterStats(*[np.stack(a) for a in zip(*per_layer, strict=True)])
    cfg = dataclasses.replace(moe_config().model, n_experts=E, experts_per_token=k)
    got = float(jax.device_get(moe.moe_losses(stacked, cfg))["moe_aux_loss"])
    want = float(load_balancing_loss_func(tuple(torch.from_numpy(x.reshape(-1, E)) for x in logits), E, k))
    assert got == pytest.approx(want, rel=1e-6)
    mean_of_layers = np.mean(
        [
            float(jax.device_get(moe.moe_losses(moe.RouterStats(*[a[None] for a in s]), cfg))["moe_aux_loss"])
            for s in per_layer
        ]
    )
    assert abs(mean_of_layers - want) > 1e-3 * want


def test_the_layer_drops_exactly_what_numpy_drops():
    """The whole MoE layer on one device, with a finite capacity, equals a NumPy loop over tokens
    that adds weight x SwiGLU_e(x) for the kept assignments only (plus the gated shared expert)."""
    cfg = moe_config(factor=1.0).model
    t = 32
    C = moe_costs.expert_capacity(cfg, t)
    assert C == math.ceil(1.0 * t * 2 / 8) == 8
    specs = param_specs(cfg)
    p = {k: np.asarray(v[0]) for k, v in init_params(specs, jax.random.key(1))["layers"].items()}
    x = np.random.default_rng(2).normal(size=(2, t, cfg.d_model)).astype(np.float32)
    y, stats = jax.device_get(jax.jit(lambda x, p: moe.moe_ffn(None, x, p, cfg, {}, None))(x, p))
    logits = x @ p["w_router"]
    _, experts, weights, kept = np_route(logits, 2, True, C)
    silu = lambda a: a / (1 + np.exp(-a))
    want = np.zeros_like(x)
    for r in range(2):
        for i in range(t):
            v = x[r, i]
            for j in range(2):
                if kept[r, i, j]:
                    e = experts[r, i, j]
                    want[r, i] += weights[r, i, j] * (
                        (silu(v @ p["we_gate"][e]) * (v @ p["we_up"][e])) @ p["we_down"][e]
                    )
            shared = (silu(v @ p["ws_gate"]) * (v @ p["ws_up"])) @ p["ws_down"]
            want[r, i] += shared / (1 + np.exp(-(v @ p["ws_router"])))
    np.testing.assert_allclose(y, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(stats.dropped, (~kept).sum(axis=(1, 2)))
    assert stats.dropped.sum() > 0


# ------------------------------------------------------------------------- layouts vs one device


def grads(cfg: RunConfig, params: dict) -> dict:
    """Raw gradients at step 5 of a random batch with a loss mask (as packed chat data has)."""
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    batch = random_batches(cfg, 1, seed=3)[0] | {"mask": loss_mask((cfg.train.global_batch, cfg.train.seq_len))}
    return jax.device_get(make_grad_step(cfg, layout, shardings)(jax.device_put(params, shardings), batch, 5))


@pytest.fixture(scope="module")
def params():
    return jax.device_get(init_params(param_specs(moe_config().model), jax.random.key(0)))


@pytest.fixture(scope="module")
def reference(params):
    """One device's gradients per (capacity factor, microbatches), computed once each."""
    cache = {}

    def get(factor: float, microbatches: int = 1) -> dict:
        if (factor, microbatches) not in cache:
            cache[factor, microbatches] = grads(moe_config(factor=factor, microbatches=microbatches), params)
        return cache[factor, microbatches]

    return get


# name: (mesh, sequence parallel, capacity factor, microbatches); capacity 1 drops ~15% of assignments;
# expert=2 x tensor=2 without SP: test_a_wrong_router_gradient_is_caught
LAYOUTS = {
    "expert4": (dict(expert=4), False, 0.0, 1),
    "expert4 capacity 1": (dict(expert=4), False, 1.0, 1),
    "expert2_tensor2_data2+sp": (dict(expert=2, tensor=2, data=2), True, 0.0, 1),
    "fsdp2_expert4": (dict(fsdp=2, expert=4), False, 0.0, 1),
    "expert2_tensor2_data2+sp capacity 1": (dict(expert=2, tensor=2, data=2), True, 1.0, 1),
    "expert2_data2 capacity 1, 2 microbatches": (dict(expert=2, data=2), False, 1.0, 2),
}


CASES = [(n, "elementwise") for n in LAYOUTS]
CASES += [("expert2_tensor2_data2+sp capacity 1", p) for p in POLICIES if p != "elementwise"]


def assert_same_as_one_device(got: dict, ref: dict) -> None:
    """Every gradient leaf within RTOL of one device's (relative to the leaf's norm), the loss, norm
    and router losses too, and the same assignments dropped, the same load on every expert."""
    g, r = named_leaves(got["grads"]), named_leaves(ref["grads"])
    assert g.keys() == r.keys() and "layers/we_gate" in g
    errors = {n: float(np.linalg.norm(g[n] - r[n]) / np.linalg.norm(r[n])) for n in r}
    assert max(errors.values()) < RTOL, errors
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, err_msg=key)
    np.testing.assert_array_equal(got["dropped_fraction"], ref["dropped_fraction"])  # the same drops
    np.testing.assert_allclose(got["expert_load"], ref["expert_load"], rtol=1e-6)


@pytest.mark.parametrize("name, policy", CASES)
def test_expert_parallel_layouts_give_the_one_device_gradients(name, policy, params, reference):
    """Every layout (tensor with and without SP, fsdp, gradient accumulation; dropless and with
    drops), and every remat policy on the most composed one (with drops)."""
    mesh, sp, factor, micro = LAYOUTS[name]
    ref = reference(factor, micro)
    assert_same_as_one_device(grads(moe_config(mesh, sp, factor, policy, micro), params), ref)
    assert (ref["dropped_fraction"] > 0.05) == (factor > 0)


def test_a_wrong_router_gradient_is_caught(params, reference):
    """The comparison above fails on a factor of 2 in the router's gradient (the leaf a doubled
    psum over tensor or expert would hit) and on one more dropped assignment."""
    got = grads(moe_config(dict(expert=2, tensor=2), False), params)
    assert_same_as_one_device(got, reference(0.0))
    doubled = got | {"grads": jax.tree.map(lambda x: x, got["grads"])}
    doubled["grads"]["layers"]["w_router"] = 2 * got["grads"]["layers"]["w_router"]
    with pytest.raises(AssertionError, match="w_router"):
        assert_same_as_one_device(doubled, reference(0.0))
    with pytest.raises(AssertionError):
        assert_same_as_one_device(got | {"dropped_fraction": got["dropped_fraction"] + 1e-3}, reference(0.0))


# dropless kernels: name -> (mesh, sequence parallel, model.moe_kernel, remat policy)
KERNELS = {
    "buffers, one device": ({}, False, "buffers", "elementwise"),
    "ragged_dot, one device": ({}, False, "ragged_dot", "elementwise"),
    "megablox in interpret mode, one device": ({}, False, "megablox", "elementwise"),
    "tiled, expert2_tensor2+sp": (dict(expert=2, tensor=2), True, "tiled", "elementwise"),
    "tiled, expert2_tensor2+sp, full": (dict(expert=2, tensor=2), True, "tiled", "full"),
    "tiled, fsdp2_expert2, dots": (dict(fsdp=2, expert=2), False, "tiled", "dots"),
}


@pytest.mark.parametrize("name", KERNELS)
def test_dropless_kernels_give_the_one_device_gradients(name, params, reference):
    """The reference is one device on the grouped CPU kernel (`tiled`, what `auto` takes for its
    512 assignments): capacity buffers of C = t slots (dropless) give its gradients, and so do
    `ragged_dot`, JAX's megablox `gmm` (interpret mode) and the tiled kernel across the grouped
    exchange's worst-case buffers, with tensor + SP and with fsdp, under remat policies that
    recompute it."""
    mesh, sp, kernel, policy = KERNELS[name]
    one = moe_config()
    assert moe_costs.expert_kernel(one.model, 8, 32) == "tiled"
    got = grads(moe_config(mesh, sp, policy=policy, moe_kernel=kernel), params)
    assert_same_as_one_device(got, reference(0.0))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from all_to_all and gathers (XLA:CPU
    does not implement the op): slice i of `operand` (input_offsets[i], send_sizes[i] rows) goes to
    device i, which writes it at this device's output_offsets[i]; received slice i (recv_sizes[i]
    rows) lands where device i said. Unsent rows never travel: they are zeroed before the all_to_all."""
    n, m, k = operand.shape[0], output.shape[0], input_offsets.shape[0]
    r = jnp.arange(n)
    rows = jnp.take(operand, jnp.minimum(input_offsets[:, None] + r, n - 1), axis=0)  # [k, n, ...]
    sent = (r < send_sizes[:, None]).reshape(k, n, *[1] * (operand.ndim - 1))
    got = jax.lax.all_to_all(jnp.where(sent, rows, 0), axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)[:, None] + r
    at = jnp.where(r < recv_sizes[:, None], at, m)  # rows past a slice's size: dropped
    return output.at[at.reshape(-1)].set(got.reshape(k * n, *operand.shape[1:]), mode="drop")


def test_the_emulated_ragged_all_to_all_is_the_documented_one():
    """The emulation above on the example in `jax.lax.ragged_all_to_all`'s docstring (axis size 2)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    args = [
        [[1, 2, 2], [3, 4, 0]],  # operand
        [[0, 0, 0, 0], [0, 0, 0, 0]],  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    ]
    args = [jnp.array(a, jnp.float32 if i < 2 else jnp.int32).reshape(-1) for i, a in enumerate(args)]
    run = jax.shard_map(
        functools.partial(emulated_ragged_all_to_all, axis_name="x"),
        mesh=mesh,
        in_specs=(P("x"),) * 6,
        out_specs=P("x"),
    )
    np.testing.assert_array_equal(jax.jit(run)(*args).reshape(2, 4), [[1, 3, 0, 0], [2, 2, 4, 0]])


@pytest.fixture
def ragged_exchange(monkeypatch):
    """The grouped exchange on CPU moving its rows by (the emulated) `ragged_all_to_all`; yields the
    list of each call's send sizes, as they run (None where they disagree with the receivers')."""
    from meshlm.model import moe as moe_module

    sizes = []

    def op(*args, axis_name, **_):
        # the op's precondition: what I send each peer is what it expects from me
        expected = jax.lax.all_to_all(args[5], axis_name, 0, 0, tiled=True)
        jax.debug.callback(
            lambda s, e: sizes.append(np.asarray(s) if np.array_equal(s, e) else None), args[3], expected
        )
        return emulated_ragged_all_to_all(*args, axis_name=axis_name)

    monkeypatch.setitem(moe_module.EXCHANGE_OP, "cpu", "ragged")
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", op)
    return sizes


@pytest.mark.parametrize("mesh, sp", [(dict(expert=4), False), (dict(expert=2, tensor=2), True)])
def test_the_ragged_exchange_gives_the_one_device_gradients(mesh, sp, params, reference, ragged_exchange):
    """Dropless on the grouped kernel, its rows exchanged by `ragged_all_to_all` (emulated: the op
    GPUs and TPUs get, `moe_costs.EXCHANGE_OP`): one device's gradients; each device sends exactly its
    routed rows (the send sizes add up to its b t k assignments; what each receives goes back)."""
    cfg = moe_config(mesh, sp, moe_kernel="tiled")
    got = grads(cfg, params)
    assert_same_as_one_device(got, reference(0.0))
    t, m = cfg.train, cfg.model
    routed = t.global_batch // mesh["expert"] * t.seq_len * m.experts_per_token
    assert all(s is not None for s in ragged_exchange)  # send sizes as the receivers' recv sizes say
    sums = [int(s.sum()) for s in ragged_exchange]  # out: routed each; back: what each device received
    assert sums.count(routed) >= len(sums) // 2 and sum(sums) == len(sums) * routed
    assert max(int(s.max()) for s in ragged_exchange) < routed  # not a whole buffer to any device


# MoE inside pipelines: name -> (mesh, schedule, SP, capacity factor, remat policy); 2 microbatches
PIPELINES = {
    "stage2_expert2_tensor2 1f1b, NaN bubbles": (dict(stage=2, expert=2, tensor=2), "1f1b", False, 0.0, "elementwise"),
    "stage2_expert2_tensor2+sp zb1 capacity 1, full, NaN bubbles": (
        dict(stage=2, expert=2, tensor=2),
        "zb1",
        True,
        1.0,
        "full",
    ),
    "stage2_data2_expert2 gpipe capacity 1, NaN bubbles": (
        dict(stage=2, data=2, expert=2),
        "gpipe",
        False,
        1.0,
        "elementwise",
    ),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_moe_inside_pipelines_gives_the_one_device_gradients(name, params, reference, monkeypatch):
    """Each stage's MoE layers route their rows, the router losses' gradients come from each chunk's
    share given the microbatch's counts over every stage (riding with the activations and back with
    the cotangents), and the metrics from every layer's statistics: raw gradients, loss, norm, router
    losses, drops and loads equal one device's with the same 2 microbatches - with the expert
    exchange inside a stage, zb1's split backward, drops, and idle stages that send NaN."""
    from meshlm import step
    from meshlm.parallel import pipeline

    mesh, schedule, sp, factor, policy = PIPELINES[name]
    if "NaN" in name:  # every empty slot and idle send NaN: none of it may reach a gradient or metric
        monkeypatch.setattr(
            step, "pipeline_gradients", functools.partial(pipeline.pipeline_gradients, idle_fill=jnp.nan)
        )
    cfg = moe_config(mesh, sp, factor, policy, microbatches=2)
    cfg = validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_schedule=schedule)))
    assert_same_as_one_device(got := grads(cfg, params), reference(factor, 2))
    np.testing.assert_array_equal(got["expert_counts"], reference(factor, 2)["expert_counts"])


# MoE models with dense layers among MoE ones inside pipelines, in units (`schedules.pipeline_unit`):
# name -> (model, mesh, schedule, virtual stages, SP); 2 microbatches, NaN bubbles
UNIT_PIPELINES = {
    "D + (M, D) x 3 over 2 stages (a pad unit), zb1, stage2_expert2_tensor2+sp": (
        dict(n_layers=7, first_k_dense=1, moe_layer_step=2),
        dict(stage=2, expert=2, tensor=2),
        "zb1",
        1,
        True,
    ),
    "(M, M, D) x 4, interleaved 2 x 2 chunks, stage2_data2_expert2": (
        dict(n_layers=12, dense_layers=(2, 5, 8, 11)),
        dict(stage=2, data=2, expert=2),
        "interleaved",
        2,
        False,
    ),
}


@pytest.fixture(scope="module")
def unit_reference():
    """One device's parameters and gradients (2 microbatches) per model of UNIT_PIPELINES."""
    cache = {}

    def get(model: dict):
        key = tuple(sorted(model.items()))
        if key not in cache:
            one = moe_config(microbatches=2, **model)
            params = jax.device_get(init_params(param_specs(one.model), jax.random.key(4)))
            cache[key] = params, grads(one, params)
        return cache[key]

    return get


@pytest.mark.parametrize("name", UNIT_PIPELINES)
def test_dense_and_moe_layers_in_units_inside_pipelines_give_the_one_device_gradients(
    name, unit_reference, monkeypatch
):
    """Qwen's decoder_sparse_step=2 (and a dense first layer before it) in a pipeline: each chunk slot
    runs a unit of a dense and an MoE layer (their weights strided out of the two stacks and
    interleaved back into them), a pad unit where the stages split the units unevenly; and units of
    two MoE layers and a dense one. Raw gradients
    of both stacks, loss, norm, router losses and expert counts equal one device's, under zb1's split
    backward with SP and under interleaving with a data axis, idle stages sending NaN."""
    from meshlm import step
    from meshlm.parallel import pipeline, schedules

    model, mesh, schedule, virtual, sp = UNIT_PIPELINES[name]
    monkeypatch.setattr(step, "pipeline_gradients", functools.partial(pipeline.pipeline_gradients, idle_fill=jnp.nan))
    cfg = moe_config(mesh, sp, microbatches=2, **model)
    par = dataclasses.replace(cfg.parallel, pipeline_schedule=schedule, virtual_stages=virtual)
    cfg = validate(dataclasses.replace(cfg, parallel=par))
    unit = schedules.pipeline_unit(cfg.model)
    assert len(unit.kinds) > 1 and unit.count * len(unit.kinds) + unit.prefix == model["n_layers"]
    params, ref = unit_reference(model)
    got = grads(cfg, params)
    assert_same_as_one_device(got, ref)
    np.testing.assert_array_equal(got["expert_counts"], ref["expert_counts"])
    assert np.abs(got["grads"]["dense_layers"]["w_down"]).max() > 0


def test_units_inside_pipelines_run_the_ring_inside_the_stages():
    """Units of (dense, MoE) run in every stage's chunk (no branch of the first stage's, as dense
    first layers do), so the ring's permutes, which every stage must enter, may run inside them:
    stage=2 x context=2 x expert=2, 3 units (a pad), load-balanced order: one device's gradients."""
    from test_gradients import assert_same_grads
    from test_gradients import grads as layout_grads

    model = dict(n_layers=6, moe_layer_step=2, attention="blockwise")
    one = moe_config(microbatches=2, **model)
    params = jax.device_get(init_params(param_specs(one.model), jax.random.key(4)))
    ring = moe_config(dict(stage=2, context=2, expert=2), microbatches=2, **model)
    assert ring.parallel.context_strategy == "ring"
    assert_same_grads(layout_grads(ring, params), layout_grads(one, params))


def test_lora_on_an_moe_model_in_a_1f1b_pipeline_gives_the_one_device_gradients():
    """LoRA on the attention of an MoE model (the experts frozen) with a dense first layer (its
    adapters in the dense stack, which runs with the embedding on stage 0), then units of (MoE,
    dense), on stage=2 x expert=2 x tensor=2, 1F1B, 2 microbatches, with LoRA dropout (each layer's
    key from its id in the whole model): the adapters' raw gradients equal one device's (B away from
    its zero start, so A's are not zero), and every frozen leaf's is zero, as without a pipeline."""
    lora = dict(lora_rank=4, lora_targets=("wq", "wv"), n_layers=5, first_k_dense=1, moe_layer_step=2, lora_dropout=0.1)
    one = moe_config(microbatches=2, **lora)
    leaves, tree = jax.tree.flatten(init_params(param_specs(one.model), jax.random.key(0)))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.device_get(
        jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)])
    )
    piped = moe_config(dict(stage=2, expert=2, tensor=2), microbatches=2, **lora)
    got, ref = (named_leaves(grads(c, params)["grads"]) for c in (piped, one))
    adapters = [n for n in ref if "_lora_" in n]
    names = ["wq_lora_a", "wq_lora_b", "wv_lora_a", "wv_lora_b"]
    assert sorted(adapters) == [f"{s}/{n}" for s in ("dense_layers", "layers") for n in names]
    for n in ref:
        if n in adapters:
            assert np.linalg.norm(got[n] - ref[n]) < RTOL * np.linalg.norm(ref[n]) and np.linalg.norm(ref[n]) > 0, n
        else:
            assert not np.any(got[n]) and not np.any(ref[n]), n


def test_a_pipeline_without_the_other_stages_counts_is_caught(params, reference, monkeypatch):
    """The comparison above fails when a stage's router-loss gradient uses its own layers' counts
    (no total riding through the pipeline) instead of the microbatch's over all stages."""
    from meshlm.parallel import pipeline

    monkeypatch.setattr(pipeline._Stage, "moe_tick", _own_counts_only(pipeline._Stage.moe_tick))
    got, ref = grads(moe_config(dict(stage=2), microbatches=2), params), reference(0.0, 2)
    g, r = named_leaves(got["grads"]), named_leaves(ref["grads"])
    error = lambda n: float(np.linalg.norm(g[n] - r[n]) / np.linalg.norm(r[n]))
    # the router's gradient most (0.64 measured); the others through the router's input (wq: 1.5e-3)
    assert error("layers/w_router") > 0.1 and error("layers/wq") < error("layers/w_router") / 100


def _own_counts_only(moe_tick):
    def tick(self, c, r, *rest):
        return moe_tick(self, c | {"act": jnp.zeros_like(c["act"])}, r, *rest)

    return tick


def test_the_tile_loop_skips_the_steps_past_the_routed_rows():
    """16 assignments, 2 per expert, each padded to a 128-row tile: 1,024 used rows (8 tiles) in a
    buffer of 16 tiles. The other 8 tiles are skipped: their rows, ones here, come out
    zero (run, they would not), and a NaN cotangent on them reaches no weight gradient (run
    backward, it would). The used rows equal each expert's SwiGLU."""
    from meshlm.model import grouped
    from meshlm.model.layers import swiglu

    E, d, f = 8, 16, 8
    g = grouped.Groups(jnp.arange(16, dtype=jnp.int32) % E, E, 4 * 4 * 128)
    assert int(g.used_rows) == E * 128
    x = jnp.ones((g.rows, d), jnp.float32)
    ws = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(E, d, f), (E, d, f), (E, f, d)])]
    out, pull = jax.vjp(lambda x, *ws: grouped.expert_swiglu(x, g, *ws, swiglu, "tiled"), x, *ws)
    assert float(jnp.abs(out[E * 128 :]).max()) == 0.0
    cotangent = jnp.where(jnp.arange(g.rows)[:, None] < E * 128, jnp.ones_like(out), jnp.nan)
    assert all(bool(jnp.isfinite(w).all()) for w in pull(cotangent)[1:])
    want = swiglu(x[0] @ ws[0][3], x[0] @ ws[1][3]) @ ws[2][3]  # row 3 x 128: expert 3's first
    np.testing.assert_allclose(out[3 * 128], want, rtol=1e-5)


# MoE models with dense layers: name -> (mesh, sequence parallel, model.moe_kernel)
MIXED = {
    "expert2_tensor2+sp": (dict(expert=2, tensor=2), True, "auto"),
    "fsdp2_expert2, grouped": (dict(fsdp=2, expert=2), False, "tiled"),
}
MIXED_MODEL = dict(n_layers=5, first_k_dense=1, dense_layers=(3,))  # dense 0 and 3: scans D, M M, D, M


@pytest.fixture(scope="module")
def mixed_reference():
    cfg = moe_config(**MIXED_MODEL)
    params = jax.device_get(init_params(param_specs(cfg.model), jax.random.key(4)))
    return params, grads(cfg, params)


@pytest.mark.parametrize("name", MIXED)
def test_moe_models_with_dense_layers_give_the_one_device_gradients(name, mixed_reference):
    """Dense first layers and a dense layer in between (two stacks, scanned in the model's order;
    HF parity is tests/test_hf_moe.py's): raw gradients of both stacks, loss and router losses equal
    one device's; the router statistics are the MoE layers' only."""
    mesh, sp, kernel = MIXED[name]
    params, ref = mixed_reference
    assert params["dense_layers"]["w_gate"].shape[0] == 2 and params["layers"]["we_gate"].shape[0] == 3
    assert np.asarray(ref["expert_load"]).shape == (3, 8)
    got = grads(moe_config(mesh, sp, moe_kernel=kernel, **MIXED_MODEL), params)
    assert_same_as_one_device(got, ref)
    assert np.abs(got["grads"]["dense_layers"]["w_down"]).max() > 0


def test_layer_groups_cover_the_models_layers_in_order():
    """The scans run every layer once in order: each (unit, repeats) group expanded gives the
    model's layer kinds, for DeepSeek-V3's and Qwen's layouts and an irregular one; parameter
    counts follow the kinds."""
    from meshlm.model import mixed

    cases = [
        (61, dict(first_k_dense=3), [((False,), 3), ((True,), 58)]),
        (8, dict(moe_layer_step=2), [((False, True), 4)]),
        (6, dict(moe_layer_step=2, dense_layers=(5,)), [((False, True), 2), ((False,), 2)]),
        (6, dict(dense_layers=(1, 2, 4)), None),
    ]
    for L, fields, want in cases:
        m = dataclasses.replace(moe_config().model, n_layers=L, **fields)
        groups = mixed.layer_groups(m.moe_layer_ids, L)
        kinds = [k for unit, r in groups for _ in range(r) for k in unit]
        assert kinds == [i in m.moe_layer_ids for i in range(L)]
        assert accounting.param_count(m) == count_params(param_specs(m))  # both stacks, each its own MLP
        idle = (m.n_experts - m.experts_per_token) * 3 * m.d_model * m.expert_ffn * len(m.moe_layer_ids)
        assert accounting.active_param_count(m) == accounting.param_count(m) - idle
        assert want is None or groups == want


# ---------------------------------------------------------------------------- accounting, configs


@pytest.mark.parametrize("name", ["moe-tiny", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_parameter_counts(name):
    m = recipes.get(name).model
    assert accounting.param_count(m) == count_params(param_specs(m))
    active = accounting.active_param_count(m)
    idle = (m.n_experts - m.experts_per_token) * 3 * m.d_model * m.expert_ffn * m.n_layers
    assert active == accounting.param_count(m) - idle
    if name == "mixtral-8x7b":  # the published figures
        assert (accounting.param_count(m), active) == (46_702_792_704, 12_879_925_248)


def test_moe_flops_count_k_experts_and_hardware_flops_the_rows_that_run():
    """MFU counts k experts per token; HFU the rows the experts run over: E x C slots per row in
    capacity buffers (1.25x at capacity 1.25, E/k = 4x dropless), and dropless on the grouped kernel
    each device's routed rows with their tile padding (moe-tiny on expert=2: 2,560 rows per device
    for its 2,048 assignments, 1.25x)."""
    cfg = recipes.get("moe-tiny")
    m, t = cfg.model, cfg.train
    terms = accounting.layer_forward_flops_per_token(m, t.seq_len)
    assert terms["mlp"] == 2 * 2 * 3 * m.d_model * m.expert_ffn and terms["router"] == 2 * m.d_model * m.n_experts
    counted, executed = accounting.expert_slot_flops(cfg)
    C = moe_costs.expert_capacity(m, t.seq_len)
    assert C == 40 and executed * m.experts_per_token * t.seq_len == counted * m.n_experts * C  # 320 / 256 slots
    dropless = lambda kernel: dataclasses.replace(
        cfg, model=dataclasses.replace(m, expert_capacity_factor=0.0, moe_kernel=kernel)
    )
    buffers, grouped = dropless("buffers"), dropless("auto")
    assert accounting.expert_slot_flops(buffers)[1] == counted * m.n_experts // m.experts_per_token  # E/k x
    assert moe_costs.expert_kernel(grouped.model, 8, t.seq_len, 2) == "tiled"
    assert moe_costs.grouped_rows(8 * t.seq_len * 2, 4) == 2560  # a device's 2,048 assignments, 4 experts
    assert accounting.expert_slot_flops(grouped)[1] * 4 == counted * 5  # 2 devices x 2,560 rows / 4,096
    hw = accounting.hardware_flops_per_step
    assert hw(buffers) - hw(cfg) == 3 * (accounting.expert_slot_flops(buffers)[1] - executed)
    assert accounting.model_flops_per_step(buffers) == accounting.model_flops_per_step(cfg)  # MFU: active only


def test_the_grouped_cpu_kernel_runs_at_most_1_25x_the_routed_flops():
    """moe-tiny's layer on one device (16 rows of 128 tokens, 8 experts, top-2), dropless: the
    compiled forward and backward, every loop body x its trip count, run 3 x 5,120 rows' expert
    GEMMs for 4,096 routed assignments (1.25x: 8 experts' padding to 128-row tiles) besides the
    router's; the capacity buffers would run 4x. Counted once per loop body, the tile loop would
    look 40 times cheaper than it is (40 tiles)."""
    from meshlm.insight import hlo

    m = dataclasses.replace(recipes.get("moe-tiny").model, expert_capacity_factor=0.0, n_layers=1)
    p = {k: v[0] for k, v in init_params(param_specs(m), jax.random.key(1))["layers"].items()}
    x = jnp.ones((16, 128, m.d_model), jnp.float32)
    loss = lambda x, p: jnp.sum(moe.moe_ffn(None, x, p, m, {}, None)[0])
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, p).compile().as_text()
    one_row = 2 * 3 * m.d_model * m.expert_ffn  # an assignment's SwiGLU, forward
    routed = 16 * 128 * 2 * one_row
    experts = hlo.executed_dot_flops(text) - 3 * 2 * 16 * 128 * m.d_model * m.n_experts  # less the router's
    assert moe_costs.expert_kernel(m, 16, 128) == "tiled" and moe_costs.grouped_rows(4096, 8) == 5120
    assert moe_costs.expert_kernel(m, 16, 128, platform="tpu") == "ragged_dot"  # 1.5x megablox on a v5e
    assert experts == 3 * 5120 * one_row and experts <= 1.25 * 3 * routed
    assert hlo.dot_flops(text) < 3 * routed / 2  # the loop body's text holds one tile of 128 rows


@pytest.fixture(scope="module")
def context_reference():
    """Dropless MoE with DeepSeek-V3's routing and its sequence-wise loss (per-row statistics),
    blockwise attention at block 4, packed rows (document and loss masks): one device's gradients."""
    from test_gradients import grads as layout_grads

    cfg = moe_config(
        attention="blockwise",
        attention_block=4,
        router_score="sigmoid",
        router_bias=True,
        n_group=4,
        topk_group=2,
        moe_seq_aux_loss_coef=1e-2,
    )
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=True))
    params = jax.device_get(init_params(param_specs(cfg.model), jax.random.key(0)))
    return cfg, params, layout_grads(cfg, params)


@pytest.mark.parametrize("strategy, kernel", [("ring", "buffers"), ("all_gather", "tiled"), ("all_to_all", "tiled")])
def test_dropless_moe_under_context_parallelism_equals_one_device(context_reference, strategy, kernel):
    """MoE x context parallelism (dropless; capacity buffers, or the grouped kernel across its exchange):
    context=2 x expert=2, each context strategy,
    load-balanced order and document masks: raw gradients, loss, norm and the router losses equal
    one device's (each row's statistics summed over `context`; without that sum the sequence-wise
    loss and the pooled loss see half rows)."""
    from test_gradients import assert_same_grads
    from test_gradients import grads as layout_grads

    one, params, ref = context_reference
    par = dataclasses.replace(one.parallel, context=2, expert=2, context_strategy=strategy)
    model = dataclasses.replace(one.model, moe_kernel=kernel)
    got = layout_grads(validate(dataclasses.replace(one, parallel=par, model=model)), params)
    assert_same_grads(got, ref)
    for key in ("moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(parallel=ParallelConfig(stage=2), model=dict(dense_layers=(2,))),
            "makes 1 unit\\(s\\) of 4 dense and MoE layers .* leaves a chunk",
        ),
        (dict(parallel=ParallelConfig(stage=2), model=dict(n_layers=6, dense_layers=(2,))), "these repeat none"),
        (dict(parallel=ParallelConfig(stage=2), model=dict(first_k_dense=3)), "less the 3 dense first layers"),
        (
            dict(
                parallel=ParallelConfig(stage=2, context=2, context_strategy="ring"),
                model=dict(first_k_dense=2, expert_capacity_factor=0, attention="blockwise"),
            ),
            "the ring's permutes",
        ),
        (
            dict(parallel=ParallelConfig(stage=2, pipeline_schedule="zbv", virtual_stages=2, pipeline_ticks="single")),
            "zbv with an MoE model is not built",
        ),
        (dict(parallel=ParallelConfig(context=2)), "a finite capacity is shared by one whole sequence"),
        (dict(parallel=ParallelConfig(expert=3)), "model.n_experts=8 is not divisible by mesh axis 'expert'"),
        (dict(model=dict(experts_per_token=9)), "experts_per_token=9"),
        (dict(model=dict(family="gpt")), "llama family"),
        (dict(model=dict(dense_layers=(0, 4))), "dense_layers=\\[0, 4\\]: \\[4\\] not in \\[0, n_layers=4\\)"),
        (dict(model=dict(first_k_dense=3, dense_layers=(3,))), "leave none of the 4 layers an MoE layer"),
        (dict(model=dict(n_experts=0, first_k_dense=1)), "but the model is dense"),
    ],
)
def test_moe_configs_that_cannot_run_are_refused(change, message):
    cfg = recipes.get("moe-tiny")
    if "model" in change:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **change["model"]))
    if "parallel" in change:
        cfg = dataclasses.replace(cfg, parallel=change["parallel"])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    with pytest.raises(ConfigError, match="the model is dense"):
        validate(dataclasses.replace(recipes.get("llama-tiny"), parallel=ParallelConfig(expert=2)))


# ------------------------------------------------------------------- a run, its metrics, resume


@pytest.fixture(scope="module")
def moe_run(corpus_dir, tmp_path_factory):
    """moe-tiny (small, 3 layers, the first dense) for 6 steps on expert=2 x tensor=2 with
    checkpoints at 3 and 6."""
    from meshlm.trainer import train

    root = tmp_path_factory.mktemp("moe")
    base = recipes.get("moe-tiny")
    cfg = validate(
        dataclasses.replace(
            base,
            model=dataclasses.replace(
                base.model, vocab_size=320, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, first_k_dense=1
            ),
            parallel=ParallelConfig(expert=2, tensor=2),
            train=dataclasses.replace(base.train, steps=6, global_batch=8, seq_len=32, log_every=1, eval_every=0),
            data=DataConfig(paths=(str(corpus_dir),), cache_dir=str(root / "cache")),
            checkpoint=CheckpointConfig(every=3, keep=5),
        )
    )
    train(cfg, root / "run", quiet=True)
    return cfg, root


def test_router_metrics_reach_metrics_jsonl_tensorboard_and_the_report(moe_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshlm.observe.run_report import write_report

    _, root = moe_run
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "moe_aux_loss" in r]
    assert len(steps) == 6
    for r in steps:
        load = np.asarray(r["expert_load"])
        assert load.shape == (2, 8) and np.allclose(load.sum(-1), 1, atol=1e-5) and r["moe_layers"] == [1, 2]
        assert 0 <= r["dropped_fraction"] < 0.5 and r["expert_load_max"] == pytest.approx(8 * load.max(), rel=1e-5)
    acc = EventAccumulator(str(root / "run" / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"moe/aux_loss", "moe/z_loss", "moe/dropped_fraction", "moe/load/layer2/expert7"} <= set(tags)
    assert "moe/load/layer0/expert0" not in tags  # layer 0 is dense: the charts name the model's layers
    assert [e.value for e in acc.Scalars("moe/aux_loss")] == pytest.approx([r["moe_aux_loss"] for r in steps])
    report = write_report(root / "run")
    assert "MoE router" in report.read_text()


def test_saved_on_expert_x_tensor_resumes_on_data(moe_run):
    """The step-3 checkpoint of the expert=2 x tensor=2 run, resumed on data=4, logs the same
    losses for steps 4-6 as the uninterrupted run."""
    import shutil

    from helpers import logged_losses
    from meshlm.trainer import train

    cfg, root = moe_run
    again = root / "again"
    shutil.copytree(root / "run", again)
    shutil.rmtree(again / "checkpoints" / "6")
    (again / "metrics.jsonl").unlink()
    train(dataclasses.replace(cfg, parallel=ParallelConfig(data=4)), again, quiet=True)
    first, second = logged_losses(root / "run"), logged_losses(again)
    assert sorted(second) == [4, 5, 6]
    np.testing.assert_allclose([second[s] for s in (4, 5, 6)], [first[s] for s in (4, 5, 6)], rtol=2e-5)


def test_meshlm_eval_on_an_moe_run_is_the_same_on_expert_x_tensor(moe_run, capsys):
    """`meshlm eval` of the trained MoE run: one device and expert=2 x tensor=2 give the same loss."""
    from meshlm.cli import main

    _, root = moe_run
    results = []
    for mesh in ([], ["--mesh", "expert=2,tensor=2"]):
        assert main(["eval", "--run-dir", str(root / "run"), "--max-tokens", "300", "--json", *mesh]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["tokens"] == results[1]["tokens"] == 300
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-5) and results[0]["loss"] < 6.5


@pytest.mark.parametrize("policy, kernel", [("elementwise", "buffers"), ("full", "buffers"), ("dots", "tiled")])
def test_the_planners_all_to_all_bytes_are_the_compiled_steps(policy, kernel):
    """The compiled train step on expert=2 (one layer in the scan body) holds the all-to-alls
    `plan.expert_exchange_bytes` prices: dispatch and return, forward and backward (and once more
    forward under `full` and `dots`), each moving the [E, b, C, d] buffer (grouped: the worst-case
    [X, b t k, d] and, forward, the expert ids), of which (X-1)/X leaves the device."""
    import re

    from helpers import build
    from meshlm.insight import plan
    from meshlm.step import abstract_batch, make_train_step

    cfg = moe_config(dict(expert=2), policy=policy, moe_kernel=kernel)
    layout, _, tx, shardings, state = build(cfg)
    text = make_train_step(cfg, layout, tx, shardings).lower(state, abstract_batch(cfg, layout)).compile().as_text()
    ops = [line for line in text.splitlines() if re.search(r"= \(?[^=]*\ball-to-all\(", line)]
    # each op's operands: the X pieces of one device's buffer, whose (X-1)/X leave it
    sent = 0
    for line in ops:
        pieces = re.findall(r"[fs]32\[([\d,]+)\]", line.split("all-to-all(")[0])
        sent += sum(math.prod(int(d) for d in p.split(",")) for p in pieces) * 4 / 2
    per_layer = plan.expert_exchange_bytes(cfg) / cfg.model.n_layers  # the scan body is one layer
    again = policy != "elementwise"
    assert len(ops) == (6 if again else 4) + (kernel == "tiled") * (2 if again else 1) and sent == per_layer


def test_balanced_routing_at_capacity_one_runs_the_active_flops_of_the_routed_tokens():
    """Routing forced to balance exactly (token i's two largest logits are experts i mod E and
    i + 1 mod E), capacity factor 1: nothing is dropped, every slot is filled, and the layer's
    program runs, besides the router's GEMM, exactly the active FLOPs of the routed token counts
    (2 x 3 x d x f per assignment) - the buffers hold no empty slot."""
    from test_flops import _lowered_dot_flops

    cfg = dataclasses.replace(moe_config(factor=1.0).model, n_shared_experts=0, shared_expert_gate=False)
    E, k, d, f, b, t = cfg.n_experts, cfg.experts_per_token, cfg.d_model, cfg.expert_ffn, 2, 32
    x = np.zeros((b, t, d), np.float32)
    x[:, np.arange(t), np.arange(t) % E] = 2.0
    x[:, np.arange(t), (np.arange(t) + 1) % E] = 1.0
    p = {k_: np.asarray(v[0]) for k_, v in init_params(param_specs(cfg), jax.random.key(3))["layers"].items()}
    p["w_router"] = np.eye(d, E, dtype=np.float32)
    fn = jax.jit(lambda x, p: moe.moe_ffn(None, x, p, cfg, {}, None))
    _, stats = jax.device_get(fn(x, p))
    np.testing.assert_array_equal(stats.counts, t * k / E)  # balanced: C = t k / E assignments each
    assert stats.dropped.sum() == 0
    routed = 2 * 3 * d * f * float(stats.counts.sum())
    program = _lowered_dot_flops(fn.lower(x, p).as_text()) - 2 * b * t * d * E
    assert abs(program - routed) <= 0.02 * routed and program == routed


def test_generation_and_evaluation_route_dropless(params):
    """A model trained with capacity factor 1 decodes (KV cache, expert=2 x tensor=2, a left-padded
    batch) to the logits of a full dropless forward pass over prompt + generated tokens: decoding
    is dropless, as a one-token decode step would otherwise be a capacity group of its own. A full
    pass at capacity 1 drops assignments, so it differs."""
    from meshlm import inference
    from meshlm.model.transformer import forward

    cfg = moe_config(factor=1.0)
    par = ParallelConfig(expert=2, tensor=2)
    layout = make_layout(par, jax.devices()[:4])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    model = inference.Model(
        RunConfig(model=cfg.model, parallel=par), jax.device_put(params, shardings), layout, None, 0, "", (0,)
    )
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31]]
    gen = inference.Generator(model).generate(prompts, 6, return_logits=True, stop_at_eos=False)
    dropless = moe.without_capacity(cfg.model)
    for i, prompt in enumerate(prompts):
        seq = np.asarray([prompt + gen.tokens[i]], np.int32)
        full = np.asarray(jax.jit(lambda p, s: forward(p, s, dropless))(params, seq))[0, len(prompt) - 1 : -1]
        np.testing.assert_allclose(gen.logits[i], full, atol=5e-5, rtol=0)
    seq = np.asarray([prompts[0] + gen.tokens[0]], np.int32)
    capped = np.asarray(jax.jit(lambda p, s: forward(p, s, cfg.model))(params, seq))[0, len(prompts[0]) - 1 : -1]
    assert np.abs(capped - gen.logits[0]).max() > 1e-3  # capacity 1 drops some of this sequence's assignments
