"""Tokenize work units in this process, in a pool of local processes, or on a Ray cluster; yield
the results in unit order; keep each finished unit on disk so that a killed preparation resumes.

Whatever runs a unit, its result is the same arrays (`units.encode`), so the prepared bytes do not
depend on the number of processes or hosts. At most a few units per process are in flight, so a
corpus of any size streams through a bounded amount of memory.

The work directory holds one `NNNNNN-<key>.npz` per finished unit (its tokens, per-document token
and byte counts and skipped input), written under a temporary name and renamed: a file that is
there is whole. A unit's key covers the unit, its files' sizes and modification times, the
tokenizer and the reading options, so a changed input is never served from an old unit.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshlm.config import ConfigError
from meshlm.data import units as U

ARRAYS = ("tokens", "counts", "doc_tokens", "doc_bytes")


class WorkDir:
    """Finished units of one preparation, in `root`; `salt` names what else decides their bytes
    (the tokenizer, the field, the error policy)."""

    def __init__(self, root: Path, salt: str):
        self.root, self.salt = root, salt
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, i: int, unit: U.Unit) -> Path:
        key = hashlib.blake2b(f"{unit.key()}:{self.salt}".encode(), digest_size=10).hexdigest()
        return self.root / f"{i:06d}-{key}.npz"

    def has(self, i: int, unit: U.Unit) -> bool:
        return self._path(i, unit).is_file()

    def get(self, i: int, unit: U.Unit) -> dict | None:
        path = self._path(i, unit)
        if not path.is_file():
            return None
        try:
            with np.load(path) as z:
                out = {k: z[k] for k in ARRAYS}
                out |= json.loads(str(z["skips"]))
            return out
        except Exception:  # damaged (a disk error): encode it again
            path.unlink(missing_ok=True)
            return None

    def put(self, i: int, unit: U.Unit, result: dict) -> None:
        path = self._path(i, unit)
        tmp = path.with_name(path.name + ".tmp")
        skips = json.dumps({"skipped": result["skipped"], "examples": result["examples"]})
        with open(tmp, "wb") as f:
            np.savez(f, **{k: result[k] for k in ARRAYS}, skips=np.array(skips))
        os.replace(tmp, path)


def auto_processes(units: list[U.Unit]) -> int:
    """One process per core, no more than there are units (1: encode in this process)."""
    return max(1, min(os.cpu_count() or 1, len(units)))


def _init_worker(threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read by tokenizers when it starts its pool


def _executor(processes: int, threads: int, ray_address: str):
    """(submit(unit) -> handle, result(handle) -> dict, slots, close())."""
    if ray_address:
        return _ray_executor(ray_address, threads)
    import concurrent.futures as cf
    import multiprocessing

    # spawn, not fork: the parent may hold tokenizers' thread pool (and JAX's), which a fork breaks
    pool = cf.ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"), _init_worker, (threads,))

    def close():
        pool.shutdown(wait=True, cancel_futures=True)

    return (lambda fn, *a: pool.submit(fn, *a)), (lambda h: h.result()), processes, close


def _ray_executor(address: str, threads: int):
    try:
        import ray
    except ImportError:
        raise ConfigError("meshlm data prepare --ray needs Ray: pip install 'meshlm[ray]'") from None
    started = not ray.is_initialized()
    if started:
        local = address == "local"
        ray.init(address=None if local else address, include_dashboard=False, log_to_driver=False)
    remote = {}

    def submit(fn, *args):
        if fn not in remote:
            remote[fn] = ray.remote(num_cpus=threads, runtime_env={"env_vars": {"RAYON_NUM_THREADS": str(threads)}})(fn)
        return remote[fn].remote(*args)

    def close():
        if started:
            ray.shutdown()

    slots = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
    return submit, ray.get, slots, close


def run(
    units: list[U.Unit],
    encode_args: tuple,
    work: WorkDir,
    processes: int = 1,
    threads: int = 1,
    ray_address: str = "",
) -> Iterator[tuple[int, dict]]:
    """(index, result) of every unit, in order; finished units come from `work`, the others are
    encoded here (processes <= 1 and no Ray), by `processes` spawned processes, or by Ray tasks
    (`ray_address`: an address, "auto", or "local" for a private local cluster). Stop iterating to
    cancel what is not started."""
    if processes <= 1 and not ray_address:
        for i, unit in enumerate(units):
            result = work.get(i, unit)
            if result is None:
                result = U.encode(unit, *encode_args)
                work.put(i, unit, result)
            yield i, result
        return
    submit, result_of, slots, close = _executor(processes, threads, ray_address)
    try:
        window: collections.deque = collections.deque()  # (index, unit, handle; None: finished earlier)
        todo = iter(enumerate(units))
        while True:
            while len(window) < 2 * slots:  # every slot busy, and the next units ready
                nxt = next(todo, None)
                if nxt is None:
                    break
                window.append((*nxt, None if work.has(*nxt) else submit(U.encode, nxt[1], *encode_args)))
            if not window:
                return
            i, unit, handle = window.popleft()
            result = work.get(i, unit) if handle is None else None
            if result is None:  # not kept, or kept damaged
                result = result_of(handle) if handle is not None else U.encode(unit, *encode_args)
                work.put(i, unit, result)
            yield i, result
    finally:
        close()
