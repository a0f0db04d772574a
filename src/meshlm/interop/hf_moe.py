"""Mixture-of-Experts models in Hugging Face's terms: Mixtral (`MixtralForCausalLM`), Qwen3-MoE
(`Qwen3MoeForCausalLM`: q/k norms, softmax-then-top-k routing) and Qwen2-MoE
(`Qwen2MoeForCausalLM`: QKV biases, one sigmoid-gated shared expert). Their attention is Llama's,
so `hf_tables` handles the rest; here are the expert tensors, the config.json keys, and which
architecture a meshlm MoE model exports as.

The files store one tensor per layer and expert (`...experts.{e}.w1.weight`); meshlm stacks them
into [layers, experts, ...] parameters sharded over the `expert` axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.config import ConfigError, ModelConfig

MOE_TYPES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def moe_rules(cfg: ModelConfig, m: str, rule: type) -> list:
    """The router, expert and shared-expert tensors of layer prefix `m` ("model.layers.{i}.") as
    `rule` (hf_tables.Rule) rows, in the naming of the architecture `cfg` exports as."""
    D, E, F = cfg.d_model, cfg.n_experts, cfg.expert_ffn
    kind = architecture(cfg)[1]
    if kind == "mixtral":
        block = m + "block_sparse_moe."
        gate, expert, names = block + "gate.weight", block + "experts.{e}.", ("w1", "w3", "w2")
    else:
        gate, expert, names = m + "mlp.gate.weight", m + "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")
    g, u, d = (expert + n + ".weight" for n in names)
    out = [
        rule("layers/w_router", gate, (E, D), transpose=True),
        rule("layers/we_gate", g, (F, D), transpose=True, experts=E),
        rule("layers/we_up", u, (F, D), transpose=True, experts=E),
        rule("layers/we_down", d, (D, F), transpose=True, experts=E),
    ]
    if cfg.shared_ffn:
        S, shared = cfg.shared_ffn, m + "mlp.shared_expert."
        out += [
            rule("layers/ws_gate", shared + "gate_proj.weight", (S, D), transpose=True),
            rule("layers/ws_up", shared + "up_proj.weight", (S, D), transpose=True),
            rule("layers/ws_down", shared + "down_proj.weight", (D, S), transpose=True),
            rule("layers/ws_router", m + "mlp.shared_expert_gate.weight", (1, D), transpose=True),
        ]
    return out


def architecture(cfg: ModelConfig) -> tuple[str, str]:
    """(architecture, model_type) a meshlm MoE model exports as; a ConfigError names what no
    supported architecture has."""
    if cfg.shared_ffn or cfg.qkv_bias:
        if not (cfg.shared_ffn and cfg.shared_expert_gate and cfg.qkv_bias) or cfg.qk_norm:
            raise ConfigError(
                "Qwen2-MoE (the architecture with shared experts) has QKV biases and one sigmoid-gated shared "
                "expert, and no q/k norms; this model differs, so it cannot be exported"
            )
        return MOE_TYPES["qwen2_moe"], "qwen2_moe"
    if cfg.qk_norm:
        return MOE_TYPES["qwen3_moe"], "qwen3_moe"
    if not cfg.router_renormalize:
        raise ConfigError(
            "an MoE model without q/k norms exports as Mixtral, whose router renormalises the top-k weights; "
            "set model.router_renormalize=true (or model.qk_norm=true for Qwen3-MoE)"
        )
    if cfg.dense_layer_ids:
        raise ConfigError(
            "an MoE model without q/k norms exports as Mixtral, whose layers are all MoE; this one has dense layers "
            f"{list(cfg.dense_layer_ids)} (Qwen3-MoE, with model.qk_norm=true, has them)"
        )
    return MOE_TYPES["mixtral"], "mixtral"


def _experts_of(data: dict, f: Any, path: Path) -> int:
    key = next((k for k in ("num_local_experts", "num_experts") if k in data), None)
    if key is None:
        raise ConfigError(f"{path}: missing the expert count (num_local_experts or num_experts)")
    return f.int(key)


def model_fields(kind: str, data: dict, f: Any, path: Path) -> dict:
    """ModelConfig fields of an MoE config.json beyond Llama's (`f`: hf_tables._Fields)."""
    E = _experts_of(data, f, path)
    out: dict[str, Any] = {
        "n_experts": E,
        "experts_per_token": f.int("num_experts_per_tok"),
        "moe_aux_loss_coef": f.float("router_aux_loss_coef", 0.001, 0.0, 1e3),
    }
    if out["experts_per_token"] > E:
        raise ConfigError(f"{path}: num_experts_per_tok={out['experts_per_token']} exceeds the {E} experts")
    if kind == "mixtral":
        f.require("sliding_window", (None,), None)
        return out | {"expert_d_ff": f.int("intermediate_size"), "router_renormalize": True}
    # Qwen: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    # (the others: a SwiGLU of intermediate_size); no sliding window
    dense = data.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)):
        raise ConfigError(f"{path}: mlp_only_layers={dense!r} must be a list of layer indices")
    f.require("use_sliding_window", (False,), False)
    out |= {"expert_d_ff": f.int("moe_intermediate_size"), "router_renormalize": f.flag("norm_topk_prob", False)}
    out |= {"moe_layer_step": f.int("decoder_sparse_step", 1), "dense_layers": tuple(sorted(dense))}
    if kind == "qwen3_moe":
        f.require("attention_bias", (False,), False)
        return out | {"qk_norm": True}
    return out | {
        "qkv_bias": f.flag("qkv_bias", True),
        "n_shared_experts": 1,
        "shared_expert_d_ff": f.int("shared_expert_intermediate_size"),
        "shared_expert_gate": True,
    }


def hf_fields(cfg: ModelConfig) -> dict:
    """config.json keys of an MoE model beyond Llama's, with its architecture and model_type."""
    if cfg.router_score != "softmax" or cfg.router_bias or cfg.n_group > 1 or cfg.routed_scaling_factor != 1.0:
        raise ConfigError(
            "DeepSeek-V3's routing (model.router_score=sigmoid, router_bias, n_group, routed_scaling_factor) has no "
            "export yet: Mixtral, Qwen3-MoE and Qwen2-MoE route by softmax alone, so the export would be another model"
        )
    arch, kind = architecture(cfg)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": kind,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.moe_aux_loss_coef,
        "output_router_logits": False,
    }
    if kind == "mixtral":
        return out | {"num_local_experts": cfg.n_experts, "intermediate_size": cfg.expert_ffn, "sliding_window": None}
    out |= {
        "num_experts": cfg.n_experts,
        "num_local_experts": cfg.n_experts,
        "moe_intermediate_size": cfg.expert_ffn,
        "norm_topk_prob": cfg.router_renormalize,
        "decoder_sparse_step": cfg.moe_layer_step,  # the dense layers it does not explain are listed
        "mlp_only_layers": [i for i in cfg.dense_layer_ids if (i + 1) % cfg.moe_layer_step == 0],
        "use_sliding_window": False,
    }
    if kind == "qwen2_moe":
        return out | {"qkv_bias": True, "shared_expert_intermediate_size": cfg.shared_ffn}
    return out
