"""Would a faster PRNG make dropout cheaper on this CPU? Time drawing P2's attention-dropout mask
(b=8, a=8, s=256: 4M Bernoulli draws) with JAX's key implementations, side by side, and check
which ones give the same bits on a sequence-parallel tensor=4 layout as on one device (what
meshlm's equivalence tests need). `philox4x32` is left out: it fails to compile under sharding in
JAX 0.10.

    python benchmarks/dropout_rng.py [--rounds 7] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from _markdown import publish
from meshlm.config import ParallelConfig
from meshlm.model import layers
from meshlm.model.transformer import RESIDUAL
from meshlm.parallel.mesh import make_layout

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
SHAPE = (8, 8, 256, 256)


def layout_invariant(impl: str) -> bool:
    """Dropout of a sequence-sharded activation (tensor=4 + SP) equals the unsharded one."""
    key = jax.random.fold_in(jax.random.key(5, impl=impl), 3)
    sharding = make_layout(ParallelConfig(tensor=4, sequence_parallel=True)).sharding(RESIDUAL)
    x = jnp.ones((4, 64, 32))
    sharded = jax.jit(lambda x: layers.dropout(x, 0.5, key), in_shardings=sharding, out_shardings=sharding)(x)
    return bool(np.array_equal(np.asarray(sharded), np.asarray(jax.jit(lambda x: layers.dropout(x, 0.5, key))(x))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    device = jax.devices()[0]
    draw = {}
    for impl in IMPLS:
        key = jax.device_put(jax.random.fold_in(jax.random.key(0, impl=impl), 1), device)
        fn = jax.jit(lambda k: jax.random.bernoulli(k, 0.9, SHAPE))
        fn(key).block_until_ready()
        draw[impl] = (fn, key)
    times = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl, (fn, key) in draw.items():
            t = time.perf_counter()
            for _ in range(5):
                fn(key).block_until_ready()
            times[impl].append((time.perf_counter() - t) / 5)
    base = float(np.median(times[IMPLS[0]]))
    command = " ".join(["python benchmarks/dropout_rng.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, jax {jax.__version__}; "
        f"one {'x'.join(map(str, SHAPE))} Bernoulli mask on one device, median of {args.rounds} interleaved rounds)",
        "",
        "| key implementation | ms per mask | vs threefry | same bits on tensor=4 + SP as on 1 device |",
        "|---|---:|---:|---|",
    ]
    for impl in IMPLS:
        t = float(np.median(times[impl]))
        lines.append(f"| {impl} | {1e3 * t:.1f} | {t / base:.2f}x | {'yes' if layout_invariant(impl) else 'no'} |")
    publish("dropout_rng", lines, args.write)


if __name__ == "__main__":
    main()
