"""Documents -> tokenizer -> token shards on disk, with an index; deterministic and atomic.

A prepared dataset is a directory:
    tokenizer.json        the tokenizer used (trained here, or the one given)
    train-00000.bin ...   token ids (uint16 when the vocabulary fits, else uint32), documents
    val-00000.bin ...     each followed by <|endoftext|>; memory-mapped by the loader
    index.json            format, dtype, vocabulary, end-of-text id, tokenizer fingerprint, and per
                          shard its token count and BLAKE2b digest; document counts; source hash;
                          bad input skipped (`--on-error skip`), counted by cause

Every k-th document (k = round(1 / val_fraction)) goes to the validation split. The same inputs
and options give the same bytes, whether one process or many (or a Ray cluster) tokenize them:
the corpus is cut into work units (`data.units`), encoded anywhere (`data.runner`), and merged here
in unit order with global document numbers. The directory is written under a temporary name and
renamed into place, so a killed preparation never leaves a half-written dataset behind; the
finished units are kept beside it until then, so starting it again resumes where it stopped.

`meshlm data prepare` writes one to a chosen directory; `meshlm train` on raw text prepares one
into a cache directory named by a hash of everything that determines its bytes, so a second run
starts immediately and a change of input can never silently reuse stale tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from meshlm.config import ConfigError, DataConfig, cache_home
from meshlm.data import corpus
from meshlm.data import runner as R
from meshlm.data import tokenizer as toks
from meshlm.data import units as U
from meshlm.data.chat import Format
from meshlm.data.shards import SPLITS, Merge, PackedMerge, ShardWriter, held_out_tail

FORMAT_VERSION = 4  # 4: chat / completion records packed into rows, with per-token flags (3: text only)
READABLE = (3, 4)  # format 3 datasets (text) still load: format 4 only adds packed ones
INDEX = "index.json"


class DataError(ConfigError):
    """A prepared dataset is unusable (corrupt or truncated shard, vocabulary mismatch, ...)."""


@dataclass(frozen=True)
class PreparedData:
    """A prepared dataset directory and its index."""

    root: Path
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def tokenizer_path(self) -> Path:
        return self.root / "tokenizer.json"

    def shards(self, split: str) -> list[np.ndarray]:
        """Memory-mapped token arrays of `split`, one per shard, each checked for its size."""
        return self._mapped(split, "file", self.dtype, "data")

    @property
    def packed(self) -> dict | None:
        """Chat / completion records packed into rows (format, rule, seq_len, counts), or None."""
        return self.meta.get("packed")

    def flags(self, split: str) -> list[np.ndarray]:
        """Memory-mapped per-token flags (units.FLAG_*) of a packed dataset's `split`, one per shard."""
        return self._mapped(split, "flags", np.dtype(np.uint8), "flags")

    def _mapped(self, split: str, key: str, dtype: np.dtype, what: str) -> list[np.ndarray]:
        out = []
        for shard in self.meta["splits"][split]:
            path = self.root / shard[key]
            expected = shard["tokens"] * dtype.itemsize
            size = path.stat().st_size if path.exists() else -1
            if size != expected:
                raise DataError(
                    f"{what} shard {path} is {'missing' if size < 0 else f'truncated or corrupt: {size} bytes'}, "
                    f"expected {expected}; re-run `meshlm data prepare` (or delete {self.root} if it is a cache)"
                )
            if shard["tokens"]:
                out.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["tokens"],)))
        return out

    def tokens(self, split: str) -> np.ndarray:
        """All tokens of `split` as one array (concatenated in memory when there are several shards)."""
        parts = self.shards(split)
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros((0,), self.dtype)

    def verify(self, vocab_size: int, digests: bool = True) -> None:
        """Check the vocabulary against the model's, every shard's size, and (`digests`) every
        shard's digest and largest id, reading all tokens once; raise DataError if anything is off."""
        if self.meta["tokenizer_vocab_size"] > vocab_size:
            raise DataError(
                f"dataset {self.root} uses a tokenizer of {self.meta['tokenizer_vocab_size']} tokens but "
                f"model.vocab_size={vocab_size}; raise model.vocab_size or prepare the data with a smaller tokenizer"
            )
        for split in SPLITS:
            self.shards(split)  # sizes
            if self.packed:
                self.flags(split)
        for split in SPLITS if digests else ():
            shards = [s for s in self.meta["splits"][split] if s["tokens"]]
            arrays = [(self.shards(split), "file", "blake2b", vocab_size - 1)]
            if self.packed:
                arrays.append((self.flags(split), "flags", "flags_blake2b", 3))
            for arrs, key, digest_key, largest in arrays:
                for shard, arr in zip(shards, arrs, strict=True):
                    digest, top = _digest_and_max(arr)
                    if digest != shard[digest_key]:
                        raise DataError(
                            f"data shard {self.root / shard[key]} is corrupt (its BLAKE2b digest does not match "
                            f"{INDEX}); re-run `meshlm data prepare` (or delete {self.root} if it is a cache)"
                        )
                    if top > largest:
                        what = f"token id {top} >= {vocab_size}" if key == "file" else f"flag value {top} > 3"
                        raise DataError(f"data shard {self.root / shard[key]} has {what}")


