"""DeepSeek-V3-class models: Multi-head Latent Attention (MLA) against a NumPy reference and on every
layout, decoding from the latent cache, multi-token prediction (MTP) against `transformers`' MtpModel
and a NumPy loss, and the accounting of both (docs/deepseek.md)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import DEEPSEEK_HF, loss_mask, random_batches
from meshlm import accounting, recipes
from meshlm.config import ConfigError, ModelConfig, ParallelConfig, RematConfig, RunConfig, TrainConfig
from meshlm.model import mla, mla_costs
from meshlm.model.lora import lora_param_count
from meshlm.model.params import count_params, init_params, named_leaves, param_specs
from meshlm.model.transformer import _attention, forward
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.rules import reorder_sequence
from meshlm.step import make_grad_step
from meshlm.train_state import state_shardings
from meshlm.validation import validate

RTOL = 1e-5
# MLA with a q LoRA, a query-key head of 8 + 4 and values of 6, YaRN; DeepSeek's MoE (a dense first
# layer, sigmoid routing over 2 groups with a bias, a shared expert); one MTP module
MODEL = ModelConfig(
    family="llama",
    vocab_size=64,
    d_model=32,
    n_layers=3,
    n_heads=4,
    d_ff=64,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_scaling="yarn",
    rope_factor=4.0,
    rope_original_len=8,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.7,
    n_experts=4,
    experts_per_token=2,
    expert_d_ff=16,
    n_shared_experts=1,
    first_k_dense=1,
    router_score="sigmoid",
    router_bias=True,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    moe_aux_loss_coef=0.0,
    mtp_depth=1,
    attention_chunk=8,
    attention_block=4,  # blockwise: 4 blocks of a row of 16, one context chunk's tokens under ring
)


def config(mesh: dict | None = None, sp: bool = False, policy: str = "elementwise", **model) -> RunConfig:
    par = ParallelConfig(sequence_parallel=sp, **(mesh or {}))
    train = TrainConfig(global_batch=8, seq_len=16, steps=3)
    model_cfg = dataclasses.replace(MODEL, **model)
    return validate(RunConfig(model=model_cfg, parallel=par, remat=RematConfig(policy), train=train))


def _perturbed(specs: dict) -> dict:
    """Parameters with norms and the router bias away from 1 and 0 (the bias then really chooses)."""
    p = init_params(specs, jax.random.key(0))
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.device_get(
        jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)])
    )


@pytest.fixture(scope="module")
def params():
    return _perturbed(param_specs(MODEL))


def grads(cfg: RunConfig, params: dict) -> dict:
    """Raw gradients at step 5 of a random loss-masked batch (context: in the layout's storage order)."""
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    batch = random_batches(cfg, 1, seed=3)[0] | {"mask": loss_mask((cfg.train.global_batch, cfg.train.seq_len))}
    if layout.context_size > 1:
        batch = {k: reorder_sequence(v, layout.context_order) for k, v in batch.items()}
    return jax.device_get(make_grad_step(cfg, layout, shardings)(jax.device_put(params, shardings), batch, 5))


@pytest.fixture(scope="module")
def reference(params):
    cache = {}

    def get(**model) -> dict:
        key = tuple(sorted(model.items()))
        if key not in cache:
            cache[key] = grads(config(**model), params)
        return cache[key]

    return get


def assert_same_as_one_device(got: dict, ref: dict) -> None:
    g, r = named_leaves(got["grads"]), named_leaves(ref["grads"])
    assert g.keys() == r.keys() and {"layers/wkv_a", "mtp/eh_proj", "mtp/wq_b"} <= g.keys()
    errors = {n: float(np.linalg.norm(g[n] - r[n]) / max(np.linalg.norm(r[n]), 1e-6)) for n in r}
    assert max(errors.values()) < RTOL, {n: e for n, e in errors.items() if e >= RTOL}
    for key in ("loss", "grad_norm", "mtp_loss"):
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, err_msg=key)
    np.testing.assert_allclose(got["expert_load"], ref["expert_load"], rtol=1e-6)


