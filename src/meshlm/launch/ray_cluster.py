"""`meshlm launch --ray ADDRESS`: the same supervision as `meshlm launch`, with the processes placed
one per node of an existing Ray cluster (`pip install 'meshlm[ray]'`).

Ray only places and watches processes: each node runs a small actor that starts `meshlm train` as
a child process and hands back its output and exit status. The training processes still form one
JAX distributed runtime among themselves (process 0's node hosts the coordinator), exactly as with
the local launcher. The run directory (checkpoints, heartbeats) must be on a file system every node
sees, as on any multi-host run. The first attempt places the processes with a placement group (one
per node where there are enough nodes); a restart puts each process back on the node it ran on
(Ray node affinity), where its in-memory copies are (`local_checkpoint` finds them by process
index), and a process whose node is gone on a live node that no process holds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from meshlm.config import ConfigError
from meshlm.launch.supervisor import PlacementFailed, Supervisor, host_env, worker_command

SILENT_S = 60.0  # a node whose process host stopped answering is not counted for this long


def _free_cpus() -> dict[str, float]:
    """Each node's CPUs not held now, by node id (Ray's own TPU helpers read the same private table;
    where it is gone, every node counts as free)."""
    try:
        from ray._private.state import available_resources_per_node

        return {node: r.get("CPU", 0) for node, r in available_resources_per_node().items()}
    except Exception:
        return {}


def _listed(ray) -> list[str]:
    """The nodes Ray lists as alive, with a CPU."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("meshlm launch --ray needs Ray: pip install 'meshlm[ray]'") from None
    return ray


class _ProcessHost:
    """Runs inside a Ray actor on one node: one child process, its output buffered for the driver."""

    def __init__(self):
        self.proc = None
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def node(self) -> tuple[str, str]:
        """(this node's IP address, its Ray node id)."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        from meshlm.launch.supervisor import free_port

        return free_port()

    def start(self, args: list[str], extra_env: dict[str, str], cwd: str) -> int:
        cmd = [sys.executable, *args]  # this node's interpreter and environment
        self.proc = subprocess.Popen(
            cmd,
            env=host_env(extra_env),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append(line.rstrip("\n"))

    def poll(self) -> tuple[int | None, list[str]]:
        rc = self.proc.poll()
        with self.lock:
            lines, self.lines = self.lines, []
        return rc, lines

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


@dataclass
class RayWorker:
    """The driver's handle on one remote process (the interface of `launch.LocalWorker`)."""

    actor: object
    on_line: object
    rc: int | None = None

    def poll(self) -> int | None:
        if self.rc is None:
            ray = _ray()
            try:
                self.rc, lines = ray.get(self.actor.poll.remote(), timeout=60)
            except Exception as e:  # the node or the actor died
                self.on_line(f"[launch] lost the process's Ray actor: {type(e).__name__}")
                self.rc = -int(signal.SIGKILL)
                return self.rc
            for line in lines:
                self.on_line(line)
        return self.rc

    def signal(self, sig: int) -> None:
        with contextlib.suppress(Exception):
            _ray().get(self.actor.signal.remote(sig), timeout=30)

    def wait(self, timeout: float) -> int | None:
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() >= deadline:
                return None
            time.sleep(0.2)
        return self.rc


