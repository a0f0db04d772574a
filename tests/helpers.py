"""Small shared builders for tests: tiny configs and a few-step training run on any mesh."""

from __future__ import annotations

import os

import jax
import numpy as np

from meshlm.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.parallel.mesh import make_layout
from meshlm.step import make_train_step
from meshlm.train_state import init_state, placement, setup
from meshlm.validation import validate

MESHES = {
    "single": dict(data=1),
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "data2_tensor4": dict(data=2, tensor=4),
    "fsdp2_tensor4": dict(fsdp=2, tensor=4),
}


def p2_gpt_model(d_model: int, n_heads: int, n_layers: int) -> ModelConfig:
    """A GPT of P2's Table 3 as the paper ran it: bf16, dropout 0.1, s = 2048, v = 51200, explicit
    attention over the whole s x s score matrix (`attention_chunk=0`)."""
    return ModelConfig(
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        vocab_size=51200,
        max_seq_len=2048,
        dropout=0.1,
        dtype="bfloat16",
        attention_chunk=0,
    )


def tiny_config(family: str = "gpt", mesh: dict | None = None, n_layers: int = 2, **train) -> RunConfig:
    model = ModelConfig(
        family=family,
        vocab_size=256,
        d_model=64,
        n_layers=n_layers,
        n_heads=4 if family == "gpt" else 8,
        n_kv_heads=4,  # llama: 8 query heads share 4 kv heads (GQA), still divisible by tensor=4
        max_seq_len=32,
        dropout=0.1 if family == "gpt" else 0.0,
        attention_chunk=16,  # explicit attention in two query chunks at seq_len 32, as longer runs go
    )
    tc = dict(steps=3, global_batch=8, seq_len=32, microbatches=1) | train
    return validate(RunConfig(model=model, parallel=ParallelConfig(**(mesh or {})), train=TrainConfig(**tc)))


def random_batches(cfg: RunConfig, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1))
        toks = toks.astype(np.int32)
        out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    return out


def loss_mask(shape: tuple[int, int], seed: int = 4) -> np.ndarray:
    """A loss mask as packed chat rows have: about 60% of the targets trained, none in the second
    half of row 0 (int32, as the loader gives it)."""
    mask = (np.random.default_rng(seed).random(shape) < 0.6).astype(np.int32)
    mask[0, shape[1] // 2 :] = 0
    return mask


def save_tiny_llama(root, tok, eos_token: str, vocab_size: int = 320, std: float | None = None) -> None:
    """A random-weight 2-layer Llama (d 64, 4 heads, 2 kv heads, 64 positions) made by `transformers`
    with `tok` (a `tokenizers.Tokenizer`) as its tokenizer, saved to `root` as Hugging Face saves it.
    `std`: weights drawn N(0, std) instead of the default initialisation."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token).save_pretrained(root)
    eos = tok.token_to_id(eos_token)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, std)
    model.save_pretrained(root)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a `meshlm` subprocess: this one's, with the test XLA flags (conftest) but
    no simulated device count (the CLI sets its own from --mesh / --devices)."""
    from meshlm.platform.xla_flags import without_device_count

    return dict(os.environ) | {"XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS", ""))} | extra


def build(cfg: RunConfig):
    devices = jax.devices()[: cfg.parallel.n_devices]
    layout = make_layout(cfg.parallel, devices)
    specs, tx, shardings = setup(cfg, layout)
    state = init_state(specs, layout, tx, cfg.train.seed, **placement(cfg))
    return layout, specs, tx, shardings, state


def train_steps(cfg: RunConfig, batches) -> tuple[object, list[float], object, object]:
    """Train len(batches) steps; returns (final state, losses, the jitted step, its layout)."""
    layout, _, tx, shardings, state = build(cfg)
    step = make_train_step(cfg, layout, tx, shardings)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state, losses, step, layout


def run_steps(cfg: RunConfig, batches) -> tuple[list[float], dict, object]:
    """Train len(batches) steps; returns (losses, final params as numpy, final state)."""
    state, losses, *_ = train_steps(cfg, batches)
    return losses, jax.tree.map(np.asarray, state.params), state


def logged_losses(run_dir) -> dict[int, float]:
    """{step: loss} from a run's metrics.jsonl; a step logged twice (a resumed run redoing it)
    keeps its last value."""
    import json

    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


# A small DeepSeek-V3 for `transformers.DeepseekV3Config` (tests/test_hf_moe.py, tests/test_deepseek.py): MLA with
# q LoRA, a query-key head of 8 + 4, values of 6, YaRN (mscale_all_dim != mscale: both factors matter), a dense
# first layer, sigmoid routing over 2 groups, a shared expert
DEEPSEEK_HF = dict(
    vocab_size=64,
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    moe_intermediate_size=16,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    max_position_embeddings=64,
    rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.7
    )
    | dict(rope_theta=100.0),
    bos_token_id=1,
    eos_token_id=2,
)


def peft_logits_with_masks(model, modules: dict[str, str], tokens: np.ndarray, p: float, key) -> np.ndarray:
    """`peft` `model`'s logits in train mode, each adapted module's dropout replaced by meshlm's keep
    mask for that layer and target (fold_in(fold_in(key, layer), its site), drawn over the module's
    input). `modules`: each meshlm target's module path in a `transformers` decoder layer."""
    import torch

    from meshlm.model.transformer import _LORA_SITES

    class Fixed(torch.nn.Module):
        def __init__(self, keep):
            super().__init__()
            self.keep = torch.from_numpy(keep.astype(np.float32))

        def forward(self, x):
            return x * self.keep.reshape(x.shape) / (1 - p)

    model.train()
    for i, layer in enumerate(model.base_model.model.model.layers):
        for target, path in modules.items():
            module = layer.get_submodule(path)
            shape = (*tokens.shape, module.in_features)
            site = jax.random.fold_in(jax.random.fold_in(key, i), _LORA_SITES[target])
            module.lora_dropout["default"] = Fixed(np.asarray(jax.random.bernoulli(site, 1 - p, shape)))
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()