LAYOUTS = {  # name: (mesh, SP, policy, model changes)
    "tensor2+sp x expert2, dots": (dict(tensor=2, expert=2), True, "dots", {}),
    "fsdp2 x expert2": (dict(fsdp=2, expert=2), False, "elementwise", {}),
    "context2 ring x tensor2": (dict(context=2, tensor=2), False, "elementwise", dict(attention="blockwise")),
    "context2 all_to_all x tensor2": (dict(context=2, tensor=2, context_strategy="all_to_all"), False, "full", {}),
    "context2 all_gather x tensor2": (
        dict(context=2, tensor=2, context_strategy="all_gather"),
        False,
        "selective",
        dict(attention="blockwise"),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mla_mtp_moe_layouts_give_the_one_device_gradients(name, params, reference):
    """Every gradient leaf (MLA's down- and up-projections, the MoE layers, the MTP module), the loss,
    the gradient norm, the MTP loss and the expert load equal one device's: tensor parallelism over
    the heads with SP beside the expert axis, FSDP, both context strategies (the MTP targets shifted
    in the original order), the blockwise kernel (values padded) and four remat policies."""
    mesh, sp, policy, model = LAYOUTS[name]
    assert_same_as_one_device(grads(config(mesh, sp, policy, **model), params), reference(**model))


# a dense first layer (run on stage 0 with the embedding), 5 MoE layers split unevenly over the stages
# (zb1: 2 + 3; interleaved: 1, 1, 2, 1 - pad slots in chunks 0, 1 and 3) and an MTP module (with
# the loss on the last chunk), DeepSeek-V3's router with both balance losses on
PIPELINED = dict(first_k_dense=1, mtp_depth=1, n_layers=6, moe_aux_loss_coef=1e-2, moe_seq_aux_loss_coef=1e-2)


def _with_micro(cfg: RunConfig, microbatches: int = 4) -> RunConfig:
    return validate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=microbatches)))


@pytest.fixture(scope="module")
def pipelined_reference() -> tuple[dict, dict]:
    """(the parameters of the PIPELINED model, one device's gradients with 4 microbatches), once."""
    params = _perturbed(param_specs(dataclasses.replace(MODEL, **PIPELINED)))
    return params, grads(_with_micro(config(**PIPELINED)), params)


@pytest.mark.parametrize("schedule", ["zb1", "interleaved"])
def test_mla_moe_in_a_pipeline_gives_the_one_device_gradients(schedule, pipelined_reference):
    """MLA with a dense first layer and MoE layers (sigmoid scores, the router bias choosing, groups,
    routed scaling, the pooled and sequence-wise balance losses) on stage=2 x expert=2 x tensor=2 + SP
    with 4 microbatches: zb1, whose weight pass runs each layer's tensor-parallel regions apart, and
    interleaved (2 chunks a stage). The dense layer runs with the embedding on stage 0 (its gradient
    made in the first chunk's backward), the MoE MTP module with the loss on the last chunk (its
    router statistics pooled with the layers'). Gradients, loss, MTP loss, router losses and the
    exact expert counts (the bias update's input) equal one device's."""
    params, ref = pipelined_reference
    cfg = config(dict(stage=2, tensor=2, expert=2), True, **PIPELINED)
    virtual = 2 if schedule == "interleaved" else 1
    par = dataclasses.replace(cfg.parallel, pipeline_schedule=schedule, virtual_stages=virtual)
    got = grads(_with_micro(dataclasses.replace(cfg, parallel=par)), params)
    g, r = named_leaves(got["grads"]), named_leaves(ref["grads"])
    assert g.keys() == r.keys() and {"dense_layers/wkv_a", "dense_layers/w_gate", "mtp/we_gate"} <= g.keys()
    errors = {n: float(np.linalg.norm(g[n] - r[n]) / max(np.linalg.norm(r[n]), 1e-6)) for n in r}
    assert max(errors.values()) < RTOL, {n: e for n, e in errors.items() if e >= RTOL}
    for key in ("loss", "grad_norm", "mtp_loss", "moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, err_msg=key)
    np.testing.assert_array_equal(got["expert_counts"], ref["expert_counts"])  # [5 layers + the MTP module, E]


def test_mtp_rides_with_the_loss_on_stage_0_under_zbv():
    """ZB-V puts the loss on stage 0 (the V's turn): the MTP module runs there with it. A dense MLA
    model with one module on stage=2 x tensor=2 + SP, 4 microbatches: every gradient leaf (the
    module's included), the loss and the MTP loss equal one device's."""
    dense = dict(n_experts=0, first_k_dense=0, router_score="softmax", router_bias=False, n_group=1, topk_group=1)
    dense |= dict(routed_scaling_factor=1.0, n_shared_experts=0, mtp_depth=1, n_layers=4)
    params = _perturbed(param_specs(dataclasses.replace(MODEL, **dense)))
    cfg = config(dict(stage=2, tensor=2), True, **dense)
    par = dataclasses.replace(cfg.parallel, pipeline_schedule="zbv", virtual_stages=2, pipeline_ticks="single")
    got = grads(_with_micro(dataclasses.replace(cfg, parallel=par)), params)
    ref = grads(_with_micro(config(**dense)), params)
    g, r = named_leaves(got["grads"]), named_leaves(ref["grads"])
    assert g.keys() == r.keys() and {"mtp/eh_proj", "mtp/wq_a"} <= g.keys()
    errors = {n: float(np.linalg.norm(g[n] - r[n]) / max(np.linalg.norm(r[n]), 1e-6)) for n in r}
    assert max(errors.values()) < RTOL, {n: e for n, e in errors.items() if e >= RTOL}
    for key in ("loss", "grad_norm", "mtp_loss"):
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, err_msg=key)


