"""Host memory reuse on CPU: keep the step's freed memory in the process instead of returning it.

XLA:CPU allocates each execution's temporary buffer (one block holding every intermediate of the
step: 326 MiB for issue 11's small gpt config) with `malloc` and frees it when the step ends. glibc
serves a block that large with a fresh `mmap` and returns it with `munmap`, so every step faults
its whole temporary buffer in again, page by page, and the kernel zeroes each page: ~83k minor
faults per step for that config (BENCHMARKS.md, "Host memory reuse on CPU"). Three `mallopt` settings make
glibc keep and reuse that memory:

- `M_ARENA_MAX=1` (`apply`, before JAX starts threads: glibc fixes the arena limit when a thread
  first needs a second arena): every thread allocates from the main arena. XLA's worker threads
  allocate the temporary buffers, and a per-thread arena would `mmap` any block over its 64 MiB heap.
- `M_MMAP_MAX=0` and `M_TRIM_THRESHOLD=-1` (`keep_freed`, once the step is compiled): no block is
  served by `mmap` (the main arena grows with `brk`), and freed memory at the top of the heap is
  never returned (-1 turns trimming off, mallopt(3)), so later steps reuse pages that are already
  resident. A finite threshold (at most 2 GiB: mallopt takes an int) returns the heap's top once
  its free chunk passes it, and one process's devices free their temporary buffers together (4
  simulated devices of a zb1 pipeline passed it: `benchmarks/pipeline.py`'s zb1 went from 0.84x to
  0.97x one device at m = 16 with trimming off).

The price is resident memory: the heap keeps its peak, and small allocations that land in a freed
temporary buffer between steps push the next one higher (one-off measurement, `meshlm train` on the
small gpt config, RSS sampled every 50 ms: 1.5-1.8 GiB resident in two runs instead of 0.9 GiB, flat
from about step 20-25 of 40). So `keep_freed` turns reuse on only when `RESIDENT_FACTOR` times the
temporary buffer fits in half of the memory available once the state and data are loaded (each
process of a multi-process run judges for itself), and the trainer keeps one step in flight
(`steps_in_flight`). Only `meshlm train` applies it. GPU runs and non-glibc platforms (macOS, musl)
keep glibc's defaults; `MESHLM_MALLOC_TUNING=0` turns all of this off. Imports nothing from JAX.
"""

from __future__ import annotations

import ctypes
import os
import platform

from meshlm.platform import xla_flags

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h>
TRIM_THRESHOLD = -1  # trimming off
RESIDENT_FACTOR = 4  # peak RSS growth under reuse, in temporary buffers, with margin (measured 0.9-3.0, BENCHMARKS.md)

_state: str = "not applied (glibc defaults)"  # "off (why)", "ready (...)" or "on (...)": run log, run.json


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


def reason_to_skip(env: dict[str, str] | None = None) -> str | None:
    """Why this process keeps glibc's default allocator behaviour, or None if it may be tuned."""
    env = os.environ if env is None else env
    if env.get("MESHLM_MALLOC_TUNING", "1") == "0":
        return "off (MESHLM_MALLOC_TUNING=0)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"off (not glibc: {platform.system()} {platform.libc_ver()[0] or 'unknown libc'})"
    if xla_flags.gpu_backend_expected(env):
        return "off (GPU backend: the step's buffers are device memory)"
    return None


def apply(env: dict[str, str] | None = None) -> str:
    """First half, before JAX (or PyTorch) starts threads: one malloc arena, unless `reason_to_skip`
    says not to. Returns this process's state."""
    global _state
    if _state.startswith(("ready", "on")):  # already applied in this process
        return _state
    skip = reason_to_skip(env)
    if skip is not None:
        _state = skip
    elif _libc().mallopt(M_ARENA_MAX, 1) != 1:  # mallopt returns 1 on success
        _state = "off (mallopt refused M_ARENA_MAX)"
    else:
        _state = "ready (one arena; reuse not switched on yet)"
    return _state


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def keep_freed(temp_bytes: int | None, available: int | None = None) -> str:
    """Second half, once the step is compiled: keep freed memory for reuse if `apply` got ready and
    `RESIDENT_FACTOR * temp_bytes` (the step's temporary buffer, from XLA's memory analysis) fits in
    half of `available` (default: MemAvailable now); `temp_bytes=None` skips that check. Returns
    this process's state. `temp_bytes` counts every local device's buffer (the trainer multiplies
    the per-device figure by the local device count)."""
    global _state
    if not _state.startswith("ready"):
        return _state
    available = available_bytes() if available is None else available
    if temp_bytes is not None and available is not None and RESIDENT_FACTOR * temp_bytes > available // 2:
        _state = (
            f"off ({RESIDENT_FACTOR} x the step's {temp_bytes / 2**20:.0f} MiB temporary buffer would not fit in "
            f"half of the {available / 2**30:.1f} GiB available)"
        )
        return _state
    libc = _libc()
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        libc.mallopt(M_MMAP_MAX, 65536)  # glibc's default
        _state = "off (mallopt refused M_MMAP_MAX or M_TRIM_THRESHOLD)"
    else:
        _state = "on (glibc: one arena, no mmap, freed memory kept)"
    return _state


def steps_in_flight() -> int | None:
    """How many train steps the loop may have dispatched and unfinished at once (None: no limit).

    Each step in flight holds its own temporary buffer from the moment it is dispatched. With glibc's
    defaults the buffers of queued steps are fresh mappings, resident only while their step runs; with
    reuse, every buffer a step has touched stays resident, so a loop running ten steps ahead would
    keep ten (one-off measurement, issue 11's small gpt, ten steps dispatched at once: 2.4 GiB resident
    against 1.1 GiB when each step is waited for). With one step in flight the host still assembles
    the next batch while the step runs."""
    return 1 if _state.startswith("on") else None
