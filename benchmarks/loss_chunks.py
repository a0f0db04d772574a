"""The output layer and loss whole or in token chunks (`remat.loss_chunks`): train-step time, side by
side in one process (interleaved rounds, medians), and the compiled step's temporary bytes, on one
CPU device. Config: llama, 4 layers, d=256, 8 heads / 4 kv, vocab 32768 (the logits outweigh a
layer's activations, as at Llama-3's 128k vocabulary), seq 512, batch 8, fp32.

    python benchmarks/loss_chunks.py [--rounds 7] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from _markdown import publish
from _timing import median_step_seconds, prepared_step
from meshlm import accounting
from meshlm.config import ModelConfig, OptimConfig, RematConfig, RunConfig, TrainConfig
from meshlm.insight.step_peak import transient_terms
from meshlm.parallel.mesh import make_layout

CHUNKS = (1, 4, 16)


def config(chunks: int) -> RunConfig:
    model = ModelConfig(
        family="llama", vocab_size=32768, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512
    )
    train = TrainConfig(global_batch=8, seq_len=512)
    return RunConfig(model=model, optim=OptimConfig(warmup_steps=0), remat=RematConfig(loss_chunks=chunks), train=train)


def temp_bytes(cfg: RunConfig) -> int:
    """The compiled train step's temporary bytes (XLA's buffer assignment on this CPU)."""
    fn, state, batch = prepared_step(cfg, make_layout(cfg.parallel, jax.devices()[:1]))
    return fn.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    command = " ".join(["python benchmarks/loss_chunks.py", *sys.argv[1:]])
    layout = make_layout(config(1).parallel, jax.devices()[:1])
    seconds = median_step_seconds({n: (config(n), layout) for n in CHUNKS}, args.rounds)
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, 1 device; llama, 4 layers, "
        f"d=256, vocab 32768, seq 512, batch 8, fp32; median step of {args.rounds} interleaved rounds)",
        "",
        "| loss chunks | step (ms) | vs whole | compiled temporaries (MiB) "
        "| planner: stored outside the layers + the loss's transients (MiB) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in CHUNKS:
        cfg = config(n)
        planned = sum(accounting.activation_memory(cfg)["outside"].values()) + sum(transient_terms(cfg).values())
        row = f"| {n} | {1e3 * seconds[n]:.0f} | {seconds[n] / seconds[1]:.3f}x | {temp_bytes(cfg) / 2**20:.0f} |"
        lines.append(f"{row} {planned / 2**20:.0f} |")
        print(lines[-1], flush=True)
    publish("loss_chunks", lines, args.write)


if __name__ == "__main__":
    main()
