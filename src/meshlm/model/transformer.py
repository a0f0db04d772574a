"""The decoder: embed -> scan(layer) -> final norm -> logits, for the `gpt` and `llama` families.

The model names *logical* axes and never a device or a mesh axis: `constrain(layout, x, axes)`
with logical names, plus the tensor-parallel region boundaries of `parallel.collectives`
(`column_parallel` on entry, `row_parallel` on exit, `vocab_parallel_embed`), which run the
block's matmuls inside explicit `shard_map` regions with Megatron's collectives (P2's f/g and
their conjugates). With `layout=None` all of them are plain single-device math. Weight axes are
read from the ParamSpecs (`weight_axes`), where they are declared once.

Shape legend: b batch, t sequence, d d_model, n heads, k kv heads, h head_dim, f d_ff, v vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshlm import axes as ax
from meshlm.config import ModelConfig
from meshlm.model import kernels, layers, lora, mixed, mla, moe, rotary
from meshlm.model.blockwise import blockwise_attention
from meshlm.model.loss import chunked_output_loss, cross_entropy_sum
from meshlm.model.params import param_specs
from meshlm.parallel import remat
from meshlm.parallel.collectives import column_parallel, over_tokens, row_parallel, vocab_parallel_embed
from meshlm.parallel.context import context_attention
from meshlm.parallel.rules import Layout, constrain
from meshlm.parallel.taps import Recorder, recording

RESIDUAL = (ax.BATCH, ax.ACT_SEQ, ax.ACT_EMBED)  # the residual stream (sequence-sharded under SP)
HEADS_ACT = mla.HEADS_ACT
MLP_ACT = (ax.BATCH, ax.SEQ, ax.ACT_MLP)

# Dropout sites inside a layer; each gets its own fold_in of the layer key (LoRA's: one per target).
_ATTN_PROBS, _ATTN_OUT, _MLP_OUT = 0, 1, 2
_LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_fc", "w_proj", "w_gate", "w_up", "w_down", "wq_a", "wq_b", "wkv_a")
_LORA_SITES = {n: 3 + i for i, n in enumerate(_LORA_TARGETS)}


def _site_key(key: jax.Array | None, site: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, site)


@functools.cache
def weight_axes(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axes of every weight as one layer (or the top level) sees it, read from the
    ParamSpecs - the one place they are declared - without the stacked LAYERS axis."""
    specs = param_specs(cfg)
    stacks = ("layers", "dense_layers", "mtp")
    out = {n: s.axes for n, s in specs.items() if n not in stacks}
    return out | {n: s.axes[1:] for stack in stacks for n, s in specs.get(stack, {}).items()}


KV_ACT = (ax.BATCH, ax.SEQ, ax.ACT_KV_HEADS, None)


class KVCache(NamedTuple):
    """A preallocated key/value cache for decoding, stacked over layers, and where to write next.

    Rows are left-padded: row r's tokens occupy slots start[r] .. index-1, so every row writes its
    next token at the same slot and its position is slot - start[r]."""

    k: jax.Array  # [L, b, S, k, h] in the compute dtype
    v: jax.Array
    index: jax.Array  # int32 scalar: slot of the first token of this call
    start: jax.Array  # int32 [b]: first valid slot of each row


CACHE_AXES = (None, ax.BATCH, None, ax.ACT_KV_HEADS, None)  # k/v of one layer (all layers: LAYERS first)


def _qkv_names(cfg: ModelConfig) -> list[str]:
    """The projection weights `_project` takes, in order: Q, K, V (+ their biases: gpt, Qwen2) (+ the
    query and key norms: Qwen3) (+ the LoRA adapters of those of Q, K, V that have them)."""
    names = ["wq", "wk", "wv"] + (["bq", "bk", "bv"] if cfg.family == "gpt" or cfg.qkv_bias else [])
    names += ["q_norm", "k_norm"] if cfg.qk_norm else []
    return names + _lora_names(cfg, ("wq", "wk", "wv"))


def _lora_names(cfg: ModelConfig, weights: tuple[str, ...]) -> list[str]:
    """The adapters of `weights` that enter the regions (none when computed outside them)."""
    if lora.outside_regions(cfg):
        return []
    return [f"{w}_lora_{ab}" for w in weights if cfg.lora_rank and w in cfg.lora_targets for ab in "ab"]