def _digest_and_max(arr: np.ndarray) -> tuple[str, int]:
    """BLAKE2b (16 bytes) and largest value of a memory-mapped shard, read in chunks of 16M values."""
    h = hashlib.blake2b(digest_size=16)
    top = 0
    for i in range(0, len(arr), 1 << 24):
        chunk = np.asarray(arr[i : i + (1 << 24)])
        h.update(chunk.tobytes())
        top = max(top, int(chunk.max()))
    return h.hexdigest(), top


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of a token unigram distribution given its counts: the loss of the best
    context-free model, the yardstick a trained model's loss is compared with."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def load(root: str | Path) -> PreparedData:
    root = Path(root).expanduser()
    try:
        meta = json.loads((root / INDEX).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{root / INDEX} is missing or unreadable ({e}); re-run `meshlm data prepare`") from None
    if meta.get("format") not in READABLE:
        readable = " or ".join(map(str, READABLE))
        raise DataError(f"{root} has dataset format {meta.get('format')}, expected {readable}; prepare it again")
    return PreparedData(root, meta)


def is_prepared(path: str | Path) -> bool:
    return (Path(path).expanduser() / INDEX).is_file()


def _same_preparation(out: Path, meta: dict) -> bool:
    """`out` holds a finished preparation of the same sources (a cache entry, whose key fingerprints
    them) with the same tokenizer and split."""
    if not meta["source_fingerprint"] or not is_prepared(out):
        return False
    try:
        theirs = json.loads((out / INDEX).read_text())
    except (OSError, ValueError):
        return False
    keys = ("format", "source_fingerprint", "tokenizer_fingerprint", "val_fraction", "train_tokens", "val_tokens")
    return all(theirs.get(k) == meta[k] for k in keys)


def _split(docs: Iterable[str], period: int) -> Iterator[tuple[str, str]]:
    """(split, text): every `period`-th document to validation. With fewer than `period`
    documents, the tail of the last one is held out instead, so both splits exist."""
    last = None
    n = 0
    for doc in docs:
        if last is not None:
            yield last
        n += 1
        last = ("val" if n % period == 0 else "train", doc)
    if last is None:
        return
    if n < period:
        yield from held_out_tail(last[1], period)
    else:
        yield last


def write_dataset(
    units: list[U.Unit],
    out: Path,
    *,
    field: str = "text",
    on_error: str = "strict",
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    val_fraction: float = 0.05,
    shard_tokens: int = 1 << 28,
    source_fingerprint: str = "",
    max_bytes: int = 0,
    fmt: Format | None = None,
    seq_len: int = 0,
    processes: int = 1,
    threads: int = 0,
    ray_address: str = "",
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> PreparedData:
    """Tokenize the documents of `units` (`data.units`) into a prepared dataset at `out`.

    Units are encoded in this process (processes <= 1), in `processes` spawned processes with
    `threads` tokenizer threads each (0: cores / processes), or as Ray tasks (`ray_address`); the
    bytes are the same. Each finished unit is kept in `.<out>.work/` beside `out` until the dataset
    is published, so a preparation killed, or stopped by bad input, and started again with the same
    inputs resumes where it stopped. `on_error="skip"` skips bad files, lines and records (counted
    in the index) instead of failing. Chat and completion records (`fmt`, `chat.make_format`) are
    packed into rows of `seq_len` + 1 tokens with their flags (`shards.PackedMerge`)."""
    fmt = fmt or Format()
    if fmt.packed and seq_len < 1:
        raise ConfigError(f"--format {fmt.kind} packs records into rows: give --seq-len (the run's train.seq_len)")
    if fmt.packed and max_bytes:
        raise ConfigError(f"--max-mb does not apply to --format {fmt.kind} (records are kept whole or not at all)")
    if fmt.packed and not tokenizer:
        raise ConfigError(f"--format {fmt.kind} needs --tokenizer (the model's own, with its chat template)")
    if not 0.0 < val_fraction < 0.5:
        raise ConfigError("val_fraction must be in (0, 0.5)")
    if on_error not in ("strict", "skip"):
        raise ConfigError(f"on_error must be 'strict' or 'skip', not {on_error!r}")
    period = max(2, round(1 / val_fraction))
    job = _Job(out, period, val_fraction, field, on_error == "strict", max_bytes, fmt, seq_len)
    if out.exists() and not is_prepared(out) and any(out.iterdir()):  # before hours of work, not after
        raise ConfigError(f"{out} exists and is not a meshlm dataset; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    work_root = out.parent / f".{out.name}.work"
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, processes))
    try:
        tok = _tokenizer(units, work_root, tokenizer, vocab_size, job)
        salt = f"{toks.fingerprint(tok)}:{field}" + (f":{fmt.key()}" if fmt.packed else "")
        work = R.WorkDir(work_root, salt, job.strict)
        run_opts = dict(processes=processes, threads=threads, ray_address=ray_address)
        data = _write(units, job, tok, work, shard_tokens, source_fingerprint, run_opts, progress, log)
    except ConfigError as e:  # bad input: no dataset; the units finished before it are kept for the rerun
        finished = len(list(work_root.glob("*.npz")))
        if not finished:
            shutil.rmtree(work_root, ignore_errors=True)
            raise
        raise ConfigError(
            f"{e}\n  ({finished} finished work units are kept in {work_root}: fix the input, or add "
            "--on-error skip, and run the same command again to resume; delete it to start over)"
        ) from None
    shutil.rmtree(work_root, ignore_errors=True)
    return data


@dataclass(frozen=True)
class _Job:
    """What is read and how it is split."""

    out: Path
    period: int  # every period-th document is held out
    val_fraction: float
    field: str
    strict: bool  # on_error="strict"
    max_bytes: int  # 0: no cap
    fmt: Format  # chat / completion records are packed into rows of seq_len + 1 tokens
    seq_len: int


def _tokenizer(units, work_root: Path, tokenizer: str | None, vocab_size: int | None, job: _Job):
    """The given tokenizer, or one trained on the corpus (kept in the work directory for a resume)."""
    if tokenizer:
        return toks.load(tokenizer)
    if not vocab_size:
        raise ConfigError("give a tokenizer (--tokenizer tokenizer.json) or a vocabulary size to train one")
    identity = [[u.key() for u in units], vocab_size, job.period, job.field, job.strict, job.max_bytes]
    kept = work_root / f"tokenizer-{hashlib.blake2b(json.dumps(identity).encode(), digest_size=10).hexdigest()}.json"
    if kept.is_file():
        return toks.load(kept)
    docs = (text for u in units for text in U.documents(u, job.field, U.Skips(job.strict)))
    texts = (t for split, t in _split(corpus.capped(docs, job.max_bytes), job.period) if split == "train")
    tok = toks.train_bpe(texts, vocab_size)
    work_root.mkdir(parents=True, exist_ok=True)
    tok.save(str(kept.with_suffix(".tmp")))
    kept.with_suffix(".tmp").rename(kept)
    return tok


def _write(units, job: _Job, tok, work, shard_tokens, source_fingerprint, run_opts, progress, log) -> PreparedData:
    """Encode the units (`runner.run`), merge them into the shards (`shards.Merge`), write the index
    and publish the directory."""
    out, max_bytes = job.out, job.max_bytes
    n_vocab = tok.get_vocab_size()
    dtype = np.dtype(np.uint16 if n_vocab <= 2**16 else np.uint32)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    t0 = time.perf_counter()
    kept = sum(work.has(i, u) for i, u in enumerate(units))
    if kept:
        log(f"resuming: {kept} of {len(units)} work units were finished by an earlier, interrupted preparation")
    try:
        row = job.seq_len + 1
        if job.fmt.packed:  # whole rows per shard
            shard_tokens = max(row, shard_tokens // row * row)
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
        flag_writers = {s: ShardWriter(tmp, s, np.dtype(np.uint8), shard_tokens, ".flags") for s in SPLITS}
        if job.fmt.packed:
            merge = PackedMerge(units, writers, flag_writers, n_vocab, toks.eot_id(tok), job.period, row)
        else:
            merge = Merge(units, writers, tok, job.period, job.field, job.strict, max_bytes)
        total = sum(u.nbytes for u in units)
        with _Progress(progress, min(total, max_bytes) if max_bytes else total) as advance:
            source = U.TokenizerSource.of(tok)
            args = (source, job.field, job.strict) + ((job.fmt,) if job.fmt.packed else ())
            for i, result in R.run(units, args, work, **run_opts):
                advance(units[i].nbytes)
                if not merge.add(i, result):
                    break
        merge.finish()
        splits = {s: w.close() for s, w in writers.items()}
        if job.fmt.packed:
            for s in SPLITS:
                for shard, flags in zip(splits[s], flag_writers[s].close(), strict=True):
                    shard |= {"flags": flags["file"], "flags_blake2b": flags["blake2b"]}
            if job.fmt.template:
                (tmp / "chat_template.jinja").write_text(job.fmt.template, encoding="utf-8")
        if not sum(sh["tokens"] for sh in splits["train"]):
            raise ConfigError("the corpus is empty: no non-blank documents in the inputs")
        tok.save(str(tmp / "tokenizer.json"))
        meta = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "tokenizer_vocab_size": n_vocab,
            "tokenizer_fingerprint": toks.fingerprint(tok),
            "eot_id": toks.eot_id(tok),
            "val_fraction": job.val_fraction,
            "documents": {s: writers[s].documents for s in SPLITS},
            "train_tokens": sum(sh["tokens"] for sh in splits["train"]),
            "val_tokens": sum(sh["tokens"] for sh in splits["val"]),
            "train_unigram_entropy": unigram_entropy(merge.counts),
            "source_fingerprint": source_fingerprint,
            "skipped": merge.skips.counts,
            "skipped_examples": merge.skips.examples,
            "splits": splits,
        }
        if job.fmt.packed:
            meta["packed"] = job.fmt.describe() | {"seq_len": job.seq_len, "row_tokens": row} | merge.stats
        (tmp / INDEX).write_text(json.dumps(meta, indent=2))
        _publish(tmp, out, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    tokens = meta["train_tokens"] + meta["val_tokens"]
    log(
        f"prepared {out}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens; "
        f"{merge.bytes / 1e6:.1f} MB in {seconds:.1f} s ({merge.bytes / 1e6 / seconds:.2f} MB/s, "
        f"{tokens / seconds / 1e3:.0f}k tokens/s)"
    )
    if merge.skips.counts:
        log("  skipped: " + ", ".join(f"{n:,} {U.CAUSES[c]}" for c, n in sorted(merge.skips.counts.items())))
    return load(out)


def _publish(tmp: Path, out: Path, meta: dict) -> None:
    """Rename a finished preparation into place, unless the same one is already there."""
    if _same_preparation(out, meta):  # another process prepared the same thing meanwhile: use theirs
        shutil.rmtree(tmp, ignore_errors=True)  # (never delete a dataset someone may be reading)
        return
    if out.exists():
        if not is_prepared(out) and any(out.iterdir()):
            raise ConfigError(f"{out} exists and is not a meshlm dataset; choose another --out")
        shutil.rmtree(out)  # replacing an older preparation (or an empty directory)
    try:
        tmp.rename(out)
    except OSError:  # another process prepared the same cache entry first; use theirs
        shutil.rmtree(tmp, ignore_errors=True)


class _Progress:
    """A rich progress bar over input bytes (or nothing)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
        self.bar = Progress(TextColumn("tokenizing"), *columns, transient=False)
        task = self.bar.add_task("tokenizing", total=self.total or None)
        self.bar.start()
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def fingerprint_files(files: list[Path], options: object) -> tuple[str, int]:
    """(hash of the options and of every file's bytes, total bytes)."""
    h = hashlib.blake2b(digest_size=10)
    h.update(json.dumps([FORMAT_VERSION, options], sort_keys=True).encode())
    total = 0
    for f in files:
        h.update(str(f.name).encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
                total += len(chunk)
    return h.hexdigest(), total


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return cache_home() / "data"


def fit_config_to_data(cfg, log=print):
    """`cfg` for its data, read from the index alone (before anything is compiled): packed chat /
    completion rows turn on the loss mask and document masks, and fix train.seq_len to theirs."""
    paths = [p for _, p in cfg.data.mixture_sources()] or list(cfg.data.paths)
    packed = [load(p).packed if len(paths) and is_prepared(p) else None for p in paths] or [None]
    if any(p is None for p in packed) and any(p is not None for p in packed):
        raise ConfigError("data.mixture mixes packed chat / completion datasets with text ones; use one kind")
    if packed[0] is None:
        if cfg.data.loss_mask:
            raise ConfigError(
                "data.loss_mask=true needs data prepared with --format chat or completion (meshlm sets it itself)"
            )
        return cfg
    lengths = {p["seq_len"] for p in packed}
    if lengths != {cfg.train.seq_len}:
        raise ConfigError(
            f"the data was packed into rows for --seq-len {', '.join(map(str, sorted(lengths)))}; set "
            f"train.seq_len to it (or prepare it again with --seq-len {cfg.train.seq_len})"
        )
    if not (cfg.data.loss_mask and cfg.data.document_mask):
        kinds = ", ".join(sorted({f"{p['format']} trained on {p['train_on']}" for p in packed}))
        log(f"data: packed {kinds}: loss mask and document masks on")
        cfg = replace(cfg, data=replace(cfg.data, loss_mask=True, document_mask=True))
    return cfg


def prepare_mixture(cfg: DataConfig, vocab_size: int, log=print) -> list[PreparedData]:
    """The sources of `data.mixture`, each found or prepared as `data.paths` naming it alone would
    be; they must share one tokenizer (raw inputs: give `data.tokenizer`)."""
    sources = [prepare(replace(cfg, paths=(path,), mixture=()), vocab_size, log) for _, path in cfg.mixture_sources()]
    first = sources[0]
    for data in sources[1:]:
        if data.meta["tokenizer_fingerprint"] != first.meta["tokenizer_fingerprint"]:
            raise ConfigError(
                f"data.mixture: {data.root} and {first.root} were tokenized with different tokenizers; a mixture "
                "needs one (prepare every source with the same --tokenizer, or set data.tokenizer for raw inputs)"
            )
    return sources


def mixture_summary(sources: list[PreparedData], weights: list[float], names: list[str]) -> PreparedData:
    """What a run records of its mixture, in a prepared dataset's terms: the first source's root and
    tokenizer, the sources with their weights, and a fingerprint of both (a changed weight or source
    changes the batches). The unigram entropy is the weighted mean of the sources' (a lower bound
    on the mixture's own, which the sources' counts would be needed for)."""
    first = sources[0].meta
    each = list(zip(sources, weights, names, strict=True))
    parts = [
        {"name": n, "root": str(d.root.absolute()), "weight": w, "train_tokens": d.meta["train_tokens"]}
        for d, w, n in each
    ]
    digests = [[w, [sh["blake2b"] for s in SPLITS for sh in d.meta["splits"][s]]] for d, w, _ in each]
    meta = {k: first[k] for k in ("format", "dtype", "tokenizer_vocab_size", "tokenizer_fingerprint", "eot_id")}
    meta |= {
        "source_fingerprint": hashlib.blake2b(json.dumps(digests).encode(), digest_size=10).hexdigest(),
        "train_tokens": sum(d.meta["train_tokens"] for d in sources),
        "val_tokens": sum(d.meta["val_tokens"] for d in sources),
        "train_unigram_entropy": float(sum(w * d.meta["train_unigram_entropy"] for d, w, _ in each)),
        "unigram_entropy_is": "the weighted mean of the sources' (a lower bound on the mixture's)",
        "mixture": parts,
        "splits": {},
    }
    return PreparedData(sources[0].root, meta)


def prepare(cfg: DataConfig, vocab_size: int, log=print) -> PreparedData:
    """The dataset a run trains on: `data.paths` naming one prepared dataset is used as is; raw
    inputs (or none: the built-in corpus) are prepared into the cache, or found there."""
    if len(cfg.paths) == 1 and is_prepared(cfg.paths[0]):
        data = load(cfg.paths[0])
    else:
        if any(is_prepared(p) for p in cfg.paths):
            raise ConfigError("data.paths names a prepared dataset among other inputs; give it alone")
        files = corpus.resolve_files(cfg.paths)
        max_bytes = int(cfg.max_corpus_mb * 1e6)
        tok_hash = hashlib.sha256(Path(cfg.tokenizer).expanduser().read_bytes()).hexdigest() if cfg.tokenizer else ""
        options = [vocab_size, cfg.val_fraction, cfg.field, max_bytes, tok_hash]
        key, total = fingerprint_files(files, options)
        root = cache_root(cfg) / key
        if is_prepared(root):
            data = load(root)
        else:
            log(f"preparing data: {len(files)} files, {total / 1e6:.1f} MB (cap {cfg.max_corpus_mb:g} MB) -> {root}")
            work = U.plan(files)
            data = write_dataset(
                work,
                root,
                field=cfg.field,
                vocab_size=vocab_size,
                tokenizer=cfg.tokenizer or None,
                val_fraction=cfg.val_fraction,
                source_fingerprint=key,
                max_bytes=max_bytes,
                processes=R.auto_processes(work),
                log=log,
            )
    data.verify(vocab_size, digests=cfg.verify)
    return data
