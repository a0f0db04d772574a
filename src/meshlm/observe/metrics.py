"""Run outputs: a live progress line on the console, `metrics.jsonl` in the run directory, and the
sinks of `meshlm.observe.sinks` (TensorBoard, W&B), all fed the same records.

Console modes: "text" (the progress line; messages on stdout), "json" (one JSON object per logged
step on stdout, every other message on stderr: for scripts), and quiet (`show=False`: nothing but
errors, which the CLI prints)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshlm.observe.sinks import chart_values


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _fmt_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Writes one JSON object per logged step (`write`) and keeps a progress line on the terminal
    (`show`: a live bar when stdout is a terminal, plain lines otherwise, e.g. in CI logs). In a
    multi-process run only process 0 writes or shows anything."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        write: bool = True,
        show: bool = True,
        peak_label: str = "",
        log_format: str = "text",
    ):
        self.enabled, self.show = write, show and write
        self.json = log_format == "json"
        self.peak_label = peak_label  # where the peak for MFU/HFU comes from, e.g. "CPU probe"
        # in json mode stdout carries only the records; every message goes to stderr
        self.console = Console(highlight=False, soft_wrap=True, stderr=self.json)
        self.path = run_dir / "metrics.jsonl"
        self.had_records = self.path.exists() and self.path.stat().st_size > 0  # an earlier attempt's
        self.file = open(self.path, "a") if write else None  # noqa: SIM115 (closed in close())
        self.sinks: list = []
        self.total = total_steps
        self.live = self.show and not self.json and sys.stdout.isatty()
        self.progress = None
        if self.live:
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task("starting", total=total_steps)
            self.progress.start()
        self.t0 = time.time()

    def resume_at(self, step: int) -> None:
        """A resumed run (or one restarted from step 0 after an attempt that never checkpointed):
        the bar starts at `step`, and metrics.jsonl records where it resumed (readers drop the
        interrupted attempt's records after it)."""
        if self.progress is not None:
            self.progress.update(self.task, completed=step)
        if self.enabled:
            self.file.write(json.dumps({"event": "resume", "step": step}) + "\n")
            self.file.flush()

    def print(self, msg: str) -> None:
        if self.show:
            self.console.print(msg, markup=False)

    def attach(self, sinks: list) -> None:
        """Also send every record to these sinks (`meshlm.observe.sinks.open_sinks`; process 0's)."""
        self.sinks = sinks

    def text(self, step: int, tag: str, text: str) -> None:
        for sink in self.sinks:
            sink.text(step, tag, text)

    def chart(self, step: int, values: dict[str, float]) -> None:
        """Chart values that are not metrics.jsonl records (e.g. the startup report's memory)."""
        for sink in self.sinks:
            sink.scalars(step, values)

    def log(self, record: dict, eta_s: float | None = None) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        values = {} if "event" in record else chart_values(record)  # events repeat a logged step's values
        if values and "step" in record:
            for sink in self.sinks:
                sink.scalars(record["step"], values)
        if "loss" not in record or "event" in record or not self.show:
            return
        if self.json:
            print(json.dumps(record), flush=True)
            return
        loss = "skipped (non-finite)" if record["loss"] is None else f"{record['loss']:.4f}"
        parts = [f"step {record['step']}/{self.total}", f"loss {loss}"]
        if "tokens_per_s" in record:
            parts += [
                f"{_fmt_rate(record['tokens_per_s'])} tok/s",
                f"MFU {100 * record['mfu']:.1f}% HFU {100 * record['hfu']:.1f}%"
                + (f" [{self.peak_label}]" if self.peak_label else ""),
            ]
        if eta_s is not None:
            parts.append(f"ETA {_fmt_eta(eta_s)}")
        line = " | ".join(parts)
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], description=line)
        else:
            self.console.print(line, markup=False)

    def close(self, failed: bool = False) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()
        for sink in self.sinks:
            sink.close(failed)
