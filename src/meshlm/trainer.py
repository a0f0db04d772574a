"""A training run from start to end: build the mesh, compile the step, report, prepare data,
restore or initialise the sharded state, run the step loop (`train_loop`), save, stop.

Everything numeric lives elsewhere (model, step, accounting); where the first state comes from is
`resume`; this file only wires the phases together, in order.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from meshlm import accounting, local_checkpoint
from meshlm.checkpoint import Checkpointer
from meshlm.config import RunConfig
from meshlm.data import mixture
from meshlm.data.loader import WindowLoader
from meshlm.data.prepare import fit_config_to_data, mixture_summary, prepare, prepare_mixture
from meshlm.insight.startup_report import format_report, startup_report
from meshlm.observe.metrics import MetricsLogger
from meshlm.observe.sinks import open_sinks
from meshlm.parallel.mesh import make_layout
from meshlm.platform import hardware, host_memory
from meshlm.resume import checkpoint_dir, copy_side_files, restore_or_init
from meshlm.step import abstract_batch, batch_sharding, make_eval_step, make_train_step
from meshlm.train_loop import (
    NonFiniteStep,
    Preempted,
    Profiler,
    StepLoop,
    StopFlag,
    TrainingError,
    write_json,
)
from meshlm.train_state import abstract_state, placement, setup
from meshlm.validation import validate
from meshlm.version import code_version

__all__ = ["NonFiniteStep", "Preempted", "RunResult", "TrainingError", "train"]


@dataclass
class RunResult:
    final_step: int
    train_loss: float | None  # None: no step logged (a run stopped before its first logged step)
    val_loss: float | None
    unigram_entropy: float
    tokens_per_s: float
    mfu: float
    compile_s: float
    run_dir: Path


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


@dataclass
class _Setup:
    """What the phases before the loop hand on: the layout, the compiled step and its report."""

    layout: object
    specs: dict
    tx: object
    shardings: object
    abstract: object
    step_fn: object
    compile_s: float
    report: dict
    peak: hardware.Peak
    run_info: dict


def _train(cfg, run_dir, log, dry_run, init_from, stop_after, stop) -> RunResult | None:
    first = jax.process_index() == 0  # writes the run's files; every process writes its checkpoint shards
    cfg = validate(fit_config_to_data(cfg, log.print))  # packed chat data: loss and document masks
    s = _compile(cfg, log)
    profiler = Profiler(cfg.train.profile_range(), cfg.train.steps, run_dir / "profile", log)
    if profiler.steps:
        log.print(f"profiling steps {profiler.first}..{profiler.last} (jax.profiler) into {profiler.directory}")
    if first:
        (run_dir / "config.json").write_text(cfg.to_json())
    if dry_run:
        if first:
            write_json(run_dir / "run.json", s.run_info)
        return None
    if first and cfg.checkpoint.local_every:
        local_checkpoint.run_id(run_dir, first)  # before the data barrier: the others read it after
    loaders, data = _data(cfg, s, log, run_dir, init_from, first)
    identity = {
        "code_version": code_version(),
        "config": cfg.to_dict(),
        "tokenizer_fingerprint": data.meta["tokenizer_fingerprint"],
        "data_fingerprint": data.meta["source_fingerprint"],
        "data_position": "batch n = f(train.seed, n): the step is the position",
    }
    ckpt = Checkpointer(checkpoint_dir(cfg, run_dir), cfg.checkpoint, log=log.print)
    local = _local_copies(cfg, run_dir, log)
    try:
        state = restore_or_init(cfg, ckpt, s.abstract, s.specs, s.layout, s.tx, identity, init_from, log, local)
        start = int(state.step)
        loop = _start_loop(cfg, s, log, run_dir, profiler, start, first)
        loop.local = local
        loop.resumed_from = "start" if not start else "memory" if local and local.restored else "disk"
        try:
            state, result = loop.run(state, start, *loaders, ckpt, identity, stop_after, stop)
        finally:
            profiler.stop()
        with loop.heartbeat.phase(result["final_step"]):
            ckpt.save(state, identity)  # the final state (a no-op if this step was just saved)
        with loop.heartbeat.phase(result["final_step"]):
            ckpt.wait()
    except NonFiniteStep:
        if local is not None:
            local.delete()  # an orderly end: the disk holds the last good state
        raise
    finally:
        if sys.exc_info()[0] is None:
            ckpt.close()
        else:  # a failed close must not hide the error on its way out
            with contextlib.suppress(Exception):
                ckpt.close()
    if local is not None:
        local.delete()  # done, stopped or preempted in order: the disk holds the state
    if loop.stopped_by is not None:
        raise Preempted(loop.stopped_by, int(state.step), ckpt.directory)
    entropy = data.meta["train_unigram_entropy"]
    result = RunResult(**result, unigram_entropy=entropy, compile_s=s.compile_s, run_dir=run_dir)
    _report_end(cfg, log, result, entropy)
    return result


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


def _hits_on_processes(mine: bool) -> int:
    """How many processes found the step in the persistent compilation cache."""
    if jax.process_count() == 1:
        return int(mine)
    from jax.experimental import multihost_utils

    return int(np.sum(multihost_utils.process_allgather(np.int32(mine))))


def _compile(cfg: RunConfig, log: MetricsLogger) -> _Setup:
    """The layout, the step compiled ahead of time from abstract shapes (the startup report reads
    the compiled program, and the loop runs this same executable), the peak and the report."""
    tc = cfg.train
    layout = make_layout(cfg.parallel)
    specs, tx, shardings = setup(cfg, layout)
    t0 = time.time()
    abstract = abstract_state(specs, layout, tx, **placement(cfg))
    with _cache_hits() as hits:
        step_fn = make_train_step(cfg, layout, tx, shardings).lower(abstract, abstract_batch(cfg, layout)).compile()
    compile_s = time.time() - t0
    hit, n = _hits_on_processes(bool(hits)), jax.process_count()
    compiled = f"train step compiled in {compile_s:.1f}s"
    if hit:
        where = "" if n == 1 else f" on {hit}/{n} processes"
        compiled += f" (persistent compilation cache hit{where})"
    peak = hardware.peak_flops(cfg.model.dtype, cfg.parallel.n_devices)
    log.peak_label = peak.label
    report = startup_report(cfg, layout, abstract, shardings, step_fn, peak.flops)
    log.print(
        f"meshlm {code_version()} | {cfg.model.family} | {tc.global_batch}x{tc.seq_len} tokens/step | "
        f"peak: {peak.source} | {compiled}"
    )
    for line in format_report(report):
        log.print(line)
    run_info = {
        "code_version": code_version(),
        "jax_version": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "mesh": dict(layout.mesh.shape),
        "params": accounting.param_count(cfg.model),
        "active_params": accounting.active_param_count(cfg.model),
        "model_flops_per_step": report["model_flops_per_step"],  # MFU's: causal attention's masked half not counted
        "eq7_flops_per_step": report["eq7_flops_per_step"],
        "mfu_convention": "causal",
        "hardware_flops_per_step": report["hardware_flops_per_step"],
        "peak_flops_per_s": peak.flops,
        "peak_source": peak.source,
        "compile_s": compile_s,
        "compile_cache_hit": hit == n,  # on every process
        "startup_report": report,
        "processes": jax.process_count(),
    }
    return _Setup(layout, specs, tx, shardings, abstract, step_fn, compile_s, report, peak, run_info)


def _local_copies(cfg: RunConfig, run_dir: Path, log: MetricsLogger) -> local_checkpoint.LocalCheckpoints | None:
    """This run's in-memory checkpoints (checkpoint.local_every > 0), in its store on this host."""
    c = cfg.checkpoint
    if not c.local_every:
        return None
    root = Path(c.local_dir).expanduser() if c.local_dir else local_checkpoint.default_root()
    directory = local_checkpoint.store_dir(root, run_dir, local_checkpoint.run_id(run_dir, False))
    peer = ", a copy on a peer process" if jax.process_count() > 1 else ""
    log.print(f"in-memory checkpoints every {c.local_every} step(s) in {directory}{peer}")
    return local_checkpoint.LocalCheckpoints(directory, c.local_every, log=log.print)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _data(cfg: RunConfig, s: _Setup, log: MetricsLogger, run_dir: Path, init_from, first: bool):
    """The train and validation loaders, and the prepared dataset. Process 0 prepares (or finds)
    the data first; the others then find it in the shared cache."""
    tc, layout = cfg.train, s.layout
    if not first:
        _barrier("meshlm-data")
    if cfg.data.mixture:
        sources = prepare_mixture(cfg.data, cfg.model.vocab_size, log=log.print)
    else:
        sources = [prepare(cfg.data, cfg.model.vocab_size, log=log.print)]
    if first:
        _barrier("meshlm-data")
    eot = sources[0].meta["eot_id"] if cfg.data.document_mask else None
    order = layout.context_order if layout.context_size > 1 else None
    if cfg.data.mixture:
        train_loader, val_loader = mixture.loaders(cfg, sources, eot, order)
        data = mixture_summary(sources, train_loader.weights, train_loader.names)
        log.print(mixture.describe(train_loader, sources))
    else:
        data = sources[0]
        b, seed = tc.global_batch, tc.seed
        flags = (lambda split: data.flags(split)) if data.packed else (lambda split: None)
        train_loader = WindowLoader(data.shards("train"), tc.seq_len, b, seed, "train", eot, order, flags("train"))
        val_loader = WindowLoader(data.shards("val"), tc.seq_len, b, seed + 1, "validation", eot, order, flags("val"))
    entropy = data.meta["train_unigram_entropy"]  # counted once, when the data was prepared
    s.run_info |= {"data": {k: v for k, v in data.meta.items() if k != "splits"}, "unigram_entropy": entropy}
    s.run_info["data_root"] = str(data.root.absolute())
    if first:
        write_json(run_dir / "run.json", s.run_info)
        copy_side_files(init_from, run_dir)
        # The run's tokenizer travels with it: generate, eval and convert --to-hf read it here.
        if data.tokenizer_path.is_file() and data.tokenizer_path.absolute() != (run_dir / "tokenizer.json").absolute():
            shutil.copyfile(data.tokenizer_path, run_dir / "tokenizer.json")
    mean = " (the sources' weighted mean)" if cfg.data.mixture else ""
    log.print(f"data: {data.meta['train_tokens']:,} training tokens, unigram entropy {entropy:.3f} nats{mean}")
    return (train_loader, val_loader), data


