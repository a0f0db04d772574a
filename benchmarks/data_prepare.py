"""`meshlm data prepare` throughput: BPE training, then tokenization with 1..N threads.

The built-in corpus (the Python standard library's source), capped at --mb, through the real CLI:
once with --vocab-size (trains the tokenizer, then encodes), then with that tokenizer given and
--workers 1, 2, ... (encoding only), alternating rounds so the ratios are comparable.

    python benchmarks/data_prepare.py [--mb 16 --rounds 2] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _markdown import publish
from meshlm.data.corpus import builtin_corpus_files


def prepare(inputs: list[str], out: Path, *extra: str) -> float:
    cmd = [sys.executable, "-m", "meshlm", "data", "prepare", "--input", *inputs, "--out", str(out), *extra]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    workers = sorted({1, 2, cores})
    files = [str(f) for f in builtin_corpus_files()]
    with tempfile.TemporaryDirectory() as tmp:
        cap = ["--max-mb", str(args.mb)]
        train_s = prepare(files, Path(tmp) / "bpe", "--vocab-size", "8192", *cap)
        tok = str(Path(tmp) / "bpe" / "tokenizer.json")
        times: dict[int, list[float]] = {w: [] for w in workers}
        for _ in range(args.rounds):
            for w in workers:
                times[w].append(prepare(files, Path(tmp) / f"w{w}", "--tokenizer", tok, "--workers", str(w), *cap))
    one = statistics.median(times[1])
    lines = [
        f"Command: `python benchmarks/data_prepare.py --mb {args.mb:g} --rounds {args.rounds}` "
        f"({time.strftime('%Y-%m-%d')}, {cores} cores): {args.mb:g} MB of the built-in corpus, whole CLI "
        "process time (start-up, reading, hashing, writing shards included).",
        "",
        "| run | seconds | MB/s | vs 1 thread |",
        "|---|---:|---:|---:|",
        f"| train an 8192-token BPE + tokenize (all threads) | {train_s:.1f} | {args.mb / train_s:.1f} | |",
    ]
    for w in workers:
        s = statistics.median(times[w])
        row = f"| tokenize with a given tokenizer, --workers {w} | {s:.1f} | {args.mb / s:.1f} | {one / s:.2f}x |"
        lines.append(row)
    publish("data_prepare", lines, args.write)


if __name__ == "__main__":
    main()
