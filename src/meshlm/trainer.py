"""The training loop: prepare data, build the mesh and sharded state, step, log, evaluate.

Everything numeric lives elsewhere (model, step, accounting); this file only wires it together.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import __version__, accounting, hardware
from meshlm.config import RunConfig, validate
from meshlm.data.loader import WindowLoader, unigram_entropy
from meshlm.data.prepare import prepare
from meshlm.metrics import MetricsLogger
from meshlm.parallel.mesh import make_layout
from meshlm.report import format_report, startup_report
from meshlm.step import batch_sharding, make_eval_step, make_train_step
from meshlm.train_state import init_state, setup


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); the message says where and why."""


@dataclass
class RunResult:
    final_step: int
    train_loss: float
    val_loss: float | None
    unigram_entropy: float
    tokens_per_s: float
    mfu: float
    compile_s: float
    run_dir: Path


def code_version() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{__version__}+{sha}" if sha else __version__


def global_batch(rows: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Assemble global arrays from host rows; each device takes only its own slice."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in rows.items()}


def evaluate(eval_fn, params, loader: WindowLoader, n_batches: int, sharding) -> float:
    total, count = 0.0, 0.0
    for i in range(min(n_batches, max(1, loader.n_windows // loader.global_batch))):
        loss_sum, c = eval_fn(params, global_batch(loader.batch(i), sharding))
        total, count = total + float(loss_sum), count + float(c)
    return total / count


def train(cfg: RunConfig, run_dir: Path, *, quiet: bool = False, dry_run: bool = False) -> RunResult | None:
    """Train `cfg`, writing into `run_dir`. With `dry_run`, stop after the startup report (the
    layout is built and the step compiled, but no data is prepared and no parameter allocated)."""
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLogger(run_dir, cfg.train.steps, enabled=not quiet)
    try:
        return _train(cfg, run_dir, log, dry_run)
    finally:
        log.close()


def _train(cfg: RunConfig, run_dir: Path, log: MetricsLogger, dry_run: bool) -> RunResult | None:
    tc = cfg.train
    layout = make_layout(cfg.parallel)
    specs, tx, shardings = setup(cfg, layout)
    bsharding = batch_sharding(layout)

    # Compile ahead of time from abstract shapes: the startup report reads the compiled program,
    # and the loop runs this same executable.
    t0 = time.time()
    abstract_state = jax.eval_shape(lambda: init_state(specs, layout, tx, tc.seed))
    abstract_batch = {
        k: jax.ShapeDtypeStruct((tc.global_batch, tc.seq_len), jnp.int32, sharding=bsharding)
        for k in ("inputs", "targets")
    }
    step_fn = make_train_step(cfg, layout, tx, shardings).lower(abstract_state, abstract_batch).compile()
    compile_s = time.time() - t0
    peak, peak_source = hardware.peak_flops(cfg.model.dtype)
    log.peak_label = "CPU probe" if peak_source.startswith("CPU") else peak_source.split(" ")[0]
    report = startup_report(cfg, layout, abstract_state, shardings, step_fn, peak)
    log.print(
        f"meshlm {code_version()} | {cfg.model.family} | {tc.global_batch}x{tc.seq_len} tokens/step | "
        f"peak: {peak_source} | train step compiled in {compile_s:.1f}s"
    )
    for line in format_report(report):
        log.print(line)
    run_info = {
        "code_version": code_version(),
        "jax_version": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "mesh": dict(layout.mesh.shape),
        "params": accounting.param_count(cfg.model),
        "model_flops_per_step": report["model_flops_per_step"],
        "hardware_flops_per_step": report["hardware_flops_per_step"],
        "peak_flops_per_s": peak,
        "peak_source": peak_source,
        "startup_report": report,
    }
    (run_dir / "config.json").write_text(cfg.to_json())
    (run_dir / "run.json").write_text(json.dumps(run_info, indent=2))
    if dry_run:
        return None

    data = prepare(cfg.data, cfg.model.vocab_size, log=log.print)
    train_tokens = data.tokens("train")
    train_loader = WindowLoader(train_tokens, tc.seq_len, tc.global_batch, tc.seed, "train")
    val_loader = WindowLoader(data.tokens("val"), tc.seq_len, tc.global_batch, tc.seed + 1, "validation")
    entropy = unigram_entropy(train_tokens, cfg.model.vocab_size)
    run_info |= {"data": data.meta, "unigram_entropy": entropy}
    (run_dir / "run.json").write_text(json.dumps(run_info, indent=2))
    log.print(f"data: {data.meta['train_tokens']:,} training tokens, unigram entropy {entropy:.3f} nats")
    state = init_state(specs, layout, tx, tc.seed)
    eval_fn = make_eval_step(cfg, layout, shardings.params)
    model_flops, hw_flops = report["model_flops_per_step"], report["hardware_flops_per_step"]

    t_last, step_last = None, 0
    tokens_per_s = mfu = 0.0
    loss = float("nan")
    val_loss = None
    for step in range(tc.steps):
        batch = global_batch(train_loader.batch(step), bsharding)
        state, metrics = step_fn(state, batch)
        last = step + 1 == tc.steps
        if step == 0:  # warm-up: throughput is measured from the end of the first step
            jax.block_until_ready(metrics)
            t_last, step_last = time.time(), 1
        if (step + 1) % tc.log_every == 0 or last:
            m = jax.device_get(metrics)
            loss = float(m["loss"])
            if not m["finite"] or int(state.step) != step + 1:
                raise TrainingError(
                    f"non-finite loss or gradient at step {step + 1} (loss={loss}, grad_norm={float(m['grad_norm'])}); "
                    "the bad update was not applied. Lower optim.lr or optim.clip_norm, or use model.dtype=float32"
                )
            now = time.time()
            n = step + 1 - step_last
            if n > 0:
                dt = (now - t_last) / n
                tokens_per_s = tc.global_batch * tc.seq_len / dt
                mfu = accounting.utilisation(model_flops, dt, peak)
                record = {
                    "step": step + 1,
                    "loss": loss,
                    "lr": float(m["lr"]),
                    "grad_norm": float(m["grad_norm"]),
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": dt,
                    "mfu": mfu,
                    "hfu": accounting.utilisation(hw_flops, dt, peak),
                }
                log.log(record, eta_s=dt * (tc.steps - step - 1))
                t_last, step_last = now, step + 1
        if tc.eval_every and ((step + 1) % tc.eval_every == 0 or last):
            val_loss = evaluate(eval_fn, state.params, val_loader, tc.eval_batches, bsharding)
            log.log({"step": step + 1, "val_loss": val_loss})
            log.print(f"step {step + 1}: validation loss {val_loss:.4f}")
            t_last = time.time()  # do not charge evaluation to training throughput
    result = RunResult(
        final_step=int(state.step),
        train_loss=loss,
        val_loss=val_loss,
        unigram_entropy=entropy,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        compile_s=compile_s,
        run_dir=run_dir,
    )
    log.print(
        f"done: {result.final_step} steps, train loss {loss:.4f}, val loss "
        f"{'-' if val_loss is None else f'{val_loss:.4f}'} (unigram entropy {entropy:.3f}), "
        f"{tokens_per_s:.0f} tok/s, MFU {100 * mfu:.1f}%, compile {compile_s:.1f}s -> {run_dir}"
    )
    return result
