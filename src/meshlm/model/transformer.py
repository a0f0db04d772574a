"""The decoder: embed -> scan(layer) -> final norm -> logits, for the `gpt` and `llama` families.

The model is single-device code. Its contact with parallelism is `constrain(layout, x, axes)` with
*logical* axis names, plus the two tensor-parallel region boundaries of `parallel.collectives`
(`column_parallel` on entry, `row_parallel` on exit); with `layout=None` all of them are plain math.

Shape legend: b batch, t sequence, d d_model, n heads, k kv heads, h head_dim, f d_ff, v vocab.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from meshlm import axes as ax
from meshlm.config import ModelConfig
from meshlm.model import layers
from meshlm.parallel import remat
from meshlm.parallel.collectives import column_parallel, row_parallel, vocab_parallel_embed
from meshlm.parallel.rules import Layout, constrain

RESIDUAL = (ax.BATCH, ax.ACT_SEQ, ax.ACT_EMBED)  # the residual stream (sequence-sharded under SP)
HEADS_ACT = (ax.BATCH, ax.SEQ, ax.ACT_HEADS, None)
MLP_ACT = (ax.BATCH, ax.SEQ, ax.ACT_MLP)

# Dropout sites inside a layer; each gets its own fold_in of the layer key.
_ATTN_PROBS, _ATTN_OUT, _MLP_OUT = 0, 1, 2


def _site_key(key: jax.Array | None, site: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, site)


def _qkv(h_btd, p, cfg: ModelConfig, layout: Layout | None):
    """Column-parallel QKV projections (heads over tensor), biases (gpt) or RoPE (llama)."""
    q = jnp.einsum("btd,dnh->btnh", h_btd, p["wq"])
    k = jnp.einsum("btd,dkh->btkh", h_btd, p["wk"])
    v = jnp.einsum("btd,dkh->btkh", h_btd, p["wv"])
    if cfg.family == "gpt":
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    else:
        positions = jnp.arange(h_btd.shape[1])
        q, k = layers.rope(q, positions, cfg.rope_theta), layers.rope(k, positions, cfg.rope_theta)
    kv_axes = (ax.BATCH, ax.SEQ, ax.ACT_KV_HEADS, None)
    return constrain(layout, q, HEADS_ACT), constrain(layout, k, kv_axes), constrain(layout, v, kv_axes)


def _attention(h_btd, p, key, cfg: ModelConfig, layout: Layout | None, remat_policy: str):
    """g -> QKV -> attention core -> row-parallel output projection -> f-bar / g-bar."""
    q, k, v = column_parallel(layout, lambda h: _qkv(h, p, cfg, layout), h_btd, RESIDUAL)
    if cfg.attention == "fused":
        a = layers.fused_attention(q, k, v)
    else:
        core = remat.wrap_attention_core(partial(layers.causal_attention, dropout_rate=cfg.dropout), remat_policy)
        a = core(q, k, v, key=_site_key(key, _ATTN_PROBS))
    a = constrain(layout, a, HEADS_ACT)
    w_axes = (ax.HEADS, ax.HEAD_DIM, ax.EMBED)
    return row_parallel(layout, "btnh,nhd->btd", a, p["wo"], HEADS_ACT, w_axes, RESIDUAL)  # f-bar / g-bar


def gpt_block(x_btd, p, key, cfg: ModelConfig, layout: Layout | None, remat_policy: str):
    """Pre-LN GPT layer (P2 Fig. 2): LN -> attention -> dropout -> +x; LN -> GeLU MLP -> dropout -> +x."""
    rate = cfg.dropout
    h = layers.layer_norm(x_btd, p["ln1_scale"], p["ln1_bias"], cfg.norm_eps)
    o = _attention(h, p, key, cfg, layout, remat_policy) + p["bo"]
    x_btd = constrain(layout, x_btd + layers.dropout(o, rate, _site_key(key, _ATTN_OUT)), RESIDUAL)

    h = layers.layer_norm(x_btd, p["ln2_scale"], p["ln2_bias"], cfg.norm_eps)
    fc1 = lambda h: constrain(layout, jnp.einsum("btd,df->btf", h, p["w_fc"]) + p["b_fc"], MLP_ACT)
    f = layers.gelu(column_parallel(layout, fc1, h, RESIDUAL))
    o = row_parallel(layout, "btf,fd->btd", f, p["w_proj"], MLP_ACT, (ax.MLP, ax.EMBED), RESIDUAL) + p["b_proj"]
    return constrain(layout, x_btd + layers.dropout(o, rate, _site_key(key, _MLP_OUT)), RESIDUAL)


def llama_block(x_btd, p, key, cfg: ModelConfig, layout: Layout | None, remat_policy: str):
    """Llama layer: RMSNorm -> GQA attention with RoPE -> +x; RMSNorm -> SwiGLU -> +x."""
    h = layers.rms_norm(x_btd, p["attn_norm"], cfg.norm_eps)
    x_btd = constrain(layout, x_btd + _attention(h, p, key, cfg, layout, remat_policy), RESIDUAL)

    h = layers.rms_norm(x_btd, p["mlp_norm"], cfg.norm_eps)
    gate, up = column_parallel(
        layout,
        lambda h: (
            constrain(layout, jnp.einsum("btd,df->btf", h, p["w_gate"]), MLP_ACT),
            constrain(layout, jnp.einsum("btd,df->btf", h, p["w_up"]), MLP_ACT),
        ),
        h,
        RESIDUAL,
    )
    o = row_parallel(layout, "btf,fd->btd", layers.swiglu(gate, up), p["w_down"], MLP_ACT, (ax.MLP, ax.EMBED), RESIDUAL)
    return constrain(layout, x_btd + o, RESIDUAL)


BLOCKS = {"gpt": gpt_block, "llama": llama_block}


def forward(
    params: dict,
    tokens_bt: jax.Array,
    cfg: ModelConfig,
    layout: Layout | None = None,
    *,
    key: jax.Array | None = None,
    remat_policy: str = "none",
) -> jax.Array:
    """Logits [b, t, v] in fp32 for int tokens [b, t].

    `params` are fp32 masters; each layer casts its slice to `cfg.dtype` just before use. `key`
    enables dropout (gpt family); None is the deterministic eval path.
    """
    dtype = jnp.dtype(cfg.dtype)
    cast = partial(jax.tree.map, lambda w: w.astype(dtype))
    t = tokens_bt.shape[1]
    x = vocab_parallel_embed(layout, params["wte"].astype(dtype), tokens_bt, RESIDUAL)
    if cfg.family == "gpt":
        x = x + params["wpe"][:t][None].astype(dtype)
    x = constrain(layout, x, RESIDUAL)
    # Layers use fold_in(key, 0..L-1); the embedding dropout takes the next index.
    x = layers.dropout(x, cfg.dropout, None if key is None else jax.random.fold_in(key, cfg.n_layers))

    block = partial(BLOCKS[cfg.family], cfg=cfg, layout=layout, remat_policy=remat_policy)

    def body(x_btd, layer):
        p, i = layer
        layer_key = None if key is None else jax.random.fold_in(key, i)
        return block(x_btd, cast(p), layer_key), None

    body = remat.wrap_layer(body, remat_policy)
    x, _ = jax.lax.scan(body, x, (params["layers"], jnp.arange(cfg.n_layers)))

    if cfg.family == "gpt":
        x = layers.layer_norm(x, params["ln_f_scale"], params["ln_f_bias"], cfg.norm_eps)
        w_out, equation = params["wte"].astype(dtype), "btd,vd->btv"  # tied embeddings
    else:
        x = layers.rms_norm(x, params["final_norm"], cfg.norm_eps)
        w_out, equation = params["lm_head"].astype(dtype), "btd,dv->btv"

    def unembed(x_btd):  # vocabulary-parallel output layer, fp32 logits
        logits = jnp.einsum(equation, x_btd, w_out, preferred_element_type=jnp.float32)
        return constrain(layout, logits, (ax.BATCH, ax.SEQ, ax.ACT_VOCAB))

    return column_parallel(layout, unembed, x, RESIDUAL)
