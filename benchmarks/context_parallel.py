"""Context parallelism on CPU (simulated devices): how long a sequence fits, and what it costs.

1. Memory: for a llama model of d=512, 8 layers, 8 heads (4 kv), bf16, one sequence per step, the
   activation bytes per device the compiled program keeps for backward (`measure_activations`:
   compiled on 8 simulated devices, never run) for explicit and blockwise attention on one device,
   ring attention over context = 2, 4, 8 and all_to_all (Ulysses) over 4; and the longest s of those
   that fits a per-device activation budget.
2. Traffic: what each strategy receives per device per layer (forward + backward, the same model
   at s=32768; `accounting.context_comm_bytes`, whose collectives tests/test_context.py checks in
   the compiled program).
3. Speed: train-step tokens/s of a small llama (d=256, 4 layers, fp32, 8192 tokens per step) on
   2 simulated devices (this machine has 2 cores): explicit and blockwise attention with the batch
   split (data=2) against the sequence split (context=2: ring, all_gather and all_to_all,
   load-balanced), alternating rounds, medians.

    python benchmarks/context_parallel.py [--budget-gib 1] [--rounds 3] [--write]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax

from _markdown import write_section
from _timing import median_step_seconds
from meshlm import accounting
from meshlm.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.insight.memory import measure_activations
from meshlm.parallel.mesh import make_layout
from meshlm.validation import validate

LENGTHS = (8192, 16384, 32768, 65536, 131072)
MEMORY_MODES = {  # name: (attention, context, strategy)
    "explicit": ("explicit", 1, "ring"),
    "blockwise": ("blockwise", 1, "ring"),
    "ring c=2": ("blockwise", 2, "ring"),
    "ring c=4": ("blockwise", 4, "ring"),
    "ring c=8": ("blockwise", 8, "ring"),
    "all_to_all c=4": ("blockwise", 4, "all_to_all"),
}
STRATEGIES = ("ring", "all_gather", "all_to_all")
SPEED_MODES = {  # name: (attention, mesh, strategy)
    "explicit data=2": ("explicit", dict(data=2), "ring"),
    "blockwise data=2": ("blockwise", dict(data=2), "ring"),
    "ring context=2": ("blockwise", dict(context=2), "ring"),
    "all_gather context=2": ("blockwise", dict(context=2), "all_gather"),
    "all_to_all context=2": ("blockwise", dict(context=2), "all_to_all"),
}


def config(attention: str, s: int, d: int, layers: int, dtype: str, batch: int, mesh: dict, strategy: str) -> RunConfig:
    model = ModelConfig(
        family="llama",
        vocab_size=4096,
        d_model=d,
        n_layers=layers,
        n_heads=8,
        n_kv_heads=4,
        dtype=dtype,
        attention=attention,
        attention_block=128,
        max_seq_len=s,
    )
    parallel = ParallelConfig(**mesh, context_strategy=strategy)
    train = TrainConfig(global_batch=batch, seq_len=s, steps=1000)
    return validate(RunConfig(model=model, parallel=parallel, optim=OptimConfig(warmup_steps=0), train=train))


def memory_rows(budget: float) -> list[str]:
    names = list(MEMORY_MODES)
    lines = ["| s | " + " | ".join(f"{n} GiB" for n in names) + " |", "|---:|" + "---:|" * len(names)]
    fits = dict.fromkeys(names, 0)
    for s in LENGTHS:
        row = []
        for name in names:
            attention, c, strategy = MEMORY_MODES[name]
            cfg = config(attention, s, 512, 8, "bfloat16", 1, dict(context=c), strategy)
            got = measure_activations(cfg, make_layout(cfg.parallel, jax.devices()[:c]), batch=1).activation_bytes
            fits[name] = s if got <= budget else fits[name]
            row.append(f"{got / 2**30:.3f}")
        lines.append(f"| {s:,} | " + " | ".join(row) + " |")
    lines += ["", f"Longest s (of those) whose activations fit {budget / 2**30:g} GiB per device: "]
    lines[-1] += ", ".join(f"{n} {'-' if not fits[n] else f'{fits[n]:,}'}" for n in names) + "."
    return lines


def traffic_line(s: int = 32768) -> str:
    """What each strategy receives per device per layer, forward + backward, at c = 2, 4, 8."""
    contexts, said = (2, 4, 8), []
    for strategy in STRATEGIES:
        row = []
        for c in contexts:
            try:
                cfg = config("blockwise", s, 512, 8, "bfloat16", 1, dict(context=c), strategy)
            except ConfigError:  # Ulysses splits the 4 KV heads at most 4 ways
                row.append("refused")
                continue
            row.append(f"{sum(accounting.context_comm_bytes(cfg).values()) / cfg.model.n_layers / 2**20:,.0f}")
        said.append(f"{strategy} {' / '.join(row)}")
    return (
        f"Received per device per layer, forward + backward, MiB at c = {' / '.join(map(str, contexts))} (the same "
        f"model, s={s:,}; `accounting.context_comm_bytes`): " + ", ".join(said) + "."
    )


def speed_rows(rounds: int, tokens: int = 8192) -> list[str]:
    lengths = (512, 1024, 2048, 4096)
    variants = {}
    for s in lengths:
        for name, (attention, mesh, strategy) in SPEED_MODES.items():
            cfg = config(attention, s, 256, 4, "float32", tokens // s, mesh, strategy)
            variants[(s, name)] = (cfg, make_layout(cfg.parallel, jax.devices()[:2]))
    seconds = median_step_seconds(variants, rounds)  # random tokens: storage order does not matter
    names = list(SPEED_MODES)
    lines = ["| s | batch | " + " | ".join(f"{n} tok/s" for n in names) + " | ring / blockwise |"]
    lines.append("|---:|---:|" + "---:|" * (len(names) + 1))
    for s in lengths:
        rate = {n: tokens / seconds[(s, n)] for n in names}
        lines.append(
            f"| {s:,} | {tokens // s} | "
            + " | ".join(f"{rate[n]:,.0f}" for n in names)
            + f" | {rate['ring context=2'] / rate['blockwise data=2']:.2f}x |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    head = [
        "Command: `python benchmarks/context_parallel.py "
        f"--budget-gib {args.budget_gib:g} --rounds {args.rounds} --write` ({time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} CPU cores, jax {jax.__version__}).",
        "",
        "Stored activations per device (llama, d=512, 8 layers, 8 heads / 4 kv, bf16, one sequence; measured "
        "from the compiled program on simulated devices; ring and all_gather store the same, all_to_all the "
        "kernel's output once more):",
        "",
    ]
    mem = memory_rows(args.budget_gib * 2**30)
    speed = speed_rows(args.rounds)
    text = "\n".join(
        [
            *head,
            *mem,
            "",
            traffic_line(),
            "",
            "Train-step speed on 2 simulated devices (llama, d=256, 4 layers, fp32, 8192 tokens per step, block "
            "128, median of rounds; the batch split over data=2 vs the sequence split over context=2):",
            "",
            *speed,
        ]
    )
    print(text)
    if args.write:
        write_section("context-parallel", text)


if __name__ == "__main__":
    main()
