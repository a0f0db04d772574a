"""The training loop: prepare data, build the mesh, restore or init the sharded state, step, log,
evaluate, checkpoint, stop.

Everything numeric lives elsewhere (model, step, accounting); this file only wires it together.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshlm import __version__, accounting
from meshlm.checkpoint import Checkpointer, resolve_checkpoint
from meshlm.config import ConfigError, RunConfig, validate
from meshlm.data import tokenizer as toks
from meshlm.data.loader import WindowLoader, process_batch
from meshlm.data.prepare import prepare
from meshlm.insight.startup_report import format_report, startup_report
from meshlm.interop import hf
from meshlm.observe.metrics import MetricsLogger
from meshlm.observe.sinks import open_sinks
from meshlm.parallel.mesh import make_layout
from meshlm.platform import hardware, host_memory
from meshlm.step import abstract_batch, batch_sharding, make_eval_step, make_train_step
from meshlm.train_state import TrainState, abstract_state, init_state, setup

_clock = time.perf_counter  # the training loop's rate clock (monotonic; tests replace it)


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); the message says where and why."""


class NonFiniteStep(TrainingError):
    """A non-finite loss or gradient stopped training (`train.on_nonfinite`); the last good state
    was checkpointed. Deterministic: resuming unchanged would stop at the same step again."""


class Preempted(RuntimeError):
    """SIGTERM/SIGINT arrived; the state was checkpointed at `step` before stopping."""

    def __init__(self, signum: int, step: int, directory: Path):
        self.signum, self.step, self.directory = signum, step, directory
        name = signal.Signals(signum).name
        super().__init__(f"{name}: saved a checkpoint at step {step} in {directory}; rerun the same command to resume")


class Heartbeat:
    """Tells a supervisor (`meshlm launch`) that this process makes progress: the file named by
    $MESHLM_HEARTBEAT gets "step time pid", at most once a second after steps; forced around the
    phases that are not steps (evaluation, checkpoint saves, the end of the run), so that a
    supervisor's --hang-timeout bounds each phase alone."""

    def __init__(self, path: str | None):
        self.path, self.last = path, 0.0

    def beat(self, step: int, force: bool = False) -> None:
        now = time.time()
        if self.path and (force or now - self.last >= 1.0):
            Path(self.path).write_text(f"{step} {now:.3f} {os.getpid()}\n")
            self.last = now

    @contextlib.contextmanager
    def phase(self, step: int):
        """A phase that is not a step (evaluation, a checkpoint save or commit): forced beats on
        each side, so that a supervisor's --hang-timeout bounds it alone."""
        self.beat(step, force=True)
        yield
        self.beat(step, force=True)


