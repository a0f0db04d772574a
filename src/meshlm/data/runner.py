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
OPTIONAL = ("flags",)  # chat and completion records: each token's flags (units.FLAG_*)


class WorkDir:
    """Finished units of one preparation, in `root`; `salt` names what else decides their bytes
    (the unit format's version, the tokenizer, the field). A unit finished while skipping bad input
    is not reused by a strict preparation, which must stop at that input instead."""

    def __init__(self, root: Path, salt: str, strict: bool):
        self.root, self.salt, self.strict = root, f"{U.VERSION}:{salt}", strict
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, i: int, unit: U.Unit) -> Path:
        key = hashlib.blake2b(f"{unit.key()}:{self.salt}".encode(), digest_size=10).hexdigest()
        return self.root / f"{i:06d}-{key}.npz"

    def has(self, i: int, unit: U.Unit) -> bool:
        return self._path(i, unit).is_file()

    def get(self, i: int, unit: U.Unit) -> dict | None:
        path = self._path(i, unit)
        try:
            with np.load(path) as z:
                out = {k: z[k] for k in ARRAYS + OPTIONAL if k in ARRAYS or k in z.files}
                out |= json.loads(str(z["skips"]))
        except FileNotFoundError:
            return None
        except Exception:  # damaged (a disk error): encode it again
            path.unlink(missing_ok=True)
            return None
        return None if self.strict and out["skipped"] else out

    def put(self, i: int, unit: U.Unit, result: dict) -> None:
        """Keep a result: written under a name of this process's and renamed, so that a reader (or
        another preparation of the same output) only ever sees whole files."""
        path = self._path(i, unit)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        skips = json.dumps({"skipped": result["skipped"], "examples": result["examples"]})
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                np.savez(f, **{k: result[k] for k in ARRAYS + OPTIONAL if k in result}, skips=np.array(skips))
            os.replace(tmp, path)
        except FileNotFoundError:  # another preparation of the same output finished and removed it all
            tmp.unlink(missing_ok=True)


def auto_processes(units: list[U.Unit]) -> int:
    """One process per core, no more than there are units (1: encode in this process)."""
    return max(1, min(os.cpu_count() or 1, len(units)))


def _init_worker(threads: int, tokenizer: U.TokenizerSource) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read by tokenizers when it starts its pool
    tokenizer.load()  # once; the tasks carry only its key


def _executor(processes: int, threads: int, ray_address: str, encode_args: tuple):
    """(submit(unit) -> handle, result(handle) -> dict, slots, close(handles not yet taken))."""
    if ray_address:
        return _ray_executor(ray_address, threads, encode_args)
    import concurrent.futures as cf
    import multiprocessing

    # spawn, not fork: the parent may hold tokenizers' thread pool (and JAX's), which a fork breaks
    tokenizer, *rest = encode_args
    pool = cf.ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"), _init_worker, (threads, tokenizer))

    def close(pending):
        pool.shutdown(wait=True, cancel_futures=True)  # the running units finish; the others never start

    submit = lambda unit: pool.submit(U.encode, unit, tokenizer.without_json(), *rest)
    return submit, (lambda h: h.result()), processes, close


def _ray_executor(address: str, threads: int, encode_args: tuple):
    try:
        import ray
    except ImportError:
        raise ConfigError("meshlm data prepare --ray needs Ray: pip install 'meshlm[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False)
    env = {"env_vars": {"RAYON_NUM_THREADS": str(threads)}}
    encode = ray.remote(num_cpus=threads, runtime_env=env)(U.encode)
    tokenizer, *rest = encode_args
    shared = ray.put(tokenizer)  # stored once; each task reads it from the object store

    def close(pending):
        for ref in pending:  # on a cluster that outlives this preparation, stop what it no longer needs
            ray.cancel(ref)
        if started:
            ray.shutdown()

    slots = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
    return (lambda unit: encode.remote(unit, shared, *rest)), ray.get, slots, close


def run(
    units: list[U.Unit],
    encode_args: tuple,  # (units.TokenizerSource, field, strict, chat.Format)
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
    submit, result_of, slots, close = _executor(processes, threads, ray_address, encode_args)
    window: collections.deque = collections.deque()  # (index, unit, handle; None: finished earlier)
    try:
        todo = iter(enumerate(units))
        while True:
            while len(window) < 2 * slots:  # every slot busy, and the next units ready
                nxt = next(todo, None)
                if nxt is None:
                    break
                window.append((*nxt, None if work.has(*nxt) else submit(nxt[1])))
            if not window:
                return
            i, unit, handle = window.popleft()
            result = work.get(i, unit) if handle is None else None
            if result is None:  # not kept, kept damaged, or kept with skips by a strict preparation
                result = result_of(handle) if handle is not None else U.encode(unit, *encode_args)
                work.put(i, unit, result)
            yield i, result
    finally:
        close([h for _, _, h in window if h is not None])
