"""In-memory checkpoints, replicated on a peer: a restart loses at most `checkpoint.local_every`
steps instead of `checkpoint.every`, and a process whose host was replaced gets its state back from
its peer.

Every `local_every` steps each process writes the shards of the train state it holds (its
addressable shards, one copy of each distinct index) into one file on a local tmpfs (`/dev/shm` by
default: it outlives the process, and JAX cannot re-initialise its runtime inside a process, so a
restart is a new process). The same bytes go to a peer process on another host where there is
one (process i + s in a ring, s the smallest shift that leaves every host; s = 1 when all share
one host) through one XLA collective (`ppermute` over a one-device-per-process mesh, in chunks),
and the peer writes them beside its own. Each file carries a blake2b digest of its
bytes and the layout it was cut for (the mesh, every leaf's shape, dtype and sharding), so a copy
is used only by the same layout and only when intact.

The copies are for restarts after a failure: `resume` consults them only when `meshlm launch`
restarts a group, or SLURM a requeued job ($MESHLM_FAULT; `launch.slurm`), and drops them on every
other start, and a run that ends in order (finished, stopped, preempted, halted) drops them too. On
such a restart every process reports the steps it holds (its own and its predecessor's) and the
disk's newest step; the group takes the newest step of which every process has a copy, its own or at
its peer, when that is not older than the newest disk checkpoint any process sees, and deletes every
other copy. Processes whose own copy is missing (a replaced host, a wiped tmpfs) receive it back
from their peer by the same collective. Anything else (a changed layout or process count, a copy
that fails its digest on any process, no common step) falls back to the disk checkpoint, the only
persistent one.

Why not Orbax's emergency managers: two of them (`emergency.checkpoint_manager` and
`emergency.p2p`) find a lost process's shards in another data-parallel replica and restore by
broadcast, so they need at least two replicas holding the same shards: they cannot serve FSDP or
ZeRO-1 over the data axis, nor a layout whose processes hold distinct shards (tensor or stage
across processes); the third (`replicator_checkpoint_manager`) leaves the replication to a service
outside the job (GKE's multi-tier checkpointing) and says not to use it without approval. A ring
copy serves every layout, at the price of a second copy of each process's shards. Copies are found
by process index: a process that restarts on another host (a scheduler that places the group
anew) finds none, and the group uses the disk.

Retention: the newest own copy and the newest held copy; the previous own copy is deleted only
once the new one has reached the peer, so at a failure there is always one step of which both
copies exist. Steady-state tmpfs use: 2x the process's shard bytes (up to 4x during a save).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

MAGIC = b"MESHLMLC"  # file: MAGIC, header length (8 bytes, little endian), JSON header, data
CHUNK = 64 << 20  # bytes per collective transfer (each is compiled once for this shape)


def default_root() -> Path:
    """`/dev/shm` where it is a writable directory (Linux), else the system's temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def run_id(run_dir: Path, first: bool) -> str:
    """The run directory's identity (`<run_dir>/.run-id`, written once by process 0): a run dir
    deleted and made again, or a copy of one, never meets the old run's in-memory copies."""
    path = run_dir / ".run-id"
    if first and not path.exists():
        _write(path, uuid.uuid4().hex.encode())
    return path.read_text().strip()


def store_dir(root: Path, run_dir: Path, rid: str) -> Path:
    where = hashlib.blake2b(str(run_dir.absolute()).encode(), digest_size=6).hexdigest()
    return root / f"meshlm-{where}-{rid[:12]}"


def layout_fingerprint(abstract: Any) -> str:
    """What a copy must have been cut for: the mesh (axis names, shape, device ids) and every leaf's
    path, shape, dtype, sharding and memory kind."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract)
    parts = [str(jax.process_count())]
    for path, x in leaves:
        s = x.sharding
        mesh = getattr(s, "mesh", None)
        where = (
            f"{dict(mesh.shape)} {[d.id for d in mesh.devices.flat]} {s.spec}"
            if mesh is not None
            else str(sorted(d.id for d in s.device_set))
        )
        parts.append(f"{jax.tree_util.keystr(path)} {x.shape} {x.dtype} {where} {s.memory_kind}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _index(idx: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    return [list(sl.indices(n)[:2]) for sl, n in zip(idx, shape, strict=True)]


def encode(state: Any, meta: dict, fingerprint: str) -> bytes:
    """This process's shards of `state` (each distinct index once) as one file's bytes."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    chunks, described, offset = [], [], 0
    for path, x in leaves:
        shards, seen = [], set()
        for shard in x.addressable_shards:
            index = _index(shard.index, x.shape)
            if str(index) in seen:
                continue
            seen.add(str(index))
            data = np.ascontiguousarray(np.asarray(shard.data)).tobytes()
            shards.append({"index": index, "offset": offset, "nbytes": len(data)})
            chunks.append(data)
            offset += len(data)
        described.append({"path": jax.tree_util.keystr(path), "dtype": str(x.dtype), "shards": shards})
    body = b"".join(chunks)
    header = {
        "meta": meta,
        "fingerprint": fingerprint,
        "process": jax.process_index(),
        "leaves": described,
        "digest": hashlib.blake2b(body, digest_size=32).hexdigest(),
    }
    head = json.dumps(header).encode()
    return MAGIC + len(head).to_bytes(8, "little") + head + body


