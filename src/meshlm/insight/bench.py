"""`meshlm bench`: the first paper's "quantitative analysis" on the devices at hand.

A sweep of layouts (mesh x sequence parallelism) and remat policies, each trained for a few steps
on synthetic tokens in this one process. All variants are compiled first, then timed in interleaved
rounds so machine noise hits them alike; step time is the median over rounds. Per variant: step
time, tokens/s, MFU/HFU, and the activation bytes the compiled program stores per device. Writes
`bench.md` (table) and `bench.png` (chart) to the run directory.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from meshlm import accounting
from meshlm.config import ConfigError, RematConfig, RunConfig, apply_overrides, parse_mesh
from meshlm.insight.memory import measure_activations
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.rules import reorder_sequence
from meshlm.platform import hardware
from meshlm.step import batch_sharding, make_train_step
from meshlm.train_state import init_state, placement, setup
from meshlm.validation import validate


@dataclass
class BenchRow:
    layout: str
    policy: str
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    activation_bytes: int


def default_layouts(cfg: RunConfig, n: int) -> list[str]:
    """data vs fsdp vs tensor vs tensor+SP on n devices (tensor 4 or 2, whichever the model allows)."""
    layouts = [f"data={n}", f"fsdp={n}"]
    for t in (4, 2):
        if n % t == 0 and cfg.model.n_heads % t == 0 and cfg.model.kv_heads % t == 0:
            rest = f",data={n // t}" if n > t else ""
            layouts += [f"tensor={t}{rest}", f"tensor={t}{rest}+sp"]
            break
    return layouts


def _config(base: RunConfig, layout: str, policy: str) -> RunConfig:
    spec, _, flag = layout.partition("+")
    if flag not in ("", "sp"):
        raise ConfigError(f"layout {layout!r}: only '+sp' may follow the mesh")
    sizes = parse_mesh(spec)
    overrides = [f"parallel.{k}={v}" for k, v in sizes.items()] + [f"parallel.sequence_parallel={flag == 'sp'}"]
    cfg = apply_overrides(base, overrides)
    return validate(dataclasses.replace(cfg, remat=RematConfig(policy)))


def run_bench(
    base: RunConfig, layouts: list[str], policies: list[str], steps: int, log=print
) -> tuple[list[BenchRow], float, str]:
    run_peak = hardware.peak_flops(base.model.dtype, jax.device_count())  # every layout uses all
    peak, peak_source = run_peak.flops, run_peak.source
    rng = np.random.default_rng(0)
    t = base.train
    tokens = rng.integers(0, base.model.vocab_size, (steps + 1, t.global_batch, t.seq_len + 1)).astype(np.int32)
    variants = {}
    for layout in layouts:
        for policy in policies:
            cfg = _config(base, layout, policy)
            lay = make_layout(cfg.parallel)
            specs, tx, shardings = setup(cfg, lay)
            step = make_train_step(cfg, lay, tx, shardings)
            state = init_state(specs, lay, tx, t.seed, **placement(cfg))
            order = lay.context_order if lay.reordered else None  # as the loader stores them
            batches = [
                jax.device_put(
                    {"inputs": reorder_sequence(x[:, :-1], order), "targets": reorder_sequence(x[:, 1:], order)},
                    batch_sharding(lay),
                )
                for x in tokens
            ]
            state, _ = step(state, batches[-1])  # compile + warm up
            act = measure_activations(cfg, lay).activation_bytes
            variants[(layout, policy)] = [cfg, step, state, batches, act, []]
            log(f"compiled {layout} remat={policy}")
    for i in range(steps):  # interleaved rounds
        for v in variants.values():
            cfg, step, state, batches, _, times = v
            t0 = time.perf_counter()
            v[2], metrics = step(state, batches[i])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
    if jax.process_count() == 1:  # a probe taken on a busy host reads low (`hardware.raise_cpu_peak`)
        fastest = max(accounting.causal_flops_per_step(v[0]) / statistics.median(v[5]) for v in variants.values())
        run_peak = hardware.raise_cpu_peak(run_peak, fastest, base.model.dtype)
        peak, peak_source = run_peak.flops, run_peak.source
    rows = []
    for (layout, policy), (cfg, _, _, _, act, times) in variants.items():
        dt = statistics.median(times)
        rows.append(
            BenchRow(
                layout,
                policy,
                dt,
                t.global_batch * t.seq_len / dt,
                accounting.utilisation(accounting.causal_flops_per_step(cfg), dt, peak),
                accounting.utilisation(accounting.hardware_flops_per_step(cfg), dt, peak),
                act,
            )
        )
    return rows, peak, peak_source


def markdown(rows: list[BenchRow], peak_source: str, header: str) -> str:
    base = rows[0].tokens_per_s
    lines = [
        header,
        f"Peak: {peak_source}",
        "",
        "| layout | remat | step (ms) | tokens/s | vs first | MFU | HFU | activations / device (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.layout} | {r.policy} | {1e3 * r.step_time_s:.1f} | {r.tokens_per_s:.0f} | "
            f"{r.tokens_per_s / base:.2f}x | {100 * r.mfu:.1f}% | {100 * r.hfu:.1f}% | "
            f"{r.activation_bytes / 2**20:.2f} |"
        )
    return "\n".join(lines)


def chart(rows: list[BenchRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.layout}\n{r.policy}" for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(rows)), 6), sharex=True)
    top.bar(labels, [r.tokens_per_s for r in rows], color="tab:blue")
    top.set_ylabel("tokens / s")
    top.set_title("meshlm bench")
    bottom.bar(labels, [r.activation_bytes / 2**20 for r in rows], color="tab:orange")
    bottom.set_ylabel("activations / device (MiB)")
    bottom.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
