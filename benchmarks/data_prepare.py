"""`meshlm data prepare` throughput against the tokenizer's own rate and Hugging Face `datasets`.

The corpus: the Python standard library's sources as JSONL, one file a line, repeated to at least
--mb MB; a 2,048-token BPE trained on it once. Then, in alternating rounds (the medians are
reported), each in its own process on the same cores:

    meshlm, 1 process x 1 tokenizer thread   `meshlm data prepare --processes 1 --workers 1`
    meshlm, 2 processes x 1 thread            `--processes 2 --workers 1`
    meshlm, 1 process x 2 threads             `--processes 1 --workers 2`
    tokenizers' encode_batch and encode_batch_fast (the same ids, no character offsets: what meshlm
              calls), 1 and 2 threads, on the documents already in memory (JSON parsed before the
              clock starts; nothing written); and encode_batch_fast in two independent processes
              of one thread, half the documents each (the most two processes can do on this host)
    datasets: load_dataset("json") + map(batched=True, num_proc=2, the same tokenizer called as
              meshlm calls it (encode_batch_fast), one thread per process) + save_to_disk

Rates are the JSONL file's bytes over wall time (meshlm: the whole CLI process, start-up included).

    python benchmarks/data_prepare.py [--mb 157 --rounds 2] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from _markdown import publish

ENCODE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
part, parts = int(sys.argv[4]), int(sys.argv[5])
docs = [json.loads(line)["text"] for k, line in enumerate(open(sys.argv[2], encoding="utf-8")) if k % parts == part]
encode = getattr(tok, sys.argv[3])
t = time.perf_counter()
n = 0
for i in range(0, len(docs), 256):
    n += sum(len(e.ids) for e in encode(docs[i : i + 256], add_special_tokens=False))
print(time.perf_counter() - t, n)
"""


def encode_time(tok: str, corpus: Path, method: str, threads: int, parts: int = 1) -> float:
    """Seconds the tokenizer alone takes (documents already in memory); with parts > 1, that many
    independent single-threaded processes each take every parts-th document, at the same time."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-c", ENCODE, tok, str(corpus), method]
    procs = [
        subprocess.Popen([*cmd, str(p), str(parts)], stdout=subprocess.PIPE, text=True, env=env) for p in range(parts)
    ]
    return max(float(p.communicate()[0].split()[0]) for p in procs)


DATASETS = """
import os, sys, time
t = time.perf_counter()
import datasets
from tokenizers import Tokenizer
datasets.disable_progress_bars()
tok_path, corpus, out, cache = sys.argv[1:5]

def encode(batch):
    global tok
    if "tok" not in globals():
        tok = Tokenizer.from_file(tok_path)
    return {"ids": [e.ids for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
ds = ds.map(encode, batched=True, num_proc=2, remove_columns=["text"])
ds.save_to_disk(out)
print(time.perf_counter() - t)
"""


def build_corpus(path: Path, mb: float) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            for p in files:
                line = json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) + "\n"
                f.write(line)
                size += len(line.encode())
                if size >= mb * 1e6:
                    break


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return time.perf_counter() - t, r.stdout + r.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=157)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "stdlib.jsonl"
        build_corpus(corpus, args.mb)
        mb = corpus.stat().st_size / 1e6
        prep = [py, "-m", "meshlm", "data", "prepare", "--input", str(corpus)]
        timed([*prep, "--out", str(tmp / "bpe"), "--vocab-size", "2048", "--max-mb", "16"])
        tok = str(tmp / "bpe" / "tokenizer.json")
        one = dict(os.environ, RAYON_NUM_THREADS="1")
        runs = {
            "meshlm, 1 process x 1 thread": lambda o: timed(
                [*prep, "--out", o, "--tokenizer", tok, "--processes", "1", "--workers", "1"]
            )[0],
            "meshlm, 2 processes x 1 thread": lambda o: timed(
                [*prep, "--out", o, "--tokenizer", tok, "--processes", "2", "--workers", "1"]
            )[0],
            "meshlm, 1 process x 2 threads": lambda o: timed(
                [*prep, "--out", o, "--tokenizer", tok, "--processes", "1", "--workers", "2"]
            )[0],
            "tokenizers encode_batch, 1 thread": lambda o: encode_time(tok, corpus, "encode_batch", 1),
            "tokenizers encode_batch, 2 threads": lambda o: encode_time(tok, corpus, "encode_batch", 2),
            "tokenizers encode_batch_fast, 1 thread": lambda o: encode_time(tok, corpus, "encode_batch_fast", 1),
            "tokenizers encode_batch_fast, 2 threads": lambda o: encode_time(tok, corpus, "encode_batch_fast", 2),
            "tokenizers encode_batch_fast, 2 processes x 1 thread, half each": lambda o: encode_time(
                tok, corpus, "encode_batch_fast", 1, parts=2
            ),
            "datasets map(num_proc=2, encode_batch_fast) + save_to_disk": lambda o: timed(
                [py, "-c", DATASETS, tok, str(corpus), o, str(tmp / "hf-cache")], dict(one, HF_DATASETS_OFFLINE="1")
            )[0],
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for k, run in runs.items():
                out = tmp / f"out-{r}"
                times[k].append(run(str(out)))
                subprocess.run(["rm", "-rf", str(out), str(tmp / "hf-cache")], check=True)
                print(f"round {r}: {k}: {times[k][-1]:.1f} s", file=sys.stderr)
    rate = {k: mb / statistics.median(v) for k, v in times.items()}
    best = max(v for k, v in rate.items() if k.startswith("meshlm"))
    cores = os.cpu_count()
    lines = [
        f"Command: `python benchmarks/data_prepare.py --mb {args.mb:g} --rounds {args.rounds}` "
        f"({time.strftime('%Y-%m-%d')}, {cores} cores): {mb:.0f} MB of JSONL (the standard library's sources, "
        "one file a line), a 2,048-token BPE; medians of alternating rounds, MB of JSONL per second of wall time.",
        "",
        "| run | seconds (median) | MB/s | meshlm's best / this |",
        "|---|---:|---:|---:|",
    ]
    for k, v in times.items():
        lines.append(f"| {k} | {statistics.median(v):.1f} | {rate[k]:.2f} | {best / rate[k]:.2f}x |")
    threads2 = rate["tokenizers encode_batch_fast, 2 threads"]
    ideal = rate["tokenizers encode_batch_fast, 2 processes x 1 thread, half each"]
    one = rate["tokenizers encode_batch_fast, 1 thread"]
    two = rate["meshlm, 2 processes x 1 thread"]
    batch = max(rate["tokenizers encode_batch, 1 thread"], rate["tokenizers encode_batch, 2 threads"])
    datasets = rate["datasets map(num_proc=2, encode_batch_fast) + save_to_disk"]
    lines += [
        "",
        f"- 2 processes / 1 process: **{two / rate['meshlm, 1 process x 1 thread']:.2f}x** (target >= 1.8x; the "
        f"tokenizer alone in two independent processes: {ideal / one:.2f}x its one-process rate)",
        f"- meshlm's best / the tokenizer alone on the same 2 cores, documents in memory: **{best / threads2:.2f}x** "
        f"`encode_batch_fast` with 2 threads, {best / ideal:.2f}x two independent processes of it, "
        f"**{best / batch:.2f}x** `encode_batch`'s best (target >= 0.9x)",
        f"- meshlm's best / datasets calling the tokenizer the same way: **{best / datasets:.2f}x** (target >= 1.3x)",
    ]
    publish("data_prepare", lines, args.write)


if __name__ == "__main__":
    main()
