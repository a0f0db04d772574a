"""Find and read the documents a run trains on: text files, directories, JSONL and Parquet.

One file of text is one document. A JSONL line is one document (its `field`, default "text"); a
Parquet row is one document (the column of that name). Documents are streamed in a fixed order
(inputs as given, directories sorted), so preparation is deterministic and never needs the whole
corpus in memory.

The built-in corpus is the Python standard library source of the running interpreter (found with
`sysconfig`, tests excluded): real, varied text that every machine with Python already has, so the
default job needs no download.
"""

from __future__ import annotations

import gzip
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from meshlm.config import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv"}
JSONL_SUFFIXES = {".jsonl", ".jsonl.gz", ".ndjson"}
PARQUET_SUFFIXES = {".parquet"}


def kind(path: Path) -> str | None:
    """'text', 'jsonl', 'parquet' or None (not a corpus file)."""
    name = path.name.lower()
    if any(name.endswith(s) for s in JSONL_SUFFIXES):
        return "jsonl"
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return "parquet"
    if path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    return None


def builtin_corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "__pycache__")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def resolve_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """Expand user paths (files; directories of text, JSONL and Parquet files) into a file list."""
    if not paths:
        return builtin_corpus_files()
    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and kind(f) is not None)
            if not found:
                suffixes = sorted(TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES)
                raise ConfigError(f"data path {p} contains no corpus files ({', '.join(suffixes)})")
            out.extend(found)
        else:
            raise ConfigError(f"data path not found: {raw}")
    return out


def _jsonl(path: Path, field: str) -> Iterator[str]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path}:{n}: no field {field!r} (has: {keys}); choose it with --field / data.field")
            yield str(record[field])


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: Parquet input needs pyarrow: pip install 'meshlm[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise ConfigError(f"{path}: cannot read Parquet ({e})") from None
    if field not in pf.schema_arrow.names:
        raise ConfigError(f"{path}: no column {field!r} (has: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def read_text(path: Path) -> str:
    """One text file as a document. Binary input (a NUL byte, or more than 1 in 20 characters not
    valid UTF-8) is refused, naming the file: tokenizing it would make a data set of noise."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if b"\x00" in raw or bad > 0.05 * max(1, len(text)):
        why = "contains NUL bytes" if b"\x00" in raw else f"{bad} of {len(text)} characters are not valid UTF-8"
        raise ConfigError(
            f"{path}: not a text file ({why}); give UTF-8 text, JSONL (.jsonl, .jsonl.gz) or Parquet (.parquet) files"
        )
    return text


def iter_documents(files: list[Path], field: str = "text", max_bytes: int = 0) -> Iterator[str]:
    """Non-blank documents of `files` in order, UTF-8 (undecodable bytes replaced); stops after
    `max_bytes` of text when it is > 0."""
    total = 0
    for f in files:
        k = kind(f) or "text"
        if k == "jsonl":
            docs = _jsonl(f, field)
        elif k == "parquet":
            docs = _parquet(f, field)
        else:
            docs = iter([read_text(f)])
        for text in docs:
            raw = text.encode("utf-8")
            if max_bytes and len(raw) > max_bytes - total:  # cut at the cap, never inside a character
                raw = raw[: max(0, max_bytes - total)]
                text = raw.decode("utf-8", errors="ignore")
            if text.strip():
                yield text
                total += len(raw)
            if max_bytes and total >= max_bytes:
                return
