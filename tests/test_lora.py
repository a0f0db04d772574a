"""LoRA (`model.lora_rank`): the adapted forward equals the merged model's; the base gets no
gradient (none computed: the compiled step's FLOPs) and no optimizer state; layouts equal one
device; a run initialised from a `transformers` Llama trains only its adapters, and its exports
load in `peft` (the adapter) and `transformers` (merged) with the same logits."""

import dataclasses
import json
import re

import jax
import numpy as np
import optax
import pytest

from helpers import peft_logits_with_masks, random_batches, save_tiny_llama, tiny_config
from meshlm import accounting
from meshlm.config import ConfigError, RematConfig, apply_overrides
from meshlm.model import lora
from meshlm.model.params import count_params, init_params, named_leaves, param_specs, trainable_mask
from meshlm.model.transformer import forward
from meshlm.optim import make_optimizer
from meshlm.parallel.mesh import make_layout
from meshlm.step import make_grad_step
from meshlm.train_state import abstract_state, state_shardings
from meshlm.validation import validate

TARGETS = {
    "gpt": ("wq", "wk", "wv", "wo", "w_fc", "w_proj"),
    "llama": ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"),
}


# an MoE model (experts frozen, attention adapted) whose first layer is dense: adapters in both stacks
MOE_PREFIX = dict(n_experts=4, experts_per_token=2, expert_d_ff=32, first_k_dense=1, n_layers=3)
MOE_PREFIX |= dict(lora_targets=("wq", "wk", "wv", "wo"))


def lora_config(family: str, mesh: dict | None = None, sp: bool = False, **train):
    cfg = tiny_config(family, mesh, **train)
    model = dataclasses.replace(cfg.model, lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS[family], dropout=0.0)
    par = dataclasses.replace(cfg.parallel, sequence_parallel=sp)
    return validate(dataclasses.replace(cfg, model=model, parallel=par))


def adapted_params(cfg, seed: int = 0) -> dict:
    """Random base weights and adapters with B away from zero (a fresh B is zero: nothing to test)."""
    p = init_params(param_specs(cfg.model), jax.random.key(seed))
    key = jax.random.key(seed + 1)
    layers = {
        k: v + 0.05 * jax.random.normal(jax.random.fold_in(key, i), v.shape) if k.endswith("_lora_b") else v
        for i, (k, v) in enumerate(sorted(p["layers"].items()))
    }
    return jax.device_get(p | {"layers": layers})


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_forward_equals_the_merged_model_and_counts_are_exact(family):
    cfg = lora_config(family)
    params = adapted_params(cfg)
    batch = random_batches(cfg, 1)[0]
    got = np.asarray(forward(params, batch["inputs"], cfg.model, None))
    merged, base = lora.merged(params, cfg.model)
    assert not base.lora_rank and set(merged["layers"]) == set(param_specs(base)["layers"])
    want = np.asarray(forward(merged, batch["inputs"], base, None))
    np.testing.assert_allclose(got, want, atol=2e-5)
    specs = param_specs(cfg.model)
    assert accounting.param_count(cfg.model) == count_params(specs)
    trainable = [
        s
        for s, t in zip(
            jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "axes")),
            jax.tree.leaves(trainable_mask(specs)),
            strict=True,
        )
        if t
    ]
    assert sum(int(np.prod(s.shape)) for s in trainable) == lora.lora_param_count(cfg.model)


