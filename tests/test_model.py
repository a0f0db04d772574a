"""The model against real reference implementations (Hugging Face transformers on PyTorch CPU),
and the parameter count against the initialised leaves."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import accounting, recipes
from meshlm.config import ModelConfig
from meshlm.model.params import count_params, init_params, param_specs
from meshlm.model.transformer import forward

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _params(cfg: ModelConfig, seed: int = 0) -> dict:
    # Random non-trivial values everywhere (norms and biases too), so every weight's mapping matters.
    specs = param_specs(cfg)
    params = init_params(specs, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.map(np.asarray, jax.tree.unflatten(treedef, leaves))


def _t(x: np.ndarray) -> "torch.Tensor":
    return torch.from_numpy(np.array(x, dtype=np.float32))  # a writable copy


def _gpt2_state_dict(p: dict, cfg: ModelConfig) -> dict:
    d = cfg.d_model
    sd = {"transformer.wte.weight": p["wte"], "transformer.wpe.weight": p["wpe"], "lm_head.weight": p["wte"]}
    sd |= {"transformer.ln_f.weight": p["ln_f_scale"], "transformer.ln_f.bias": p["ln_f_bias"]}
    lp = p["layers"]
    for i in range(cfg.n_layers):
        pre = f"transformer.h.{i}."
        qkv_w = [lp[n][i].reshape(d, -1) for n in ("wq", "wk", "wv")]
        qkv_b = [lp[n][i].reshape(-1) for n in ("bq", "bk", "bv")]
        sd |= {
            pre + "ln_1.weight": lp["ln1_scale"][i],
            pre + "ln_1.bias": lp["ln1_bias"][i],
            pre + "attn.c_attn.weight": np.concatenate(qkv_w, axis=1),  # Conv1D: y = x @ W
            pre + "attn.c_attn.bias": np.concatenate(qkv_b),
            pre + "attn.c_proj.weight": lp["wo"][i].reshape(-1, d),
            pre + "attn.c_proj.bias": lp["bo"][i],
            pre + "ln_2.weight": lp["ln2_scale"][i],
            pre + "ln_2.bias": lp["ln2_bias"][i],
            pre + "mlp.c_fc.weight": lp["w_fc"][i],
            pre + "mlp.c_fc.bias": lp["b_fc"][i],
            pre + "mlp.c_proj.weight": lp["w_proj"][i],
            pre + "mlp.c_proj.bias": lp["b_proj"][i],
        }
    return {k: _t(v) for k, v in sd.items()}


def _llama_state_dict(p: dict, cfg: ModelConfig) -> dict:
    d = cfg.d_model
    sd = {"model.embed_tokens.weight": p["wte"], "model.norm.weight": p["final_norm"]}
    if not cfg.tied_embeddings:
        sd["lm_head.weight"] = p["lm_head"].T  # torch Linear: y = x @ W.T
    lp = p["layers"]
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        sd |= {
            pre + "input_layernorm.weight": lp["attn_norm"][i],
            pre + "post_attention_layernorm.weight": lp["mlp_norm"][i],
            pre + "self_attn.q_proj.weight": lp["wq"][i].reshape(d, -1).T,
            pre + "self_attn.k_proj.weight": lp["wk"][i].reshape(d, -1).T,
            pre + "self_attn.v_proj.weight": lp["wv"][i].reshape(d, -1).T,
            pre + "self_attn.o_proj.weight": lp["wo"][i].reshape(-1, d).T,
            pre + "mlp.gate_proj.weight": lp["w_gate"][i].T,
            pre + "mlp.up_proj.weight": lp["w_up"][i].T,
            pre + "mlp.down_proj.weight": lp["w_down"][i].T,
        }
    return {k: _t(v) for k, v in sd.items()}


def _reference_logits(model, state_dict: dict, tokens: np.ndarray) -> np.ndarray:
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # Only non-persistent buffers (e.g. causal-mask/rotary caches) and a tied output layer may be
    # absent from our dict.
    assert not unexpected, unexpected
    tied = model.config.tie_word_embeddings
    assert all(
        "rotary" in k or "attn.bias" in k or "masked_bias" in k or (tied and k == "lm_head.weight") for k in missing
    )
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _tokens(cfg: ModelConfig, b: int = 2, t: int = 24) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t)).astype(np.int32)


def test_gpt_matches_huggingface_gpt2():
    cfg = ModelConfig(family="gpt", vocab_size=96, d_model=64, n_layers=3, n_heads=4, max_seq_len=32)
    params, tokens = _params(cfg), _tokens(cfg)
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=cfg.norm_eps,
        tie_word_embeddings=True,
    )
    want = _reference_logits(transformers.GPT2LMHeadModel(hf_cfg), _gpt2_state_dict(params, cfg), tokens)
    got = np.asarray(forward(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens), cfg))
    assert got.dtype == np.float32 and got.shape == (2, 24, cfg.vocab_size)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def _hf_llama_config(cfg: ModelConfig) -> "transformers.LlamaConfig":
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_len,
        }
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.dim_head,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=64,
        rope_scaling=scaling,
        tie_word_embeddings=cfg.tied_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )


LLAMA_SMALL = ModelConfig(family="llama", vocab_size=96, d_model=64, n_layers=3, n_heads=8, n_kv_heads=2, d_ff=96)
# Llama 3 RoPE scaling and tied embeddings (Llama-3.2-1B's features) at test size: with head_dim 8
# and original_len 32, the four frequencies fall in all three regimes (stretched, blended, kept).
LLAMA3_SMALL = dataclasses.replace(
    LLAMA_SMALL,
    rope_theta=50.0,
    rope_scaling="llama3",
    rope_factor=4.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_len=32,
    tie_embeddings=True,
)


@pytest.mark.parametrize("cfg", [LLAMA_SMALL, LLAMA3_SMALL], ids=["gqa", "gqa-llama3-rope-tied"])
def test_llama_matches_huggingface_llama(cfg):
    params, tokens = _params(cfg), _tokens(cfg)
    want = _reference_logits(
        transformers.LlamaForCausalLM(_hf_llama_config(cfg)), _llama_state_dict(params, cfg), tokens
    )
    got = np.asarray(forward(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens), cfg))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    if cfg.rope_scaling == "llama3":  # the scaling really changes the model at these positions
        plain = forward(
            jax.tree.map(jnp.asarray, params), jnp.asarray(tokens), dataclasses.replace(cfg, rope_scaling="none")
        )
        assert np.max(np.abs(np.asarray(plain) - want)) > 100 * 2e-4


def test_llama3_frequencies_fall_in_every_regime():
    from meshlm.model.layers import rope_inv_freq

    c = LLAMA3_SMALL
    plain = np.asarray(rope_inv_freq(c.dim_head, c.rope_theta))
    scaled = np.asarray(rope_inv_freq(c.dim_head, c.rope_theta, ("llama3", 4.0, 1.0, 4.0, 32)))
    ratio = scaled / plain
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(0.25) and 0.25 < ratio[1] < 1.0, ratio


def test_bf16_compute_stays_within_its_rounding_of_fp32():
    """bf16 keeps 8 significant bits: unit roundoff u = 2^-8. The residual stream is rounded to bf16
    after each of a layer's two sublayers, and the embedding, the final norm and the head's input once
    each (about 4 more): at worst these relative errors add, so the logits stay within (4 + 2L) u of
    fp32 in norm (measured: 0.012 for L = 2, against a bound of 0.031). The old bound, 15% of the
    largest logit, let through a 5% error in the final norm's scale; this one does not."""
    cfg = ModelConfig(family="llama", vocab_size=96, d_model=64, n_layers=2, n_heads=4)
    params, tokens = jax.tree.map(jnp.asarray, _params(cfg)), jnp.asarray(_tokens(cfg))
    bound = (4 + 2 * cfg.n_layers) * 2.0**-8
    ref = forward(params, tokens, cfg)
    error = lambda out: float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    bf = forward(params, tokens, bf16)
    assert bf.dtype == jnp.float32  # logits are fp32 whatever the compute dtype
    assert error(bf) < bound
    assert error(bf) > 1e-3  # it really ran in bf16
    off = params | {"final_norm": params["final_norm"] * 1.05}  # a bug the old bound passed
    buggy = forward(off, tokens, bf16)
    assert float(jnp.max(jnp.abs(buggy - ref))) < 0.15 * float(jnp.max(jnp.abs(ref))) and error(buggy) > bound


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_param_count_formula_matches_initialised_leaves(name):
    cfg = recipes.get(name).model
    specs = param_specs(cfg)
    # the leaves the real initialiser produces (abstractly: no memory, even for 175B)
    leaves = jax.tree.leaves(jax.eval_shape(lambda: init_params(specs, jax.random.key(0))))
    assert accounting.param_count(cfg) == sum(x.size for x in leaves) == count_params(specs)


