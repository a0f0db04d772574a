"""XLA flags per backend, chosen in one place and applied before JAX starts a backend.

Only GPU runs get flags today, those the JAX/MaxText GPU performance guides recommend for
sharded training: the latency-hiding scheduler (overlaps collectives with compute), pipelined
all-gather / reduce-scatter / all-reduce inside loops (the layer scan), while-loop double
buffering, and collective combining up to 128 MiB (fewer, larger NCCL calls). CPU runs get none:
every XLA:CPU flag tried was within noise (BENCHMARKS-history.md, "Tried and not kept: XLA:CPU options and others").

The flags are parsed by every jaxlib build, CPU-only ones included (a test starts JAX on CPU with
them), but their effect on a GPU is unmeasured here: no GPU was lent to the sessions that wrote
this (`benchmarks/gpu.sh` measures it where one is). A flag the user already set in XLA_FLAGS wins;
`MESHLM_XLA_TUNING=0` turns all of this off. Imports nothing from JAX on purpose.
"""

from __future__ import annotations

import importlib.util
import os
import sys

COMBINE_BYTES = 128 * 2**20
GPU_FLAGS: tuple[str, ...] = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    f"--xla_gpu_all_gather_combine_threshold_bytes={COMBINE_BYTES}",
    f"--xla_gpu_reduce_scatter_combine_threshold_bytes={COMBINE_BYTES}",
    f"--xla_gpu_all_reduce_combine_threshold_bytes={COMBINE_BYTES}",
)
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def gpu_backend_expected(env: dict[str, str] | None = None) -> bool:
    """Whether JAX will start a CUDA backend: a CUDA plugin is installed and JAX_PLATFORMS allows it."""
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms.split(",") for p in ("cuda", "gpu")):
        return False
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def with_backend_flags(xla_flags: str, gpu: bool) -> str:
    """`xla_flags` plus the backend's flags that it does not set already (the user's value wins)."""
    if not gpu:
        return xla_flags
    present = {f.split("=")[0] for f in xla_flags.split()}
    extra = [f for f in GPU_FLAGS if f.split("=")[0] not in present]
    return " ".join([*xla_flags.split(), *extra])


def flags_for(env: dict[str, str] | None = None) -> str:
    """The XLA_FLAGS this process should start JAX with: its own, plus the backend's."""
    env = os.environ if env is None else env
    if env.get("MESHLM_XLA_TUNING", "1") == "0":
        return env.get("XLA_FLAGS", "")
    return with_backend_flags(env.get("XLA_FLAGS", ""), gpu_backend_expected(env))


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def without_device_count(xla_flags: str) -> str:
    """`xla_flags` minus the simulated host device count (each process sets its own with --devices);
    every other flag the user set is kept."""
    return " ".join(f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG))


def with_device_count(xla_flags: str, n: int) -> str:
    """`xla_flags` simulating `n` host devices (replacing any count already there)."""
    return " ".join([*without_device_count(xla_flags).split(), f"{DEVICE_COUNT_FLAG}={n}"])


def prepare_backend(n_host_devices: int, cpu: bool) -> bool:
    """Before JAX is imported: the backend's flags and `n_host_devices` simulated host devices, and
    with `cpu` the CPU platform unless the user chose one. False (nothing done) once JAX is loaded:
    it reads these once, at import."""
    if "jax" in sys.modules:
        return False
    apply()
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n_host_devices)
    if cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return True


def apply(env: dict[str, str] | None = None) -> None:
    """Set XLA_FLAGS for the backend this process will use (call before JAX starts a backend)."""
    env = os.environ if env is None else env
    env["XLA_FLAGS"] = flags_for(env)
