"""Mixture-of-Experts checkpoints in and out of Hugging Face: Mixtral (GQA), Qwen3-MoE (q/k norms,
softmax-then-top-k) and Qwen2-MoE (QKV biases, a sigmoid-gated shared expert), made by
`transformers` with random weights. Import gives its logits on one device and on expert=2 x
tensor=2, export writes back the same tensors, and greedy decoding equals its `generate`."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from helpers import DEEPSEEK_HF, peft_logits_with_masks
from meshlm import inference
from meshlm.config import ParallelConfig, RunConfig
from meshlm.interop import hf, hf_tables
from meshlm.model.params import param_specs
from meshlm.model.transformer import forward
from meshlm.parallel.mesh import make_layout
from meshlm.train_state import param_shardings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

EP_TP = ParallelConfig(expert=2, tensor=2)
COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    rope_theta=1000.0,
)


def _hf_model(name: str):
    if name.startswith("deepseek_v3"):  # 3 layers, the first dense; "full q": V2-Lite's query projection,
        # RoPE rows not interleaved, and an rms_norm_eps that MLA's latent norms must not take (they use 1e-6)
        full_q = dict(q_lora_rank=None, rope_interleave=False, rms_norm_eps=1e-3) if "full q" in name else {}
        # interleaved: 8 rotated dimensions, whose reordering is not its own inverse (4's is)
        full_q = full_q or dict(qk_rope_head_dim=8)
        config = transformers.DeepseekV3Config(**(DEEPSEEK_HF | full_q), num_hidden_layers=3)
        return transformers.DeepseekV3ForCausalLM(config)
    if name == "mixtral":
        c = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **COMMON)
        return transformers.MixtralForCausalLM(c)
    qwen = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]
    )
    common = COMMON
    if name == "qwen3_moe, dense layers":  # 6 layers: 1, 3 and 5 sparse (decoder_sparse_step), but 5 (mlp_only_layers)
        qwen, common = qwen | dict(decoder_sparse_step=2, mlp_only_layers=[5]), COMMON | dict(num_hidden_layers=6)
    if name.startswith("qwen3_moe"):
        c = transformers.Qwen3MoeConfig(intermediate_size=64, head_dim=16, norm_topk_prob=True, **qwen, **common)
        return transformers.Qwen3MoeForCausalLM(c)
    c = transformers.Qwen2MoeConfig(intermediate_size=64, shared_expert_intermediate_size=48, **qwen, **COMMON)
    return transformers.Qwen2MoeForCausalLM(c)


NAMES = ("mixtral", "qwen3_moe", "qwen2_moe", "qwen3_moe, dense layers", "deepseek_v3", "deepseek_v3, full q")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(i)
        model = _hf_model(name).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
            for layer in model.model.layers if name.startswith("deepseek_v3") else ():  # zero at init: make it choose
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(4))
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, max_shard_size="100KB")
        out[name] = (d, model)
    return out


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _load(d, parallel):
    cfg = hf_tables.model_config(d)
    layout = make_layout(parallel)
    return cfg, layout, hf.load_params(d, cfg, param_shardings(param_specs(cfg), layout))


@pytest.mark.parametrize("name", NAMES)
def test_import_gives_transformers_logits_on_one_device_and_expert2_tensor2(hf_dirs, name, devices):
    d, model = hf_dirs[name]
    tokens = np.random.default_rng(0).integers(0, 64, (2, 24)).astype(np.int32)
    want = _hf_logits(model, tokens)
    cfg = hf_tables.model_config(d)
    assert cfg.n_experts == 4 and cfg.qk_norm == name.startswith("qwen3") and cfg.qkv_bias == (name == "qwen2_moe")
    deepseek = name.startswith("deepseek_v3")
    assert cfg.dense_layer_ids == ((0,) if deepseek else (0, 2, 4, 5) if "dense" in name else ())
    assert cfg.mla == cfg.router_bias == deepseek and cfg.q_lora_rank == (0 if "full q" in name else 16 * deepseek)
    for parallel in (ParallelConfig(), EP_TP):
        cfg, layout, params = _load(d, parallel)
        if parallel.expert > 1:  # built straight into shards: each device holds 2 of the 4 experts
            assert {s.data.shape[1] for s in params["layers"]["we_gate"].addressable_shards} == {2}
        got = np.asarray(jax.jit(lambda p, t, c=cfg, lay=layout: forward(p, t, c, lay))(params, tokens))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_back_the_same_tensors_and_config(hf_dirs, name, tmp_path, devices):
    d, model = hf_dirs[name]
    cfg, _, params = _load(d, EP_TP)
    out = hf.save_pretrained(params, cfg, tmp_path / "out", log=lambda m: None)
    original, exported = {}, {}
    for src, dst in ((d, original), (out, exported)):
        for f in sorted(src.glob("*.safetensors")):
            dst |= safetensors_torch.load_file(f)
    assert set(exported) == set(original)
    # export writes RoPE rows interleaved (transformers' default): a source without keeps its rotated rows elsewhere
    moved = ("q_proj.weight", "kv_a_proj_with_mqa.weight") if "full q" in name else ()
    for k, v in exported.items():
        assert torch.equal(v, original[k]) != k.endswith(moved), k
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == name.split(",")[0] and written["architectures"] == [type(model).__name__]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(1).integers(0, 64, (2, 16)).astype(np.int32)
    np.testing.assert_allclose(
        _hf_logits(reloaded, tokens), _hf_logits(model, tokens), rtol=0, atol=1e-5 if moved else 0
    )


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_on_expert2_tensor2_equals_transformers_generate(hf_dirs, name, devices):
    d, model = hf_dirs[name]
    cfg, layout, params = _load(d, EP_TP)
    stops = hf.token_ids(d)["eos_token_id"]
    m = inference.Model(RunConfig(model=cfg, parallel=EP_TP), params, layout, None, stops[0], "", tuple(stops))
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20 + i for i in range(13)]]
    gen = inference.Generator(m).generate(prompts, 8, stop_at_eos=False)
    for prompt, tokens in zip(prompts, gen.tokens, strict=True):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
        assert want == tokens[: len(want)] and (len(want) == 8 or want[-1] in stops)


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers='0' must be a list of layer indices"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window=4096 is not supported"),
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds the 4 experts"),
        ("qwen3_moe", {"num_experts": None, "num_local_experts": None}, "missing the expert count"),
    ],
)
def test_moe_configs_meshlm_does_not_compute_are_refused(hf_dirs, name, change, message, tmp_path):
    """Malformed dense-layer keys, sliding windows and impossible routing are named, not imported as
    something else."""
    from meshlm.config import ConfigError

    data = json.loads((hf_dirs[name][0] / "config.json").read_text())
    data = {k: v for k, v in (data | change).items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        hf_tables.model_config(tmp_path)


def test_dense_layers_route_like_transformers_and_do_not_export_as_mixtral(hf_dirs, devices):
    """The router statistics are the sparse layers', in order: each MoE layer's summed router
    probabilities equal the softmax of `transformers`' router logits for that layer (Qwen3-MoE,
    dense layers 0, 2, 4, 5). A model with dense layers does not export as Mixtral, whose layers
    are all MoE."""
    from meshlm.config import ConfigError

    d, model = hf_dirs["qwen3_moe, dense layers"]
    tokens = np.random.default_rng(2).integers(0, 64, (2, 12)).astype(np.int32)
    cfg, _, params = _load(d, ParallelConfig())
    _, stats = jax.jit(lambda p, t: forward(p, t, cfg, router_stats=True))(params, tokens)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens.astype(np.int64)), output_router_logits=True).router_logits
    assert len(logits) == len(cfg.moe_layer_ids) == 2
    for j, layer in enumerate(logits):
        want = torch.softmax(layer.float(), -1).numpy().reshape(2, 12, -1).sum(1)
        np.testing.assert_allclose(np.asarray(stats.prob_sum[j]), want, rtol=1e-4, atol=1e-5)
    mixed = dataclasses.replace(hf_tables.model_config(hf_dirs["mixtral"][0]), first_k_dense=1)
    with pytest.raises(ConfigError, match="whose layers are all MoE; this one has dense layers \\[0\\]"):
        hf_tables.hf_config(mixed, 1, 2, "float32")


def test_lora_adapters_on_dense_and_moe_layers_load_in_peft(hf_dirs, tmp_path, devices):
    """LoRA on every attention projection of a Qwen3-MoE with dense layers (0, 2, 4, 5; MoE 1 and 3,
    stacked apart): meshlm's forward with random adapters in both stacks equals `peft`'s, on the
    original `transformers` model, with the adapter directory `save_peft` writes (each stack's layers
    under their own model indices)."""
    from peft import PeftModel

    from meshlm.model import lora
    from meshlm.model.params import init_params

    d, _ = hf_dirs["qwen3_moe, dense layers"]
    base_cfg, _, base = _load(d, ParallelConfig())
    cfg = dataclasses.replace(base_cfg, lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wk", "wv", "wo"))
    fresh = lora.adapters(init_params(param_specs(cfg), jax.random.key(0)))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    randomised = jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape), fresh)  # B away from zero
    params = lora.with_adapters(base, randomised)
    assert set(lora.adapters(params)) == {"layers", "dense_layers"}
    tokens = np.random.default_rng(3).integers(0, 64, (2, 16)).astype(np.int32)
    got = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg))(params, tokens))
    hf.save_peft(params, cfg, tmp_path / "adapter", str(d), log=lambda _: None)
    theirs = PeftModel.from_pretrained(transformers.Qwen3MoeForCausalLM.from_pretrained(d), tmp_path / "adapter")
    want = _hf_logits(theirs.eval(), tokens)
    assert np.abs(want - _hf_logits(transformers.Qwen3MoeForCausalLM.from_pretrained(d).eval(), tokens)).max() > 1e-2
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# each MLA target's module in `transformers`' DeepSeek-V3 layer
MLA_MODULES = {
    "wq_a": "self_attn.q_a_proj",
    "wq_b": "self_attn.q_b_proj",
    "wq": "self_attn.q_proj",
    "wkv_a": "self_attn.kv_a_proj_with_mqa",
    "wo": "self_attn.o_proj",
}


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3, full q"])
def test_lora_on_mla_equals_transformers_on_the_merged_export(hf_dirs, name, tmp_path, devices):
    """LoRA on a DeepSeek-V3 (MLA, a dense first layer, RoPE rows interleaved or not) with random
    adapters on the query path, the key-value latent and the output: meshlm's forward, on one device
    and on expert=2 x tensor=2 + SP, equals `transformers`' on the merged export (the adapters folded,
    then written as the checkpoint's own tensors) and `peft`'s with the adapter `save_peft` writes on the
    original checkpoint, and differs from the base model's. With `lora_dropout`, the same without a
    dropout key (one device, the sharded layout, decoding), and with one, `peft`'s in train mode given
    meshlm's keep masks."""
    from meshlm.config import ConfigError
    from meshlm.model import lora
    from meshlm.model.params import init_params

    d, model = hf_dirs[name]
    base_cfg, _, base = _load(d, ParallelConfig())
    targets = ("wq_a", "wq_b", "wkv_a", "wo") if base_cfg.q_lora_rank else ("wq", "wkv_a", "wo")
    cfg = dataclasses.replace(base_cfg, lora_rank=4, lora_alpha=8.0, lora_targets=targets)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    fresh = lora.adapters(init_params(param_specs(cfg), jax.random.key(0)))
    params = lora.with_adapters(base, jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape), fresh))
    tokens = np.random.default_rng(4).integers(0, 64, (2, 16)).astype(np.int32)
    layout = make_layout(dataclasses.replace(EP_TP, sequence_parallel=True))
    sharded = jax.device_put(params, param_shardings(param_specs(cfg), layout))
    got = [
        np.asarray(jax.jit(lambda p, t, lay=lay: forward(p, t, cfg, lay))(q, tokens))
        for q, lay in ((params, None), (sharded, layout))
    ]
    merged, merged_cfg = lora.merged(params, cfg)
    out = hf.save_pretrained(merged, merged_cfg, tmp_path / "merged", log=lambda _: None)
    want = _hf_logits(transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval(), tokens)
    assert np.abs(want - _hf_logits(model, tokens)).max() > 1e-2  # the adapters change the function
    for logits in got:
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)
    # decoding from the latent cache runs the adapters too: greedy tokens as transformers' on the merge
    m = inference.Model(
        RunConfig(model=cfg, parallel=EP_TP),
        jax.device_put(params, param_shardings(param_specs(cfg), make_layout(EP_TP))),
        make_layout(EP_TP),
    )
    prompt = [5, 6, 7, 8, 9]
    ours = inference.Generator(m).generate([prompt], 6, stop_at_eos=False).tokens[0]
    merged_model = transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()
    theirs = merged_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert ours == theirs[0, len(prompt) :].tolist()
    # the adapters alone, as a PEFT adapter of the original checkpoint (its RoPE rows interleaved or not)
    from peft import PeftModel

    hf.save_peft(params, cfg, tmp_path / "adapter", str(d), log=lambda _: None)
    theirs = PeftModel.from_pretrained(transformers.DeepseekV3ForCausalLM.from_pretrained(d), tmp_path / "adapter")
    np.testing.assert_allclose(_hf_logits(theirs.eval(), tokens), got[0], atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="its rope_interleave"):  # the row order needs the base's config.json
        hf.save_peft(params, cfg, tmp_path / "no base", "", log=lambda _: None)
    # `lora_dropout` moves the terms and the query latent out of the region (`mla.outside`): without a
    # key (evaluation, decoding) the same function; with one, peft's in train mode given meshlm's masks
    drop = dataclasses.replace(cfg, lora_dropout=0.5)
    for q, lay in ((params, None), (sharded, layout)):
        logits = jax.jit(lambda p, t, lay=lay: forward(p, t, drop, lay))(q, tokens)
        np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)
    m = inference.Model(RunConfig(model=drop, parallel=EP_TP), m.params, m.layout)
    assert inference.Generator(m).generate([prompt], 6, stop_at_eos=False).tokens[0] == ours
    key = jax.random.key(11)
    keyed = np.asarray(jax.jit(lambda p, t: forward(p, t, drop, None, key=key))(params, tokens))
    masked = peft_logits_with_masks(theirs, {t: MLA_MODULES[t] for t in targets}, tokens, 0.5, key)
    np.testing.assert_allclose(keyed, masked, atol=1e-4, rtol=0)
    assert np.abs(keyed - got[0]).max() > 1e-2  # it drops


def test_deepseek_routing_starts_from_mixtral_with_a_zero_bias_and_refuses_to_export_as_it(hf_dirs, devices):
    """`--init-from` a Mixtral with DeepSeek-V3's routing switched on: every weight is the
    checkpoint's and the router bias (which Mixtral has not) starts at zero; exporting that model as
    Mixtral would change its routing, so it is refused."""
    import dataclasses

    from meshlm.config import ConfigError
    from meshlm.interop import hf_moe

    d, _ = hf_dirs["mixtral"]
    cfg, layout, params = _load(d, ParallelConfig())
    biased = dataclasses.replace(cfg, router_score="sigmoid", router_bias=True, router_bias_rate=1e-3)
    got = hf.load_params(d, biased, param_shardings(param_specs(biased), layout))
    assert not np.any(np.asarray(got["layers"]["router_bias"])) and got["layers"]["router_bias"].dtype == np.float32
    for name, w in params["layers"].items():
        np.testing.assert_array_equal(np.asarray(got["layers"][name]), np.asarray(w), err_msg=name)
    with pytest.raises(ConfigError, match=r"DeepSeek-V3.s routing .* has no export yet"):
        hf_moe.hf_fields(biased)