@contextlib.contextmanager
def _cache_hits():
    """Collects JAX's persistent-compilation-cache hit events raised inside the block."""
    hits: list[str] = []

    def listen(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(listen)


def _any_process(flag: int | None) -> int | None:
    """The largest signal number any process received. All processes must stop after the same
    step (the next collective would hang otherwise); a host all-gather waits for the step in
    flight, so multi-process runs only agree at logging steps, where the loop syncs anyway."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(np.int32(flag or 0))
    return int(np.max(got)) or None


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class StopFlag:
    """Set by SIGTERM/SIGINT while training (a second SIGINT interrupts at once)."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


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


@functools.cache
def code_version() -> str:
    """meshlm's version plus the git commit of its source tree, if it is a checkout (one git call
    per process)."""
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


def evaluate(eval_fn, params, loader: WindowLoader, n_batches: int, sharding) -> float:
    total, count = 0.0, 0.0
    for i in range(min(n_batches, max(1, loader.n_windows // loader.global_batch))):
        loss_sum, c = eval_fn(params, process_batch(loader, i, sharding))
        total, count = total + float(loss_sum), count + float(c)
    return total / count


def train(
    cfg: RunConfig,
    run_dir: Path,
    *,
    quiet: bool = False,
    dry_run: bool = False,
    init_from: str | None = None,
    stop_after: int | None = None,
    log_format: str = "text",
) -> RunResult | None:
    """Train `cfg`, writing into `run_dir`, resuming from its latest good checkpoint if any.

    `init_from`: start a new run from the parameters of another run (a run directory, its
    checkpoints directory or one step directory). `stop_after`: checkpoint and return after this
    step (a run split into time slots). With `dry_run`, stop after the startup report (the layout is
    built and the step compiled, but no data is prepared and no parameter allocated).
    SIGTERM/SIGINT: checkpoint, then raise `Preempted`. `quiet`: print nothing; `log_format="json"`:
    one JSON object per logged step on stdout, every other message on stderr.
    """
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Only process 0 writes metrics and prints; every process writes its own checkpoint shards.
    log = MetricsLogger(run_dir, cfg.train.steps, write=jax.process_index() == 0, show=not quiet, log_format=log_format)
    failed = True
    try:
        with StopFlag() as stop:
            result = _train(cfg, run_dir, log, dry_run, init_from, stop_after, stop)
        failed = False
        return result
    finally:
        log.close(failed)


def _attach_sinks(log: MetricsLogger, cfg: RunConfig, run_dir: Path, start: int, report: dict) -> None:
    """TensorBoard / W&B from `start` on, with the startup report as text and its memory as charts."""
    log.attach(open_sinks(cfg.metrics, run_dir, start, cfg.to_dict(), quiet=not log.show, log=log.print))
    log.text(start, "startup_report", "```\n" + "\n".join(format_report(report)) + "\n```")
    slug = lambda k: re.sub(r"[^a-z0-9]+", "_", k.lower()).strip("_")
    log.chart(start, {f"memory/{slug(k)}_bytes": v for k, v in report["predicted_device_bytes"].items()})


def checkpoint_dir(cfg: RunConfig, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else run_dir / "checkpoints"


def _config_changes(saved: dict, cfg: RunConfig) -> list[str]:
    now = json.loads(cfg.to_json())
    return [
        f"{section}.{k}: {saved.get(section, {}).get(k)!r} -> {v!r}"
        for section, values in now.items()
        for k, v in values.items()
        if saved.get(section, {}).get(k, v) != v
    ]


def _check_tokenizer(meta: dict, identity: dict, where: str) -> None:
    saved, now = meta.get("tokenizer_fingerprint"), identity["tokenizer_fingerprint"]
    if saved and saved != now:
        raise ConfigError(
            f"{where} was trained with tokenizer {saved}, but this run's data uses tokenizer {now}: token ids "
            "would mean different things. Use the same tokenizer (data.tokenizer) or a new run"
        )


def _copy_side_files(init_from: str | None, run_dir: Path) -> None:
    """A run started from a Hugging Face model (directly or via `convert`) keeps that model's
    tokenizer_config, generation config (stop ids) and chat template, for generate and export."""
    if not init_from:
        return
    root = hf.hf_path(init_from) if hf.is_hf_ref(init_from) else resolve_checkpoint(init_from)[0].parent
    for name in hf.SIDE_FILES:
        if (root / name).is_file() and not (run_dir / name).exists():
            shutil.copyfile(root / name, run_dir / name)


def _restore_or_init(cfg, ckpt, abstract, specs, layout, tx, identity, init_from, log) -> TrainState:
    """Resume from the run's own latest good checkpoint, else `init_from`'s weights, else fresh."""
    if cfg.checkpoint.resume:
        had = ckpt.steps()
        restored = ckpt.restore_latest(abstract)
        if restored is not None:
            meta = restored.meta
            _check_tokenizer(meta, identity, f"checkpoint {ckpt.directory}/{meta['step']}")
            log.print(f"resumed from {ckpt.directory}/{meta['step']} (saved by meshlm {meta['code_version']})")
            changes = _config_changes(meta.get("config", {}), cfg)
            if changes:
                log.print("  config differs from the checkpoint's: " + "; ".join(changes))
            if meta.get("data_fingerprint") != identity["data_fingerprint"]:
                log.print("  warning: the training data differs from the checkpoint's; batches will not repeat")
            return restored.state
        if had:
            raise TrainingError(
                f"no readable checkpoint left in {ckpt.directory} (steps {had} were moved to "
                f"{ckpt.directory}.corrupt); to start over, use a new run dir or --set checkpoint.resume=false"
            )
    elif ckpt.steps():  # starting over must not mix with (or silently skip saving over) another run's steps
        raise ConfigError(
            f"checkpoint.resume=false but {ckpt.directory} holds checkpoints {ckpt.steps()} of an earlier run; "
            "use a new run dir or --set checkpoint.dir=..."
        )
    state = init_state(specs, layout, tx, cfg.train.seed)
    if init_from and hf.is_hf_ref(init_from):
        root = hf.hf_path(init_from)
        shardings = jax.tree.map(lambda a: a.sharding, abstract.params)
        state = state._replace(params=hf.load_params(root, cfg.model, shardings))
        if (root / "tokenizer.json").is_file():
            meta = {"tokenizer_fingerprint": toks.fingerprint(toks.load(root / "tokenizer.json"))}
            _check_tokenizer(meta, identity, f"--init-from {init_from}")
        else:
            log.print(f"  warning: {root} has no tokenizer.json; make sure data.tokenizer is the model's tokenizer")
        log.print(f"initialised parameters from Hugging Face {root} (optimizer state and step are fresh)")
    elif init_from:
        directory, step = resolve_checkpoint(init_from)
        source = Checkpointer(directory, cfg.checkpoint, log=log.print, read_only=True)
        params, meta = source.restore_params(abstract.params, step)
        _check_tokenizer(meta, identity, f"--init-from {directory}/{meta['step']}")
        state = state._replace(params=params)
        log.print(f"initialised parameters from {directory}/{meta['step']} (optimizer state and step are fresh)")
    return state


def _train(cfg, run_dir, log, dry_run, init_from, stop_after, stop) -> RunResult | None:
    tc = cfg.train
    layout = make_layout(cfg.parallel)
    specs, tx, shardings = setup(cfg, layout)
    bsharding = batch_sharding(layout)

    # Compile ahead of time from abstract shapes: the startup report reads the compiled program,
    # and the loop runs this same executable.
    t0 = time.time()
    abstract = abstract_state(specs, layout, tx)
    with _cache_hits() as hits:
        step_fn = make_train_step(cfg, layout, tx, shardings).lower(abstract, abstract_batch(cfg, layout)).compile()
    compile_s = time.time() - t0
    compiled = f"train step compiled in {compile_s:.1f}s" + (" (persistent compilation cache hit)" if hits else "")
    run_peak = hardware.peak_flops(cfg.model.dtype, cfg.parallel.n_devices)
    peak, peak_source = run_peak.flops, run_peak.source
    log.peak_label = run_peak.label
    report = startup_report(cfg, layout, abstract, shardings, step_fn, peak)
    log.print(
        f"meshlm {code_version()} | {cfg.model.family} | {tc.global_batch}x{tc.seq_len} tokens/step | "
        f"peak: {peak_source} | {compiled}"
    )
    for line in format_report(report):
        log.print(line)
    profiler = Profiler(tc.profile_range(), tc.steps, run_dir / "profile", log)
    if profiler.steps:
        log.print(f"profiling steps {profiler.first}..{profiler.last} (jax.profiler) into {profiler.directory}")
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
        "compile_s": compile_s,
        "compile_cache_hit": bool(hits),
        "startup_report": report,
    }
    first = jax.process_index() == 0  # writes the run's files; every process writes its checkpoint shards
    run_info["processes"] = jax.process_count()
    if first:
        (run_dir / "config.json").write_text(cfg.to_json())
    if dry_run:
        if first:
            (run_dir / "run.json").write_text(json.dumps(run_info, indent=2))
        return None

    # Process 0 prepares (or finds) the data first; the others then find it in the shared cache.
    if not first:
        _barrier("meshlm-data")
    data = prepare(cfg.data, cfg.model.vocab_size, log=log.print)
    if first:
        _barrier("meshlm-data")
    eot = data.meta["eot_id"] if cfg.data.document_mask else None
    order = layout.context_order if layout.context_size > 1 else None
    train_loader = WindowLoader(data.shards("train"), tc.seq_len, tc.global_batch, tc.seed, "train", eot, order)
    val_loader = WindowLoader(data.shards("val"), tc.seq_len, tc.global_batch, tc.seed + 1, "validation", eot, order)
    entropy = data.meta["train_unigram_entropy"]  # counted once, when the data was prepared
    run_info |= {"data": {k: v for k, v in data.meta.items() if k != "splits"}, "unigram_entropy": entropy}
    run_info["data_root"] = str(data.root.absolute())
    if first:
        (run_dir / "run.json").write_text(json.dumps(run_info, indent=2))
        _copy_side_files(init_from, run_dir)
        # The run's tokenizer travels with it: generate, eval and convert --to-hf read it here.
        if data.tokenizer_path.is_file() and data.tokenizer_path.absolute() != (run_dir / "tokenizer.json").absolute():
            shutil.copyfile(data.tokenizer_path, run_dir / "tokenizer.json")
    log.print(f"data: {data.meta['train_tokens']:,} training tokens, unigram entropy {entropy:.3f} nats")

    identity = {
        "code_version": code_version(),
        "config": cfg.to_dict(),
        "tokenizer_fingerprint": data.meta["tokenizer_fingerprint"],
        "data_fingerprint": data.meta["source_fingerprint"],
        "data_position": "batch n = f(train.seed, n): the step is the position",
    }
    ckpt = Checkpointer(checkpoint_dir(cfg, run_dir), cfg.checkpoint, log=log.print)
    try:
        state = _restore_or_init(cfg, ckpt, abstract, specs, layout, tx, identity, init_from, log)
        start = int(state.step)
        if start or log.had_records:
            log.resume_at(start)
        if first:
            _attach_sinks(log, cfg, run_dir, start, report)
        eval_fn = make_eval_step(cfg, layout, shardings.params)
        analysis = step_fn.memory_analysis()  # host memory reuse (CPU), judged with state and data loaded
        allocator = host_memory.keep_freed(None if analysis is None else int(analysis.temp_size_in_bytes))
        log.print(f"host allocator reuse (meshlm.platform.host_memory): {allocator}")
        run_info["host_allocator"] = allocator
        if first:
            tmp = run_dir / "run.json.tmp"
            tmp.write_text(json.dumps(run_info, indent=2))
            os.replace(tmp, run_dir / "run.json")  # a kill mid-write never leaves half a run.json
        loop = _Loop(cfg, log, step_fn, eval_fn, bsharding, report, run_peak, profiler, run_dir)
        try:
            state, result = loop.run(state, start, train_loader, val_loader, ckpt, identity, stop_after, stop)
        finally:
            profiler.stop()
        with loop.heartbeat.phase(result["final_step"]):
            ckpt.save(state, identity)  # the final state (a no-op if this step was just saved)
        with loop.heartbeat.phase(result["final_step"]):
            ckpt.wait()
    finally:
        ckpt.close()
    if loop.stopped_by is not None:
        raise Preempted(loop.stopped_by, int(state.step), ckpt.directory)
    result = RunResult(**result, unigram_entropy=entropy, compile_s=compile_s, run_dir=run_dir)
    finished = result.final_step >= tc.steps
    log.print(
        ("done: " if finished else f"stopped (checkpointed; rerun to resume to {tc.steps}): ")
        + f"{result.final_step} steps, train loss {result.train_loss:.4f}, val loss "
        f"{'-' if result.val_loss is None else f'{result.val_loss:.4f}'} (unigram entropy {entropy:.3f}), "
        f"{result.tokens_per_s:.0f} tok/s, MFU {100 * result.mfu:.1f}%, compile {compile_s:.1f}s -> {run_dir}"
    )
    return result


def wait_for_room(pending: list[tuple[int, Any]], limit: int | None) -> None:
    """Block until fewer than `limit` of the dispatched steps (`pending`: (step, metrics), oldest
    first) are still running, so that dispatching one more keeps at most `limit` in flight (no limit
    if None). Every step in flight holds its own temporary buffer; see `host_memory.steps_in_flight`."""
    if limit is not None and len(pending) >= limit:
        jax.block_until_ready(pending[-limit][1])


class Profiler:
    """A `jax.profiler` trace of steps [first, end) (clipped to the run's steps) into `directory`
    (per process in a multi-process run), readable in TensorBoard's profile plugin and Perfetto.
    Each step is marked with a StepTraceAnnotation; the trace starts once the step before has
    finished and stops once the last traced step has, so it holds exactly those steps. A run
    resumed inside the range traces the rest of it."""

    def __init__(self, steps: tuple[int, int] | None, total: int, directory: Path, log):
        self.steps, self.log, self.active, self.traced = steps, log, False, []
        if steps:
            self.first, self.last = steps[0], min(steps[1] - 1, total)
        self.directory = directory / f"process-{jax.process_index()}" if jax.process_count() > 1 else directory

    def before(self, n: int, state) -> None:
        """Before dispatching step n (state: the previous step's output)."""
        if self.steps and self.first <= n <= self.last and not self.active and not self.traced:
            jax.block_until_ready(state)  # the previous step's work stays out of the trace
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def annotate(self, n: int):
        if not self.active:
            return contextlib.nullcontext()
        self.traced.append(n)
        return jax.profiler.StepTraceAnnotation("train", step_num=n)

    def after(self, n: int, outputs) -> None:
        if self.active and n == self.last:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            what = f"steps {self.traced[0]}..{self.traced[-1]}" if self.traced else "no step"
            self.log.print(f"profile of {what} written to {self.directory}")


class _Loop:
    """The step loop with its logging, evaluation and checkpoint cadence.

    The host reads the device only at sync points (logging, evaluation, checkpoint, the end); in
    between it keeps each step's small metrics on the device, so at a sync point it learns about
    every step since the last one - which were skipped as non-finite, and whether one halted the
    run (`step.make_train_step` explains the contract) - without a per-step sync.
    """

    def __init__(
        self, cfg, log, step_fn, eval_fn, bsharding, report, peak: hardware.Peak, profiler: Profiler, run_dir: Path
    ):
        self.run_dir = run_dir
        self.cfg, self.log, self.step_fn, self.eval_fn, self.bsharding = cfg, log, step_fn, eval_fn, bsharding
        self.model_flops, self.hw_flops = report["model_flops_per_step"], report["hardware_flops_per_step"]
        self.peak = peak
        self.heartbeat = Heartbeat(os.environ.get("MESHLM_HEARTBEAT"))  # no beat before the first step ends
        self.stopped_by: int | None = None
        self.profiler = profiler

    def run(self, state, start, train_loader, val_loader, ckpt, identity, stop_after, stop):
        tc, every = self.cfg.train, self.cfg.checkpoint.every
        end = tc.steps if stop_after is None else min(tc.steps, stop_after)
        t_last, step_last = None, start
        tokens_per_s = mfu = 0.0
        loss = float("nan")
        val_loss = None
        pending: list[tuple[int, dict]] = []  # (step, metrics) the host has not read yet
        limit = host_memory.steps_in_flight()
        for step in range(start, end):
            batch = process_batch(train_loader, step, self.bsharding)  # overlaps the steps still running
            wait_for_room(pending, limit)
            self.profiler.before(step + 1, state)
            with self.profiler.annotate(step + 1):
                state, metrics = self.step_fn(state, batch)
            self.profiler.after(step + 1, metrics)
            pending.append((step + 1, metrics))
            last = step + 1 == tc.steps
            if step == start:  # warm-up: throughput is measured from the end of the first step
                jax.block_until_ready(metrics)
                t_last, step_last = _clock(), step + 1
            logged = (step + 1) % tc.log_every == 0 or last
            evaluated = tc.eval_every and ((step + 1) % tc.eval_every == 0 or last)
            saving = every and (step + 1) % every == 0 and not last
            if logged or evaluated or saving or step + 1 == end:  # sync points: read every pending step
                m = self._settle(state, pending, ckpt, identity)
                pending = []
            if logged:
                loss = float(m["loss"])
                record = {"step": step + 1, "loss": loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"])}
                if not m["applied"]:  # a skipped step (on_nonfinite=skip): NaN and inf are not JSON
                    record |= {"loss": None, "grad_norm": None}
                record["skipped"] = int(m["skipped"])  # non-finite steps skipped so far (on_nonfinite=skip)
                now = _clock()
                n = step + 1 - step_last
                if n > 0:  # the first step of an attempt compiles and warms up: no rate for it
                    dt = (now - t_last) / n
                    tokens_per_s = tc.global_batch * tc.seq_len / dt
                    self._check_peak(self.model_flops / dt)
                    mfu = accounting.utilisation(self.model_flops, dt, self.peak.flops)
                    hfu = accounting.utilisation(self.hw_flops, dt, self.peak.flops)
                    record |= {"tokens_per_s": tokens_per_s, "step_time_s": dt, "mfu": mfu, "hfu": hfu}
                    t_last, step_last = now, step + 1
                self.log.log(record, eta_s=dt * (tc.steps - step - 1) if n > 0 else None)
            # Evaluation and checkpoint saves are not training time: the rate window keeps the steps
            # it already ran and moves its start forward by the pause (the pending steps were read
            # at the sync point above, so the pause holds no training).
            if evaluated:
                t_eval = _clock()
                with self.heartbeat.phase(step + 1):
                    val_loss = evaluate(self.eval_fn, state.params, val_loader, tc.eval_batches, self.bsharding)
                self.log.log({"step": step + 1, "val_loss": val_loss})
                self.log.print(f"step {step + 1}: validation loss {val_loss:.4f}")
                t_last += _clock() - t_eval
            if saving:
                t_save = _clock()
                with self.heartbeat.phase(step + 1):
                    ckpt.save(state, identity)  # returns once the arrays are off the devices
                save_s = _clock() - t_save
                t_last += save_s
                self.log.log({"step": step + 1, "checkpoint_save_s": save_s})
            self.heartbeat.beat(step + 1, force=step == start)
            if jax.process_count() == 1 or logged:
                self.stopped_by = _any_process(stop.signum)
            if self.stopped_by is not None:
                self._settle(state, pending, ckpt, identity)  # never checkpoint a halted run as preempted
                self.log.print(f"{signal.Signals(self.stopped_by).name} at step {step + 1}: saving a checkpoint")
                break
        result = {
            "final_step": int(state.step),
            "train_loss": loss,
            "val_loss": val_loss,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
        }
        return state, result

    def _check_peak(self, flops_per_s: float) -> None:
        """A CPU peak below this run's model FLOP rate is wrong (`hardware.raise_cpu_peak`): quote
        utilisation against the rate from here, say so, and record it in run.json. Single-process
        runs only: the processes of a multi-process run may sit on several hosts."""
        if jax.process_count() > 1:
            return
        raised = hardware.raise_cpu_peak(self.peak, flops_per_s, self.cfg.model.dtype)
        if raised is self.peak:
            return
        self.log.print(
            f"warning: this run computes {flops_per_s / 1e9:.0f} GFLOP/s of model FLOPs, above the CPU peak "
            f"estimate ({self.peak.flops / 1e9:.0f} GFLOP/s; a matmul probe reads low on a busy host): MFU and "
            f"HFU are quoted against {raised.flops / 1e9:.0f} GFLOP/s from here, and later runs on this host "
            "start from it"
        )
        self.peak = raised
        path = self.run_dir / "run.json"
        info = json.loads(path.read_text()) | {"peak_flops_per_s": raised.flops, "peak_source": raised.source}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, path)  # a kill mid-write never leaves half a run.json

    def _settle(self, state, pending, ckpt, identity) -> dict | None:
        """Read the pending steps' metrics; report skipped steps; on a halted run, checkpoint its
        last good state and raise TrainingError naming the step. Returns the newest metrics."""
        if not pending:
            return None
        got = jax.device_get([m for _, m in pending])
        for n, m in zip([n for n, _ in pending], got, strict=True):
            if m["halted"]:
                self._halt(state, n, m, ckpt, identity)
            if not m["applied"]:
                self.log.print(
                    f"step {n}: non-finite loss ({float(m['loss'])}) or gradient norm ({float(m['grad_norm'])}); "
                    f"update skipped ({int(m['skipped'])} skipped so far)"
                )
                # str(): NaN and inf are not JSON; "loss" is left to the records of logged steps
                bad = {"bad_loss": str(float(m["loss"])), "bad_grad_norm": str(float(m["grad_norm"]))}
                self.log.log({"event": "skipped", "step": n, "skipped": int(m["skipped"])} | bad)
        return got[-1]

    def _halt(self, state, n: int, m: dict, ckpt, identity) -> None:
        # a slow save here must not look like a hang: a restart would halt again
        with self.heartbeat.phase(n - 1):
            ckpt.save(state, identity)  # the frozen state: exactly the state after step n - 1
        with self.heartbeat.phase(n - 1):
            ckpt.wait()
        tc = self.cfg.train
        where = f"the update was not applied; the state of step {n - 1} is checkpointed in {ckpt.directory}"
        values = f"loss={float(m['loss'])}, grad_norm={float(m['grad_norm'])}"
        if tc.on_nonfinite == "skip":
            k = tc.max_consecutive_skips
            raise NonFiniteStep(
                f"{k + 1} consecutive non-finite steps ({n - k}..{n}; train.max_consecutive_skips={k}); at step {n}: "
                f"{values}; {where}. Lower optim.lr or optim.clip_norm, or check the data at these steps"
            )
        raise NonFiniteStep(
            f"non-finite loss or gradient at step {n} ({values}); {where}. Lower optim.lr or "
            "optim.clip_norm, or use model.dtype=float32, then rerun to resume; or set train.on_nonfinite=skip"
        )
