"""Seeing a run: TensorBoard event files equal metrics.jsonl (and a resumed run has no duplicate
points), W&B offline, profiles of exactly the asked steps, `meshlm report` figures, and the quiet
and JSON console modes."""

import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import logged_losses, tiny_config
from meshlm.config import CheckpointConfig, DataConfig, validate
from meshlm.run_report import figures, read_run, write_report
from meshlm.trainer import train


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
    4 to 10, so steps 5-8 were logged twice. 'interrupted': stopped at step 6 of 10."""
    root = tmp_path_factory.mktemp("runs")
    cfg = _cfg(corpus_dir, root / "cache")
    train(cfg, root / "resumed", quiet=True, stop_after=8)
    shutil.rmtree(root / "resumed" / "checkpoints" / "8")
    train(cfg, root / "resumed", quiet=True)
    train(cfg, root / "interrupted", quiet=True, stop_after=6)
    return root


def _tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()  # applies the purge_step a resumed writer records, as TensorBoard does
    return acc


def test_tensorboard_equals_metrics_jsonl_without_duplicates(runs):
    run = runs / "resumed"
    acc = _tensorboard(run)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 11))  # each step once, 5-8 from the resumed attempt
    logged = logged_losses(run)  # the last record per step
    np.testing.assert_allclose([e.value for e in loss], [logged[s] for s in range(1, 11)], rtol=1e-6)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert {e.step: pytest.approx(e.value, rel=1e-6) for e in acc.Scalars("val/loss")} == val
    tags = set(acc.Tags()["scalars"])
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "perf/hfu", "perf/step_time_s"} <= tags
    assert "checkpoint/save_s" in tags and "memory/optimizer_state_bytes" in tags
    assert any(t.startswith("startup_report") for t in acc.Tags()["tensors"])


def test_wandb_sink_offline(tmp_path, monkeypatch):
    """The W&B sink records what it is given, offline (no network here), under <run_dir>/wandb."""
    from meshlm.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink("meshlm-test", tmp_path, {"model": {"d_model": 64}}, quiet=True)
    sink.scalars(3, {"train/loss": 1.5, "perf/mfu": 0.25})
    sink.scalars(4, {"train/loss": 1.25})  # W&B commits a step when the next one starts
    summary = dict(sink.run.summary)
    assert (summary["train/loss"], summary["perf/mfu"], summary["_step"]) == (1.5, 0.25, 3)
    assert sink.run.config["model"]["d_model"] == 64
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_is_never_imported_unless_asked(monkeypatch, tmp_path):
    code = (
        "import sys, pathlib; import meshlm.cli, meshlm.trainer, meshlm.sinks as s; from meshlm.config import "
        "MetricsConfig; s.open_sinks(MetricsConfig(), pathlib.Path(sys.argv[1]), 0, {}); "
        "assert 'wandb' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    from meshlm.config import ConfigError, MetricsConfig
    from meshlm.sinks import open_sinks

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"pip install 'meshlm\[wandb\]'"):
        open_sinks(MetricsConfig(tensorboard=False, wandb="p"), tmp_path, 0, {})


def test_profile_steps_trace_exactly_those_steps(corpus_dir, tmp_path, capsys):
    cfg = _cfg(corpus_dir, tmp_path / "cache", steps=6, profile_steps="3:5", eval_every=0)
    train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert "profiling steps 3..4 (jax.profiler) into" in out and "profile of steps 3..4 written" in out
    (trace,) = (tmp_path / "run" / "profile").rglob("*.trace.json.gz")
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and "args" in e)
    assert steps == [3, 4]


def test_report_figures_have_the_right_axes_and_series(runs, tmp_path):
    resumed, interrupted = read_run(runs / "resumed"), read_run(runs / "interrupted")
    assert sorted(interrupted.steps) == list(range(1, 7))  # an interrupted run reports what it has
    figs = figures(resumed, [interrupted])
    by_step, by_tokens = figs["loss"].axes
    assert (by_step.get_xlabel(), by_tokens.get_xlabel()) == ("step", "tokens")
    labels = [line.get_label() for line in by_step.lines]
    assert labels == ["resumed train", "resumed validation", "interrupted train", "interrupted validation"]
    assert list(by_step.lines[0].get_xdata()) == list(range(1, 11))
    assert by_tokens.lines[0].get_xdata()[-1] == 10 * 8 * 32  # steps x batch x sequence
    rate, mfu = figs["throughput"].axes
    assert rate.get_ylabel() == "tokens / s" and mfu.get_ylabel() == "MFU (%)" and len(rate.lines) == 2
    assert figs["lr"].axes[0].get_ylabel() == "learning rate"
    memory = figs["memory"].axes[0]
    assert [t.get_text() for t in memory.get_xticklabels()] == ["predicted", "compiled (XLA)"]
    legend = [t.get_text() for t in memory.get_legend().get_texts()]
    assert "parameters (fp32)" in legend and "act: logits" in legend and "argument_size" in legend
    report = write_report(runs / "resumed", [runs / "interrupted"], tmp_path / "out")
    text = report.read_text()
    assert "Compared with:" in text and "| progress | step 10 of 10 logged |" in text
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {f"{n}.png" for n in figs}


def _cli(*args, **env):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | env
    return subprocess.run([sys.executable, "-m", "meshlm", *args], capture_output=True, text=True, env=env, timeout=300)


def test_quiet_prints_nothing_and_json_lines_parse(corpus_dir, tmp_path):
    args = ["train", "--steps", "4", "--set", f"data.paths={corpus_dir}", "--set", "model.vocab_size=320"]
    args += ["--set", "train.seq_len=32", "--set", "train.log_every=2", "--set", "metrics.tensorboard=false"]
    quiet = _cli(*args, "--quiet", "--run-dir", str(tmp_path / "q"), MESHLM_CACHE=str(tmp_path / "cache"))
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == "", quiet.stderr[-2000:]
    assert len(logged_losses(tmp_path / "q")) == 2  # it did train
    js = _cli(*args, "--log-format", "json", "--run-dir", str(tmp_path / "j"), MESHLM_CACHE=str(tmp_path / "cache"))
    assert js.returncode == 0, js.stderr[-2000:]
    records = [json.loads(line) for line in js.stdout.splitlines()]
    assert [r["step"] for r in records] == [2, 4] and all("loss" in r and "tokens_per_s" in r for r in records)
    assert "train step compiled in" in js.stderr  # every other message goes to stderr
    assert not (tmp_path / "j" / "tb").exists()
