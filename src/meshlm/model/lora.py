"""LoRA adapters (`model.lora_rank`): folding them into their base weights, and the PEFT layout.

The adapters of projection W (`model.params.lora_specs`) are A [L, *in, r] and B [L, r, *out]; the
layer computes x W + (alpha / r) (x A) B (`layers.lora_delta`). Merged, W' = W + (alpha / r) A B:
the same function with no adapters, which `convert --to-hf` writes. `peft` stores A as
lora_A.weight [r, in] and B as lora_B.weight [out, r] per layer, and scales by lora_alpha / r too.
"""

from __future__ import annotations

import dataclasses
import math

from meshlm.config import ModelConfig


def widths(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's (input, output) width: an adapter is A [in, r] and B [r, out] per layer."""
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.dim_head, cfg.kv_heads * cfg.dim_head, cfg.ffn
    out = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (cfg.n_heads * cfg.value_dim, d)}
    out |= {"w_fc": (d, f), "w_proj": (f, d), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    # MLA's: the query latent and its up-projection, the key-value latent (+ the shared RoPE key)
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return out | {"wq_a": (d, cfg.q_lora_rank), "wq_b": (cfg.q_lora_rank, q), "wkv_a": (d, kv_a)}


def lora_param_count(cfg: ModelConfig) -> int:
    """The LoRA adapters' parameters (the trainable ones of a LoRA run): r (in + out) per target and layer."""
    if not cfg.lora_rank:
        return 0
    return cfg.n_layers * cfg.lora_rank * sum(sum(widths(cfg)[t]) for t in cfg.lora_targets)


def outside_regions(cfg: ModelConfig) -> bool:
    """Where the LoRA terms are computed. Without dropout, inside the tensor-parallel regions beside
    their base projections (the adapters are region weights: one input-gradient reduction for both).
    With `lora_dropout`, outside them, under GSPMD (`transformer._lora_terms`; MLA's `mla.outside`):
    the dropout bits must be those of the global tensor, which a region (manual over every axis) does
    not see; x A then moves between devices as a rank-r tensor, not a d-wide one (MLA's query latent,
    and wkv_a's term, enter its region as latent-wide ones)."""
    return cfg.lora_rank > 0 and cfg.lora_dropout > 0


def recompute_flops_per_token(cfg: ModelConfig) -> int:
    """Forward FLOPs per token that `lora_dropout`'s rematerialised terms run again in the backward
    pass: x A of every target (2 r in per target and layer); none without dropout."""
    if not outside_regions(cfg):
        return 0
    return 2 * cfg.n_layers * cfg.lora_rank * sum(widths(cfg)[t][0] for t in cfg.lora_targets)


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The model without adapters."""
    return dataclasses.replace(cfg, lora_rank=0)


STACKS = ("layers", "dense_layers")  # the stacked layers that carry adapters (an MoE model's dense ones too)


def _stacks(params: dict) -> tuple[str, ...]:
    """The stacked layers of a parameter tree: "layers", and an MoE model's "dense_layers"."""
    return tuple(s for s in STACKS if s in params)


def adapters(params: dict) -> dict:
    """The adapters of a parameter-shaped tree, {"layers": {"<target>_lora_a": ..., ...}} (and
    "dense_layers": ... for an MoE model's dense layers): all that a LoRA run trains, and all its
    checkpoints hold."""
    return {s: {k: v for k, v in params[s].items() if "_lora_" in k} for s in _stacks(params)}


def without_adapters(params: dict) -> dict:
    """Every leaf but the adapters: the frozen base."""
    return params | {s: {k: v for k, v in params[s].items() if "_lora_" not in k} for s in _stacks(params)}


def with_adapters(base: dict, adapted: dict) -> dict:
    """The base's leaves with `adapted`'s adapters added (or replacing the base tree's own)."""
    return base | {s: base[s] | a for s, a in adapters(adapted).items()}


def delta(a, b, shape: tuple[int, ...]):
    """(A B) of stacked adapters, shaped as the stacked base weight `shape` [L, *in, *out]."""
    import jax.numpy as jnp

    n, r = a.shape[0], a.shape[-1]
    a2 = a.reshape(n, math.prod(a.shape[1:-1]), r)
    b2 = b.reshape(n, r, math.prod(b.shape[2:]))
    return jnp.einsum("lir,lro->lio", a2, b2).reshape(shape)


def merged(params: dict, cfg: ModelConfig) -> tuple[dict, ModelConfig]:
    """(the parameters with every adapter folded into its base weight, the base model's config);
        unchanged without LoRA. One jitted fold per target, on the arrays' own sharding. (JAX is imported
    here, not at the top: `lora_param_count` serves `accounting`, which imports no JAX.)"""
    if not cfg.lora_rank:
        return params, cfg
    import jax

    fold = jax.jit(lambda w, a, b: w + cfg.lora_scale * delta(a, b, w.shape).astype(w.dtype))
    out = dict(params)
    for stack in _stacks(params):
        layers = dict(params[stack])
        for name in cfg.lora_targets:
            a, b = layers.pop(f"{name}_lora_a"), layers.pop(f"{name}_lora_b")
            layers[name] = fold(layers[name], a, b)
        out[stack] = layers
    return out, base_config(cfg)
