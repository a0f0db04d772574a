"""The train step: gradient accumulation, non-finite protection, remat equivalence, determinism."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MESHES, build, random_batches, run_steps, tiny_config
from meshlm.config import OptimConfig, RematConfig
from meshlm.model.loss import cross_entropy_sum
from meshlm.model.transformer import forward
from meshlm.parallel import remat
from meshlm.step import make_train_step


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_gradient_accumulation_equals_whole_batch(family, devices):
    cfg1 = tiny_config(family, MESHES["data2_tensor4"], microbatches=1)
    cfg1 = dataclasses.replace(cfg1, model=dataclasses.replace(cfg1.model, dropout=0.0))
    cfg4 = dataclasses.replace(cfg1, train=dataclasses.replace(cfg1.train, microbatches=4))
    batches = random_batches(cfg1, 3)
    l1, p1, _ = run_steps(cfg1, batches)
    l4, p4, _ = run_steps(cfg4, batches)
    np.testing.assert_allclose(l4, l1, rtol=1e-6)
    # Parameters are O(0.02-1); Adam turns summation-order noise on ~0 gradients into ~1e-7 steps.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p4, p1)


def test_non_finite_step_leaves_state_untouched(devices):
    cfg = tiny_config("gpt", MESHES["fsdp8"])
    layout, _, tx, shardings, state = build(cfg)
    before = jax.tree.map(np.array, state.params)  # writable host copies
    step = make_train_step(cfg, layout, tx, shardings)
    batch = random_batches(cfg, 1)[0]
    # Poison one weight: the loss becomes NaN, the update must not be applied.
    params = dict(state.params, wte=state.params["wte"].at[0, 0].set(jnp.nan))
    state = state._replace(params=params)
    before["wte"][0, 0] = np.nan
    new, metrics = step(state, batch)
    assert not bool(metrics["finite"]) and np.isnan(float(metrics["loss"]))
    assert int(new.step) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), new.params, before)


@pytest.mark.parametrize("policy", [p for p in remat.POLICIES if p != "none"])
def test_every_remat_policy_gives_the_same_gradients(policy, devices):
    cfg = tiny_config("gpt")  # dropout on: recomputation must replay the same masks
    layout, _, _, _, state = build(cfg)
    batch = {k: jnp.asarray(v) for k, v in random_batches(cfg, 1)[0].items()}
    key = jax.random.key(7)

    def loss(params, pol):
        logits = forward(params, batch["inputs"], cfg.model, layout, key=key, remat_policy=pol)
        total, count = cross_entropy_sum(logits, batch["targets"])
        return total / count

    ref = jax.jit(jax.grad(lambda p: loss(p, "none")))(state.params)
    got = jax.jit(jax.grad(lambda p: loss(p, policy)))(state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, ref)


def test_dropout_key_depends_on_step_only(devices):
    """Same (seed, step) -> same update; the next step draws different dropout bits."""
    cfg = tiny_config("gpt", MESHES["data8"])
    batch = random_batches(cfg, 1)[0]
    la, pa, _ = run_steps(cfg, [batch, batch])
    lb, pb, _ = run_steps(cfg, [batch, batch])
    assert la == lb
    jax.tree.map(np.testing.assert_array_equal, pa, pb)
    no_dropout = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0))
    lc, _, _ = run_steps(no_dropout, [batch])
    assert lc[0] != la[0]  # dropout really is on in the train step


def test_bfloat16_training_learns(devices):
    cfg = tiny_config("llama", MESHES["fsdp2_tensor4"], steps=8)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"), optim=OptimConfig(lr=1e-2, warmup_steps=0)
    )
    batch = random_batches(cfg, 1)[0]
    losses, params, _ = run_steps(cfg, [batch] * 8)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5  # memorises the batch
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params))  # fp32 master weights


def test_remat_config_is_used_by_step(devices):
    cfg = tiny_config("gpt")
    full = dataclasses.replace(cfg, remat=RematConfig(policy="full"))
    batch = random_batches(cfg, 2)
    l_none, _, _ = run_steps(cfg, batch)
    l_full, _, _ = run_steps(full, batch)
    np.testing.assert_allclose(l_full, l_none, rtol=1e-6)
