"""Multi-head Latent Attention (DeepSeek-V2 section 2.1, V3 section 2.1; docs/deepseek.md).

Training runs MLA as projections in front of meshlm's attention kernels: `project` turns the
normed residual stream into per-head q, k [b, t, n, nope + rope] and v [b, t, n, v_head_dim], inside
the tensor-parallel region of the Q/K/V projections (`column_parallel`), so every kernel, context
strategy, pipeline and remat policy sees ordinary multi-head attention:

- queries: c_q = RMSNorm(h W_DQ) of rank q_lora_rank, q = c_q W_UQ (or q = h W_Q with q_lora_rank 0),
  each head's last qk_rope_head_dim values rotated;
- keys and values: [c_kv | k_r] = h W_DKV, the latent c_kv RMSNormed, k = [c_kv W_UK | RoPE(k_r)] -
  one rotated key part shared by every head - and v = c_kv W_UV.

The down-projections (W_DQ, W_DKV) are replicated over `tensor`: each rank computes the latents
from the whole gathered sequence and up-projects its own heads; the region's backward sums the
ranks' partial input gradients once, as it does for Q, K and V.

Decoding keeps only the latent: the cache holds c_kv and RoPE(k_r) (kv_lora_rank + qk_rope_head_dim
values per token and layer, `cache_rows`), and `attention_cached` absorbs W_UK into the query
(scores = (q_nope W_UK^T) c_kv + q_rope k_r) and W_UV into the output (o = (p c_kv) W_UV).

Shape legend: b batch, t query positions, s cache slots, d d_model, n heads, r a latent rank,
e the query-key no-RoPE size, p the RoPE size, h a head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from meshlm import axes as ax
from meshlm.config import ModelConfig
from meshlm.model import layers, lora, rotary
from meshlm.model.blockwise import blockwise_attention
from meshlm.model.mla_costs import padded
from meshlm.parallel.collectives import column_parallel, row_parallel
from meshlm.parallel.rules import constrain

# transformers' DeepseekV3 normalises both latents with RMSNorm's default eps, whatever rms_norm_eps says
LATENT_EPS = 1e-6
# the latent cache: [layers, b, slots, 1, rank], replicated over `tensor` (every rank's heads read it)
CACHE_AXES = (None, ax.BATCH, None, None, None)


LATENT_IN = (ax.BATCH, ax.SEQ, None)  # what `outside` hands the region [b, t, c]: the query latent, latent terms
HEADS_ACT = (ax.BATCH, ax.SEQ, ax.ACT_HEADS, None)  # per-head activations [b, t, n, h] (transformer's too)
# `transformer._lora_terms` of one layer: (x, equation, {target: logical axes}) -> {target: term}
Terms = Callable[[jax.Array, str, dict], dict]


def names(cfg: ModelConfig) -> list[str]:
    """The weights `project` takes, in order (then the LoRA adapters of those that have them). With
    `lora_dropout` no adapters, and no query down-projection: `outside` computes the query latent."""
    if lora.outside_regions(cfg):
        return ["wq_b" if cfg.q_lora_rank else "wq", "wkv_a", "kv_a_norm", "wk_b", "wv_b"]
    q = ["wq_a", "q_a_norm", "wq_b"] if cfg.q_lora_rank else ["wq"]
    adapted = [w for w in (*q, "wkv_a") if cfg.lora_rank and w in cfg.lora_targets]
    return [*q, "wkv_a", "kv_a_norm", "wk_b", "wv_b", *(f"{w}_lora_{ab}" for w in adapted for ab in "ab")]


def outside(h_btd: jax.Array, p: dict, cfg: ModelConfig, terms: Terms | None) -> dict[str, tuple]:
    """With `lora_dropout` (`lora.outside_regions`: the LoRA terms computed under GSPMD, their dropout
    bits the global tensor's), what the projections' region reads besides h, in the order `project`
    takes it: {name: (array, logical axes)} - the normed query latent c_q (wq_a's term added before
    the norm, as peft adds it to q_a_proj's output), then the terms of wq_b (of c_q, peft's q_b_proj
    input) or of wq, then wkv_a's. `terms(x, equation, targets)`: the layer's `transformer._lora_terms`.
    Without dropout: {} (the adapters are region weights)."""
    if not lora.outside_regions(cfg):
        return {}
    out = {}
    if cfg.q_lora_rank:
        c = layers.dense("btd,dc->btc", h_btd, p["wq_a"], False)  # over b and t: GSPMD shards them
        c_q = _latent_norm(c + terms(h_btd, "btd,dc->btc", {"wq_a": LATENT_IN}).get("wq_a", 0), p["q_a_norm"])
        out["c_q"] = (c_q, LATENT_IN)
        q = terms(c_q, "btc,cnh->btnh", {"wq_b": HEADS_ACT})
    else:
        q = terms(h_btd, "btd,dnh->btnh", {"wq": HEADS_ACT})
    kv = terms(h_btd, "btd,dc->btc", {"wkv_a": LATENT_IN})
    return out | {n: (t, HEADS_ACT) for n, t in q.items()} | {n: (t, LATENT_IN) for n, t in kv.items()}


@jax.checkpoint  # keeps only its input; backward recomputes the element-wise work
def _latent_norm(x, scale):
    return layers.rms_norm(x, scale, LATENT_EPS)


def _projections(h, p: dict, cfg: ModelConfig, flat: bool, given: dict):
    """(q_nope [b, t, n, e], q_r [b, t, n, p], c_kv [b, t, r] normed, k_r [b, t, 1, p]), RoPE not yet
    applied. Both down-projections read h in one call, so backward keeps h once for their gradients
    (with `lora_dropout` the query's runs in `outside`). `given`: what `outside` computed, else {}."""
    b, t, d = h.shape
    plus = lambda x, name: x + given[name] if name in given else x
    if "c_q" in given:
        q, kv = given["c_q"], layers.dense("btd,dc->btc", h, p["wkv_a"], flat)
    else:
        down = p["wq_a"] if cfg.q_lora_rank else p["wq"].reshape(d, -1)  # a full query projection: [d, n h]
        q, kv = layers.dense_shared("btd,dc->btc", h, [down, p["wkv_a"]], flat)
    # LoRA (the targets validation allows: the query path, the key-value latent; not W_UK, W_UV)
    with_lora = partial(layers.with_lora, p=p, scale=cfg.lora_scale)
    kv = plus(with_lora("btd,dc->btc", h, [kv], ("wkv_a",))[0], "wkv_a")
    if cfg.q_lora_rank:
        if "c_q" not in given:
            q = _latent_norm(with_lora("btd,dc->btc", h, [q], ("wq_a",))[0], p["q_a_norm"])
        q = with_lora("btc,cnh->btnh", q, [layers.dense("btc,cnh->btnh", q, p["wq_b"], flat)], ("wq_b",))[0]
        q = plus(q, "wq_b")
    else:
        q = plus(with_lora("btd,dnh->btnh", h, [q.reshape(b, t, -1, cfg.dim_head)], ("wq",))[0], "wq")
    c = _latent_norm(kv[..., : cfg.kv_lora_rank], p["kv_a_norm"])
    return q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :], c, kv[..., None, cfg.kv_lora_rank :]


def _rotate(q_rope, k_rope, positions, cfg: ModelConfig):
    dim = cfg.qk_rope_head_dim
    return layers.rotate(
        (q_rope, k_rope), positions, dim, cfg.rope_theta, rotary.scaling(cfg), rotary.attention_factor(cfg)
    )


def project(h_btd, *args, cfg: ModelConfig, context: bool = False, pad: int = 0, given: tuple[str, ...] = ()):
    """q, k [b, t, n, e + p] and v [b, t, n, v_head_dim] (all padded with zeros to `pad` if > 0) from
    the normed stream; `args`: under context parallelism this rank's token positions, then what
    `outside` computed (named `given`), then the weights `names` lists. q carries YaRN's softmax
    factor (`rotary.softmax_factor`)."""
    positions = args[0] if context else None
    g, p = _split(args[1 if context else 0 :], given, cfg)
    flat = not context
    q_nope, q_rope, c, k_rope = _projections(h_btd, p, cfg, flat, g)
    k_nope, v = layers.dense_shared("btc,cnh->btnh", c, [p["wk_b"], p["wv_b"]], flat)
    q_rope, k_rope = _rotate(q_rope, k_rope, positions, cfg)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1)
    scale = rotary.softmax_factor(cfg)
    if pad > cfg.dim_head:  # zero query-key columns: keep the kernel's 1/sqrt(size) that of dim_head
        scale *= math.sqrt(pad / cfg.dim_head)
    if scale != 1.0:  # in fp32: a bf16 factor would move the softmax's temperature (1.8739 -> 1.875)
        q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return _widened((q, k, v), pad)