@pytest.mark.parametrize(
    "parallel, moe",
    [({}, {}), (dict(stage=2, pipeline_schedule="1f1b"), {}), (dict(stage=2, pipeline_schedule="1f1b"), MOE_PREFIX)],
    ids=["one", "1f1b", "1f1b, MoE with a dense first layer"],
)
def test_the_base_has_no_gradient_and_no_optimizer_state(parallel, moe):
    """In the compiled gradient step of a LoRA run, every matmul that makes a weight-shaped output
    (neither dimension a microbatch's rows) has the rank as a dimension: the frozen weights' d_in x
    d_out gradient GEMMs are not in the program - nor in a pipeline's, whose stages differentiate
    and accumulate the adapters only (full fine-tuning's are: the check fails there, as it did by
    hand on 1F1B with the frozen weights accumulated; the program's exact GEMM FLOPs:
    tests/test_flops.py). Adam's moments exist for the adapters only. With a dense first layer (MoE)
    in a pipeline, its adapters train among the weights outside the stages, and still the output
    layer gets no gradient GEMM (it did, by hand, when the pipeline differentiated every top weight)."""
    cfg = lora_config("llama", microbatches=2 if parallel else 1)
    model = dataclasses.replace(cfg.model, **moe)
    cfg = validate(dataclasses.replace(cfg, model=model, parallel=dataclasses.replace(cfg.parallel, **parallel)))
    full = validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=0)))
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), random_batches(cfg, 1)[0])
    rows = cfg.train.global_batch // cfg.train.microbatches * cfg.train.seq_len
    r = cfg.model.lora_rank

    def program(c):
        specs = param_specs(c.model)
        sh = state_shardings(specs, layout, optax.sgd(1.0)).params
        shapes = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), specs, is_leaf=lambda x: hasattr(x, "axes")
        )
        compiled = make_grad_step(c, layout, sh).lower(shapes, batch, 0).compile()
        dots = re.findall(r"= f32\[([0-9,]*)\][^ ]* dot\(", compiled.as_text())
        weight_shaped = [d for d in dots if d.count(",") == 1 and str(rows) not in d.split(",")]
        return weight_shaped

    lora_dots, full_dots = program(cfg), program(full)
    assert lora_dots and all(str(r) in d.split(",") for d in lora_dots), lora_dots
    assert not all(str(r) in d.split(",") for d in full_dots)  # the check sees weight gradients
    specs = param_specs(cfg.model)
    state = abstract_state(specs, layout, make_optimizer(cfg.optim, 10, specs))
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * lora.lora_param_count(cfg.model)


@pytest.mark.parametrize(
    "family, mesh, sp", [("llama", dict(fsdp=2, tensor=2), True), ("gpt", dict(data=2, tensor=2), False)]
)
def test_layouts_give_the_one_device_adapter_gradients(family, mesh, sp):
    from test_gradients import assert_same_grads

    one = lora_config(family, microbatches=2)
    cfg = lora_config(family, mesh, sp, microbatches=2)
    params = adapted_params(one)
    batch = random_batches(one, 1, seed=3)[0]

    def grads(c):
        layout = make_layout(c.parallel, jax.devices()[: c.parallel.n_devices])
        sh = state_shardings(param_specs(c.model), layout, optax.sgd(1.0)).params
        return jax.device_get(make_grad_step(c, layout, sh)(jax.device_put(params, sh), batch, 5))

    got, ref = grads(cfg), grads(one)
    assert_same_grads(got, ref)
    assert all(not np.any(v) for k, v in named_leaves(got["grads"]).items() if "_lora_" not in k)


@pytest.fixture(scope="module")
def deep_reference():
    """One device's gradients of a 4-layer LoRA model in 4 microbatches (what a pipeline of 2
    stages x 2 chunks needs), per (family, lora_dropout), with their parameters."""
    from test_gradients import grads

    cache = {}

    def get(family: str, rate: float):
        if (family, rate) not in cache:
            cfg = lora_config(family, microbatches=4, n_layers=4)
            cfg = validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_dropout=rate)))
            params = adapted_params(cfg)
            cache[family, rate] = cfg, params, grads(cfg, params)
        return cache[family, rate]

    return get


@pytest.mark.parametrize(
    "family, rate, parallel",
    [
        ("llama", 0.2, dict(stage=2, tensor=2, sequence_parallel=True)),
        ("llama", 0.0, dict(stage=2, tensor=2, sequence_parallel=True, data=2)),
        ("gpt", 0.0, dict(stage=2, pipeline_schedule="interleaved", virtual_stages=2, data=2)),
        ("gpt", 0.2, dict(stage=2, fsdp=2)),
        ("llama", 0.2, dict(context=2, context_strategy="all_to_all", fsdp=2)),
        ("gpt", 0.2, dict(tensor=2, sequence_parallel=True, data=2)),
    ],
)
def test_pipelines_and_lora_dropout_give_the_one_device_gradients(deep_reference, family, rate, parallel):
    """LoRA inside pipelines (1F1B and interleaved, with tensor parallelism: the adapters inside its
    regions, or outside them with dropout) and `lora_dropout` (its bits at each element's global
    position: the same on every layout, context's load-balanced order included): raw gradients equal
    one device's; frozen leaves zero."""
    from test_gradients import assert_same_grads, grads

    one, params, ref = deep_reference(family, rate)
    cfg = validate(dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, **parallel)))
    got = grads(cfg, params)
    assert_same_grads(got, ref)
    assert all(not np.any(v) for k, v in named_leaves(got["grads"]).items() if "_lora_" not in k)
    if rate:  # the dropout is on: the gradients are not those without it
        assert not np.allclose(ref["loss"], deep_reference(family, 0.0)[2]["loss"], rtol=1e-5)