def _lora_terms(x, p: dict, key, equation: str, targets: dict, cfg: ModelConfig, layout: Layout | None) -> dict:
    """The LoRA terms computed outside the regions (`lora.outside_regions`): {target: scale x
    dropout(x) A B, laid out as targets[target]} of the projections `equation` of x, for those of
    `targets` that have adapters. Each target draws its own
    mask (PEFT: one nn.Dropout per adapted module) at every element's global position; no key (eval,
    decoding): no dropout."""
    if not lora.outside_regions(cfg):
        return {}
    at = _drop_positions(layout, x.shape[1])

    @jax.checkpoint  # backward redraws the mask and x A from x and the key: no dropped copy of x is kept
    def term(x, a, b, key):
        return layers.lora_delta(equation, layers.dropout(x, cfg.lora_dropout, key, at), a, b, cfg.lora_scale)

    out = {}
    for name, axes in targets.items():
        if f"{name}_lora_a" in p:
            a, b = p[f"{name}_lora_a"], p[f"{name}_lora_b"]
            out[name] = constrain(layout, term(x, a, b, _site_key(key, _LORA_SITES[name])), axes)
    return out


def _layer_terms(p: dict, key, cfg: ModelConfig, layout: Layout | None) -> mla.Terms:
    """`_lora_terms` of this layer's adapters as f(x, equation, targets) (MLA's `mla.outside`)."""
    return lambda x, equation, targets: _lora_terms(x, p, key, equation, targets, cfg, layout)


_QKV_TERMS = {"wq": HEADS_ACT, "wk": KV_ACT, "wv": KV_ACT}


def _plus(x: jax.Array, terms: dict) -> jax.Array:
    """x plus the one LoRA term in `terms`, if any."""
    return x + next(iter(terms.values())) if terms else x


def _project(h_btd, *ws, cfg: ModelConfig, flat: bool = True, terms: tuple[str, ...] = ()):
    """Column-parallel QKV projections (+ biases, + RMSNorm of q and k over head_dim, + LoRA terms).
    Runs per tensor rank on its heads (inside `column_parallel`), so it must not name mesh axes.
    `terms`: the targets among wq, wk, wv whose LoRA terms come computed (`_lora_terms`), first in `ws`."""
    given = dict(zip(terms, ws, strict=False))
    p = dict(zip(_qkv_names(cfg), ws[len(terms) :], strict=True))
    q, k, v = layers.dense_shared("btd,dnh->btnh", h_btd, [p["wq"], p["wk"], p["wv"]], flat)
    q, k, v = layers.with_lora("btd,dnh->btnh", h_btd, [q, k, v], ("wq", "wk", "wv"), p, cfg.lora_scale)
    q, k, v = (o + given[w] if w in given else o for o, w in zip((q, k, v), ("wq", "wk", "wv"), strict=True))
    if cfg.family == "gpt" or cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm:
        q, k = layers.rms_norm(q, p["q_norm"], cfg.norm_eps), layers.rms_norm(k, p["k_norm"], cfg.norm_eps)
    return q, k, v


def _lora(p: dict, name: str, cfg: ModelConfig):
    """A row-parallel projection's LoRA adapters for `row_parallel` (None without, or outside it)."""
    if f"{name}_lora_a" not in p or lora.outside_regions(cfg):
        return None
    axes = weight_axes(cfg)
    a, b = f"{name}_lora_a", f"{name}_lora_b"
    return p[a], p[b], axes[a], axes[b], cfg.lora_scale


def _rope_qk(q, k, positions, cfg: ModelConfig):
    """RoPE on q and k [b, t, heads, h] (`layers.rotate`)."""
    return layers.rotate(
        (q, k), positions, cfg.dim_head, cfg.rope_theta, rotary.scaling(cfg), rotary.attention_factor(cfg)
    )


