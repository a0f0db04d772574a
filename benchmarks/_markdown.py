"""Write a benchmark's table into its marked section of BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def write_section(name: str, table: str) -> None:
    """Replace the text between `<!-- name:start -->` and `<!-- name:end -->` (appended if absent)."""
    text = BENCHMARKS.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text:
        text = f"{text.rstrip()}\n\n{start}\n{end}\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    BENCHMARKS.write_text(f"{head}{start}\n{table}\n{end}{tail}")


def publish(name: str, lines: list[str], write: bool) -> None:
    """Print a benchmark's table (its lines joined), and with `write` put it into its section."""
    table = "\n".join(lines)
    print(table)
    if write:
        write_section(name, table)
