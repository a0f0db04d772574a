"""`meshlm report RUN_DIR`: a one-page summary of a run with its curves, from what the run wrote.

Reads `metrics.jsonl` (a `resume` record drops what the interrupted attempt logged after the
checkpoint it resumed from; a `recovered` record, what a restart after a failure cost),
`config.json` and `run.json` (the startup report), so it works on a finished run, one still
running, one that was interrupted, and a multi-process run (process 0 wrote the files).
Writes `<out>/report.md` and PNGs (default out: `<run_dir>/report`). `compare` overlays other runs'
curves, labelled by their directory names.

Shapes of the figures (tests check these on the figure objects, not on pixels):
loss.png (loss and validation loss vs step, and vs tokens), throughput.png (tokens/s and MFU vs
step), lr.png, grad_norm.png, memory.png (per-device bytes: predicted by category, activations by
term, next to XLA's view of the compiled step).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from meshlm import accounting
from meshlm.axes import MESH_AXES
from meshlm.config import ConfigError, RunConfig, from_dict

MiB = 2**20


@dataclass
class Run:
    directory: Path
    config: RunConfig
    info: dict  # run.json ({} before the run wrote it)
    steps: dict[int, dict] = field(default_factory=dict)  # step -> logged record (loss, lr, ...)
    val: dict[int, float] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    recoveries: list[dict] = field(default_factory=list)  # "recovered" records of restarted groups

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def tokens_per_step(self) -> int:
        return self.config.train.global_batch * self.config.train.seq_len

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs = [s for s in sorted(self.steps) if self.steps[s].get(key) is not None]
        return xs, [self.steps[s][key] for s in xs]


def read_run(directory: str | Path) -> Run:
    d = Path(directory)
    if not (d / "config.json").exists():
        raise ConfigError(f"{d} is not a meshlm run directory (no config.json)")
    info = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else {}
    run = Run(d, from_dict(json.loads((d / "config.json").read_text())), info)
    metrics = d / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            r = json.loads(line)
        except ValueError:  # a line being written by a running process
            continue
        if r.get("event") == "resume":  # a resumed attempt redoes the steps after r["step"]
            run.steps = {k: v for k, v in run.steps.items() if k <= r["step"]}
            run.val = {k: v for k, v in run.val.items() if k <= r["step"]}
            run.skipped = [k for k in run.skipped if k <= r["step"]]
        elif r.get("event") == "recovered":
            run.recoveries.append(r)
        elif r.get("event") == "skipped":
            run.skipped.append(r["step"])
        elif "loss" in r and "event" not in r:
            run.steps[r["step"]] = r
        elif "val_loss" in r:
            run.val[r["step"]] = r["val_loss"]
    return run


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_figure(runs: list[Run]):
    plt = _plt()
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        xs, ys = run.series("loss")
        by_step.plot(xs, ys, label=f"{run.name} train")
        by_tokens.plot([x * run.tokens_per_step for x in xs], ys, label=f"{run.name} train")
        if run.val:
            vx = sorted(run.val)
            by_step.plot(vx, [run.val[x] for x in vx], "o--", label=f"{run.name} validation")
            by_tokens.plot(
                [x * run.tokens_per_step for x in vx], [run.val[x] for x in vx], "o--", label=f"{run.name} validation"
            )
    by_step.set(xlabel="step", ylabel="loss (nats/token)", title="loss vs step")
    by_tokens.set(xlabel="tokens", ylabel="loss (nats/token)", title="loss vs tokens")
    for ax in (by_step, by_tokens):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def throughput_figure(runs: list[Run]):
    plt = _plt()
    fig, (rate, mfu) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        rate.plot(*run.series("tokens_per_s"), label=run.name)
        xs, ys = run.series("mfu")
        mfu.plot(xs, [100 * y for y in ys], label=run.name)
    rate.set(xlabel="step", ylabel="tokens / s", title="throughput")
    mfu.set(xlabel="step", ylabel="MFU (%)", title="model FLOPs utilisation (causal attention)")
    for ax in (rate, mfu):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def line_figure(runs: list[Run], key: str, ylabel: str):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        ax.plot(*run.series(key), label=run.name)
    ax.set(xlabel="step", ylabel=ylabel, title=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def memory_bars(run: Run, top_terms: int = 6) -> dict[str, dict[str, float]]:
    """Per-device bytes to draw: {"predicted": {category or activation term: bytes},
    "compiled (XLA)": {argument/temp/output: bytes}}; the largest activation terms are named, the
    rest summed."""
    report = run.info.get("startup_report", {})
    predicted = {k: v for k, v in report.get("predicted_device_bytes", {}).items() if not k.startswith("activations")}
    act = accounting.activation_memory(run.config)
    terms = {f"act: {k}": run.config.model.n_layers * v for k, v in act["per_layer"].items()}
    terms |= {f"act: {k}": v for k, v in act["outside"].items()}
    ranked = sorted(terms.items(), key=lambda kv: -kv[1])
    predicted |= dict(ranked[:top_terms])
    if len(ranked) > top_terms:
        predicted["act: other terms"] = sum(v for _, v in ranked[top_terms:])
    xla = report.get("xla_memory_analysis", {})
    compiled = {k: float(xla[k]) for k in ("argument_size", "temp_size", "output_size") if k in xla}
    if "alias_size" in xla and "output_size" in compiled:  # donated state: outputs written in place
        compiled["output_size"] = max(0.0, compiled["output_size"] - xla["alias_size"])
    return {"predicted": predicted, "compiled (XLA)": compiled}


def memory_figure(run: Run):
    plt = _plt()
    bars = memory_bars(run)
    fig, ax = plt.subplots(figsize=(7, 5))
    colors = iter(plt.get_cmap("tab20").colors)  # one color per segment, across both bars
    for i, parts in enumerate(bars.values()):
        bottom = 0.0
        for name, value in parts.items():
            ax.bar(i, value / MiB, bottom=bottom, label=name, color=next(colors))
            bottom += value / MiB
    ax.set_xticks(range(len(bars)), list(bars))
    ax.set(ylabel="MiB per device", title=f"memory per device: {run.name}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def figures(run: Run, others: list[Run] = ()) -> dict:
    runs = [run, *others]
    out = {
        "loss": loss_figure(runs),
        "throughput": throughput_figure(runs),
        "lr": line_figure(runs, "lr", "learning rate"),
        "grad_norm": line_figure(runs, "grad_norm", "gradient norm (before clipping)"),
    }
    if run.info.get("startup_report"):
        out["memory"] = memory_figure(run)
    return out


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _summary(run: Run) -> list[str]:
    c, info = run.config, run.info
    m, p = c.model, c.parallel
    steps = sorted(run.steps)
    rates = [r["tokens_per_s"] for r in run.steps.values() if "tokens_per_s" in r]
    mfus = [r["mfu"] for r in run.steps.values() if "mfu" in r]
    last = run.steps[steps[-1]] if steps else {}
    mesh = info.get("mesh") or {axis: getattr(p, axis) for axis in MESH_AXES}
    lines = [
        f"| run | `{run.directory}` |",
        "|---|---|",
        f"| model | {m.family}, {accounting.param_count(m) / 1e6:.2f}M parameters, L={m.n_layers} h={m.d_model} "
        f"a={m.n_heads} kv={m.kv_heads} vocab {m.vocab_size}, {m.dtype} |",
        f"| layout | mesh {' x '.join(f'{k}={v}' for k, v in mesh.items())}"
        f"{' + sequence parallel' if p.sequence_parallel else ''}, remat {c.remat.policy}, "
        f"{c.train.microbatches} microbatch(es), {info.get('processes', 1)} process(es) |",
        f"| progress | step {steps[-1] if steps else 0} of {c.train.steps} logged"
        f"{'' if steps and steps[-1] >= c.train.steps else ' (running or interrupted)'} |",
        f"| train loss (last logged) | {_num(last.get('loss'))} |",
        f"| validation loss (last) | {_num(run.val[max(run.val)] if run.val else None)} |",
        f"| skipped non-finite steps | {len(run.skipped)} {run.skipped[:10] if run.skipped else ''} |",
        f"| tokens/s (median) | {statistics.median(rates):.0f} |" if rates else "| tokens/s | - |",
        f"| MFU (median) | {100 * statistics.median(mfus):.1f}% against {info.get('peak_source', '?')} |"
        if mfus
        else "| MFU | - |",
        f"| compile | {info.get('compile_s', float('nan')):.1f} s"
        f"{' (persistent cache hit)' if info.get('compile_cache_hit') else ''} |",
    ]
    if run.recoveries:  # failures survived by `meshlm launch`: where each resumed from, what it cost
        lost = sum(r["lost_steps"] for r in run.recoveries)
        each = "; ".join(
            f"step {r['resumed_at']} from {r['source']}, {r['lost_steps']} lost, {r['recovery_s']:.1f} s"
            for r in run.recoveries
        )
        lines.append(f"| recoveries | {len(run.recoveries)}, {lost} step(s) lost in all: {each} |")
    if "moe_aux_loss" in last:  # Mixture of Experts: the router's health at the last logged step
        lines.append(
            f"| MoE router (last logged) | aux loss {_num(last['moe_aux_loss'])} ({m.experts_per_token} when "
            f"balanced), z-loss {_num(last['moe_z_loss'])}, dropped {100 * last['dropped_fraction']:.2f}% of "
            f"assignments, busiest expert at {last['expert_load_max']:.2f}x its fair share |"
        )
    sources = {k[len("tokens/") :]: v for k, v in last.items() if k.startswith("tokens/")}
    if sources:  # data.mixture: what each source gave so far, against its weight
        total = sum(sources.values()) or 1
        weight = {p["name"]: p["weight"] for p in info.get("data", {}).get("mixture", [])}
        lines.append(
            "| tokens per source (last logged) | "
            + ", ".join(
                f"{name} {n:,} ({100 * n / total:.1f}%, weight {100 * weight.get(name, float('nan')):.1f}%)"
                for name, n in sources.items()
            )
            + " |"
        )
    return lines


def write_report(run_dir: str | Path, compare: list[str | Path] = (), out: str | Path | None = None) -> Path:
    """Write report.md and the PNGs; returns the report's path."""
    run = read_run(run_dir)
    others = [read_run(d) for d in compare]
    out = Path(out) if out else run.directory / "report"
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    written = []
    for name, fig in figures(run, others).items():
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(name)
    md = [f"# meshlm run report: {run.name}", "", *_summary(run), ""]
    if others:
        md += ["Compared with: " + ", ".join(f"`{o.directory}`" for o in others), ""]
    for name in written:
        md += [f"## {name.replace('_', ' ')}", "", f"![{name}]({name}.png)", ""]
    if "memory" in written:
        bars = memory_bars(run)
        md += ["| per device | MiB |", "|---|---:|"]
        md += [f"| {side}: {k} | {v / MiB:.2f} |" for side, parts in bars.items() for k, v in parts.items()]
        md.append("")
    (out / "report.md").write_text("\n".join(md))
    return out / "report.md"
