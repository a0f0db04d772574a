"""Write a benchmark's table into its marked section of BENCHMARKS.md (or of BENCHMARKS-history.md,
for the secondary tables and experiments kept there), moving the table it replaces to the history."""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "BENCHMARKS-history.md"
REPLACED = "## Tables replaced by reruns"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(name: str, table: str, page: Path = BENCHMARKS, history: Path = HISTORY) -> None:
    """Replace the text between `<!-- name:start -->` and `<!-- name:end -->` in whichever of the two
    files holds them (appended to the page if neither does); the table replaced, if any, is appended
    to the history's last section, `## Tables replaced by reruns`, with its section name and date."""
    start, end = _markers(name)
    target = next((f for f in (page, history) if f.exists() and start in f.read_text()), page)
    text = target.read_text()
    if start not in text:
        text = f"{text.rstrip()}\n\n{start}\n{end}\n"
    head, _, rest = text.partition(start)
    old, _, tail = rest.partition(end)
    target.write_text(f"{head}{start}\n{table}\n{end}{tail}")
    old = old.strip()
    if old and old != table.strip():
        _archive(name, old, history)


def _archive(name: str, old: str, history: Path) -> None:
    text = history.read_text() if history.exists() else f"# Benchmark history\n\n{REPLACED}\n"
    if REPLACED not in text:
        text = f"{text.rstrip()}\n\n{REPLACED}\n"
    entry = f"\n### `{name}`, replaced on {time.strftime('%Y-%m-%d')}\n\n{old}\n"
    history.write_text(f"{text.rstrip()}\n{entry}")


def publish(name: str, lines: list[str], write: bool) -> None:
    """Print a benchmark's table (its lines joined), and with `write` put it into its section."""
    table = "\n".join(lines)
    print(table)
    if write:
        write_section(name, table)
