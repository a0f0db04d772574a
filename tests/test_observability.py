"""Seeing a run: TensorBoard event files equal metrics.jsonl (and a resumed run has no duplicate
points), W&B offline, profiles of exactly the asked steps, `meshlm report` figures, and the quiet
and JSON console modes."""

import dataclasses
import gzip
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import logged_losses, subprocess_env, tiny_config
from meshlm.config import CheckpointConfig, DataConfig
from meshlm.observe.run_report import figures, read_run, write_report
from meshlm.trainer import train
from meshlm.validation import validate


def _cfg(corpus_dir, cache, steps=10, **train_kw):
    cfg = tiny_config("gpt", dict(data=2), steps=steps, log_every=1, eval_every=5, seq_len=32)
    return validate(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, vocab_size=320),
            train=dataclasses.replace(cfg.train, **train_kw),
            data=DataConfig(paths=(str(corpus_dir),), cache_dir=str(cache)),
            checkpoint=CheckpointConfig(every=4, keep=10),
        )
    )


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory):
    """'resumed': 8 steps, its step-8 checkpoint lost (a crash after logging step 8), resumed from
    4 to 10 with another learning rate, so steps 5-8 were logged twice with different values.
    'restarted': 3 steps that never checkpointed, then rerun from step 0 to 10.
    'interrupted': stopped at step 6 of 10."""
    root = tmp_path_factory.mktemp("runs")
    cfg = _cfg(corpus_dir, root / "cache")
    train(cfg, root / "resumed", quiet=True, stop_after=8)
    shutil.rmtree(root / "resumed" / "checkpoints" / "8")
    train(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-3)), root / "resumed", quiet=True)
    train(cfg, root / "restarted", quiet=True, stop_after=3)
    shutil.rmtree(root / "restarted" / "checkpoints")
    train(cfg, root / "restarted", quiet=True)
    train(cfg, root / "interrupted", quiet=True, stop_after=6)
    return root


def _tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()  # applies the purge_step a resumed writer records, as TensorBoard does
    return acc


def _last_records(run_dir) -> tuple[dict[int, dict], dict[int, float]]:
    """metrics.jsonl's logged-step records and validation losses as the run ended up: a `resume`
    record drops what the interrupted attempt logged after the step it resumed from."""
    steps, val = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "resume":
            steps = {k: v for k, v in steps.items() if k <= r["step"]}
            val = {k: v for k, v in val.items() if k <= r["step"]}
        elif "loss" in r and "event" not in r:
            steps[r["step"]] = r
        elif "val_loss" in r:
            val[r["step"]] = r["val_loss"]
    return steps, val


@pytest.mark.parametrize("name", ["resumed", "restarted"])
def test_tensorboard_equals_metrics_jsonl_without_duplicates(runs, name):
    run = runs / name
    acc = _tensorboard(run)
    records, val_losses = _last_records(run)
    if name == "resumed":  # the redone steps really differ, so "the later attempt's" is tested
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        first_attempt = lines[: next(i for i, r in enumerate(lines) if r.get("event") == "resume")]
        (step7,) = [r for r in first_attempt if r.get("step") == 7 and "loss" in r]
        assert step7["loss"] != records[7]["loss"]
    for tag, key in [("train/loss", "loss"), ("train/lr", "lr"), ("perf/tokens_per_s", "tokens_per_s")]:
        points = acc.Scalars(tag)
        steps = [e.step for e in points]
        assert steps == sorted(set(steps)), f"{tag}: a step charted twice"
        want = {s: r[key] for s, r in records.items() if r.get(key) is not None}
        assert steps == sorted(want), tag
        np.testing.assert_allclose([e.value for e in points], [want[s] for s in steps], rtol=1e-6, err_msg=tag)
    val = acc.Scalars("val/loss")
    assert [e.step for e in val] == sorted(val_losses) == [5, 10]
    np.testing.assert_allclose([e.value for e in val], [val_losses[5], val_losses[10]], rtol=1e-6)
    tags = set(acc.Tags()["scalars"])
    assert {"train/grad_norm", "train/skipped_steps", "perf/mfu", "perf/hfu", "perf/step_time_s"} <= tags
    assert "checkpoint/save_s" in tags and "memory/optimizer_state_bytes" in tags
    assert any(t.startswith("startup_report") for t in acc.Tags()["tensors"])


