"""Orbax checkpoints: round trip, restore onto another mesh and device count, exact resume,
retention, corrupt/half-written fallback, shape mismatch, init-from and preemption."""

import dataclasses
import json
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import build, logged_losses, random_batches, subprocess_env, tiny_config
from meshlm import train_loop
from meshlm.checkpoint import Checkpointer, CheckpointSpace
from meshlm.config import CheckpointConfig, ConfigError, DataConfig
from meshlm.parallel.mesh import make_layout
from meshlm.step import make_train_step
from meshlm.train_state import abstract_state, setup
from meshlm.trainer import TrainingError, train
from meshlm.validation import validate


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def _abstract(cfg, devices=None):
    layout = make_layout(cfg.parallel, devices)
    specs, tx, _ = setup(cfg, layout)
    return abstract_state(specs, layout, tx)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two steps on data=8 (gpt with dropout), saved asynchronously after each, with the state
    donated to the next step right after the save started."""
    cfg = tiny_config(mesh=dict(data=8), steps=4)
    layout, _, tx, shardings, state = build(cfg)
    step = make_train_step(cfg, layout, tx, shardings)
    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    ck = Checkpointer(directory, CheckpointConfig(keep=5))
    snapshots = {}
    batches = random_batches(cfg, 3)
    for b in batches[:2]:
        state, _ = step(state, b)
        snapshots[int(state.step)] = _np(state)
        ck.save(state, {"tokenizer_fingerprint": "t"})
    state, metrics = step(state, batches[2])  # donates the buffers the last save read from
    ck.close()
    return cfg, directory, snapshots, batches, float(metrics["loss"])


def test_round_trip_same_mesh(saved):
    cfg, directory, snapshots, _, _ = saved
    ck = Checkpointer(directory, CheckpointConfig())
    assert ck.steps() == [1, 2]
    r = ck.restore_latest(_abstract(cfg))
    assert int(r.state.step) == 2 and r.meta["step"] == 2 and r.meta["tokenizer_fingerprint"] == "t"
    assert _equal(r.state, snapshots[2])
    r1 = ck.restore_latest(_abstract(cfg), step=1)
    assert _equal(r1.state, snapshots[1])


@pytest.mark.parametrize(
    "mesh,n_devices", [(dict(fsdp=2, tensor=4), 8), (dict(data=2, tensor=2), 4), (dict(data=1), 1)]
)
def test_restore_onto_another_mesh_and_device_count(saved, devices, mesh, n_devices):
    cfg, directory, snapshots, batches, loss3 = saved
    cfg2 = validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **({"data": 1} | mesh))))
    layout = make_layout(cfg2.parallel, devices[:n_devices])
    specs, tx, shardings = setup(cfg2, layout)
    r = Checkpointer(directory, CheckpointConfig()).restore_latest(abstract_state(specs, layout, tx))
    assert _equal(r.state, snapshots[2])
    for got, want in zip(jax.tree.leaves(r.state), jax.tree.leaves(shardings), strict=True):
        assert got.sharding == want and len(got.sharding.device_set) == n_devices
    _, metrics = make_train_step(cfg2, layout, tx, shardings)(r.state, batches[2])
    np.testing.assert_allclose(float(metrics["loss"]), loss3, rtol=1e-5)  # the same third step


def test_retention_keeps_latest_k_plus_every_mth(tmp_path):
    cfg = tiny_config(mesh=dict(data=2))
    _, _, _, _, state = build(cfg)
    ck = Checkpointer(tmp_path / "c", CheckpointConfig(keep=2, keep_every=4, async_save=False))
    for s in range(1, 11):
        ck.save(state._replace(step=jax.numpy.int32(s)), {})
    ck.close()
    assert Checkpointer(tmp_path / "c", CheckpointConfig()).steps() == [4, 8, 9, 10]


def _copy(directory, tmp_path):
    dst = tmp_path / "checkpoints"
    shutil.copytree(directory, dst)
    return dst


def _largest_file(step_dir):
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "delete"])
def test_corrupt_checkpoint_falls_back_and_is_kept(saved, tmp_path, damage):
    cfg, directory, snapshots, _, _ = saved
    d = _copy(directory, tmp_path)
    step2 = d / "2"
    if damage == "meta":
        (step2 / "meta" / "metadata").write_text("{not json")
    elif damage == "delete":
        shutil.rmtree(step2 / "opt_state")
    else:
        f = _largest_file(step2 / "params")
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            f.write_bytes(data[: len(data) // 2])
        else:  # a bit flip somewhere in the middle of the array data
            data[len(data) // 2] ^= 0x10
            f.write_bytes(bytes(data))
    messages = []
    ck = Checkpointer(d, CheckpointConfig(), log=messages.append)
    r = ck.restore_latest(_abstract(cfg))
    assert int(r.state.step) == 1 and _equal(r.state, snapshots[1])
    assert len(messages) == 1 and "2" in messages[0] and "unusable" in messages[0]
    kept = list((tmp_path / "checkpoints.corrupt").iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("2-")  # moved aside, not deleted
    assert ck.steps() == [1]


def test_half_written_checkpoint_is_ignored(saved, tmp_path):
    cfg, directory, snapshots, _, _ = saved
    d = _copy(directory, tmp_path)
    # What a save killed mid-write leaves: Orbax's temporary directory, never renamed into place.
    shutil.copytree(d / "2", d / "3.orbax-checkpoint-tmp-1234")
    shutil.rmtree(d / "2")
    r = Checkpointer(d, CheckpointConfig()).restore_latest(_abstract(cfg))
    assert int(r.state.step) == 1 and _equal(r.state, snapshots[1])


def test_shape_mismatch_names_the_tensors(saved):
    cfg, directory, _, _, _ = saved
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32, vocab_size=128))
    with pytest.raises(ConfigError) as e:
        Checkpointer(directory, CheckpointConfig()).restore_latest(_abstract(validate(other)))
    msg = str(e.value)
    assert "params/wte: checkpoint [256, 64] float32, config [128, 32] float32" in msg
    assert "params/layers/wq" in msg
    assert (directory / "2").exists()  # a config error moves nothing aside


# ----------------------------------------------------------------------------- via the trainer


def _run_cfg(corpus_dir, cache, mesh, steps=10, document_mask=False, **ck):
    cfg = tiny_config(mesh=mesh, steps=steps, log_every=1, eval_every=0, seq_len=32)
    return validate(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, vocab_size=320),
            data=DataConfig(paths=(str(corpus_dir),), cache_dir=str(cache), document_mask=document_mask),
            checkpoint=CheckpointConfig(**({"every": 3} | ck)),
        )
    )


def _final_params(cfg, run_dir):
    ck = Checkpointer(run_dir / "checkpoints", CheckpointConfig())
    r = ck.restore_latest(_abstract(cfg))
    return int(r.state.step), _np(r.state)


@pytest.mark.slow
def test_exact_resume_at_a_random_step(corpus_dir, tmp_path):
    """gpt with dropout on data=2 x tensor=4 with SP: interrupted at a random step, resumed, and
    bit-identical to the uninterrupted run in every loss and every final tensor."""
    mesh = dict(data=2, tensor=4, sequence_parallel=True)
    cfg = _run_cfg(corpus_dir, tmp_path / "cache", mesh)
    stop = random.randint(1, cfg.train.steps - 1)
    train(cfg, tmp_path / "a", quiet=True)
    first = train(cfg, tmp_path / "b", quiet=True, stop_after=stop)
    assert first.final_step == stop
    train(cfg, tmp_path / "b", quiet=True)
    assert logged_losses(tmp_path / "a") == logged_losses(tmp_path / "b"), f"stopped at {stop}"
    step_a, state_a = _final_params(cfg, tmp_path / "a")
    step_b, state_b = _final_params(cfg, tmp_path / "b")
    assert step_a == step_b == cfg.train.steps and _equal(state_a, state_b), f"stopped at {stop}"


@pytest.mark.slow
def test_resume_on_another_mesh_and_init_from(corpus_dir, tmp_path):
    cfg = _run_cfg(corpus_dir, tmp_path / "cache", dict(data=8), steps=6)
    train(cfg, tmp_path / "a", quiet=True, stop_after=4)
    other = _run_cfg(corpus_dir, tmp_path / "cache", dict(fsdp=2, tensor=4), steps=6)
    result = train(other, tmp_path / "a", quiet=True)
    assert result.final_step == 6 and sorted(logged_losses(tmp_path / "a")) == [1, 2, 3, 4, 5, 6]
    # --init-from: the weights of run a at its last step, a fresh optimizer and step 0
    fresh = _run_cfg(corpus_dir, tmp_path / "cache", dict(data=2), steps=0)
    assert train(fresh, tmp_path / "b", quiet=True, init_from=str(tmp_path / "a")).train_loss is None  # none logged
    step, state = _final_params(fresh, tmp_path / "b")
    _, source = _final_params(cfg, tmp_path / "a")
    assert step == 0 and _equal(state.params, source.params)
    assert all(not np.any(x) for x in jax.tree.leaves(state.opt_state[1][0].mu))
    # a model that does not match the source
    wrong = dataclasses.replace(fresh, model=dataclasses.replace(fresh.model, n_layers=3))
    with pytest.raises(ConfigError, match="params/layers/wq: checkpoint \\[2, 64, 4, 16\\]"):
        train(wrong, tmp_path / "c", quiet=True, init_from=str(tmp_path / "a"))


@pytest.mark.slow
def test_trainer_falls_back_past_a_corrupt_checkpoint(corpus_dir, tmp_path):
    cfg = _run_cfg(corpus_dir, tmp_path / "cache", dict(data=2), steps=8, document_mask=True)
    train(cfg, tmp_path / "ref", quiet=True)
    train(cfg, tmp_path / "a", quiet=True, stop_after=6)  # checkpoints 3 and 6
    f = _largest_file(tmp_path / "a" / "checkpoints" / "6" / "params")
    f.write_bytes(f.read_bytes()[:10])
    result = train(cfg, tmp_path / "a", quiet=True)  # resumes from 3, redoes 4..8
    assert result.final_step == 8
    assert logged_losses(tmp_path / "a") == logged_losses(tmp_path / "ref")
    assert len(list((tmp_path / "a" / "checkpoints.corrupt").iterdir())) == 1
    # every checkpoint unreadable: a clear error, nothing started from scratch behind the user's back
    steps = [s for s in (tmp_path / "a" / "checkpoints").iterdir() if s.name.isdigit()]
    for s in steps:
        shutil.rmtree(s / "meta")
    with pytest.raises(TrainingError, match="no readable checkpoint left"):
        train(cfg, tmp_path / "a", quiet=True)
    # each set aside, the redone step 6 beside the first one (in the same second too: no name clash)
    assert len(list((tmp_path / "a" / "checkpoints.corrupt").iterdir())) == 1 + len(steps)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_final_checkpoint_and_resume_finishes(corpus_dir, tmp_path, sig):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "meshlm", "train", "--mesh", "data=2", "--steps", "400", "--run-dir", str(run)]
    for kv in ("model.n_layers=1", "model.d_model=32", "train.seq_len=32", "train.log_every=1", "train.eval_every=0"):
        args += ["--set", kv]
    args += ["--set", f"data.paths={corpus_dir}", "--set", "model.vocab_size=320", "--set", "checkpoint.every=1000"]
    env = subprocess_env()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and len(logged_losses(run) if (run / "metrics.jsonl").exists() else {}) < 3:
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    saved_step = int(err.split("saved a checkpoint at step ")[1].split()[0])
    assert 3 <= saved_step < 400 and (run / "checkpoints" / str(saved_step)).is_dir()
    assert max(logged_losses(run)) == saved_step  # stopped right after the step it was on
    if sig == signal.SIGINT:  # the same checkpoint either way: one resume is enough to prove it resumes
        return
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {run / 'checkpoints'}/{saved_step}" in r.stdout and "done: 400 steps" in r.stdout


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's threads, after the error
def test_a_full_disk_ends_with_a_clear_error_and_no_corrupt_checkpoint(corpus_dir, tmp_path, small_tmpfs, capsys):
    """Real full file systems: the checkpoint directory on a 2.5 MB tmpfs (one 1.5 MB checkpoint
    fits, a second does not) and the in-memory copies on a 100 kB one. The copies turn themselves
    off with a warning and training goes on; the disk save that does not fit stops the run with
    CheckpointSpace (exit 5 from the CLI, which `meshlm launch` does not retry), naming the step and
    the committed steps. Given room, the same command resumes from the committed step (restored
    and checksummed: not corrupt) and finishes."""
    disk, shm = small_tmpfs("disk", "2500k"), small_tmpfs("shm", "100k")
    ck = dict(every=2, dir=str(disk / "ckpt"), local_every=1, local_dir=str(shm))
    cfg = _run_cfg(corpus_dir, tmp_path / "cache", dict(data=2), steps=8, **ck)
    with pytest.raises(CheckpointSpace, match=r"while saving step 4: .* committed checkpoints \[2\] are intact"):
        train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert "in-memory checkpoints turned off at step 1: OSError: [Errno 28] No space left on device" in out
    assert not any(shm.iterdir())  # the copies' files are gone, their space given back
    subprocess.run(["mount", "-o", "remount,size=20m", "tmpfs", str(disk)], check=True)
    assert train(cfg, tmp_path / "run", quiet=True).final_step == 8
    resumed = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"event": "resume", "step": 2} in resumed


def test_checkpoint_saves_and_the_end_of_a_run_beat_the_heartbeat(corpus_dir, tmp_path, monkeypatch):
    """A supervisor's --hang-timeout bounds each phase alone: the heartbeat file is written (forced,
    not left to the once-a-second throttle) on each side of every checkpoint save and of the final
    commit (a slow save on a busy host was read as a hang when the last beat was the last step's)."""
    events = []
    beat, save, wait = train_loop.Heartbeat.beat, Checkpointer.save, Checkpointer.wait

    def beat_spy(self, step, force=False):
        last = self.last
        beat(self, step, force)
        if self.last != last:  # written
            events.append(("beat", step, force))

    monkeypatch.setenv("MESHLM_HEARTBEAT", str(tmp_path / "beat"))
    monkeypatch.setattr(train_loop.Heartbeat, "beat", beat_spy)
    monkeypatch.setattr(Checkpointer, "save", lambda self, *a: events.append(("save",)) or save(self, *a))
    monkeypatch.setattr(Checkpointer, "wait", lambda self: events.append(("wait",)) or wait(self))
    cfg = _run_cfg(corpus_dir, tmp_path / "cache", dict(data=2), steps=4)  # saves at 3 and 4 (final)
    train(cfg, tmp_path / "run", quiet=True)
    phases = [i for i, e in enumerate(events) if e[0] != "beat"]
    assert [events[i] for i in phases] == [("save",), ("save",), ("wait",)], events
    for i, step in zip(phases, (3, 4, 4), strict=True):
        assert events[i - 1] == events[i + 1] == ("beat", step, True), events
    assert events[-1] == ("beat", 4, True) and (tmp_path / "beat").read_text().split()[0] == "4"


def test_starting_over_in_a_directory_with_checkpoints_is_refused(saved, corpus_dir, tmp_path):
    _, directory, _, _, _ = saved
    run = tmp_path / "run"
    shutil.copytree(directory, run / "checkpoints")
    fresh = _run_cfg(corpus_dir, tmp_path / "cache", dict(data=2), resume=False)
    with pytest.raises(ConfigError, match=r"resume=false but .* holds checkpoints \[1, 2\]"):
        train(fresh, run, quiet=True)


def test_a_read_only_checkpointer_logs_no_warnings(tmp_path, caplog):
    """`meshlm generate` / `eval` open checkpoints read-only; Orbax warned on every call that it
    overrode the options ("read_only=True, setting max_to_keep=None", ...) and that the directory
    is read only. Neither is news to the user."""
    import logging

    with caplog.at_level(logging.INFO):
        Checkpointer(tmp_path, CheckpointConfig(), read_only=True).close()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_checksums_equal_a_numpy_reference_on_any_layout_without_a_leaf_sized_temporary(devices):
    """[sum of the bits, sum of bits x (flat index % 65521 + 1)] in wrapping uint32 arithmetic, as
    NumPy computes it, for a sharded leaf too; the compiled program holds no leaf-sized buffer
    beyond its input (the checksum once made two, 3x a model's bytes while converting)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshlm.checkpoint import _checksums, describe
    from meshlm.parallel.mesh import make_mesh

    x = np.random.default_rng(0).standard_normal((4, 70000, 3), dtype=np.float32)  # > 65521 elements a row
    bits = x.view(np.uint32).ravel().astype(np.uint64)
    weight = np.arange(x.size, dtype=np.uint64) % 65521 + 1
    want = [int(bits.sum() % 2**32), int((bits * weight).sum() % 2**32)]
    mesh = make_mesh(dataclasses.replace(tiny_config().parallel, data=2, tensor=4))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
    half = jax.numpy.asarray(x[:, :5].astype(np.float16))
    hbits = x[:, :5].astype(np.float16).view(np.uint16).ravel().astype(np.uint64)
    hweight = np.arange(hbits.size, dtype=np.uint64) % 65521 + 1
    scalar, small = np.float32(-2.5), np.arange(-7, 8, dtype=np.int8).reshape(3, 5)
    got = describe({"a": jax.numpy.asarray(x), "b": sharded, "c": half, "d": jax.numpy.asarray(scalar)})
    got |= describe({"e": jax.numpy.asarray(small)})
    assert got["a"]["checksum"] == want and got["b"]["checksum"] == want
    assert got["c"]["checksum"] == [int(hbits.sum() % 2**32), int((hbits * hweight).sum() % 2**32)]
    assert got["d"]["checksum"] == [int(scalar.view(np.uint32))] * 2  # weight 1 at index 0
    ebits = small.view(np.uint8).ravel().astype(np.uint64)
    assert got["e"]["checksum"] == [int(ebits.sum()), int((ebits * (np.arange(15) + 1)).sum())]
    temp = _checksums.lower({"a": jax.numpy.asarray(x)}).compile().memory_analysis().temp_size_in_bytes
    assert temp < x.nbytes // 4, temp


def test_processes_agree_on_a_failed_asynchronous_save_before_waiting_on_it(tmp_path, monkeypatch):
    """The multi-process agreement (`Checkpointer._agree`) in one process, with the host all-gather
    played by a script of the other process's states: it polls while a save is in flight, returns
    once every process committed, and raises CheckpointSpace naming the process whose write ran out
    of space, after which `close` no longer waits on Orbax's threads. The failure is the one Orbax
    logs from its `async_save` thread (another thread's error is not this save's)."""
    import errno
    import logging
    import threading

    from jax.experimental import multihost_utils

    from meshlm import checkpoint

    ck = Checkpointer(tmp_path / "ckpt", CheckpointConfig())
    (tmp_path / "ckpt" / "3").mkdir()
    (tmp_path / "ckpt" / "6.orbax-checkpoint-tmp").mkdir()
    ck.last_saved = 6
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(checkpoint, "ABANDONED_THREADS", [])
    peer, seen = [], []

    def allgather(mine):
        seen.append(int(mine))
        return np.array([int(mine), peer.pop(0)], np.int32)

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    peer[:] = [1, 1, 0]  # the other process commits after two polls
    ck._agree()
    assert seen == [0, 0, 0] and not peer
    full = OSError(errno.ENOSPC, "No space left on device")

    def log_from(name):  # as Orbax logs it: logging.error(..., exc_info=True) in the failing thread
        def fail():
            try:
                raise full
            except OSError:
                logging.getLogger("absl").error("failed", exc_info=True)

        thread = threading.Thread(target=fail, name=name)
        thread.start()
        thread.join()

    log_from("save_finalize")
    assert ck.errors.error is None
    peer[:] = [3]  # ...or ran out of space: named, and every process raises at once
    with pytest.raises(CheckpointSpace, match=r"\(process\(es\) \[1\]\) while saving step 6: .* checkpoints \[3\] are"):
        ck._agree()
    log_from("async_save")
    assert ck.errors.error is full
    peer[:] = [1]
    with pytest.raises(CheckpointSpace, match=r"\(process\(es\) \[0\]\)"):
        ck._agree()
    assert seen[-1] == 3 and len(checkpoint.ABANDONED_THREADS) == 2
    ck.close()  # returns: no wait on threads that wait on a barrier never met
    assert ck.errors not in logging.getLogger("absl").handlers
