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


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A small text corpus (24 files of short word lines) for runs through the trainer."""
    import numpy as np

    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "mesh", "shard", "token", "layer", "device", "batch"]
    for i in range(24):
        (root / f"{i}.txt").write_text("\n".join(" ".join(rng.choice(words, 9)) for _ in range(50)))
    return root
