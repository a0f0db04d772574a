"""Build the device mesh from `ParallelConfig`, and join a multi-process group.

Axes are always (stage, data, fsdp, context, tensor); an axis of size 1 shards nothing, so every strategy is a
choice of sizes, never a different code path. Axis types are `Auto`: shardings are declared with
`NamedSharding`/`with_sharding_constraint` and GSPMD propagates the rest (the FAX model: declared
partitioning, compiler-inserted collectives).

Multi-process runs use JAX's own distributed runtime (`jax.distributed`): one process per host
(or per group of local devices), XLA collectives between them (gloo on CPU, NCCL on GPU, ICI/DCN on
TPU). The mesh then spans every process's devices.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from meshlm.axes import MESH_AXES
from meshlm.config import ConfigError, ParallelConfig
from meshlm.parallel.rules import Layout, context_order, rules_for

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "MESHLM_COORDINATOR", "MESHLM_NUM_PROCESSES", "MESHLM_PROCESS_ID"


@dataclass(frozen=True)
class ProcessGroup:
    """How this process joins a run: explicit (coordinator host:port, N, i) or `auto` (let
    `jax.distributed.initialize()` read SLURM, Cloud TPU or GKE's environment)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    timeout_s: int = 60

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator is not None


def process_group(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto: bool = False,
    timeout_s: int = 60,
    env: dict | None = None,
) -> ProcessGroup:
    """Arguments first, then MESHLM_COORDINATOR / MESHLM_NUM_PROCESSES / MESHLM_PROCESS_ID."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    try:
        n = num_processes if num_processes is not None else int(env.get(ENV_NUM_PROCESSES, 0)) or None
        i = process_id if process_id is not None else (int(env[ENV_PROCESS_ID]) if ENV_PROCESS_ID in env else None)
    except ValueError:
        raise ConfigError(f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers") from None
    group = ProcessGroup(coordinator, n, i, auto, timeout_s)
    if coordinator is not None:
        if auto:
            raise ConfigError("give either --distributed (auto-detect) or --coordinator/--num-processes/--process-id")
        if n is None or i is None:
            raise ConfigError("--coordinator needs --num-processes and --process-id (or the MESHLM_* variables)")
        if n < 1 or not 0 <= i < n:
            raise ConfigError(f"--process-id must be in [0, {n}) and --num-processes >= 1 (got {i} of {n})")
        if ":" not in coordinator:
            raise ConfigError(f"--coordinator must be host:port, got {coordinator!r}")
    elif n is not None or i is not None:
        raise ConfigError("--num-processes/--process-id need --coordinator host:port (or MESHLM_COORDINATOR)")
    return group


HELLO_LIMIT = 1024  # bytes: a hello is {"n": N, "i": I}; anything longer is not one
HELLO_TIMEOUT = 5.0  # seconds a connection may take to say hello before it is dropped


class BadHello(ValueError):
    """A connection to the rendezvous port that is not a meshlm process saying hello."""


def _recv_line(conn: socket.socket, deadline: float, limit: int | None = None) -> str:
    """One line from `conn` (without its newline). With `limit`, a line is at most that many bytes,
    must end with a newline before the peer closes and must be UTF-8, else BadHello."""
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(0.05, deadline - time.time()))
        chunk = conn.recv(4096)
        if not chunk:
            if limit is not None:
                raise BadHello("closed before a complete line")
            break
        data += chunk
        if limit is not None and len(data) > limit:
            raise BadHello(f"more than {limit} bytes without a newline")
    try:
        return data.decode().strip()
    except UnicodeDecodeError:
        raise BadHello("not UTF-8 text") from None


def _read_hello(conn: socket.socket, deadline: float) -> tuple[int, int]:
    """(n, i) of a process's hello line `{"n": N, "i": I}`; BadHello for anything else."""
    line = _recv_line(conn, min(deadline, time.time() + HELLO_TIMEOUT), HELLO_LIMIT)
    try:
        hello = json.loads(line)
    except ValueError:
        raise BadHello("not JSON") from None
    if not isinstance(hello, dict):
        raise BadHello("not a JSON object")
    n, i = hello.get("n"), hello.get("i")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, i)):
        raise BadHello("needs integer fields n and i")
    return n, i


def _host_port(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"--coordinator must be host:port, got {coordinator!r}") from None


def bind_address(host: str, resolve=socket.gethostbyname) -> str:
    """Where process 0 listens for the rendezvous: the coordinator's own address, so that a run of
    processes on one machine (`meshlm launch`: 127.0.0.1) is reachable from nowhere else.

    One exception: a host *name* that resolves to a loopback address (Debian and Ubuntu map the
    machine's own name to 127.0.1.1) is how the other hosts of a cluster name this machine too,
    so binding to loopback would lock them out; then it listens on every interface, as JAX's own
    coordination service does on the same port."""
    try:
        address = resolve(host)
    except OSError as e:
        raise ConfigError(f"cannot resolve the coordinator host {host!r}: {e}") from None
    if ipaddress.ip_address(address).is_loopback and host != address and host != "localhost":
        return ""
    return address