def test_step_time_excludes_evaluation_and_checkpoint_saves(corpus_dir, tmp_path, monkeypatch):
    """The rate of a log window counts every step in it and none of the evaluation or save time:
    on a clock that moves 1 s per training step, 100 s per evaluation and 10 s per save, every
    window reports exactly 1 s per step (windows 3-6 and 6-9 hold saves at 4 and 8, an evaluation at 5)."""
    import meshlm.train_loop as loop_mod
    from meshlm.checkpoint import Checkpointer

    clock = [0.0]

    def advancing(fn, seconds):
        def wrapped(*args, **kwargs):
            clock[0] += seconds
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(loop_mod, "_clock", lambda: clock[0])
    monkeypatch.setattr(loop_mod, "process_batch", advancing(loop_mod.process_batch, 1.0))  # once per step
    monkeypatch.setattr(loop_mod, "evaluate", advancing(loop_mod.evaluate, 100.0))
    monkeypatch.setattr(Checkpointer, "save", advancing(Checkpointer.save, 10.0))
    cfg = _cfg(corpus_dir, tmp_path / "cache", steps=10, log_every=3)
    train(cfg, tmp_path / "run", quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    saves = [r["step"] for r in records if "checkpoint_save_s" in r]
    assert saves == [4, 8] and [r["step"] for r in records if "val_loss" in r] == [5, 10]
    assert times == {3: 1.0, 6: 1.0, 9: 1.0, 10: 1.0}


def test_a_low_cpu_probe_is_raised_so_mfu_stays_below_one(corpus_dir, tmp_path, monkeypatch, capsys):
    """A probe cached while the host was busy (here 1 MFLOP/s) would put MFU far above 100%: each
    window whose model FLOP rate beats the peak raises it to that rate, says so, and caches it, and
    run.json names the peak the last windows were quoted against."""
    from meshlm.platform import hardware

    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "peak"))
    (tmp_path / "peak").mkdir()
    (tmp_path / "peak" / "peak_flops.json").write_text(json.dumps({hardware._cpu_key("float32"): 1e6}))
    train(_cfg(corpus_dir, tmp_path / "cache", steps=5, log_every=2, eval_every=0), tmp_path / "run")
    assert "above the CPU peak estimate (0 GFLOP/s; a matmul probe reads low" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r for r in records if "mfu" in r]
    assert len(rates) == 3 and all(0 < r["mfu"] <= 1 for r in rates)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    fastest = max(info["model_flops_per_step"] / r["step_time_s"] for r in rates)
    assert info["peak_flops_per_s"] == pytest.approx(fastest, rel=1e-9)
    assert "a run's model FLOP rate" in info["peak_source"]
    assert hardware.peak_flops("float32", 8).flops == pytest.approx(fastest, rel=1e-9)


def test_wandb_sink_offline(tmp_path, monkeypatch):
    """The W&B sink records what it is given, offline (no network here), under <run_dir>/wandb."""
    from meshlm.observe.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink("meshlm-test", tmp_path, {"model": {"d_model": 64}}, quiet=True)
    sink.scalars(3, {"train/loss": 1.5, "perf/mfu": 0.25})
    sink.scalars(2, {"train/loss": 1.25})  # a resumed attempt may log an earlier meshlm step: kept
    summary = dict(sink.run.summary)
    assert (summary["train/loss"], summary["perf/mfu"], summary["step"], summary["_step"]) == (1.25, 0.25, 2, 1)
    assert sink.run.config["model"]["d_model"] == 64
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_falls_back_to_offline_when_unreachable(tmp_path, monkeypatch):
    """Logged in (a key is set) but no network (this machine has none): the run logs offline
    instead of failing."""
    from meshlm.observe.sinks import WandbSink

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    said = []
    sink = WandbSink("meshlm-test", tmp_path, {}, quiet=True, log=said.append)
    assert sink.run.offline and "logging offline" in said[0]
    sink.close()


def test_wandb_is_never_imported_unless_asked(monkeypatch, tmp_path):
    """Nor PyTorch, which tensorboardX imports when it can (installed here): 2.5-5 s of every run's start-up."""
    code = (
        "import sys, pathlib; import meshlm.cli, meshlm.trainer, meshlm.observe.sinks as s; from meshlm.config import "
        "MetricsConfig; s.open_sinks(MetricsConfig(), pathlib.Path(sys.argv[1]), 0, {}); "
        "assert 'wandb' not in sys.modules and 'torch' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    from meshlm.config import ConfigError, MetricsConfig

    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # as if the extra were not installed
    cfg = dataclasses.replace(tiny_config(), metrics=MetricsConfig(wandb="p"))
    with pytest.raises(ConfigError, match=r"pip install 'meshlm\[wandb\]'"):  # before any work, every process
        validate(cfg)


def _traced_steps(trace) -> list[int]:
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and "args" in e)


