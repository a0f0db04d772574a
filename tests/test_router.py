"""DeepSeek-V3's routing (docs/moe.md): sigmoid scores, a per-expert bias for the choice only moved
by the sign of the load error after each step, group-limited top-k, the routed scaling factor and
the sequence-wise balance loss - against `transformers`' DeepseekV3TopkRouter and NumPy, and on an
expert-parallel layout against one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_batches, run_steps
from meshlm.config import ConfigError, apply_overrides
from meshlm.model import moe
from meshlm.model.params import init_params, named_leaves, param_specs
from meshlm.validation import validate
from test_moe import grads, moe_config

DEEPSEEK = dict(
    router_score="sigmoid",
    router_bias=True,
    router_bias_rate=0.01,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    moe_seq_aux_loss_coef=1e-3,
)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_choice_and_weights_equal_transformers_deepseek_v3_router(normalize):
    """16 experts in 4 groups, top-4 within the best 2 groups, a random bias: the chosen experts and
    their weights equal `DeepseekV3TopkRouter`'s on the same logits (its weight the identity, so
    the hidden states are the logits) and bias."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    E, k, T = 16, 4, 64
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(T, E)).astype(np.float32) * 2
    bias = rng.normal(size=E).astype(np.float32) * 0.3
    config = DeepseekV3Config(
        hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=4, topk_group=2, norm_topk_prob=normalize
    )
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, want_w, want_e = (t.numpy() for t in router(torch.from_numpy(logits)))
    w, e, probs = jax.device_get(
        moe.route(jnp.asarray(logits), k, normalize, score="sigmoid", bias=bias, n_group=4, topk_group=2, scale=2.5)
    )
    order, want_order = np.argsort(e, -1), np.argsort(want_e, -1)  # transformers' top-k is unsorted
    np.testing.assert_array_equal(np.take_along_axis(e, order, -1), np.take_along_axis(want_e, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(w, order, -1), np.take_along_axis(want_w, want_order, -1), rtol=1e-6)
    s = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(probs, s / s.sum(-1, keepdims=True), rtol=1e-6)
    # the groups and the bias decide: without them the choice differs on some tokens
    plain = jax.device_get(moe.route(jnp.asarray(logits), k, normalize, score="sigmoid")[1])
    assert (np.sort(plain, -1) != np.take_along_axis(e, order, -1)).any(axis=-1).sum() > T // 4


def test_bias_update_and_sequence_wise_loss_equal_numpy():
    """The bias moves by rate x sign(mean load - load), per layer, from exact counts (an expert at
    the mean does not move); it stays fp32 in a bf16 model; the sequence-wise loss is
    sum_e (E / (k T)) count_e x mean_t s_e / sum_j s_j per row, averaged over rows and layers."""
    from meshlm.model.transformer import cast_layer

    cfg = moe_config(**DEEPSEEK).model
    E, k, b, t, L = cfg.n_experts, cfg.experts_per_token, 3, 16, 2
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 50, size=(L, E)).astype(np.int32)
    counts[0] = [7, 7, 9, 5, 7, 7, 6, 8]  # mean 7: experts 0, 1, 4 and 5 stay put
    bias = rng.normal(size=(L, E)).astype(np.float32)
    got = moe.update_router_bias({"layers": {"router_bias": bias}}, jnp.asarray(counts), cfg)["layers"]["router_bias"]
    want = bias + 0.01 * np.sign(counts.mean(-1, keepdims=True) - counts)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert np.array_equal(np.asarray(got)[0, [0, 1, 4, 5]], bias[0, [0, 1, 4, 5]])
    kept = cast_layer({"router_bias": jnp.asarray(bias), "w_router": jnp.asarray(bias)}, jnp.bfloat16)
    assert kept["router_bias"].dtype == jnp.float32 and kept["w_router"].dtype == jnp.bfloat16

    per_layer = []
    seq_want = []
    for _ in range(L):
        logits = rng.normal(size=(b, t, E)).astype(np.float32)
        _, e, probs = jax.device_get(moe.route(jnp.asarray(logits), k, True, score="sigmoid", n_group=4, topk_group=2))
        counts = np.stack([(e == j).sum(axis=(1, 2)) for j in range(E)], -1).astype(np.float32)
        per_layer.append(moe.RouterStats(counts, probs.sum(1), np.zeros(b, np.float32), np.zeros(b, np.float32)))
        s = 1 / (1 + np.exp(-logits))
        p = (s / s.sum(-1, keepdims=True)).mean(1)  # [b, E]
        seq_want.append(np.sum(E / (k * t) * counts * p, axis=-1))  # [b]
    stacked = moe.RouterStats(*[np.stack(a) for a in zip(*per_layer, strict=True)])
    got = float(jax.device_get(moe.moe_losses(stacked, cfg))["moe_seq_aux_loss"])
    assert got == pytest.approx(float(np.mean(seq_want)), rel=1e-6)