def decode(blob: bytes | memoryview) -> tuple[dict, memoryview]:
    """(header, data) of a file's bytes; ValueError when it is not one, or its digest disagrees."""
    view = memoryview(blob)
    if bytes(view[:8]) != MAGIC:
        raise ValueError("not an in-memory checkpoint")
    n = int.from_bytes(view[8:16], "little")
    header = json.loads(bytes(view[16 : 16 + n]))
    body = view[16 + n :]
    if hashlib.blake2b(body, digest_size=32).hexdigest() != header["digest"]:
        raise ValueError("digest mismatch")
    return header, body


def rebuild(header: dict, body: memoryview, abstract: Any) -> Any:
    """The state with `abstract`'s shardings from a decoded file's shards (this process's)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    saved = {leaf["path"]: leaf for leaf in header["leaves"]}
    out = []
    for path, x in leaves:
        leaf = saved[jax.tree_util.keystr(path)]
        by_index = {str(s["index"]): s for s in leaf["shards"]}
        dtype, arrays = jnp.dtype(leaf["dtype"]), []
        for device, idx in x.sharding.addressable_devices_indices_map(x.shape).items():
            s = by_index[str(_index(idx, x.shape))]
            shape = [b - a for a, b in s["index"]]
            host = np.frombuffer(body[s["offset"] : s["offset"] + s["nbytes"]], dtype=dtype).reshape(shape)
            arrays.append(jax.device_put(host, SingleDeviceSharding(device, memory_kind=x.sharding.memory_kind)))
        out.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
    return jax.tree_util.tree_unflatten(treedef, out)


# ------------------------------------------------------------------------ the collectives


def _allgather(values: list[int]) -> np.ndarray:
    """(process count, len(values)) int64: every process's `values`. Each travels as two int32
    words: JAX moves int64 as int32 unless x64 is on, which would wrap lengths of 2 GiB and more."""
    from jax.experimental import multihost_utils

    words = _words(values)
    got = np.asarray(multihost_utils.process_allgather(words)).reshape(jax.process_count(), -1)
    return _unwords(got)


def _words(values: list[int]) -> np.ndarray:
    v = np.asarray(values, np.int64)
    return np.stack([v >> 31, v & 0x7FFFFFFF], axis=-1).astype(np.int32).reshape(-1)


def _unwords(words: np.ndarray) -> np.ndarray:
    w = words.astype(np.int64).reshape(words.shape[0], -1, 2)
    return (w[..., 0] << 31) | w[..., 1]


def peer_shift(hosts: list[int]) -> int:
    """The smallest ring shift that sends every process's copy to another host (1 if none does)."""
    n = len(hosts)
    return next((s for s in range(1, n) if all(hosts[i] != hosts[(i + s) % n] for i in range(n))), 1)


def choose(table: np.ndarray, k: int, shift: int) -> tuple[int | None, list[int]]:
    """From every process's report (row j: its own steps, k of them, then the steps it holds for
    process j - shift, k of them, then the newest disk step it sees; -1 = none): the newest step
    of which every process has a copy, its own or at its peer, not older than any process's disk
    step, and the processes that need theirs sent back; (None, []) when there is none."""
    n = len(table)
    owns = [set(table[j, :k].tolist()) - {-1} for j in range(n)]
    helds = [set(table[(j + shift) % n, k : 2 * k].tolist()) - {-1} for j in range(n)]
    disk = int(table[:, 2 * k].max())
    common = set.intersection(*(owns[j] | helds[j] for j in range(n)))
    step = max((s for s in common if s >= disk), default=None)
    return step, [] if step is None else [j for j in range(n) if step not in owns[j]]


