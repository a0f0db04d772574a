"""Attention modes: blockwise == explicit (outputs and gradients), its dropout masks replayed, what
`fused` runs, and what each mode stores for the backward pass, measured against the formula."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import accounting
from meshlm.cli import main
from meshlm.model import layers
from meshlm.model.blockwise import blockwise_attention, keep_mask
from meshlm.parallel.remat import POLICIES
from test_memory import S, T, _measure, paper_config

B, N, KV, H = 2, 4, 2, 8  # GQA: 2 query heads per kv head


def _qkv(t: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, t, N, H))
    k = jax.random.normal(ks[1], (B, t, KV, H))
    v = jax.random.normal(ks[2], (B, t, KV, H))
    d_out = jax.random.normal(ks[3], (B, t, N, H))
    return q, k, v, d_out


def _segments(t: int) -> jax.Array:  # several documents per row, boundaries inside blocks
    return jnp.asarray(np.cumsum(np.random.default_rng(t).random((B, t)) < 0.12, axis=1), jnp.int32)


def _value_and_grads(fn, q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(d_out)


@pytest.mark.parametrize("t, block", [(37, 8), (37, 5), (32, 32), (20, 64), (48, 16)])
@pytest.mark.parametrize("docs", [False, True])
def test_blockwise_equals_explicit(t, block, docs):
    """Outputs and gradients, fp32: odd block sizes, s not a multiple of the block, one block,
    a block longer than s, packed documents, grouped KV heads."""
    q, k, v, d_out = _qkv(t)
    seg = _segments(t) if docs else None
    want, want_grads = _value_and_grads(lambda q, k, v: layers.causal_attention(q, k, v, seg), q, k, v, d_out)
    got, got_grads = _value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, seg, block=block), q, k, v, d_out)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-6, rtol=0)


@pytest.mark.parametrize("docs", [False, True])
def test_blockwise_dropout_replays_its_masks(docs):
    """With dropout, blockwise = explicit attention given the mask blockwise draws (so the backward
    pass regenerated exactly the forward's bits), and the mask drops `rate` of the entries."""
    t, block, rate = 37, 8, 0.3
    q, k, v, d_out = _qkv(t, seed=1)
    seg = _segments(t) if docs else None
    key = jax.random.key(7)
    mask = keep_mask(key, rate, (B, KV, N // KV, t, t), block)

    def explicit(q, k, v):
        scores = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, t, KV, N // KV, H), k) / np.sqrt(H)
        same = None if seg is None else layers.same_document(seg)
        return layers._softmax_dropout_av(scores, v, mask, same, rate).reshape(B, t, N, H)

    fn = lambda q, k, v: blockwise_attention(q, k, v, seg, block=block, dropout_rate=rate, key=key)
    want, want_grads = _value_and_grads(explicit, q, k, v, d_out)
    got, got_grads = _value_and_grads(fn, q, k, v, d_out)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    assert abs(1 - float(mask.mean()) - rate) < 0.02
    assert not np.array_equal(mask, keep_mask(jax.random.key(8), rate, mask.shape, block))


def test_fused_is_cudnn_where_it_applies_and_blockwise_elsewhere(tmp_path, capsys, devices):
    pick = layers.fused_implementation
    assert pick("bfloat16", 64, False, "gpu") == ("cudnn", "cuDNN flash attention")
    assert pick("float32", 64, False, "gpu")[0] == "blockwise"
    assert pick("bfloat16", 256, False, "gpu")[0] == "blockwise"
    assert pick("bfloat16", 64, True, "gpu")[0] == "blockwise"
    assert pick("bfloat16", 64, False, "cpu") == ("blockwise", "no cuDNN on cpu")
    args = ["train", "--dry-run", "--run-dir", str(tmp_path), "--set", "model.attention=fused"]
    assert main(args) == 0
    assert "attention: fused -> blockwise (no cuDNN on cpu)" in capsys.readouterr().out


def _with(cfg, **model):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("sp", [False, True])
def test_blockwise_stores_what_the_formula_says(family, policy, sp, devices):
    """P2's paper setting (bf16, dropout for gpt, tensor=4): the bytes the compiled program keeps
    for backward equal the formula, which has no s x s term for blockwise."""
    cfg = _with(paper_config(2, T, sp, policy, family), attention="blockwise")
    m = _measure(cfg)
    f = accounting.activation_memory(cfg)
    assert "attn_probs" not in f["per_layer"]
    assert m.activation_bytes == pytest.approx(f["total"], rel=5e-3)
    assert m.host_bytes == pytest.approx(f["host_total"], rel=5e-3, abs=1)


def test_blockwise_storage_is_linear_in_the_sequence_length(devices):
    """Per layer, measured: doubling s doubles blockwise's stored bytes exactly, while explicit's
    grow by exactly its s x s terms (the formula's attn_probs/masks) on top - the quadratic part a
    blockwise kernel that kept a score matrix would show."""

    def config(attention: str, s: int, layers: int):
        base = paper_config(layers, T, False, "elementwise")
        return _with(dataclasses.replace(base, train=dataclasses.replace(base.train, seq_len=s)), attention=attention)

    def per_layer(attention: str, s: int) -> float:
        return _measure(config(attention, s, 2)).activation_bytes - _measure(config(attention, s, 1)).activation_bytes

    def formula(attention: str, s: int) -> float:
        return accounting.activation_memory(config(attention, s, 1))["layer_total"]

    for attention in ("blockwise", "explicit"):
        half, full = per_layer(attention, S // 2), per_layer(attention, S)
        superlinear = full - 2 * half
        assert superlinear == formula(attention, S) - 2 * formula(attention, S // 2)
        assert (superlinear == 0) == (attention == "blockwise"), (attention, superlinear)