def test_lora_dropout_drops_each_targets_input_as_numpy_does():
    """`_lora_terms` against NumPy with jax.random.bernoulli's mask: scale x (x * keep / (1 - p)) A B,
    a mask of its own per target (PEFT: one nn.Dropout per adapted module); no key, no dropout."""
    from meshlm.model import transformer as tr

    cfg = lora_config("llama").model
    cfg = dataclasses.replace(cfg, lora_dropout=0.25)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, cfg.d_model)).astype(np.float32)
    p = {}
    for name, heads in (("wq", cfg.n_heads), ("wk", cfg.kv_heads)):
        p[f"{name}_lora_a"] = rng.standard_normal((cfg.d_model, 4)).astype(np.float32)
        p[f"{name}_lora_b"] = rng.standard_normal((4, heads, cfg.dim_head)).astype(np.float32)
    key = jax.random.key(3)
    targets = {"wq": tr.HEADS_ACT, "wk": tr.KV_ACT}
    got = tr._lora_terms(x, p, key, "btd,dnh->btnh", targets, cfg, None)
    plain = tr._lora_terms(x, p, None, "btd,dnh->btnh", targets, cfg, None)
    masks = []
    for name in targets:
        keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, tr._LORA_SITES[name]), 0.75, x.shape))
        masks.append(keep)
        a, b = p[f"{name}_lora_a"], p[f"{name}_lora_b"]
        want = cfg.lora_scale * np.einsum("btr,rnh->btnh", (x * keep / 0.75) @ a, b)
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-4, atol=1e-4)
        full = cfg.lora_scale * np.einsum("btr,rnh->btnh", x @ a, b)
        np.testing.assert_allclose(np.asarray(plain[name]), full, rtol=1e-4, atol=1e-4)
    assert 0.6 < masks[0].mean() < 0.9 and not np.array_equal(masks[0], masks[1])


def test_config_errors():
    cfg = tiny_config("llama")
    bad = lambda **m: validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=4, **m)))
    with pytest.raises(ConfigError, match="lora_targets"):
        bad(lora_targets=("w_fc",))
    moe = dataclasses.replace(cfg.model, n_experts=4, lora_rank=4, lora_targets=("wq", "w_gate"))
    with pytest.raises(ConfigError, match="experts are not built yet"):
        validate(dataclasses.replace(cfg, model=moe))
    with pytest.raises(ConfigError, match="lora_dropout must be in"):
        bad(lora_dropout=1.0)
    with pytest.raises(ConfigError, match="lora_dropout without a rank"):
        validate(apply_overrides(cfg, ["finetune.lora_dropout=0.1"]))
    piped = apply_overrides(cfg, ["finetune.lora_rank=4", "parallel.stage=2", "train.microbatches=2"])
    validate(piped)  # 1F1B
    with pytest.raises(ConfigError, match="zb1 with LoRA"):
        validate(apply_overrides(piped, ["parallel.pipeline_schedule=zb1"]))
    zbv = ["parallel.pipeline_schedule=zbv", "parallel.virtual_stages=2", "parallel.pipeline_ticks=single"]
    with pytest.raises(ConfigError, match="zbv with LoRA"):
        validate(apply_overrides(piped, zbv))
    # the names: finetune.lora_* set the model's LoRA fields (the adapters are parameters)
    got = apply_overrides(cfg, ["finetune.lora_rank=8", "finetune.lora_dropout=0.1", "finetune.lora_targets=wq,wv"])
    assert (got.model.lora_rank, got.model.lora_dropout, got.model.lora_targets) == (8, 0.1, ("wq", "wv"))
    with pytest.raises(ConfigError, match="the finetune keys are"):
        apply_overrides(cfg, ["finetune.steps=3"])


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    from meshlm.data import tokenizer as toks

    root = tmp_path_factory.mktemp("hf-llama-lora")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "mesh", "shard", "token", "layer"]
    tok = toks.train_bpe([" ".join(rng.choice(words, 12)) for _ in range(200)], 300)
    save_tiny_llama(root, tok, toks.EOT)
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 20)) for _ in range(400)))
    return root