@dataclass
class Ring:
    """Moves bytes between processes along a ring: one device per process, a `ppermute` over them."""

    mesh: Mesh = field(init=False)
    programs: dict = field(default_factory=dict)

    def __post_init__(self):
        firsts = {}
        for d in jax.devices():
            firsts.setdefault(d.process_index, d)
        self.mesh = Mesh(np.array([firsts[p] for p in range(jax.process_count())]), ("process",))
        self.device = firsts[jax.process_index()]

    def _program(self, shift: int, size: int):
        if (shift, size) not in self.programs:
            n = jax.process_count()
            perm = [(j, (j + shift) % n) for j in range(n)]
            body = lambda x: jax.lax.ppermute(x, "process", perm)
            spec = PartitionSpec("process")
            f = jax.shard_map(body, mesh=self.mesh, in_specs=spec, out_specs=spec)
            self.programs[shift, size] = jax.jit(f)
        return self.programs[shift, size]

    def shift(self, blob: bytes, length: int, shift: int) -> bytes:
        """Send `blob` (padded to `length`, the largest any process sends) to process i + `shift`;
        returns the `length` bytes process i - `shift` sent. Every process calls it. Chunks are
        powers of two up to CHUNK, so a copy whose header grows by a digit compiles nothing new."""
        size = min(CHUNK, 1 << max(0, length - 1).bit_length())
        sharding = NamedSharding(self.mesh, PartitionSpec("process"))
        received = bytearray()
        view = memoryview(blob)
        for start in range(0, max(1, length), size):
            part = np.zeros((1, size), np.uint8)
            piece = view[start : start + size]
            part[0, : len(piece)] = np.frombuffer(piece, np.uint8)
            local = jax.device_put(part, self.device)
            x = jax.make_array_from_single_device_arrays((jax.process_count(), size), sharding, [local])
            out = self._program(shift, size)(x)
            received += np.asarray(out.addressable_shards[0].data)[0].tobytes()
        return bytes(received[:length])


# ------------------------------------------------------------------------------ the store


