"""Context parallelism: the sequence split over a `context` mesh axis gives one device's loss and
raw gradients (all-gather and ring, load balancing on and off, composed with tensor + SP, data and
remat), stores what the formula says, and balances causal work across ranks."""

import dataclasses
import json
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import test_gradients
from helpers import logged_losses, tiny_config
from meshlm import accounting
from meshlm.config import ConfigError, ParallelConfig, RematConfig, RunConfig
from meshlm.data.loader import WindowLoader
from meshlm.model.params import param_specs
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.rules import context_order, reorder_sequence, restore_sequence, sequence_index
from meshlm.train_state import state_shardings
from meshlm.validation import validate
from test_gradients import assert_same_grads, batch_for, grads


def config(
    family: str, mesh: dict | None = None, *, document_mask=True, policy="elementwise", microbatches=1, **model
) -> RunConfig:
    """The tiny model (s=32) with the blockwise kernel at block 4 - under CP at most one context
    chunk (2 tokens at c=8 balanced), so ranks run several blocks at c <= 4."""
    cfg = tiny_config(family, microbatches=microbatches)
    mesh = dict(mesh or {})
    par = dataclasses.replace(ParallelConfig(), **mesh, sequence_parallel=mesh.get("tensor", 1) > 1)
    return validate(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, **(dict(attention="blockwise", attention_block=4) | model)),
            parallel=par,
            remat=RematConfig(policy),
            data=dataclasses.replace(cfg.data, document_mask=document_mask),
        )
    )


params = test_gradients.params  # the same perturbed parameters (the attention mode adds none)


_REFERENCE: dict = {}