def listen(host: str, port: int) -> socket.socket:
    """Process 0's rendezvous socket (see `bind_address`)."""
    address = bind_address(host)
    try:
        return socket.create_server((address, port), reuse_port=hasattr(socket, "SO_REUSEPORT"))
    except OSError as e:
        raise ConfigError(
            f"process 0 cannot listen on the coordinator address {host}:{port}: {e.strerror or e} "
            "(--coordinator must name this host, process 0's, and a free port)"
        ) from None


def _serve_rendezvous(group: ProcessGroup, host: str, port: int, deadline: float) -> None:
    """Process 0: wait for the N-1 others on the coordinator port, check they agree, answer.

    A connection that does not say a well-formed hello (not JSON, not an object, fields missing or
    not integers, too long, binary, closed early, silent for HELLO_TIMEOUT) is not a meshlm process:
    it is dropped and the rendezvous goes on waiting. A well-formed hello that disagrees (another
    process count, an id out of range or taken twice) is a real misconfiguration: the group stops."""
    server = listen(host, port)
    conns: list[socket.socket] = []  # every process that said hello gets the verdict
    joined: set[int] = set()
    error = None
    with server:
        while len(joined) < group.num_processes - 1 and error is None:
            server.settimeout(max(0.05, deadline - time.time()))
            try:
                conn, _ = server.accept()
            except OSError:  # the accept timed out (or was interrupted): try again until the deadline
                if time.time() >= deadline:
                    break
                continue
            try:
                n, i = _read_hello(conn, deadline)
            except (BadHello, OSError):
                conn.close()
                continue
            conns.append(conn)
            error = _disagreement(group, n, i, joined)
            joined.add(i)
        missing = sorted(set(range(1, group.num_processes)) - joined)
        if error is None and missing:
            error = (
                f"only {len(joined) + 1} of {group.num_processes} processes joined within {group.timeout_s}s "
                f"(missing process ids: {', '.join(map(str, missing[:10]))})"
            )
        for conn in conns:
            with conn, contextlib.suppress(OSError):
                conn.sendall(("OK" if error is None else f"ERR {error}").encode() + b"\n")
    if error is not None:
        raise ConfigError(f"the process group did not form: {error}")


def _disagreement(group: ProcessGroup, n: int, i: int, joined: set[int]) -> str | None:
    """Why process i's hello (its process count n) cannot join this group, or None."""
    if n != group.num_processes:
        return f"process {i} was started with --num-processes {n}, process 0 with {group.num_processes}"
    if not 0 < i < group.num_processes:
        return f"a process gave --process-id {i}, outside 1..{group.num_processes - 1}"
    if i in joined:
        return f"a second process claims --process-id {i}"
    return None


