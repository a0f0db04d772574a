"""Parameters are declared once, with their logical axes, when they are created.

`param_specs(cfg)` returns a pytree of `ParamSpec`; everything else (abstract shapes, shardings,
initialisation, parameter count) is derived from it, so a renamed parameter can never lose its
sharding (the failure mode of regex-over-path rules).

Shape legend: L layers, V vocab, D d_model, N heads, K kv heads, H head_dim, F d_ff, S max_seq_len.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from meshlm import axes as ax
from meshlm.config import ModelConfig
from meshlm.model import lora

Init = Callable[[jax.Array, tuple[int, ...]], jax.Array]


def normal(std: float) -> Init:
    return lambda key, shape: std * jax.random.normal(key, shape, jnp.float32)


def zeros(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jnp.zeros(shape, jnp.float32)


def ones(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jnp.ones(shape, jnp.float32)


@dataclass(frozen=True)
class ParamSpec:
    """Shape, logical axes (one per dim) and initialiser of one fp32 master parameter."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Init
    decay: bool = True  # AdamW weight decay applies (weight matrices); False for norms and biases
    trainable: bool = True  # False: frozen (LoRA's base weights): no gradient, no optimizer state

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def _is_spec(x: object) -> bool:
    return isinstance(x, ParamSpec)


def param_specs(cfg: ModelConfig) -> dict:
    """The full parameter tree of a model: {'embed': ..., 'layers': {...}, 'final_norm': ...}.

    Layer parameters are stacked along a leading LAYERS axis and consumed by `lax.scan`. With LoRA
    (`model.lora_rank`) every weight is frozen and the layers gain the adapters (`lora_specs`).
    """
    tree = _base_specs(cfg)
    if not cfg.lora_rank:
        return tree
    tree = map_specs(lambda s: dataclasses.replace(s, trainable=False), tree)
    for stack in lora.STACKS:  # an MoE model's dense layers (`model.first_k_dense`...) are adapted too
        if stack in tree:
            tree[stack] |= lora_specs(cfg, tree[stack])
    return tree


LORA_IN_DIMS = {
    "wq": 1,
    "wk": 1,
    "wv": 1,
    "wo": 2,
    "w_fc": 1,
    "w_proj": 1,
    "w_gate": 1,
    "w_up": 1,
    "w_down": 1,
    "wq_a": 1,
    "wq_b": 1,
    "wkv_a": 1,
}


def lora_specs(cfg: ModelConfig, layer: dict) -> dict:
    """`<target>_lora_a` [L, *in, r] and `<target>_lora_b` [L, r, *out] of each LoRA target, with the
    logical axes of the base weight's input and output dimensions, so the rules table shards them as
    it shards their base (B's rank dimension, and A's, never). A ~ N(0, 1/fan_in), B = 0: the model
    starts as its base."""
    r = cfg.lora_rank
    out = {}
    for name in cfg.lora_targets:
        base = layer[name]
        k = LORA_IN_DIMS[name]  # input dimensions after the layer axis
        ins, outs = base.shape[1 : 1 + k], base.shape[1 + k :]
        in_axes, out_axes = base.axes[1 : 1 + k], base.axes[1 + k :]
        L = base.shape[0]
        out[f"{name}_lora_a"] = ParamSpec(
            (L, *ins, r), (base.axes[0], *in_axes, None), normal(1 / math.sqrt(math.prod(ins)))
        )
        out[f"{name}_lora_b"] = ParamSpec((L, r, *outs), (base.axes[0], None, *out_axes), zeros)
    return out


def trainable_mask(specs: dict) -> dict:
    """True at each trainable leaf (all of them unless LoRA freezes the base)."""
    return map_specs(lambda s: s.trainable, specs)


def partition(tree: Any, mask: dict) -> tuple[list, list, Callable[[list, list], Any]]:
    """(trainable leaves, frozen leaves, join(trainable, frozen) -> the tree) of a parameter-shaped
    tree, by `trainable_mask`."""
    leaves, treedef = jax.tree.flatten(tree)
    marks = jax.tree.leaves(mask)
    assert len(marks) == len(leaves), (len(marks), len(leaves))

    def join(train: list, frozen: list):
        it, fr = iter(train), iter(frozen)
        return jax.tree.unflatten(treedef, [next(it) if m else next(fr) for m in marks])

    return (
        [x for x, m in zip(leaves, marks, strict=True) if m],
        [x for x, m in zip(leaves, marks, strict=True) if not m],
        join,
    )


