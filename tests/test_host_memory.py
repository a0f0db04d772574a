"""Host memory reuse on CPU (`meshlm.platform.host_memory`): the temporary buffer of an XLA:CPU program is
faulted in afresh on every call under glibc's defaults, and reused under meshlm's settings; the
settings stay off where they would not fit; the train loop keeps one step in flight under them."""

import json
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from helpers import subprocess_env
from meshlm import train_loop
from meshlm.platform import host_memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

# A fresh interpreter (the settings are per process, the arena limit fixed before threads start):
# an XLA:CPU program whose temporary buffer is over glibc's largest mmap threshold (32 MiB), called
# repeatedly; minor page faults of the median call after warm-up, as `meshlm train` runs it (one call
# in flight).
PROBE = textwrap.dedent(
    """
    import json, resource
    from meshlm.platform import host_memory
    host_memory.apply()
    import jax, jax.numpy as jnp
    def f(x):
        ys = []
        for i in range(4):  # four [2048, 2048] fp32 intermediates (16 MiB each), all live at the end
            x = jnp.sin(x) * (i + 1.0)
            ys.append(x)
        return sum(y.sum() for y in ys)
    x = jnp.ones((2048, 2048), jnp.float32) / 2048
    step = jax.jit(f).lower(x).compile()
    temp = step.memory_analysis().temp_size_in_bytes
    state = host_memory.keep_freed(temp)
    for _ in range(30):  # under reuse the heap grows for the first calls, then stays (fragmentation)
        step(x).block_until_ready()
    per_call = []  # the median call: one late growth of the heap is not what a call costs
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(x).block_until_ready()
        per_call.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    faults = sorted(per_call)[len(per_call) // 2]
    print(json.dumps({"temp": temp, "faults": faults, "per_call": per_call, "state": state}))
    """
)


def _probe(tuning: str) -> dict:
    env = subprocess_env(MESHLM_MALLOC_TUNING=tuning)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_temporary_buffer_is_reused_instead_of_faulted_in_every_call():
    default, tuned = _probe("0"), _probe("1")
    pages = default["temp"] / 4096
    assert default["temp"] > 32 * 2**20  # above glibc's mmap threshold: a fresh mapping per call
    assert default["state"].startswith("off (MESHLM_MALLOC_TUNING=0)")
    assert tuned["state"].startswith("on"), tuned
    # glibc's defaults fault most of the temporary buffer in on every call; reuse faults almost none
    assert default["faults"] > 0.5 * pages, (default, pages)
    assert tuned["faults"] < 0.05 * pages, (tuned, pages)


def test_reuse_stays_off_where_it_would_not_fit(monkeypatch):
    def no_libc():
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(host_memory, "_state", "ready (one arena; reuse not switched on yet)")
    monkeypatch.setattr(host_memory, "_libc", no_libc)
    state = host_memory.keep_freed(temp_bytes=2**30, available=6 * 2**30)  # 4 GiB > half of 6 GiB
    assert state.startswith("off (4 x the step's 1024 MiB temporary buffer would not fit in half of the 6.0 GiB")
    assert host_memory.steps_in_flight() is None


def test_reuse_turns_trimming_off(monkeypatch):
    """A trim threshold would return the heap's top once the devices' freed buffers pass it (at most
    2 GiB: 4 CPU devices of 512 MiB each), and every step would fault them in again."""
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(host_memory, "_state", "ready (one arena; reuse not switched on yet)")
    monkeypatch.setattr(host_memory, "_libc", Libc)
    assert host_memory.keep_freed(temp_bytes=3 * 2**30, available=2**40).startswith("on (")
    assert calls == [(host_memory.M_MMAP_MAX, 0), (host_memory.M_TRIM_THRESHOLD, -1)]


def test_reuse_is_skipped_off_glibc_cpu(monkeypatch):
    assert host_memory.reason_to_skip({"MESHLM_MALLOC_TUNING": "0"}) == "off (MESHLM_MALLOC_TUNING=0)"
    monkeypatch.setattr(host_memory, "_libc", lambda: pytest.fail("mallopt must not be called"))
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host_memory.reason_to_skip({}).startswith("off (not glibc")
    monkeypatch.undo()
    monkeypatch.setattr(host_memory, "_libc", lambda: pytest.fail("mallopt must not be called"))
    monkeypatch.setattr(host_memory.xla_flags, "gpu_backend_expected", lambda env=None: True)
    assert "GPU backend" in host_memory.reason_to_skip({})
    monkeypatch.setattr(host_memory, "_state", "off (GPU backend: the step's buffers are device memory)")
    assert host_memory.keep_freed(None).startswith("off (GPU")  # apply did not get ready: nothing changes


def test_one_step_in_flight_under_reuse(monkeypatch):
    monkeypatch.setattr(host_memory, "_state", "on (glibc: one arena, no mmap, freed memory kept)")
    assert host_memory.steps_in_flight() == 1

    @jax.jit
    def slow(x):  # ~1 s of matmuls on one CPU device, dispatched asynchronously
        for _ in range(40):
            x = jnp.tanh(x @ x)
        return x

    x = jnp.ones((1024, 1024), jnp.float32) / 1024
    slow(x).block_until_ready()  # compile
    pending = [(1, slow(x))]
    train_loop.wait_for_room(pending, None)  # no limit: returns at once
    assert not pending[0][1].is_ready()  # still running: the check below can fail
    train_loop.wait_for_room(pending, host_memory.steps_in_flight())
    assert pending[0][1].is_ready()
