"""The accelerators meshlm knows, in one table, and the peak FLOP/s a run is measured against.

One `Accelerator` per chip model: the exact `device_kind` strings JAX reports for it, its memory,
its dense peak per matmul precision, and its links (the planner's inputs). The CLI names
(`meshlm plan --device h100`), the planner and MFU all read this table; a chip that is not in it
gets no MFU rather than a guess (an H100 PCIe is not an H100 SXM).

MFU must be quoted against the peak of the arithmetic that really runs, which is not always the
parameter dtype: JAX computes float32 matmuls with TF32 tensor cores on NVIDIA GPUs and with one
bfloat16 pass on TPUs unless `jax_default_matmul_precision` asks for more (`matmul_precision`).

On CPU there is no datasheet number worth quoting, so the peak is a jitted square matmul timed on
this machine (best of several runs), cached per (CPU model, generation and vector extensions, CPUs
the process may use, dtype): a cache shared by hosts of one model name but another CPU generation,
or written by a run pinned to fewer cores, is not reused. All simulated CPU devices share the same
cores, so the probe measures every CPU the process may use and MFU is quoted against those. A probe
taken on a busy host reads low; when a single-host run then computes more model FLOPs per second than
it, the run's rate replaces it (`raise_cpu_peak`), so such a run never reports MFU above 100%.

JAX is imported inside the functions that need a device, so the CLI can read the table before
it sets the simulated device count.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshlm.config import cache_home

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """Datasheet figures of one chip model. `peak` is dense (no sparsity) FLOP/s per chip by the
    precision the matmul units run: "bf16", "tf32", "fp32" (TPUs: fp32 is emulated by 3 or 6
    bf16 passes, see `peak_for`). Links: per-device bandwidth, one direction, inside a node
    (NVLink / ICI) and across nodes (InfiniBand per GPU; TPU slices stay on ICI)."""

    name: str  # the CLI's spelling: meshlm plan --device NAME
    platform: str  # "gpu" or "tpu"
    device_kinds: tuple[str, ...]  # jax.Device.device_kind, matched exactly
    memory: float  # bytes per chip
    peak: dict[str, float]
    intra_bw: float
    inter_bw: float
    per_node: int
    source: str


def _nvidia(name, kinds, memory_gib, sparse, fp32, links, source) -> Accelerator:
    """`sparse` = (bf16, tf32) tensor-core TFLOP/s as NVIDIA prints them, "with sparsity": dense is
    half. `links` = (intra-node GB/s per direction, inter-node GB/s per GPU)."""
    bf16, tf32 = sparse
    peak = {"bf16": bf16 * T / 2, "tf32": tf32 * T / 2, "fp32": fp32 * T}
    return Accelerator(name, "gpu", kinds, memory_gib * GiB, peak, links[0] * 1e9, links[1] * 1e9, 8, source)


def _tpu(name, kinds, memory_gib, bf16, ici, chips_per_slice, source) -> Accelerator:
    """TPUs: `bf16` dense TFLOP/s; ICI GB/s per direction; the largest slice stays on ICI."""
    peak = {"bf16": bf16 * T}
    return Accelerator(name, "tpu", kinds, memory_gib * GiB, peak, ici * 1e9, ici * 1e9, chips_per_slice, source)


T = 1e12
# Inter-node bandwidth per GPU: A100 nodes with HDR InfiniBand (200 Gb/s = 25 GB/s per GPU), H100/H200
# nodes with NDR (400 Gb/s = 50 GB/s). PCIe H100s talk over PCIe Gen5 x16 (64 GB/s) inside a node.
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        _nvidia("a100", ("NVIDIA A100-SXM4-80GB",), 80, (624, 312), 19.5, (300, 25), "A100 SXM4 datasheet"),
        _nvidia("a100-40gb", ("NVIDIA A100-SXM4-40GB",), 40, (624, 312), 19.5, (300, 25), "A100 SXM4 datasheet"),
        _nvidia("h100", ("NVIDIA H100 80GB HBM3",), 80, (1979, 989), 67, (450, 50), "H100 SXM5 datasheet"),
        _nvidia("h100-pcie", ("NVIDIA H100 PCIe",), 80, (1513, 756), 51, (64, 50), "H100 PCIe datasheet"),
        _nvidia("h100-nvl", ("NVIDIA H100 NVL",), 94, (1671, 835), 60, (300, 50), "H100 NVL datasheet"),
        _nvidia("h200", ("NVIDIA H200",), 141, (1979, 989), 67, (450, 50), "H200 SXM datasheet"),
        # H800: the H100 SXM's compute with NVLink cut to 400 GB/s (NVIDIA's H800 spec; 200 per direction);
        # InfiniBand 50 GB/s per GPU (DeepSeek-V3 3.2.2, which measured NVLink at 160 GB/s)
        _nvidia("h800", ("NVIDIA H800", "NVIDIA H800 80GB HBM3"), 80, (1979, 989), 67, (200, 50), "H800 SXM spec"),
        _tpu("tpu-v4", ("TPU v4",), 32, 275, 300, 4096, "Cloud TPU v4 docs"),
        _tpu("tpu-v5e", ("TPU v5 lite", "TPU v5e"), 16, 197, 200, 256, "Cloud TPU v5e docs"),
        _tpu("tpu-v5p", ("TPU v5p", "TPU v5"), 95, 459, 600, 8960, "Cloud TPU v5p docs"),
        _tpu("tpu-v6e", ("TPU v6 lite", "TPU v6e"), 32, 918, 400, 256, "Cloud TPU v6e docs"),
    )
}
BY_DEVICE_KIND: dict[str, Accelerator] = {k: a for a in ACCELERATORS.values() for k in a.device_kinds}

# jax_default_matmul_precision values -> the coarse level they select ("default" when unset).
_LEVELS = {
    None: "default",
    "default": "default",
    "fastest": "default",
    "bfloat16": "default",
    "high": "high",
    "tensorfloat32": "high",
    "bfloat16_3x": "high",
    "highest": "highest",
    "float32": "highest",
}


def _level(value) -> str:
    """A precision setting, or a `jax.lax.DotAlgorithmPreset` name (e.g. "F32_F32_F32",
    "TF32_TF32_F32", "BF16_BF16_F32_X3"), as default / high / highest / tf32."""
    text = None if value is None else str(value).lower().removeprefix("dotalgorithmpreset.")
    if text in _LEVELS:
        return _LEVELS[text]
    if text.startswith("f32_f32_f32") or text.endswith(("_x6", "_x9")):
        return "highest"
    if text.startswith("tf32"):
        return "tf32"
    if text.endswith("_x3"):
        return "high"
    return "default"  # "any_...", "bf16_bf16_f32", fp16 and fp8 presets: the fast path


def matmul_precision(dtype: str, platform: str, level: str | None = None) -> str:
    """The arithmetic a matmul of `dtype` operands runs on `platform` ("gpu", "tpu", "cpu").

    bfloat16 operands run bf16 everywhere. float32 operands follow `jax_default_matmul_precision`
    (`level`; read from JAX's config when None): on NVIDIA GPUs TF32 unless it is highest/float32
    (or the F32_F32_F32 algorithm); on TPUs one bf16 pass by default, 3 (high) or 6 (highest)
    passes. CPUs compute in fp32.
    """
    if dtype == "bfloat16":
        return "bf16"
    if level is None:
        import jax

        level = jax.config.jax_default_matmul_precision
    coarse = _level(level)
    if platform == "gpu":
        return "fp32" if coarse == "highest" else "tf32"
    if platform == "tpu":
        return {"default": "bf16", "tf32": "bf16x3", "high": "bf16x3", "highest": "bf16x6"}[coarse]
    return "fp32"


def peak_for(acc: Accelerator, precision: str) -> float:
    """Dense peak FLOP/s per chip at `precision` (see `matmul_precision`)."""
    if precision in ("bf16x3", "bf16x6"):
        return acc.peak["bf16"] / int(precision[-1])
    return acc.peak[precision]


def _cache_file() -> Path:
    return cache_home() / "peak_flops.json"


# What sets a CPU's matmul speed beyond its model name: hosts that share one ("AMD EPYC") across
# generations differ several-fold in the probe by their vector units (AVX2 against AVX-512), and
# generations with the same extensions by how wide those run (x86 "cpu family" and "model" tell them
# apart).
_CPUINFO = Path("/proc/cpuinfo")
_VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "asimd", "sve", "sve2")


def _cpuinfo() -> dict[str, str]:
    """The first CPU's "model name", "cpu family", "model" and "flags" (or "Features") lines of
    /proc/cpuinfo; empty where the file or a line is missing."""
    wanted, found = ("model name", "cpu family", "model", "flags", "Features"), {}
    try:
        for line in _CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in wanted and key not in found:
                found[key] = value.strip()
            elif not key and found:  # the blank line after the first CPU
                break
    except OSError:
        pass
    return found


def cpu_description() -> str:
    """This host's CPU as benchmarks and the CPU peak's cache name it, e.g.
    "AMD EPYC (family 26 model 2; avx2, fma, avx512f, avx512_bf16)"."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    has_generation = "cpu family" in info and "model" in info
    generation = f"family {info['cpu family']} model {info['model']}" if has_generation else ""
    vector = ", ".join(f for f in _VECTOR_FLAGS if f in flags)
    details = "; ".join(x for x in (generation, vector) if x)
    return f"{name} ({details})" if details else name


def _usable_cpus() -> int:
    """The CPUs this process may run on (a pinned process probes, and computes, on those only)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        return os.cpu_count() or 1


def probe_matmul_flops(dtype: str, n: int = 1024, repeats: int = 20) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((n, n), jnp.dtype(dtype), device=jax.local_devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _cpu_key(dtype: str) -> str:
    return f"{cpu_description()}|{_usable_cpus()} cpus|{dtype}"


def _update_cache(key: str, update: Callable[[dict | None], dict]) -> dict:
    """Sets the cached CPU peak under `key` to `update(cached entry or None)` and returns it; an
    entry is {"flops": FLOP/s, "from": "probe" | "run"}. The cache is read and written under an
    exclusive file lock, so processes that start together on one host (`meshlm launch --processes
    N`) probe one at a time rather than side by side. A cache directory this process cannot write
    is read without the lock and left as it is."""
    path = _cache_file()
    lock_path = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o666)  # flock needs no write access
    except OSError:
        lock = None
    try:
        if lock is not None:
            with contextlib.suppress(OSError):  # a file system without locks: go on unlocked
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the descriptor closes
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        old = cache.get(key)
        if isinstance(old, float | int):  # written by an older meshlm: a bare probe result
            old = {"flops": float(old), "from": "probe"}
        entry = update(old)
        if lock is not None and entry != old:
            cache[key] = entry
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            try:
                tmp.write_text(json.dumps(cache, indent=2))
                os.replace(tmp, path)  # atomic: a reader never sees half a file
            except OSError:
                tmp.unlink(missing_ok=True)
        return entry
    finally:
        if lock is not None:
            os.close(lock)


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of the whole run (0: unknown, no MFU)
    source: str  # where it comes from, for the startup line and run.json
    label: str  # short tag for the progress line, e.g. "h100 tf32" or "CPU probe"


def _cpu_peak(entry: dict, dtype: str) -> Peak:
    flops = entry["flops"]
    how = "matmul probe" if entry["from"] == "probe" else "a run's model FLOP rate, above the matmul probe"
    return Peak(flops, f"CPU peak {flops / 1e9:.0f} GFLOP/s ({how}; {dtype}, host)", "CPU probe")


def peak_flops(dtype: str, n_devices: int) -> Peak:
    """The peak FLOP/s of a run on `n_devices` devices, and where it came from.

    Accelerators: the datasheet figure per chip at the precision the matmuls really run, times the
    devices the run uses (across every process). CPU: the measured matmul peak of this host, which
    all its simulated devices, and all processes on it, share."""
    import jax

    dev = jax.local_devices()[0]
    if dev.platform != "cpu":
        acc = BY_DEVICE_KIND.get(dev.device_kind)
        if acc is None:
            return Peak(
                0.0, f"unknown device {dev.device_kind!r}: no peak in meshlm.platform.hardware, MFU not reported", ""
            )
        precision = matmul_precision(dtype, acc.platform)
        source = f"{acc.source}, {precision} matmuls, x{n_devices} devices"
        return Peak(peak_for(acc, precision) * n_devices, source, f"{acc.name} {precision}")
    entry = _update_cache(
        _cpu_key(dtype),
        lambda cached: {"flops": probe_matmul_flops(dtype), "from": "probe"} if cached is None else cached,
    )
    return _cpu_peak(entry, dtype)


def raise_cpu_peak(peak: Peak, flops_per_s: float, dtype: str) -> Peak:
    """`peak`, or - when it is a CPU probe and a run has just computed faster - that rate, cached for
    later runs. `flops_per_s` is the run's model FLOPs (P2 Eq. 7) over its step time: at most the
    FLOPs that ran (hardware FLOPs can be more, where XLA merges recomputation), so it is a measured
    lower bound of this host's peak - but for one excess: causal attention, counted in full while
    the attention kernels (explicit in query chunks, the default, and blockwise) skip masked score
    blocks; a few percent of the model FLOPs at short sequences (3% for issue 11's small gpt at
    s = 256), so a raised peak can read that much high, never MFU above 100%. Call it from
    single-host runs only: a run over several hosts computes more than one host's peak."""
    if peak.label != "CPU probe" or flops_per_s <= peak.flops:
        return peak

    def higher(cached: dict | None) -> dict:
        if cached is not None and cached["flops"] >= flops_per_s:
            return cached
        return {"flops": flops_per_s, "from": "run"}

    return _cpu_peak(_update_cache(_cpu_key(dtype), higher), dtype)
