"""Explicit attention in query chunks (`model.attention_chunk`): before/after, side by side in one process.

Two tables:

1. meshlm's train step (`benchmarks/vs_pytorch.py`'s `meshlm_stepper`: data path + step, one
   device) on issue 11's shapes, for `attention_chunk` = 0 (the whole s x s score matrix at once),
   32, 64 (the default) and 128, and "before": the explicit attention core as it was before the
   chunks (scores [b, k, t, s] from [b, t, k, h] operands, 1/sqrt(h) applied to the scores, whole
   matrix; restored below by patching `layers.causal_attention`).
2. The attention core alone (Q, K, V -> output, forward + backward, jitted), b=8, t=256, 8 query
   heads of 32, MHA and GQA (2 kv heads): the same variants, and PyTorch's
   `scaled_dot_product_attention(is_causal=True)` (its CPU flash kernel) on the same shapes.

    python benchmarks/attention_chunks.py [--families gpt,llama] [--sizes small,medium] [--rounds 5] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

import vs_pytorch as vs
from _markdown import publish
from meshlm.model import layers

CHUNKS = (0, 32, 64, 128)
BEFORE = "before (whole matrix, scaled scores)"


# ---------------------------------------------------------------- the core before query chunks


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _before_softmax_av(scores, v, keep, same_doc, rate):
    return _before_fwd(scores, v, keep, same_doc, rate)[0]


def _before_eqs(grouped: bool) -> tuple[str, str, str]:  # scores, attention over V, its operands' axes
    if grouped:
        return "btkgh,bskh->bkgts", "bkgts,bskh->btkgh", ("bkgts", "bskh", "btkgh")
    return "btkh,bskh->bkts", "bkts,bskh->btkh", ("bkts", "bskh", "btkh")


def _before_fwd(scores, v, keep, same_doc, rate):
    probs = layers._causal_softmax(scores, same_doc)
    dropped = probs if keep is None else layers._apply_keep_mask(probs, keep, rate)
    return jnp.einsum(_before_eqs(scores.ndim == 5)[1], dropped, v), (probs, keep, dropped, v)


def _before_bwd(rate, res, g):
    probs, keep, dropped, v = res
    p_axes, v_axes, o_axes = _before_eqs(probs.ndim == 5)[2]
    d_dropped = jnp.einsum(f"{o_axes},{v_axes}->{p_axes}", g, v)
    dv = jnp.einsum(f"{p_axes},{o_axes}->{v_axes}", dropped, g)
    d_probs = d_dropped if keep is None else layers._mask_bwd(rate, keep, d_dropped)[0]
    p, gp = probs.astype(jnp.float32), d_probs.astype(jnp.float32)
    return (p * (gp - jnp.sum(gp * p, axis=-1, keepdims=True))).astype(probs.dtype), dv, None, None


_before_softmax_av.defvjp(_before_fwd, _before_bwd)


def before_causal_attention(q, k, v, segment_ids=None, dropout_rate=0.0, key=None, chunk=0):
    b, t, n, h = q.shape
    kv = k.shape[2]
    grouped = n != kv
    q = q.reshape(b, t, kv, n // kv, h) if grouped else q
    scores = jnp.einsum(_before_eqs(grouped)[0], q, k) * jnp.asarray(1 / math.sqrt(h), q.dtype)
    keep = None if key is None or dropout_rate == 0 else jax.random.bernoulli(key, 1 - dropout_rate, scores.shape)
    same = None if segment_ids is None else layers.same_document(segment_ids)
    if same is not None and not grouped:
        same = same[:, :, 0]
    return _before_softmax_av(scores, v, keep, same, dropout_rate).reshape(b, t, n, h)


# ---------------------------------------------------------------- tables


def step_row(family: str, size: str, rounds: int, steps: int) -> dict[str, float]:
    base = vs.meshlm_config(family, size)
    with_chunk = lambda c: dataclasses.replace(base, model=dataclasses.replace(base.model, attention_chunk=c))
    real = layers.causal_attention
    steppers = {}
    try:
        layers.causal_attention = before_causal_attention
        steppers[BEFORE] = vs.meshlm_stepper(with_chunk(0))
        steppers[BEFORE][0]()  # trace and compile with the old core
    finally:
        layers.causal_attention = real
    for c in CHUNKS:
        steppers[f"chunk {c}"] = vs.meshlm_stepper(with_chunk(c))
    return vs.time_variants(steppers, rounds, steps)


def core_row(kv_heads: int, rounds: int) -> dict[str, float]:
    b, t, n, h = 8, 256, 8, 32
    ks = jax.random.split(jax.random.key(0), 4)
    q, d_out = (jax.random.normal(k, (b, t, n, h)) for k in ks[:2])
    k, v = (jax.random.normal(kk, (b, t, kv_heads, h)) for kk in ks[2:])

    def jitted(fn):
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.vdot(fn(q, k, v), d_out), argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(grads(q, k, v)), lambda: None

    variants = {BEFORE: jitted(before_causal_attention)}
    for c in CHUNKS:
        variants[f"chunk {c}"] = jitted(partial(layers.causal_attention, chunk=c))
    tq, tk, tv, tg = (
        torch.tensor(np.asarray(x)).transpose(1, 2).contiguous().requires_grad_()
        for x in (q, jnp.repeat(k, n // kv_heads, 2), jnp.repeat(v, n // kv_heads, 2), d_out)
    )

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).backward(tg)

    variants["PyTorch SDPA"] = (sdpa, lambda: None)
    return vs.time_variants(variants, rounds, 10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="gpt,llama")
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    command = " ".join(["python benchmarks/attention_chunks.py", *sys.argv[1:]])
    names = [BEFORE] + [f"chunk {c}" for c in CHUNKS]
    head = f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, jax {jax.__version__}, "
    lines = [
        head + f"torch {torch.__version__}; vocab {vs.VOCAB}, seq {vs.SEQ}, batch {vs.BATCH}, fp32, 1 device; "
        f"median of {args.rounds} alternating rounds of {args.steps} steps; ms per train step)",
        "",
        "| family | size | " + " | ".join(names) + " | chunk 64 / before |",
        "|---|---|" + "---:|" * (len(names) + 1),
    ]
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            t = step_row(family, size, args.rounds, args.steps)
            cells = " | ".join(f"{1e3 * t[k]:.0f}" for k in names)
            lines.append(f"| {family} | {size} | {cells} | {t['chunk 64'] / t[BEFORE]:.2f}x |")
            print(lines[-1], flush=True)
    publish("attention_chunks_step", lines, args.write)

    core_names = [*names, "PyTorch SDPA"]
    lines = [
        f"Command: same invocation; the attention core alone, b=8, t=256, 8 query heads of 32, fp32, "
        f"forward + backward; median of {args.rounds} alternating rounds of 10 calls; ms",
        "",
        "| kv heads | " + " | ".join(core_names) + " | chunk 64 / PyTorch |",
        "|---|" + "---:|" * (len(core_names) + 1),
    ]
    for kv_heads in (8, 2):
        t = core_row(kv_heads, args.rounds)
        cells = " | ".join(f"{1e3 * t[k]:.1f}" for k in core_names)
        lines.append(f"| {kv_heads} | {cells} | {t['chunk 64'] / t['PyTorch SDPA']:.2f}x |")
        print(lines[-1], flush=True)
    publish("attention_chunks_core", lines, args.write)


if __name__ == "__main__":
    main()
