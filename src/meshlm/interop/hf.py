"""Hugging Face checkpoints in and out: GPT-2 (`gpt`) and Llama-family (`llama`) models.

A Hugging Face model directory holds `config.json`, weights in `*.safetensors` (one file, or several
listed by `model.safetensors.index.json`), usually `generation_config.json` and tokenizer files.

One table per family (`rules`) says, for every meshlm parameter, which Hugging Face tensor holds
it (one per layer for the stacked layer weights), whether it is transposed (torch `Linear` stores
[out, in]; GPT-2's `Conv1D` stores [in, out]) and, for GPT-2's fused `c_attn`, which third it is.
Import and export both read that table, so they cannot drift apart.

Import reads `config.json` value by value (each checked; unsupported architectures or options are
named), checks the tensor names and shapes against the table (missing, extra and mis-shaped
tensors are all named before anything is read), then builds each meshlm parameter straight into
its shards: `jax.make_array_from_callback` asks for each device's slice, and only the Hugging Face
tensors of that slice's layers are read from the memory-mapped files. Pickled weights
(`*.bin`, `*.pt`, ...) are refused and never opened: unpickling runs code.

Export gathers one Hugging Face tensor at a time (a layer's slice of a stacked parameter) and
streams it into the safetensors file, so the host holds one tensor, never the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.config import ConfigError, ModelConfig
from meshlm.interop import safetensors_io as st

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
# Files that hold pickled weights (torch.save, pickle, joblib): refused, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib")
# Tokenizer and generation settings carried through import and export unchanged (chat templates,
# bos/eos, stop ids): meshlm reads tokenizer.json and the stop ids, and keeps the rest for the tools.
SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Buffers some checkpoints carry that are not parameters (causal masks, rotary caches).
IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")
HF_PREFIX = "hf:"


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

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf

    def names(self, n_layers: int) -> list[str]:
        return [self.hf.format(i=i) for i in range(n_layers)] if self.layered else [self.hf]

    def part_shape(self) -> tuple[int, ...]:
        *lead, last = self.hf_shape
        return (*lead, last // self.parts)

    def to_meshlm(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if self.parts > 1:
            w = x.shape[-1] // self.parts
            x = x[..., self.part * w : (self.part + 1) * w]
        return (x.T if self.transpose else x).reshape(shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """This parameter's (per-layer) value as its chunk of the Hugging Face tensor."""
        p = self.part_shape()
        return x.reshape(p[::-1]).T if self.transpose else x.reshape(p)


def rules(cfg: ModelConfig) -> list[Rule]:
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
    out = [
        Rule("wte", "model.embed_tokens.weight", (V, D)),
        Rule("final_norm", "model.norm.weight", (D,)),
        Rule("layers/attn_norm", m + "input_layernorm.weight", (D,)),
        Rule("layers/mlp_norm", m + "post_attention_layernorm.weight", (D,)),
        Rule("layers/wq", m + "self_attn.q_proj.weight", (N * H, D), transpose=True),
        Rule("layers/wk", m + "self_attn.k_proj.weight", (K * H, D), transpose=True),
        Rule("layers/wv", m + "self_attn.v_proj.weight", (K * H, D), transpose=True),
        Rule("layers/wo", m + "self_attn.o_proj.weight", (D, N * H), transpose=True),
        Rule("layers/w_gate", m + "mlp.gate_proj.weight", (F, D), transpose=True),
        Rule("layers/w_up", m + "mlp.up_proj.weight", (F, D), transpose=True),
        Rule("layers/w_down", m + "mlp.down_proj.weight", (D, F), transpose=True),
    ]
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


def _read_json(path: Path) -> dict:
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
    data = _read_json(path)
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
    elif kind == "llama":
        f.require("hidden_act", ("silu",), "silu")
        f.require("attention_bias", (False,), False)
        f.require("mlp_bias", (False,), False)
        d, n = f.int("hidden_size"), f.int("num_attention_heads")
        kv = f.int("num_key_value_heads", n)
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
        )
    else:
        arch = data.get("architectures")
        raise ConfigError(
            f"{path}: model_type {kind!r} ({arch}) is not supported; meshlm converts 'gpt2' (GPT2LMHeadModel) "
            "and 'llama' (LlamaForCausalLM) checkpoints"
        )
    return cfg


def _rope(data: dict, f: _Fields, path: Path) -> dict:
    """RoPE settings from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`."""
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
    if kind != "llama3":
        raise ConfigError(f"{path}: RoPE type {kind!r} is not supported (meshlm implements 'default' and 'llama3')")
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


