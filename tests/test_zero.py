"""ZeRO-1 (`parallel.shard_optimizer`) and optimizer-state host offload (`optim.offload_state`):
the same training as the plain run, Adam's moments where they are said to be.

ZeRO-1 shards the moments over the data-parallel axes the weights are replicated on, so each
device updates only its shard: the update's sums (the clip's global norm over sharded leaves, and
the gradient reduction where XLA turns it into a reduce-scatter) run in another order, so parameters
agree to rounding (ZERO1_ATOL = 1e-6 after 3 AdamW steps), not bit for bit. Offload changes where
the moments live, not one operation: bit for bit.
"""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import build, random_batches, tiny_config, train_steps
from meshlm.checkpoint import Checkpointer
from meshlm.config import CheckpointConfig, ParallelConfig, RunConfig
from meshlm.model.params import named_leaves
from meshlm.step import batch_sharding, make_train_step
from meshlm.train_state import abstract_state, placement
from meshlm.validation import validate

ZERO1_ATOL = 1e-6


def _with(cfg: RunConfig, shard: bool = False, offload: bool = False) -> RunConfig:
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, shard_optimizer=shard),
        optim=dataclasses.replace(cfg.optim, offload_state=offload),
    )


LAYOUTS = {
    "data=4 x tensor=2": dict(mesh=dict(data=4, tensor=2)),
    "context=2 x data=2 x tensor=2 + SP": dict(
        mesh=dict(context=2, data=2, tensor=2, sequence_parallel=True), attention="blockwise", block=8
    ),
    "stage=2 x data=2 x tensor=2": dict(mesh=dict(stage=2, data=2, tensor=2), microbatches=2),
}


def _config(name: str) -> RunConfig:
    spec = LAYOUTS[name]
    cfg = tiny_config("gpt", steps=3, microbatches=spec.get("microbatches", 1))
    model = cfg.model
    if "attention" in spec:
        model = dataclasses.replace(model, attention=spec["attention"], attention_block=spec["block"])
    return validate(dataclasses.replace(cfg, model=model, parallel=ParallelConfig(**spec["mesh"])))


@pytest.fixture(scope="module")
def runs():
    """{(layout, shard, offload): (final state, losses, compiled step, layout)}, 3 AdamW steps each."""
    out = {}
    for name in LAYOUTS:
        cfg = _config(name)
        batches = random_batches(cfg, 3)
        variants = [(False, False), (True, False)] + (
            [(False, True), (True, True)] if name == "data=4 x tensor=2" else []
        )
        for shard, offload in variants:
            out[name, shard, offload] = train_steps(_with(cfg, shard, offload), batches)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero1_trains_like_the_plain_run(runs, name, devices):
    plain, plain_losses, *_ = runs[name, False, False]
    zero, zero_losses, *_ = runs[name, True, False]
    np.testing.assert_allclose(zero_losses, plain_losses, rtol=1e-6)
    want, got = named_leaves(jax.device_get(plain.params)), named_leaves(jax.device_get(zero.params))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=ZERO1_ATOL, err_msg=k)
    assert int(zero.step) == 3


