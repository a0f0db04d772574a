"""Process-group settings and launch planning (no processes started; those are in test_multiprocess)."""

import signal
import time

import pytest

from meshlm.cli.train import launch_plan
from meshlm.config import ConfigError
from meshlm.launch.supervisor import describe_exit, describe_failures, worker_command
from meshlm.parallel.mesh import process_group


def test_process_group_from_flags_and_environment():
    assert not process_group(env={}).enabled
    g = process_group("10.0.0.1:1234", 4, 2, env={})
    assert (g.coordinator, g.num_processes, g.process_id, g.enabled) == ("10.0.0.1:1234", 4, 2, True)
    env = {"MESHLM_COORDINATOR": "h:9", "MESHLM_NUM_PROCESSES": "3", "MESHLM_PROCESS_ID": "0"}
    g = process_group(env=env)
    assert (g.coordinator, g.num_processes, g.process_id) == ("h:9", 3, 0)
    assert process_group(process_id=2, env=env).process_id == 2  # flags win over the environment
    assert process_group(auto=True, env={}).auto


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(coordinator="h:1", num_processes=2), "needs --num-processes and --process-id"),
        (dict(coordinator="h:1", num_processes=2, process_id=2), "must be in [0, 2)"),
        (dict(coordinator="h", num_processes=2, process_id=0), "must be host:port"),
        (dict(num_processes=2, process_id=0), "need --coordinator"),
        (dict(coordinator="h:1", num_processes=2, process_id=0, auto=True), "either --distributed"),
        (dict(env={"MESHLM_COORDINATOR": "h:1", "MESHLM_NUM_PROCESSES": "x", "MESHLM_PROCESS_ID": "0"}), "integers"),
    ],
)
def test_bad_process_group_settings(kwargs, message):
    with pytest.raises(ConfigError) as e:
        process_group(**({"env": {}} | kwargs))
    assert message in str(e.value)


def test_plan_launch_checks_the_train_command(tmp_path, capsys):
    args, run_dir = launch_plan(["train", "--mesh", "data=2,tensor=2", "--run-dir", str(tmp_path)], 2, 2)
    assert run_dir == tmp_path and args[0] == "train"
    args, run_dir = launch_plan(["train", "--mesh", "data=4"], 4, 1)
    assert args[-2] == "--run-dir" and str(run_dir).startswith("runs/tiny-")  # fixed once for every attempt
    with pytest.raises(ConfigError) as e:
        launch_plan(["train", "--mesh", "data=4"], 2, 1)
    assert "= 4 devices, but --processes 2 x --devices-per-process 1 = 2" in str(e.value)
    with pytest.raises(ConfigError, match="runs a train command"):
        launch_plan(["memory"], 2, 1)
    with pytest.raises(ConfigError, match="sets --coordinator itself"):
        launch_plan(["train", "--coordinator", "h:1"], 2, 1)
    launch_plan(["train", "--mesh", "data=4"], 2, None)  # real accelerators: the processes decide
    # elastic: the local launcher needs to be told the capacity (under --ray, the live nodes tell it)
    from meshlm.cli import main

    elastic = ["launch", "--processes", "2", "--devices-per-process", "2", "--min-processes", "1"]
    assert main([*elastic, "--", "train", "--mesh", "data=4", "--run-dir", str(tmp_path)]) == 2
    assert "--min-processes (elastic) needs --capacity-cmd with the local launcher" in capsys.readouterr().err