def reference(family: str, params, **model) -> dict:
    key = (family, tuple(sorted(model.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = grads(config(family, **model), params[family])
    return _REFERENCE[key]


# gpt keeps dropout 0.1 at every site: with load balancing its masks are drawn by original position
# (`positional_bernoulli` for the residual stream, per block of original positions in attention).
CASES = {
    "llama ring c=8 balanced": ("llama", dict(context=8, context_strategy="ring"), {}),
    "llama all_gather c=4 balanced": ("llama", dict(context=4, context_strategy="all_gather"), {}),
    "llama ring c=2 x tensor=2+SP x data=2": ("llama", dict(context=2, tensor=2, data=2), {}),
    "gpt ring c=4 unbalanced, dropout": ("gpt", dict(context=4, context_load_balance=False), {}),
    "gpt all_gather c=2 x tensor=2+SP x data=2 unbalanced, dropout": (
        "gpt",
        dict(context=2, tensor=2, data=2, context_strategy="all_gather", context_load_balance=False),
        {},
    ),
    "gpt ring c=4 x tensor=2+SP balanced, dropout": ("gpt", dict(context=4, tensor=2), {}),
    "gpt all_gather c=2 x fsdp=2 x tensor=2 balanced, dropout": (
        "gpt",
        dict(context=2, fsdp=2, tensor=2, context_strategy="all_gather"),
        {},
    ),
    # Ulysses: any kernel between the two all-to-alls (explicit and blockwise), GQA, dropout, with and
    # without document masks; the reference is the same kernel on one device
    "llama all_to_all c=2 x tensor=2+SP balanced, explicit": (
        "llama",
        dict(context=2, tensor=2, context_strategy="all_to_all"),
        dict(attention="explicit"),
    ),
    "llama all_to_all c=4 x data=2 balanced, no document mask": (
        "llama",
        dict(context=4, data=2, context_strategy="all_to_all"),
        dict(document_mask=False),
    ),
    "gpt all_to_all c=4 x data=2 balanced, dropout": (
        "gpt",
        dict(context=4, data=2, context_strategy="all_to_all"),
        {},
    ),
    "gpt all_to_all c=2 x fsdp=2 x tensor=2+SP unbalanced, explicit, dropout, no document mask": (
        "gpt",
        dict(context=2, fsdp=2, tensor=2, context_strategy="all_to_all", context_load_balance=False),
        dict(attention="explicit", document_mask=False),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_gradients_equal_one_device(case, params, devices):
    family, mesh, model = CASES[case]
    assert_same_grads(grads(config(family, mesh, **model), params[family]), reference(family, params, **model))


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
def test_the_attention_core_equals_one_device_with_balanced_dropout(strategy, devices):
    """The core alone, load-balanced c=4 with GQA, documents and attention dropout: outputs and
    input gradients equal the single-device blockwise kernel's (same dropout blocks, by original
    position) and, without dropout, explicit attention's - a reference that shares no code."""
    from meshlm.model.blockwise import blockwise_attention
    from meshlm.model.layers import causal_attention
    from meshlm.parallel.context import context_attention

    b, t, n, kv, h, block = 2, 32, 8, 4, 8, 4  # all_to_all: 2 query heads per KV head, one KV head per rank
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k, v = (jax.random.normal(x, (b, t, kv, h)) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], (b, t, n, h))
    seg = jnp.asarray(np.cumsum(np.random.default_rng(0).random((b, t)) < 0.1, axis=1), jnp.int32)
    layout = make_layout(ParallelConfig(context=4, context_strategy=strategy), jax.devices()[:4])
    idx = jnp.asarray(layout.seq_index(t))
    back = jnp.asarray(np.argsort(layout.seq_index(t)))

    def split(q, k, v, rate):
        r = lambda x: jnp.take(x, idx, axis=1)
        out = context_attention(layout, r(q), r(k), r(v), r(seg), block=block, dropout_rate=rate, key=keys[4])
        return jnp.take(out, back, axis=1)

    @partial(jax.jit, static_argnums=0)
    def value_and_grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    outputs = []
    for rate in (0.0, 0.2):
        got = value_and_grads(partial(split, rate=rate))
        outputs.append(got[0])
        ref = value_and_grads(
            lambda q, k, v, rate=rate: blockwise_attention(q, k, v, seg, block=block, dropout_rate=rate, key=keys[4])
        )
        for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-5)
    assert not np.allclose(outputs[0], outputs[1])  # dropout really ran
    explicit = value_and_grads(lambda q, k, v: causal_attention(q, k, v, seg))
    no_dropout = value_and_grads(partial(split, rate=0.0))
    for a, r in zip(jax.tree.leaves(no_dropout), jax.tree.leaves(explicit), strict=True):
        np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-5)


def test_context_parallel_with_recomputation_and_accumulation(params, devices):
    """`full` re-runs the attention forward (the ring included) in backward; 2 microbatches
    accumulate to the whole batch's gradient."""
    cfg = config("llama", dict(context=4, tensor=2), policy="full", microbatches=2)
    assert_same_grads(grads(cfg, params["llama"]), reference("llama", params))


def test_ulysses_exchanges_twice_per_layer_and_never_gathers_kv(devices):
    """The compiled forward pass of llama (GQA) on context=2 x tensor=2 x data=2: the scanned layer
    body holds two all-to-alls - Q, K and V together before the kernel, its output after - and no
    activation is all-gathered or passed around (collective-permute); forward + backward, four (the
    transposes). The ring's program, for contrast, has permutes and no all-to-all."""
    from meshlm import axes as ax
    from meshlm.insight import hlo
    from meshlm.model.loss import cross_entropy_sum
    from meshlm.model.params import abstract_params
    from meshlm.model.transformer import forward
    from meshlm.train_state import param_shardings

    model = config("llama", document_mask=False).model
    specs = param_specs(model)
    found = {}
    for strategy in ("all_to_all", "ring"):
        layout = make_layout(ParallelConfig(context=2, tensor=2, data=2, context_strategy=strategy))

        def loss(p, t, layout=layout):
            return cross_entropy_sum(forward(p, t, model, layout), t)[0]

        for name, fn in (("forward", loss), ("backward", jax.grad(loss))):
            in_sh = (param_shardings(specs, layout), layout.sharding((ax.BATCH, ax.SEQ)))
            tokens = jax.ShapeDtypeStruct((4, 32), jnp.int32)
            text = jax.jit(fn, in_shardings=in_sh).lower(abstract_params(specs), tokens).compile().as_text()
            ops = sum(" all-to-all(" in line for line in text.splitlines())
            found[strategy, name] = ops, hlo.collectives(text, batch_rows=2)  # activations: 2 rows per data rank
    for name, n in (("forward", 2), ("backward", 4)):
        ops, moved = found["all_to_all", name]
        assert ops == n and moved["all-gather"] == moved["collective-permute"] == 0, (name, ops, moved)
    assert found["ring", "forward"][0] == 0 and found["ring", "forward"][1]["collective-permute"] > 0


def test_policies_that_recompute_attention_rerun_the_ring_forward(params, devices):
    """What `context_comm_bytes` assumes: full, dots and offload re-run the attention forward -
    its K/V hops included - in backward; elementwise and selective do not (ppermutes in the
    traced gradient: forward K, V, positions; backward K, V, positions and dK, dV twice)."""
    from meshlm.step import gradients

    counts = {}
    for policy in ("elementwise", "selective", "full", "dots", "offload"):
        cfg = config("llama", dict(context=2), policy=policy, document_mask=False)
        layout = make_layout(cfg.parallel, jax.devices()[:2])
        shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
        fn = lambda p, b, cfg=cfg, layout=layout, sh=shardings: gradients(p, b, None, cfg, layout, sh)[0]
        counts[policy] = str(jax.make_jaxpr(fn)(params["llama"], batch_for(cfg))).count("ppermute")
    assert counts == dict(elementwise=10, selective=10, full=13, dots=13, offload=13)


def test_a_batch_left_in_original_order_is_caught(params, devices):
    """Break it on purpose: the layout expects the load-balanced order; a batch the loader did not
    reorder gives other gradients, and the comparison says so."""
    cfg = config("llama", dict(context=4))
    with pytest.raises(AssertionError, match="differ from one device"):
        assert_same_grads(grads(cfg, params["llama"], reorder=False), reference("llama", params))


def test_dropout_bits_by_original_position_are_jax_bits():
    """`positional_bernoulli` is jax.random.bernoulli bit for bit (identity positions), its
    permutation (permuted positions) and its rows (a batch shard's); its 64-bit flat index is exact
    past 2^32 elements."""
    from meshlm.model.layers import flat_index_2x32, positional_bernoulli

    key = jax.random.key(7)
    for shape in [(3, 40, 24), (2, 16), (5, 8, 3, 4)]:
        perm = np.random.default_rng(0).permutation(shape[1])
        for p in (0.9, 0.5):
            ref = np.asarray(jax.random.bernoulli(key, p, shape))
            assert np.array_equal(positional_bernoulli(key, p, shape, {1: (jnp.arange(shape[1]), shape[1])}), ref)
            got = positional_bernoulli(key, p, shape, {1: (jnp.asarray(perm), shape[1])})
            assert np.array_equal(got, np.take(ref, perm, axis=1))
            rows = (1, *shape[1:])  # one batch row of the whole, as a batch shard holds it
            got = positional_bernoulli(key, p, rows, {0: (jnp.asarray([shape[0] - 1]), shape[0])})
            assert np.array_equal(got, ref[-1:])
            both = {0: (jnp.asarray([shape[0] - 1]), shape[0]), 1: (jnp.asarray(perm), shape[1])}
            assert np.array_equal(positional_bernoulli(key, p, rows, both), np.take(ref[-1:], perm, axis=1))
    shape = (4096, 131072, 16384)  # 2^43 elements: the high word matters
    rng = np.random.default_rng(1)
    coords = [rng.integers(0, s, 50, dtype=np.uint64) for s in shape]
    hi, lo = flat_index_2x32([jnp.asarray(c.astype(np.uint32)) for c in coords], shape)
    want = (coords[0] * np.uint64(shape[1]) + coords[1]) * np.uint64(shape[2]) + coords[2]
    got = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) + np.asarray(lo).astype(np.uint64)
    assert np.array_equal(got, want)


def test_reorder_round_trip_and_the_loader():
    assert context_order(4, True) == (0, 7, 1, 6, 2, 5, 3, 4)
    assert context_order(4, False) == (0, 1, 2, 3)
    idx = sequence_index(16, context_order(2, True))
    assert idx.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    x = np.arange(3 * 32).reshape(3, 32)
    for c, balanced in [(2, True), (4, True), (8, True), (4, False)]:
        order = context_order(c, balanced)
        assert np.array_equal(restore_sequence(reorder_sequence(x, order), order), x)
        assert not balanced or not np.array_equal(reorder_sequence(x, order), x)
    # the loader cuts documents in the original order, then reorders every array the same way
    tokens = np.random.default_rng(0).integers(0, 9, 4000).astype(np.uint16)
    order = context_order(4, True)
    plain, cp = (
        WindowLoader(tokens, 32, 4, seed=1, eot_id=0),
        WindowLoader(tokens, 32, 4, seed=1, eot_id=0, order=order),
    )
    a, b = plain.batch(3), cp.batch(3)
    assert a.keys() == b.keys() == {"inputs", "targets", "segment_ids", "positions"}
    for k in a:
        assert np.array_equal(reorder_sequence(a[k], order), b[k]), k


def test_load_balancing_equalises_causal_work():
    """Per-rank (query block, key block) pairs the kernel's skip rule admits: equal under load
    balancing, in total the single-device count nb(nb+1)/2 either way; unbalanced, rank r runs r
    full chunks and a diagonal one (the last about 2c-1 times the first)."""
    s, block = 4096, 128
    nb = s // block
    for c in (2, 4, 8):
        balanced = accounting.context_block_pairs(s, c, True, block)
        assert max(balanced) - min(balanced) <= 1 and sum(balanced) == nb * (nb + 1) // 2
        unbalanced = accounting.context_block_pairs(s, c, False, block)
        m = nb // c  # blocks per rank: rank r sees r full chunks before its own diagonal chunk
        assert unbalanced == [r * m * m + m * (m + 1) // 2 for r in range(c)]
        assert sum(unbalanced) == nb * (nb + 1) // 2


@pytest.mark.parametrize(
    "family, mesh, policy, attention",
    [
        ("llama", dict(context=2, tensor=4, context_strategy="ring"), "elementwise", "blockwise"),
        ("gpt", dict(context=4, tensor=2, context_strategy="all_gather"), "selective", "blockwise"),
        ("llama", dict(context=8, context_strategy="ring"), "dots", "blockwise"),
        ("llama", dict(context=2, tensor=2, context_strategy="all_to_all"), "elementwise", "blockwise"),
        ("gpt", dict(context=4, tensor=2, context_strategy="all_to_all"), "elementwise", "explicit"),
    ],
)
def test_context_parallel_stores_what_the_formula_says(family, mesh, policy, attention, devices):
    """Measured residual bytes per device (compiled program) = the formula with s/c tokens per
    rank: only this rank's Q, K, V, output and log-sum-exp, never a gathered K/V or an s x s tensor -
    except Ulysses' explicit kernel, which keeps the whole s x s scores of 1/(c t) of the heads."""
    from test_memory import _measure, paper_config

    base = paper_config(2, 1, False, policy, family)
    sp = mesh.get("tensor", 1) > 1
    par = dataclasses.replace(base.parallel, **mesh, sequence_parallel=sp)
    cfg = validate(dataclasses.replace(base, model=dataclasses.replace(base.model, attention=attention), parallel=par))
    measured, formula = _measure(cfg).activation_bytes, accounting.activation_memory(cfg)["total"]
    assert measured == pytest.approx(formula, rel=5e-3)


def with_parallel(cfg: RunConfig, **parallel) -> RunConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def test_context_accounting():
    cfg = config("llama", dict(context=2, tensor=2, data=2), dtype="bfloat16")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2))
    comm = accounting.context_comm_bytes(cfg)
    m, t = cfg.model, cfg.train
    local = t.seq_len // 2 * (t.global_batch // 2 // 2) * m.kv_heads * m.dim_head / 2  # one rank's K, one microbatch
    n = m.n_layers * 2  # layers x microbatches
    assert comm["forward"] == n * 1 * 2 * 2 * local  # 1 hop of bf16 K and V
    assert comm["backward"] == n * (1 * 2 * 2 * local + 2 * 2 * 4 * local)  # 1 K/V hop, 2 hops of fp32 dK/dV
    full = dataclasses.replace(cfg, remat=RematConfig("full"))
    assert accounting.context_comm_bytes(full)["forward"] == 2 * comm["forward"]  # attention forward runs twice
    gathered = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_strategy="all_gather"))
    assert accounting.context_comm_bytes(gathered)["backward"] == n * (2 * 2 * local + 2 * 4 * local)
    assert accounting.context_comm_bytes(config("llama")) == {}
    # Ulysses: (c-1)/c of one rank's Q (8 heads), K, V (4 each) and output (8), each way; bf16
    ulysses = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_strategy="all_to_all"))
    heads = local / m.kv_heads  # one rank's tokens x head_dim for one head (over tensor=2)
    assert accounting.context_comm_bytes(ulysses) == {"forward": n * 2 * heads * 24 / 2, "backward": n * heads * 24}
    # per device it falls as c grows (more ranks, fewer tokens each); the ring's grows
    wider = {c: dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context=c)) for c in (2, 4)}
    volume = {
        (strategy, c): sum(
            accounting.context_comm_bytes(
                dataclasses.replace(w, parallel=dataclasses.replace(w.parallel, context_strategy=strategy))
            ).values()
        )
        for strategy in ("ring", "all_to_all")
        for c, w in wider.items()
    }
    assert volume["all_to_all", 4] < volume["all_to_all", 2] and volume["ring", 4] > volume["ring", 2]
    # all_gather sends less than all_to_all exactly when n/k > 2c - 1 (bf16): 8 heads over 2 KV heads
    # (n/k = 4) at c=2 (3) but not at c=4 (7); over 4 KV heads (n/k = 2) at neither
    for kv, c, fewer in ((2, 2, True), (2, 4, False), (4, 2, False)):
        gqa = dataclasses.replace(cfg, model=dataclasses.replace(m, n_kv_heads=kv))
        sent = {
            s: sum(accounting.context_comm_bytes(with_parallel(gqa, context=c, context_strategy=s)).values())
            for s in ("all_gather", "all_to_all")
        }
        assert (sent["all_gather"] < sent["all_to_all"]) == fewer, (kv, c, sent)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(model=dict(attention="explicit")),
            "context parallelism (parallel.context > 1, context_strategy=ring) runs",
        ),
        # Ulysses: 4 KV heads over context=4 x tensor=2 (query heads 8 would divide)
        (
            dict(parallel=dict(context_strategy="all_to_all", tensor=2)),
            "splits the KV heads (model.n_kv_heads)=4 over context x tensor = 8",
        ),
        (
            dict(parallel=dict(context_strategy="all_to_all"), model=dict(n_heads=6, n_kv_heads=0, head_dim=8)),
            "model.n_heads=6",
        ),
        (dict(train=dict(seq_len=36)), "train.seq_len=36 is not divisible by 2 x context"),
        (dict(parallel=dict(context_strategy="ulysses")), "parallel.context_strategy='ulysses' unknown"),
        (dict(model=dict(attention_block=3)), "model.attention_block=3 does not divide the context chunk of 4"),
    ],
)
def test_bad_context_configs_are_refused(change, message):
    """(All are refused with context=4; each message names what to change.)"""
    cfg = config("llama", dict(context=4))
    sections = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in change.items()}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(dataclasses.replace(cfg, **sections))