def _base_specs(cfg: ModelConfig) -> dict:
    L, V, D, N, K, H, F = (
        cfg.n_layers,
        cfg.vocab_size,
        cfg.d_model,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.dim_head,
        cfg.ffn,
    )
    w = normal(cfg.init_std)
    # GPT-2: residual-branch output projections scaled by 1/sqrt(2L) so the stream's variance
    # does not grow with depth.
    w_out = normal(cfg.init_std / math.sqrt(2 * L))
    layer = {
        "wq": ParamSpec((L, D, N, H), (ax.LAYERS, ax.EMBED, ax.HEADS, ax.HEAD_DIM), w),
        "wk": ParamSpec((L, D, K, H), (ax.LAYERS, ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), w),
        "wv": ParamSpec((L, D, K, H), (ax.LAYERS, ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), w),
        "wo": ParamSpec((L, N, H, D), (ax.LAYERS, ax.HEADS, ax.HEAD_DIM, ax.EMBED), w_out),
    }
    if cfg.mla:
        layer = _mla_specs(cfg, w, w_out)
    if cfg.family == "gpt":
        norm = lambda: ParamSpec((L, D), (ax.LAYERS, ax.EMBED), ones, decay=False)
        bias = lambda *shape_axes: ParamSpec(
            (L, *[s for s, _ in shape_axes]), (ax.LAYERS, *[a for _, a in shape_axes]), zeros, decay=False
        )
        layer |= {
            "ln1_scale": norm(),
            "ln1_bias": bias((D, ax.EMBED)),
            "bq": bias((N, ax.HEADS), (H, ax.HEAD_DIM)),
            "bk": bias((K, ax.KV_HEADS), (H, ax.HEAD_DIM)),
            "bv": bias((K, ax.KV_HEADS), (H, ax.HEAD_DIM)),
            "bo": bias((D, ax.EMBED)),
            "ln2_scale": norm(),
            "ln2_bias": bias((D, ax.EMBED)),
            "w_fc": ParamSpec((L, D, F), (ax.LAYERS, ax.EMBED, ax.MLP), w),
            "b_fc": bias((F, ax.MLP)),
            "w_proj": ParamSpec((L, F, D), (ax.LAYERS, ax.MLP, ax.EMBED), w_out),
            "b_proj": bias((D, ax.EMBED)),
        }
        return {
            "wte": ParamSpec((V, D), (ax.VOCAB, ax.EMBED), w),
            "wpe": ParamSpec((cfg.max_seq_len, D), (ax.POS, ax.EMBED), normal(0.01)),
            "layers": layer,
            "ln_f_scale": ParamSpec((D,), (ax.EMBED,), ones, decay=False),
            "ln_f_bias": ParamSpec((D,), (ax.EMBED,), zeros, decay=False),
        }
    tree = {"wte": ParamSpec((V, D), (ax.VOCAB, ax.EMBED), w)}
    if cfg.dense_layer_ids:  # an MoE model with dense layers: two stacks, each scanned over its layers
        tree["dense_layers"] = _llama_layer(cfg, layer, len(cfg.dense_layer_ids), False, w, w_out)
    tree |= {
        "layers": _llama_layer(cfg, layer, len(cfg.moe_layer_ids) if cfg.moe else L, cfg.moe, w, w_out),
        "final_norm": ParamSpec((D,), (ax.EMBED,), ones, decay=False),
    }
    if not cfg.tied_embeddings:  # tied: the output layer is wte, as in GPT-2
        tree["lm_head"] = ParamSpec((D, V), (ax.EMBED, ax.VOCAB), w)
    if cfg.mtp_depth:
        tree["mtp"] = _mtp_specs(cfg, layer, w, w_out)
    return tree


def _mtp_specs(cfg: ModelConfig, attention: dict, w: Init, w_out: Init) -> dict:
    """The multi-token-prediction modules (`model.mtp`), stacked over the depth (not a LAYERS axis:
    a pipeline's stages do not split them): each a llama layer (MoE in an MoE model), the norms of
    the embedding and the hidden state, their projection [2d, d] and the norm before the shared head."""
    D, d = cfg.mtp_depth, cfg.d_model
    layer = _llama_layer(cfg, attention, D, cfg.moe, w, w_out)
    unstacked = {n: dataclasses.replace(s, axes=(None, *s.axes[1:])) for n, s in layer.items()}
    norm = lambda: ParamSpec((D, d), (None, ax.EMBED), ones, decay=False)
    return unstacked | {
        "enorm": norm(),
        "hnorm": norm(),
        "eh_proj": ParamSpec((D, 2 * d, d), (None, None, ax.EMBED), w),
        "post_norm": norm(),
    }


def _mla_specs(cfg: ModelConfig, w: Init, w_out: Init) -> dict:
    """MLA's (`model.mla`) attention weights of all L layers: down-projections [L, d, rank] and their norms,
    up-projections [L, rank, n, h] sharded over heads, and the output [L, n, v_head_dim, d]."""
    L, D, N = cfg.n_layers, cfg.d_model, cfg.n_heads
    R, P, E, V, Q = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    down = lambda rank: ParamSpec((L, D, rank), (ax.LAYERS, ax.EMBED, None), w)
    up = lambda rank, h: ParamSpec((L, rank, N, h), (ax.LAYERS, None, ax.HEADS, ax.HEAD_DIM), w)
    norm = lambda rank: ParamSpec((L, rank), (ax.LAYERS, None), ones, decay=False)
    out = {"wq_a": down(Q), "q_a_norm": norm(Q), "wq_b": up(Q, E + P)} if Q else {}
    if not Q:
        out["wq"] = ParamSpec((L, D, N, E + P), (ax.LAYERS, ax.EMBED, ax.HEADS, ax.HEAD_DIM), w)
    return out | {
        "wkv_a": down(R + P),
        "kv_a_norm": norm(R),
        "wk_b": up(R, E),
        "wv_b": up(R, V),
        "wo": ParamSpec((L, N, V, D), (ax.LAYERS, ax.HEADS, ax.HEAD_DIM, ax.EMBED), w_out),
    }