def _split(args: tuple, given: tuple[str, ...], cfg: ModelConfig) -> tuple[dict, dict]:
    """`outside`'s arrays by name, then the weights by name, from a region's arguments."""
    n = len(given)
    return dict(zip(given, args[:n], strict=True)), dict(zip(names(cfg), args[n:], strict=True))


def _widened(qkv: tuple, pad: int) -> tuple:
    """q, k, v with zero columns up to `pad` (0: as they are)."""
    if not pad:
        return qkv
    return tuple(jnp.pad(x, [(0, 0)] * 3 + [(0, pad - x.shape[-1])]) for x in qkv)


def cache_rows(cfg: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """The per-token (k, v) cache shapes [heads, size]: MLA keeps (c_kv, RoPE(k_r)) for one shared
    head; other models their KV heads' keys and values."""
    if cfg.mla:
        return (1, cfg.kv_lora_rank), (1, cfg.qk_rope_head_dim)
    return (cfg.kv_heads, cfg.dim_head), (cfg.kv_heads, cfg.value_dim)


def latents(h_btd, positions_bt, *args, cfg: ModelConfig, given: tuple[str, ...] = ()):
    """Decoding's projections: (q_nope [b, t, n, e], RoPE(q_r) [b, t, n, p], c_kv [b, t, 1, r],
    RoPE(k_r) [b, t, 1, p]) - what `attention_cached` absorbs and caches. `args` as `project`'s."""
    g, p = _split(args, given, cfg)
    q_nope, q_rope, c, k_rope = _projections(h_btd, p, cfg, True, g)
    q_rope, k_rope = _rotate(q_rope, k_rope, positions_bt, cfg)
    return q_nope, q_rope, c[:, :, None], k_rope


def absorbed_attention(q_nope, q_rope, c_bs1r, r_bs1p, wk_b, wv_b, q_slots_t, start_b, cfg: ModelConfig):
    """Attention of t queries over s cached latents with W_UK and W_UV absorbed: scores
    (q_nope W_UK^T) c_kv + q_rope k_r, scaled as the uncompressed path; the softmax-weighted latent
    up-projected by W_UV. Masking as `layers.cached_attention`. Scores and softmax in fp32;
    returns [b, t, n, v_head_dim]."""
    f32 = jnp.float32
    q_lat = jnp.einsum("btne,rne->btnr", q_nope, wk_b, preferred_element_type=f32)
    c, r = c_bs1r[:, :, 0], r_bs1p[:, :, 0]
    scores = jnp.einsum("btnr,bsr->bnts", q_lat, c.astype(f32))
    scores += jnp.einsum("btnp,bsp->bnts", q_rope, r, preferred_element_type=f32)
    scores *= rotary.softmax_factor(cfg) / math.sqrt(cfg.dim_head)
    slot, q_slot = jnp.arange(c.shape[1]), q_slots_t[None, :, None]
    allowed = (slot <= q_slot) & ((slot >= start_b[:, None, None]) | (slot == q_slot))
    probs = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
    o_lat = jnp.einsum("bnts,bsr->btnr", probs, c.astype(f32))
    return jnp.einsum("btnr,rnh->btnh", o_lat, wv_b.astype(f32)).astype(q_nope.dtype)


def write_cache(layout, kv, new: tuple, index, axes) -> tuple:
    """A decoding step's write into a whole cache (K/V, or MLA's latent and RoPE key): the new tokens'
    rows of layer `kv[2]` of the caches `kv[:2]` put at slots index.., in place (the caches are the
    layer scan's carry: stacking each layer's as a scan output would copy all of it every step).
    Returns (the whole caches, that layer's)."""
    layer = kv[2]
    whole = tuple(
        constrain(layout, jax.lax.dynamic_update_slice(a, x[None].astype(a.dtype), (layer, 0, index, 0, 0)), axes)
        for a, x in zip(kv[:2], new, strict=True)
    )
    return whole, tuple(jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False) for a in whole)


