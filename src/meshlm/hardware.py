"""Peak FLOP/s of the devices a run uses: a table for accelerators, a measured probe for CPUs.

On CPU there is no datasheet number worth quoting, so the peak is a jitted square matmul timed on
this machine (best of several runs), cached per (CPU, dtype). All simulated CPU devices share the
same cores, so the probe measures the whole host and MFU is quoted against the host.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

# Dense peak FLOP/s per chip, by dtype. Sources: vendor datasheets (bf16/fp16 dense, no sparsity).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "a100": {"bfloat16": 312e12, "float32": 19.5e12},
    "h100": {"bfloat16": 989e12, "float32": 67e12},
    "h200": {"bfloat16": 989e12, "float32": 67e12},
    "tpu v4": {"bfloat16": 275e12, "float32": 275e12 / 4},
    "tpu v5p": {"bfloat16": 459e12, "float32": 459e12 / 4},
    "tpu v5 lite": {"bfloat16": 197e12, "float32": 197e12 / 4},
}


def _cache_file() -> Path:
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm")) / "peak_flops.json"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_matmul_flops(dtype: str, n: int = 1024, repeats: int = 7) -> float:
    x = jnp.ones((n, n), jnp.dtype(dtype), device=jax.local_devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def peak_flops(dtype: str, n_devices: int) -> tuple[float, str]:
    """(peak FLOP/s of a run on `n_devices` devices, a short description of where it came from).

    Accelerators: the datasheet figure per chip times the devices the run uses (across every
    process). CPU: the measured matmul peak of this host, which all its simulated devices, and all
    processes on it, share."""
    dev = jax.local_devices()[0]
    kind = dev.device_kind.lower()
    if dev.platform != "cpu":
        for name, table in PEAK_FLOPS.items():
            if name in kind:
                return table[dtype] * n_devices, f"{name} datasheet x{n_devices}"
        return 0.0, f"unknown device {dev.device_kind!r}: no peak, MFU not reported"
    key = f"{_cpu_name()}|{os.cpu_count()}|{dtype}"
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = probe_matmul_flops(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=2))
        os.replace(tmp, path)  # atomic: concurrent processes never read half a file
    return cache[key], f"CPU matmul probe {cache[key] / 1e9:.0f} GFLOP/s ({dtype}, host)"
