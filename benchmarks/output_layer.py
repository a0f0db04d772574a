"""Before/after of weight gradients against a transposed copy, side by side in one process.

`layers.dense_shared` now gives every dense layer's weight gradient as a plain GEMM against a
transposed copy of the smaller operand, x or the output gradient (`layers._dense_gradients`),
instead of autodiff's contraction over the rows of both operands in place. "before" restores the
previous code path by patching `layers.transposed_copy_gradients` (False: the einsum on the rows
view, differentiated by autodiff, as on GPUs). Two tables: the output layer and the loss alone
(forward + backward, with `torch.nn.functional`'s linear + cross-entropy on the same shapes for
reference; its weight is [v, d] in both rows, as `F.linear` takes it), and meshlm's whole train
step (`benchmarks/vs_pytorch.py`'s `meshlm_stepper`: data path + step) on issue 11's shapes, one
device.

    python benchmarks/output_layer.py [--families gpt,llama] [--sizes small,medium] [--rounds 9] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

import vs_pytorch as vs
from _markdown import publish
from meshlm.model import layers, loss

VARIANTS = {"before (autodiff)": False, "after (transposed copy)": True}
BEFORE, AFTER = VARIANTS


def _configure(transposed: bool) -> None:
    layers.transposed_copy_gradients = lambda: transposed


def _median_ms(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    return {name: 1e3 * statistics.median(v) for name, v in times.items()}


def output_layer_table(rounds: int) -> list[str]:
    """Final projection + cross-entropy, forward and backward, for the small configs' shapes."""
    b, t, d, v = vs.BATCH, vs.SEQ, vs.SIZES["small"][1], vs.VOCAB
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, t, d), np.float32)
    w_vd = (0.02 * rng.standard_normal((v, d))).astype(np.float32)
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    lines = [
        f"The output layer and the loss alone: x [{b}, {t}, {d}] -> logits [{b}, {t}, {v}] -> summed "
        f"cross-entropy, forward + backward (gradients of x and of the weight), fp32, 1 device; "
        f"median of {rounds} alternating rounds of 5 calls; ms",
        "",
        "| weight | " + " | ".join(VARIANTS) + " | PyTorch (`F.linear` + `F.cross_entropy`) | after / before |",
        "|---|" + "---:|" * (len(VARIANTS) + 2),
    ]
    tx = torch.from_numpy(x).requires_grad_()
    tt = torch.from_numpy(targets).long()
    for label, equation, w in (
        ("tied, [v, d] (gpt)", "btd,vd->btv", w_vd),
        ("[d, v] (llama)", "btd,dv->btv", w_vd.T.copy()),
    ):
        fns = {}
        for name, transposed in VARIANTS.items():
            _configure(transposed)

            def loss_of(x, w, equation=equation):
                logits = layers.dense(equation, x, w, preferred_element_type=jnp.float32)
                return loss.cross_entropy_sum(logits, jnp.asarray(targets))[0]

            grad = jax.jit(jax.value_and_grad(loss_of, argnums=(0, 1)))
            jx, jw = jnp.asarray(x), jnp.asarray(w)
            jax.block_until_ready(grad(jx, jw))
            fns[name] = lambda grad=grad, jx=jx, jw=jw: jax.block_until_ready(grad(jx, jw))
        _configure(True)
        tw = torch.from_numpy(w_vd).requires_grad_()

        def torch_step(tw=tw):
            out = torch.nn.functional.cross_entropy(
                torch.nn.functional.linear(tx, tw).view(-1, v), tt.view(-1), reduction="sum"
            )
            out.backward()
            tx.grad = tw.grad = None

        fns["PyTorch"] = torch_step
        ms = _median_ms(fns, rounds, 5)
        cells = " | ".join(f"{ms[k]:.1f}" for k in [*VARIANTS, "PyTorch"])
        lines.append(f"| {label} | {cells} | {ms[AFTER] / ms[BEFORE]:.2f}x |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="gpt,llama")
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    command = " ".join(["python benchmarks/output_layer.py", *sys.argv[1:]])
    versions = f"jax {jax.__version__}, torch {torch.__version__}"
    head = f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, {versions})"
    publish("output_layer_alone", [head, "", *output_layer_table(args.rounds * 3)], args.write)
    lines = [
        f"Command: same invocation; vocab {vs.VOCAB}, seq {vs.SEQ}, batch {vs.BATCH}, fp32, 1 device, meshlm's train "
        f"step and data path; median of {args.rounds} alternating rounds of {args.steps} steps; ms per step",
        "",
        "| family | size | " + " | ".join(VARIANTS) + " | after / before |",
        "|---|---|" + "---:|" * (len(VARIANTS) + 1),
    ]
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            patches = {name: partial(_configure, transposed) for name, transposed in VARIANTS.items()}
            restore = partial(_configure, True)
            t = vs.time_patched_steps(vs.meshlm_config(family, size), patches, restore, args.rounds, args.steps)
            cells = " | ".join(f"{1e3 * t[k]:.0f}" for k in VARIANTS)
            lines.append(f"| {family} | {size} | {cells} | {t[AFTER] / t[BEFORE]:.2f}x |")
            print(lines[-1], flush=True)
    publish("output_layer_step", lines, args.write)


if __name__ == "__main__":
    main()
