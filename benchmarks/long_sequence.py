"""Long sequences on CPU: explicit attention (stores s x s scores, or their causal blocks in query
chunks) vs blockwise (stores O(s)).

1. Memory: for a llama model of d=512, 8 layers, 8 heads (4 kv), bf16, batch 1, the activation
   bytes the compiled program keeps for backward (`meshlm.insight.memory.measure_activations`: compiled,
   never run) at s = 1k .. 64k, and the longest s that fits a per-device activation budget.
2. Speed: train-step tokens/s of a small llama (d=256, 4 layers, fp32) at s = 256 .. 2048 with
   the same tokens per step, explicit vs blockwise (block 128 and 256), alternating rounds, medians.

    python benchmarks/long_sequence.py [--budget-gib 4] [--rounds 3] [--write]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from _markdown import write_section
from _timing import median_step_seconds
from meshlm.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.insight.memory import measure_activations
from meshlm.parallel.mesh import make_layout
from meshlm.validation import validate

MODES = {"explicit": ("explicit", 128), "blockwise-128": ("blockwise", 128), "blockwise-256": ("blockwise", 256)}


def config(mode: str, s: int, d: int, layers: int, heads: int, dtype: str, batch: int) -> RunConfig:
    attention, block = MODES[mode]
    model = ModelConfig(
        family="llama",
        vocab_size=4096,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads // 2,
        dtype=dtype,
        attention=attention,
        attention_block=block,
        max_seq_len=s,
    )
    train = TrainConfig(global_batch=batch, seq_len=s, steps=1000)
    return validate(RunConfig(model=model, parallel=ParallelConfig(), optim=OptimConfig(warmup_steps=0), train=train))


def memory_rows(budget: float) -> list[str]:
    layout = make_layout(ParallelConfig())
    lines = ["| s | explicit GiB | blockwise GiB (block 128) | explicit / blockwise |", "|---:|---:|---:|---:|"]
    fits = {"explicit": 0, "blockwise-128": 0}
    for s in (1024, 2048, 4096, 8192, 16384, 32768, 65536):
        got = {}
        for mode in fits:
            got[mode] = measure_activations(config(mode, s, 512, 8, 8, "bfloat16", 1), layout, batch=1).activation_bytes
            if got[mode] <= budget:
                fits[mode] = s
        lines.append(
            f"| {s:,} | {got['explicit'] / 2**30:.3f} | {got['blockwise-128'] / 2**30:.3f} | "
            f"{got['explicit'] / got['blockwise-128']:.1f}x |"
        )
    lines.append("")
    lines.append(
        f"Longest s (of those) whose activations fit {budget / 2**30:g} GiB per device: explicit "
        f"{fits['explicit']:,}, blockwise {fits['blockwise-128']:,}."
    )
    return lines


def speed_rows(rounds: int, tokens: int = 4096) -> list[str]:
    variants = {}
    for s in (256, 512, 1024, 2048):
        for mode in MODES:
            cfg = config(mode, s, 256, 4, 8, "float32", tokens // s)
            variants[(s, mode)] = (cfg, make_layout(cfg.parallel))
    seconds = median_step_seconds(variants, rounds)
    lines = ["| s | batch | " + " | ".join(f"{m} tok/s" for m in MODES) + " | blockwise-128 / explicit |"]
    lines.append("|---:|---:|" + "---:|" * (len(MODES) + 1))
    for s in (256, 512, 1024, 2048):
        rate = {m: tokens / seconds[(s, m)] for m in MODES}
        lines.append(
            f"| {s:,} | {tokens // s} | "
            + " | ".join(f"{rate[m]:,.0f}" for m in MODES)
            + f" | {rate['blockwise-128'] / rate['explicit']:.2f}x |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    head = [
        "Command: `python benchmarks/long_sequence.py "
        f"--budget-gib {args.budget_gib:g} --rounds {args.rounds} --write` ({time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} CPU cores, jax {jax.__version__}).",
        "",
        "Stored activations (llama, d=512, 8 layers, 8 heads / 4 kv, bf16, batch 1; measured from the compiled "
        "program):",
        "",
    ]
    mem = memory_rows(args.budget_gib * 2**30)
    speed = speed_rows(args.rounds)
    text = "\n".join(
        [
            *head,
            *mem,
            "",
            "Train-step speed (llama, d=256, 4 layers, fp32, 4096 tokens per step, median of rounds):",
            "",
            *speed,
        ]
    )
    print(text)
    if args.write:
        write_section("long-sequence", text)


if __name__ == "__main__":
    main()
