"""Test session setup: 8 simulated CPU devices (set before jax is imported anywhere) and a
private cache directory so tests never read or write the user's ~/.cache."""

import atexit
import os
import shutil
import subprocess
import tempfile

from meshlm.platform.xla_flags import with_device_count  # jax-free

# The test programs are compiled for a short compile, not a fast run: LLVM at -O0 and XLA:CPU's
# elemental emitters instead of its fusion emitters. Compilation is most of the suite's time on 2
# cores, and these two flags cut it 3.6x (tests/test_step.py: 50 s of backend compile -> 14 s).
# The programs are the ones users run - the same HLO, shardings, collectives and buffer sizes, which
# is what the tests check - only their machine code is less optimised (elementwise rounding may
# differ in the last bits; no test compares against a golden from an optimised build at a tolerance
# tighter than that). Subprocesses that train inherit them (`helpers.subprocess_env`), except the
# README's default job, which runs as a user runs it.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# any device count already set (the user's, or pytest-xdist's controller's, which workers inherit) is replaced
_flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if f.split("=")[0] not in {t.split("=")[0] for t in TEST_XLA_FLAGS}
]
os.environ["XLA_FLAGS"] = with_device_count(" ".join([*_flags, *TEST_XLA_FLAGS]), 8)
os.environ["JAX_PLATFORMS"] = "cpu"
if "MESHLM_CACHE" not in os.environ:  # made here (the controller, or a run without workers): removed at exit
    os.environ["MESHLM_CACHE"] = tempfile.mkdtemp(prefix="meshlm-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MESHLM_CACHE"], True)
if os.environ.get("PYTEST_XDIST_WORKER"):  # each pytest-xdist worker its own cache, below the controller's
    os.environ["MESHLM_CACHE"] = os.path.join(os.environ["MESHLM_CACHE"], os.environ["PYTEST_XDIST_WORKER"])

import jax  # noqa: E402 (after the environment above: jax reads it once, at import)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The longest files first: pytest-xdist (--dist=loadfile) hands whole files to the workers in
# collection order, so the files that take minutes start at once instead of leaving one worker
# running alone at the end (about 300 s and 150 s for the first two on a 2-core host).
LONGEST_FIRST = ("test_multiprocess.py", "test_hf.py", "test_checkpoint.py", "test_attention.py", "test_pipeline.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: order within a file kept


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


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The README's main job, run once as a user runs it (`meshlm train`, the default `tiny`
    recipe on the built-in corpus, in a subprocess): its run directory, shared by the tests that
    check what it learned and what is done with it afterwards (export, generate, eval). Under
    pytest-xdist the workers share it: the first to ask trains, the others wait on a lock."""
    import fcntl
    import sys

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's directory, above each worker's own
    run, done, failed = root / "default-job" / "tiny", root / "default-job.done", root / "default-job.failed"
    with open(root / "default-job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists() and not failed.exists():
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as a user runs it
            try:
                r = subprocess.run(
                    [sys.executable, "-m", "meshlm", "train", "--run-dir", str(run)],
                    capture_output=True,
                    text=True,
                    timeout=900,
                    env=env,
                )
                (done if r.returncode == 0 else failed).write_text(r.stderr[-3000:])
            except BaseException as e:  # a timeout: the other workers must not train it again
                failed.write_text(repr(e))
                raise
    assert not failed.exists(), failed.read_text()
    return run


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(name, size) -> a tmpfs of that size at tmp_path / name (unmounted afterwards); the test is
    skipped, saying why, where this process may not mount one (it needs root or CAP_SYS_ADMIN)."""
    mounted = []

    def mount(name: str, size: str):
        path = tmp_path / name
        path.mkdir(parents=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