def _np_rope(x, pos, inv_freq, factor):
    """Rotate-half RoPE in NumPy on x [..., t, h] at positions [t], times YaRN's factor."""
    ang = pos[:, None] * inv_freq[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)) * factor, np.sin(np.concatenate([ang, ang], -1)) * factor
    h = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., h:], x[..., :h]], -1) * sin


def _np_yarn(dim, theta, factor, fast, slow, original):
    """YaRN's frequencies as the paper (and transformers' `_compute_yarn_parameters`) define them."""
    base = theta ** (np.arange(0, dim, 2) / dim)
    corr = lambda rot: dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)
    return (1 / (factor * base)) * ramp + (1 / base) * (1 - ramp)


def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


LORA_LAYOUTS = {  # (mesh, sequence parallel, microbatches, attention, lora_dropout)
    "tensor2+sp x expert2": (dict(tensor=2, expert=2), True, 1, "explicit", 0.0),
    "stage2 1f1b x expert2 x tensor2+sp, lora_dropout": (dict(stage=2, expert=2, tensor=2), True, 4, "explicit", 0.25),
    "context2 ring x tensor2, lora_dropout": (dict(context=2, tensor=2), False, 1, "blockwise", 0.25),
}


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_on_mla_gives_the_one_device_adapter_gradients(name):
    """LoRA on MLA's query path (down and up), key-value latent and output, in both stacks (the dense
    first layer's and the MoE layers'): on tensor=2 + SP x expert=2 (the adapters inside the regions),
    and with `lora_dropout` (the terms and the query latent outside the regions, `mla.outside`; the
    bits drawn at each element's global position) in a 1f1b pipeline x tensor=2 + SP (the dense
    layer's adapters with the embedding on stage 0) and under ring context parallelism: every
    adapter's raw gradient equals one device's (the adapters perturbed: B is not zero), every frozen
    leaf's is zero."""
    mesh, sp, micro, attention, rate = LORA_LAYOUTS[name]
    lora = dict(lora_rank=4, lora_targets=("wq_a", "wq_b", "wkv_a", "wo"), mtp_depth=0, attention=attention)
    lora |= dict(lora_dropout=rate)
    one = _with_micro(config(**lora), micro)
    params = _perturbed(param_specs(one.model))
    got, ref = (named_leaves(grads(c, params)["grads"]) for c in (_with_micro(config(mesh, sp, **lora), micro), one))
    adapters = [n for n in ref if "_lora_" in n]
    assert len(adapters) == 16 and {n.split("/")[0] for n in adapters} == {"layers", "dense_layers"}
    assert sum(ref[n].size for n in adapters) == lora_param_count(one.model)  # accounting's (and its FLOPs')
    for n in ref:
        if n in adapters:
            assert np.linalg.norm(got[n] - ref[n]) < RTOL * np.linalg.norm(ref[n]) and np.linalg.norm(ref[n]) > 0, n
        else:
            assert not np.any(got[n]) and not np.any(ref[n]), n


