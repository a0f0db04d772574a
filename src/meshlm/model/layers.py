"""Pure math of a decoder layer: no parameters are created here and no mesh is known.

Shape legend (einsum letters): b batch, t query positions, s key positions, d d_model,
n query heads, k kv heads, g query heads per kv head (n = k*g), h head_dim, f d_ff, v vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def layer_norm(x_btd: jax.Array, scale_d: jax.Array, bias_d: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with statistics in fp32; output in x's dtype."""
    x = x_btd.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale_d.astype(jnp.float32) + bias_d.astype(jnp.float32)).astype(x_btd.dtype)


def rms_norm(x_btd: jax.Array, scale_d: jax.Array, eps: float) -> jax.Array:
    x = x_btd.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
    return (y * scale_d.astype(jnp.float32)).astype(x_btd.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's tanh-approximate GeLU ("gelu_new" in Hugging Face)."""
    return jax.nn.gelu(x, approximate=True)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout. The keep mask is a bool (1 byte/element), matching P2's accounting."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def rope(x_btnh: jax.Array, positions_t: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, "rotate half" convention (first half of head_dim pairs with the second),
    as in Hugging Face Llama. Angles in fp32."""
    h = x_btnh.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angles_th = positions_t.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles_th = jnp.concatenate([angles_th, angles_th], axis=-1)
    cos, sin = jnp.cos(angles_th)[None, :, None, :], jnp.sin(angles_th)[None, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_btnh.dtype)


def causal_attention(
    q_btnh: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    *,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
) -> jax.Array:
    """Explicit softmax attention with grouped KV heads (n = k*g; MHA is g = 1).

    The score matrix is materialised on purpose: P2's memory model and selective recomputation
    are about exactly these tensors, which are tagged for the remat policies:
    attn_scores (QK^T), attn_probs (softmax), attn_probs_dropped (softmax dropout).
    """
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh) / math.sqrt(h)
    scores = checkpoint_name(scores, "attn_scores")
    causal_ts = jnp.tril(jnp.ones((t, k_bskh.shape[1]), dtype=bool))
    scores = jnp.where(causal_ts, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(q_btnh.dtype), "attn_probs")
    probs = checkpoint_name(dropout(probs, dropout_rate, key), "attn_probs_dropped")
    out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)
    return out_btkgh.reshape(b, t, n, h)
