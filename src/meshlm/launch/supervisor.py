"""`meshlm launch`: start the processes of one run, merge their logs, supervise, restart.

    meshlm launch --processes 2 --devices-per-process 4 -- train --mesh data=2,tensor=4 ...

starts N `meshlm train` processes that join one JAX distributed runtime (process 0 hosts the
coordinator on a free port), prefixes and merges their output (also kept in <run_dir>/launch.log),
and watches them. When one process dies, or stops making progress for `--hang-timeout` seconds
(each process touches a heartbeat file every step and around evaluations and checkpoint saves), the
launcher kills the whole group and starts it again; `meshlm train` resumes from the run's latest good checkpoint.
Until a process has finished its first step (compilation, data, restore) `--startup-timeout` applies
instead. After `--max-restarts` restarts it gives up and exits non-zero with a summary of every attempt.

Processes run on this machine (simulated CPU devices, the same code path as a cluster), or with
`--ray ADDRESS` one per node of an existing Ray cluster (`pip install 'meshlm[ray]'`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshlm.config import ConfigError, RunConfig
from meshlm.exits import FINAL_EXITS
from meshlm.launch import elastic
from meshlm.platform import xla_flags


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(train_args: list[str], devices: int | None, coordinator: str, n: int, i: int) -> list[str]:
    """`meshlm train` for process i; `devices` simulated CPU devices (None: the real ones)."""
    simulated = ["--devices", str(devices)] if devices else []
    return [
        sys.executable,
        "-m",
        "meshlm",
        *train_args,
        *simulated,
        "--coordinator",
        coordinator,
        "--num-processes",
        str(n),
        "--process-id",
        str(i),
    ]


def read_beat(beat: Path) -> tuple[int, float, int] | None:
    """A heartbeat file's (step, time, pid) as `train_loop.Heartbeat` writes them; None while it is
    absent or being rewritten."""
    with contextlib.suppress(OSError, ValueError):
        step, when, pid = beat.read_text().split()
        return int(step), float(when), int(pid)
    return None


def reached(beats: list[Path]) -> int:
    """The newest step any of these heartbeat files reported (0 before any)."""
    return max([0, *(b[0] for b in map(read_beat, beats) if b)])


def worker_vars(heartbeat: Path) -> dict[str, str]:
    """What a worker's environment adds to its host's."""
    return {"MESHLM_HEARTBEAT": str(heartbeat), "PYTHONUNBUFFERED": "1"}


def host_env(extra: dict[str, str]) -> dict[str, str]:
    """This host's environment for a worker, plus `extra`. The user's XLA_FLAGS reach the workers,
    without a simulated device count (each worker's --devices sets its own)."""
    env = dict(os.environ)
    if "XLA_FLAGS" in env:
        env["XLA_FLAGS"] = xla_flags.without_device_count(env["XLA_FLAGS"])
    return env | extra


class LocalWorker:
    """One `meshlm train` process on this machine, in its own session (so a kill reaches it all)."""

    def __init__(self, cmd: list[str], env: dict[str, str], on_line):
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, args=(on_line,), daemon=True)
        self.reader.start()

    def _read(self, on_line) -> None:
        for line in self.proc.stdout:
            on_line(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.reader.join(timeout=5)
        return rc


def describe_exit(rc: int) -> str:
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    if rc > 128 and rc - 128 in signal.Signals._value2member_map_:
        return f"stopped by {signal.Signals(rc - 128).name} (exit {rc})"
    return f"exited with code {rc}"


def describe_failures(failed: list[tuple[int, int]]) -> str:
    """Why a group ended, from its failed (process, exit code) pairs seen in one poll. A process that
    aborted (SIGABRT) is most often reacting to a lost peer (JAX's runtime aborts when one vanishes),
    so another failure seen in the same poll is named as the cause, the aborts after it."""
    aborted = (-signal.SIGABRT, 128 + signal.SIGABRT)
    first, *others = sorted(failed, key=lambda f: (f[1] in aborted, f[0]))
    also = "".join(f"; process {i} {describe_exit(rc)} too" for i, rc in others)
    return f"process {first[0]} {describe_exit(first[1])}{also}"


class PlacementFailed(Exception):
    """A restart of an elastic group whose processes could not be placed (a node that was counted is
    gone or full): a failed attempt, after which the group is resized."""


@dataclass
class Attempt:
    number: int
    outcome: str = "running"
    seconds: float = 0.0


@dataclass
class Supervisor:
    """Runs attempts of a group of workers until one succeeds or restarts run out."""

    train_args: list[str]
    processes: int
    devices_per_process: int | None
    run_dir: Path
    max_restarts: int = 3
    hang_timeout: float = 600.0
    startup_timeout: float = 900.0
    attempts: list[Attempt] = field(default_factory=list)
    stop_signal: int | None = None
    fault: str | None = None  # "time step": when the last failure was seen, the step the group had reached
    # elastic (`--min-processes`): shrink when lost processes are not replaced in time, regrow after
    min_processes: int | None = None
    replace_timeout: float = 300.0
    capacity_cmd: str | None = None  # prints how many processes can run now (None: always all of them)
    cfg: RunConfig | None = None  # the train command's config: the layout to shrink
    capacity_poll: float = 5.0  # seconds between capacity checks while the group runs shrunk

    def __post_init__(self):
        self.full = (self.processes, list(self.train_args))  # the group as asked for
        self.regrows = 0
        self.lock = threading.Lock()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.run_dir / "launch.log", "a")  # noqa: SIM115 (closed in run())

    def say(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def _heartbeats(self) -> list[Path]:
        d = self.run_dir / ".heartbeat"
        d.mkdir(exist_ok=True)
        return [d / f"process-{i}" for i in range(self.processes)]

    def _start(self, attempt: Attempt) -> list:
        coordinator = f"127.0.0.1:{free_port()}"
        beats = self._heartbeats()
        for b in beats:
            b.unlink(missing_ok=True)
        per = f" x {self.devices_per_process} devices" if self.devices_per_process else ""
        self.say(f"[launch] attempt {attempt.number}: {self.processes} processes{per}, coordinator {coordinator}")
        workers = []
        for i in range(self.processes):
            cmd = worker_command(self.train_args, self.devices_per_process, coordinator, self.processes, i)
            on_line = lambda line, i=i: self.say(f"[{i}] {line}")
            workers.append(LocalWorker(cmd, host_env(self._worker_vars(beats[i])), on_line))
        return workers

    def _worker_vars(self, heartbeat: Path) -> dict[str, str]:
        """A worker's environment additions; after a failure, when it was seen and the step reached."""
        return worker_vars(heartbeat) | ({"MESHLM_FAULT": self.fault} if self.fault else {})

    def _reached(self) -> int:
        """The newest step any process's heartbeat reported (0 before any)."""
        return reached(self._heartbeats())

    def _check(self, workers: list, started: float) -> str | None:
        """None while the group is healthy and running; else why it ended ('ok' on success)."""
        codes = [w.poll() for w in workers]
        failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
        if failed:
            return describe_failures(failed)
        if all(rc == 0 for rc in codes):
            return "ok"
        now = time.time()
        stale, late = [], []
        for i, beat in enumerate(self._heartbeats()):
            if codes[i] is not None:
                continue
            if beat.exists():
                if now - beat.stat().st_mtime > self.hang_timeout:
                    stale.append(i)
            elif now - started > self.startup_timeout:
                late.append(i)
        if stale:  # a stuck process stalls its peers in the next collective: report them all
            who = ", ".join(map(str, stale))
            return f"process{'es' if len(stale) > 1 else ''} {who} hung (no progress for > {self.hang_timeout:g}s)"
        if late:
            who = ", ".join(map(str, late))
            return f"process {who} did not finish a first step within --startup-timeout {self.startup_timeout:g}s"
        return None

    def _stop_all(self, workers: list, sig: int = signal.SIGKILL, grace: float = 10.0) -> None:
        for w in workers:
            if w.poll() is None:
                w.signal(sig)
        deadline = time.time() + grace
        for w in workers:
            if w.wait(max(0.1, deadline - time.time())) is None:
                w.signal(signal.SIGKILL)
                w.wait(10)

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.log_file.close()

    def _run(self) -> int:
        while True:
            attempt = Attempt(len(self.attempts) + 1)
            self.attempts.append(attempt)
            started = time.time()
            try:
                workers = self._start(attempt)
            except PlacementFailed as e:  # an elastic group: resized like after any failure
                workers, outcome = [], str(e)
            else:
                outcome = self._watch(workers, started)
            attempt.outcome, attempt.seconds = outcome, time.time() - started
            if self.stop_signal is not None:
                self._summary()
                return 128 + self.stop_signal
            if outcome == "ok":
                self._summary()
                return 0
            if outcome.startswith("stopped to regrow"):  # checkpointed: not a failure, nothing lost
                self.regrows += 1
                self.fault, (self.processes, self.train_args) = None, self.full
                continue
            reached = self._reached()  # the restarted group reports its recovery from this failure...
            if self.fault is None or reached:  # ...or from the one before, if this attempt made no step
                self.fault = f"{time.time():.3f} {reached}"
            self.say(f"[launch] attempt {attempt.number} failed: {outcome}; stopping the other processes")
            self._stop_all(workers)
            codes = [w.poll() for w in workers]
            final = [rc for rc in FINAL_EXITS if rc in codes]
            if final:
                self.say(f"[launch] {FINAL_EXITS[final[0]]} is not retried")
                self._summary()
                return final[0]
            if len(self.attempts) - self.regrows > self.max_restarts or not self._resize():
                self._summary()
                return 1 if self.stop_signal is None else 128 + self.stop_signal
            reached = self.fault.split()[1]
            self.say(f"[launch] restarting the group (it had reached step {reached}) from the latest good checkpoint")

    def _watch(self, workers: list, started: float) -> str:
        """Poll the running group until it ends: why it ended ('ok' on success). A SIGTERM/SIGINT to
        the launcher is forwarded (every process checkpoints); a shrunk group whose full capacity is
        back is stopped the same way, to restart at full size."""
        polled = time.time()
        while True:
            time.sleep(0.2)
            if self.stop_signal is not None:  # forward: every process checkpoints and exits
                name = signal.Signals(self.stop_signal).name
                self.say(f"[launch] {name}: asking every process to checkpoint and stop")
                self._stop_all(workers, signal.SIGTERM, grace=300)
                return f"stopped by {name}"
            outcome = self._check(workers, started)
            if outcome is not None:
                return outcome
            if self.processes < self.full[0] and time.time() - polled > self.capacity_poll:
                polled = time.time()
                if self._capacity() >= self.full[0]:
                    self.say(
                        f"[launch] capacity for {self.full[0]} processes is back: every process checkpoints, "
                        "and the group restarts at full size"
                    )
                    self._stop_all(workers, signal.SIGTERM, grace=300)
                    stopped = (0, 128 + signal.SIGTERM, -signal.SIGTERM)  # checkpointed and stopped
                    failed = [(i, w.poll()) for i, w in enumerate(workers) if w.poll() not in stopped]
                    if failed:  # not a clean stop: a failure like any other
                        return f"{describe_failures(failed)} while stopping to regrow"
                    return f"stopped to regrow to {self.full[0]} processes"

    def _capacity(self) -> int:
        """How many processes can run now: --capacity-cmd's number (the full group without one)."""
        if not self.capacity_cmd:
            return self.full[0]
        try:
            r = subprocess.run(self.capacity_cmd, shell=True, capture_output=True, text=True, timeout=10)
            return int(r.stdout.split()[0])
        except (subprocess.SubprocessError, ValueError, IndexError) as e:
            self.say(f"[launch] --capacity-cmd gave no number ({type(e).__name__}); assuming the current group")
            return self.processes

    def _resize(self) -> bool:
        """Before a restart: wait up to --replace-timeout for the full group's capacity; without it,
        shrink to the largest group the layout allows (`elastic`), retried on every capacity check
        for another --replace-timeout when none fits yet. False: give up (the reason was said)."""
        full, args = self.full
        if self.min_processes is None or self.min_processes >= full:
            return self.stop_signal is None
        deadline = time.time() + self.replace_timeout  # first, for the lost processes to come back
        capacity = self._capacity()
        while capacity < full and time.time() < deadline and self.stop_signal is None:
            time.sleep(1.0)
            capacity = self._capacity()
        said = None
        deadline = time.time() + self.replace_timeout
        while self.stop_signal is None and capacity < full:
            got = elastic.largest(self.cfg, full, capacity, self.min_processes)
            if not isinstance(got, str):
                self._shrink(*got)
                return True
            if got != said:
                self.say(f"[launch] cannot shrink to {capacity} processes: {got}; waiting for capacity")
                said = got
            if time.time() > deadline:
                self.say(f"[launch] no group of at least --min-processes {self.min_processes} fits: giving up")
                return False
            time.sleep(1.0)
            capacity = self._capacity()
        self.processes, self.train_args = full, args
        return self.stop_signal is None

    def _shrink(self, n: int, cfg: RunConfig) -> None:
        full, args = self.full
        p, was = cfg.parallel, self.cfg.train.microbatches
        self.say(
            f"[launch] {full - n} process(es) not replaced within --replace-timeout {self.replace_timeout:g}s: "
            f"continuing on {n} processes, mesh {p.describe(' x ')}, microbatches {was} -> "
            f"{cfg.train.microbatches} (the global batch is unchanged)"
        )
        self.processes, self.train_args = n, elastic.command(args, cfg)

    def _summary(self) -> None:
        self.say(f"[launch] summary ({len(self.attempts)} attempts, --max-restarts {self.max_restarts}):")
        for a in self.attempts:
            self.say(f"[launch]   attempt {a.number}: {a.outcome} after {a.seconds:.0f}s")


def plan_launch(
    train_args: list[str],
    cfg: RunConfig,
    run_dir: str | None,
    recipe: str,
    processes: int,
    devices_per_process: int | None,
) -> tuple[list[str], Path]:
    """Check the train command (`train_args`, resolved to `cfg`) against the group size before
    starting anything; fix one run dir for every attempt. Returns (train args with --run-dir, run dir)."""
    if processes < 1 or (devices_per_process is not None and devices_per_process < 1):
        raise ConfigError("--processes and --devices-per-process must be >= 1")
    for flag in ("--coordinator", "--num-processes", "--process-id", "--devices", "--distributed"):
        if flag in train_args:
            raise ConfigError(f"meshlm launch sets {flag} itself; remove it from the train command")
    total = processes * (devices_per_process or 0)
    if devices_per_process and cfg.parallel.n_devices != total:  # else each process's accelerators decide
        p = cfg.parallel
        raise ConfigError(
            f"mesh {p.describe(' x ')} = {p.n_devices} devices, but --processes "
            f"{processes} x --devices-per-process {devices_per_process} = {total}; make them equal"
        )
    if run_dir:
        return train_args, Path(run_dir)
    path = Path(f"runs/{recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    return [*train_args, "--run-dir", str(path)], path