def test_the_mla_attention_equals_numpy(params):
    """The attention of one layer (q LoRA + norm, the KV latent + norm, the shared RoPE key, the
    per-head up-projections, YaRN's two factors, causal softmax, v_head_dim 6 != 12) equals a
    NumPy transcription of DeepSeek-V3 2.1, with the explicit and the blockwise kernel."""
    m = MODEL
    p = {k: np.asarray(v[1], np.float64) for k, v in params["layers"].items()}  # the second MoE layer's attention
    h = np.random.default_rng(0).normal(size=(2, 16, 32))
    E, P, R, n = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.n_heads
    fm = lambda f, mscale: 1.0 if f <= 1 else 0.1 * mscale * math.log(f) + 1
    attn_factor, softmax_factor = fm(4.0, 1.0) / fm(4.0, 0.7), fm(4.0, 0.7) ** 2
    inv = _np_yarn(P, m.rope_theta, 4.0, 32.0, 1.0, 8)
    pos = np.arange(16.0)
    c_q = _np_rms(h @ p["wq_a"], p["q_a_norm"], 1e-6)
    q = np.einsum("btc,cnh->bnth", c_q, p["wq_b"])
    kv = h @ p["wkv_a"]
    c_kv = _np_rms(kv[..., :R], p["kv_a_norm"], 1e-6)
    k_rope = _np_rope(kv[:, None, :, R:], pos, inv, attn_factor)
    q = np.concatenate([q[..., :E], _np_rope(q[..., E:], pos, inv, attn_factor)], -1)
    k = np.concatenate([np.einsum("btc,cnh->bnth", c_kv, p["wk_b"]), np.repeat(k_rope, n, 1)], -1)
    v = np.einsum("btc,cnh->bnth", c_kv, p["wv_b"])
    s = q @ k.transpose(0, 1, 3, 2) * softmax_factor / math.sqrt(E + P)
    s = np.where(np.tril(np.ones((16, 16), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    o = (a / a.sum(-1, keepdims=True)) @ v
    want = np.einsum("bnth,nhd->btd", o, p["wo"])
    for kernel in ("explicit", "blockwise"):
        cfg = dataclasses.replace(m, attention=kernel, attention_block=8)
        layer = {k: jnp.asarray(v[1]) for k, v in params["layers"].items()}
        got, _ = _attention(jnp.asarray(h, jnp.float32), layer, None, cfg, None, "elementwise")
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=kernel)


@pytest.mark.parametrize("mesh, kernel", [({}, "explicit"), (dict(tensor=2), "blockwise")])
def test_latent_cache_decoding_equals_the_full_forward(params, mesh, kernel):
    """Prefill 8 tokens, then 16 decode steps from the latent cache (c_kv and the rotated key, W_UK
    and W_UV absorbed): every step's logits equal the full forward's at that position, on one
    device and over tensor=2 (whose blockwise model prefills with its O(s) kernel, keys and values
    expanded once). The generator's cache holds kv_lora_rank + qk_rope_head_dim values per token and
    layer, the formula's."""
    from meshlm import inference

    cfg = dataclasses.replace(MODEL, attention=kernel)
    tok = np.random.default_rng(0).integers(0, 64, (2, 24)).astype(np.int32)
    full = np.asarray(forward(params, tok, cfg))
    layout = make_layout(ParallelConfig(**mesh), jax.devices()[: 2 if mesh else 1])
    model = inference.Model(RunConfig(model=cfg, parallel=ParallelConfig(**mesh)), params, layout, None, 2, "", (2,))
    cache = inference.Generator(model)._empty_cache(2, 24, np.zeros(2, np.int32))
    assert cache.k.shape == (3, 2, 24, 1, 12) and cache.v.shape == (3, 2, 24, 1, 4)
    assert cache.k.shape[-1] + cache.v.shape[-1] == mla_costs.cache_values_per_token(cfg)
    plain = dataclasses.replace(cfg, kv_lora_rank=0, q_lora_rank=0, mtp_depth=0)  # 4 heads of 8: keys and values
    assert mla_costs.cache_values_per_token(plain) == 4 * 2 * 8 == sum(h * w for h, w in mla.cache_rows(plain))
    step = jax.jit(lambda p, t, c, pre: forward(p, t, cfg, layout, cache=c, prefill=pre), static_argnums=3)
    logits, cache = step(params, tok[:, :8], cache, True)
    errors = [np.abs(np.asarray(logits[:, 0]) - full[:, 7]).max()]
    for i in range(8, 24):
        logits, cache = step(params, tok[:, i : i + 1], cache, False)
        errors.append(np.abs(np.asarray(logits[:, 0]) - full[:, i]).max())
    assert max(errors) < 1e-5, errors


def test_parameter_counts_and_flops_of_mla_and_mtp():
    """The parameter formula equals the specs' count (MLA's projections, both layer kinds, the MTP
    module); DeepSeek-V3's recipe has its published 671B parameters (37B active) plus the 11.6B of
    its MTP module beyond the shared embedding and head; MTP's FLOPs are one layer, its projection
    and the output layer per token and module."""
    assert accounting.param_count(MODEL) == count_params(param_specs(MODEL))
    dense = dataclasses.replace(MODEL, n_experts=0, first_k_dense=0, mtp_depth=2, q_lora_rank=0)
    assert accounting.param_count(dense) == count_params(param_specs(dense))
    v3 = recipes.get("deepseek-v3").model
    main = dataclasses.replace(v3, mtp_depth=0)
    assert round(accounting.param_count(main) / 1e9) == 671
    active = accounting.active_param_count(main)  # 37.55B; without the input embedding 36.6B: "37B"
    assert int(active / 1e9) == 37 and round((active - v3.vocab_size * v3.d_model) / 1e9) == 37
    assert round((accounting.param_count(v3) - accounting.param_count(main)) / 1e9, 1) == 11.6
    run = config()
    no_mtp = dataclasses.replace(run, model=dataclasses.replace(run.model, mtp_depth=0))
    t, d, v = run.train, MODEL.d_model, MODEL.vocab_size
    layer = accounting.layer_forward_flops_per_token(dataclasses.replace(MODEL, first_k_dense=0), t.seq_len)
    per_token = sum(layer.values()) + 2 * (2 * d) * d + 2 * d * v
    assert accounting.model_flops_per_step(run) - accounting.model_flops_per_step(no_mtp) == (
        3 * t.global_batch * t.seq_len * per_token
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_kv_heads=2), "leave model.n_kv_heads and model.head_dim at 0"),
        (dict(lora_rank=4, mtp_depth=0), "lora_targets=wq,wk,wv,wo: each once, from wq_a, wq_b, wkv_a, wo"),
        (dict(lora_rank=4), "from wq_a, wq_b, wkv_a, wo; LoRA on this model also needs model.mtp_depth=0"),
        (dict(lora_rank=4, kv_lora_rank=0, q_lora_rank=0), "fine-tune an MTP model with model.mtp_depth=0"),
        (dict(qk_rope_head_dim=3), "even model.qk_rope_head_dim"),
        (dict(kv_lora_rank=0), "model.q_lora_rank needs MLA"),
    ],
)
def test_mla_configs_that_cannot_run_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        config(**change)


