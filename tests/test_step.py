"""The train step: determinism of dropout keys, bf16 training with fp32 masters. (Gradients across
layouts, remat and accumulation: test_gradients.py; non-finite steps: test_nonfinite.py.)"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MESHES, random_batches, run_steps, tiny_config
from meshlm.config import OptimConfig
from meshlm.model.loss import cross_entropy_sum
from meshlm.model.params import init_params, param_specs
from meshlm.model.transformer import forward, run_layers
from meshlm.step import make_train_step


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


def test_program_size_is_flat_in_depth_unless_unrolled(devices):
    """Compile time follows program size: with the layer scan, 2 or 8 layers lower to the same
    program (up to the stacked shapes in it); model.scan_unroll=n_layers copies the layer n times."""
    from meshlm.parallel.mesh import make_layout
    from meshlm.step import abstract_batch
    from meshlm.train_state import abstract_state, placement, setup

    def program_chars(n_layers: int, unroll: int) -> int:
        cfg = tiny_config("llama")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers, scan_unroll=unroll))
        layout = make_layout(cfg.parallel, jax.devices()[:1])
        specs, tx, shardings = setup(cfg, layout)
        lowered = make_train_step(cfg, layout, tx, shardings).lower(
            abstract_state(specs, layout, tx, **placement(cfg)), abstract_batch(cfg, layout)
        )
        return len(lowered.as_text(debug_info=False))

    scanned2, scanned8 = program_chars(2, 1), program_chars(8, 1)
    assert abs(scanned8 - scanned2) < 0.01 * scanned2
    assert program_chars(8, 8) > 2 * scanned8  # no loop: 8 calls of the layer


@pytest.mark.parametrize(("family", "policy"), [("gpt", "elementwise"), ("llama", "elementwise"), ("gpt", "full")])
def test_unrolled_layers_are_the_scanned_layers(family, policy):
    """model.scan_unroll = n_layers runs no loop: the layers are calls on the stacked weights split
    along the layer axis (no scan in the program, no stacked residual buffers), with the same loss and
    raw gradients as the layer scan, dropout included (layer j draws from fold_in(key, j) either
    way), under a per-layer checkpoint too (remat `full`)."""
    cfg = tiny_config(family, n_layers=3).model
    params = init_params(param_specs(cfg), jax.random.key(0))
    tokens = random_batches(tiny_config(family), 1)[0]
    key = jax.random.key(7) if cfg.dropout else None

    def loss_fn(unroll: int):
        m = dataclasses.replace(cfg, scan_unroll=unroll)
        return lambda p: cross_entropy_sum(
            forward(p, tokens["inputs"], m, key=key, remat_policy=policy), tokens["targets"]
        )[0]

    scans = lambda unroll: str(jax.make_jaxpr(loss_fn(unroll))(params)).count(" scan[")
    assert scans(1) == 1 and scans(2) == 1 and scans(cfg.n_layers) == 0
    # the chained gradient of each stacked weight is one concatenate of the layers' parts, not a sum
    # of zero-padded copies of the whole stack (what static slices of the stack would give)
    grad_ops = str(jax.make_jaxpr(jax.grad(loss_fn(cfg.n_layers)))(params))
    stacked = lambda op: len(re.findall(rf":f32\[{cfg.n_layers},[\d,]*\] = {op}\[", grad_ops))
    assert stacked("pad") == 0 and stacked("concatenate") == len(jax.tree.leaves(params["layers"]))
    (scanned, g_scan), (chained, g_chain) = (jax.jit(jax.value_and_grad(loss_fn(u)))(params) for u in (1, 3))
    np.testing.assert_allclose(chained, scanned, rtol=1e-6)
    # fp32 rounding is relative to a leaf's scale (the GEMMs' summation order differs between the two
    # programs and between CPUs): elements near zero get an absolute slack of 1e-6 of the leaf's
    # largest element, which an AVX-512 host needs (3e-7 on a leaf whose largest is above 0.7). A leaf
    # whose gradient is zero but for rounding (gpt's key bias: q . b_k adds one constant to a row of
    # scores, which softmax ignores) has no scale of its own: both must be noise at the gradients' scale.
    scale = max(float(np.abs(b).max()) for b in jax.tree.leaves(g_scan))
    for a, b in zip(jax.tree.leaves(g_chain), jax.tree.leaves(g_scan), strict=True):
        if float(np.abs(b).max()) < 1e-6 * scale:
            assert float(np.abs(a).max()) < 1e-6 * scale
            continue
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


@pytest.mark.parametrize(("n", "unroll"), [(1, 1), (2, 1), (2, 2)])
def test_pipeline_chunk_keeps_its_weights_as_residuals(n, unroll):
    """A pipeline chunk's layers (`run_layers` without `chain`, whatever model.scan_unroll says;
    one layer per chunk under interleaved 1F1B) keep the chunk's weight arrays themselves among
    their backward's residuals, which the pipeline recognises and does not stash. Chained, the
    residuals would be slices: copies of the weights, stashed per microbatch."""
    cfg = dataclasses.replace(tiny_config("llama").model, scan_unroll=unroll)
    w = jax.tree.map(lambda a: a[:n], init_params(param_specs(cfg), jax.random.key(0))["layers"])
    x = jax.random.normal(jax.random.key(1), (2, 32, cfg.d_model))

    def weights_kept(chain: bool) -> int:
        _, vjp_fn = jax.vjp(lambda w, x: run_layers(x, w, jnp.arange(n), cfg, chain=chain), w, x)
        residuals = jax.tree.leaves(vjp_fn)
        return sum(any(r is leaf for r in residuals) for leaf in jax.tree.leaves(w))

    assert weights_kept(chain=False) == len(jax.tree.leaves(w))
    assert weights_kept(chain=True) == 0


def test_warmup_starts_at_lr_over_warmup_and_the_cosine_ends_at_the_minimum():
    """Update k's learning rate: lr (k+1)/w during the warmup, so the first update is not wasted at
    lr 0 (Megatron's schedule), then a cosine from lr to min_lr_ratio * lr at the last update."""
    import math

    from meshlm.config import OptimConfig
    from meshlm.optim import lr_schedule

    lr = [float(lr_schedule(OptimConfig(lr=2.0, warmup_steps=4, min_lr_ratio=0.1), 10)(k)) for k in range(12)]
    np.testing.assert_allclose(lr[:4], [0.5, 1.0, 1.5, 2.0], rtol=1e-6)
    cosine = [0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * (k + 1 - 4) / 6)) for k in range(4, 10)]
    np.testing.assert_allclose(lr[4:10], cosine, rtol=1e-6)
    assert lr[9] == pytest.approx(0.2) and lr[10] == lr[11] == pytest.approx(0.2)  # held after the last
    no_warmup = lr_schedule(OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.1), 4)
    assert float(no_warmup(0)) == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi / 4)), rel=1e-6)
