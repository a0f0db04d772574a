"""Multi-process runs on JAX's distributed runtime (gloo on CPU), launched and supervised by
`meshlm launch`: equal to one process, restart after SIGKILL and after a hang (from in-memory
copies, a replaced process's from its peer), clear errors."""

import collections
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import logged_losses, subprocess_env
from meshlm import local_checkpoint as lc
from meshlm.checkpoint import Checkpointer
from meshlm.config import CheckpointConfig, from_dict
from meshlm.data.prepare import write_dataset
from meshlm.data.units import Unit
from meshlm.launch.supervisor import free_port, read_beat
from meshlm.model.params import named_leaves
from meshlm.observe.run_report import write_report
from meshlm.parallel.mesh import make_layout
from meshlm.train_state import abstract_state, setup

pytestmark = pytest.mark.slow
STEPS = 12
MESH = "data=2,tensor=4"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    rng = np.random.default_rng(4)
    words = ["alpha", "beta", "gamma", "delta", "mesh", "shard", "token", "layer", "device", "batch"]
    texts = ["\n".join(" ".join(rng.choice(words, 9)) for _ in range(40)) for _ in range(30)]
    write_dataset([Unit("texts", texts=tuple(texts))], root / "ds", vocab_size=320, log=lambda _: None)
    return root / "ds"


def _train_args(dataset, run_dir, steps=STEPS, mesh=MESH):
    args = ["train", "--mesh", mesh, "--steps", str(steps), "--run-dir", str(run_dir)]
    for kv in (
        f"data.paths={dataset}",
        "model.vocab_size=320",
        "model.n_layers=2",
        "model.d_model=64",
        "model.dropout=0.1",
        "train.seq_len=32",
        "train.global_batch=8",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=3",
    ):
        args += ["--set", kv]
    return args


def _env():
    return subprocess_env()


