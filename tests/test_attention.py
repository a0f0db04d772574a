"""Attention modes: blockwise == explicit (outputs and gradients), its dropout masks replayed, what
`fused` runs, and what each mode stores for the backward pass, measured against the formula."""

import dataclasses
import re
from functools import partial
from types import SimpleNamespace

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from meshlm import accounting
from meshlm import axes as ax
from meshlm.cli import main
from meshlm.config import ParallelConfig
from meshlm.model import kernels, layers
from meshlm.model.blockwise import blockwise_attention, keep_mask
from meshlm.parallel.remat import POLICIES
from meshlm.validation import validate
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


def test_blockwise_tiles_run_folded_in_one_loop_of_nb_plus_one_steps():
    """The compiled forward + backward of blockwise attention over nb = 8 blocks: two loops (forward,
    backward), each of nb + 1 = 9 steps, nothing nested - each step runs nb/2 block pairs at once,
    where a loop over query blocks with a loop over key blocks inside would run them one by one."""
    q, k, v, _ = _qkv(64)
    fn = jax.jit(jax.grad(lambda q, k, v: blockwise_attention(q, k, v, block=8).sum(), argnums=(0, 1, 2)))
    text = fn.lower(q, k, v).compile().as_text()
    # (at the suite's -O0 flags XLA:CPU expands the dQ scatter-add into a loop over the 4 rows; with
    # its default flags the scatter is one op and these two loops are all there is)
    loops = [line for line in text.splitlines() if " while(" in line and "scatter" not in line]
    assert len(loops) == 2
    assert [re.search(r'known_trip_count":\{"n":"(\d+)"', line).group(1) for line in loops] == ["9", "9"]


def _causal(q, k, v, segs, rate, chunk):
    """`causal_attention` for queries that are the last t of s positions, with (query, key)
    segment ids; the dropout mask is drawn over the whole [.., t, s], as `causal_attention` does."""
    b, t, n, _ = q.shape
    kv, s = k.shape[2], k.shape[1]
    shape = (b, kv, n // kv, t, s) if n != kv else (b, kv, t, s)
    keep = jax.random.bernoulli(jax.random.key(4), 1 - rate, shape)
    same = None if segs is None else segs[0][:, None, None, :, None] == segs[1][:, None, None, None, :]
    if same is not None and n == kv:
        same = same[:, :, 0]
    return layers.masked_causal_attention(q, k, v, keep, same, rate, chunk)


@pytest.mark.parametrize("kv", [KV, N])
@pytest.mark.parametrize("docs", [False, True])
def test_chunked_explicit_equals_the_whole_score_matrix(kv, docs):
    """Explicit attention in query chunks = over the whole s x s at once: outputs and gradients of
    Q, K and V, fp32, with dropout (the same bits: each chunk reads its block of the whole mask),
    packed documents, GQA and MHA (distinct kv heads); chunks that do not divide t, one row, and
    longer than t; and the last 20 queries of 37 keys (queries after the start of the keys)."""
    s, rate = 37, 0.3
    ks = jax.random.split(jax.random.key(2), 4)
    q, d_out = (jax.random.normal(k, (B, s, N, H)) for k in ks[:2])
    k, v = (jax.random.normal(kk, (B, s, kv, H)) for kk in ks[2:])
    seg = _segments(s) if docs else None

    def run(chunk, q, d_out, rows):
        segs = None if seg is None else (seg[:, s - rows :], seg)
        fn = lambda q, k, v: _causal(q, k, v, segs, rate, chunk)
        if rows == s:  # the model's entry point, which draws the mask itself
            fn = lambda q, k, v: layers.causal_attention(q, k, v, seg, rate, jax.random.key(4), chunk=chunk)
        return jax.jit(_value_and_grads, static_argnums=0)(fn, q, k, v, d_out)

    def reference(q, k, v):  # plain jnp, JAX's autodiff; queries are the last t of s positions
        t = q.shape[1]
        scores = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, t, kv, N // kv, H), k) / np.sqrt(H)
        allowed = jnp.tril(jnp.ones((t, s), bool), k=s - t)
        if seg is not None:
            allowed = allowed & (seg[:, None, None, s - t :, None] == seg[:, None, None, None, :])
        probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
        keep = jax.random.bernoulli(jax.random.key(4), 1 - rate, probs.shape)
        return jnp.einsum("bkgts,bskh->btkgh", jnp.where(keep, probs / (1 - rate), 0), v).reshape(B, t, N, H)

    for rows, chunks in ((s, (0, 1, 5, 8, 36, 37, 64)), (20, (0, 6))):
        q_rows, d_rows = q[:, s - rows :], d_out[:, s - rows :]
        want, want_grads = _value_and_grads(reference, q_rows, k, v, d_rows)
        for chunk in chunks:
            got, got_grads = run(chunk, q_rows, d_rows, rows)
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=0, err_msg=f"chunk {chunk}, {rows} rows")
            for g, w in zip(got_grads, want_grads, strict=True):
                np.testing.assert_allclose(g, w, atol=5e-6, rtol=0, err_msg=f"chunk {chunk}, {rows} rows")
    t = s
    assert layers.query_chunks(t, 5) == ((0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30), (30, 35), (35, 37))
    capped = layers.query_chunks(t, 1)  # at most MAX_QUERY_CHUNKS: rows of ceil(37 / 16) = 3
    assert capped[0] == (0, 3) and len(capped) == 13 <= accounting.MAX_QUERY_CHUNKS