LATENT_ACT = (ax.BATCH, ax.SEQ, None, None)  # [b, t, 1, r]: one shared "head", every tensor rank reads it


def attention_cached(
    h_btd,
    p: dict,
    cfg: ModelConfig,
    layout,
    axes: dict,
    residual,
    kv,
    cache,
    positions_bt,
    prefill,
    wo_lora,
    terms: Terms,
):
    """`transformer._attention_cached` for MLA: the new tokens' latents written at slots
    index..index+t-1 of layer `kv[2]` of the whole latent cache `kv[:2]` (c_kv, RoPE(k_r)), then
    absorbed attention over the valid slots; a prompt (`prefill`) of a blockwise or fused model
    attends among its tokens with the O(s) kernel instead, its keys and values expanded once.
    `wo_lora`: the output projection's LoRA adapters for `row_parallel` (`transformer._lora`);
    `terms`: with `lora_dropout`, the layer's terms computed outside (`outside`, no dropout here).
    Returns (output, (whole c_kv, whole k_r))."""
    heads = HEADS_ACT
    ws, given = names(cfg), outside(h_btd, p, cfg, terms)
    q_nope, q_rope, c, r = column_parallel(
        layout,
        partial(latents, cfg=cfg, given=tuple(given)),
        h_btd,
        [p[n] for n in ws],
        [axes[n] for n in ws],
        (heads, heads, LATENT_ACT, LATENT_ACT),
        residual,
        [(positions_bt, (ax.BATCH, ax.SEQ)), *given.values()],
    )
    (c_all, r_all), (c_layer, r_layer) = write_cache(layout, kv, (c, r), cache.index, CACHE_AXES)
    slots = cache.index + jnp.arange(h_btd.shape[1])
    if prefill and cfg.attention != "explicit":  # padding is its own document
        k_nope, v = (jnp.einsum("btr,rnh->btnh", c[:, :, 0], w) for w in (p["wk_b"], p["wv_b"]))
        k = jnp.concatenate([k_nope, jnp.broadcast_to(r, (*k_nope.shape[:3], r.shape[-1]))], axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1).astype(jnp.float32) * rotary.softmax_factor(cfg)
        q, k, v = (constrain(layout, x, heads) for x in _widened((q.astype(k.dtype), k, v), padded(cfg, False)))
        real = jnp.broadcast_to((slots[None, :] >= cache.start[:, None]).astype(jnp.int32), h_btd.shape[:2])
        a = blockwise_attention(q, k, v, real, block=cfg.attention_block)[..., : cfg.value_dim]
    else:
        a = absorbed_attention(q_nope, q_rope, c_layer, r_layer, p["wk_b"], p["wv_b"], slots, cache.start, cfg)
    a = constrain(layout, a, heads)
    out = row_parallel(layout, "btnh,nhd->btd", a, p["wo"], heads, axes["wo"], residual, lora=wo_lora)
    if lora.outside_regions(cfg):
        out = out + terms(a, "btnh,nhd->btd", {"wo": residual}).get("wo", 0)
    return out, (c_all, r_all)
