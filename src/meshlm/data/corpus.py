"""Find and read the text a run trains on.

The built-in corpus is the Python standard library source of the running interpreter (found with
`sysconfig`, tests excluded): real, varied text that every machine with Python already has, so the
default job needs no download.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from meshlm.config import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv"}


def builtin_corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "__pycache__")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def resolve_files(paths: tuple[str, ...]) -> list[Path]:
    """Expand user paths (files and directories of text files) into a sorted file list."""
    if not paths:
        return builtin_corpus_files()
    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise ConfigError(f"data path {p} contains no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
            out.extend(found)
        else:
            raise ConfigError(f"data path not found: {raw}")
    return out


def read_documents(files: list[Path], max_bytes: int) -> list[str]:
    """Read files as UTF-8 (undecodable bytes replaced), in order, until `max_bytes` is reached."""
    docs, total = [], 0
    for f in files:
        text = f.read_bytes()[: max(0, max_bytes - total)].decode("utf-8", errors="replace")
        if text.strip():
            docs.append(text)
            total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    if not docs:
        raise ConfigError("the corpus is empty: no non-blank text in " + ", ".join(str(f) for f in files[:5]))
    return docs