def test_a_run_from_transformers_trains_only_adapters_and_exports_to_peft_and_merged(hf_llama, tmp_path):
    """`train --init-from hf:DIR` with LoRA, stopped and resumed: the base weights stay the Hugging
    Face ones bit for bit, the adapters move; `convert --to-hf --peft` loads in `peft` on the original model, and the
    merged `convert --to-hf` in `transformers`, both with meshlm's logits (1e-4)."""
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from meshlm.config import CheckpointConfig, DataConfig, OptimConfig, RunConfig, TrainConfig
    from meshlm.inference import load_model
    from meshlm.interop import hf_tables
    from meshlm.interop.convert import export_hf
    from meshlm.trainer import train

    model = dataclasses.replace(
        hf_tables.model_config(hf_llama), lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS["llama"]
    )
    cfg = validate(
        RunConfig(
            model=model,
            data=DataConfig(
                paths=(str(hf_llama / "corpus.txt"),),
                tokenizer=str(hf_llama / "tokenizer.json"),
                cache_dir=str(tmp_path / "cache"),
            ),
            train=TrainConfig(steps=3, global_batch=4, seq_len=32, log_every=1, eval_every=0),
            optim=OptimConfig(lr=5e-2, warmup_steps=0),
            remat=RematConfig("elementwise"),
            checkpoint=CheckpointConfig(every=0, keep=2),
        )
    )
    run = tmp_path / "run"
    train(cfg, run, quiet=True, init_from=f"hf:{hf_llama}", stop_after=2)  # then resumed: adapters and their
    train(cfg, run, quiet=True)  # moments come back from the checkpoint (the base's moments do not exist)
    trained = load_model(run)
    base = load_model(f"hf:{hf_llama}")
    got, want = named_leaves(trained.params), named_leaves(base.params)
    for name, w in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(w), err_msg=name)  # frozen: unchanged
    assert all(np.any(np.asarray(got[k])) for k in got if k.endswith("_lora_b"))  # B moved from zero
    tokens = np.random.default_rng(5).integers(0, 300, (2, 24)).astype(np.int32)
    ours = np.asarray(forward(trained.params, tokens, trained.cfg.model, None))
    export_hf(run, tmp_path / "adapter", peft=True, log=lambda _: None)
    export_hf(run, tmp_path / "merged", log=lambda _: None)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        hf_llama.absolute()
    )
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_llama), tmp_path / "adapter").eval()
        theirs = peft_model(torch.from_numpy(tokens).long()).logits.numpy()
        merged = (
            LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()(torch.from_numpy(tokens).long()).logits.numpy()
        )
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    np.testing.assert_allclose(ours, merged, atol=1e-4)


