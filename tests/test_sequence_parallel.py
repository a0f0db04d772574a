"""Sequence parallelism (P2 4.2.2): same numbers as without it, the paper's collectives in the
compiled program, and dropout bits that differ per shard and replay exactly under recomputation."""

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from meshlm import axes as ax
from meshlm.config import ConfigError, ModelConfig, ParallelConfig
from meshlm.insight import hlo
from meshlm.model import layers
from meshlm.model.loss import cross_entropy_sum
from meshlm.model.params import abstract_params, param_specs
from meshlm.model.transformer import RESIDUAL, forward, gpt_block, llama_block
from meshlm.parallel import remat
from meshlm.parallel.mesh import make_layout
from meshlm.train_state import param_shardings
from meshlm.validation import validate


def _sp(cfg, on=True):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=on))


# SP and every remat policy under SP give the one-device gradients: tests/test_gradients.py.


@pytest.mark.parametrize("block", [gpt_block, llama_block])
def test_layer_collectives_are_the_papers(block, devices):
    """One layer, forward + backward, tensor=4: TP does 4 all-reduces of activations (f-bar twice
    forward, f twice backward); TP+SP does none, with all-gathers and reduce-scatters instead."""
    family = "gpt" if block is gpt_block else "llama"
    model = ModelConfig(
        family=family, vocab_size=256, d_model=64, n_layers=1, n_heads=4, max_seq_len=32, dtype="bfloat16"
    )
    specs = param_specs(model)
    p_abs = abstract_params(specs)["layers"]
    x_abs = jax.ShapeDtypeStruct((4, 32, 64), jnp.bfloat16)
    counts = {}
    for sp in (False, True):
        layout = make_layout(ParallelConfig(data=2, tensor=4, sequence_parallel=sp))

        def loss(x, p, layout=layout):
            p = jax.tree.map(lambda w: w[0].astype(jnp.bfloat16), p)
            return jnp.sum(block(x, p, None, model, layout, "elementwise")[0].astype(jnp.float32) ** 2)

        in_sh = (layout.sharding(RESIDUAL), param_shardings(specs, layout)["layers"])
        fn = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=in_sh)
        counts[sp] = hlo.collectives(fn.lower(x_abs, p_abs).compile().as_text(), batch_rows=2)
    # Megatron's pattern exactly: TP = 4 all-reduces; TP+SP = 4 all-gathers + 4 reduce-scatters.
    # (With forward and backward in one unscanned program XLA keeps the forward gathers alive
    # rather than re-gathering; the scanned model below does re-gather.)
    assert counts[False] == Counter({"all-reduce": 4}), counts[False]
    assert counts[True] == Counter({"all-gather": 4, "reduce-scatter": 4}), counts[True]


def test_whole_model_sp_has_no_activation_all_reduce_and_regathers_in_backward(devices):
    model = ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, max_seq_len=32, dtype="bfloat16")
    specs = param_specs(model)
    counts = {}
    for sp in (False, True):
        layout = make_layout(ParallelConfig(data=2, tensor=4, sequence_parallel=sp))

        def loss(p, t, layout=layout):
            return cross_entropy_sum(forward(p, t, model, layout), t)[0]

        in_sh = (param_shardings(specs, layout), layout.sharding((ax.BATCH, None)))
        lowered = jax.jit(jax.grad(loss), in_shardings=in_sh).lower(
            abstract_params(specs), jax.ShapeDtypeStruct((4, 32), jnp.int32)
        )
        counts[sp] = hlo.collectives(lowered.compile().as_text(), batch_rows=2)
    # TP: 4 per layer (the scanned body appears once) + embedding forward + output layer backward.
    assert counts[False] == Counter({"all-reduce": 6}), counts[False]
    # SP, per layer: 2 gathers (g), 2 conjugates of g-bar, 2 backward re-gathers of the saved shards;
    # plus the output layer's g and the embedding's backward. Reduce-scatters: 4 per layer, the
    # embedding (vocabulary-parallel lookup scattered to the SP region) and the output layer's backward.
    assert counts[True] == Counter({"all-gather": 8, "reduce-scatter": 6}), counts[True]


def test_sp_dropout_bits_differ_per_shard_and_match_unsharded(devices):
    layout = make_layout(ParallelConfig(tensor=4, sequence_parallel=True))
    sharding = layout.sharding(RESIDUAL)
    x = jnp.ones((2, 32, 16), jnp.float32)
    key = jax.random.key(5)
    sharded = jax.jit(lambda x: layers.dropout(x, 0.5, key), in_shardings=sharding, out_shardings=sharding)(x)
    plain = jax.jit(lambda x: layers.dropout(x, 0.5, key))(x)
    assert len(sharded.addressable_shards) == 4
    shards = [np.asarray(s.data) for s in sorted(sharded.addressable_shards, key=lambda s: s.index[1].start)]
    assert all(s.shape == (2, 8, 16) for s in shards)
    for i in range(1, 4):
        assert not np.array_equal(shards[0], shards[i])  # not one key reused on every shard
    np.testing.assert_array_equal(np.concatenate(shards, axis=1), np.asarray(plain))  # layout-invariant


def test_sp_config_checks():
    cfg = tiny_config("gpt")
    with pytest.raises(ConfigError, match="sequence_parallel needs a tensor axis > 1"):
        validate(_sp(cfg))
    bad = dataclasses.replace(_sp(cfg), parallel=ParallelConfig(tensor=4, sequence_parallel=True))
    bad = dataclasses.replace(bad, train=dataclasses.replace(bad.train, seq_len=30))
    with pytest.raises(ConfigError, match=r"train.seq_len=30 is not divisible by mesh axis 'tensor'"):
        validate(bad)


def test_layer_wrapping_is_identity_for_policies_without_a_layer_rule():
    f = lambda x: x
    assert remat.wrap_layer(f, "elementwise") is f and remat.wrap_layer(f, "selective") is f
    assert remat.wrap_layer(f, "full") is not f