def test_train_on_a_context_mesh_logs_the_one_device_losses(corpus_dir, tmp_path, devices):
    """End to end through the trainer and its loader (document masking, load balancing,
    validation): the same run on context=2 x tensor=2 + SP and on one device logs the same losses."""
    from meshlm.cli import main

    def run(name: str, *mesh: str) -> dict:
        args = ["train", "--recipe", "llama-tiny", "--steps", "3", "--run-dir", str(tmp_path / name), *mesh]
        for kv in (
            f"data.paths={corpus_dir}",
            "data.document_mask=true",
            "model.vocab_size=320",
            "model.attention=blockwise",
            "model.attention_block=8",
            "train.seq_len=64",
            "train.global_batch=4",
            "train.log_every=1",
            "train.eval_every=3",
        ):
            args += ["--set", kv]
        assert main(args) == 0
        return logged_losses(tmp_path / name)

    one = run("one")
    split = run("split", "--mesh", "context=2,tensor=2", "--set", "parallel.sequence_parallel=true")
    assert one.keys() == split.keys() == {1, 2, 3}
    np.testing.assert_allclose([split[k] for k in one], [one[k] for k in one], rtol=2e-5)
    val = [
        [
            json.loads(line)["val_loss"]
            for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()
            if "val_loss" in line
        ]
        for n in ("one", "split")
    ]
    assert len(val[0]) == 1 and val[0] == pytest.approx(val[1], rel=2e-5)
    info = json.loads((tmp_path / "split" / "run.json").read_text())
    assert info["mesh"]["context"] == 2