def test_an_elastic_group_shrinks_its_batch_axes_only_and_keeps_the_global_batch():
    from meshlm.cli.train import _train_command
    from meshlm.launch import elastic

    base = ["train", "--mesh", "data=4,tensor=2", "--dcn", "data=4", "--set", "train.global_batch=16"]
    _, cfg = _train_command(base)
    n, small = elastic.largest(cfg, processes=4, capacity=3, least=1)  # 3 would cut data to 3: not whole
    assert n == 2 and (small.parallel.data, small.parallel.tensor, small.parallel.dcn_data) == (2, 2, 2)
    assert small.train.microbatches == 2 and small.train.global_batch == 16
    command = elastic.command([*base, "--set", "parallel.dcn_data=4"], small)
    assert command[:7] == [
        "train",
        "--set",
        "train.global_batch=16",
        "--set",
        "parallel.dcn_data=4",
        "--mesh",
        "data=2,tensor=2",
    ]
    assert "--dcn" not in command and command[-2:] == ["--set", "train.microbatches=2"]
    assert _train_command(command)[1] == small  # exactly the shrunk config: the user's own dcn set is replaced
    # --dcn keeps as many processes per slice: an uncut axis's split makes the cut go to the other axis
    _, split = _train_command(["train", "--mesh", "data=2,fsdp=4", "--dcn", "fsdp=4"])
    n, small = elastic.largest(split, 4, 2, 2)
    assert (small.parallel.data, small.parallel.fsdp, small.parallel.dcn_fsdp) == (2, 2, 2)
    _, staged = _train_command(["train", "--mesh", "stage=2,data=2", "--dcn", "stage=2"])
    assert "data=1: --dcn would leave 2 slice(s) for 2 processes" in elastic.largest(staged, 4, 2, 2)
    _, fsdp = _train_command(["train", "--mesh", "fsdp=4,tensor=2"])
    assert elastic.largest(fsdp, 4, 2, 2)[1].parallel.fsdp == 2
    # a tensor or stage group cannot lose a member; the reasons are given per size tried
    _, model_only = _train_command(["train", "--mesh", "tensor=8"])
    reason = elastic.largest(model_only, 4, 2, 1)
    assert reason.startswith("2 processes: data=1 does not shrink by 4/2") and "1 processes" in reason
    assert "fewer than --min-processes 3" in elastic.largest(cfg, 4, 2, 3)


def test_worker_command_and_exit_descriptions():
    cmd = worker_command(["train", "--steps", "3"], 4, "127.0.0.1:5", 2, 1)
    assert cmd[3:] == [
        "train",
        "--steps",
        "3",
        "--devices",
        "4",
        "--coordinator",
        "127.0.0.1:5",
        "--num-processes",
        "2",
        "--process-id",
        "1",
    ]
    assert "--devices" not in worker_command(["train"], None, "h:1", 2, 0)
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(128 + signal.SIGTERM) == "stopped by SIGTERM (exit 143)"
    assert describe_exit(1) == "exited with code 1"
    # a peer that aborts on the lost process, seen in the same poll, is not named as the cause
    kill, abort = -signal.SIGKILL, -signal.SIGABRT
    assert describe_failures([(0, abort), (3, kill)]) == "process 3 killed by SIGKILL; process 0 killed by SIGABRT too"
    assert (
        describe_failures([(2, 134), (1, abort)])
        == "process 1 killed by SIGABRT; process 2 stopped by SIGABRT (exit 134) too"
    )
    assert describe_failures([(1, 1)]) == "process 1 exited with code 1"


def test_rendezvous_listens_on_the_coordinator_address_only(monkeypatch):
    """Process 0 binds the pre-flight rendezvous to the coordinator's own address (loopback for
    `meshlm launch`), not to every interface."""
    from meshlm.parallel import mesh

    with mesh.listen("127.0.0.1", 0) as s:
        assert s.getsockname()[0] == "127.0.0.1"
    with mesh.listen("localhost", 0) as s:
        assert s.getsockname()[0] == "127.0.0.1"
    resolver = {"10.1.2.3": "10.1.2.3", "node0": "127.0.1.1", "node1": "10.0.0.7"}.get
    assert mesh.bind_address("10.1.2.3", resolver) == "10.1.2.3"
    assert mesh.bind_address("node1", resolver) == "10.0.0.7"
    assert mesh.bind_address("node0", resolver) == ""  # this machine's own name, as the cluster knows it
    with pytest.raises(ConfigError, match=r"cannot listen on the coordinator address 192\.0\.2\.1:"):
        mesh.listen("192.0.2.1", 0)  # TEST-NET-1: never this host's address
    bound = []
    real = mesh.listen
    monkeypatch.setattr(mesh, "listen", lambda host, port: bound.append(host) or real(host, port))
    from meshlm.launch.supervisor import free_port

    group = process_group(f"127.0.0.1:{free_port()}", 2, 0, timeout_s=1, env={})
    with pytest.raises(ConfigError, match="only 1 of 2 processes joined"):
        mesh.rendezvous(group)
    assert bound == ["127.0.0.1"]