class RaySupervisor(Supervisor):
    def __init__(self, *args, address: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.address = address
        self.actors: list = []
        self.group = None  # the Ray placement group of the first attempt
        self.homes: list[str] = []  # the Ray node id each process ran on in the last attempt
        self.silent: dict[str, float] = {}  # nodes whose process host stopped answering: since when

    def run(self) -> int:
        ray = _ray()
        try:
            ray.init(address=self.address, log_to_driver=False)
        except Exception as e:
            raise ConfigError(f"cannot connect to the Ray cluster at {self.address}: {e}") from None
        try:
            return super().run()
        finally:
            self._release()
            ray.shutdown()

    def _live_nodes(self) -> list[str]:
        """The Ray node ids that can hold a process (alive, with a CPU held by the group or free), less
        the nodes whose process host stopped answering in the last SILENT_S seconds: a node that died
        stays listed alive until Ray's health checks mark it dead (about 30 s by default); after that,
        Ray's list holds. Each attempt's hosts are asked until one fails to answer, then not again."""
        ray = _ray()
        now = time.time()
        asked = {h: a.node.remote() for h, a in zip(self.homes, self.actors, strict=False) if h not in self.silent}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=10) if asked else ([], [])
        answered = set()
        for ref in ready:
            with contextlib.suppress(Exception):  # a dead actor's reply is its error
                answered.add(ray.get(ref)[1])
        self.silent |= {h: now for h in asked if h not in answered}  # asked once per attempt's hosts
        left_out = {h for h, t in self.silent.items() if now - t < SILENT_S}
        free = _free_cpus()
        # a node counts when one of the group's processes holds its CPU, or one is free (another job
        # may hold it all)
        return sorted(n for n in _listed(ray) if n not in left_out and (n in self.homes or free.get(n, 1) >= 1))

    def _capacity(self) -> int:
        """How many processes can run now: --capacity-cmd's number where given, else one a live node
        of the Ray cluster (`--min-processes` shrinks the group when a node is lost and not replaced
        within --replace-timeout, and regrows it when nodes join)."""
        if self.capacity_cmd:
            return super()._capacity()
        return len(self._live_nodes())

    def _homecoming(self, alive: list[str]) -> tuple[list, str]:
        """Where a restarted group's processes go: each to the node it ran on (whose tmpfs holds its
        in-memory copies), a process whose node is gone to a live node with a CPU that no process
        holds (its copy comes back from its peer), else wherever Ray finds room. Where that fails
        within a minute (a node listed alive is dead or full), `_start` places the group anew."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spare = [n for n in alive if n not in self.homes]
        targets = [home if home in alive else spare.pop(0) if spare else None for home in self.homes]
        strategies = [NodeAffinitySchedulingStrategy(t, soft=False) if t else "SPREAD" for t in targets]
        moved = [i for i, (t, home) in enumerate(zip(targets, self.homes, strict=True)) if t != home]
        return strategies, f"processes {moved} moved, the others on their nodes" if moved else "each on its node"

    def _release(self) -> None:
        ray = _ray()
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
        if self.group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.group)
            self.group = None

    def _start(self, attempt) -> list:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        alive = self._live_nodes()
        self._release()
        host_cls = ray.remote(num_cpus=1, max_concurrency=4)(_ProcessHost)
        placed = None
        if len(self.homes) == self.processes:  # a restart: each process back on its node
            strategies, how = self._homecoming(alive)
            self.actors = [host_cls.options(scheduling_strategy=s).remote() for s in strategies]
            try:  # a node listed alive may be dead, or full (another job took its CPU)
                placed = ray.get([a.node.remote() for a in self.actors], timeout=min(60.0, self.startup_timeout))
            except Exception as e:
                self.say(
                    f"[launch] the processes cannot go back to their nodes ({type(e).__name__}): placing them anew"
                )
                self._release()
        if placed is None:
            elastic = self.min_processes is not None  # its capacity counts nodes: it is never packed
            if elastic and attempt.number == 1 and len(alive) < self.processes:
                raise ConfigError(
                    f"elastic under --ray runs one process a node, but the cluster has {len(alive)} live "
                    f"node(s) with a free CPU for {self.processes} processes"
                )
            how = "STRICT_SPREAD" if elastic or len(_listed(ray)) >= self.processes else "SPREAD"
            self.group = ray.util.placement_group([{"CPU": 1}] * self.processes, strategy=how)
            if not self.group.wait(timeout_seconds=self.startup_timeout):
                if elastic and attempt.number > 1:  # a counted node is gone or full: resize
                    self._release()
                    raise PlacementFailed(f"Ray could not place {self.processes} processes one a node")
                raise ConfigError(f"the Ray cluster at {self.address} cannot place {self.processes} processes")
            self.actors = [
                host_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, i)).remote()
                for i in range(self.processes)
            ]
            placed = ray.get([a.node.remote() for a in self.actors])
        self.silent = {h: t for h, t in self.silent.items() if time.time() - t < SILENT_S}  # new hosts: asked
        ips, self.homes = [ip for ip, _ in placed], [node for _, node in placed]
        coordinator = f"{ips[0]}:{ray.get(self.actors[0].free_port.remote())}"
        beats = self._heartbeats()
        for b in beats:
            b.unlink(missing_ok=True)
        nodes = " ".join(f"{i}:{node[:8]}" for i, node in enumerate(self.homes))
        where = f"{self.processes} processes on Ray ({len(set(self.homes))} nodes, {how}; nodes {nodes})"
        self.say(f"[launch] attempt {attempt.number}: {where}, coordinator {coordinator}")
        workers = []
        for i, actor in enumerate(self.actors):
            cmd = worker_command(self.train_args, self.devices_per_process, coordinator, self.processes, i)
            ray.get(actor.start.remote(cmd[1:], self._worker_vars(beats[i]), os.getcwd()))
            workers.append(RayWorker(actor, lambda line, i=i: self.say(f"[{i}] {line}")))
        return workers