def _qkv(h_btd, *args, cfg: ModelConfig, context: bool = False, terms: tuple[str, ...] = ()):
    """Projections (+ the LoRA `terms` given next in `args`), then RoPE (llama) at positions 0..t-1 -
    or, under context parallelism, at the original positions of this rank's tokens, passed first."""
    positions = args[0] if context else None  # None: 0..t-1 (RoPE's tables constants up to CONSTANT_ROPE_MAX)
    q, k, v = _project(h_btd, *args[1 if context else 0 :], cfg=cfg, flat=not context, terms=terms)
    if cfg.family == "gpt":
        return q, k, v
    return (*_rope_qk(q, k, positions, cfg), v)


def _context(layout: Layout | None) -> bool:
    return layout is not None and layout.context_size > 1


def _attention_cached(h_btd, p, cfg: ModelConfig, layout: Layout | None, kv, cache: KVCache, positions_bt, prefill):
    """Attention of t new tokens over the cache: their K/V are written at slots index..index+t-1
    of layer `kv[2]` of the whole cache `kv[:2]`, then every query attends to the valid slots up
    to its own. Returns (output, (whole k, whole v))."""
    if cfg.mla:
        wo, terms = _lora(p, "wo", cfg), _layer_terms(p, None, cfg, layout)
        return mla.attention_cached(
            h_btd, p, cfg, layout, weight_axes(cfg), RESIDUAL, kv, cache, positions_bt, prefill, wo, terms
        )
    names, terms = _qkv_names(cfg), _lora_terms(h_btd, p, None, "btd,dnh->btnh", _QKV_TERMS, cfg, layout)
    q, k, v = column_parallel(
        layout,
        partial(_project, cfg=cfg, terms=tuple(terms)),
        h_btd,
        [p[n] for n in names],
        [weight_axes(cfg)[n] for n in names],
        (HEADS_ACT, KV_ACT, KV_ACT),
        RESIDUAL,
        [(t, _QKV_TERMS[n]) for n, t in terms.items()],
    )
    if cfg.family == "llama":
        q, k = _rope_qk(q, k, positions_bt, cfg)
    (k_all, v_all), (k_layer, v_layer) = mla.write_cache(layout, kv, (k, v), cache.index, CACHE_AXES)
    slots = cache.index + jnp.arange(h_btd.shape[1])
    if prefill and cfg.attention != "explicit":  # among the prompt tokens only; padding is its own document
        real = jnp.broadcast_to((slots[None, :] >= cache.start[:, None]).astype(jnp.int32), h_btd.shape[:2])
        a = blockwise_attention(q, k, v, real, block=cfg.attention_block)
    else:
        a = layers.cached_attention(q, k_layer, v_layer, slots, cache.start)
    a = constrain(layout, a, HEADS_ACT)
    wo_axes = weight_axes(cfg)["wo"]
    out = row_parallel(layout, "btnh,nhd->btd", a, p["wo"], HEADS_ACT, wo_axes, RESIDUAL, lora=_lora(p, "wo", cfg))
    return _plus(out, _lora_terms(a, p, None, "btnh,nhd->btd", {"wo": RESIDUAL}, cfg, layout)), (k_all, v_all)