@pytest.mark.parametrize("code", [2, 3, 4, 5])
def test_config_errors_and_non_finite_stops_are_not_retried(monkeypatch, tmp_path, code):
    """Exit 2 (bad config), 3 (a non-finite step stopped training), 4 (`train --check` found the
    layout differs from one device) and 5 (a full checkpoint directory, which the CLI maps
    CheckpointSpace to) would recur on a restart: the supervisor stops the group and passes the
    code on after one attempt."""
    from meshlm.checkpoint import CheckpointSpace
    from meshlm.cli import _exit_code

    assert _exit_code(CheckpointSpace("full"), "train") == 5
    import sys

    from meshlm.launch import supervisor as launch

    def worker(train_args, devices, coordinator, n, i):  # process 1 fails at once, process 0 waits
        return [sys.executable, "-c", f"import sys, time; time.sleep(0 if {i} else 60); sys.exit({code})"]

    monkeypatch.setattr(launch, "worker_command", worker)
    sup = launch.Supervisor(["train"], 2, 1, tmp_path, max_restarts=3)
    assert sup.run() == code
    assert len(sup.attempts) == 1
    assert "is not retried" in (tmp_path / "launch.log").read_text()


@pytest.mark.parametrize("clean_stop", [True, False])
def test_the_supervisor_shrinks_then_regrows_and_a_regrow_is_not_a_restart(monkeypatch, tmp_path, clean_stop):
    """Fake workers, real supervision: process 1 of 2 fails and capacity is 1, so after
    --replace-timeout the group continues on 1 process (data=2 -> 1, 2 microbatches); that worker
    reports capacity 2 back, the supervisor stops it with SIGTERM and restarts on 2 processes, which
    finish. A worker that does not stop cleanly on the regrow's SIGTERM is a failure like any other
    (with --max-restarts 1, restarts run out)."""
    import sys

    from meshlm.cli.train import _train_command
    from meshlm.launch import supervisor as launch

    capacity, commands = tmp_path / "capacity", []
    capacity.write_text("1")
    on_term = 143 if clean_stop else 1

    def worker(train_args, devices, coordinator, n, i):
        commands.append((n, train_args))
        if n == 1:  # the shrunk group: capacity comes back while it runs
            code = f"signal.signal(signal.SIGTERM, lambda *a: sys.exit({on_term})); "
            code += f"pathlib.Path({str(capacity)!r}).write_text('2'); time.sleep(60)"
        else:  # the first full group fails in process 1 (process 0 waits to be stopped); the regrown one finishes
            first = len(commands) <= 2
            code = f"time.sleep(60 if {first and i == 0} else 0.2); sys.exit({int(first and i == 1)})"
        return [sys.executable, "-c", "import pathlib, signal, sys, time; " + code]

    monkeypatch.setattr(launch, "worker_command", worker)
    args = ["train", "--mesh", "data=2"]
    sup = launch.Supervisor(
        args, 2, 1, tmp_path, max_restarts=1, min_processes=1, replace_timeout=0.5,
        capacity_cmd=f"cat {capacity}", cfg=_train_command(args)[1], capacity_poll=0.1,
    )  # fmt: skip
    code = sup.run()
    log = (tmp_path / "launch.log").read_text()
    assert "continuing on 1 processes, mesh data=1 x fsdp=1 x tensor=1, microbatches 1 -> 2" in log
    assert [n for n, _ in commands] == ([2, 2, 1, 2, 2] if clean_stop else [2, 2, 1])
    shrunk = _train_command(commands[2][1])[1]
    assert (shrunk.parallel.data, shrunk.train.microbatches) == (1, 2)
    if clean_stop:
        assert code == 0 and sup.regrows == 1 and commands[-1][1] == args
        assert [a.outcome for a in sup.attempts][1:] == ["stopped to regrow to 2 processes", "ok"]
    else:
        assert code == 1 and sup.regrows == 0
        assert sup.attempts[1].outcome == "process 0 exited with code 1 while stopping to regrow"