def _write(path: Path, blob: bytes) -> None:
    """Atomically: a kill mid-write leaves a `.tmp` file, never a short copy under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full tmpfs: give back what the partial write took
        raise


def _steps(directory: Path) -> dict[int, Path]:
    if not directory.is_dir():
        return {}
    return {int(p.stem): p for p in directory.glob("*.ckpt") if p.stem.isdigit()}


def _host_id() -> int:
    return int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=4).digest(), "little") >> 1


@dataclass
class Restored:
    state: Any
    meta: dict
    step: int
    from_peer: list[int]  # processes whose state came from their peer's copy


class LocalCheckpoints:
    """This process's in-memory copies of one run (`directory`: the run's store on this host).
    Made on every process at once (it asks the others for their hosts)."""

    def __init__(self, directory: Path, every: int, log=print):
        self.every, self.log = every, log
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.home = directory / f"process-{self.process}"
        self.own = self.home / "own"
        self.ring = Ring() if self.processes > 1 else None
        hosts = _allgather([_host_id()])[:, 0].tolist() if self.ring else [0]
        self.shift = peer_shift(hosts)
        self.peer = (self.process - self.shift) % self.processes  # whose copy this process holds
        self.successor = (self.process + self.shift) % self.processes  # who holds this process's
        self.held = self.home / f"held-{self.peer}"
        self.disabled: str | None = None
        self.restored: Restored | None = None  # what `restore` returned

    def due(self, n: int) -> bool:
        return bool(self.every) and self.disabled is None and n % self.every == 0

    def save(self, state: Any, meta: dict) -> None:
        """Write this process's shards, send them to its peer and keep its predecessor's. A failure
        on any process (a full tmpfs, no memory for the copy) turns the copies off for the rest of
        the run on every process (the exchange is a collective), with a warning, and deletes them
        (the space goes back to the tmpfs): training goes on."""
        step = int(jax.device_get(state.step))
        blob, error = b"", None
        try:
            blob = encode(state, meta | {"step": step}, layout_fingerprint(state))
            _write(self.own / f"{step}.ckpt", blob)
        except Exception as e:  # every process must reach the exchange below, whatever failed here
            error = f"{type(e).__name__}: {e}"
        if self.ring is not None:
            lengths = _allgather([len(blob), error is not None])
            received = self.ring.shift(blob, int(lengths[:, 0].max()), self.shift)
            if error is None:
                error = self._try(lambda: _write(self.held / f"{step}.ckpt", received[: int(lengths[self.peer, 0])]))
            failed = _allgather([error is not None])[:, 0] + lengths[:, 1]
            if failed.any():
                self.disabled = error or f"a copy failed on process(es) {np.flatnonzero(failed).tolist()}"
        elif error:
            self.disabled = error
        if self.disabled:
            self.log(
                f"warning: in-memory checkpoints turned off at step {step}: {self.disabled}; their files are "
                "deleted, and the disk checkpoints (checkpoint.every) still protect the run"
            )
            self.discard()
            return
        self._prune(step)

    def _try(self, write) -> str | None:
        try:
            write()
            return None
        except OSError as e:
            return f"{type(e).__name__}: {e}"

    def _prune(self, keep: int | None) -> None:
        """Delete every copy of this process but step `keep`'s (all of them for None)."""
        for directory in [self.own, *self.home.glob("held-*")]:
            for step, path in _steps(directory).items():
                if step != keep:
                    path.unlink(missing_ok=True)
            for tmp in directory.glob("*.tmp"):
                tmp.unlink(missing_ok=True)

    def discard(self) -> None:
        """Drop this process's copies (and the run's store once no process has any left)."""
        shutil.rmtree(self.home, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.home.parent.rmdir()

    def delete(self) -> None:
        """Drop this process's copies (the run ended in order: the disk has its state); process 0
        drops the run's whole store (with the parts of processes a shrunk group lost)."""
        shutil.rmtree(self.home.parent if self.process == 0 else self.home, ignore_errors=True)

    # --------------------------------------------------------------------------- restore

    def _usable(self, directory: Path, fingerprint: str) -> dict[int, Path]:
        """The steps of `directory` whose header names this layout (digests are checked on load)."""
        out = {}
        for step, path in _steps(directory).items():
            try:
                with open(path, "rb") as f:
                    head = f.read(16)
                    if head[:8] != MAGIC:
                        continue
                    header = json.loads(f.read(int.from_bytes(head[8:], "little")))
            except (OSError, ValueError):
                continue
            if header.get("fingerprint") == fingerprint:
                out[step] = path
        return out

    def restore(self, abstract: Any, disk_step: int | None) -> Restored | None:
        """The newest step of which every process has a copy (its own, or at its peer), when not
        older than the disk's newest; None otherwise. Every other copy is deleted. Every process
        calls it (collectives)."""
        self.restored = self._restore(abstract, -1 if disk_step is None else disk_step) if self.every else None
        self._prune(None if self.restored is None else self.restored.step)
        return self.restored

    def _restore(self, abstract: Any, disk_step: int) -> Restored | None:
        fingerprint = layout_fingerprint(abstract)
        own, held = self._usable(self.own, fingerprint), self._usable(self.held, fingerprint)
        if self.ring is None:
            for step in sorted((s for s in own if s >= disk_step), reverse=True):
                with contextlib.suppress(Exception):
                    return self._load(own[step].read_bytes(), abstract, step, [])
                self.log(f"the in-memory copy of step {step} failed its digest; not used")
            return None
        k = 4
        pad = lambda steps: [*sorted(steps, reverse=True)[:k], *[-1] * k][:k]
        step, needy = choose(_allgather([*pad(own), *pad(held), disk_step]), k, self.shift)
        if step is None:
            return None
        restored, blob = None, b""
        with contextlib.suppress(Exception):
            blob = own[step].read_bytes() if step in own else b""
        if needy:  # peers send back the copies they hold
            send = b""
            with contextlib.suppress(Exception):
                send = held[step].read_bytes() if self.peer in needy else b""
            lengths = _allgather([len(send)])
            back = self.ring.shift(send, int(lengths[:, 0].max()), -self.shift)
            if self.process in needy:
                blob = back[: int(lengths[self.successor, 0])]
        with contextlib.suppress(Exception):  # anything that fails here fails for the group below
            restored = self._load(blob, abstract, step, needy)
        if not _allgather([restored is not None])[:, 0].all():
            self.log(f"the in-memory copies of step {step} could not be used on every process; using the disk")
            return None
        if self.process in needy:  # this host's own copy again, for the next failure
            self._try(lambda: _write(self.own / f"{step}.ckpt", blob))
        return restored

    def _load(self, blob: bytes, abstract: Any, step: int, needy: list[int]) -> Restored:
        header, body = decode(blob)
        if header["meta"]["step"] != step or header["process"] != self.process:
            raise ValueError(f"not process {self.process}'s copy of step {step}")
        return Restored(rebuild(header, body, abstract), header["meta"], step, needy)
