"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3) in Hugging Face's terms: MLA's
tensors, dense first layers, sigmoid routing with `e_score_correction_bias`, shared experts and the
MTP layers, and its config.json: the keys that are model fields read and written from one table
(`FIELDS`, `FIXED`), the few more transformers needs written beside them (`hf_fields`).

RoPE: with `rope_interleave` (the released checkpoints' and transformers' default) the rotated
query and key dimensions are stored as interleaved pairs (x0, x1), (x2, x3), ...; meshlm rotates
halves (x0..x_{p/2-1} with x_{p/2}..), as Llama does. The two are one permutation of the rotated
rows of q_b_proj (q_proj) and kv_a_proj_with_mqa apart (`_rope_rows`): applied on import and
inverted on export, so the attention is the same function of the same numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.config import ConfigError, ModelConfig

ARCH, KIND = "DeepseekV3ForCausalLM", "deepseek_v3"
# model types of the same architecture (config keys and tensors): Moonshot's Kimi K2 (384 experts, one group)
ALSO = ("kimi_k2",)

# (config.json key, ModelConfig field, kind, transformers' DeepseekV3Config default): kinds "int" (>= 1),
# "int0" (>= 0), "rank" (null or >= 1; null is meshlm's 0), "float" (> 0), "float0" (>= 0), "bool".
# Import reads each (a missing key: transformers' default, as transformers reads it); export writes each.
FIELDS = (
    ("vocab_size", "vocab_size", "int", 129280),
    ("hidden_size", "d_model", "int", 7168),
    ("num_hidden_layers", "n_layers", "int", 61),
    ("num_attention_heads", "n_heads", "int", 128),
    ("intermediate_size", "d_ff", "int", 18432),
    ("moe_intermediate_size", "expert_d_ff", "int", 2048),
    ("n_routed_experts", "n_experts", "int", 256),
    ("num_experts_per_tok", "experts_per_token", "int", 8),
    ("n_shared_experts", "n_shared_experts", "int0", 1),
    ("first_k_dense_replace", "first_k_dense", "int0", 3),
    ("n_group", "n_group", "int", 8),
    ("topk_group", "topk_group", "int", 4),
    ("q_lora_rank", "q_lora_rank", "rank", 1536),
    ("kv_lora_rank", "kv_lora_rank", "int", 512),
    ("qk_nope_head_dim", "qk_nope_head_dim", "int0", 128),
    ("qk_rope_head_dim", "qk_rope_head_dim", "int", 64),
    ("v_head_dim", "v_head_dim", "int", 128),
    ("max_position_embeddings", "max_seq_len", "int", 4096),
    ("routed_scaling_factor", "routed_scaling_factor", "float", 2.5),
    ("rms_norm_eps", "norm_eps", "float", 1e-6),
    ("norm_topk_prob", "router_renormalize", "bool", True),
    ("tie_word_embeddings", "tie_embeddings", "bool", False),
    ("aux_loss_alpha", "moe_seq_aux_loss_coef", "float0", 0.0),  # DeepSeek's own files (with seq_aux: true)
)
# config.json values meshlm computes only as written here (import requires them; export writes them)
FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "scoring_func": "sigmoid",  # older DeepSeek config.json files name the routing; transformers assumes it
    "topk_method": "noaux_tc",
    "seq_aux": True,  # aux_loss_alpha weighs the sequence-wise balance loss
    "moe_layer_freq": 1,  # DeepSeek's and Kimi K2's files: every layer after the dense ones is MoE
}
# the ModelConfig fields every DeepSeek-V3 model has (the architecture's, not its config.json's)
MODEL = {"family": "llama", "router_score": "sigmoid", "router_bias": True}


def is_deepseek_v3(data: dict) -> bool:
    """Whether a config.json describes this architecture: model_type deepseek_v3, or one of `ALSO` whose
    architectures name DeepseekV3ForCausalLM (Kimi K2's)."""
    kind = data.get("model_type")
    return kind == KIND or (kind in ALSO and data.get("architectures") == [ARCH])