def _launch_cmd(train_args, *options, processes=2):
    return [
        sys.executable,
        "-m",
        "meshlm",
        "launch",
        "--processes",
        str(processes),
        "--devices-per-process",
        str(8 // processes),
        *options,
        "--",
        *train_args,
    ]


def _final_state(run_dir, checkpoints: Path | None = None):
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    # read back in this one process: the mesh's shape, not its split over nodes (--dcn)
    one_node = {f"dcn_{axis}": 1 for axis, ways in cfg.parallel.dcn.items() if ways > 1}
    layout = make_layout(dataclasses.replace(cfg.parallel, **one_node))
    specs, tx, _ = setup(cfg, layout)
    ckpt = Checkpointer(checkpoints or run_dir / "checkpoints", CheckpointConfig())
    r = ckpt.restore_latest(abstract_state(specs, layout, tx))
    return int(r.state.step), {k: np.asarray(v) for k, v in named_leaves(r.state.params).items()}


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    """An uninterrupted 2 x 4 launch, checked against one device first (`train --check`: the layout
    across both processes, the reference on each process's first device). The processes stand for
    two nodes (`--dcn data=2`: data across them, tensor within each, `parallel.mesh.hybrid_devices`)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    cmd = _launch_cmd([*_train_args(dataset, run), "--check", "--dcn", "data=2"])
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    return run, r.stdout


@pytest.fixture(scope="module")
def one_device_40(dataset, tmp_path_factory) -> dict[int, float]:
    """One device's losses over 40 steps without dropout: what every elastic run (its layout, and with
    it the order of its sums, changes) gives to 1e-5."""
    run = tmp_path_factory.mktemp("one") / "run"
    return _losses_of_one_process([*_train_args(dataset, run, steps=40, mesh="data=1"), "--set", "model.dropout=0"])


def test_two_processes_equal_one_process(reference, dataset, tmp_path):
    run, out = reference
    assert "attempt 1: ok" in out and "[1] " in out  # merged, prefixed logs of both processes
    assert "(across slices/nodes: data=2)" in out  # the hybrid mesh: data across the two processes
    for i in (0, 1):
        assert f"[{i}] verdict: equal to one device" in out, out[-3000:]
    assert (run / "launch.log").read_text().count("[launch]") >= 2
    single = tmp_path / "single"
    two, one = logged_losses(run), _losses_of_one_process([*_train_args(dataset, single), "--devices", "8"])
    assert sorted(two) == list(range(1, STEPS + 1)) == sorted(one)
    # the same program on the same mesh; only the order of gloo's floating-point sums differs
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5)
    step2, params2 = _final_state(run)
    step1, params1 = _final_state(single)
    assert step2 == step1 == STEPS
    for k in params1:
        # the key bias's gradient is zero up to rounding (q . b_k adds one constant to a whole row
        # of scores, which softmax ignores): its values are rounding noise, which the two sum
        # orders draw differently; they stay tiny (Adam's eps keeps the noise's steps small)
        atol = 1e-5 if k.endswith("/bk") else 1e-6
        np.testing.assert_allclose(params2[k], params1[k], rtol=1e-4, atol=atol, err_msg=k)
    info = json.loads((run / "run.json").read_text())
    assert info["processes"] == 2 and len(info["devices"]) == 8
    # only process 0 writes metrics (one record per step); each process writes its own shards
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "loss" in r]) == STEPS
    for item in ("params", "opt_state"):
        assert sorted(p.name for p in (run / "checkpoints" / str(STEPS) / item).glob("ocdbt.process_*")) == [
            "ocdbt.process_0",
            "ocdbt.process_1",
        ]


def _wait_for_step(run, process: int, step: int, proc, timeout=300, not_pid: int | None = None) -> int:
    """Wait until `process` (not the one with pid `not_pid`: a later attempt's) has reported `step`
    in its heartbeat; return its pid."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        reached, pid = _beat(run, process)
        if pid and reached >= step and pid != not_pid:
            return pid
        time.sleep(0.1)
    raise AssertionError(f"process {process} never reached step {step}")


def test_a_hung_then_a_killed_worker_recover_from_the_in_memory_copies_bit_for_bit(reference, dataset, tmp_path):
    """In-memory checkpoints every step and no disk checkpoint before the end (checkpoint.every
    above the run's steps), two failures in a row on the reference's layout: a SIGSTOP, seen by the
    heartbeat, then in the restarted group a SIGKILL at a random step. Each time both processes
    restore their own copies and at most one step is lost; every loss and final tensor equals the
    uninterrupted run's bit for bit."""
    ref_run, _ = reference
    run = tmp_path / "run"
    # 20 s: the resumed attempt must not be read as hung on a busy 2-core host (CI runs two workers)
    options = ["--max-restarts", "2", "--hang-timeout", "20"]
    args = [*_train_args(dataset, run), "--set", "checkpoint.every=100", "--set", "checkpoint.local_every=1"]
    cache = tmp_path / "cache"  # a cold compilation cache of its own: one step entry per process
    proc = _popen(_launch_cmd(args, *options), MESHLM_CACHE=str(cache))
    pid = _wait_for_step(run, 1, 5, proc)
    store = lc.store_dir(lc.default_root(), run, lc.run_id(run, first=False))
    assert (store / "process-1" / "own").is_dir() and (store / "process-0" / "held-1").is_dir()
    os.kill(pid, signal.SIGSTOP)
    second = random.randint(7, 10)
    print(f"SIGKILL at step {second}")
    os.kill(_wait_for_step(run, 0, second, proc, not_pid=_pid(run, 0)), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "hung (no progress for > 20s)" in out and "process 0 killed by SIGKILL" in out and "attempt 3: ok" in out
    assert out.count("resumed from the in-memory copies of step") == 2 and "; no disk checkpoint" in out
    # every process of a restarted group finds its step in the persistent cache (XLA:CPU keys differ by
    # process, and JAX writes process 0's only: meshlm.platform.compile_cache)
    assert out.count("(persistent compilation cache hit on 2/2 processes)") >= 2, out[-4000:]
    assert json.loads((run / "run.json").read_text())["compile_cache_hit"] is True  # the last attempt's: on both
    # each process wrote its own entry: their keys differ (were they equal, both would write one file at once)
    assert len(list((cache / "xla").glob("jit_step-*"))) == 2
    events = [r for r in _records(run) if r.get("event") == "recovered"]
    assert [e["source"] for e in events] == ["memory", "memory"] and all(e["lost_steps"] <= 1 for e in events)
    # a heartbeat names a step once it is dispatched: its copy may not have been made when the fault came
    assert events[0]["resumed_at"] >= 4 and events[1]["resumed_at"] >= second - 1
    assert all(e["step"] == e["resumed_at"] + 1 and e["recovery_s"] > 0 for e in events)
    assert not store.exists()  # a finished run drops its copies
    report = write_report(run, out=tmp_path / "report").read_text()
    assert f"| recoveries | 2, {sum(e['lost_steps'] for e in events)} step(s) lost in all: step" in report
    assert logged_losses(run) == logged_losses(ref_run)
    (step, params), (ref_step, ref_params) = _final_state(run), _final_state(ref_run)
    assert step == ref_step == STEPS
    for k in ref_params:
        np.testing.assert_array_equal(params[k], ref_params[k], err_msg=k)


def test_four_processes_survive_a_replaced_host_then_shrink_and_regrow(one_device_40, dataset, tmp_path):
    """4 processes x 2 devices on data=4 x tensor=2 (tensor inside a process, data across), with
    in-memory copies every step and disk checkpoints every 3 steps, through two failures in a row:
    1. at a random step, process 2 is frozen, its host's copies (its tmpfs store) wiped and SIGKILLed: the group
       restarts on 4 processes from the in-memory copies, process 2's shards sent back by process 3;
    2. capacity drops to 2 (--capacity-cmd) and process 3 is SIGKILLed: after --replace-timeout the
       launcher continues on 2 processes (data=2, microbatches 1 -> 2) from the disk checkpoint
       (the copies were cut for the other layout);
    3. capacity is back: the shrunk group checkpoints on SIGTERM and restarts on 4 processes.
    Every loss is one device's within 1e-5 (the layouts sum the batch's rows in other orders), and each
    step run on 4 processes (before the shrunk group's resume) an uninterrupted 4-process run's bit for bit."""
    run, capacity = tmp_path / "run", tmp_path / "capacity"
    capacity.write_text("4")
    train_args = [*_train_args(dataset, run, steps=40, mesh="data=4,tensor=2"), "--set", "model.dropout=0"]
    train_args += ["--set", "checkpoint.local_every=1"]
    options = ["--max-restarts", "3", "--hang-timeout", "30", "--min-processes", "2", "--replace-timeout", "2"]
    options += ["--capacity-cmd", f"cat {capacity}", "--capacity-poll", "0.2"]
    proc = _popen(_launch_cmd(train_args, *options, processes=4))
    first = random.randint(4, 7)  # the first failure's step
    print(f"first failure at step {first}")
    pid = _wait_for_step(run, 2, first, proc)
    first_three = _pid(run, 3)  # before the kill: the launcher clears the heartbeats when it restarts
    os.kill(pid, signal.SIGSTOP)
    shutil.rmtree(lc.store_dir(lc.default_root(), run, lc.run_id(run, first=False)) / "process-2")
    os.kill(pid, signal.SIGKILL)
    pid = _wait_for_step(run, 3, first + 4, proc, not_pid=first_three)
    second_zero = _pid(run, 0)
    capacity.write_text("2")
    os.kill(pid, signal.SIGKILL)
    _wait_for_step(run, 0, first + 9, proc, not_pid=second_zero)  # the shrunk group trains
    capacity.write_text("4")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "process 2 killed by SIGKILL" in out and "process 3 killed by SIGKILL" in out
    assert " (process 2 from its peer's copy); the disk's newest is step" in out, out[-4000:]
    assert "continuing on 2 processes, mesh data=2 x fsdp=1 x tensor=2, microbatches 1 -> 2" in out
    assert "capacity for 4 processes is back" in out and "attempt 4: ok" in out
    assert "train.microbatches: 1 -> 2" in out  # the shrunk group's resume names what changed
    events = [r for r in _records(run) if r.get("event") == "recovered"]
    assert [e["source"] for e in events] == ["memory", "disk"], f"first failure at step {first}"
    # a heartbeat names a step once it is dispatched: its copy may not have been made when the kill came
    assert events[0]["lost_steps"] <= 1 and events[0]["resumed_at"] >= first - 1
    assert not lc.store_dir(lc.default_root(), run, lc.run_id(run, first=False)).exists()  # dropped at the end
    got, want = logged_losses(run), one_device_40
    assert sorted(got) == sorted(want) == list(range(1, 41))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
    # up to the shrunk group's resume every step ran on 4 processes: bit for bit an uninterrupted 4-process run
    resumed = events[1]["resumed_at"]
    ref = [*_train_args(dataset, tmp_path / "ref", steps=40, mesh="data=4,tensor=2"), "--set", "model.dropout=0"]
    cmd = _launch_cmd([*ref, "--stop-after", str(resumed)], processes=4)
    r = subprocess.run(cmd, capture_output=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    same = logged_losses(tmp_path / "ref")
    assert [got[s] for s in range(1, resumed + 1)] == [same[s] for s in range(1, resumed + 1)]


def _losses_of_one_process(train_args: list[str]) -> dict[int, float]:
    """`meshlm <train_args>` as one process (no launcher): its logged losses by step."""
    r = subprocess.run(
        [sys.executable, "-m", "meshlm", *train_args], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return logged_losses(Path(train_args[train_args.index("--run-dir") + 1]))


def _popen(cmd, **env) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env() | env)


def _pid(run: Path, process: int) -> int:
    for _ in range(100):  # a heartbeat being rewritten reads empty for a moment
        if pid := _beat(run, process)[1]:
            return pid
        time.sleep(0.01)
    raise AssertionError(f"process {process}'s heartbeat stays unreadable")


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_worker_killed_during_a_checkpoint_save_resumes_from_the_last_committed_step(reference, dataset, tmp_path):
    """Process 1 is SIGKILLed the moment Orbax's temporary directory of a save after step 3
    appears (the save of step 6 or 9 in flight, never committed: the commit waits for every
    process). The restarted group resumes from the last committed step, the half-written one is
    never listed, and every loss and final tensor equals the uninterrupted run's bit for bit."""
    run = tmp_path / "run"
    proc = _popen(_launch_cmd(_train_args(dataset, run), "--max-restarts", "2"))
    _wait_for_step(run, 1, 1, proc)
    deadline, saving = time.time() + 300, None
    while saving is None:
        assert time.time() < deadline and proc.poll() is None
        names = os.listdir(run / "checkpoints") if (run / "checkpoints").is_dir() else []
        saving = next((n for n in names if "tmp" in n and not n.startswith(("0.", "3."))), None)
        time.sleep(0.002)
    os.kill(_pid(run, 1), signal.SIGKILL)
    killed_at = int(saving.split(".")[0])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "process 1 killed by SIGKILL" in out, out[-4000:]
    resumed = int(out.split(f"resumed from {run / 'checkpoints'}/")[1].split()[0])
    assert resumed == killed_at - 3, f"killed while saving step {killed_at}, resumed from {resumed}"
    assert logged_losses(run) == logged_losses(reference[0])
    (step, got), (_, want) = _final_state(run), _final_state(reference[0])
    assert step == STEPS
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_restarts_run_out_with_a_summary(dataset, tmp_path):
    """Every attempt's workers crash (exit 1) at start-up: one restart, then exit 1 with a summary."""
    hook = tmp_path / "hook"
    hook.mkdir()
    # Python imports sitecustomize at start-up; only the workers have MESHLM_HEARTBEAT set.
    (hook / "sitecustomize.py").write_text("import os, sys\nif os.environ.get('MESHLM_HEARTBEAT'):\n    sys.exit(1)\n")
    env = _env() | {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    args = _train_args(dataset, tmp_path / "run")
    r = subprocess.run(_launch_cmd(args, "--max-restarts", "1"), capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "attempt 1: process" in r.stdout and "attempt 2: process" in r.stdout
    assert "summary (2 attempts, --max-restarts 1)" in r.stdout


def test_a_non_finite_stop_is_not_retried(dataset, tmp_path):
    """A learning rate that blows up stops training at the same step on every attempt: the
    launcher passes exit 3 on after one attempt instead of restarting."""
    args = [*_train_args(dataset, tmp_path / "run"), "--set", "optim.lr=1e9", "--set", "optim.clip_norm=1e9"]
    r = subprocess.run(
        _launch_cmd(args, "--max-restarts", "3"), capture_output=True, text=True, env=_env(), timeout=600
    )
    assert r.returncode == 3, r.stdout[-2000:]
    assert "a non-finite step (it would recur) is not retried" in r.stdout
    assert "summary (1 attempts, --max-restarts 3)" in r.stdout and "non-finite loss or gradient at step" in r.stdout


def test_coordinator_unreachable_is_a_clear_error(dataset, tmp_path):
    args = _train_args(dataset, tmp_path / "run")
    cmd = [
        sys.executable,
        "-m",
        "meshlm",
        *args,
        "--devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--init-timeout",
        "5",
    ]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "could not reach the coordinator 127.0.0.1:" in r.stderr and "within 5s" in r.stderr
    assert time.time() - t < 60


def _start(args, devices, port, n, i, timeout=5):
    cmd = [sys.executable, "-m", "meshlm", *args, "--devices", str(devices), "--coordinator", f"127.0.0.1:{port}"]
    cmd += ["--num-processes", str(n), "--process-id", str(i), "--init-timeout", str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def test_missing_or_disagreeing_processes_are_a_clear_error(dataset, tmp_path):
    args = _train_args(dataset, tmp_path / "run")
    t = time.time()
    alone = _start(args, 4, free_port(), 2, 0)  # process 1 never comes
    _, err = alone.communicate(timeout=120)
    assert alone.returncode == 2 and "only 1 of 2 processes joined within 5s (missing process ids: 1)" in err
    port = free_port()
    p0, p1 = _start(args, 4, port, 2, 0), _start(args, 4, port, 3, 1)  # they disagree on the count
    errs = [p.communicate(timeout=120)[1] for p in (p0, p1)]
    assert p0.returncode == p1.returncode == 2
    assert all("process 1 was started with --num-processes 3, process 0 with 2" in e for e in errs), errs
    assert time.time() - t < 90


def test_process_count_that_does_not_match_the_mesh(dataset, tmp_path):
    # caught by the launcher before anything starts
    args = _train_args(dataset, tmp_path / "run", mesh="data=8")
    r = subprocess.run(
        [sys.executable, "-m", "meshlm", "launch", "--processes", "2", "--devices-per-process", "2", "--", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert r.returncode == 2 and "--processes 2 x --devices-per-process 2 = 4" in r.stderr
    # and by every process when started by hand: both exit within seconds, no hang
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshlm",
                *args,
                "--devices",
                "2",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--init-timeout",
                "30",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for i in range(2)
    ]
    t = time.time()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2, err[-2000:]
        assert "needs 8 devices but 2 processes x 2 devices = 4 devices" in err
    assert time.time() - t < 60


HOLD_A_CPU = """
import json, subprocess, sys
import ray
ray.init(address=sys.argv[1])
@ray.remote(num_cpus=1)
class Hold:
    def ping(self):
        return 1
hold = Hold.remote()
ray.get(hold.ping.remote())
r = subprocess.run(json.loads(sys.argv[2]), capture_output=True, text=True)
print("launch exit", r.returncode, r.stderr[-2000:])
"""


def _ray_node(ray_bin: Path, port: int, env: dict) -> subprocess.Popen:
    """A worker node of the local Ray cluster (a raylet of its own on this machine), kept in the
    foreground (--block) so that its processes are the tree below this one."""
    cmd = [str(ray_bin), "start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--block"]
    node = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    late = threading.Timer(180, node.kill)  # a node that never starts ends its output, and the test
    late.start()
    said = []
    for line in node.stdout:  # returned once the node has joined
        said.append(line)
        if "Ray runtime started" in line:
            late.cancel()
            threading.Thread(target=node.stdout.read, daemon=True).start()  # drained from now on
            return node
    raise AssertionError("".join(said)[-2000:])


def _tree(root: int) -> list[int]:
    """`root` and every process started below it (Ray's raylet and workers start their own sessions)."""
    children = collections.defaultdict(list)
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            children[int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])].append(int(d.name))
    tree, todo = [], [root]
    while todo:
        tree.append(todo.pop())
        todo += children[tree[-1]]
    return tree


def test_ray_backend_places_processes_on_a_local_cluster(one_device_40, dataset, tmp_path):
    """`meshlm launch --ray` and `meshlm data prepare --ray` on a local Ray cluster of two nodes started
    here (the optional `ray` extra), elastic with the cluster's live nodes as the capacity
    (`--min-processes 1`, no --capacity-cmd):
    1. a process SIGKILLed at step 5: the restart puts each process back on its node and the group
       resumes from the in-memory copies;
    2. the second node dies (its raylet, its Ray workers and the training process on it SIGKILLed):
       after --replace-timeout the group continues on the head node alone (data=2 -> 1, microbatches
       1 -> 2), from the disk checkpoint;
    3. a new node joins: the shrunk group checkpoints and regrows to 2 processes.
    Every loss is one device's within 1e-5."""
    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).parent / "ray"
    port = free_port()
    env = _env() | {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}  # a private test cluster
    head = [str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false"]
    subprocess.run(head, check=True, capture_output=True, env=env, timeout=180)
    nodes, proc = [_ray_node(ray_bin, port, env)], None
    try:
        run = tmp_path / "run"
        args = [*_train_args(dataset, run, steps=40), "--set", "model.dropout=0", "--set", "checkpoint.local_every=1"]
        options = ["--ray", f"127.0.0.1:{port}", "--max-restarts", "3"]  # the default --hang-timeout (600 s):
        # the shrunk process is held stopped while a node starts
        options += ["--min-processes", "1", "--replace-timeout", "2", "--capacity-poll", "1"]
        proc = subprocess.Popen(
            _launch_cmd(args, *options), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        first_zero = _wait_for_step(run, 0, 1, proc)
        os.kill(_wait_for_step(run, 1, 5, proc), signal.SIGKILL)
        pids = [_wait_for_step(run, i, 10, proc, not_pid=first_zero if i == 0 else None) for i in (0, 1)]
        tree = _tree(nodes[0].pid)  # the node's machine dies: its raylet, Ray workers and training process
        assert len([pid for pid in pids if pid in tree]) == 1
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        shrunk = _wait_for_step(run, 0, 12, proc, not_pid=pids[0])  # the shrunk group trains on the head node
        os.kill(shrunk, signal.SIGSTOP)  # held until the launcher sees the new node, so the regrow comes first
        nodes.append(_ray_node(ray_bin, port, env))  # a new node joins
        deadline = time.time() + 120
        while "capacity for 2 processes is back" not in (run / "launch.log").read_text():
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.2)
        os.kill(shrunk, signal.SIGCONT)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-4000:]
        first, second = (out.split(f"attempt {n}: 2 processes on Ray (")[1].split(")")[0] for n in (1, 2))
        assert first.startswith("2 nodes, STRICT_SPREAD; nodes 0:"), first
        # the restart puts each process back on its node, where its in-memory copy is
        assert second == first.replace("STRICT_SPREAD", "each on its node"), out[-3000:]
        assert "resumed from the in-memory copies of step" in out
        assert "continuing on 1 processes, mesh data=1 x fsdp=1 x tensor=4, microbatches 1 -> 2" in out, out[-4000:]
        assert "attempt 3: 1 processes on Ray (1 nodes" in out
        assert "capacity for 2 processes is back" in out and "attempt 4: 2 processes on Ray (2 nodes" in out
        assert "attempt 4: ok" in out, out[-3000:]
        assert [e["source"] for e in _records(run) if e.get("event") == "recovered"] == ["memory", "disk"]
        got = logged_losses(run)
        assert sorted(got) == sorted(one_device_40) == list(range(1, 41))
        np.testing.assert_allclose([got[s] for s in sorted(got)], [one_device_40[s] for s in sorted(got)], rtol=1e-5)
        # an elastic group is never packed and counts only nodes with a free CPU: with one node's CPU
        # held by another Ray job, 2 processes are refused (counting that node, the placement would
        # wait --startup-timeout, then fail with another message)
        late = ["--startup-timeout", "30"]
        r = subprocess.run(
            [sys.executable, "-c", HOLD_A_CPU, f"127.0.0.1:{port}", json.dumps(_launch_cmd(args, *options, *late))],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert "launch exit 2" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
        assert "the cluster has 1 live node(s) with a free CPU for 2 processes" in r.stdout
        # `meshlm data prepare --ray` on the same cluster: its work units (JSONL byte ranges) are Ray
        # tasks, and the bytes equal one process's
        corpus = tmp_path / "corpus.jsonl"
        rng = np.random.default_rng(1)
        words = ["mesh", "shard", "ray", "task", "unit", "token"]
        corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 30))}) + "\n" for _ in range(300)))
        prep = [sys.executable, "-m", "meshlm", "data", "prepare", "--input", str(corpus), "--vocab-size", "300"]
        logs = {}
        for out, how in (("ray", ["--ray", f"127.0.0.1:{port}", "--unit-mb", "0.005"]), ("one", ["--processes", "1"])):
            r = subprocess.run([*prep, "--out", str(tmp_path / out), *how], capture_output=True, text=True, env=env)
            assert r.returncode == 0, r.stderr[-3000:]
            logs[out] = r.stderr
        units = -(-corpus.stat().st_size // int(0.005 * 2**20))
        assert f"in {units} units (Ray (127.0.0.1:{port}))" in logs["ray"] and units > 4
        for f in ("train-00000.bin", "val-00000.bin", "index.json", "tokenizer.json"):
            assert (tmp_path / "ray" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f
    finally:
        if proc is not None and proc.poll() is None:  # a failed check: the launcher goes too
            proc.kill()
        subprocess.run([str(ray_bin), "stop", "--force"], capture_output=True, env=env, timeout=120)
        for node in nodes:
            node.kill()
            node.wait()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_full_disk_then_a_preemption_under_launch(reference, dataset, tmp_path, small_tmpfs):
    """Real full file systems under `meshlm launch` (2 processes): process 1's in-memory copies on a
    100 kB tmpfs (mounted where its part of the store goes), the checkpoints on a 2.5 MB one (the
    step-3 checkpoint fits, step 6's does not). Process 1's write fails and the exchange's vote turns
    the copies off on both processes at step 1, training goes on; the failed save of step 6 stops
    every process at the next save (step 9) with exit 5, which the launcher does not retry, naming
    the committed step. Given room, the same
    command resumes from step 3; a SIGTERM to the launcher then makes every process stop after the
    same step and save; the same command again resumes from there and ends where the uninterrupted
    run did, bit for bit."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    run.mkdir()
    (run / ".run-id").write_text("f" * 32)  # its store's path is then known before the run starts
    small_tmpfs(str(lc.store_dir(shm, run, "f" * 32).relative_to(tmp_path) / "process-1"), "100k")
    disk = small_tmpfs("disk", "2500k")
    args = [*_train_args(dataset, run), "--set", f"checkpoint.dir={disk / 'ckpt'}"]
    args += ["--set", "checkpoint.local_every=1", "--set", f"checkpoint.local_dir={shm}"]
    r = subprocess.run(
        _launch_cmd(args, "--max-restarts", "2"), capture_output=True, text=True, env=_env(), timeout=600
    )
    assert r.returncode == 5, r.stdout[-4000:]
    out = r.stdout
    # process 0 speaks for the group: process 1's write failed (its tmpfs is full), so both turned the copies off
    assert "[0] warning: in-memory checkpoints turned off at step 1: a copy failed on process(es) [1]" in out, out
    for i in (0, 1):  # every process stops at once with the clear error (Orbax's barrier would hold it 20 min)
        assert f"[{i}] meshlm: training stopped: no space left (or over quota) on the device of {disk / 'ckpt'}" in out
    assert "while saving step 6:" in out and "committed checkpoints [3] are intact" in out, out[-4000:]
    assert "is not retried" in out and "attempt 2" not in out
    subprocess.run(["mount", "-o", "remount,size=20m", "tmpfs", str(disk)], check=True)
    shutil.rmtree(run / ".heartbeat")  # the failed attempt's (step 9): wait for this launch's own
    proc = _popen(_launch_cmd(args))
    _wait_for_step(run, 0, 5, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and f"resumed from {disk / 'ckpt'}/3" in out, out[-4000:]
    saved = int(out.split("saved a checkpoint at step ")[1].split()[0])
    assert 5 <= saved < STEPS and (disk / "ckpt" / str(saved)).is_dir()
    r = subprocess.run(_launch_cmd(args), capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0 and f"resumed from {disk / 'ckpt'}/{saved}" in r.stdout, r.stdout[-3000:]
    assert logged_losses(run) == logged_losses(reference[0])
    (step, got), (_, want) = _final_state(run, disk / "ckpt"), _final_state(reference[0])
    assert step == STEPS
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.fixture(scope="module")
def stopped_at_6(dataset, tmp_path_factory):
    """A 2 x 4 launch stopped (checkpointed) after step 6; tests continue copies of it."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    r = subprocess.run(
        _launch_cmd([*_train_args(dataset, run), "--stop-after", "6"]),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert r.returncode == 0 and "stopped (checkpointed" in r.stdout, r.stdout[-3000:]
    return run


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_resume_with_another_process_count(reference, dataset, stopped_at_6, tmp_path):
    """Stopped after step 6 as 2 processes x 4 devices, resumed as 1 process x 8: the same global
    batches (each process read only its rows before; one reads all of them now), so the losses
    follow the uninterrupted 2-process run."""
    run = _copy_run(stopped_at_6, tmp_path / "run")
    args = _train_args(dataset, run)
    r = subprocess.run(
        [sys.executable, "-m", "meshlm", *args, "--devices", "8"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    got, want = logged_losses(run), logged_losses(reference[0])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]  # the same processes: exact
    np.testing.assert_allclose([got[s] for s in range(7, STEPS + 1)], [want[s] for s in range(7, STEPS + 1)], rtol=1e-5)


def test_corrupt_shard_of_one_process_falls_back_after_restart(reference, dataset, stopped_at_6, tmp_path):
    """Step 6 damaged in the files process 1 wrote: the processes that cannot read it move it aside
    and exit, the launcher restarts the group, and the run resumes from step 3 and ends exactly
    where the uninterrupted run did; the damaged step is kept aside."""
    run = _copy_run(stopped_at_6, tmp_path / "run")
    args = _train_args(dataset, run)
    files = [p for p in (run / "checkpoints" / "6" / "params" / "ocdbt.process_1").rglob("*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    r = subprocess.run(
        _launch_cmd(args, "--max-restarts", "2"), capture_output=True, text=True, env=_env(), timeout=600
    )
    assert r.returncode == 0, r.stdout[-4000:]
    assert "is unusable" in r.stdout and "attempt 2: ok" in r.stdout
    assert f"resumed from {run / 'checkpoints'}/3" in r.stdout
    assert [p.name.split("-")[0] for p in (run / "checkpoints.corrupt").iterdir()] == ["6"]
    assert logged_losses(run) == logged_losses(reference[0])


SLURM_JOB = """#!/bin/bash
#SBATCH --ntasks=2 --cpus-per-task=1 --requeue --open-mode=append --output={out}
srun {python} -m meshlm {args}
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A single-node SLURM cluster from Debian's packages (scripts/slurm_cluster.sh; `.ci/run`
    installs them), or a skip that says why it cannot start here."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "slurm_cluster.sh"
    state = tmp_path_factory.mktemp("slurm")
    r = subprocess.run(["bash", str(script), "start", str(state)], capture_output=True, text=True, timeout=120)
    if r.returncode:
        subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True, timeout=60)
        pytest.skip(f"no single-node SLURM cluster here: {r.stderr.strip()[-400:]}")
    yield _env() | {"SLURM_CONF": str(state / "slurm.conf")}
    subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True, timeout=60)


def _job_state(job: str, env: dict) -> str:
    r = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, env=env, timeout=60)
    return r.stdout.split("JobState=")[1].split()[0] if "JobState=" in r.stdout else "UNKNOWN"


def test_a_slurm_job_equals_the_launched_run_and_survives_a_requeue_and_a_node_failure(
    reference, dataset, slurm, tmp_path
):
    """`sbatch` of 2 tasks, each `srun meshlm train --distributed` (jax.distributed reads SLURM's
    environment), on the reference's layout with in-memory copies every step, requeued twice:
    1. `scontrol requeue` at step 4 or later: SLURM's SIGTERM makes both tasks checkpoint, and the
       requeued job resumes from that checkpoint (an orderly stop drops the copies);
    2. a node failure: both tasks SIGKILLed two steps later, process 1's copies wiped (its host
       replaced) and the disk checkpoints deleted (to prove where the state comes from), the failed
       job requeued: it resumes from the in-memory copies, process 1's sent back by process 0,
       losing at most a step.
    Every loss and final tensor equals the `meshlm launch` run's bit for bit."""
    run, out = tmp_path / "run", tmp_path / "job.out"
    args = [*_train_args(dataset, run), "--distributed", "--devices", "4", "--dcn", "data=2"]
    args += ["--set", "checkpoint.local_every=1"]
    script = tmp_path / "job.sh"
    script.write_text(SLURM_JOB.format(out=out, python=sys.executable, args=" ".join(args)))
    submit = ["sbatch", "--parsable", str(script)]
    job = subprocess.run(submit, capture_output=True, text=True, env=slurm, check=True).stdout.strip()
    deadline = time.time() + 600

    def wait(until, bad=("FAILED", "CANCELLED", "TIMEOUT", "COMPLETED"), pause=0.2):
        while not until():
            state = _job_state(job, slurm)  # UNKNOWN: scontrol did not answer this time
            assert time.time() < deadline and state not in bad, f"{state}: {out.read_text()[-3000:]}"
            if state == "PENDING":  # SLURM holds a requeued job back for a while: let it start now
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, timeout=60)
            time.sleep(pause)

    wait(lambda: len(logged_losses(run) if (run / "metrics.jsonl").exists() else {}) >= 4)
    assert len(logged_losses(run)) < STEPS, "the job finished before the requeue: too fast to test it"
    subprocess.run(["scontrol", "requeue", job], env=slurm, check=True, timeout=60)
    wait(lambda: "resumed from" in out.read_text())
    saved = int(out.read_text().split("saved a checkpoint at step ")[1].split()[0])
    # the node failure, two steps into the requeued run (each task beats after its first step)
    beats = {}

    def two_steps_in():  # both beats read once, whole: a pid of 0 would signal this process's group
        beats.update({i: _beat(run, i) for i in (0, 1)})
        return beats[0][0] >= saved + 2 and beats[1][0] >= saved + 1

    wait(two_steps_in, pause=0.02)
    pids = [beats[i][1] for i in (0, 1)]
    assert all(pids), beats
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    shutil.rmtree(lc.store_dir(lc.default_root(), run, lc.run_id(run, first=False)) / "process-1")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(run / "checkpoints")  # the disk's checkpoints gone too: only the copies can resume it
    wait(lambda: _job_state(job, slurm) == "FAILED", bad=("CANCELLED", "TIMEOUT", "COMPLETED"))
    quiet = len(out.read_text())  # srun has reported the kill

    def completed():
        """Requeues the failed job until it runs to completion. `scontrol requeue` of a job that has just
        failed does not always take, and a requeued job has failed again without writing a line (SLURM did
        not launch it; seen twice in CI): both are requeued again. A requeued run that wrote output and
        failed is meshlm's failure: the test fails with it."""
        state = _job_state(job, slurm)
        if state == "FAILED":
            assert len(out.read_text()) == quiet, f"the requeued job failed: {out.read_text()[quiet - 500 :]}"
            subprocess.run(["scontrol", "requeue", job], env=slurm, capture_output=True, timeout=60)
        return state == "COMPLETED"

    wait(completed, bad=("CANCELLED", "TIMEOUT"), pause=0.5)
    text = out.read_text()
    assert saved >= 4 and f"resumed from {run / 'checkpoints'}/{saved}" in text, text[-3000:]
    assert "(process 1 from its peer's copy); no disk checkpoint" in text, text[-3000:]
    events = [r for r in _records(run) if r.get("event") == "recovered"]
    assert [e["source"] for e in events] == ["disk", "memory"] and events[0]["lost_steps"] == 0, events
    assert events[1]["lost_steps"] <= 1 and events[1]["resumed_at"] >= saved + 1, events
    assert json.loads((run / "run.json").read_text())["processes"] == 2
    assert logged_losses(run) == logged_losses(reference[0])
    (step, got), (_, want) = _final_state(run), _final_state(reference[0])
    assert step == STEPS
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def _beat(run: Path, process: int) -> tuple[int, int]:
    """(step, pid) of a process's heartbeat; (0, 0) while there is none (or it is being rewritten)."""
    beat = read_beat(run / ".heartbeat" / f"process-{process}")
    return (beat[0], beat[2]) if beat else (0, 0)


def test_report_on_a_two_process_run(reference, tmp_path):
    """`meshlm report` reads a multi-process run's directory (process 0 wrote its files)."""
    from meshlm.cli import main
    from meshlm.observe.run_report import figures, read_run

    run, _ = reference
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "2 process(es)" in text and f"| progress | step {STEPS} of {STEPS} logged |" in text
    (train_line,) = figures(read_run(run))["loss"].axes[0].lines
    assert list(train_line.get_xdata()) == list(range(1, STEPS + 1))
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1  # process 0 alone writes TensorBoard