def token_ids(hf_dir: str | Path) -> dict[str, list[int]]:
    """{"bos_token_id": [...], "eos_token_id": [...]} from generation_config.json, else config.json
    (a single id or a list: Llama 3 Instruct stops at either of two tokens)."""
    root = Path(hf_dir).expanduser()
    out: dict[str, list[int]] = {"bos_token_id": [], "eos_token_id": []}
    for name in ("config.json", "generation_config.json"):  # the latter wins
        p = root / name
        if not p.is_file():
            continue
        data = _read_json(p)
        for key in out:
            v = data.get(key)
            ids = v if isinstance(v, list) else [v]
            if v is not None and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                out[key] = list(ids)
            elif v is not None and v != []:
                raise ConfigError(f"{p}: {key} must be a token id or a list of them, got {v!r}")
    return out


def publish(tmp: Path, out: Path) -> None:
    """Rename a finished temporary directory into place, readable as the umask allows (mkdtemp
    makes it private)."""
    probe = tmp / ".mode-probe"  # a new file's mode is 0o666 & ~umask (os.umask would change it process-wide)
    probe.touch()
    umask = 0o666 & ~probe.stat().st_mode & 0o777
    probe.unlink()
    for p in [tmp, *tmp.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
    if out.exists():
        out.rmdir()
    tmp.rename(out)


# ------------------------------------------------------------------------------------------ import


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of a directory; pickled weights are refused without being opened."""
    if not hf_dir.is_dir():
        raise ConfigError(f"Hugging Face model directory not found: {hf_dir}")
    index = hf_dir / SAFE_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{index}: weight_map must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        bad = [f for f in files if Path(f).name != f or not f.endswith(".safetensors")]
        if bad:
            raise ConfigError(f"{index}: weight_map names files outside the directory or not safetensors: {bad}")
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise ConfigError(f"{index} lists files that are missing: {', '.join(missing)}")
        return [hf_dir / f for f in files]
    if (hf_dir / SAFE_SINGLE).is_file():
        return [hf_dir / SAFE_SINGLE]
    pickled = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ConfigError(
            f"{hf_dir} holds pickled weights ({', '.join(pickled)}) and no safetensors; meshlm never unpickles "
            "weights (loading a pickle runs code). Convert them once, somewhere you trust the file, e.g.\n"
            '  python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{hf_dir}').save_pretrained('{hf_dir}-safetensors')\""
        )
    raise ConfigError(f"{hf_dir} has no {SAFE_SINGLE} or {SAFE_INDEX}")


def _plan_import(reader: st.Reader, cfg: ModelConfig, where: Path) -> tuple[list[Rule], str]:
    """The rules, and the name prefix the files use (GPT-2 files saved by OpenAI's converter have
    no "transformer."); every missing, extra or mis-shaped tensor named."""
    table = rules(cfg)
    names = set(reader.tensors)
    layered = next(r for r in table if r.layered).hf.split("{i}")[0].removeprefix("transformer.")
    present = {
        int(m.group(1)) for n in names if (m := re.match(r"(?:transformer\.)?" + re.escape(layered) + r"(\d+)\.", n))
    }
    if present != set(range(cfg.n_layers)):
        raise ConfigError(
            f"{where}/config.json says {cfg.n_layers} layers, but the weights hold layers "
            f"{sorted(present)[:5]}{'...' if len(present) > 5 else ''} ({len(present)} in all)"
        )
    not_float = sorted(n for n in names if reader.tensors[n].dtype not in FLOAT_DTYPES and not IGNORED.search(n))
    if not_float:
        raise ConfigError(
            f"{where}: tensors stored as integers or booleans (quantized weights?) are not supported: "
            + ", ".join(f"{n} ({reader.tensors[n].dtype})" for n in not_float[:5])
        )
    prefix = ""
    if cfg.family == "gpt" and "transformer.wte.weight" not in names and "wte.weight" in names:
        prefix = "transformer."
    want: dict[str, tuple[int, ...]] = {}
    for r in table:
        for n in r.names(cfg.n_layers):
            want[n.removeprefix(prefix) if prefix and n.startswith(prefix) else n] = r.hf_shape
    problems = [f"missing tensor {n} (expected shape {list(s)})" for n, s in want.items() if n not in names]
    problems += [
        f"tensor {n} has shape {list(reader.tensors[n].shape)}, expected {list(s)}"
        for n, s in want.items()
        if n in names and reader.tensors[n].shape != s
    ]
    tied_alias = {"lm_head.weight"} if cfg.tied_embeddings else set()
    extra = sorted(n for n in names - want.keys() if not IGNORED.search(n) and n not in tied_alias)
    problems += [f"unexpected tensor {n} (not part of a meshlm {cfg.family} model)" for n in extra]
    if problems:
        raise ConfigError(
            f"the weights in {where} do not match its config.json:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )
    return table, prefix


def load_params(hf_dir: str | Path, cfg: ModelConfig, shardings: dict) -> dict:
    """meshlm's fp32 parameter tree from a Hugging Face directory, each leaf built directly into
    `shardings` (a tree like the params, e.g. `train_state.param_shardings`)."""
    import jax

    from meshlm.model.params import abstract_params, named_leaves, param_specs

    root = Path(hf_dir).expanduser()
    reader = st.Reader(weight_files(root))
    try:
        table, prefix = _plan_import(reader, cfg, root)
        abstract = named_leaves(abstract_params(param_specs(cfg)))
        named_sh = named_leaves(shardings)
        by_leaf: dict[str, list[Rule]] = {}
        for r in table:
            by_leaf.setdefault(r.leaf, []).append(r)
        built = {}
        for leaf, shape_dtype in abstract.items():
            (rule,) = by_leaf[leaf]
            built[leaf] = _build_leaf(reader, rule, prefix, shape_dtype.shape, named_sh[leaf])
        treedef = jax.tree.structure(abstract_params(param_specs(cfg)))
        return jax.tree.unflatten(treedef, [built[n] for n in abstract])
    finally:
        reader.close()


def _build_leaf(reader: st.Reader, rule: Rule, prefix: str, shape: tuple[int, ...], sharding) -> Any:
    import jax

    def hf_name(i: int | None) -> str:
        n = rule.hf.format(i=i) if i is not None else rule.hf
        return n.removeprefix(prefix) if prefix else n

    # Each HF tensor is read and converted once per leaf and dropped after the last device slice
    # that needs it; a slice several devices hold (replicas) is built once and dropped after its
    # last copy. So the host holds at most one stacked parameter (fp32) beyond the shards.
    layers_of = lambda index: list(range(*index[0].indices(shape[0]))) if rule.layered else [None]
    indices = list(sharding.addressable_devices_indices_map(shape).values())
    copies = Counter(repr(ix) for ix in indices)
    distinct = {repr(ix): ix for ix in indices}
    uses = Counter(i for ix in distinct.values() for i in layers_of(ix))
    converted: dict[int | None, np.ndarray] = {}
    done: dict[str, np.ndarray] = {}

    def one(i: int | None, per: tuple[int, ...], idx: tuple) -> np.ndarray:
        if i not in converted:
            converted[i] = np.asarray(rule.to_meshlm(reader.get(hf_name(i)), per), dtype=np.float32)
        out = np.array(converted[i][idx])
        uses[i] -= 1
        if uses[i] <= 0:
            del converted[i]
        return out

    def callback(index: tuple) -> np.ndarray:
        key = repr(index)
        if key not in done:
            if rule.layered:
                done[key] = np.stack([one(i, shape[1:], index[1:]) for i in layers_of(index)])
            else:
                done[key] = one(None, shape, index)
        out = done[key]
        copies[key] -= 1
        if copies[key] <= 0:
            del done[key]
        return out

    return jax.make_array_from_callback(shape, sharding, callback)


# ------------------------------------------------------------------------------------------ export


def hf_config(cfg: ModelConfig, bos: int | None, eos: int | None, dtype: str, max_positions: int = 0) -> dict:
    """config.json for `transformers` (GPT2LMHeadModel / LlamaForCausalLM). `max_positions`: llama's
    max_position_embeddings (meshlm's max_seq_len only sizes gpt's position table)."""
    torch_dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[dtype]
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
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope = rope | {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_len,
        }
    return {
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
        "max_position_embeddings": max(cfg.max_seq_len, max_positions),
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,  # transformers >= 5
        "rope_theta": cfg.rope_theta,  # older readers (transformers 4, vLLM, llama.cpp's converter)
        "rope_scaling": None if cfg.rope_scaling == "none" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tied_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": torch_dtype,
        "torch_dtype": torch_dtype,
    }


def save_pretrained(
    params: dict,
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    tokenizer_file: Path | None = None,
    eos_token: str | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = 2 * 2**30,
    max_positions: int = 0,
    side_files: Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write a Hugging Face directory (config, generation config, safetensors shards + index,
    tokenizer) from meshlm parameters (global arrays, any sharding). `side_files`: a directory
    whose tokenizer_config.json, generation_config.json, ... (`SIDE_FILES`, kept by an import)
    are copied instead of meshlm's own. Written under a temporary name and renamed into place: a
    failure leaves nothing at `out_dir`."""
    import jax

    from meshlm.model.params import named_leaves

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; export into a new directory")
    np_dtype = {"float32": np.float32, "bfloat16": np.dtype(st.DTYPES["BF16"]), "float16": np.float16}[dtype]
    leaves = named_leaves(params)
    tensors: list[tuple[str, list[tuple[Rule, int | None]]]] = []  # HF name -> its meshlm sources
    seen: dict[str, int] = {}
    for r in rules(cfg):
        for i, name in enumerate(r.names(cfg.n_layers)):
            if name not in seen:
                seen[name] = len(tensors)
                tensors.append((name, []))
            tensors[seen[name]][1].append((r, i if r.layered else None))
    tensors.sort(key=lambda t: _natural(t[0]))
    shape = {name: src[0][0].hf_shape for name, src in tensors}

    def gather(name: str, sources: list[tuple[Rule, int | None]]) -> np.ndarray:
        parts = sorted(sources, key=lambda s: s[0].part)
        chunks = []
        for rule, i in parts:
            x = leaves[rule.leaf] if i is None else leaves[rule.leaf][i]
            chunks.append(rule.to_hf(np.asarray(jax.device_get(x))))
        return np.concatenate(chunks, axis=-1) if len(chunks) > 1 else chunks[0]

    # Shards of at most max_shard_bytes (a tensor larger than that gets a file of its own).
    files: list[list[tuple[str, list]]] = [[]]
    size = 0
    for name, src in tensors:
        nbytes = math.prod(shape[name]) * np.dtype(np_dtype).itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append((name, src))
        size += nbytes
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        names = (
            [SAFE_SINGLE]
            if len(files) == 1
            else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
        )
        weight_map, total = {}, 0
        for fname, group in zip(names, files, strict=True):
            specs = [(n, shape[n], np_dtype) for n, _ in group]
            st.write(tmp / fname, specs, (gather(n, src) for n, src in group), {"format": "pt"})
            weight_map |= {n: fname for n, _ in group}
            total += sum(math.prod(shape[n]) * np.dtype(np_dtype).itemsize for n, _ in group)
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2))
        bos = eos = None
        if tokenizer_file is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tokenizer_file))
            eos = tok.token_to_id(eos_token) if eos_token else None
            bos = eos  # GPT-2 convention: one end-of-text token begins and ends documents
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
            special = {"bos_token": eos_token, "eos_token": eos_token, "unk_token": eos_token}
            (tmp / "tokenizer_config.json").write_text(
                json.dumps(
                    {
                        "tokenizer_class": "PreTrainedTokenizerFast",
                        "model_max_length": cfg.max_seq_len,
                        "clean_up_tokenization_spaces": False,
                        "add_prefix_space": False,
                    }
                    | special,
                    indent=2,
                )
            )
            (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
        kept = [f for f in SIDE_FILES if side_files is not None and (side_files / f).is_file()]
        for f in kept:  # an imported model's own settings (chat template, bos/eos, stop ids)
            shutil.copyfile(side_files / f, tmp / f)
        if kept:
            ids = token_ids(tmp)
            bos = ids["bos_token_id"][0] if ids["bos_token_id"] else bos
            eos = ids["eos_token_id"][0] if ids["eos_token_id"] else eos
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, bos, eos, dtype, max_positions), indent=2))
        if "generation_config.json" not in kept:
            gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}: {len(tensors)} tensors in {len(files)} file(s), {total / 2**20:,.1f} MiB {dtype}")
    return out


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def is_hf_ref(path: str | None) -> bool:
    return bool(path) and str(path).startswith(HF_PREFIX)


def hf_path(ref: str) -> Path:
    return Path(ref.removeprefix(HF_PREFIX)).expanduser()


def with_model(cfg_run, model: ModelConfig):
    """A run config whose model section is `model`, keeping the run's compute dtype, attention
    kind and layer unrolling (how to run the model, not what it is)."""
    keep = {
        k: getattr(cfg_run.model, k)
        for k in ("dtype", "attention", "attention_block", "attention_chunk", "scan_unroll")
    }
    return dataclasses.replace(cfg_run, model=dataclasses.replace(model, **keep))