def _attention(h_btd, p, key, cfg: ModelConfig, layout: Layout | None, remat_policy: str, segments=None, dec=None):
    """f / g -> QKV -> attention core -> row-parallel output projection -> f-bar / g-bar.
    With `dec` = ((whole k, whole v, layer index), KVCache, positions): decoding; returns
    (output, (whole k, whole v))."""
    if dec is not None:
        return _attention_cached(h_btd, p, cfg, layout, *dec)
    names = mla.names(cfg) if cfg.mla else _qkv_names(cfg)
    context = _context(layout)
    extras = [(jnp.asarray(layout.seq_index(h_btd.shape[1])), (ax.SEQ,))] if context else []
    explicit = cfg.attention == "explicit" and not context
    pad = mla.padded(cfg, explicit)  # MLA: one head size for q, k and v where the kernel needs it
    if cfg.mla:  # with lora_dropout, the query latent and the LoRA terms come computed (`mla.outside`)
        given = mla.outside(h_btd, p, cfg, _layer_terms(p, key, cfg, layout))
        project = partial(mla.project, cfg=cfg, context=context, pad=pad, given=tuple(given))
    else:
        terms = _lora_terms(h_btd, p, key, "btd,dnh->btnh", _QKV_TERMS, cfg, layout)
        given = {n: (t, _QKV_TERMS[n]) for n, t in terms.items()}
        project = partial(_qkv, cfg=cfg, context=context, terms=tuple(terms))
    extras += list(given.values())
    q, k, v = column_parallel(
        layout,
        project,
        h_btd,
        [p[n] for n in names],
        [weight_axes(cfg)[n] for n in names],
        (HEADS_ACT, KV_ACT, KV_ACT),
        RESIDUAL,
        extras,
    )
    kernel = _kernel(cfg, key, remat_policy, layout)
    if context:  # the sequence is split over `context`: ring, all-gather or all-to-all (any kernel)
        drop_key = _site_key(key, _ATTN_PROBS)
        fused, doc = cfg.attention == "fused", segments is not None
        at = kernels.fused_at_offset(cfg.dtype, cfg.dim_head, doc, cfg.attention_block) if fused else None
        a = context_attention(
            layout,
            q,
            k,
            v,
            segments,
            block=cfg.attention_block,
            dropout_rate=cfg.dropout,
            key=drop_key,
            kernel=kernel,
            kernel_at=at,
        )
    else:
        a = kernel(q, k, v, segments)
    if pad:
        a = a[..., : cfg.value_dim]
    if explicit:  # the O(s) kernels keep their output for their own backward
        a = constrain(layout, a, HEADS_ACT)  # pass: a constrained copy (or a rows view) would be stored twice
    wo_axes, wo_lora = weight_axes(cfg)["wo"], _lora(p, "wo", cfg)
    out = row_parallel(layout, "btnh,nhd->btd", a, p["wo"], HEADS_ACT, wo_axes, RESIDUAL, explicit, lora=wo_lora)
    return _plus(out, _lora_terms(a, p, key, "btnh,nhd->btd", {"wo": RESIDUAL}, cfg, layout)), None


def _kernel(cfg: ModelConfig, key, remat_policy: str, layout: Layout | None):
    """The attention core `model.attention` names, as `(q, k, v, segment_ids) -> output`."""
    drop_key = _site_key(key, _ATTN_PROBS)
    if cfg.attention == "fused":  # heads as the kernel sees them: Ulysses splits them over context too
        ulysses = _context(layout) and layout.context_strategy == "all_to_all"
        heads = ("tensor", "context") if ulysses else ("tensor",)
        return partial(kernels.fused_attention, block=cfg.attention_block, layout=layout, heads=heads)
    if cfg.attention == "blockwise":  # stores O(s) per row already: no policy recomputes it
        return partial(blockwise_attention, block=cfg.attention_block, dropout_rate=cfg.dropout, key=drop_key)
    explicit = partial(layers.causal_attention, dropout_rate=cfg.dropout, chunk=cfg.attention_chunk)
    core = remat.wrap_attention_core(explicit, remat_policy)
    return lambda q, k, v, segments: core(q, k, v, segments, key=drop_key)


def _drop_positions(layout: Layout | None, t: int) -> jax.Array | None:
    """Original positions for the dropout bits when the sequence is stored permuted, else None."""
    return jnp.asarray(layout.seq_index(t)) if layout is not None and layout.reordered else None