def _join_rendezvous(group: ProcessGroup, host: str, port: int, deadline: float) -> None:
    """Process i > 0: reach process 0 (retrying until the deadline) and wait for its answer."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, deadline - time.time())) as conn:
                conn.sendall(json.dumps({"n": group.num_processes, "i": group.process_id}).encode() + b"\n")
                answer = _recv_line(conn, deadline)
            break
        except OSError:
            if time.time() >= deadline:
                raise ConfigError(
                    f"could not reach the coordinator {group.coordinator} (process 0) within {group.timeout_s}s; "
                    "check that process 0 is running and that the address is reachable from this host"
                ) from None
            time.sleep(0.2)
    if answer != "OK":
        reason = answer[4:] if answer.startswith("ERR ") else "no answer from process 0"
        raise ConfigError(f"the process group did not form: {reason}")


def rendezvous(group: ProcessGroup) -> None:
    """A pre-flight check before `jax.distributed.initialize`, on the coordinator's own port:
    every process reaches process 0 and they agree on the process count. JAX's runtime
    terminates the process (no Python exception) when a peer is missing; this turns an unreachable
    coordinator or a wrong process count into a clear error within `timeout_s`."""
    host, port = _host_port(group.coordinator)
    deadline = time.time() + group.timeout_s
    if group.process_id == 0:
        _serve_rendezvous(group, host, port, deadline)
    else:
        _join_rendezvous(group, host, port, deadline)


def init_distributed(group: ProcessGroup) -> None:
    """Join the process group (before any device is touched). On CPU, cross-process collectives
    use gloo. Fails with a ConfigError after `timeout_s` if the group cannot form."""
    if not group.enabled:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not group.auto and group.num_processes > 1:
        rendezvous(group)
    where = "auto-detected cluster" if group.auto else f"{group.coordinator}"
    try:
        if group.auto:
            jax.distributed.initialize(initialization_timeout=group.timeout_s)
        else:
            jax.distributed.initialize(
                group.coordinator,
                group.num_processes,
                group.process_id,
                initialization_timeout=group.timeout_s,
            )
    except Exception as e:  # jax raises RuntimeError / XlaRuntimeError / ValueError here
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"could not join the process group at {where} as process {group.process_id} of {group.num_processes} "
            f"within {group.timeout_s}s: {first}. Check that the coordinator (process 0) is running and reachable, "
            "and that every process was given the same --num-processes"
        ) from None


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """A `Mesh` of shape (stage, data, fsdp, context, tensor) over `devices` (default: the global devices).

    `tensor` is the innermost (fastest-varying) axis so that it maps onto the closest devices
    (same host / NVLink / ICI neighbours), as both papers require of the model-parallel group;
    `context` comes next (its ring exchanges K/V every layer, as Megatron places CP inside DP);
    `stage` is the outermost (pipeline sends are point-to-point, once per microbatch: the axis
    that tolerates the slowest links, P2 and Megatron's inter-node placement).
    """
    shape = mesh_shape(parallel)
    if devices is None:
        devices = jax.devices()
        # One process may run a smaller mesh on the first devices (e.g. a 2-device job on an 8-GPU
        # box); across processes every device must take part.
        if jax.process_count() == 1 and int(np.prod(shape)) < len(devices):
            devices = devices[: int(np.prod(shape))]
    devices = list(devices)
    if int(np.prod(shape)) != len(devices):
        where = (
            f"{jax.process_count()} processes x {jax.local_device_count()} devices = {len(devices)} devices"
            if jax.process_count() > 1
            else f"{len(devices)} are available (use --devices N on CPU, or change --mesh)"
        )
        mesh = "mesh " + " x ".join(f"{n}={s}" for n, s in zip(MESH_AXES, shape, strict=True))
        raise ConfigError(f"{mesh} needs {int(np.prod(shape))} devices but {where}")
    if parallel.n_slices > 1:
        return Mesh(hybrid_devices(parallel, devices), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def hybrid_devices(parallel: ParallelConfig, devices: list) -> np.ndarray:
    """The device array of a mesh over several slices (TPU: `slice_index`) or nodes (elsewhere: one
    process per node, `process_index`): each axis is `dcn` ways across them x the rest within one,
    laid out by `mesh_utils.create_hybrid_device_mesh` (the within-slice part topology-aware on TPU),
    so that a collective over `tensor` - and over any axis not split across - stays on the fast links."""
    from jax.experimental import mesh_utils

    dcn = tuple(parallel.dcn.values())
    ici = tuple(size // ways for size, ways in zip(mesh_shape(parallel), dcn, strict=True))
    by_process = devices[0].platform != "tpu"
    unit = "processes (one per node)" if by_process else "TPU slices"
    found = len({getattr(d, "process_index" if by_process else "slice_index", 0) for d in devices})
    if found != parallel.n_slices:
        across = ", ".join(f"{a}={n}" for a, n in parallel.dcn.items() if n > 1)
        raise ConfigError(
            f"--dcn {across} splits the mesh over {parallel.n_slices} {unit}, but the devices come from {found}; "
            f"run on {parallel.n_slices} {unit} or change --dcn"
        )
    try:
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=by_process, allow_split_physical_axes=True
        )
    except ValueError as e:  # e.g. slices of unequal size
        raise ConfigError(f"cannot lay out the mesh over {parallel.n_slices} {unit}: {e}") from None


def mesh_shape(parallel: ParallelConfig) -> tuple[int, ...]:
    """Axis sizes in `MESH_AXES` order."""
    return tuple(getattr(parallel, name) for name in MESH_AXES)


def _layout(mesh, parallel: ParallelConfig) -> Layout:
    order = None
    if parallel.context > 1:
        order = context_order(parallel.context, parallel.context_load_balance)
    return Layout(mesh, rules_for(parallel.sequence_parallel), parallel.context_strategy, order)


def abstract_layout(parallel: ParallelConfig) -> Layout:
    """The layout of a mesh of this shape without devices: shard shapes for planning any size."""
    mesh = AbstractMesh(mesh_shape(parallel), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return _layout(mesh, parallel)


def make_layout(parallel: ParallelConfig, devices: list | None = None) -> Layout:
    """The mesh plus the rules table for this parallel config (sequence and context parallelism included)."""
    return _layout(make_mesh(parallel, devices), parallel)
