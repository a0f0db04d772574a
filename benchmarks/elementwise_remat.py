"""Should norms and activation functions keep only their inputs (`RematPolicy.elementwise`, every
policy's choice) or everything JAX's autodiff would keep? Train-step time and stored activation
bytes of both, side by side in one process, on one CPU device.

The comparison flips `elementwise` on the `elementwise` policy's registry entry (nothing else
changes: no layer-level checkpoint, no attention recomputation), builds both steps, and times them
in interleaved rounds (medians). Activation bytes are the vjp residuals of the compiled forward
pass (`meshlm.insight.memory`). Config: issue 11's "small" shape (4 layers, d=256, 8 heads, vocab 8192,
seq 256, batch 8, fp32, no dropout).

    python benchmarks/elementwise_remat.py [--rounds 7] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from _markdown import publish
from meshlm.config import ModelConfig, OptimConfig, RunConfig, TrainConfig
from meshlm.insight.memory import measure_activations
from meshlm.parallel import remat
from meshlm.parallel.mesh import make_layout
from meshlm.step import make_train_step
from meshlm.train_state import init_state, setup


def config(family: str) -> RunConfig:
    model = ModelConfig(family=family, vocab_size=8192, d_model=256, n_layers=4, n_heads=8, max_seq_len=256)
    return RunConfig(model=model, optim=OptimConfig(warmup_steps=0), train=TrainConfig(global_batch=8, seq_len=256))


def build(cfg: RunConfig, keep_inputs_only: bool):
    """(jitted step, state, activation bytes) with the element-wise checkpoints on or off."""
    original = remat.POLICIES["elementwise"]
    remat.POLICIES["elementwise"] = dataclasses.replace(original, elementwise=keep_inputs_only)
    try:
        layout = make_layout(cfg.parallel, jax.devices()[:1])
        specs, tx, shardings = setup(cfg, layout)
        state = init_state(specs, layout, tx, 0)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1))
        batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
        abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        step = make_train_step(cfg, layout, tx, shardings).lower(state, abstract_batch).compile()
        return step, state, batch, measure_activations(cfg, layout).activation_bytes
    finally:
        remat.POLICIES["elementwise"] = original


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    command = " ".join(["python benchmarks/elementwise_remat.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, 1 device; "
        "4 layers, d=256, 8 heads, vocab 8192, seq 256, batch 8, fp32; "
        f"median of {args.rounds} interleaved rounds of {args.steps} steps)",
        "",
        "| family | norms / activations keep | step (ms) | tokens/s | activations (MiB) | vs inputs only |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for family in ("gpt", "llama"):
        cfg = config(family)
        variants = {"inputs only (every policy)": build(cfg, True), "what autodiff keeps": build(cfg, False)}
        times = {name: [] for name in variants}
        states = {name: v[1] for name, v in variants.items()}
        for name, (step, _, batch, _) in variants.items():  # warm up
            states[name], m = step(states[name], batch)
            jax.block_until_ready(m)
        for _ in range(args.rounds):
            for name, (step, _, batch, _) in variants.items():
                t = time.perf_counter()
                for _ in range(args.steps):
                    states[name], m = step(states[name], batch)
                jax.block_until_ready(m)
                times[name].append((time.perf_counter() - t) / args.steps)
        base = float(np.median(times["inputs only (every policy)"]))
        for name, (_, _, _, act) in variants.items():
            dt = float(np.median(times[name]))
            tokens = cfg.train.global_batch * cfg.train.seq_len
            row = f"| {family} | {name} | {1e3 * dt:.1f} | {tokens / dt:.0f} | {act / 2**20:.1f} |"
            lines.append(f"{row} {dt / base:.2f}x time |")
            print(lines[-1], flush=True)
    publish("elementwise_remat", lines, args.write)


if __name__ == "__main__":
    main()