def gpt_block(x_btd, p, key, cfg: ModelConfig, layout: Layout | None, remat_policy: str, segments=None, dec=None):
    """Pre-LN GPT layer (P2 Fig. 2): LN -> attention -> dropout -> +x; LN -> GeLU MLP -> dropout -> +x.
    Returns (the new residual stream, with `dec` (decoding) the layer's updated (k, v), else None)."""
    rate = cfg.dropout
    at = _drop_positions(layout, x_btd.shape[1])
    norm = remat.wrap_elementwise(partial(layers.layer_norm, eps=cfg.norm_eps), remat_policy)
    h = norm(x_btd, p["ln1_scale"], p["ln1_bias"])
    o, kv = _attention(h, p, key, cfg, layout, remat_policy, segments, dec)
    o = o + p["bo"]
    x_btd = constrain(layout, x_btd + layers.dropout(o, rate, _site_key(key, _ATTN_OUT), at), RESIDUAL)

    h = norm(x_btd, p["ln2_scale"], p["ln2_bias"])
    flat = not _context(layout)
    names = ["w_fc", "b_fc", *_lora_names(cfg, ("w_fc",))]

    def fc1(h, *ws):
        q = dict(zip(names, ws, strict=True))
        return (
            layers.with_lora(
                "btd,df->btf", h, [layers.dense("btd,df->btf", h, q["w_fc"], flat)], ("w_fc",), q, cfg.lora_scale
            )[0]
            + q["b_fc"],
        )

    axes = weight_axes(cfg)
    (f,) = column_parallel(layout, fc1, h, [p[n] for n in names], [axes[n] for n in names], (MLP_ACT,), RESIDUAL)
    f = _plus(f, _lora_terms(h, p, key, "btd,df->btf", {"w_fc": MLP_ACT}, cfg, layout))
    f = remat.wrap_elementwise(layers.gelu, remat_policy)(f)
    proj_lora = _lora(p, "w_proj", cfg)
    o = row_parallel(layout, "btf,fd->btd", f, p["w_proj"], MLP_ACT, axes["w_proj"], RESIDUAL, lora=proj_lora)
    o = o + p["b_proj"]
    o = _plus(o, _lora_terms(f, p, key, "btf,fd->btd", {"w_proj": RESIDUAL}, cfg, layout))
    x_btd = constrain(layout, x_btd + layers.dropout(o, rate, _site_key(key, _MLP_OUT), at), RESIDUAL)
    return x_btd, kv


def llama_block(x_btd, p, key, cfg: ModelConfig, layout: Layout | None, remat_policy: str, segments=None, dec=None):
    """Llama layer: RMSNorm -> GQA attention with RoPE -> +x; RMSNorm -> SwiGLU (or the MoE layer)
    -> +x. Returns (the new residual stream, with `dec` the layer's updated (k, v), else the MoE
    layer's RouterStats or None)."""
    norm = remat.wrap_elementwise(partial(layers.rms_norm, eps=cfg.norm_eps), remat_policy)
    h = norm(x_btd, p["attn_norm"])
    o, kv = _attention(h, p, key, cfg, layout, remat_policy, segments, dec)
    x_btd = constrain(layout, x_btd + o, RESIDUAL)

    h = norm(x_btd, p["mlp_norm"])
    if "we_gate" in p:  # an MoE layer (an MoE model's dense layers have w_gate)
        o, stats = moe.moe_ffn(layout, h, p, cfg, weight_axes(cfg), RESIDUAL, remat_policy)
        x_btd = constrain(layout, x_btd + o, RESIDUAL)
        return x_btd, (stats if dec is None else kv)
    flat = not _context(layout)
    names = ["w_gate", "w_up", *_lora_names(cfg, ("w_gate", "w_up"))]

    def gate_up(h, *ws):
        q = dict(zip(names, ws, strict=True))
        out = layers.dense_shared("btd,df->btf", h, [q["w_gate"], q["w_up"]], flat)
        return layers.with_lora("btd,df->btf", h, out, ("w_gate", "w_up"), q, cfg.lora_scale)

    axes = weight_axes(cfg)
    gate, up = column_parallel(
        layout, gate_up, h, [p[n] for n in names], [axes[n] for n in names], (MLP_ACT, MLP_ACT), RESIDUAL
    )
    terms = _lora_terms(h, p, key, "btd,df->btf", {"w_gate": MLP_ACT, "w_up": MLP_ACT}, cfg, layout)
    gate, up = gate + terms.get("w_gate", 0), up + terms.get("w_up", 0)
    act = remat.wrap_elementwise(layers.swiglu, remat_policy)(gate, up)
    down_lora = _lora(p, "w_down", cfg)
    o = row_parallel(layout, "btf,fd->btd", act, p["w_down"], MLP_ACT, axes["w_down"], RESIDUAL, lora=down_lora)
    o = _plus(o, _lora_terms(act, p, key, "btf,fd->btd", {"w_down": RESIDUAL}, cfg, layout))
    x_btd = constrain(layout, x_btd + o, RESIDUAL)
    return x_btd, kv


BLOCKS = {"gpt": gpt_block, "llama": llama_block}


