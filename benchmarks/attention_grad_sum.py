"""dK and dV of chunked explicit attention: summed in place against padded to all keys and added.

Explicit attention runs the queries in chunks (`model.attention_chunk`); each chunk's key and value
gradients cover only the keys it saw, and the backward pass sums them over the chunks. meshlm adds
each chunk's part into the running sum in place (`layers._add_rows`: one buffer, a
dynamic-update-slice per chunk). The "padded" variant pads the running sum to the next chunk's keys
before adding, the form a sum of padded parts takes (meshlm's code before this change padded every
part to all keys and summed): XLA:CPU then fuses the pads and adds into every consumer of the sum
(the input gradient's GEMM, the weight gradient's transposed copy, a bias gradient), each a
strided transpose, and re-adds the padded copies in each. Both variants make the same additions in
the same order: the gradients are checked equal, bit for bit, before timing.

For each family (the medium models of `benchmarks/vs_pytorch.py`, one device), in alternating
rounds: one layer's forward + backward, and meshlm's whole train step (`vs_pytorch.meshlm_stepper`).
`--cores 1` pins the process to one core first (less noise from thread scheduling).

    python benchmarks/attention_grad_sum.py [--cores 0] [--families gpt,llama] [--rounds 7] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys

import _cores  # jax-free


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cores", type=int, default=0, help="pin the process to this many cores (0: all)")
    ap.add_argument("--families", default="gpt,llama")
    ap.add_argument("--size", default="medium")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="calls per timed round")
    ap.add_argument("--write", action="store_true")
    return ap.parse_args()


if __name__ == "__main__":  # pinned before JAX sizes its thread pools
    ARGS = parse_args()
    _cores.pin(ARGS.cores)

import vs_pytorch as vs  # first: meshlm's host allocator settings and JAX_PLATFORMS=cpu, before JAX loads

# isort: split
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from _markdown import publish
from meshlm.model import layers, transformer
from meshlm.model.params import init_params
from meshlm.parallel.mesh import make_layout
from meshlm.train_state import setup

IN_PLACE = layers._add_rows


def add_rows_padded(total: jax.Array | None, part: jax.Array) -> jax.Array:
    """The running sum padded with zeros to `part`'s keys, then added: pads and adds that XLA fuses
    into the sum's consumers, as it did the old code's sum of parts each padded to all keys."""
    if total is None:
        return part
    pad = [(0, 0)] * (part.ndim - 2) + [(0, part.shape[-2] - total.shape[-2]), (0, 0)]
    return jnp.pad(total, pad) + part


VARIANTS = {"padded": add_rows_padded, "in place": IN_PLACE}


def use(name: str) -> None:
    layers._add_rows = VARIANTS[name]


def one_layer(family: str, size: str) -> dict:
    """{variant: (call, sync)}: one layer's forward + backward (vjp of a fixed cotangent), jitted
    under each variant; their gradients checked bit for bit equal."""
    run = vs.meshlm_config(family, size)
    cfg = run.model
    specs, _, _ = setup(run, make_layout(run.parallel, jax.devices()[:1]))
    p = jax.tree.map(lambda a: a[0], init_params(specs, jax.random.key(0))["layers"])
    rng = np.random.default_rng(0)
    x, g = (jnp.asarray(rng.standard_normal((vs.BATCH, vs.SEQ, cfg.d_model)).astype(np.float32)) for _ in range(2))
    block = partial(transformer.BLOCKS[family], cfg=cfg, layout=None, remat_policy="elementwise")
    out, grads = {}, {}
    for name in VARIANTS:
        use(name)
        fn = jax.jit(lambda g, x, p: jax.vjp(lambda x, p: block(x, p, None), x, p)[1](g))
        grads[name] = jax.block_until_ready(fn(g, x, p))  # traced under this variant
        out[name] = (lambda fn=fn: jax.block_until_ready(fn(g, x, p)), lambda: None)
    use("in place")
    for a, b in zip(*(jax.tree.leaves(v) for v in grads.values()), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), "the variants' gradients differ"
    return out


def main(args: argparse.Namespace) -> None:
    cores = len(os.sched_getaffinity(0))
    command = " ".join(["python benchmarks/attention_grad_sum.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {cores} CPU core(s), jax {jax.__version__}, 1 device; "
        f"{args.size} model of vs_pytorch.py, batch {vs.BATCH}, seq {vs.SEQ}, fp32, attention_chunk 64 (4 query "
        f"chunks); median ms of {args.rounds} alternating rounds of {args.steps} calls)",
        "",
        "| family | one layer fwd + bwd: padded | in place | in place / padded | train step: padded | in place "
        "| in place / padded |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for family in args.families.split(","):
        layer = vs.time_variants(one_layer(family, args.size), args.rounds, args.steps)
        patches = {name: partial(use, name) for name in VARIANTS}
        step = vs.time_patched_steps(
            vs.meshlm_config(family, args.size), patches, partial(use, "in place"), args.rounds, args.steps
        )
        ms = lambda t: {k: v * 1e3 for k, v in t.items()}
        a, b = ms(layer), ms(step)
        lines.append(
            f"| {family} | {a['padded']:.1f} | {a['in place']:.1f} | {a['in place'] / a['padded']:.3f} "
            f"| {b['padded']:.0f} | {b['in place']:.0f} | {b['in place'] / b['padded']:.3f} |"
        )
        print(lines[-1], flush=True)
    publish(f"attention_grad_sum_{cores}core", lines, args.write)


if __name__ == "__main__":
    main(ARGS)