def test_paper_param_counts():
    # P2 Table 3 models: 22.1B and 174.6B parameters (notes 2.9, 12Lh^2(1 + 13/12h + (v+s)/12Lh)).
    assert round(accounting.param_count(recipes.get("gpt-22b").model) / 1e9, 1) == 22.1
    assert round(accounting.param_count(recipes.get("gpt-175b").model) / 1e9, 1) == 174.6
    # Llama-3.2-1B as published (Hugging Face's parameter count of meta-llama/Llama-3.2-1B)
    assert accounting.param_count(recipes.get("llama-1b").model) == 1_235_814_400


@pytest.mark.parametrize("unroll", [1, 2])  # the layer scan; the layers chained (no loop)
def test_rope_tables_are_constants_of_the_step(unroll, monkeypatch):
    """In training, RoPE's cos and sin tables are computed by XLA when the step is traced, once (the
    same two constants for q and k of every layer), and the compiled gradient evaluates no cos or
    sin at all. Computed in the program (as before), XLA:CPU fused them into every consumer of the
    rotated Q and K (each query chunk's slice of K, the backward's rotation) and evaluated them
    once per element there (BENCHMARKS-history.md, "RoPE's tables computed once"). Sequences longer than
    the constants' limit still compute them in the program. The gradients are the same bit for bit."""
    from helpers import random_batches, tiny_config
    from meshlm.model import layers
    from meshlm.model.loss import cross_entropy_sum

    cfg = dataclasses.replace(tiny_config("llama").model, scan_unroll=unroll)
    tokens = random_batches(tiny_config("llama"), 1)[0]
    params = init_params(param_specs(cfg), jax.random.key(0))
    loss = lambda p: cross_entropy_sum(forward(p, tokens["inputs"], cfg), tokens["targets"])[0]
    t, h = tokens["inputs"].shape[1], cfg.dim_head

    def grads_hlo_and_tables():
        lowered = jax.jit(jax.grad(loss)).lower(params)
        compiled = lowered.compile()
        tables = len(re.findall(rf"stablehlo.constant dense<.*> : tensor<1x{t}x1x{h}xf32>", lowered.as_text()))
        return compiled(params), compiled.as_text(), tables

    constants, hlo, tables = grads_hlo_and_tables()
    assert tables == 2  # cos and sin, shared by q, k and the layers
    assert not re.search(r"= f32\[[\d,]*\]\S* (?:sine|cosine)\(", hlo)

    # a sequence longer than the constants' limit: tables computed in the program (as all were before)
    monkeypatch.setattr(layers, "CONSTANT_ROPE_MAX", t * h - 1)
    traced, hlo, tables = grads_hlo_and_tables()
    assert tables == 0 and re.search(r"= f32\[[\d,]*\]\S* (?:sine|cosine)\(", hlo)
    for a, b in zip(jax.tree.leaves(constants), jax.tree.leaves(traced), strict=True):
        np.testing.assert_array_equal(a, b)


def test_rope_tables_made_inside_one_mesh_serve_every_step():
    """The cached tables are host arrays: made inside a shard_map (a pipeline stage), they serve it and
    a step traced later outside it. Cached as device arrays, made eagerly while that shard_map was
    traced, they carried a mesh of other axis types into it, and tracing failed ("Mesh for all inputs
    should be equal": the pipeline tests with sequence parallelism)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshlm.model import layers

    layers.constant_rope_tables.cache_clear()
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    x = jax.device_put(jnp.ones((4, 8, 1, 16)), NamedSharding(mesh, P("stage")))
    inside = jax.shard_map(
        lambda x: layers.rope(x, *layers.constant_rope_tables(8, 16, 10000.0)),
        mesh=mesh,
        in_specs=P("stage"),
        out_specs=P("stage"),
    )
    a = jax.jit(inside)(x)
    b = jax.jit(lambda x: layers.rope(x, *layers.constant_rope_tables(8, 16, 10000.0)))(x)
    assert layers.constant_rope_tables.cache_info().hits == 1
    np.testing.assert_array_equal(a, b)
