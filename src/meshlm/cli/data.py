"""`meshlm data prepare` and `meshlm data info`: token shards from text, and checking them."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshlm.config import ConfigError


def add_parsers(sub) -> dict:
    """The `data` subcommand and its own subcommands; returns its handler."""
    data = sub.add_parser("data", help="prepare a tokenized dataset (token shards + index) or inspect one")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare", help="text files, directories, JSONL (.gz, .zst), Parquet, datasets directories -> token shards"
    )
    prep.add_argument(
        "--input", nargs="+", required=True, metavar="PATH", help="files, directories, glob patterns ('web/*.parquet')"
    )
    prep.add_argument("--out", required=True, help="output directory")
    tok = prep.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="an existing tokenizer.json (Hugging Face tokenizers)")
    tok.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this many tokens")
    prep.add_argument(
        "--field", default="", help="JSONL field / Parquet column holding a document (default: text; chat: messages)"
    )
    prep.add_argument(
        "--format",
        choices=("text", "chat", "completion"),
        default="text",
        help="text: documents; chat: JSONL `messages` rendered with the tokenizer's chat template; completion: "
        "JSONL prompt + completion. chat and completion keep a loss mask and pack records into rows (docs/finetune.md)",
    )
    prep.add_argument(
        "--train-on", default="", help="chat: assistant (default), last or all; completion: completion (default) or all"
    )
    prep.add_argument("--seq-len", type=int, default=0, help="chat / completion: the row length (train.seq_len)")
    prep.add_argument("--chat-template", default="", help="a Jinja chat template file (default: the tokenizer's)")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="every round(1/f)-th document is held out")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    prep.add_argument("--processes", type=int, default=0, help="tokenizing processes (default: one per core)")
    prep.add_argument(
        "--workers", type=int, default=0, help="tokenizer threads per process (default: cores / processes)"
    )
    prep.add_argument(
        "--ray", default="", metavar="ADDRESS", help="tokenize on a Ray cluster ('auto', an address, or 'local')"
    )
    prep.add_argument(
        "--unit-mb", type=float, default=0, help="input per work unit (default: a 64th of the input, 1 to 64 MiB)"
    )
    prep.add_argument(
        "--on-error",
        choices=("strict", "skip"),
        default="strict",
        help="strict: the first bad file, line or record stops it; skip: skip and count them",
    )
    prep.add_argument("--max-mb", type=float, default=0, help="stop after this much text (0: all)")
    info = data_sub.add_parser("info", help="summarise and verify a prepared dataset")
    info.add_argument("path")
    info.add_argument("--vocab-size", type=int, help="also check every id fits this model vocabulary")
    return {"data": cmd_data}


def cmd_data(args: argparse.Namespace) -> int:
    if args.data_command == "info":
        return _info(args)
    if args.vocab_size is not None and args.vocab_size < 258:
        raise ConfigError("--vocab-size must be >= 258 (256 byte tokens + <|endoftext|> + at least one merge)")
    if args.shard_tokens < 1 or min(args.max_mb, args.unit_mb, args.processes, args.workers) < 0:
        raise ConfigError("--shard-tokens must be positive; --max-mb, --unit-mb, --processes and --workers >= 0")
    from meshlm.data import corpus, runner, units
    from meshlm.data.chat import DEFAULT_FIELD, make_format
    from meshlm.data.prepare import write_dataset

    if args.format == "text" and (args.train_on or args.seq_len or args.chat_template):
        raise ConfigError("--train-on, --seq-len and --chat-template apply to --format chat or completion")
    fmt = make_format(args.format, args.train_on, args.tokenizer, args.chat_template)
    field = args.field or DEFAULT_FIELD.get(args.format, "text")

    files = corpus.resolve_files(args.input)
    work = units.plan(files, int(args.unit_mb * 2**20))
    processes = args.processes or runner.auto_processes(work)
    threads = args.workers or max(1, (os.cpu_count() or 1) // processes)
    if processes == 1 and not args.ray:
        os.environ["RAYON_NUM_THREADS"] = str(threads)  # read by tokenizers when it starts its pool
    total = sum(u.nbytes for u in work)
    where = f"Ray ({args.ray})" if args.ray else f"{processes} process{'es' * (processes > 1)} x {threads} threads"
    print(
        f"preparing {len(files)} files, {total / 1e6:.1f} MB in {len(work)} units ({where}) -> {args.out}",
        file=sys.stderr,
    )
    write_dataset(
        work,
        Path(args.out),
        field=field,
        on_error=args.on_error,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        max_bytes=int(args.max_mb * 1e6),
        fmt=fmt,
        seq_len=args.seq_len,
        processes=processes,
        threads=threads,
        ray_address=args.ray,
        progress=sys.stderr.isatty(),
        log=lambda m: print(m, file=sys.stderr),
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    """`meshlm data info`: the index summarised, every shard verified."""
    from meshlm.data.prepare import load

    data = load(args.path)
    data.verify(args.vocab_size or data.meta["tokenizer_vocab_size"])
    m = data.meta
    print(
        f"{data.root}: format {m['format']}, {m['dtype']}, vocabulary {m['tokenizer_vocab_size']}, "
        f"end-of-text id {m['eot_id']}"
    )
    for split in ("train", "val"):
        shards = m["splits"][split]
        print(f"  {split}: {m[split + '_tokens']:,} tokens, {m['documents'][split]:,} documents, {len(shards)} shards")
    from meshlm.data.units import CAUSES

    packed = m.get("packed")
    if packed:
        print(
            f"  {packed['format']} records, trained on: {packed['train_on']}, packed into rows of "
            f"{packed['seq_len']} + 1 tokens"
        )
        for split in ("train", "val"):
            st = packed[split]
            total = m[split + "_tokens"] or 1
            print(
                f"  {split}: {st['records']:,} records, {st['trained']:,} trained tokens "
                f"({100 * st['trained'] / total:.1f}%), padding {100 * st['padding'] / total:.1f}%, "
                f"{st['truncated']:,} truncated to the row ({st['truncated_tokens']:,} tokens cut)"
            )
    for cause, n in sorted(m.get("skipped", {}).items()):
        print(f"  skipped: {n:,} {CAUSES[cause]}")
    for example in m.get("skipped_examples", []):
        print(f"    {example}")
    print("  verified: sizes, BLAKE2b digests, ids < vocabulary")
    return 0