def test_offloaded_optimizer_state_trains_bit_for_bit_from_host_memory(runs, devices):
    plain, plain_losses, *_ = runs["data=4 x tensor=2", False, False]
    off, off_losses, *_ = runs["data=4 x tensor=2", False, True]
    both, _, *_ = runs["data=4 x tensor=2", True, True]
    assert off_losses == plain_losses
    for a, b in zip(jax.tree.leaves(off.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(off.opt_state), jax.tree.leaves(plain.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adam = lambda s: s.opt_state[1][0]  # clip_by_global_norm, then adamw's ScaleByAdamState
    for state in (off, both):
        for leaf in jax.tree.leaves((adam(state).mu, adam(state).nu)):
            assert leaf.sharding.memory_kind == "pinned_host"
        assert adam(state).count.sharding.memory_kind == "device"  # the step count stays on the device
        assert all(p.sharding.memory_kind == "device" for p in jax.tree.leaves(state.params))


def _axes(spec) -> set[str]:
    return {a for part in spec for a in ((part,) if isinstance(part, str) else (part or ()))}


def test_optimizer_state_bytes_per_device_are_the_total_over_its_axes(runs, devices):
    """Each moment leaf's bytes on a device = its bytes / the product of the mesh axes it is
    sharded over; under ZeRO-1 on data=4 x tensor=2 every moment leaf divisible by 4 is sharded over
    `data` too, so the moments per device are a quarter of the plain run's but for those that are not."""
    mesh_shape = runs["data=4 x tensor=2", False, False][3].mesh.shape
    per_device = {}
    for shard in (False, True):
        state = runs["data=4 x tensor=2", shard, False][0]
        adam = state.opt_state[1][0]
        total = 0
        for leaf in jax.tree.leaves((adam.mu, adam.nu)):
            axes = _axes(leaf.sharding.spec)
            assert leaf.addressable_shards[0].data.nbytes * np.prod([mesh_shape[a] for a in axes]) == leaf.nbytes
            if shard and leaf.shape and max(leaf.shape) % 4 == 0 and leaf.size % 8 == 0:
                assert "data" in axes, (leaf.shape, leaf.sharding.spec)
            if not shard:
                assert "data" not in axes
            total += leaf.addressable_shards[0].data.nbytes
        per_device[shard] = total
    assert per_device[True] * 4 <= per_device[False] * 1.05  # a quarter, up to the few that do not divide
    # the planner's figure (8 bytes of fp32 moments per element it counts) is the arrays' own
    from meshlm.insight import plan

    assert per_device[True] == 8 * plan.zero1_params(_with(_config("data=4 x tensor=2"), shard=True))
    # with context: the moments of every leaf with a dimension divisible by data x context = 4 are
    # split over both, and a leaf's bytes per device are its bytes / the product of its axes
    name = "context=2 x data=2 x tensor=2 + SP"
    state, layout = runs[name, True, False][0], runs[name, True, False][3]
    adam = state.opt_state[1][0]
    both = 0
    for leaf in jax.tree.leaves((adam.mu, adam.nu)):
        axes = _axes(leaf.sharding.spec)
        assert leaf.addressable_shards[0].data.nbytes * np.prod([layout.mesh.shape[a] for a in axes]) == leaf.nbytes
        if any(d % 4 == 0 for d in leaf.shape):  # (tensor already splits some of them: a dimension is left)
            both += {"data", "context"} <= axes
    assert both >= len(jax.tree.leaves(adam.mu))  # most leaves, in mu and nu


def _groups_over(layout, axis: str) -> set[frozenset]:
    """The device-id groups a collective over one mesh axis uses (one group per other coordinate)."""
    ids = np.vectorize(lambda d: d.id)(layout.mesh.devices)
    moved = np.moveaxis(ids, layout.mesh.axis_names.index(axis), -1)
    return {frozenset(int(i) for i in g) for g in moved.reshape(-1, layout.mesh.shape[axis])}


def test_zero1_compiled_step_gathers_weights_over_data_and_holds_less(runs, devices):
    """ZeRO-1's compiled step all-gathers the updated weights over `data` (replica groups = the data
    groups of the mesh; the plain step gathers nothing over data: its weights are updated whole on
    every device), and its arguments (the state) are smaller by exactly the moments it shards."""
    from meshlm.insight import hlo

    text, arguments, moments = {}, {}, {}
    for shard in (False, True):
        state, _, step, layout = runs["data=4 x tensor=2", shard, False]
        batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(layout))
            for k, v in random_batches(_config("data=4 x tensor=2"), 1)[0].items()
        }
        compiled = step.lower(state, batch).compile()
        text[shard], arguments[shard] = compiled.as_text(), compiled.memory_analysis().argument_size_in_bytes
        adam = state.opt_state[1][0]
        moments[shard] = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((adam.mu, adam.nu)))
    data = _groups_over(layout, "data")
    over_data = lambda t: sum(
        {frozenset(g) for g in groups} == data for groups in hlo.collective_groups(t, "all-gather")
    )
    assert over_data(text[False]) == 0 and over_data(text[True]) >= 1
    assert arguments[False] - arguments[True] == moments[False] - moments[True] > 0


def test_a_checkpoint_resumes_across_zero1_and_offload(runs, tmp_path, devices):
    """Saved with ZeRO-1 and offload, restored plain and back (and saved plain, restored with both):
    the same values, on the target's shardings and memory kinds, and the next step from the restored
    state gives the same loss and, to ZERO1_ATOL, the same parameters - checkpoints do not depend on
    where the moments lived."""
    cfg = _config("data=4 x tensor=2")
    batch = random_batches(cfg, 4, seed=1)[3]
    for source in ((True, True), (False, False)):
        saved = runs["data=4 x tensor=2", *source][0]
        ckpt = Checkpointer(tmp_path / f"c{source}", CheckpointConfig(async_save=False))
        ckpt.save(saved, {"code_version": "test"})
        after = []
        for target in (_with(cfg), _with(cfg, True, True)):
            layout, specs, tx, shardings, _ = build(target)
            restored = ckpt.restore_latest(abstract_state(specs, layout, tx, **placement(target))).state
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            kinds = {x.sharding.memory_kind for x in jax.tree.leaves(restored.opt_state[1][0].mu)}
            assert kinds == {"pinned_host" if target.optim.offload_state else "device"}
            new, metrics = make_train_step(target, layout, tx, shardings)(restored, batch)
            after.append((float(metrics["loss"]), named_leaves(jax.device_get(new.params))))
        ckpt.close()
        assert after[0][0] == after[1][0]
        for k, want in after[0][1].items():
            np.testing.assert_allclose(after[1][1][k], want, rtol=0, atol=ZERO1_ATOL, err_msg=k)
