"""Process-group settings and launch planning (no processes started; those are in test_multiprocess)."""

import signal

import pytest

from meshlm.config import ConfigError
from meshlm.launch import describe_exit, plan_launch, worker_command
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


def test_plan_launch_checks_the_train_command(tmp_path):
    args, run_dir = plan_launch(["train", "--mesh", "data=2,tensor=2", "--run-dir", str(tmp_path)], 2, 2)
    assert run_dir == tmp_path and args[0] == "train"
    args, run_dir = plan_launch(["train", "--mesh", "data=4"], 4, 1)
    assert args[-2] == "--run-dir" and str(run_dir).startswith("runs/tiny-")  # fixed once for every attempt
    with pytest.raises(ConfigError) as e:
        plan_launch(["train", "--mesh", "data=4"], 2, 1)
    assert "= 4 devices, but --processes 2 x --devices-per-process 1 = 2" in str(e.value)
    with pytest.raises(ConfigError, match="runs a train command"):
        plan_launch(["memory"], 2, 1)
    with pytest.raises(ConfigError, match="sets --coordinator itself"):
        plan_launch(["train", "--coordinator", "h:1"], 2, 1)
    plan_launch(["train", "--mesh", "data=4"], 2, None)  # real accelerators: the processes decide


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
