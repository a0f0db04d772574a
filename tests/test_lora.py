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

from helpers import random_batches, save_tiny_llama, tiny_config
from meshlm import accounting
from meshlm.config import ConfigError, ParallelConfig, RematConfig
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


def test_the_base_has_no_gradient_and_no_optimizer_state():
    """In the compiled gradient step of a LoRA run, every matmul that makes a weight-shaped output
    (neither dimension the batch's rows) has the rank as a dimension: the frozen weights' d_in x
    d_out gradient GEMMs are not in the program (full fine-tuning's are: the check fails there; the
    program's exact GEMM FLOPs: tests/test_flops.py). Adam's moments exist for the adapters only."""
    cfg = lora_config("llama")
    full = validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=0)))
    layout = make_layout(cfg.parallel, jax.devices()[:1])
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), random_batches(cfg, 1)[0])
    rows, r = cfg.train.global_batch * cfg.train.seq_len, cfg.model.lora_rank

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


def test_config_errors():
    cfg = tiny_config("llama")
    bad = lambda **m: validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=4, **m)))
    with pytest.raises(ConfigError, match="lora_targets"):
        bad(lora_targets=("w_fc",))
    moe = dataclasses.replace(cfg.model, n_experts=4, lora_rank=4, lora_targets=("wq", "w_gate"))
    with pytest.raises(ConfigError, match="experts are not built yet"):
        validate(dataclasses.replace(cfg, model=moe))
    piped = dataclasses.replace(
        cfg,
        parallel=ParallelConfig(stage=2),
        model=dataclasses.replace(cfg.model, lora_rank=4, n_layers=2),
        train=dataclasses.replace(cfg.train, microbatches=2),
    )
    with pytest.raises(ConfigError, match="LoRA inside pipelines"):
        validate(piped)


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
