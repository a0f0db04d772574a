"""The step loop and what interrupts it: logging, evaluation and checkpoint cadence, the host's
sync points, non-finite steps, SIGTERM/SIGINT, the supervisor's heartbeat and the profiler.

`trainer.train` builds everything this loop needs; the loop only runs steps and decides when to
look at them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshlm import accounting
from meshlm.data.loader import WindowLoader, process_batch
from meshlm.platform import hardware, host_memory

_clock = time.perf_counter  # the training loop's rate clock (monotonic; tests replace it)


def write_json(path: Path, data: dict) -> None:
    """Write a JSON file under a temporary name and rename it: a kill mid-write never leaves half
    a file (run.json is rewritten during a run)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def moe_record(m: dict) -> dict:
    """The MoE part of a logged step's record: the router losses (before their coefficients), the
    fraction of routed assignments dropped by capacity, every layer's load per expert (fractions of
    the layer's assignments; 1/E each when balanced) and the largest load x E over all layers (1:
    perfectly balanced; E: one expert takes everything)."""
    load = np.asarray(m["expert_load"], dtype=np.float64)
    return {
        "moe_aux_loss": float(m["moe_aux_loss"]),
        "moe_seq_aux_loss": float(m["moe_seq_aux_loss"]),
        "moe_z_loss": float(m["moe_z_loss"]),
        "dropped_fraction": float(m["dropped_fraction"]),
        "expert_load_max": float(load.max() * load.shape[-1]),
        "expert_load": [[round(float(v), 6) for v in row] for row in load],
    }


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
    $MESHLM_HEARTBEAT gets "step time pid", at most every 0.1 s after steps (the launcher reads the
    step a failed group had reached from it); forced around the
    phases that are not steps (evaluation, checkpoint saves, the end of the run), so that a
    supervisor's --hang-timeout bounds each phase alone."""

    def __init__(self, path: str | None):
        self.path, self.last = path, 0.0

    def beat(self, step: int, force: bool = False) -> None:
        now = time.time()
        if self.path and (force or now - self.last >= 0.1):
            Path(self.path).write_text(f"{step} {now:.3f} {os.getpid()}\n")
            self.last = now

    @contextlib.contextmanager
    def phase(self, step: int):
        """A phase that is not a step (evaluation, a checkpoint save or commit): forced beats on
        each side, so that a supervisor's --hang-timeout bounds it alone."""
        self.beat(step, force=True)
        yield
        self.beat(step, force=True)