def _attach_sinks(log: MetricsLogger, cfg: RunConfig, run_dir: Path, start: int, report: dict) -> None:
    """TensorBoard / W&B from `start` on, with the startup report as text and its memory as charts."""
    log.attach(open_sinks(cfg.metrics, run_dir, start, cfg.to_dict(), quiet=not log.show, log=log.print))
    log.text(start, "startup_report", "```\n" + "\n".join(format_report(report)) + "\n```")
    slug = lambda k: re.sub(r"[^a-z0-9]+", "_", k.lower()).strip("_")
    log.chart(start, {f"memory/{slug(k)}_bytes": v for k, v in report["predicted_device_bytes"].items()})


def _start_loop(cfg, s: _Setup, log, run_dir: Path, profiler: Profiler, start: int, first: bool) -> StepLoop:
    """What the loop needs once the state is there: sinks from `start` on, the eval step, the host
    allocator's setting (judged with state and data loaded), run.json complete."""
    if start or log.had_records:
        log.resume_at(start)
    if first:
        _attach_sinks(log, cfg, run_dir, start, s.report)
    eval_fn = make_eval_step(cfg, s.layout, s.shardings.params)
    analysis = s.step_fn.memory_analysis()  # host memory reuse (CPU)
    # every local device's step holds its own temporary buffer
    temp = None if analysis is None else int(analysis.temp_size_in_bytes) * jax.local_device_count()
    allocator = host_memory.keep_freed(temp)
    log.print(f"host allocator reuse (meshlm.platform.host_memory): {allocator}")
    s.run_info["host_allocator"] = allocator
    if first:
        write_json(run_dir / "run.json", s.run_info)
    bsharding = batch_sharding(s.layout)
    return StepLoop(cfg, log, s.step_fn, eval_fn, bsharding, s.report, s.peak, profiler, run_dir)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _report_end(cfg: RunConfig, log: MetricsLogger, result: RunResult, entropy: float) -> None:
    steps = cfg.train.steps
    log.print(
        ("done: " if result.final_step >= steps else f"stopped (checkpointed; rerun to resume to {steps}): ")
        + f"{result.final_step} steps, train loss {_loss(result.train_loss)}, val loss {_loss(result.val_loss)} "
        f"(unigram entropy {entropy:.3f}), "
        f"{result.tokens_per_s:.0f} tok/s, MFU {100 * result.mfu:.1f}%, compile {result.compile_s:.1f}s -> "
        f"{result.run_dir}"
    )