def model_fields(data: dict, f: Any, path: Path) -> dict:
    """ModelConfig fields of a DeepSeek-V3 config.json (`f`: hf_tables._Fields); RoPE is read apart.
    `mtp_depth`: the multi-token-prediction modules the weights beside it hold (at most
    num_nextn_predict_layers; none where there are no weights to look at)."""
    for key, value in FIXED.items():
        f.require(key, (value,), value)
    quant = data.get("quantization_config")
    if quant is not None and (
        not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3"
    ):
        raise ConfigError(
            f"{path}: quantization_config {quant!r}: meshlm reads FP8 E4M3 weights with block scales only"
        )
    out: dict[str, Any] = dict(MODEL) | {"moe_aux_loss_coef": 0.0}  # no Switch loss: the bias balances
    for key, field, kind, default in FIELDS:
        if kind == "bool":
            out[field] = f.flag(key, default)
        elif kind.startswith("float"):
            out[field] = f.float(key, default, 0.0 if kind == "float0" else 1e-30)
        elif kind == "rank":
            out[field] = 0 if key in data and data[key] is None else f.int(key, default)
        else:
            out[field] = f.int(key, default, 0 if kind == "int0" else 1)
    declared = f.int("num_nextn_predict_layers", 0, 0)
    out["mtp_depth"] = min(declared, mtp_layers_stored(_tensor_names(path.parent), out["n_layers"]))
    if out["first_k_dense"] > out["n_layers"]:
        raise ConfigError(f"{path}: first_k_dense_replace={out['first_k_dense']} exceeds num_hidden_layers")
    if out["experts_per_token"] > out["n_experts"] or out["n_experts"] % out["n_group"]:
        raise ConfigError(f"{path}: num_experts_per_tok and n_group must fit the {out['n_experts']} routed experts")
    return out


def hf_fields(cfg: ModelConfig) -> dict:
    """config.json keys of a DeepSeek-V3 model beyond RoPE, bos/eos and the dtype; a ConfigError
    names what the architecture cannot hold."""
    problems = [f"model.{k}={getattr(cfg, k)!r} (DeepSeek-V3: {v!r})" for k, v in MODEL.items() if getattr(cfg, k) != v]
    if not cfg.moe or cfg.moe_layer_ids != tuple(range(cfg.first_k_dense, cfg.n_layers)):
        problems.append("its MoE layers are all those from first_k_dense on (no dense_layers, moe_layer_step 1)")
    if cfg.qk_norm or cfg.qkv_bias or cfg.shared_expert_gate or cfg.rope_scaling == "llama3":
        problems.append("q/k norms, QKV biases, a shared-expert gate and llama3 RoPE scaling are not DeepSeek-V3's")
    if cfg.shared_ffn != cfg.n_shared_experts * cfg.expert_ffn:
        problems.append("its shared experts are n_shared_experts x expert_d_ff wide (model.shared_expert_d_ff=0)")
    if problems:
        raise ConfigError("this MLA model is not a DeepSeek-V3 and cannot be exported as one: " + "; ".join(problems))
    out: dict[str, Any] = {"architectures": [ARCH], "model_type": KIND, **FIXED}
    resolved = {"d_ff": cfg.ffn, "expert_d_ff": cfg.expert_ffn}  # 0 in the config: the default width
    for key, field, kind, _ in FIELDS:
        value = resolved.get(field, getattr(cfg, field))
        out[key] = None if kind == "rank" and value == 0 else value
    # what transformers needs beside them: MLA's per-head keys (import ignores it, as transformers does),
    # the RoPE row order export writes (import reads either, `hf.py`), the MTP layers written
    # (import counts the stored ones, `mtp_layers_stored`)
    return out | {
        "num_key_value_heads": cfg.n_heads,
        "rope_interleave": True,
        "num_nextn_predict_layers": cfg.mtp_depth,
    }