def embed(
    params: dict,
    tokens_bt: jax.Array,
    cfg: ModelConfig,
    layout: Layout | None = None,
    key: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Token (+ learned position) embedding and its dropout: the residual stream entering layer 0.
    The embedding dropout uses fold_in(key, n_layers) (layers use 0..L-1)."""
    dtype = jnp.dtype(cfg.dtype)
    t = tokens_bt.shape[1]
    x = vocab_parallel_embed(layout, params["wte"].astype(dtype), weight_axes(cfg)["wte"], tokens_bt, RESIDUAL)
    if positions is None and _context(layout):  # stored in context order: each token's original position
        positions = jnp.asarray(layout.seq_index(t))[None]
    if cfg.family == "gpt":
        wpe = params["wpe"].astype(dtype)
        x = x + (wpe[:t][None] if positions is None else jnp.take(wpe, positions, axis=0))
    x = constrain(layout, x, RESIDUAL)
    embed_key = None if key is None else jax.random.fold_in(key, cfg.n_layers)
    return layers.dropout(x, cfg.dropout, embed_key, _drop_positions(layout, t))


def cast_layer(p: dict, dtype) -> dict:
    """A layer's fp32 weights in the compute dtype, but the router bias: fp32, as `transformers`
    keeps it (its steps of 1e-3 would vanish in bf16 next to a bias of 0.3)."""
    return {n: w if n == "router_bias" else w.astype(dtype) for n, w in p.items()}


def run_layers(
    x_btd: jax.Array,
    stacked: dict,
    layer_ids: jax.Array,
    cfg: ModelConfig,
    layout: Layout | None = None,
    key: jax.Array | None = None,
    remat_policy: str = "elementwise",
    segment_ids: jax.Array | None = None,
    chain: bool = False,
    taps: list | None = None,
) -> tuple[jax.Array, moe.RouterStats | None]:
    """(the residual stream after the layers, the MoE layers' RouterStats stacked [n, ...] or None).

    With `taps` (zb1's forward, `parallel.taps`: a zero [n, ...] per output of each tensor-parallel
    region of a layer, in call order, as `region_shapes` lists them), the second output is
    (RouterStats or None, each region's input stacked [n, ...]), and the regions' weights get no
    gradient: `weight_gradients` gives them from those inputs and the taps' gradients.

    `lax.scan` of the layer over stacked fp32 weights [n, ...]; layer j draws its dropout from
    fold_in(key, layer_ids[j]) (its index in the whole model), so a pipeline chunk of layers
    draws what the whole model would. With `chain` there is no loop: the layers are called one
    after another on the parts of the split weights (no stacked residual buffers; the program grows
    with n). `forward` chains when `model.scan_unroll` >= layers; a pipeline chunk never does: its
    backward must keep the chunk's weight arrays themselves, which the scan passes through and a
    split would copy (the pipeline recognises them and does not stash them)."""
    dtype = jnp.dtype(cfg.dtype)
    cast = partial(cast_layer, dtype=dtype)
    block = partial(BLOCKS[cfg.family], cfg=cfg, layout=layout, remat_policy=remat_policy, segments=segment_ids)

    def body(x_btd, layer):
        p, i = layer[:2]
        key_of = lambda j: None if key is None else jax.random.fold_in(key, i if j is None else i[j])
        if taps is None:
            return in_order(block, x_btd, p, key_of, cast)  # (x, RouterStats or None)
        with recording(Recorder("forward", taps=layer[2])) as rec:
            x_btd, stats = in_order(block, x_btd, p, key_of, cast)
        return x_btd, (stats, rec.inputs)

    n = layer_ids.shape[0]
    layer = remat.wrap_layer(body, remat_policy)
    if taps is not None:
        if chain:
            raise ValueError("the split backward (taps) runs over a scan of layers, not a chain")
        x_btd, (stats, inputs) = jax.lax.scan(layer, x_btd, (stacked, layer_ids, taps), unroll=min(cfg.scan_unroll, n))
        return x_btd, (_units_flat(stats, layer_ids), inputs)
    if chain:
        # One split per stacked array, not n slices: the gradient of a split is one concatenate of
        # the layers' parts; that of n slices is a sum of n zero-padded copies of the whole stacked
        # array, each of which XLA:CPU writes out (n times the gradient's bytes, mostly zeros).
        leaves, tree = jax.tree.flatten((stacked, layer_ids))
        parts = [jax.lax.split(a, [1] * n) for a in leaves]
        stats = []
        for j in range(n):
            x_btd, s = layer(x_btd, jax.tree.unflatten(tree, [jnp.squeeze(p[j], 0) for p in parts]))
            stats.append(s)
        return x_btd, None if stats[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *stats)
    x_btd, stats = jax.lax.scan(layer, x_btd, (stacked, layer_ids), unroll=min(cfg.scan_unroll, n))
    return x_btd, _units_flat(stats, layer_ids)


def in_order(block, x_btd, p: dict, key_of=lambda j: None, cast=lambda p: p):
    """`block(x, weights, key)` of one layer, or of a pipeline unit's layers in order (their weights
    named "j:name", `stage_layout.staged_params`; `key_of(j)` layer j's key, `key_of(None)` one
    layer's): (x, the RouterStats of its MoE layers - a unit's stacked [its MoE layers, ...] - or None)."""
    if not any(":" in n for n in p):
        return block(x_btd, cast(p), key_of(None))
    stats = []
    for j in range(1 + max(int(n.split(":")[0]) for n in p)):
        x_btd, st = block(
            x_btd, cast({n.split(":", 1)[1]: w for n, w in p.items() if n.startswith(f"{j}:")}), key_of(j)
        )
        stats += [] if st is None else [st]
    return x_btd, jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None


def _units_flat(stats, layer_ids: jax.Array):
    """A scan's RouterStats over pipeline units ([n, MoE layers a unit, ...], `layer_ids` [n, u]) as [n x
    those, ...], one row per MoE layer in order; as they are over layers."""
    if stats is None or layer_ids.ndim == 1:
        return stats
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)


def logits(
    params: dict, x_btd: jax.Array, cfg: ModelConfig, layout: Layout | None = None, remat_policy: str = "elementwise"
):
    """Final norm and the vocabulary-parallel output layer: fp32 logits [b, t, v]."""
    project, w_out, _ = _output_layer(params, cfg, layout)
    return project(_final_norm(params, x_btd, cfg, remat_policy), w_out)


def output_loss(params: dict, x_btd, targets, mask, cfg: ModelConfig, layout=None, policy="elementwise", chunks=1):
    """(summed token loss, counted tokens) of `logits` and `loss.cross_entropy_sum`; with `chunks` > 1
    (`remat.loss_chunks`) chunk by chunk on each device's tokens (`loss.chunked_output_loss`, reduced once:
    `collectives.over_tokens`), but whole on a sequence the chunks do not split (eval at another length)."""
    if chunks == 1 or x_btd.shape[1] % chunks:
        return cross_entropy_sum(logits(params, x_btd, cfg, layout, policy), targets, mask)
    (project, w_out, split), x_btd = _output_layer(params, cfg, layout), _final_norm(params, x_btd, cfg, policy)
    return chunked_output_loss(project, x_btd, w_out, targets, mask, chunks, split)


def _final_norm(params: dict, x_btd, cfg: ModelConfig, remat_policy: str):
    if cfg.family == "gpt":
        final_norm = partial(layers.layer_norm, eps=cfg.norm_eps)
        return remat.wrap_elementwise(final_norm, remat_policy)(x_btd, params["ln_f_scale"], params["ln_f_bias"])
    final_norm = partial(layers.rms_norm, eps=cfg.norm_eps)
    return remat.wrap_elementwise(final_norm, remat_policy)(x_btd, params["final_norm"])


def _output_layer(params: dict, cfg: ModelConfig, layout):
    """(project(x, w) -> fp32 logits: the vocabulary-parallel output layer, w cast to the compute
    dtype inside; the fp32 weight w; `over_tokens` for it, `loss.chunked_output_loss`'s `split`)."""
    out_name, equation = ("wte", "btd,vd->btv") if cfg.tied_embeddings else ("lm_head", "btd,dv->btv")
    w_axes, flat, dtype = weight_axes(cfg)[out_name], not _context(layout), jnp.dtype(cfg.dtype)

    logits_axes = (ax.BATCH, ax.SEQ, ax.ACT_VOCAB)

    def unembed(x_btd, w):  # vocabulary-parallel output layer, fp32 logits
        return (layers.dense(equation, x_btd, w, flat, preferred_element_type=jnp.float32),)

    def project(x_btd, w):
        return column_parallel(layout, unembed, x_btd, [w.astype(dtype)], [w_axes], (logits_axes,), RESIDUAL)[0]

    return project, params[out_name], partial(over_tokens, layout)


def forward(
    params: dict,
    tokens_bt: jax.Array,
    cfg: ModelConfig,
    layout: Layout | None = None,
    *,
    key: jax.Array | None = None,
    remat_policy: str = "elementwise",
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    cache: KVCache | None = None,
    prefill: bool = False,
    router_stats: bool = False,
    hidden: bool = False,
    head: Callable | None = None,
) -> jax.Array | tuple:
    """Logits [b, t, v] in fp32 for int tokens [b, t]: `embed` -> `run_layers` -> `logits`.

    `params` are fp32 masters; each layer casts its slice to `cfg.dtype` just before use. `key`
    enables dropout (gpt family); None is the deterministic eval path. Packed rows: `segment_ids`
    [b, t] keeps attention inside each document; `positions` [b, t] index the learned position
    table (gpt; RoPE depends on relative positions only, which a restart does not change).
    With a `cache` (decoding, no dropout) the tokens continue each row of the cache; returns the
    last position's logits [b, 1, v] and the cache with their K/V written and its index advanced.
    `prefill`: the cache is empty (index 0), so a blockwise/fused model attends among the new
    tokens with its O(s) kernel instead of over the whole cache.
    `router_stats` (MoE, no cache): returns (logits, the layers' RouterStats [L, b, ...]); `hidden`
    (no cache): (logits, RouterStats or None, the last layer's output before the final norm). `head`
    (no cache): `head(last layer's output)` in place of the logits (`output_loss` over chunks, say).
    """
    t = tokens_bt.shape[1]
    if cache is not None:
        positions = jnp.maximum(cache.index + jnp.arange(t)[None, :] - cache.start[:, None], 0)
    x = embed(params, tokens_bt, cfg, layout, key, positions)
    ids = jnp.arange(cfg.n_layers)
    cast = partial(cast_layer, dtype=jnp.dtype(cfg.dtype))
    block = partial(BLOCKS[cfg.family], cfg=cfg, layout=layout, remat_policy=remat_policy)
    mixed_layers = partial(mixed.run, params=params, moe_ids=cfg.moe_layer_ids, n_layers=cfg.n_layers)
    if cache is None:
        if "dense_layers" in params:  # an MoE model with dense layers: two stacks (`model.mixed`)

            def one(x_btd, p, i):
                layer_key = None if key is None else jax.random.fold_in(key, i)
                return block(x_btd, cast(p), layer_key, segments=segment_ids)

            x, stats = mixed_layers(x, one_layer=remat.wrap_layer(one, remat_policy), unroll=cfg.scan_unroll)
        else:
            chain = cfg.scan_unroll >= cfg.n_layers > 1  # fully unrolled: no loop at all
            x, stats = run_layers(x, params["layers"], ids, cfg, layout, key, remat_policy, segment_ids, chain)
        out = logits(params, x, cfg, layout, remat_policy) if head is None else head(x)
        return (out, stats, x) if hidden else (out, stats) if router_stats else out

    def decode_layer(carry, p, i):
        x_btd, k_all, v_all = carry
        dec = ((k_all, v_all, i), cache, positions, prefill)
        x_btd, (k_all, v_all) = block(x_btd, cast(p), None, dec=dec)
        return (x_btd, k_all, v_all), None

    unroll = min(cfg.scan_unroll, cfg.n_layers)
    if "dense_layers" in params:
        (x, k_all, v_all), _ = mixed_layers((x, cache.k, cache.v), one_layer=decode_layer, unroll=unroll)
    else:
        layers_in = (params["layers"], ids)
        (x, k_all, v_all), _ = jax.lax.scan(
            lambda c, li: decode_layer(c, *li), (x, cache.k, cache.v), layers_in, unroll=unroll
        )
    cache = KVCache(k_all, v_all, cache.index + t, cache.start)
    x = x[:, -1:]  # only the last position's logits are used: never build [b, t, vocab]
    return logits(params, x, cfg, layout, remat_policy), cache