def test_generation_refuses_a_context_mesh():
    from meshlm.inference import _inference_config

    with pytest.raises(ConfigError, match="do not split the sequence over 'context'"):
        _inference_config(config("llama"), ParallelConfig(context=2))


def test_the_planner_splits_long_sequences_over_context():
    """llama-1b at 32k tokens, 4 sequences per step, on 8 H100s: the best plan uses context (with
    the blockwise kernel the recipe did not ask for) and says why; at 2k tokens it does not."""
    from meshlm import recipes
    from meshlm.insight import plan, plan_report
    from meshlm.platform.hardware import ACCELERATORS

    def best(seq_len: int, batch: int):
        cfg = recipes.get("llama-1b")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len, global_batch=batch))
        plans = plan.enumerate_plans(cfg, 8, ACCELERATORS["h100"])
        return plans[0], plan_report.explain_choice(plans), plan_report.explain_context_strategy(plans)

    long, why, strategy = best(32768, 4)
    assert not long.rejected and long.cfg.parallel.context > 1 and long.cfg.model.attention == "blockwise"
    assert why.startswith(f"context={long.cfg.parallel.context}: at s=32768") and "faster than" in why
    exchange = plan.EXCHANGE
    gathered = dataclasses.replace(long.cfg.parallel, context_strategy="all_gather")
    gathered = plan.estimate(dataclasses.replace(long.cfg, parallel=gathered), ACCELERATORS["h100"])
    # all-gather's exchange is timed whole; the ring's is reduced by the attention it may overlap
    # (the planner's assumption, unmeasured without a GPU)
    assert gathered.time[exchange] > 0 and long.time[exchange] < gathered.time[exchange]
    assert long.cfg.parallel.describe() == "data=2 fsdp=2 context=2 tensor=1"  # docs/long-sequences.md
    # the strategy: the ring (hops hidden), against the best all_gather and all_to_all plans, each timed
    assert strategy.startswith("context_strategy=ring: receives ") and "0 ms of it in the step" in strategy
    assert re.search(r"; all_gather at best \(.*all_gather.*\) 1\.\d+x the time, [\d,]+ MiB", strategy)
    assert re.search(r"; all_to_all at best \(.*all_to_all.*\) 1\.\d+x the time, [\d,]+ MiB", strategy)
    short, why, strategy = best(2048, 256)
    assert short.cfg.parallel.context == 1 and why.startswith("no context parallelism") and strategy is None


