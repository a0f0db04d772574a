"""Before/after of two layout changes in meshlm's own code paths, side by side in one process.

1. Dense layers on b*t rows (`layers.dense`): the weight gradient becomes one 2-D contraction, so
   XLA:CPU no longer writes the activation gradient transposed inside an element-wise fusion.
2. MHA scores without a unit query-group axis (`layers._grouped`): [b, k, t, s] instead of
   [b, k, 1, t, s] (GQA keeps its group axis).

"before" restores the previous code paths by patching the two helpers (plain 3-D einsums; a group
axis always), so all variants are meshlm's real train step (`benchmarks/vs_pytorch.py`'s
`meshlm_stepper`: data path + step) on issue 11's shapes, one device, in alternating rounds.

    python benchmarks/dense_rows.py [--families gpt,llama] [--sizes small,medium] [--rounds 5] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp

import vs_pytorch as vs
from _markdown import publish
from meshlm.model import layers
from meshlm.parallel import collectives

VARIANTS = {  # name: (dense on rows, MHA without a group axis)
    "before (3-D einsums, group axis)": (False, False),
    "rows only": (True, False),
    "group axis dropped only": (False, True),
    "after (both)": (True, True),
}


def _configure(rows: bool, squeeze: bool, real_dense, real_grouped) -> None:
    plain = lambda equation, x, w, flat=True, **kw: jnp.einsum(equation, x, w, **kw)
    plain_shared = lambda equation, x, ws, flat=True, **kw: tuple(jnp.einsum(equation, x, w, **kw) for w in ws)
    layers.dense, collectives.dense = (real_dense[0], real_dense[0]) if rows else (plain, plain)
    layers.dense_shared = real_dense[1] if rows else plain_shared
    layers._grouped = real_grouped if squeeze else (lambda n, k: True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="gpt,llama")
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    real_dense, real_grouped = (layers.dense, layers.dense_shared), layers._grouped
    command = " ".join(["python benchmarks/dense_rows.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, jax {jax.__version__}; "
        f"vocab {vs.VOCAB}, seq {vs.SEQ}, batch {vs.BATCH}, fp32, 1 device, meshlm's train step and data path; "
        f"median of {args.rounds} alternating rounds of {args.steps} steps; ms per step)",
        "",
        "| family | size | " + " | ".join(VARIANTS) + " | after / before |",
        "|---|---|" + "---:|" * (len(VARIANTS) + 1),
    ]
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            patches = {name: partial(_configure, *flags, real_dense, real_grouped) for name, flags in VARIANTS.items()}
            restore = partial(_configure, True, True, real_dense, real_grouped)
            t = vs.time_patched_steps(vs.meshlm_config(family, size), patches, restore, args.rounds, args.steps)
            first, last = next(iter(VARIANTS)), list(VARIANTS)[-1]
            cells = " | ".join(f"{1e3 * t[k]:.0f}" for k in VARIANTS)
            lines.append(f"| {family} | {size} | {cells} | {t[last] / t[first]:.2f}x |")
            print(lines[-1], flush=True)
    publish("dense_rows", lines, args.write)


if __name__ == "__main__":
    main()