def _rope_rows(p: int) -> list[int]:
    """meshlm's rotated dimension i as the interleaved layout's: 2i for the first half, 2(i - p/2) + 1
    for the second."""
    return [2 * i if i < p // 2 else 2 * (i - p // 2) + 1 for i in range(p)]


def mla_rules(cfg: ModelConfig, m: str, rule: type, interleaved: bool = True) -> list:
    """The attention tensors of layer prefix `m` ("model.layers.{i}.") as `rule` (hf_tables.Rule) rows."""
    D, N, R, P = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    E, V, Q = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    rope = _rope_rows(P) if interleaved else list(range(P))
    a = m + "self_attn."
    q_rows = tuple(h * (E + P) + (i if i < E else E + rope[i - E]) for h in range(N) for i in range(E + P))
    kv_rows = (*range(R), *(R + j for j in rope))
    out = [
        rule("wkv_a", a + "kv_a_proj_with_mqa.weight", (R + P, D), transpose=True, rows=kv_rows),
        rule("kv_a_norm", a + "kv_a_layernorm.weight", (R,)),
        rule("wk_b", a + "kv_b_proj.weight", (N * (E + V), R), transpose=True, rows=_heads(N, E + V, 0, E)),
        rule("wv_b", a + "kv_b_proj.weight", (N * (E + V), R), transpose=True, rows=_heads(N, E + V, E, V)),
        rule("wo", a + "o_proj.weight", (D, N * V), transpose=True),
    ]
    if not Q:
        return [rule("wq", a + "q_proj.weight", (N * (E + P), D), transpose=True, rows=q_rows), *out]
    return [
        rule("wq_a", a + "q_a_proj.weight", (Q, D), transpose=True),
        rule("q_a_norm", a + "q_a_layernorm.weight", (Q,)),
        rule("wq_b", a + "q_b_proj.weight", (N * (E + P), Q), transpose=True, rows=q_rows),
        *out,
    ]


def _heads(n: int, width: int, start: int, size: int) -> tuple[int, ...]:
    """Rows start..start+size-1 of each head's block of `width` rows."""
    return tuple(h * width + start + i for h in range(n) for i in range(size))


def moe_rules(cfg: ModelConfig, m: str, rule: type) -> list:
    """The router, its score-correction bias, the experts and the shared experts of layer prefix `m`."""
    D, E, F, S = cfg.d_model, cfg.n_experts, cfg.expert_ffn, cfg.shared_ffn
    mlp = m + "mlp."
    out = [
        rule("w_router", mlp + "gate.weight", (E, D), transpose=True),
        rule("router_bias", mlp + "gate.e_score_correction_bias", (E,)),
    ]
    for name, hf, shape in (("gate", "gate_proj", (F, D)), ("up", "up_proj", (F, D)), ("down", "down_proj", (D, F))):
        out.append(rule(f"we_{name}", mlp + "experts.{e}." + hf + ".weight", shape, transpose=True, experts=E))
        if S:
            shared = (S, D) if name != "down" else (D, S)
            out.append(rule(f"ws_{name}", mlp + "shared_experts." + hf + ".weight", shared, transpose=True))
    return out


def mtp_rules(cfg: ModelConfig, m: str, rule: type) -> list:
    """A multi-token-prediction module's own tensors (its layer's are the usual ones), as stored in
    the released checkpoints: `model.layers.{L + k - 1}.` + enorm, hnorm, eh_proj and shared_head.norm
    (its copies of the embedding and the output layer, `embed_tokens` and `shared_head.head`, are the
    model's own: not read, not written)."""
    D = cfg.d_model
    return [
        rule("mtp/enorm", m + "enorm.weight", (D,)),
        rule("mtp/hnorm", m + "hnorm.weight", (D,)),
        rule("mtp/eh_proj", m + "eh_proj.weight", (D, 2 * D), transpose=True),
        rule("mtp/post_norm", m + "shared_head.norm.weight", (D,)),
    ]


# a module's copies of the shared embedding and output layer, which the released checkpoints hold
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _tensor_names(hf_dir: Path) -> set[str]:
    """The tensor names of a directory's safetensors files (their headers only); none without files."""
    from meshlm.interop import hf, safetensors_io

    try:
        files = hf.weight_files(hf_dir)
    except ConfigError:
        return set()
    return {name for file in files for name in safetensors_io.read_header(file)[0]}


def mtp_layers_stored(names: set[str], n_layers: int) -> int:
    """How many multi-token-prediction modules a checkpoint's tensor `names` hold (layers n_layers,
    n_layers + 1, ... with an `eh_proj`): config.json says num_nextn_predict_layers 1 even without one."""
    k = 0
    while f"model.layers.{n_layers + k}.eh_proj.weight" in names:
        k += 1
    return k
