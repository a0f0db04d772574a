"""Find the documents a run trains on: text files, directories, JSONL, Parquet, `datasets` directories.

One file of text is one document. A JSONL line is one document (its `field`, default "text"); a
Parquet or Arrow row is one document (the column of that name). Inputs are files, directories
(searched recursively), glob patterns, or directories written by Hugging Face `datasets`'
`save_to_disk` (their Arrow files, read through a memory map). Documents are streamed in a fixed
order (inputs as given, directories and globs sorted), so preparation is deterministic and never
needs the whole corpus in memory; `data.units` reads them.

The built-in corpus is the Python standard library source of the running interpreter (found with
`sysconfig`, tests excluded): real, varied text that every machine with Python already has, so the
default job needs no download.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from meshlm.config import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv"}
JSONL_SUFFIXES = {f"{s}{c}" for s in (".jsonl", ".ndjson") for c in ("", ".gz", ".zst")}
PARQUET_SUFFIXES = {".parquet"}
ARROW_SUFFIXES = {".arrow"}  # found through a save_to_disk directory's state.json, never by suffix alone


def kind(path: Path) -> str | None:
    """'text', 'jsonl', 'parquet', 'arrow' or None (not a corpus file)."""
    name = path.name.lower()
    if any(name.endswith(s) for s in JSONL_SUFFIXES):
        return "jsonl"
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return "parquet"
    if path.suffix.lower() in ARROW_SUFFIXES:
        return "arrow"
    if path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    return None


def builtin_corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "__pycache__")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def compressed(path: Path) -> bool:
    return path.name.lower().endswith((".gz", ".zst"))


def _saved_dataset(p: Path) -> list[Path] | None:
    """The Arrow files of a directory written by `datasets`' save_to_disk (None: it is not one)."""
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(
            f"{p} holds several splits ({', '.join(splits)}); give one, e.g. {p / (splits or ['train'])[0]}"
        )
    if not (p / "state.json").is_file():
        return None
    try:
        names = [f["filename"] for f in json.loads((p / "state.json").read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{p / 'state.json'} is not a datasets state file ({e})") from None
    missing = [n for n in names if not (p / n).is_file()]
    if missing:
        raise ConfigError(f"{p}: state.json lists files that are not there: {', '.join(missing)}")
    return [p / n for n in names]


def _expand(raw: str) -> list[Path]:
    """A path, or the sorted matches of a glob pattern (`**` recursive)."""
    p = Path(raw).expanduser()
    if p.exists() or not any(c in raw for c in "*?["):
        return [p]
    matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True))
    if not matches:
        raise ConfigError(f"data path pattern matches nothing: {raw}")
    return matches


def resolve_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """Expand user paths (files; globs; directories of text, JSONL and Parquet files; datasets'
    save_to_disk directories) into a file list."""
    if not paths:
        return builtin_corpus_files()
    out: list[Path] = []
    for raw in paths:
        for p in _expand(raw):
            if p.is_file():
                out.append(p)
            elif p.is_dir():
                saved = _saved_dataset(p)
                if saved is not None:
                    out.extend(saved)
                    continue
                found = sorted(f for f in p.rglob("*") if f.is_file() and kind(f) not in (None, "arrow"))
                if not found:
                    suffixes = sorted(TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES)
                    raise ConfigError(f"data path {p} contains no corpus files ({', '.join(suffixes)})")
                out.extend(found)
            else:
                raise ConfigError(f"data path not found: {raw}")
    return out


def iter_documents(files: list[Path], field: str = "text", max_bytes: int = 0) -> Iterator[str]:
    """Non-blank documents of `files` in order, UTF-8 (undecodable bytes replaced); stops after
    `max_bytes` of text when it is > 0 (the document that crosses it cut, never inside a character)."""
    from meshlm.data import units

    docs = (text for u in units.plan(files) for text in units.documents(u, field))
    return capped(docs, max_bytes)


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))  # the readers skip text that is not valid Unicode (bad_text)


def capped(docs: Iterator[str], max_bytes: int, total: int = 0) -> Iterator[str]:
    """`docs` until `max_bytes` of UTF-8 text (0: no cap), `total` of it already taken."""
    for text in docs:
        raw_len = utf8_len(text)
        if max_bytes and raw_len > max_bytes - total:
            raw = text.encode("utf-8")[: max(0, max_bytes - total)]
            text, raw_len = raw.decode("utf-8", errors="ignore"), len(raw)  # the cut counts in full
        if text.strip():
            yield text
            total += raw_len
        if max_bytes and total >= max_bytes:
            return
