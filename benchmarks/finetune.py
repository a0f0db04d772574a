"""LoRA against full fine-tuning: tokens/s and memory, side by side in one run.

Two llama models, each trained by the real CLI (`meshlm train`, one process per run, one after
another) on the built-in corpus, once with every weight trained (AdamW) and once with LoRA
(`model.lora_rank=16`, adapters on all seven projections, the base frozen):

    llama-tiny   the `llama-tiny` recipe
    ~100M        d_model 768, 12 layers, 12 heads, vocabulary 8192

Reported: the median tokens/s after the first logged interval (compilation), the peak anonymous
memory of the process (RssAnon, sampled every 10 ms: on CPU the devices' memory is the process's),
and the startup report's predicted per-device bytes of gradients and optimizer state.

    python benchmarks/finetune.py [--steps 12] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _markdown import publish
from convert_memory import peak_memory

MODELS = {
    "llama-tiny": ["--recipe", "llama-tiny"],
    "~100M llama": [
        "--recipe",
        "llama-tiny",
        "--set",
        "model.d_model=768",
        "--set",
        "model.n_layers=12",
        "--set",
        "model.n_heads=12",
        "--set",
        "model.n_kv_heads=12",
        "--set",
        "model.vocab_size=8192",
    ],
}
LORA = ["--set", "model.lora_rank=16", "--set", "model.lora_alpha=32"]
LORA += ["--set", "model.lora_targets=wq,wk,wv,wo,w_gate,w_up,w_down"]


def run(args: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "meshlm", "train", "--run-dir", tmp, "--steps", str(steps), *args]
        cmd += ["--set", "train.eval_every=0", "--set", "train.log_every=1", "--set", "checkpoint.every=0"]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        seconds, anon, _ = peak_memory(cmd, env)
        records = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        report = json.loads((Path(tmp) / "run.json").read_text())["startup_report"]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    predicted = report["predicted_device_bytes"]
    return {
        "tokens_per_s": statistics.median(rates),
        "anon": anon,
        "grads": predicted["gradients (fp32)"],
        "optimizer": predicted["optimizer state"],
        "params": report["param_count"],
        "trainable": report["trainable_param_count"],
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, model in MODELS.items():
        full = run(model, args.steps)
        lora = run([*model, *LORA], args.steps)
        rows.append((name, full, lora))
        print(f"{name}: full {full['tokens_per_s']:.0f} tok/s, LoRA {lora['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    lines = [
        f"Command: `python benchmarks/finetune.py --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} cores, the recipe's data=2 mesh): full fine-tuning (AdamW on every weight) against LoRA "
        "r=16 on the seven projections, the built-in corpus, batch 16 x 128; tokens/s the median after the first "
        "interval; gradients + optimizer state per device from the startup report.",
        "",
        "| model | run | trainable / all parameters | tokens/s | LoRA / full | gradients + optimizer (predicted) "
        "| peak RssAnon |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, full, lora in rows:
        for label, r in (("full", full), ("LoRA r=16", lora)):
            lines.append(
                f"| {name} | {label} | {r['trainable'] / 1e6:.2f}M / {r['params'] / 1e6:.2f}M | "
                f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / full['tokens_per_s']:.2f}x | "
                f"{mib(r['grads'] + r['optimizer'])} | {mib(r['anon'])} |"
            )
    publish("finetune", lines, args.write)


if __name__ == "__main__":
    main()