def test_workers_get_the_users_xla_flags_without_a_device_count(monkeypatch):
    """`meshlm launch` passes the user's XLA_FLAGS (dump flags, tuning) on to every worker, minus the
    simulated device count, which each worker's --devices sets."""
    from meshlm.launch.supervisor import host_env

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8")
    assert host_env({"A": "1"})["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    assert host_env({"A": "1"})["A"] == "1"
    monkeypatch.delenv("XLA_FLAGS")
    assert "XLA_FLAGS" not in host_env({})


def _garbage_then_group(monkeypatch, payloads: list[bytes], hellos: dict[int, int]) -> list:
    """Process 0's rendezvous for a group of 3, fed `payloads` (one connection each, closed after
    sending) and then real hellos (process id -> the process count it claims); returns
    [process 0's outcome, each hello's answer]."""
    import socket
    import threading

    from meshlm.launch.supervisor import free_port
    from meshlm.parallel import mesh

    monkeypatch.setattr(mesh, "HELLO_TIMEOUT", 0.3)
    port = free_port()
    outcome: list = []

    def serve():
        try:
            mesh.rendezvous(process_group(f"127.0.0.1:{port}", 3, 0, timeout_s=20, env={}))
            outcome.append("ok")
        except ConfigError as e:
            outcome.append(str(e))

    server = threading.Thread(target=serve)
    server.start()
    for payload in payloads:
        for _ in range(100):  # until process 0 listens
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                time.sleep(0.05)
        with conn:
            conn.sendall(payload)
            if payload and not payload.endswith(b"\n") and len(payload) < 100:
                conn.shutdown(socket.SHUT_WR)  # an early disconnect: half a hello, then EOF
            conn.settimeout(5)
            t0 = time.time()
            try:  # the rendezvous drops it without an answer (or resets it)
                answer = conn.recv(100)
            except OSError:
                answer = b""
            assert answer == b"", (payload, answer)
            if not payload:  # silent (the socket left open): dropped only after HELLO_TIMEOUT
                assert time.time() - t0 >= 0.25, time.time() - t0
    answers = {}

    def join(i, n):
        try:
            mesh.rendezvous(process_group(f"127.0.0.1:{port}", n, i, timeout_s=20, env={}))
            answers[i] = "ok"
        except ConfigError as e:
            answers[i] = str(e)

    joiners = [threading.Thread(target=join, args=item) for item in hellos.items()]
    for t in joiners:
        t.start()
    for t in [*joiners, server]:
        t.join(30)
    return [outcome[0] if outcome else None, answers]


GARBAGE = [
    b"[]\n",  # valid JSON, not an object: raised outside the try and ended process 0 before
    b"true\n",
    b'"hello"\n',
    b"not json at all\n",
    b'{"n": "3", "i": 1}\n',  # mistyped
    b'{"n": 3, "i": true}\n',  # a bool is not an id
    b'{"n": 3}\n',  # missing field
    b"\xff\xfe\x00\x01garbage\n",  # binary
    b'{"n": 3, "i": 1',  # an early disconnect mid-hello
    b"x" * 5000,  # oversized, no newline
    b"",  # connects and says nothing (dropped after HELLO_TIMEOUT)
]


def test_rendezvous_drops_malformed_connections_and_the_group_still_forms(monkeypatch):
    import random

    rng = random.Random(0)
    fuzz = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) + b"\n" for _ in range(5)]
    process0, answers = _garbage_then_group(monkeypatch, GARBAGE + fuzz, {1: 3, 2: 3})
    assert process0 == "ok" and answers == {1: "ok", 2: "ok"}


def test_rendezvous_still_stops_on_a_well_formed_hello_that_disagrees(monkeypatch):
    process0, answers = _garbage_then_group(monkeypatch, [b"[]\n"], {1: 4})
    assert "process 1 was started with --num-processes 4, process 0 with 3" in process0
    assert "did not form" in answers[1]


def test_a_slurm_task_beats_and_reads_a_requeue_as_a_restart_after_a_failure(tmp_path):
    """A SLURM task (no launcher) gets the launcher's heartbeat file; a job SLURM started again takes
    the failure's time and step from the heartbeats its previous run's tasks left (the newest time
    written in them, the largest step; not an earlier, larger group's). Outside SLURM, or under
    `meshlm launch`, nothing changes."""
    import os

    from meshlm.launch.slurm import task_env

    run = tmp_path / "run"
    assert task_env(run, {}) == {} and task_env(run, {"SLURM_PROCID": "1", "MESHLM_HEARTBEAT": "x"}) == {}
    first = task_env(run, {"SLURM_PROCID": "1", "SLURM_RESTART_COUNT": "0"})
    assert first == {"MESHLM_HEARTBEAT": str(run / ".heartbeat" / "process-1")}
    for i, (step, written) in enumerate([(9, 1000.0), (8, 1005.5), (50, 2000.0)]):  # process 2: a stale one
        beat = run / ".heartbeat" / f"process-{i}"
        beat.write_text(f"{step} {written} 4{i}\n")
        os.utime(beat, (3000.0 - i, 3000.0 - i))  # the file server's clock: not the task's
    again = task_env(run, {"SLURM_PROCID": "0", "SLURM_RESTART_COUNT": "2", "SLURM_NTASKS": "2"})
    assert again == {"MESHLM_HEARTBEAT": str(run / ".heartbeat" / "process-0"), "MESHLM_FAULT": "1005.500 9"}