def test_chunked_explicit_bf16_sums_the_chunks_dk_dv_in_fp32():
    """bf16, 16 query chunks: dK and dV, sums over the chunks, are accumulated in fp32 and rounded
    once, so they are as close to the fp32 gradients as the unchunked bf16 computation's."""
    t = 64
    q, k, v, d_out = _qkv(t, seed=5)
    want = jax.vjp(lambda q, k, v: layers.causal_attention(q, k, v), q, k, v)[1](d_out)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, d_out)]
    errors = {}
    for chunk in (0, 4):
        fn = lambda q, k, v, chunk=chunk: layers.causal_attention(q, k, v, chunk=chunk)
        got = jax.jit(lambda *x, fn=fn: jax.vjp(fn, *x[:3])[1](x[3]))(*bf)
        errors[chunk] = [float(jnp.abs(g.astype(jnp.float32) - w).max()) for g, w in zip(got, want, strict=True)]
    assert len(layers.query_chunks(t, 4)) == 16
    for whole, chunked in zip(errors[0][1:], errors[4][1:], strict=True):  # dK, dV
        assert chunked <= 1.5 * whole, errors


@pytest.mark.parametrize(
    ("kv", "t", "queries", "chunk", "rate"),
    [(KV, 32, 32, 8, 0.0), (N, 37, 37, 5, 0.3), (N, 37, 20, 6, 0.3)],  # GQA; MHA, uneven; fewer queries
)
def test_chunked_dk_dv_are_summed_in_place(kv, t, queries, chunk, rate, monkeypatch):
    """Each query chunk's key and value gradients are added into one running sum in place: the
    compiled backward of chunked attention holds no pad (padded parts, summed, were re-added and
    transposed inside every consumer of the sum on XLA:CPU: BENCHMARKS-history.md, "dK and dV summed in
    place"), and its gradients equal a padded running sum's bit for bit (same additions, same
    order), with dropout, chunks that do not divide t, and queries that are the last of the keys."""
    q, k, v, d_out = _qkv(t)
    k, v = (x[:, :, :kv] if kv <= KV else jnp.tile(x, (1, 1, kv // KV, 1)) for x in (k, v))
    q, d_out = q[:, -queries:], d_out[:, -queries:]
    fn = lambda q, k, v: _causal(q, k, v, None, rate, chunk)

    def grads_and_pads():
        step = jax.jit(lambda q, k, v, d: _value_and_grads(fn, q, k, v, d)[1])
        text = step.lower(q, k, v, d_out).compile().as_text()
        return step(q, k, v, d_out), len(re.findall(r"= \S+ pad\(", text))

    in_place, pads = grads_and_pads()
    assert pads == 0

    def padded(total, part):  # the running sum padded to the chunk's keys, then added
        if total is None:
            return part
        rows = part.shape[-2] - total.shape[-2]
        return jnp.pad(total, [(0, 0)] * (part.ndim - 2) + [(0, rows), (0, 0)]) + part

    monkeypatch.setattr(layers, "_add_rows", padded)
    summed, pads = grads_and_pads()
    assert pads > 0
    for a, b in zip(in_place, summed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_startup_report_names_the_query_chunks():
    from meshlm.insight.startup_report import _explicit_label

    cfg = tiny_config()
    assert _explicit_label(cfg.model, 32) == (
        "explicit in 2 query chunks of 16 (the score blocks on and below the diagonal are stored)"
    )
    assert _explicit_label(dataclasses.replace(cfg.model, attention_chunk=0), 32).startswith("explicit (the s x s")


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
        same = None if seg is None else layers.same_document(seg)
        return layers.masked_causal_attention(q, k, v, mask, same, rate)

    fn = lambda q, k, v: blockwise_attention(q, k, v, seg, block=block, dropout_rate=rate, key=key)
    want, want_grads = _value_and_grads(explicit, q, k, v, d_out)
    got, got_grads = _value_and_grads(fn, q, k, v, d_out)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    assert abs(1 - float(mask.mean()) - rate) < 0.02
    assert not np.array_equal(mask, keep_mask(jax.random.key(8), rate, mask.shape, block))
    tiles = [mask[..., i * block : (i + 1) * block, j * block : (j + 1) * block] for i, j in ((1, 0), (1, 1), (2, 1))]
    assert not np.array_equal(tiles[0], tiles[1]) and not np.array_equal(tiles[1], tiles[2])  # i and j both count


def _device(platform="gpu", version="cuda 12.8", capability="9.0"):
    client = SimpleNamespace(platform_version=version)
    return SimpleNamespace(platform=platform, client=client, compute_capability=capability)


def test_fused_picks_cudnn_pallas_or_splash_by_device_and_blockwise_elsewhere(tmp_path, capsys, monkeypatch, devices):
    pick = kernels.fused_implementation
    h100, v100 = _device(), _device(capability="7.0")
    assert pick("bfloat16", 64, False, h100) == ("cudnn", "cuDNN flash attention")
    assert pick("bfloat16", 64, False, v100)[0] == "blockwise"  # flash needs Ampere or newer
    assert pick("bfloat16", 64, False, _device(version="rocm 6.2"))[0] == "blockwise"
    # where cuDNN does not apply on such a GPU: the Pallas (Triton) kernel, with the reason
    assert pick("float32", 64, False, h100) == (
        "pallas-gpu",
        "Pallas GPU flash attention (cuDNN's needs bf16, the model computes in float32)",
    )
    assert pick("bfloat16", 256, False, h100)[0] == "pallas-gpu"
    assert pick("bfloat16", 64, True, h100) == (
        "pallas-gpu",
        "Pallas GPU flash attention (document masks: segment ids)",
    )
    assert pick("float32", 64, True, _device("tpu")) == ("splash", "TPU splash attention (Pallas)")
    assert pick("bfloat16", 64, False, _device("cpu")) == ("blockwise", "no cuDNN or Pallas GPU kernel on cpu")
    assert pick("bfloat16", 64, False)[0] == "blockwise"  # this machine
    # a private cache: this in-process run (8 simulated devices) must not leave its CPU peak probe
    # for the CLI tests' runs to read (a low probe there would push their MFU above 1)
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    args = ["train", "--dry-run", "--run-dir", str(tmp_path), "--set", "model.attention=fused"]
    assert main(args) == 0
    assert "attention: fused -> blockwise (no cuDNN or Pallas GPU kernel on cpu)" in capsys.readouterr().out
    # each choice calls its kernel: cuDNN's through JAX, causal and unmasked; the Pallas ones by name
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or a[0])
    for kind in ("pallas-gpu", "splash"):
        monkeypatch.setattr(
            kernels,
            f"{kind.replace('-gpu', '_gpu')}_attention",
            lambda *a, kind=kind, **kw: calls.append((kind, kw["block"])) or a[0],
        )
    q, k, v, _ = _qkv(16)
    for kind in ("cudnn", "pallas-gpu", "splash"):
        monkeypatch.setattr(kernels, "fused_implementation", lambda *a, kind=kind: (kind, ""))
        kernels.fused_attention(q.astype(jnp.bfloat16), k, v)
    # splash runs blocks of at least SPLASH_BLOCK rows (measured on a TPU v5e: BENCHMARKS.md)
    assert calls == [{"is_causal": True, "implementation": "cudnn"}, ("pallas-gpu", 128), ("splash", 512)]


def test_splash_blocks_stop_at_the_padded_rows(monkeypatch):
    """`splash_attention_at` with 512-row blocks on fewer rows (interpret mode): the query and key
    blocks shrink to their padded lengths apart (128 queries at offset 256 of 384 keys, 200 queries
    at 128), with documents: explicit attention's rows."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    sizes, block_sizes = [], splash.BlockSizes
    monkeypatch.setattr(
        splash, "BlockSizes", lambda **kw: sizes.append((kw["block_q"], kw["block_kv"])) or block_sizes(**kw)
    )
    s = 384
    q, k, v, _ = _qkv(s, seed=6)
    seg = _segments(s)
    want = layers.causal_attention(q, k, v, seg)
    for offset, t in ((256, 128), (128, 200)):
        rows = slice(offset, offset + t)
        got = kernels.splash_attention_at(q[:, rows], k, v, seg[:, rows], seg, offset, block=512, interpret=True)
        np.testing.assert_allclose(got, want[:, rows], atol=2e-6, rtol=0)
    assert sizes == [(128, 384), (256, 384)]


@pytest.mark.parametrize("kernel, t, block", [("pallas_gpu", 40, 16), ("splash", 300, 128)])
@pytest.mark.parametrize("docs", [False, True])
def test_pallas_kernels_in_interpret_mode_equal_explicit_attention(kernel, t, block, docs):
    """The GPU (Triton) and TPU (splash) Pallas kernels, run on this CPU in interpret mode: outputs
    and gradients equal explicit attention's (fp32), grouped KV heads, s not a multiple of the block
    and several blocks (3 of 16 rows; splash's keys come in 128s: 3 of 128), with and without documents."""
    q, k, v, d_out = _qkv(t, seed=3)
    seg = _segments(t) if docs else None
    fn = getattr(kernels, f"{kernel}_attention")
    want, want_grads = _value_and_grads(lambda q, k, v: layers.causal_attention(q, k, v, seg), q, k, v, d_out)
    got, got_grads = _value_and_grads(lambda q, k, v: fn(q, k, v, seg, block=block, interpret=True), q, k, v, d_out)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=0)


@pytest.mark.parametrize("t", [16, 20])
@pytest.mark.parametrize("docs", [False, True])
def test_pallas_gpu_kernel_at_a_causal_offset_equals_explicit_attention(t, docs):
    """All_gather's GPU kernel (`pallas_gpu_attention_at`, interpret mode), a chunk of t queries at each
    offset of s = 3t keys (16-row tiles: t=16 one, t=20 padded to two; GQA): the outputs
    and gradients of explicit attention's rows. Documents: one from key 3 to s - 6 (into every chunk),
    and boundaries at a chunk start, mid-chunk and the last key."""
    s = 3 * t
    q, k, v, d_out = _qkv(s, seed=5)
    starts = np.zeros((B, s), int)
    starts[0, [3, s - 5]] = starts[1, [t, t + t // 2 + 1, s - 1]] = 1
    seg = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32) if docs else None
    for offset in range(0, s, t):
        rows = slice(offset, offset + t)
        whole = lambda q_c, k, v, rows=rows: layers.causal_attention(q.at[:, rows].set(q_c), k, v, seg)[:, rows]
        segs = dict(seg_q_bt=None, seg_k_bs=None) if seg is None else dict(seg_q_bt=seg[:, rows], seg_k_bs=seg)
        at = partial(kernels.pallas_gpu_attention_at, **segs, offset=offset, block=16, interpret=True)
        want, want_grads = _value_and_grads(whole, q[:, rows], k, v, d_out[:, rows])
        got, got_grads = _value_and_grads(at, q[:, rows], k, v, d_out[:, rows])
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
        for g, w in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w, atol=5e-6, rtol=0)
    with pytest.raises(ValueError, match="for both the queries and the keys"):
        kernels.pallas_gpu_attention_at(q[:, :t], k, v, None, jnp.zeros((B, s), jnp.int32), 0)
    with pytest.raises(ValueError, match=f"must be whole {t}-row chunks"):
        kernels.pallas_gpu_attention_at(q[:, :t], k, v, None, None, t // 2)


def test_pallas_kernels_run_per_device_on_a_mesh(devices):
    """On data=2 x tensor=2 a Pallas kernel runs on each device's rows and heads (`kernels.sharded`):
    the same outputs and gradients as on one device, and no operand gathered (no all-gather)."""
    from meshlm.insight import hlo
    from meshlm.parallel.mesh import make_layout

    t = 32
    q, k, v, d_out = _qkv(t, seed=4)
    seg = _segments(t)
    layout = make_layout(ParallelConfig(data=2, tensor=2), jax.devices()[:4])
    fn = partial(kernels.splash_attention, block=16, interpret=True)
    run = kernels.sharded(layout, ("tensor",), fn)
    want = _value_and_grads(lambda q, k, v: fn(q, k, v, seg), q, k, v, d_out)
    on_mesh = jax.jit(lambda q, k, v, d: _value_and_grads(lambda q, k, v: run(q, k, v, seg), q, k, v, d))
    got = on_mesh(q, k, v, d_out)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
    text = on_mesh.lower(q, k, v, d_out).compile().as_text()
    assert hlo.collectives(text)["all-gather"] == 0


def test_blockwise_bf16_multiplies_bf16_and_accumulates_fp32():
    """bf16 inputs: every matmul of forward and backward takes bf16 operands (bf16 speed) with an
    fp32 result, and the gradients stay as close to fp32 ones as explicit bf16 attention's."""
    q, k, v, d_out = _qkv(64, seed=2)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, d_out)]
    fn = lambda q, k, v: blockwise_attention(q, k, v, block=16)

    def vjp(q, k, v, d):
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(d)

    jaxpr = jax.make_jaxpr(vjp)(*bf)
    dots = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append((*(str(a.aval.dtype) for a in eqn.invars), str(eqn.outvars[0].aval.dtype)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert len(dots) >= 7 and set(dots) == {("bfloat16", "bfloat16", "float32")}, dots
    explicit = lambda q, k, v: layers.causal_attention(q, k, v)
    want = jax.vjp(explicit, q, k, v)[1](d_out)  # fp32 reference
    ours = vjp(*bf)[1]
    theirs = jax.vjp(explicit, *bf[:3])[1](bf[3])  # explicit attention in bf16
    for g, e, w in zip(ours, theirs, want, strict=True):
        err_g = float(jnp.abs(g.astype(jnp.float32) - w).max())
        err_e = float(jnp.abs(e.astype(jnp.float32) - w).max())
        assert err_g <= 1.5 * err_e + 1e-3, (err_g, err_e)


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


def test_blockwise_formula_with_padded_rows(devices):
    """s not a multiple of the block: the log-sum-exp is kept for the real rows only, measured = formula."""
    base = paper_config(2, T, False, "elementwise")
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, seq_len=S - 32))
    cfg = _with(cfg, attention="blockwise", attention_block=128)
    assert _measure(cfg).activation_bytes == pytest.approx(accounting.activation_memory(cfg)["total"], rel=1e-9)


def test_blockwise_hardware_flops_count_the_blocks_the_kernel_runs():
    """HFU's executed FLOPs: per (sequence, head) the kernel runs, over the block pairs its loops
    visit (query block i, key blocks 0..i), 2 matmuls forward and 5 backward of 2*B*B*h FLOPs."""
    base = paper_config(2, T, False, "elementwise")
    for s, block in ((S, 128), (S - 32, 128), (S, 512), (300, 64)):
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, seq_len=s))
        blockwise = _with(cfg, attention="blockwise", attention_block=block)
        explicit = _with(cfg, attention="explicit", attention_chunk=0)  # the whole s x s
        m, t = cfg.model, cfg.train
        nb = -(-s // block)
        pairs = sum(1 for i in range(nb) for j in range(nb) if j <= i)
        kernel = t.global_batch * m.n_layers * m.n_heads * pairs * 7 * 2 * block * block * m.dim_head
        counted = t.global_batch * m.n_layers * m.n_heads * 6 * 2 * s * s * m.dim_head
        got = accounting.hardware_flops_per_step(blockwise) - accounting.hardware_flops_per_step(explicit)
        assert got == kernel - counted
        assert accounting.model_flops_per_step(blockwise) == accounting.model_flops_per_step(explicit)


def test_chunked_explicit_hardware_flops_count_the_score_blocks_it_runs():
    """Chunked explicit attention runs its 6 matmuls (2 forward, 4 backward; selective adds QK^T
    once more) over each query chunk's rows x the keys up to its last row, not over s x s; at most
    MAX_QUERY_CHUNKS chunks (longer ones beyond)."""
    for policy, passes in (("elementwise", 6), ("selective", 7)):
        base = paper_config(2, T, False, policy)
        for s, chunk, rows in ((S, 64, [64] * 8), (300, 64, [64] * 4 + [44]), (S, 16, [32] * 16), (S, 512, [S])):
            cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, seq_len=s))
            chunked, whole = _with(cfg, attention_chunk=chunk), _with(cfg, attention_chunk=0)
            ends = np.cumsum(rows)
            assert [e - a for a, e in accounting.query_chunks(s, chunk)] == rows
            m, t = cfg.model, cfg.train
            per_pass = t.global_batch * m.n_layers * m.n_heads * 2 * m.dim_head
            got = accounting.hardware_flops_per_step(chunked) - accounting.hardware_flops_per_step(whole)
            assert got == passes * per_pass * (int(np.dot(rows, ends)) - s * s), (policy, s, chunk)
            assert accounting.model_flops_per_step(chunked) == accounting.model_flops_per_step(whole)


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_mha_scores_without_a_group_axis_are_the_grouped_computation(monkeypatch):
    """MHA computes [b, k, t, s] scores, GQA [b, k, g, t, s]: for MHA both layouts give the same
    outputs, gradients and dropout bits (same elements in the same order), with document masks."""
    ks = jax.random.split(jax.random.key(3), 4)
    q, k, v, d_out = (jax.random.normal(kk, (B, 32, N, H)) for kk in ks)  # N kv heads: MHA
    segments = _segments(32)

    def run():
        fn = lambda q, k, v: layers.causal_attention(q, k, v, segments, dropout_rate=0.3, key=jax.random.key(5))
        return _value_and_grads(fn, q, k, v, d_out)

    def score_ranks():  # ranks of the [.., t, s] score GEMMs' outputs (the core is a custom VJP)
        jaxpr = jax.make_jaxpr(lambda q, k, v: layers.causal_attention(q, k, v, segments))(q, k, v)
        dots = [e.outvars[0].aval.shape for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        return [len(shape) for shape in dots if np.prod(shape) == B * N * 32 * 32]

    squeezed, ranks = run(), score_ranks()
    monkeypatch.setattr(layers, "_grouped", lambda n, kv: True)  # the group axis kept, as GQA does
    grouped = run()
    for a, b in zip(jax.tree.leaves(squeezed), jax.tree.leaves(grouped), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert ranks == [4] and score_ranks() == [5], (ranks, score_ranks())


@pytest.mark.parametrize(
    ("eq", "x_shape", "w_shape"),
    [
        ("btd,dnh->btnh", (3, 8, 16), (16, 4, 6)),
        ("btd,vd->btv", (3, 8, 16), (20, 16)),
        ("btnh,nhd->btd", (3, 8, 4, 6), (4, 6, 16)),
    ],
)
def test_dense_weight_gradient_is_one_contraction_over_rows(eq, x_shape, w_shape):
    """`layers.dense_shared` = the einsums (values and gradients, up to summation order; in the
    inputs' dtypes under bf16, fp32 logits too), but its backward contracts each weight gradient
    over one b*t axis,
    as a plain GEMM against the transpose of the smaller operand (x, or the output gradient),
    written out; reshapes x once for all its weights, and keeps the einsum where asked
    (`flat=False`). The weight's axes in any order (tied output layer: [v, d])."""
    x = jax.random.normal(jax.random.key(0), x_shape)
    ws = [jax.random.normal(jax.random.key(i), w_shape) for i in (1, 2)]
    out_shape = jax.eval_shape(lambda: jnp.einsum(eq, x, ws[0])).shape
    g = jax.random.normal(jax.random.key(3), out_shape)

    def grads(fn, x=x, ws=ws):
        return jax.vjp(lambda x, ws: sum((y * g).sum() for y in fn(x, ws)), x, ws)[1](1.0)

    einsums = lambda x, ws: [jnp.einsum(eq, x, w) for w in ws]
    for flat in (True, False):
        ours = lambda x, ws, flat=flat: layers.dense_shared(eq, x, ws, flat)
        want = jax.tree.leaves((einsums(x, ws), grads(einsums)))
        for a, b in zip(jax.tree.leaves((ours(x, ws), grads(ours))), want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    bf16 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)
    for kw in ({}, {"preferred_element_type": jnp.float32}):  # the output layer's fp32 logits
        ours = lambda x, ws, kw=kw: layers.dense_shared(eq, x, ws, **kw)
        theirs = lambda x, ws, kw=kw: [jnp.einsum(eq, x, w, **kw) for w in ws]
        fx, fws = (jax.tree.map(lambda a: a.astype(jnp.float32), t) for t in (bf16(x), bf16(ws)))
        got = jax.vjp(ours, bf16(x), bf16(ws))[1]((g.astype(jnp.float32 if kw else jnp.bfloat16),) * 2)
        want = jax.vjp(theirs, fx, fws)[1]([g] * 2)
        assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.05 * np.abs(b).max())

    def weight_grad_contractions(fn):  # contracting dims of each weight-gradient dot in backward
        jaxpr = jax.make_jaxpr(lambda x, ws: jax.vjp(fn, x, ws)[1]((g, g)))(x, ws)
        eqns = list(_equations(jaxpr.jaxpr))
        dots = [
            e
            for e in eqns
            if e.primitive.name == "dot_general" and sorted(e.outvars[0].aval.shape) == sorted(ws[0].shape)
        ]
        return [len(e.params["dimension_numbers"][0][0]) for e in dots], eqns

    rows, eqns = weight_grad_contractions(lambda x, ws: layers.dense_shared(eq, x, ws))
    assert rows == [1, 1], rows  # b*t as one axis
    x_rows = (x_shape[0] * x_shape[1], *x_shape[2:])
    assert sum(e.primitive.name == "reshape" and e.outvars[0].aval.shape == x_rows for e in eqns) == 1
    smaller = (*x_shape[2:], x_rows[0]) if np.prod(x_shape) <= np.prod(out_shape) else (*out_shape[2:], x_rows[0])
    barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
    assert [v.aval.shape for v in barriers[0].outvars] == [smaller], barriers  # x^T or g^T, written out
    plain, _ = weight_grad_contractions(lambda x, ws: layers.dense_shared(eq, x, ws, flat=False))
    assert plain == [2, 2], plain  # the einsum's weight gradient contracts over b and t


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_weight_gradients_are_plain_gemms(family, monkeypatch):
    """In the compiled gradient of the whole model (one device), no matmul without batch axes
    reads its left operand across the contracted rows (lhs_contracting_dims={0}): every weight
    gradient is a GEMM against a transposed copy, the form XLA:CPU runs at full speed (gpt ties its
    output layer to the [v, d] embedding, llama's is [d, v]). Autodiff's own weight gradients, as
    on GPUs (`layers.transposed_copy_gradients` False), are such matmuls."""
    from meshlm.model.loss import cross_entropy_sum
    from meshlm.model.params import abstract_params, param_specs
    from meshlm.model.transformer import forward

    cfg = _with(tiny_config(family), dropout=0.0)

    def transposed_lhs_dots():
        loss = lambda p, t: cross_entropy_sum(forward(p, t, cfg.model), t)[0]
        tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32)
        text = jax.jit(jax.grad(loss)).lower(abstract_params(param_specs(cfg.model)), tokens).compile().as_text()
        dots = [line for line in text.splitlines() if re.search(r"= \S+ dot\(", line) and "lhs_batch_dims" not in line]
        assert dots
        return [line for line in dots if "lhs_contracting_dims={0}" in line]

    assert transposed_lhs_dots() == []

    monkeypatch.setattr(layers, "transposed_copy_gradients", lambda: False)  # autodiff's, as on GPUs
    assert len(transposed_lhs_dots()) >= cfg.model.n_layers