@pytest.mark.parametrize("kind", ["splash", "pallas-gpu"])
def test_all_gather_runs_the_device_kernel_at_each_chunks_causal_offset(kind, params, monkeypatch, devices):
    """`model.attention=fused` under all_gather where the device's kernel is TPU splash or Pallas GPU
    (chosen as on a TPU / GPU, run in interpret mode): each rank runs it per chunk of its queries
    against the gathered keys, at the chunk's causal offset (static, one switch branch per rank):
    splash's mask shifted, Pallas GPU as calls merged by log-sum-exp. Load-balanced c=2 x data=2 x
    tensor=2, GQA, document masks: gradients equal the same kernel on one device; every offset traced."""
    from meshlm.insight.startup_report import _attention
    from meshlm.model import kernels

    offsets, name = set(), "splash_attention" if kind == "splash" else "pallas_gpu_attention"
    whole, at = getattr(kernels, name), getattr(kernels, f"{name}_at")

    def traced(*args, **kw):
        offsets.add(args[5])
        return at(*args, **(kw | dict(interpret=True)))

    monkeypatch.setattr(kernels, "fused_implementation", lambda *a: (kind, "as on the device"))
    monkeypatch.setattr(kernels, f"{name}_at", traced)  # one device: splash calls it at offset 0
    monkeypatch.setattr(kernels, name, partial(whole, interpret=True))
    mesh = dict(context=2, data=2, tensor=2, context_strategy="all_gather")
    cfg = config("llama", mesh, attention="fused")
    got = grads(cfg, params["llama"])
    assert offsets == {0, 8, 16, 24}  # s=32 in 4 chunks of 8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert_same_grads(got, grads(config("llama", attention="fused"), params["llama"]))
    # the start-up report says what runs; where cuDNN would run, the Pallas GPU kernel, and why
    assert f"{kind} over context=2 (gathered K/V, " in _attention(cfg)[0]
    monkeypatch.setattr(kernels, "fused_implementation", lambda *a: ("cudnn", "as on an H100"))
    assert _attention(cfg)[0].endswith("merged by log-sum-exp; cuDNN's causal mask takes no offset)")