def test_checkpoints_hold_the_adapters_and_a_checked_pointer_to_the_base(hf_llama, tmp_path):
    """A LoRA run's checkpoints hold its adapters (and their moments) only, with a pointer to the
    base - hf:DIR, a meshlm checkpoint step, or train.seed's initialisation - and the base's
    checksums: resume, generate and export read the base from there, and refuse one that changed
    or is gone, naming it."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from meshlm import sources
    from meshlm.checkpoint import Checkpointer
    from meshlm.config import CheckpointConfig, DataConfig, OptimConfig, RunConfig, TrainConfig
    from meshlm.inference import load_model
    from meshlm.interop import hf_tables
    from meshlm.interop.convert import export_hf
    from meshlm.trainer import train

    is_spec = lambda x: hasattr(x, "axes")
    base = tmp_path / "base"
    shutil.copytree(hf_llama, base)
    model = dataclasses.replace(hf_tables.model_config(base), lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wv"))
    cfg = validate(
        RunConfig(
            model=model,
            data=DataConfig(
                paths=(str(base / "corpus.txt"),), tokenizer=str(base / "tokenizer.json"), cache_dir=str(tmp_path / "c")
            ),
            train=TrainConfig(steps=2, global_batch=4, seq_len=32, log_every=1, eval_every=0),
            optim=OptimConfig(lr=5e-2, warmup_steps=0),
            checkpoint=CheckpointConfig(every=0, keep=2),
        )
    )
    run = tmp_path / "run"
    train(cfg, run, quiet=True, init_from=f"hf:{base}", stop_after=1)
    meta = Checkpointer(run / "checkpoints", cfg.checkpoint, log=lambda _: None, read_only=True).read_meta(1)
    saved = [k for k in meta["tensors"] if k.startswith("params/")]
    assert sorted(saved) == [f"params/layers/{t}_lora_{ab}" for t in ("wq", "wv") for ab in "ab"]
    assert meta["base"]["source"] == f"hf:{base.absolute()}"
    assert set(meta["base"]["checksums"]) == set(named_leaves(lora.without_adapters(load_model(run).params)))

    weights = load_file(base / "model.safetensors")
    name = next(k for k in weights if "q_proj" in k)
    weights[name] = weights[name] + np.float32(1e-3)
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="is not the one this run's adapters were trained on: 1 of"):
        train(cfg, run, quiet=True)
    shutil.rmtree(base)
    with pytest.raises(ConfigError, match=r"its base hf:.* cannot be read"):
        load_model(run)
    export_hf(run, tmp_path / "adapter", peft=True, log=lambda _: None)  # a PEFT export reads no base
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base_model = sources.base_run_config(cfg).model
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), param_specs(base_model), is_leaf=is_spec)
    with pytest.raises(ConfigError, match="holds the adapters only; fold them"):  # --init-from a LoRA run
        sources.source_params(str(run), sources.base_run_config(cfg), shapes)

    # no --init-from: the base is train.seed's initialisation, drawn again and checked
    fresh = tmp_path / "fresh"
    corpus, tok = str(hf_llama / "corpus.txt"), str(hf_llama / "tokenizer.json")
    data = dataclasses.replace(cfg.data, paths=(corpus,), tokenizer=tok)
    seeded = dataclasses.replace(cfg, data=data)
    train(seeded, fresh, quiet=True, stop_after=1)
    got = named_leaves(load_model(fresh).params)
    want = named_leaves(jax.jit(lambda k: init_params(param_specs(cfg.model), k))(jax.random.key(cfg.train.seed)))
    for k, w in want.items():
        if "_lora_" not in k:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(w), err_msg=k)


# each meshlm target's module in `transformers`' Llama layer
LLAMA_MODULES = {
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}


def _peft_dropout_logits(hf_llama, run, tokens, p: float, key):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_llama), run)
    return peft_logits_with_masks(model, LLAMA_MODULES, tokens, p, key)


def test_lora_dropout_sits_where_peft_puts_it(hf_llama, tmp_path):
    """With the same keep masks, meshlm's training forward with `lora_dropout` equals `peft`'s in
    train mode (its dropout modules given meshlm's masks): the mask multiplies each adapter's input
    only, per target, scaled by 1 / (1 - p); the base path and the other targets see x whole."""
    from meshlm.inference import load_model
    from meshlm.interop import hf

    base = load_model(f"hf:{hf_llama}")
    model = dataclasses.replace(
        base.cfg.model, lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS["llama"], lora_dropout=0.5
    )
    cfg = validate(dataclasses.replace(base.cfg, model=model))
    params = lora.with_adapters(jax.device_get(base.params), adapted_params(cfg, seed=3))
    hf.save_peft(params, cfg.model, tmp_path / "adapter", str(hf_llama), log=lambda _: None)
    tokens = np.random.default_rng(6).integers(0, 300, (2, 24)).astype(np.int32)
    key = jax.random.key(11)
    ours = np.asarray(forward(params, tokens, cfg.model, None, key=key))
    theirs = _peft_dropout_logits(hf_llama, tmp_path / "adapter", tokens, 0.5, key)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert not np.allclose(ours, np.asarray(forward(params, tokens, cfg.model, None)), atol=1e-3)  # it drops
