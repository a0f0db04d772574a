"""Peak memory of checkpoint conversion: import, export, and a restore onto another mesh.

A ~1B-parameter float32 Llama is written as a Hugging Face directory in several safetensors shards
(random weights, made tensor by tensor with NumPy). Then, each in its own process, sampled every
10 ms from /proc/PID/status (RssAnon: anonymous memory, the copies a program makes; RssFile:
file-backed pages, e.g. the memory-mapped shards, which the kernel can drop):

    import     meshlm convert --from-hf DIR --to RUN
    export     meshlm convert --from RUN --to-hf OUT            (float32)
    restore    meshlm convert --from RUN --to-hf OUT2 --mesh tensor=2 --devices 2
               (the checkpoint restored onto a 2-device tensor-parallel mesh, then exported)
    generate   meshlm generate --run-dir hf:DIR (the safetensors read straight into the model)

Each peak is reported as a multiple of the checkpoint's bytes (target: anonymous <= 1.5x).

    python benchmarks/convert_memory.py [--layers 18] [--before OLD_CHECKOUT/src] [--write]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from _markdown import publish
from meshlm.config import ModelConfig
from meshlm.interop import hf, hf_tables
from meshlm.interop import safetensors_io as st


def write_model(out: Path, cfg: ModelConfig, shard_bytes: int) -> int:
    """A Hugging Face Llama directory of random float32 weights; returns the weights' bytes."""
    import json

    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tensors = hf._hf_tensors(cfg)
    files = hf._shard_files(tensors, 4, shard_bytes)
    weight_map, total = {}, 0
    for k, group in enumerate(files):
        name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        specs = [(n, shape, np.dtype(np.float32)) for n, shape, _ in group]
        arrays = ((rng.standard_normal(shape, dtype=np.float32) * 0.02) for _, shape, _ in group)
        st.write(out / name, specs, arrays, {"format": "pt"})
        weight_map |= {n: name for n, _, _ in group}
        total += sum(math.prod(shape) * 4 for _, shape, _ in group)
    from meshlm.data.tokenizer import train_bpe

    train_bpe(["a small tokenizer for the prompt"] * 4, 300).save(str(out / "tokenizer.json"))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(hf_tables.hf_config(cfg, None, None, "float32", 2048)))
    return total


def peak_memory(cmd: list[str], env: dict | None = None) -> tuple[float, int, int]:
    """(seconds, peak RssAnon, peak RssFile) of a command, sampled every 10 ms."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    peaks = {"RssAnon": 0, "RssFile": 0}

    def sample():
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        key = line.split(":")[0]
                        if key in peaks:
                            peaks[key] = max(peaks[key], int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                pass
            time.sleep(0.01)

    th = threading.Thread(target=sample)
    th.start()
    _, err = proc.communicate()
    th.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    return time.perf_counter() - t, peaks["RssAnon"], peaks["RssFile"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=18)  # 0.98B parameters
    ap.add_argument("--before", help="also run each conversion with this src/ (an older checkout) on PYTHONPATH")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    cfg = ModelConfig(
        family="llama", vocab_size=32000, d_model=2048, n_layers=args.layers, n_heads=16, n_kv_heads=8, d_ff=5632
    )
    meshlm = [sys.executable, "-m", "meshlm", "convert"]
    generate = [sys.executable, "-m", "meshlm", "generate", "--temperature", "0"]
    versions = {"now": None} | ({"before": args.before} if args.before else {})
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        size = write_model(tmp / "hf", cfg, 1 << 30)
        shards = len(list((tmp / "hf").glob("*.safetensors")))
        for version, src in versions.items():
            run, out = tmp / f"run-{version}", tmp / f"out-{version}"
            tp = ["--mesh", "tensor=2", "--devices", "2"]
            runs = {
                "import (convert --from-hf)": [*meshlm, "--from-hf", str(tmp / "hf"), "--to", str(run)],
                "export (convert --to-hf)": [*meshlm, "--from", str(run), "--to-hf", str(out)],
                "restore onto tensor=2, then export": [*meshlm, "--from", str(run), "--to-hf", f"{out}-tp", *tp],
                "generate hf:DIR (read into the model, 2 tokens)": [
                    *[*generate, "--run-dir", f"hf:{tmp / 'hf'}", "--prompt", "a small", "--max-new-tokens", "2"]
                ],
            }
            env = dict(os.environ, PYTHONPATH=src) if src else None
            for name, cmd in runs.items():
                seconds, anon, file = peak_memory(cmd, env)
                rows.append((version, name, seconds, anon, file))
                print(
                    f"{version}: {name}: {seconds:.1f} s, anon {anon / size:.2f}x, file {file / size:.2f}x",
                    file=sys.stderr,
                )
    n = sum(math.prod(shape) for _, shape, _ in hf._hf_tensors(cfg))
    before, flag = "", ""
    if args.before:
        commit = subprocess.run(
            ["git", "-C", args.before, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        before = f", and (before) with the code of commit {commit.stdout.strip() or '?'} on PYTHONPATH"
        flag = " --before OLD_CHECKOUT/src"
    lines = [
        f"Command: `python benchmarks/convert_memory.py --layers {args.layers}{flag}` "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores): a float32 Llama of {n / 1e9:.2f}B parameters "
        f"({size / 2**30:.2f} GiB) in {shards} safetensors shards{before}; peaks sampled every 10 ms from "
        "/proc/PID/status, as multiples of the checkpoint's bytes (target: anonymous <= 1.5x).",
        "",
        "| conversion | code | seconds | peak anonymous (RssAnon) | peak file-backed (RssFile) |",
        "|---|---|---:|---:|---:|",
    ]
    for version, name, seconds, anon, file in sorted(rows, key=lambda r: list(runs).index(r[1])):
        lines.append(
            f"| {name} | {version} | {seconds:.1f} | {anon / 2**30:.2f} GiB = **{anon / size:.2f}x** | "
            f"{file / 2**30:.2f} GiB = {file / size:.2f}x |"
        )
    over = [
        f"{name} ({anon / size:.2f}x)" for version, name, _, anon, _ in rows if version == "now" and anon > 1.5 * size
    ]
    lines += [
        "",
        f"- Target (anonymous peak <= 1.5x): {'missed by ' + ', '.join(over) if over else 'met by every conversion'}.",
    ]
    publish("convert_memory", lines, args.write)
    if over:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