def _any_process(flag: int | None) -> int | None:
    """The largest signal number any process received. All processes must stop after the same
    step (the next collective would hang otherwise); a host all-gather waits for the step in
    flight, so multi-process runs only agree at logging steps, where the loop syncs anyway."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(np.int32(flag or 0))
    return int(np.max(got)) or None


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


def evaluate(eval_fn, params, loader: WindowLoader, n_batches: int, sharding) -> float:
    total, count = 0.0, 0.0
    for i in range(min(n_batches, max(1, loader.n_windows // loader.global_batch))):
        loss_sum, c = eval_fn(params, process_batch(loader, i, sharding))
        total, count = total + float(loss_sum), count + float(c)
    return total / count if count else float("nan")  # a packed split whose rows train no token


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


class StepLoop:
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
        self.loss, self.val_loss = None, None  # the latest logged loss and validation loss (None: none logged)
        self.tokens_per_s = self.mfu = 0.0  # the latest logged rate
        self.t_last: float | None = None  # start of the rate window (after the step that ended it)
        self.step_last = 0
        self.paused_s = 0.0  # the length of the latest pause (evaluation or checkpoint save)
        self.local = None  # in-memory checkpoints (local_checkpoint.LocalCheckpoints), when on
        self.resumed_from = "start"  # where the first state came from: start, disk or memory

    def run(self, state, start, train_loader, val_loader, ckpt, identity, stop_after, stop):
        tc, every = self.cfg.train, self.cfg.checkpoint.every
        end = tc.steps if stop_after is None else min(tc.steps, stop_after)
        self.t_last, self.step_last = None, start
        self.source_tokens = train_loader.source_tokens  # data.mixture: tokens per source so far
        pending: list[tuple[int, dict]] = []  # (step, metrics) the host has not read yet
        limit = host_memory.steps_in_flight()
        for step in range(start, end):
            n = step + 1  # the step number the progress line shows
            batch = process_batch(train_loader, step, self.bsharding)  # overlaps the steps still running
            wait_for_room(pending, limit)
            self.profiler.before(n, state)
            with self.profiler.annotate(n):
                state, metrics = self.step_fn(state, batch)
            self.profiler.after(n, metrics)
            pending.append((n, metrics))
            last = n == tc.steps
            if step == start:  # warm-up: throughput is measured from the end of the first step
                jax.block_until_ready(metrics)
                self.t_last, self.step_last = _clock(), n
                self._report_recovery(n, start)
            logged = n % tc.log_every == 0 or last
            evaluated = tc.eval_every and (n % tc.eval_every == 0 or last)
            saving = every and n % every == 0 and not last
            copying = self.local is not None and self.local.due(n) and not last
            if logged or evaluated or saving or copying or n == end:  # sync points: read every pending step
                m = self._settle(state, pending, ckpt, identity)
                pending = []
            if logged:
                self._log(n, m)
            # Evaluation and checkpoint saves are not training time: the rate window keeps the steps
            # it already ran and moves its start forward by the pause (the pending steps were read
            # at the sync point above, so the pause holds no training).
            if evaluated:
                with self._pause(n):
                    self.val_loss = evaluate(self.eval_fn, state.params, val_loader, tc.eval_batches, self.bsharding)
                self.log.log({"step": n, "val_loss": self.val_loss})
                self.log.print(f"step {n}: validation loss {self.val_loss:.4f}")
            if saving:
                with self._pause(n):
                    ckpt.save(state, identity)  # returns once the arrays are off the devices
                self.log.log({"step": n, "checkpoint_save_s": self.paused_s})
            if copying:  # in-memory copies count as training time: their cost shows in the rate
                with self.heartbeat.phase(n):
                    self.local.save(state, identity)
            self.heartbeat.beat(n, force=step == start)
            if jax.process_count() == 1 or logged:
                self.stopped_by = _any_process(stop.signum)
            if self.stopped_by is not None:
                self._settle(state, pending, ckpt, identity)  # never checkpoint a halted run as preempted
                self.log.print(f"{signal.Signals(self.stopped_by).name} at step {n}: saving a checkpoint")
                break
        result = {
            "final_step": int(state.step),
            "train_loss": self.loss,
            "val_loss": self.val_loss,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
        }
        return state, result

    def _report_recovery(self, n: int, start: int) -> None:
        """After the first step of a group that `meshlm launch` (or SLURM) restarted ($MESHLM_FAULT: when it
        saw the failure and the step the group had reached): the steps lost and the time from the
        failure to this step, in metrics.jsonl (an "event": "recovered" record) and on the console."""
        fault = os.environ.get("MESHLM_FAULT", "").split()
        if len(fault) != 2:
            return
        took, lost = time.time() - float(fault[0]), max(0, int(fault[1]) - start)
        source = {"memory": "the in-memory copies", "disk": "the disk checkpoint"}.get(self.resumed_from, "step 0")
        self.log.log(
            {
                "event": "recovered",
                "step": n,
                "resumed_at": start,
                "source": self.resumed_from,
                "lost_steps": lost,
                "recovery_s": round(took, 3),
            }
        )
        self.log.print(
            f"recovered {took:.1f}s after the failure: resumed at step {start} from {source}; {lost} step(s) lost"
        )

    def _log(self, n: int, m: dict) -> None:
        """The record of logged step n (its metrics `m`), with the rate over the steps since the last."""
        tc = self.cfg.train
        self.loss = float(m["loss"])
        record = {"step": n, "loss": self.loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"])}
        if not m["applied"]:  # a skipped step (on_nonfinite=skip): NaN and inf are not JSON
            record |= {"loss": None, "grad_norm": None}
        record["skipped"] = int(m["skipped"])  # non-finite steps skipped so far (on_nonfinite=skip)
        if "expert_load" in m:  # MoE: router losses, drops and each layer's load per expert
            record |= moe_record(m)
            if self.cfg.model.dense_layer_ids or self.cfg.model.mtp_depth:  # their layer ids, when not 0..L-1
                record["moe_layers"] = list(self.cfg.model.moe_stat_layer_ids)
        if "mtp_loss" in m:  # each multi-token-prediction module's loss (model.mtp_depth)
            record |= {f"mtp_loss_{k + 1}": float(v) for k, v in enumerate(np.asarray(m["mtp_loss"]))}
        record |= self.source_tokens(n)
        now, steps = _clock(), n - self.step_last
        eta = None
        if steps > 0:  # the first step of an attempt compiles and warms up: no rate for it
            dt = (now - self.t_last) / steps
            self.tokens_per_s = tc.global_batch * tc.seq_len / dt
            self._check_peak(self.model_flops / dt)
            self.mfu = accounting.utilisation(self.model_flops, dt, self.peak.flops)
            hfu = accounting.utilisation(self.hw_flops, dt, self.peak.flops)
            record |= {"tokens_per_s": self.tokens_per_s, "step_time_s": dt, "mfu": self.mfu, "hfu": hfu}
            self.t_last, self.step_last = now, n
            eta = dt * (tc.steps - n)
        self.log.log(record, eta_s=eta)

    @contextlib.contextmanager
    def _pause(self, n: int):
        """A phase that is not training (evaluation, a checkpoint save): heartbeats on each side, and
        the rate window's start moved forward by its length (`paused_s`)."""
        t0 = _clock()
        with self.heartbeat.phase(n):
            yield
        self.paused_s = _clock() - t0
        self.t_last += self.paused_s

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
        write_json(path, info)

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
