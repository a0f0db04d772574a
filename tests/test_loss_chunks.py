"""The output layer and loss in token chunks (`remat.loss_chunks`, `loss.chunked_output_loss`): the
function equals NumPy's softmax cross-entropy and its gradients, and a train step's raw gradients,
loss and norm equal the whole-logits step's on the layouts that shard the tokens or the vocabulary
(tensor + SP, context, a pipeline's last stage with an MTP module), with tied embeddings, a loss
mask, dropout, microbatches and LoRA's frozen output layer. Memory and FLOPs: test_memory and
test_flops (no logits kept; no GEMM more than without chunks)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import build, loss_mask, random_batches, tiny_config
from meshlm.config import ConfigError, ParallelConfig, RematConfig
from meshlm.insight.hlo import replica_groups
from meshlm.model import transformer
from meshlm.model.loss import chunked_output_loss
from meshlm.step import make_eval_step, make_grad_step
from meshlm.validation import validate

RTOL = 1e-5


def test_chunked_loss_equals_numpy_and_its_gradients():
    """Logits x @ w over 4 strided chunks with a loss mask: the loss sum (differentiated or not), the
    count and the gradients of x and w (scaled by an outer cotangent of 3) equal NumPy's softmax minus
    one-hot by hand."""
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 8, 5, 11
    x, w = rng.normal(size=(b, t, d)).astype(np.float32), rng.normal(size=(d, v)).astype(np.float32)
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    project = lambda x, w: jnp.einsum("btd,dv->btv", x, w)
    f = lambda x, w: chunked_output_loss(project, x, w, targets, mask, 4)
    (loss, count), vjp = jax.vjp(f, x, w)
    dx, dw = vjp((jnp.float32(3.0), jnp.float32(0.0)))

    logits = np.einsum("btd,dv->btv", x.astype(np.float64), w)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    onehot = np.eye(v)[targets]
    nll = -np.log((probs * onehot).sum(-1))
    d_logits = 3.0 * (probs - onehot) * mask[..., None]
    np.testing.assert_allclose(loss, (nll * mask).sum(), rtol=1e-6)
    np.testing.assert_allclose(f(x, w)[0], loss, rtol=1e-6)  # undifferentiated (eval): the primal's own scan
    assert float(count) == mask.sum()
    np.testing.assert_allclose(dx, np.einsum("btv,dv->btd", d_logits, w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, np.einsum("btd,btv->dv", x, d_logits), rtol=1e-5, atol=1e-6)


CASES = {  # (family, mesh, model changes, train changes)
    "gpt, one device, dropout, 2 microbatches": ("gpt", {}, {}, dict(microbatches=2)),
    "gpt, fsdp=2 x data=2, dropout": ("gpt", dict(fsdp=2, data=2), {}, {}),
    "llama tied, data=2 x tensor=2 + SP": (
        "llama",
        dict(data=2, tensor=2, sequence_parallel=True),
        dict(tie_embeddings=True),
        {},
    ),
    "llama bf16, fsdp=2 x tensor=2 + SP": (
        "llama",
        dict(fsdp=2, tensor=2, sequence_parallel=True),
        dict(dtype="bfloat16"),
        {},
    ),
    "gpt, context=2 x tensor=2": ("gpt", dict(context=2, tensor=2, context_strategy="all_to_all"), {}, {}),
    "llama + MTP, 1f1b stage=2 x tensor=2 + SP": (
        "llama",
        dict(stage=2, tensor=2, sequence_parallel=True),
        dict(mtp_depth=1),
        dict(microbatches=4),
    ),
    "llama LoRA (frozen output layer), fsdp=2 x tensor=2": (
        "llama",
        dict(fsdp=2, tensor=2),
        dict(lora_rank=4, lora_targets=("wq", "wv", "w_down")),
        {},
    ),
}


def _grads(cfg, batch) -> dict:
    layout, _, _, shardings, state = build(cfg)
    return jax.tree.map(np.asarray, make_grad_step(cfg, layout, shardings.params)(state.params, batch, 3))


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_gives_the_whole_loss_gradients(case, devices, monkeypatch):
    family, mesh, model, train = CASES[case]
    cfg = tiny_config(family, mesh, n_layers=2, **train)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    cfg = validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, loss_mask=True)))
    batch = random_batches(cfg, 1)[0] | {"mask": loss_mask((cfg.train.global_batch, cfg.train.seq_len))}
    whole = _grads(cfg, batch)
    traced = []  # each head that runs chunked (the main loss; an MTP module's), as the step is traced
    real = transformer.chunked_output_loss
    monkeypatch.setattr(transformer, "chunked_output_loss", lambda *a: traced.append(a[5]) or real(*a))
    chunked = _grads(validate(dataclasses.replace(cfg, remat=RematConfig(loss_chunks=4))), batch)
    assert traced.count(4) >= 1 + cfg.model.mtp_depth
    assert chunked.keys() == whole.keys()
    tol = 2e-2 if cfg.model.dtype == "bfloat16" else RTOL  # bf16: rounding (dx before the scaling, dw per chunk)
    for key in whole:
        if key != "grads":
            np.testing.assert_allclose(chunked[key], whole[key], rtol=tol, err_msg=key)
    trained = 0
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(whole["grads"]), jax.tree.leaves(chunked["grads"]), strict=True
    ):
        scale = np.max(np.abs(a))
        assert np.max(np.abs(a - b)) <= tol * scale, jax.tree_util.keystr(path)
        trained += scale > 0
    assert trained >= 3  # LoRA: B starts at zero, so only the three B leaves have a gradient


def test_loss_chunks_must_split_the_sequence_shards_evenly():
    sp = tiny_config("llama", dict(tensor=2, sequence_parallel=True))  # seq_len 32, 2 shards under SP
    context = tiny_config("gpt", dict(context=2, context_strategy="all_to_all"))  # 2 shards over context
    for cfg in (sp, context):
        validate(dataclasses.replace(cfg, remat=RematConfig(loss_chunks=16)))
        for bad in (0, 3, 32):
            with pytest.raises(ConfigError, match=f"remat.loss_chunks={bad} must be >= 1 and divide"):
                validate(dataclasses.replace(cfg, remat=RematConfig(loss_chunks=bad)))


def test_eval_runs_the_loss_in_chunks_and_whole_on_a_length_they_do_not_split(devices, monkeypatch):
    """Eval (`make_eval_step`, what `meshlm eval` and the run's validation use): the chunked loss sum
    equals the whole loss's at the training length, and at a length 4 chunks do not split (30) the
    loss runs whole instead of failing."""
    cfg = tiny_config("llama", dict(data=2, tensor=2, sequence_parallel=True))
    layout, _, _, shardings, state = build(cfg)
    chunked = validate(dataclasses.replace(cfg, remat=RematConfig(loss_chunks=4)))
    tokens, real = random_batches(cfg, 1)[0], transformer.chunked_output_loss
    for length, runs_chunked in ((32, True), (30, False)):
        batch = {k: v[:, :length] for k, v in tokens.items()}
        whole = make_eval_step(cfg, layout, shardings.params)(state.params, batch)
        traced = []
        monkeypatch.setattr(transformer, "chunked_output_loss", lambda *a, t=traced: t.append(1) or real(*a))
        got = make_eval_step(chunked, layout, shardings.params)(state.params, batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=1e-6)
        assert bool(traced) == runs_chunked


def test_the_planner_counts_the_logits_gradient_and_chunks_what_does_not_fit():
    """gpt-125m on one TPU v5e (vocabulary 50,304, 2048-token rows): at 32 microbatches the whole loss
    fits and the plan counts its logits' gradient beside the kept logits (and the microbatch's gradient
    beside the accumulator); at 8 (12.3 GiB of logits)
    the plan runs the loss in chunks of 1024 tokens, fits, and keeps the whole loss's step time: the
    layout `benchmarks/tpu.sh --sections memory` measured at 6.50 GiB (whole: out of memory)."""
    from meshlm import accounting, recipes
    from meshlm.insight import plan as planner
    from meshlm.insight import plan_report
    from meshlm.insight.step_peak import planned_loss_chunks
    from meshlm.platform.hardware import ACCELERATORS

    tpu, base = ACCELERATORS["tpu-v5e"], recipes.get("gpt-125m")
    model = dataclasses.replace(base.model, attention="blockwise")
    layout = lambda micro, policy: dataclasses.replace(
        base,
        model=model,
        parallel=ParallelConfig(),
        remat=RematConfig(policy),
        train=dataclasses.replace(base.train, microbatches=micro),
    )
    whole = planner.estimate(validate(layout(32, "elementwise")), tpu)
    assert not whole.rejected and whole.cfg.remat.loss_chunks == 1
    logits = accounting.activation_memory(whole.cfg)["outside"]["logits"]
    assert whole.memory["logits gradient"] == logits == 4 * 8 * 2048 * 50304
    # and the microbatch's fp32 gradient beside the accumulator (32 microbatches)
    assert whole.memory["microbatch gradient"] == 4 * planner.sharded_params(whole.cfg, trainable=True) > 4 * 1.2e8

    asked = validate(layout(8, "full"))
    chunked = planner.estimate(asked, tpu)
    assert not chunked.rejected and chunked.cfg.remat.loss_chunks == 64  # 65,536 tokens / 1024
    assert chunked.memory["loss chunk (logits and gradient)"] == 2 * 4 * 1024 * 50304
    assert "logits" not in accounting.activation_memory(chunked.cfg)["outside"]
    unchunked = planner.estimate(asked, tpu, memory_limit=float("inf"))
    assert unchunked.cfg.remat.loss_chunks == 1 and unchunked.total_memory > tpu.memory
    assert chunked.step_time == unchunked.step_time
    assert "loss-chunks=64" in chunked.describe()
    assert plan_report.to_json([chunked], tpu)["plans"][0]["loss_chunks"] == 64
    # where the token floor does not bind: the fewest chunks whose logits fit in the hidden state's bytes
    small_vocab = dataclasses.replace(asked, model=dataclasses.replace(model, vocab_size=8192))
    assert planned_loss_chunks(small_vocab) == 32  # 4 x 8192 / (2 x 768) = 21.3 -> the next divisor of 2048


def _moves_data(line: str) -> bool:
    """False for a collective over groups of one device (the transpose of a region nested over size-1
    axes leaves them; they move nothing)."""
    groups = replica_groups(line)
    return groups is None or max(map(len, groups)) > 1


@pytest.mark.parametrize("mesh", [dict(data=2), dict(fsdp=2, tensor=2, sequence_parallel=True)], ids=str)
def test_a_split_batch_reduces_the_output_gradient_once_after_the_chunks(mesh, devices):
    """Each device loops over its own tokens' chunks (`collectives.over_tokens`), so the output layer's
    weight gradient is reduced once, outside the loop, as without chunks: on data=2 (GSPMD's layout) and
    on fsdp=2 x tensor=2 + SP (inside the tensor region's nesting). Left to GSPMD (before over_tokens), XLA
    reduced the [d, v] gradient in the chunk loop's body, once per chunk; a reduce-scatter over fsdp in the
    region made GSPMD all-gather the gradient over `tensor` first (more [d, v] bytes than without chunks)."""
    shape = re.compile(r"f32\[(64|32),(256|128)\]")  # tiny llama's lm_head [d, v] and its shards

    def collectives(chunks: int) -> list[tuple[str, str, int]]:
        """(computation, op, bytes) of each collective of a [d, v]-sized array that moves data."""
        cfg = validate(dataclasses.replace(tiny_config("llama", mesh), remat=RematConfig(loss_chunks=chunks)))
        layout, _, _, shardings, state = build(cfg)
        batch = random_batches(cfg, 1)[0]
        text = make_grad_step(cfg, layout, shardings.params).lower(state.params, batch, 0).compile().as_text()
        found = []
        for comp in text.split("\n\n"):
            for line in comp.split("\n"):
                op = re.search(r" (all-reduce|reduce-scatter|all-gather)(-start)?\(", line)
                sizes = [int(d) * int(v) * 4 for d, v in shape.findall(line[: op.start()])] if op else []
                if sizes and _moves_data(line):
                    found.append((comp.split("\n")[0].split()[0], op.group(1), sum(sizes)))
        return found

    once, chunked = collectives(1), collectives(4)
    reduced = lambda found: [op for _, op, _ in found if op != "all-gather"]
    assert reduced(once) and {c for c, _, _ in once} == {"ENTRY"}
    assert {c for c, _, _ in chunked} == {"ENTRY"}  # nothing in the loop's body
    assert len(reduced(chunked)) == len(reduced(once))  # as many (an unrolled loop's per-chunk ones would add)
    assert sum(b for *_, b in chunked) <= sum(b for *_, b in once)