def test_profile_steps_trace_exactly_those_steps(corpus_dir, tmp_path, capsys):
    """3:5 traces steps 3 and 4; a run stopped after step 3 and resumed traces 3, then 4; a range
    past the end is clipped to the run's last step."""
    cfg = _cfg(corpus_dir, tmp_path / "cache", steps=6, profile_steps="3:5", eval_every=0)
    train(cfg, tmp_path / "whole")
    out = capsys.readouterr().out
    assert "profiling steps 3..4 (jax.profiler) into" in out and "profile of steps 3..4 written" in out
    (trace,) = (tmp_path / "whole" / "profile").rglob("*.trace.json.gz")
    assert _traced_steps(trace) == [3, 4]
    train(cfg, tmp_path / "resumed", quiet=True, stop_after=3)
    train(cfg, tmp_path / "resumed", quiet=True)
    traces = sorted((tmp_path / "resumed" / "profile").rglob("*.trace.json.gz"))
    assert [_traced_steps(t) for t in traces] == [[3], [4]]
    clipped = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, profile_steps="5:100"))
    train(clipped, tmp_path / "clipped", quiet=True)
    (trace,) = (tmp_path / "clipped" / "profile").rglob("*.trace.json.gz")
    assert _traced_steps(trace) == [5, 6]


def test_report_figures_have_the_right_axes_and_series(runs, tmp_path):
    resumed, interrupted = read_run(runs / "resumed"), read_run(runs / "interrupted")
    assert sorted(interrupted.steps) == list(range(1, 7))  # an interrupted run reports what it has
    assert resumed.steps == _last_records(runs / "resumed")[0]  # the resumed attempt's records
    figs = figures(resumed, [interrupted])
    by_step, by_tokens = figs["loss"].axes
    assert (by_step.get_xlabel(), by_tokens.get_xlabel()) == ("step", "tokens")
    labels = [line.get_label() for line in by_step.lines]
    assert labels == ["resumed train", "resumed validation", "interrupted train", "interrupted validation"]
    assert list(by_step.lines[0].get_xdata()) == list(range(1, 11))
    assert by_tokens.lines[0].get_xdata()[-1] == 10 * 8 * 32  # steps x batch x sequence
    rate, mfu = figs["throughput"].axes
    assert rate.get_ylabel() == "tokens / s" and mfu.get_ylabel() == "MFU (%)" and len(rate.lines) == 2
    assert figs["lr"].axes[0].get_ylabel() == "learning rate" and len(mfu.lines) == 2
    grad = figs["grad_norm"].axes[0]
    assert grad.get_xlabel() == "step" and list(grad.lines[0].get_ydata()) == [
        resumed.steps[s]["grad_norm"] for s in range(1, 11)
    ]
    memory = figs["memory"].axes[0]
    assert [t.get_text() for t in memory.get_xticklabels()] == ["predicted", "compiled (XLA)"]
    legend = [t.get_text() for t in memory.get_legend().get_texts()]
    assert "parameters (fp32)" in legend and "act: logits" in legend and "argument_size" in legend
    report = write_report(runs / "resumed", [runs / "interrupted"], tmp_path / "out")
    text = report.read_text()
    assert "Compared with:" in text and "| progress | step 10 of 10 logged |" in text
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {f"{n}.png" for n in figs}


def _cli(*args, **env):
    env = subprocess_env(**env)
    return subprocess.run([sys.executable, "-m", "meshlm", *args], capture_output=True, text=True, env=env, timeout=300)


def test_quiet_prints_nothing_and_json_lines_parse(corpus_dir, tmp_path):
    args = ["train", "--steps", "4", "--set", f"data.paths={corpus_dir}", "--set", "model.vocab_size=320"]
    args += ["--set", "train.seq_len=32", "--set", "train.log_every=2"]
    quiet = _cli(
        *args,
        "--quiet",
        "--set",
        "metrics.wandb=meshlm-test",
        "--run-dir",
        str(tmp_path / "q"),
        MESHLM_CACHE=str(tmp_path / "cache"),
        WANDB_MODE="offline",
    )
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == "", quiet.stderr[-2000:]
    assert len(logged_losses(tmp_path / "q")) == 2  # it did train, and wrote TensorBoard and W&B files
    assert list((tmp_path / "q" / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "q" / "wandb").glob("offline-run-*/run-*.wandb"))
    js = _cli(*args, "--log-format", "json", "--run-dir", str(tmp_path / "j"), MESHLM_CACHE=str(tmp_path / "cache"))
    assert js.returncode == 0, js.stderr[-2000:]
    records = [json.loads(line) for line in js.stdout.splitlines()]
    assert [r["step"] for r in records] == [2, 4] and all("loss" in r and "tokens_per_s" in r for r in records)
    assert "train step compiled in" in js.stderr  # every other message goes to stderr
