"""P2 Table 4 on this machine: one transformer layer's forward, backward and recompute time for
baseline / sequence parallel / full recompute / selective / selective + SP, as ratios to the baseline.

All five variants run in one process on the same simulated tensor-parallel mesh, interleaved round
by round (so machine noise hits them alike); each figure is the median over rounds. Backward time
is (forward+backward) - forward, as in P2, and includes any recomputation.

    python benchmarks/layer_recompute.py [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _markdown import publish

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig, ParallelConfig
from meshlm.model.params import init_params, param_specs
from meshlm.model.transformer import RESIDUAL, gpt_block
from meshlm.parallel import remat
from meshlm.parallel.mesh import make_layout
from meshlm.train_state import param_shardings

VARIANTS = [  # (name, sequence parallel, remat policy)
    ("baseline (TP, no recompute)", False, "elementwise"),
    ("sequence parallelism", True, "elementwise"),
    ("full recompute", False, "full"),
    ("selective recompute", False, "selective"),
    ("selective + sequence parallelism", True, "selective"),
]


def build(model: ModelConfig, sp: bool, policy: str, batch: int, seq: int):
    layout = make_layout(ParallelConfig(tensor=4, sequence_parallel=sp))
    specs = param_specs(model)
    params = jax.jit(lambda k: init_params(specs, k), out_shardings=param_shardings(specs, layout))(jax.random.key(0))
    layer = jax.tree.map(lambda w: w[0].astype(jnp.bfloat16), params["layers"])
    key = jax.random.key(1)
    block = remat.wrap_layer(lambda x, p: gpt_block(x, p, key, model, layout, policy), policy)
    x = jax.device_put(
        jax.random.normal(jax.random.key(2), (batch, seq, model.d_model), jnp.bfloat16), layout.sharding(RESIDUAL)
    )
    fwd = jax.jit(block)
    fwd_bwd = jax.jit(jax.grad(lambda x, p: jnp.sum(block(x, p).astype(jnp.float32) ** 2), argnums=(0, 1)))
    return fwd, fwd_bwd, x, layer


def timed(fn, *args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    model = ModelConfig(
        vocab_size=512,
        d_model=args.d_model,
        n_layers=1,
        n_heads=args.heads,
        max_seq_len=args.seq,
        dropout=args.dropout,
        dtype="bfloat16",
    )
    built = {name: build(model, sp, pol, args.batch, args.seq) for name, sp, pol in VARIANTS}
    for fwd, fwd_bwd, x, p in built.values():  # compile and warm up
        timed(fwd, x, p), timed(fwd_bwd, x, p)
    times = {name: ([], []) for name in built}
    for _ in range(args.rounds):
        for name, (fwd, fwd_bwd, x, p) in built.items():
            times[name][0].append(timed(fwd, x, p))
            times[name][1].append(timed(fwd_bwd, x, p))
    rows = []
    for name in built:
        f, fb = statistics.median(times[name][0]), statistics.median(times[name][1])
        rows.append((name, f, fb - f, fb))
    base = rows[0][3]
    s, b, h, a = args.seq, args.batch, args.d_model, args.heads
    cmd = "python benchmarks/layer_recompute.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, 4 simulated devices, "
        f"tensor=4; one gpt layer s={s} b={b} h={h} a={a}, bf16, dropout {args.dropout}; median of {args.rounds} "
        "interleaved rounds)",
        "",
        "| experiment | forward (ms) | backward (ms) | combined (ms) | overhead vs baseline | P2 Table 4 (A100) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    paper = ["-", "-3%", "39%", "7%", "4%"]
    for (name, f, bw, fb), p2 in zip(rows, paper, strict=True):
        overhead = "-" if fb == base else f"{100 * (fb / base - 1):+.0f}%"
        lines.append(f"| {name} | {1e3 * f:.1f} | {1e3 * bw:.1f} | {1e3 * fb:.1f} | {overhead} | {p2} |")
    publish(f"layer_recompute_dropout{args.dropout:g}", lines, args.write)


if __name__ == "__main__":
    main()
