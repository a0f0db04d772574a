"""What a Hugging Face model is in meshlm's terms, for GPT-2 (`gpt`) and Llama-family (`llama`)
models: the weight table and the config.json mapping, both ways.

One table per family (`rules`) says, for every meshlm parameter, which Hugging Face tensor holds
it (one per layer for the stacked layer weights), whether it is transposed (torch `Linear` stores
[out, in]; GPT-2's `Conv1D` stores [in, out]) and, for GPT-2's fused `c_attn`, which third it is.
Import and export both read that table, so they cannot drift apart.

`model_config` reads config.json value by value (each checked; unsupported architectures or options
are named); `hf_config` writes it. The files themselves are `hf.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.config import ConfigError, ModelConfig
from meshlm.interop import hf_deepseek
from meshlm.interop import safetensors_io as st
from meshlm.interop.hf_moe import MOE_TYPES, moe_rules
from meshlm.interop.hf_moe import hf_fields as moe_hf_fields
from meshlm.interop.hf_moe import model_fields as moe_fields


@dataclass(frozen=True)
class Rule:
    """One meshlm parameter <- one Hugging Face tensor (per layer when `layered`).

    HF -> meshlm: take `part` of `parts` equal chunks of the last axis, transpose if `transpose`,
    reshape to the parameter's per-layer shape. meshlm -> HF is the inverse."""

    leaf: str  # meshlm name, e.g. "layers/wq"
    hf: str  # Hugging Face name, "{i}" standing for the layer index
    hf_shape: tuple[int, ...]  # the whole Hugging Face tensor
    transpose: bool = False
    part: int = 0
    parts: int = 1
    experts: int = 0  # > 0: one tensor per layer and expert, "{e}" standing for the expert index
    layers: tuple[int, ...] | None = None  # the HF layer at each place of the stack (None: all, in order)
    rows: tuple[int, ...] | None = None  # the HF tensor's rows (axis 0) this leaf holds, in its order (None: all)

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf

    def indices(self, n_layers: int) -> list:
        """Where each of `names` sits in the stacked parameter: None (unstacked), the layer i, or
        (i, e) for expert e of layer i (places in the stack: `layers` maps them to HF's layers)."""
        if not self.layered:
            return [None]
        n = n_layers if self.layers is None else len(self.layers)
        if self.experts:
            return [(i, e) for i in range(n) for e in range(self.experts)]
        return list(range(n))

    def name(self, index) -> str:
        if index is None:
            return self.hf
        i, e = index if isinstance(index, tuple) else (index, None)
        return self.hf.format(i=i if self.layers is None else self.layers[i], e=e)

    def names(self, n_layers: int) -> list[str]:
        return [self.name(ix) for ix in self.indices(n_layers)]

    def part_shape(self) -> tuple[int, ...]:
        if self.rows is not None:
            return (len(self.rows), *self.hf_shape[1:])
        *lead, last = self.hf_shape
        return (*lead, last // self.parts)

    def to_meshlm(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if self.rows is not None:
            x = x[np.asarray(self.rows)]
        if self.parts > 1:
            w = x.shape[-1] // self.parts
            x = x[..., self.part * w : (self.part + 1) * w]
        return (x.T if self.transpose else x).reshape(shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """This parameter's (per-layer) value as its chunk of the Hugging Face tensor."""
        p = self.part_shape()
        return x.reshape(p[::-1]).T if self.transpose else x.reshape(p)


def rules(cfg: ModelConfig, interleaved: bool = True) -> list[Rule]:
    """The table of `cfg`'s tensors. `interleaved`: an MLA model's rotated rows are stored in
    interleaved pairs (DeepSeek-V3's `rope_interleave`, `hf_deepseek`)."""
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head, cfg.ffn, cfg.vocab_size
    if cfg.family == "gpt":
        t = "transformer.h.{i}."
        out = [
            Rule("wte", "transformer.wte.weight", (V, D)),
            Rule("wpe", "transformer.wpe.weight", (cfg.max_seq_len, D)),
            Rule("ln_f_scale", "transformer.ln_f.weight", (D,)),
            Rule("ln_f_bias", "transformer.ln_f.bias", (D,)),
            Rule("layers/ln1_scale", t + "ln_1.weight", (D,)),
            Rule("layers/ln1_bias", t + "ln_1.bias", (D,)),
            Rule("layers/ln2_scale", t + "ln_2.weight", (D,)),
            Rule("layers/ln2_bias", t + "ln_2.bias", (D,)),
            Rule("layers/wo", t + "attn.c_proj.weight", (D, D)),  # Conv1D: [in, out]
            Rule("layers/bo", t + "attn.c_proj.bias", (D,)),
            Rule("layers/w_fc", t + "mlp.c_fc.weight", (D, F)),
            Rule("layers/b_fc", t + "mlp.c_fc.bias", (F,)),
            Rule("layers/w_proj", t + "mlp.c_proj.weight", (F, D)),
            Rule("layers/b_proj", t + "mlp.c_proj.bias", (D,)),
        ]
        for j, n in enumerate("qkv"):  # c_attn = [q | k | v] along its output axis
            out.append(Rule(f"layers/w{n}", t + "attn.c_attn.weight", (D, 3 * D), part=j, parts=3))
            out.append(Rule(f"layers/b{n}", t + "attn.c_attn.bias", (3 * D,), part=j, parts=3))
        return out
    m = "model.layers.{i}."
    out = [Rule("wte", "model.embed_tokens.weight", (V, D)), Rule("final_norm", "model.norm.weight", (D,))]
    stacks = [("layers", cfg.moe, cfg.moe_layer_ids if cfg.dense_layer_ids else None)]
    if cfg.dense_layer_ids:  # an MoE model's dense layers, stacked apart
        stacks.append(("dense_layers", False, cfg.dense_layer_ids))
    if cfg.mtp_depth and cfg.mla:  # DeepSeek-V3's multi-token-prediction modules: the layers after the model's
        stacks.append(("mtp", cfg.moe, tuple(range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth))))
        out += [dataclasses.replace(r, layers=stacks[-1][2]) for r in hf_deepseek.mtp_rules(cfg, m, Rule)]
    for stack, moe, ids in stacks:
        layer = [
            Rule("attn_norm", m + "input_layernorm.weight", (D,)),
            Rule("mlp_norm", m + "post_attention_layernorm.weight", (D,)),
        ]
        if cfg.mla:  # DeepSeek-V3's
            layer += hf_deepseek.mla_rules(cfg, m, Rule, interleaved)
        else:
            layer += [
                Rule("wq", m + "self_attn.q_proj.weight", (N * H, D), transpose=True),
                Rule("wk", m + "self_attn.k_proj.weight", (K * H, D), transpose=True),
                Rule("wv", m + "self_attn.v_proj.weight", (K * H, D), transpose=True),
                Rule("wo", m + "self_attn.o_proj.weight", (D, N * H), transpose=True),
            ]
        if cfg.qkv_bias:
            widths = (N * H, K * H, K * H)
            layer += [Rule(f"b{n}", m + f"self_attn.{n}_proj.bias", (w,)) for n, w in zip("qkv", widths, strict=True)]
        if cfg.qk_norm:
            layer += [Rule(f"{n}_norm", m + f"self_attn.{n}_norm.weight", (H,)) for n in "qk"]
        if moe:
            layer += hf_deepseek.moe_rules(cfg, m, Rule) if cfg.mla else moe_rules(cfg, m, Rule)
        else:
            layer += [
                Rule("w_gate", m + "mlp.gate_proj.weight", (F, D), transpose=True),
                Rule("w_up", m + "mlp.up_proj.weight", (F, D), transpose=True),
                Rule("w_down", m + "mlp.down_proj.weight", (D, F), transpose=True),
            ]
        named = [r if "/" in r.leaf else dataclasses.replace(r, leaf=f"{stack}/{r.leaf}") for r in layer]
        out += [dataclasses.replace(r, layers=ids) for r in named]
    if not cfg.tied_embeddings:
        out.append(Rule("lm_head", "lm_head.weight", (V, D), transpose=True))
    return out


# ------------------------------------------------------------------------------------ config.json


class _Fields:
    """Typed, checked reads of config.json values; every error names the file and the key."""

    def __init__(self, data: dict, path: Path):
        self.data, self.path = data, path

    def _bad(self, key: str, want: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key} must be {want}, got {self.data.get(key)!r}")

    def int(self, key: str, default: Any = None, minimum: int = 1) -> int:
        v = self.data.get(key, default)
        if v is None and default is None:
            raise ConfigError(f"{self.path}: missing required key {key!r}")
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self._bad(key, f"an integer >= {minimum}")
        return v

    def float(self, key: str, default: Any = None, low: float = 0.0, high: float = math.inf, data=None) -> float:
        src = self.data if data is None else data
        v = src.get(key, default)
        if v is None:
            raise ConfigError(f"{self.path}: missing required key {key!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low <= v <= high) or not math.isfinite(v):
            raise ConfigError(f"{self.path}: {key} must be a finite number in [{low}, {high}], got {v!r}")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self.data.get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def require(self, key: str, allowed: tuple, default: Any) -> None:
        """Options meshlm's model does not implement: accepted only at the values it computes."""
        v = self.data.get(key, default)
        if v not in allowed:
            raise ConfigError(
                f"{self.path}: {key}={v!r} is not supported by meshlm's {self.data.get('model_type')} model "
                f"(supported: {', '.join(map(repr, allowed))})"
            )


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: a Hugging Face model directory needs config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def model_config(hf_dir: str | Path) -> ModelConfig:
    """meshlm's ModelConfig for a Hugging Face directory's config.json, every value checked."""
    path = Path(hf_dir).expanduser() / "config.json"
    data = read_json(path)
    f = _Fields(data, path)
    kind = data.get("model_type")
    if kind == "gpt2":
        f.require("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
        f.require("scale_attn_weights", (True,), True)
        f.require("scale_attn_by_inverse_layer_idx", (False,), False)
        f.require("add_cross_attention", (False,), False)
        f.require("tie_word_embeddings", (True,), True)
        d, n = f.int("n_embd"), f.int("n_head")
        if d % n:
            raise ConfigError(f"{path}: n_embd={d} is not divisible by n_head={n}")
        inner = data.get("n_inner")
        cfg = ModelConfig(
            family="gpt",
            vocab_size=f.int("vocab_size"),
            d_model=d,
            n_layers=f.int("n_layer"),
            n_heads=n,
            d_ff=4 * d if inner is None else f.int("n_inner"),
            max_seq_len=f.int("n_positions"),
            dropout=f.float("resid_pdrop", 0.1, 0.0, 0.99),
            norm_eps=f.float("layer_norm_epsilon", 1e-5, 0.0, 1.0),
        )
    elif hf_deepseek.is_deepseek_v3(data):  # Kimi K2's too
        cfg = ModelConfig(**hf_deepseek.model_fields(data, f, path), **_rope(data, f, path, yarn=True))
    elif kind in ("llama", *MOE_TYPES):
        f.require("hidden_act", ("silu",), "silu")
        if kind != "qwen3_moe":  # hf_moe checks Qwen3-MoE's
            f.require("attention_bias", (False,), False)
        f.require("mlp_bias", (False,), False)
        d, n = f.int("hidden_size"), f.int("num_attention_heads")
        kv = f.int("num_key_value_heads", n)
        if data.get("head_dim") is None:  # Mixtral writes null: d / n
            data = {k: v for k, v in data.items() if k != "head_dim"}
            f = _Fields(data, path)
        head_dim = f.int("head_dim", d // n if d % n == 0 else None)
        if n % kv:
            raise ConfigError(f"{path}: num_attention_heads={n} is not a multiple of num_key_value_heads={kv}")
        if head_dim % 2:
            raise ConfigError(f"{path}: head_dim={head_dim} must be even for rotary embeddings")
        rope = _rope(data, f, path)
        cfg = ModelConfig(
            family="llama",
            vocab_size=f.int("vocab_size"),
            d_model=d,
            n_layers=f.int("num_hidden_layers"),
            n_heads=n,
            n_kv_heads=kv,
            head_dim=head_dim if head_dim != d // n or d % n else 0,
            d_ff=f.int("intermediate_size"),
            max_seq_len=f.int("max_position_embeddings", 2048),
            norm_eps=f.float("rms_norm_eps", 1e-6, 0.0, 1.0),
            tie_embeddings=f.flag("tie_word_embeddings", False),
            **rope,
            **(moe_fields(kind, data, f, path) if kind in MOE_TYPES else {}),
        )
    else:
        arch = data.get("architectures")
        raise ConfigError(
            f"{path}: model_type {kind!r} ({arch}) is not supported; meshlm converts 'gpt2' (GPT2LMHeadModel), "
            "'llama' (LlamaForCausalLM), 'mixtral' (MixtralForCausalLM), 'qwen3_moe' (Qwen3MoeForCausalLM) and "
            "'qwen2_moe' (Qwen2MoeForCausalLM) and 'deepseek_v3' or 'kimi_k2' (DeepseekV3ForCausalLM) checkpoints"
        )
    return cfg


def _rope(data: dict, f: _Fields, path: Path, yarn: bool = False) -> dict:
    """RoPE settings from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`;
    YaRN where `yarn` (DeepSeek-V3's; the Llama family's is not checked against transformers)."""
    params = data.get("rope_parameters")
    scaling = data.get("rope_scaling")
    for name, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"{path}: {name} must be an object, got {v!r}")
    src = params or scaling or {}
    theta = f.float("rope_theta", 10000.0, 1.0, data=params) if params else f.float("rope_theta", 10000.0, 1.0)
    kind = src.get("rope_type", src.get("type", "default"))
    if kind in (None, "default"):
        return {"rope_theta": theta}
    if kind == "yarn" and yarn:
        return _yarn(src, f, theta, path)
    if kind != "llama3":
        also = " and 'yarn' (DeepSeek-V3)" if not yarn else ""
        raise ConfigError(f"{path}: RoPE type {kind!r} is not supported (meshlm implements 'default', 'llama3'{also})")
    out = {
        "rope_theta": theta,
        "rope_scaling": "llama3",
        "rope_factor": f.float("factor", None, 1.0, data=src),
        "rope_low_freq_factor": f.float("low_freq_factor", None, 1e-9, data=src),
        "rope_high_freq_factor": f.float("high_freq_factor", None, 1e-9, data=src),
    }
    original = src.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"{path}: original_max_position_embeddings must be a positive integer, got {original!r}")
    if out["rope_low_freq_factor"] >= out["rope_high_freq_factor"]:
        raise ConfigError(f"{path}: low_freq_factor must be below high_freq_factor")
    return out | {"rope_original_len": original}


def _yarn(src: dict, f: _Fields, theta: float, path: Path) -> dict:
    """YaRN's settings (`ModelConfig.rope_scaling` "yarn"); an explicit attention_factor is refused."""
    if src.get("attention_factor") is not None:
        raise ConfigError(f"{path}: YaRN's attention_factor is derived from mscale and mscale_all_dim in meshlm")
    if src.get("truncate", True) is not True:
        raise ConfigError(f"{path}: YaRN with truncate={src['truncate']!r}: meshlm rounds the ramp's ends (true)")
    original = src.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"{path}: original_max_position_embeddings must be a positive integer, got {original!r}")
    return {
        "rope_theta": theta,
        "rope_scaling": "yarn",
        "rope_factor": f.float("factor", None, 1.0, data=src),
        "rope_original_len": original,
        "yarn_beta_fast": f.float("beta_fast", 32.0, 1e-9, data=src),
        "yarn_beta_slow": f.float("beta_slow", 1.0, 1e-9, data=src),
        "yarn_mscale": f.float("mscale", 0.0, 0.0, data=src),  # missing: unset (transformers' None), not 1
        "yarn_mscale_all_dim": f.float("mscale_all_dim", 0.0, 0.0, data=src),
    }


def hf_rope(cfg: ModelConfig) -> dict:
    """config.json's `rope_parameters` (transformers >= 5)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        return rope | {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_len,
        }
    if cfg.rope_scaling == "yarn":
        return rope | {
            "rope_type": "yarn",
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_len,
            "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow,
            "mscale": cfg.yarn_mscale,
            "mscale_all_dim": cfg.yarn_mscale_all_dim,
        }
    return rope


def hf_config(cfg: ModelConfig, bos: int | None, eos: int | None, dtype: str, max_positions: int = 0) -> dict:
    """config.json for `transformers` (GPT2LMHeadModel / LlamaForCausalLM). `max_positions`: llama's
    max_position_embeddings (meshlm's max_seq_len only sizes gpt's position table)."""
    if dtype not in st.EXPORT_DTYPES:
        raise ConfigError(f"cannot export weights as {dtype!r}; choose from {', '.join(st.EXPORT_DTYPES)}")
    torch_dtype = dtype  # transformers names dtypes as meshlm does
    if cfg.family == "gpt":
        if cfg.kv_heads != cfg.n_heads or cfg.dim_head * cfg.n_heads != cfg.d_model:
            raise ConfigError("GPT-2 has neither grouped KV heads nor head_dim != d_model / n_heads; cannot export")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True,
            "tie_word_embeddings": True,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "dtype": torch_dtype,
            "torch_dtype": torch_dtype,  # transformers 4's name
        }
    rope = hf_rope(cfg)
    common = {
        "max_position_embeddings": max(cfg.max_seq_len, max_positions),
        "rope_parameters": rope,  # transformers >= 5
        "rope_theta": cfg.rope_theta,  # older readers (transformers 4, vLLM, llama.cpp's converter)
        "rope_scaling": None if cfg.rope_scaling == "none" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": torch_dtype,
        "torch_dtype": torch_dtype,
    }
    if cfg.mla:
        return hf_deepseek.hf_fields(cfg) | common
    if cfg.mtp_depth or cfg.rope_scaling == "yarn":
        raise ConfigError(
            "multi-token prediction and YaRN export only as DeepSeek-V3 (an MLA model); for a Llama-family "
            "checkpoint set model.mtp_depth=0 (the modules are dropped) and keep RoPE default or llama3"
        )
    if (cfg.qk_norm or cfg.qkv_bias or cfg.shared_ffn) and not cfg.moe:
        raise ConfigError("a dense llama-family model with q/k norms, QKV biases or shared experts has no export")
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_head,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tied_embeddings,
    } | common
    return out | moe_hf_fields(cfg) if cfg.moe else out


def with_model(cfg_run, model: ModelConfig):
    """A run config whose model section is `model`, keeping the run's compute dtype, attention
    kind and layer unrolling (how to run the model, not what it is)."""
    keep = {
        k: getattr(cfg_run.model, k)
        for k in ("dtype", "attention", "attention_block", "attention_chunk", "scan_unroll")
    }
    return dataclasses.replace(cfg_run, model=dataclasses.replace(model, **keep))