def test_deepseek_routing_on_expert_parallel_layouts_equals_one_device():
    """Sigmoid + bias + groups + scaling + the sequence-wise loss, dropless: raw gradients on
    expert=4 x data=2 equal one device's (no gradient reaches the bias), and after two train steps
    the moved bias is bit for bit one device's, with the layout's batch in 2 microbatches too (the
    bias moves by the whole step's exact assignment counts)."""
    from test_gradients import assert_same_grads

    one = moe_config(**DEEPSEEK)
    params = init_params(param_specs(one.model), jax.random.key(0))
    # a bias that decides choices (a fresh one is zero)
    bias = 0.2 * jax.random.normal(jax.random.key(5), params["layers"]["router_bias"].shape)
    params = jax.device_get(params | {"layers": params["layers"] | {"router_bias": bias}})
    cfg = validate(dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, expert=4, data=2)))
    got, ref = grads(cfg, params), grads(one, params)
    assert_same_grads(got, ref)
    assert not np.any(named_leaves(ref["grads"])["layers/router_bias"])
    for key in ("moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-6)

    batches = random_batches(one, 2, seed=7)
    accumulated = dataclasses.replace(  # 4 batch shards: 2 microbatches of 4 rows
        cfg, parallel=dataclasses.replace(cfg.parallel, data=1), train=dataclasses.replace(cfg.train, microbatches=2)
    )
    biases = [run_steps(c, batches)[1]["layers"]["router_bias"] for c in (one, accumulated)]
    np.testing.assert_array_equal(biases[0], biases[1])
    steps = biases[0] / 0.01  # from zero, two moves of +-0.01 (or none) per expert
    assert np.allclose(steps, np.round(steps), atol=1e-4) and np.any(np.abs(steps) > 1.5)


def test_router_options_are_checked():
    cfg = moe_config()
    bad = lambda *sets: validate(apply_overrides(cfg, ["model.router_score=sigmoid", *sets]))
    with pytest.raises(ConfigError, match="n_group=3 must divide"):
        bad("model.n_group=3")
    with pytest.raises(ConfigError, match="more than the 2 experts"):
        bad("model.n_group=4", "model.topk_group=1", "model.experts_per_token=3")
    with pytest.raises(ConfigError, match=r"needs model\.router_bias"):
        bad("model.router_bias_rate=0.001")
    with pytest.raises(ConfigError, match=r"set model\.router_score=sigmoid"):
        bad("model.router_bias=true", "model.router_score=softmax")
    with pytest.raises(ConfigError, match="but the model is dense"):
        validate(apply_overrides(cfg, ["model.n_experts=0", "model.router_score=sigmoid"]))
    with pytest.raises(ConfigError, match="router_bias_rate with LoRA"):
        bad("model.router_bias=true", "model.router_bias_rate=0.001", "model.lora_rank=4")
