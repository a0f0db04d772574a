"""The train step: determinism of dropout keys, bf16 training with fp32 masters. (Gradients across
layouts, remat and accumulation: test_gradients.py; non-finite steps: test_nonfinite.py.)"""

import dataclasses

import jax
import numpy as np

from helpers import MESHES, random_batches, run_steps, tiny_config
from meshlm.config import OptimConfig


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