def _llama_layer(cfg: ModelConfig, attention: dict, n: int, moe: bool, w: Init, w_out: Init) -> dict:
    """A stack of n llama layers: the attention's weights (`attention`, stacked over all L layers,
    restacked over n), norms, Qwen's biases and q/k norms, and the MoE layer (`moe`) or a SwiGLU."""
    D, K, N, H = cfg.d_model, cfg.kv_heads, cfg.n_heads, cfg.dim_head
    layer = {k: dataclasses.replace(v, shape=(n, *v.shape[1:])) for k, v in attention.items()}
    layer |= {
        "attn_norm": ParamSpec((n, D), (ax.LAYERS, ax.EMBED), ones, decay=False),
        "mlp_norm": ParamSpec((n, D), (ax.LAYERS, ax.EMBED), ones, decay=False),
    }
    if cfg.qkv_bias:  # Qwen2
        layer |= {
            k: ParamSpec((n, heads, H), (ax.LAYERS, axis, ax.HEAD_DIM), zeros, decay=False)
            for k, heads, axis in (("bq", N, ax.HEADS), ("bk", K, ax.KV_HEADS), ("bv", K, ax.KV_HEADS))
        }
    if cfg.qk_norm:  # Qwen3
        layer |= {k: ParamSpec((n, H), (ax.LAYERS, ax.HEAD_DIM), ones, decay=False) for k in ("q_norm", "k_norm")}
    return layer | (_moe_specs(cfg, n, w, w_out) if moe else _swiglu_specs(n, D, cfg.ffn, w, w_out, "w_"))


def _swiglu_specs(L: int, D: int, F: int, w: Init, w_out: Init, prefix: str, lead=()) -> dict:
    """gate/up [L, *lead, D, F] and down [L, *lead, F, D] of a SwiGLU MLP (`lead`: (E, ax.EXPERT)
    for stacked experts)."""
    sizes, names = tuple(n for n, _ in lead), tuple(a for _, a in lead)
    return {
        f"{prefix}gate": ParamSpec((L, *sizes, D, F), (ax.LAYERS, *names, ax.EMBED, ax.MLP), w),
        f"{prefix}up": ParamSpec((L, *sizes, D, F), (ax.LAYERS, *names, ax.EMBED, ax.MLP), w),
        f"{prefix}down": ParamSpec((L, *sizes, F, D), (ax.LAYERS, *names, ax.MLP, ax.EMBED), w_out),
    }


def _moe_specs(cfg: ModelConfig, L: int, w: Init, w_out: Init) -> dict:
    """The router [L, D, E] (experts never sharded: every device routes to all of them), the
    stacked experts (`we_*`, sharded over `expert`) and the fused shared experts (`ws_*`), for the
    L MoE layers."""
    D, E = cfg.d_model, cfg.n_experts
    out = {"w_router": ParamSpec((L, D, E), (ax.LAYERS, ax.EMBED, None), w)}
    if cfg.router_bias:  # for the choice only: no gradient, moved by the step (`moe.update_router_bias`)
        out["router_bias"] = ParamSpec((L, E), (ax.LAYERS, None), zeros, trainable=False)
    out |= _swiglu_specs(L, D, cfg.expert_ffn, w, w_out, "we_", ((E, ax.EXPERT),))
    if cfg.shared_ffn:
        out |= _swiglu_specs(L, D, cfg.shared_ffn, w, w_out, "ws_")
        if cfg.shared_expert_gate:
            out["ws_router"] = ParamSpec((L, D), (ax.LAYERS, ax.EMBED), w)
    return out


def init_params(specs: dict, key: jax.Array) -> dict:
    """Materialise every parameter from `key`. Leaf i draws from fold_in(key, i), and JAX's
    partitionable threefry makes the values independent of how the output is sharded."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    arrays = [s.init(jax.random.fold_in(key, i), s.shape) for i, s in enumerate(leaves)]
    return jax.tree.unflatten(treedef, arrays)


def abstract_params(specs: dict) -> dict:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs, is_leaf=_is_spec)


def map_specs(fn: Callable[[ParamSpec], object], specs: dict) -> dict:
    """Apply `fn` to every ParamSpec (e.g. to build the sharding tree from logical axes)."""
    return jax.tree.map(fn, specs, is_leaf=_is_spec)


def count_params(specs: dict) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=_is_spec))


def named_leaves(tree: Any) -> dict[str, Any]:
    """{'layers/wq': leaf, ...} in leaf order: the one naming of tensors for reports, checkpoint
    metadata and messages (dict keys, NamedTuple fields and tuple indices joined by '/')."""

    def name(path) -> str:
        return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)

    return {name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