def test_mtp_with_the_ring_inside_a_pipeline_is_refused():
    with pytest.raises(ConfigError, match=r"multi-token prediction .* the ring's permutes"):
        par = ParallelConfig(stage=2, context=2, context_strategy="ring")
        model = dataclasses.replace(MODEL, attention="blockwise", **PIPELINED | dict(first_k_dense=0, n_layers=4))
        validate(dataclasses.replace(config(), parallel=par, model=model))


# ---------------------------------------------------------------- Hugging Face: MTP layers in and out

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _mtp_tensors(mtp_model, n_layers: int) -> dict:
    """An MtpModel's weights as DeepSeek-V3's checkpoints store them: layer n_layers + k, its block's
    tensors under that prefix (experts one by one), `shared_head.norm` for its post norm."""
    out = {}
    for name, w in mtp_model.state_dict().items():
        if not name.startswith("layers."):
            continue  # the shared embedding and head
        k, rest = name.split(".", 2)[1:]
        prefix = f"model.layers.{n_layers + int(k)}."
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):
            f = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[prefix + f"mlp.experts.{e}.gate_proj.weight"] = w[e, :f].contiguous()
                out[prefix + f"mlp.experts.{e}.up_proj.weight"] = w[e, f:].contiguous()
        elif rest.endswith("experts.down_proj"):
            out |= {prefix + f"mlp.experts.{e}.down_proj.weight": w[e].contiguous() for e in range(w.shape[0])}
        else:
            out[prefix + rest] = w.contiguous()
    return out


