"""Backend XLA flags: chosen in one place, added only for a CUDA backend, the user's value wins,
and every flag is one XLA knows (an unknown flag in XLA_FLAGS aborts JAX at start-up)."""

import os
import subprocess
import sys

from meshlm.platform import xla_flags


def test_gpu_flags_are_added_only_for_gpu_and_never_override_the_user():
    assert xla_flags.with_backend_flags("--a=1", gpu=False) == "--a=1"
    user = "--xla_gpu_enable_latency_hiding_scheduler=false"
    out = xla_flags.with_backend_flags(user, gpu=True).split()
    assert out[0] == user and "--xla_gpu_enable_latency_hiding_scheduler=true" not in out
    assert set(out[1:]) == set(xla_flags.GPU_FLAGS[1:])


def test_flags_follow_the_backend_jax_will_start(monkeypatch):
    """Decided the same way on every host: the CUDA plugins are stood in for (a module that does
    not exist, then one that does), so a CUDA host cannot pass this test by having the flags."""
    monkeypatch.setattr(xla_flags, "CUDA_PLUGINS", ("meshlm_no_such_cuda_plugin",))
    env = {"XLA_FLAGS": "--x=1"}
    xla_flags.apply(env)
    assert env["XLA_FLAGS"] == "--x=1"  # no CUDA plugin: no flags
    monkeypatch.setattr(xla_flags, "CUDA_PLUGINS", ("json",))  # an importable module as the plugin
    env = {"XLA_FLAGS": "--x=1"}
    xla_flags.apply(env)
    assert env["XLA_FLAGS"].split() == ["--x=1", *xla_flags.GPU_FLAGS]
    for platforms in ("cpu", "tpu", "cpu,tpu"):  # a plugin, but JAX told not to start CUDA
        env = {"XLA_FLAGS": "--x=1", "JAX_PLATFORMS": platforms}
        xla_flags.apply(env)
        assert env["XLA_FLAGS"] == "--x=1", platforms
    for platforms in ("cuda", "gpu", "cuda,cpu"):
        assert xla_flags.gpu_backend_expected({"JAX_PLATFORMS": platforms}), platforms
    off = {"MESHLM_XLA_TUNING": "0", "XLA_FLAGS": ""}
    xla_flags.apply(off)
    assert off["XLA_FLAGS"] == ""


def test_every_gpu_flag_is_known_to_xla():
    """XLA parses every flag in XLA_FLAGS at backend start and aborts on an unknown one, CPU builds
    included, so starting JAX on CPU with the GPU flags checks their spelling."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"XLA_FLAGS": " ".join(xla_flags.GPU_FLAGS), "JAX_PLATFORMS": "cpu"}
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x + 1)(jnp.ones(()))))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "2.0", run.stderr[-500:]
    bad = env | {"XLA_FLAGS": "--xla_gpu_no_such_flag=true"}
    run = subprocess.run([sys.executable, "-c", code], env=bad, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Unknown flag" in run.stderr