@pytest.mark.parametrize(
    ("family", "mesh"),
    [("llama", {"data": 2, "fsdp": 2}), ("gpt", {"data": 2, "fsdp": 2}), ("llama", {"data": 2, "context": 2})],
)
def test_dense_rows_move_no_data(family, mesh, monkeypatch, devices):
    """The whole model's gradient program has the same collectives with dense layers on b*t rows as
    with plain 3-D einsums: the rows view is local wherever `layers.dense` is used flat (under
    context it must not be: the sequence is split, and a reshape would gather it)."""
    from meshlm.insight import hlo
    from meshlm.model.loss import cross_entropy_sum
    from meshlm.model.params import abstract_params, param_specs
    from meshlm.model.transformer import forward
    from meshlm.parallel import collectives
    from meshlm.parallel.mesh import make_layout
    from meshlm.train_state import param_shardings

    cfg = _with(tiny_config(family), attention="blockwise" if "context" in mesh else "explicit")
    cfg = validate(dataclasses.replace(cfg, parallel=ParallelConfig(**mesh)))
    layout = make_layout(cfg.parallel, jax.devices()[:4])
    specs = param_specs(cfg.model)

    def counts():
        loss = lambda p, t: cross_entropy_sum(forward(p, t, cfg.model, layout), t)[0]
        shardings = (param_shardings(specs, layout), layout.sharding((ax.BATCH, ax.SEQ)))
        tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32)
        lowered = jax.jit(jax.grad(loss), in_shardings=shardings).lower(abstract_params(specs), tokens)
        return hlo.collectives(lowered.compile().as_text())

    rows = counts()
    plain = lambda equation, x, w, flat=True, **kw: jnp.einsum(equation, x, w, **kw)
    monkeypatch.setattr(layers, "dense", plain)
    monkeypatch.setattr(collectives, "dense", plain)
    monkeypatch.setattr(layers, "dense_shared", lambda eq, x, ws, flat=True, **kw: tuple(plain(eq, x, w) for w in ws))
    assert rows == counts() and sum(rows.values()) > 0, (rows, counts())