@pytest.fixture(scope="module")
def hf_mtp(tmp_path_factory):
    """A random DeepSeek-V3 (2 layers, the first dense; YaRN) with 2 MTP layers made by `transformers`' MtpModel,
    every weight and router bias perturbed, saved as a released checkpoint is (MTP as layers 2 and 3)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(0)
    c = transformers.DeepseekV3Config(**DEEPSEEK_HF, num_hidden_layers=2, num_mtp_layers=2)
    model = transformers.DeepseekV3ForCausalLM(c).eval()
    mtp_model = MtpModel(model, 2).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for name, p in mtp_model.layers.named_parameters():  # MtpModel leaves its experts uninitialised
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if name.endswith("norm.weight") else 0.0))
        for m in (model, mtp_model):
            for name, b in m.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn_like(b))
    d = tmp_path_factory.mktemp("deepseek-mtp")
    model.save_pretrained(d)
    main = load_file(d / "model.safetensors")
    save_file(_mtp_tensors(mtp_model, 2), d / "mtp.safetensors")
    weight_map = dict.fromkeys(main, "model.safetensors") | dict.fromkeys(_mtp_tensors(mtp_model, 2), "mtp.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d, model, mtp_model


def _hf_mtp_logits(model, mtp_model, z: np.ndarray) -> list[np.ndarray]:
    """Each MTP layer's logits for inputs z[:, :T] (T = z's length - 1), as `transformers` drafts:
    layer k reads tokens z[:, k:] and the previous layer's hidden state (the model's last layer output
    first)."""
    t = z.shape[1] - 1
    zt = torch.from_numpy(z.astype(np.int64))
    out = []
    with torch.no_grad():
        h = model(zt[:, :t], output_hidden_states=True).hidden_states[-1]
        pos = torch.arange(t)[None].expand(z.shape[0], -1)
        for k in range(len(mtp_model.layers)):
            n = t - k
            h = mtp_model.forward_layer(k, h[:, :n], pos[:, :n], None, input_ids=zt[:, k + 1 : k + 1 + n])
            out.append(mtp_model._project_to_logits(h).numpy())
    return out


def test_mtp_layers_import_with_transformers_logits_and_the_papers_loss(hf_mtp, devices):
    """Importing the checkpoint finds its 2 MTP layers (config.json would say 1 even without any):
    each module's logits equal MtpModel's where both are defined, and the MTP losses of the train
    step equal a NumPy transcription of DeepSeek-V3 2.2 on those logits: L_k = -(1/T) sum over the
    positions with a token k + 1 ahead of log P(t_{i+k+1}), over the positions a loss mask trains (shifted
    by k: where the main loss trains i + k) and the main loss's token count, on one device and on
    expert=2 x tensor=2."""
    from meshlm.interop import hf, hf_tables
    from meshlm.model import mtp
    from meshlm.train_state import param_shardings

    d, model, mtp_model = hf_mtp
    cfg = hf_tables.model_config(d)
    assert cfg.mla and cfg.mtp_depth == 2 and cfg.moe_stat_layer_ids == (1, 2, 3)
    z = np.random.default_rng(0).integers(0, 64, (4, 17)).astype(np.int32)
    want = _hf_mtp_logits(model, mtp_model, z)
    run = validate(RunConfig(model=cfg, train=TrainConfig(global_batch=4, seq_len=16)))
    mask = loss_mask((4, 16))
    batch = {"inputs": z[:, :-1], "targets": z[:, 1:], "mask": mask}
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, loss_mask=True))
    for mesh in ({}, dict(expert=2, tensor=2)):
        run = dataclasses.replace(run, parallel=ParallelConfig(**mesh))
        layout = make_layout(run.parallel, jax.devices()[: run.parallel.n_devices])
        params = hf.load_params(d, cfg, param_shardings(param_specs(cfg), layout))
        heads = jax.jit(
            lambda p, b, lay=layout: mtp.module_logits(
                p, forward(p, b["inputs"], cfg, lay, hidden=True)[2], b, cfg, lay
            )
        )
        got = heads(params, batch)
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(np.asarray(g)[:, : w.shape[1]], w, atol=1e-4, err_msg=f"module {k + 1}")
        shardings = state_shardings(param_specs(cfg), layout, optax.sgd(1.0)).params
        losses = np.asarray(make_grad_step(run, layout, shardings)(params, batch, 0)["mtp_loss"])
        for k, w in enumerate(want):  # module k + 1 at position i predicts z[i + k + 2], defined for i < T - k - 1,
            n = 16 - k - 1  # and trained where the main loss trains position i + k + 1 (the mask's)
            logp = w[:, :n] - np.log(np.exp(w[:, :n]).sum(-1, keepdims=True))
            ce = -(np.take_along_axis(logp, z[:, k + 2 : k + 2 + n, None], -1)[..., 0] * mask[:, k + 1 :]).sum()
            np.testing.assert_allclose(losses[k], ce / mask.sum(), rtol=1e-5)


def test_mtp_losses_stay_inside_each_packed_document():
    """Packed rows (document ids, as chat data trains): module k at position i is trained on t_{i+k+1}
    only where its input token t_{i+k} (position i + k) is in i's document and the loss mask trains
    position i + k. The modules' loss sums
    (`mtp.objective`, which the train step divides by the main loss's count) equal that rule applied
    in NumPy to their own logits (`mtp.module_logits`, the same document ids); leaving the document
    rule out (tried) moves them."""
    from meshlm.model import mtp

    cfg = config(mtp_depth=2)
    p = _perturbed(param_specs(cfg.model))
    b, t = cfg.train.global_batch, cfg.train.seq_len
    rng = np.random.default_rng(5)
    segments = (np.arange(t)[None, :] >= rng.integers(3, t - 3, (b, 1))).astype(np.int32)  # two documents a row
    batch = random_batches(cfg, 1, seed=4)[0] | {"mask": loss_mask((b, t)), "segment_ids": segments}

    @jax.jit
    def modules(p, batch):
        hidden = forward(p, batch["inputs"], cfg.model, hidden=True, segment_ids=batch["segment_ids"])[2]
        sums, _ = mtp.objective(p, hidden, batch, cfg.model, None, None, "elementwise")
        return sums, mtp.module_logits(p, hidden, batch, cfg.model)

    sums, logits = modules(p, batch)
    targets, mask = batch["targets"], batch["mask"]
    for k, out in enumerate(logits, start=1):
        n, out = t - k, np.asarray(out, np.float64)  # position i predicts targets[i + k]
        logp = out[:, :n] - np.log(np.exp(out[:, :n]).sum(-1, keepdims=True))
        picked = np.take_along_axis(logp, targets[:, k:, None], -1)[..., 0]
        valid = mask[:, k:] * (segments[:, k:] == segments[:, :n])  # trained at i + k, in i's document
        assert 0 < valid.sum() < mask[:, k:].sum()  # the rule drops some positions here
        np.testing.assert_allclose(sums[k - 1], -(picked * valid).sum(), rtol=RTOL)


def test_mtp_layers_export_and_transformers_loads_them(hf_mtp, tmp_path, devices, monkeypatch):
    """Export writes the MTP layers back as the checkpoint had them (and num_nextn_predict_layers 2);
    `transformers`' MtpModel.from_pretrained loads them from the export and drafts the same logits.
    (transformers finds DeepSeek-V3's MTP weights by the pattern of its 61-layer release, layers.61:
    here the layers after this model's 2.)"""
    import json

    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    from meshlm.interop import hf, hf_tables
    from meshlm.train_state import param_shardings

    d, model, mtp_model = hf_mtp
    cfg = hf_tables.model_config(d)
    layout = make_layout(ParallelConfig(expert=2, tensor=2), jax.devices()[:4])
    params = hf.load_params(d, cfg, param_shardings(param_specs(cfg), layout))
    out = hf.save_pretrained(params, cfg, tmp_path / "out", log=lambda m: None)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    original = load_file(d / "mtp.safetensors")
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    for name, w in original.items():
        assert torch.equal(exported[name], w), name
    mtp_pattern = [r"model\.layers\.[23]\..*"]
    monkeypatch.setattr(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", mtp_pattern)
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()
    drafts = MtpModel.from_pretrained(reloaded).eval()
    z = np.random.default_rng(1).integers(0, 64, (2, 13)).astype(np.int32)
    for got, want in zip(_hf_mtp_logits(reloaded, drafts, z), _hf_mtp_logits(model, mtp_model, z), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_fp8_weights_are_dequantised_by_their_block_scales(hf_mtp, tmp_path, devices):
    """The released DeepSeek-V3 and Kimi K2 weights are FP8 E4M3 with a `weight_scale_inv` per block
    of config.json's weight_block_size. A checkpoint whose projections (MTP layers included) are
    quantised so, in blocks of 8 x 8, imports as exactly the float32 checkpoint of its NumPy
    dequantisation; a scale of the wrong shape is refused by name."""
    import json

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from meshlm.interop import hf, hf_tables
    from meshlm.train_state import param_shardings

    d, _, _ = hf_mtp
    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    tensors = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
    quantised, dequantised = {}, {}
    for name, w in tensors.items():
        if not name.endswith("proj.weight") or w.ndim != 2:
            quantised[name] = dequantised[name] = w
            continue
        rows, cols = -(-w.shape[0] // 8), -(-w.shape[1] // 8)
        padded = np.zeros((rows * 8, cols * 8), np.float32)
        padded[: w.shape[0], : w.shape[1]] = w
        scale = np.abs(padded.reshape(rows, 8, cols, 8)).max((1, 3)) / 448.0
        full = np.repeat(np.repeat(scale, 8, 0), 8, 1)[: w.shape[0], : w.shape[1]]
        q = (w / full).astype(ml_dtypes.float8_e4m3fn)
        quantised |= {name: q, name + "_scale_inv": scale.astype(np.float32)}
        dequantised[name] = q.astype(np.float32) * full
    config = json.loads((d / "config.json").read_text())
    quant = {"quantization_config": dict(quant_method="fp8", fmt="e4m3", weight_block_size=[8, 8])}
    for out, weights, extra in ((fp8, quantised, quant), (plain, dequantised, {})):
        out.mkdir()
        save_file(weights, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(config | extra))
    cfg = hf_tables.model_config(fp8)
    assert cfg == hf_tables.model_config(plain) and cfg.mtp_depth == 2
    layout = make_layout(ParallelConfig(expert=2, tensor=2), jax.devices()[:4])
    got, want = (hf.load_params(x, cfg, param_shardings(param_specs(cfg), layout)) for x in (fp8, plain))
    for name, w in named_leaves(want).items():
        np.testing.assert_array_equal(np.asarray(named_leaves(got)[name]), np.asarray(w), err_msg=name)
    assert sum(n.endswith("_scale_inv") for n in quantised) > 30  # every projection, the MTP layers' too
    assert not np.array_equal(
        dequantised["model.layers.0.self_attn.q_b_proj.weight"], tensors["model.layers.0.self_attn.q_b_proj.weight"]
    )
    name = next(n for n in quantised if n.endswith("_scale_inv"))
    save_file(quantised | {name: quantised[name][:1]}, fp8 / "model.safetensors")
    with pytest.raises(ConfigError, match="do not tile"):
        hf.load_params(fp8, cfg, param_shardings(param_specs(cfg), layout))


def test_kimi_k2_files_import_as_deepseek_v3(hf_mtp, tmp_path):
    """Kimi K2's config.json names model_type kimi_k2 with DeepseekV3ForCausalLM (the same keys and
    tensors): it imports as the same model. Another architecture under that type, or a
    moe_layer_freq other than 1 (MoE layers meshlm would not place), is refused."""
    import json

    from meshlm.interop import hf_tables

    d, _, _ = hf_mtp
    config = json.loads((d / "config.json").read_text())
    for f in d.iterdir():  # the weights (the MTP layers are counted from their names)
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)

    def read(**changes):
        (tmp_path / "config.json").write_text(json.dumps(config | changes))
        return hf_tables.model_config(tmp_path)

    assert read(model_type="kimi_k2", moe_layer_freq=1) == hf_tables.model_config(d)
    with pytest.raises(ConfigError, match="model_type 'kimi_k2'"):
        read(model_type="kimi_k2", architectures=["KimiLinearForCausalLM"])
    with pytest.raises(ConfigError, match="moe_layer_freq=2"):
        read(model_type="kimi_k2", moe_layer_freq=2)


def test_meshlm_check_shrinks_mla_and_catches_a_doubled_latent_gradient(monkeypatch, devices):
    """`meshlm check` on deepseek-tiny (blockwise) over tensor=2 + SP x data=2 (MLA's ranks and head
    parts cut, values still narrower than queries and keys: the padding path) is equal to one device;
    a doubled gradient of the replicated KV down-projection inside the tensor-parallel region (a psum
    too many) is caught on it. (Expert layouts: `test_mla_mtp_moe_layouts_give_the_one_device_gradients`.)"""
    from meshlm.insight import check
    from meshlm.model import mla as mla_model

    cfg = recipes.get("deepseek-tiny")  # blockwise: values padded to the query-key size in the check too
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(tensor=2, data=2, sequence_parallel=True))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="blockwise"))
    result = check.run_check(validate(cfg))
    assert result.equal, "\n".join(check.format_result(result))
    small = check.shrink(cfg).model
    assert small.mla and small.v_head_dim < small.dim_head and small.mtp_depth == 1
    assert mla_costs.padded(small, False) == small.dim_head  # the padding path runs
    real = mla_model._projections

    def doubled(w):
        @jax.custom_vjp
        def f(w):
            return w

        f.defvjp(lambda w: (w, None), lambda _, g: (2 * g,))
        return f(w)

    def buggy(h, p, cfg, flat, given):
        if "tensor" in jax.sharding.get_abstract_mesh().manual_axes:
            p = p | {"wkv_a": doubled(p["wkv_a"])}
        return real(h, p, cfg, flat, given)

    monkeypatch.setattr(mla_model, "_projections", buggy)
    result = check.run_check(validate(cfg))
    assert not result.equal and "layers/wkv_a" in result.mismatched


def test_mtp_losses_are_charted():
    """Each module's loss in a metrics record (`mtp_loss_<k>`) is a TensorBoard / W&B chart of its own."""
    from meshlm.observe.sinks import chart_values

    charts = chart_values({"step": 3, "loss": 2.0, "mtp_loss_1": 2.5, "mtp_loss_2": 3.0})
    assert charts["train/mtp_loss_1"] == 2.5 and charts["train/mtp_loss_2"] == 3.0


def test_an_mtp_run_resumes_on_another_layout_with_the_same_losses(corpus_dir, tmp_path):
    """An MLA + MoE + MTP run on expert=2, cut back to its step-2 checkpoint and resumed on tensor=2 +
    SP x data=2, logs steps 3-4 with the losses of the run that never stopped (to the cross-layout tolerance), the MTP
    module's included: `mtp_loss_1` in metrics.jsonl at every step, and the router's bias restored."""
    import json
    import shutil

    from meshlm.config import CheckpointConfig, DataConfig
    from meshlm.trainer import train

    def run_cfg(mesh: dict, sp: bool = False) -> RunConfig:
        cfg = config(mesh, sp, vocab_size=320, router_bias_rate=1e-2)
        data = DataConfig(paths=(str(corpus_dir),), cache_dir=str(tmp_path / "cache"))
        train_cfg = dataclasses.replace(cfg.train, steps=4, log_every=1, eval_every=0)
        return validate(dataclasses.replace(cfg, data=data, train=train_cfg, checkpoint=CheckpointConfig(every=2)))

    train(run_cfg(dict(expert=2)), tmp_path / "ref", quiet=True)
    # the run as stopped after step 2 (one compile fewer than training it again): the reference's
    # directory without its last checkpoint; the resumed run logs steps 3-4 again after a resume marker
    shutil.copytree(tmp_path / "ref", tmp_path / "a")
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "4")
    train(run_cfg(dict(tensor=2, data=2), sp=True), tmp_path / "a", quiet=True)
    lines = lambda run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    events = lines("a")
    resumed = events[events.index({"event": "resume", "step": 2}) + 1 :]  # what the resumed run logged
    got = {r["step"]: (r["loss"], r["mtp_loss_1"]) for r in resumed if "mtp_loss_1" in r}
    want = {r["step"]: (r["loss"], r["mtp_loss_1"]) for r in lines("ref") if "mtp_loss_1" in r}
    assert sorted(got) == [3, 4] and sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)], rtol=1e-5)