def test_a_ray_restart_puts_each_process_back_on_its_node(tmp_path):
    """`meshlm launch --ray` after a failure: each process to the node it ran on (its in-memory
    copies are there), one whose node is gone to a live node no process holds, and with no such
    node wherever Ray finds room."""
    pytest.importorskip("ray")
    from meshlm.launch.ray_cluster import RaySupervisor

    sup = RaySupervisor(["train"], 3, None, tmp_path, address="auto")
    a, b, c, d = (ch * 56 for ch in "abcd")  # Ray node ids: 28 bytes, in hex
    sup.homes = [a, b, c]
    strategies, how = sup._homecoming([a, c, d])
    assert [s.node_id for s in strategies] == [a, d, c] and not strategies[0].soft
    assert how == "processes [1] moved, the others on their nodes"
    strategies, how = sup._homecoming([a, b, c])
    assert [s.node_id for s in strategies] == sup.homes and how == "each on its node"
    strategies, _ = sup._homecoming([b, c])
    assert strategies[0] == "SPREAD" and [s.node_id for s in strategies[1:]] == [b, c]
    sup.log_file.close()


def test_a_placement_that_fails_is_a_failed_attempt_and_the_group_is_resized(monkeypatch, tmp_path):
    """An elastic restart whose processes cannot be placed (`PlacementFailed`, raised by the Ray
    launcher when a node it counted is gone or full) is a failed attempt like any other: the group is
    resized and started again, not the launch ended. Real supervision, workers that exit at once."""
    import sys

    from meshlm.cli.train import _train_command
    from meshlm.launch import supervisor as launch

    monkeypatch.setattr(launch, "worker_command", lambda *a: [sys.executable, "-c", "pass"])

    class Unplaceable(launch.Supervisor):
        def _start(self, attempt):
            if attempt.number == 1:
                raise launch.PlacementFailed("Ray could not place 2 processes one a node")
            return super()._start(attempt)

    args = ["train", "--mesh", "data=2"]
    sup = Unplaceable(
        args, 2, 1, tmp_path, max_restarts=1, min_processes=1, replace_timeout=0.5,
        capacity_cmd="echo 2", cfg=_train_command(args)[1], capacity_poll=0.1,
    )  # fmt: skip
    assert sup.run() == 0
    assert [a.outcome for a in sup.attempts] == ["Ray could not place 2 processes one a node", "ok"]


def test_every_cpu_process_writes_its_own_compilation_cache_entry(monkeypatch):
    """`platform.compile_cache`: JAX's write on process 0 and off CPU; on another CPU process, the
    entry under that process's key - not with host callbacks or under the minimum compile time; a
    failed write warns, or raises where JAX is set to raise."""
    from types import SimpleNamespace

    from jax._src import compilation_cache, compiler, distributed

    from meshlm.platform.compile_cache import write_on_every_cpu_process

    jax_writes, puts = [], []

    def jax_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        jax_writes.append(cache_key)

    monkeypatch.setattr(compiler, "_cache_write", jax_write)
    monkeypatch.setattr(compilation_cache, "put_executable_and_time", lambda key, *a: puts.append(key))
    assert write_on_every_cpu_process() and write_on_every_cpu_process()  # installed once, then found
    cpu, gpu = SimpleNamespace(platform="cpu"), SimpleNamespace(platform="gpu")
    for process, backend, callbacks, seconds, key in [
        (0, cpu, [], 5.0, "process 0"),
        (1, gpu, [], 5.0, "gpu"),
        (1, cpu, [], 5.0, "cpu 1"),
        (1, cpu, ["callback"], 5.0, "callbacks"),
        (1, cpu, [], 0.0, "quick"),
    ]:
        monkeypatch.setattr(distributed.global_state, "process_id", process)
        compiler._cache_write(key, seconds, "jit_step", backend, object(), callbacks)
    assert jax_writes == ["process 0", "gpu"] and puts == ["cpu 1"]

    def full(*args):
        raise OSError("disk full")

    monkeypatch.setattr(compilation_cache, "put_executable_and_time", full)
    with pytest.warns(UserWarning, match="disk full"):
        compiler._cache_write("k", 5.0, "jit_step", cpu, object(), [])
    from jax._src import config

    with config.raise_persistent_cache_errors(True), pytest.raises(OSError, match="disk full"):
        compiler._cache_write("k", 5.0, "jit_step", cpu, object(), [])
