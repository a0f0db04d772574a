"""The decoder: embed -> scan(layer) -> final norm -> logits, for the `gpt` and `llama` families.

The model is single-device code. Its only contact with parallelism is `constrain(layout, x, axes)`
with *logical* axis names, which is a no-op when `layout` is None.

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
from meshlm.parallel.rules import Layout, constrain

RESIDUAL = (ax.BATCH, ax.ACT_SEQ, ax.ACT_EMBED)  # the residual stream between blocks

# Dropout sites inside a layer; each gets its own fold_in of the layer key.
_ATTN_PROBS, _ATTN_OUT, _MLP_OUT = 0, 1, 2


def _dtype(cfg: ModelConfig) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def _site_key(key: jax.Array | None, site: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, site)


def _qkv(h_btd, p, cfg: ModelConfig, layout: Layout | None):
    q = jnp.einsum("btd,dnh->btnh", h_btd, p["wq"])
    k = jnp.einsum("btd,dkh->btkh", h_btd, p["wk"])
    v = jnp.einsum("btd,dkh->btkh", h_btd, p["wv"])
    if cfg.family == "gpt":
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = constrain(layout, q, (ax.BATCH, ax.SEQ, ax.ACT_HEADS, None))
    k = constrain(layout, k, (ax.BATCH, ax.SEQ, ax.ACT_KV_HEADS, None))
    v = constrain(layout, v, (ax.BATCH, ax.SEQ, ax.ACT_KV_HEADS, None))
    return q, k, v


def gpt_block(x_btd, p, key, cfg: ModelConfig, layout: Layout | None):
    """Pre-LN GPT layer (P2 Fig. 2): LN -> attention -> dropout -> +x; LN -> GeLU MLP -> dropout -> +x."""
    rate = cfg.dropout
    h = layers.layer_norm(x_btd, p["ln1_scale"], p["ln1_bias"], cfg.norm_eps)
    q, k, v = _qkv(h, p, cfg, layout)
    a = layers.causal_attention(q, k, v, dropout_rate=rate, key=_site_key(key, _ATTN_PROBS))
    o = jnp.einsum("btnh,nhd->btd", a, p["wo"]) + p["bo"]
    x_btd = x_btd + layers.dropout(constrain(layout, o, RESIDUAL), rate, _site_key(key, _ATTN_OUT))
    x_btd = constrain(layout, x_btd, RESIDUAL)

    h = layers.layer_norm(x_btd, p["ln2_scale"], p["ln2_bias"], cfg.norm_eps)
    f = jnp.einsum("btd,df->btf", h, p["w_fc"]) + p["b_fc"]
    f = layers.gelu(constrain(layout, f, (ax.BATCH, ax.SEQ, ax.ACT_MLP)))
    o = jnp.einsum("btf,fd->btd", f, p["w_proj"]) + p["b_proj"]
    x_btd = x_btd + layers.dropout(constrain(layout, o, RESIDUAL), rate, _site_key(key, _MLP_OUT))
    return constrain(layout, x_btd, RESIDUAL)


def llama_block(x_btd, p, key, cfg: ModelConfig, layout: Layout | None):
    """Llama layer: RMSNorm -> GQA attention with RoPE -> +x; RMSNorm -> SwiGLU -> +x."""
    positions = jnp.arange(x_btd.shape[1])
    h = layers.rms_norm(x_btd, p["attn_norm"], cfg.norm_eps)
    q, k, v = _qkv(h, p, cfg, layout)
    q, k = layers.rope(q, positions, cfg.rope_theta), layers.rope(k, positions, cfg.rope_theta)
    a = layers.causal_attention(q, k, v)
    o = jnp.einsum("btnh,nhd->btd", a, p["wo"])
    x_btd = constrain(layout, x_btd + constrain(layout, o, RESIDUAL), RESIDUAL)

    h = layers.rms_norm(x_btd, p["mlp_norm"], cfg.norm_eps)
    gate = constrain(layout, jnp.einsum("btd,df->btf", h, p["w_gate"]), (ax.BATCH, ax.SEQ, ax.ACT_MLP))
    up = constrain(layout, jnp.einsum("btd,df->btf", h, p["w_up"]), (ax.BATCH, ax.SEQ, ax.ACT_MLP))
    o = jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p["w_down"])
    return constrain(layout, x_btd + constrain(layout, o, RESIDUAL), RESIDUAL)


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

    `params` are fp32 masters; each layer casts its slice to `cfg.dtype` just before use (after the
    FSDP all-gather would be nicer for bandwidth, before it is what XLA picks on its own). `key`
    enables dropout (gpt family); None is the deterministic eval path.
    """
    dtype = _dtype(cfg)
    cast = partial(jax.tree.map, lambda w: w.astype(dtype))
    t = tokens_bt.shape[1]
    x = jnp.take(params["wte"], tokens_bt, axis=0)
    if cfg.family == "gpt":
        x = x + params["wpe"][:t][None]
    x = constrain(layout, x.astype(dtype), RESIDUAL)
    # Layers use fold_in(key, 0..L-1); the embedding dropout takes the next index.
    x = layers.dropout(x, cfg.dropout, None if key is None else jax.random.fold_in(key, cfg.n_layers))

    block = BLOCKS[cfg.family]

    def body(x_btd, layer):
        p, i = layer
        layer_key = None if key is None else jax.random.fold_in(key, i)
        return block(x_btd, cast(p), layer_key, cfg, layout), None

    body = remat.wrap(body, remat_policy)
    x, _ = jax.lax.scan(body, x, (params["layers"], jnp.arange(cfg.n_layers)))

    if cfg.family == "gpt":
        x = layers.layer_norm(x, params["ln_f_scale"], params["ln_f_bias"], cfg.norm_eps)
        logits = jnp.einsum("btd,vd->btv", x, params["wte"].astype(dtype), preferred_element_type=jnp.float32)
    else:
        x = layers.rms_norm(x, params["final_norm"], cfg.norm_eps)
        logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dtype), preferred_element_type=jnp.float32)
    return constrain(layout, logits, (ax.BATCH, ax.SEQ, ax.ACT_VOCAB))
