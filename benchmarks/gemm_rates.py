"""The dense GEMMs of issue 11's models alone: PyTorch (`torch.mm`, its BLAS) against XLA (a jitted
`dot_general`, what meshlm's step runs), side by side in one process, in GFLOP/s.

meshlm's step spends most of its time in these GEMMs (section "Where the step's time goes"), so
how fast each framework's matmul library runs on the host sets much of `vs_pytorch.py`'s ratio:
this table tells that part apart from what meshlm's own code does. For each GEMM shape of a layer
and the head (rows = batch * seq = 2048): the forward product x @ w, the input gradient g @ w^T and
the weight gradient x^T @ g, with weights stored [in, out] and the transposed operands read in place;
and the 1024^3 product of the MFU probe. Median of alternating rounds.

Both libraries get the same operands in the same layout. It is each library's speed per shape, not
each framework's exact products: `nn.Linear` stores its weights [out, in], gpt's tied head [vocab, d]
in meshlm, and meshlm's weight gradients on CPU multiply a transposed copy of the activations
(`layers._dense_gradients`).

    python benchmarks/gemm_rates.py [--sizes medium] [--families gpt,llama] [--cores 0] [--write]
"""

from __future__ import annotations

import _cores  # jax-free

if __name__ == "__main__":  # pinned before JAX and PyTorch size their thread pools
    ARGS = _cores.side_by_side_args(sizes="medium")
    _cores.pin(ARGS.cores)

import vs_pytorch as vs  # first: meshlm's host allocator settings and JAX_PLATFORMS=cpu, before JAX loads

# isort: split
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from _markdown import publish
from meshlm.platform.hardware import cpu_description

ROWS = vs.BATCH * vs.SEQ


def shapes(family: str, size: str) -> dict[str, tuple[str, int, int, int]]:
    """{name: (kind, m, k, n)}, the product [m, k] x [k, n], for each GEMM of one layer and the head
    (names without the family: families whose GEMMs have the same shapes share a row)."""
    cfg = vs.meshlm_config(family, size).model
    d, f, v = cfg.d_model, cfg.ffn, cfg.vocab_size
    out = {}
    dense = {"attention d->d": (d, d), "mlp d->ffn": (d, f), "mlp ffn->d": (f, d), "head d->vocab": (d, v)}
    for name, (i, o) in dense.items():
        out[f"{size} {name} forward"] = ("forward", ROWS, i, o)
        out[f"{size} {name} input grad"] = ("input grad", ROWS, o, i)
        out[f"{size} {name} weight grad"] = ("weight grad", i, ROWS, o)
    return out


def gemm_pair(kind: str, m: int, k: int, n: int):
    """(torch call, jax call) computing the same [m, n] product from the same operands, stored as the
    module docstring says."""
    # (stored shapes of the two operands, the axes they contract)
    layout = {
        "forward": ((m, k), (k, n), 1, 0),  # x @ w
        "input grad": ((m, k), (n, k), 1, 1),  # g @ w^T, w stored [in, out] = [n, k]
        "weight grad": ((k, m), (k, n), 0, 0),  # x^T @ g, x stored [rows, in] = [k, m]
    }
    sa, sb, ca, cb = layout[kind]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa, np.float32), rng.standard_normal(sb, np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ta, tb = (ta.t() if ca == 0 else ta), (tb.t() if cb == 1 else tb)  # transposed views, read in place
    torch_call = lambda: torch.mm(ta, tb)
    dims = (((ca,), (cb,)), ((), ()))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    f = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims))
    return torch_call, lambda: f(ja, jb).block_until_ready()


def main(args) -> None:
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    command = " ".join(["python benchmarks/gemm_rates.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {cpu_description()}, {cores} of {os.cpu_count()} "
        f"CPU cores, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()} kernels), "
        f"jax {jax.__version__}; fp32; median GFLOP/s of {args.rounds * 4} alternating rounds of {args.steps} calls)",
        "",
        "| GEMM | [m, k] x [k, n] | PyTorch GFLOP/s | XLA GFLOP/s | XLA / PyTorch |",
        "|---|---|---:|---:|---:|",
    ]
    rows = {("forward", 1024, 1024, 1024): ["MFU probe 1024^3", []]}  # product: [name, families]
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            for name, product in shapes(family, size).items():
                rows.setdefault(product, [name, []])[1].append(family)
    for (kind, m, k, n), (name, families) in rows.items():
        name = f"{', '.join(families)} {name}" if families else name
        torch_call, jax_call = gemm_pair(kind, m, k, n)
        calls = {"torch": (torch_call, lambda: None), "jax": (jax_call, lambda: None)}  # each call returns done
        rate = {fw: 2 * m * k * n / t / 1e9 for fw, t in vs.time_variants(calls, args.rounds * 4, args.steps).items()}
        lines.append(
            f"| {name} | [{m}, {k}] x [{k}, {n}] | {rate['torch']:.0f} | {rate['jax']:.0f} "
            f"| {rate['jax'] / rate['torch']:.2f}x |"
        )
        print(lines[-1], flush=True)
    publish("gemm_rates" if cores == os.cpu_count() else f"gemm_rates_{cores}core", lines, args.write)


if __name__ == "__main__":
    main(ARGS)
