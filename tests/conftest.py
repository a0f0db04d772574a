"""Test session setup: 8 simulated CPU devices (set before jax is imported anywhere) and a
private cache directory so tests never read or write the user's ~/.cache."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count", "--ignored")
    + " --xla_force_host_platform_device_count=8"
)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("MESHLM_CACHE", tempfile.mkdtemp(prefix="meshlm-test-cache-"))

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 simulated CPU devices"
    return devs
