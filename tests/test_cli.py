"""The command line, end to end: real subprocesses for what a user types, including bad input."""

import json
import platform
import subprocess
import sys

import numpy as np
import pytest

from helpers import subprocess_env
from meshlm.cli import main
from meshlm.config import from_dict


def _cli(*args: str, timeout: float = 120, **env_vars: str) -> subprocess.CompletedProcess:
    env = subprocess_env(**env_vars)
    return subprocess.run(
        [sys.executable, "-m", "meshlm", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "tensor=3"], "model.n_heads=4 is not divisible by mesh axis 'tensor' (size 3)"),
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--set", "model.n_layerz=2"], "ModelConfig has no field 'n_layerz'"),
        (["--set", "train.steps=many"], "TrainConfig.steps expects an integer, got 'many'"),
        (["--set", "data.paths=/definitely/missing", "--steps", "1"], "data path not found: /definitely/missing"),
        (["--mesh", "data=4", "--devices", "2"], "needs 4 devices but 2 are available"),
        (["--init-from", "/definitely/missing/run", "--steps", "1"], "--init-from path not found"),
    ],
)
def test_bad_input_gives_one_clear_line(args, message, tmp_path):
    r = _cli("train", "--run-dir", str(tmp_path / "run"), *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    if "--init-from" in args:  # caught with the other arguments, before the run starts
        assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "mesh", "shard", "token", "layer"]
    for i in range(20):
        (root / f"{i}.md").write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(80)))
    return root


def test_train_writes_config_and_metrics(small_corpus, tmp_path, devices):
    run = tmp_path / "run"
    rc = main(
        [
            "train",
            "--recipe",
            "llama-tiny",
            "--mesh",
            "fsdp=2,tensor=2",
            "--steps",
            "12",
            "--set",
            f"data.paths={small_corpus}",
            "--set",
            "model.vocab_size=320",
            "--set",
            "train.log_every=4",
            "--set",
            "train.eval_every=6",
            "--set",
            "train.seq_len=32",
            "--run-dir",
            str(run),
        ]
    )
    assert rc == 0
    cfg = from_dict(json.loads((run / "config.json").read_text()))
    assert (cfg.parallel.fsdp, cfg.parallel.tensor, cfg.train.steps) == (2, 2, 12)
    assert cfg.model.family == "llama" and cfg.data.paths == (str(small_corpus),)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == [4, 8, 12] and [r["step"] for r in evals] == [6, 12]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "hfu"} <= r.keys()
        assert r["hfu"] >= r["mfu"]  # hardware FLOPs include recomputation
        # MFU is exactly 1 in the window whose rate raised a CPU probe taken on a busy host
        assert np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and 0 < r["mfu"] <= 1
    assert steps[-1]["loss"] < steps[0]["loss"]
    info = json.loads((run / "run.json").read_text())
    assert info["mesh"] == {"stage": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert info["params"] > 0


def test_print_config_and_recipes(capsys):
    assert main(["train", "--recipe", "gpt-22b", "--print-config", "--set", "train.steps=7"]) == 0
    cfg = from_dict(json.loads(capsys.readouterr().out))
    assert cfg.model.d_model == 6144 and cfg.train.steps == 7
    assert main(["recipes"]) == 0
    assert "gpt-175b" in capsys.readouterr().out


@pytest.mark.slow
def test_default_tiny_job_learns(default_run):
    """The README's main job, as a user runs it: the built-in corpus, the default `tiny` recipe.
    Its validation loss must end well below the unigram entropy of its tokens."""
    run = default_run
    assert (run / "tokenizer.json").is_file()  # the run carries its tokenizer (generate, eval, export)
    info = json.loads((run / "run.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    entropy = info["unigram_entropy"]
    assert entropy > 5.0  # a real BPE vocabulary over real text
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":  # meshlm.platform.host_memory, on by default
        assert info["host_allocator"].startswith("on"), info["host_allocator"]
    assert val[-1] < entropy - 1.5, (val, entropy)
    assert val == sorted(val, reverse=True)  # validation loss falls at every evaluation
    print(f"tiny: val losses {val}, unigram entropy {entropy:.3f}")


def test_dry_run_reports_layout_and_matches_xla_argument_bytes(tmp_path, capsys, devices):
    run = tmp_path / "dry"
    args = ["train", "--dry-run", "--mesh", "fsdp=2,tensor=4", "--set", "parallel.sequence_parallel=true"]
    assert main([*args, "--set", "remat.policy=selective", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "P(None, 'fsdp', 'tensor')" in out and "expected bound" in out
    assert not (run / "metrics.jsonl").read_text()  # nothing trained
    report = json.loads((run / "run.json").read_text())["startup_report"]
    predicted = report["predicted_device_bytes"]
    assert predicted["gradients (fp32)"] == predicted["parameters (fp32)"]
    assert predicted["optimizer state"] >= 2 * predicted["parameters (fp32)"]  # Adam's two moments
    # The compiled step's arguments are the state and the batch; ours are exact up to scalars.
    cfg = from_dict(json.loads((run / "config.json").read_text()))
    batch = 2 * 4 * cfg.train.global_batch * cfg.train.seq_len // cfg.parallel.batch_shards
    state = predicted["parameters (fp32)"] + predicted["optimizer state"]
    assert state + batch <= report["xla_memory_analysis"]["argument_size"] <= state + batch + 64


def test_bench_writes_table_and_chart(tmp_path, capsys, devices):
    run = tmp_path / "bench"
    args = ["bench", "--layouts", "data=8;tensor=4,data=2+sp", "--policies", "elementwise,full", "--steps", "2"]
    small = ["--set", "model.n_layers=2", "--set", "train.seq_len=64", "--set", "model.max_seq_len=64"]
    assert main([*args, *small, "--run-dir", str(run)]) == 0
    table = (run / "bench.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| data") or line.startswith("| tensor")]
    assert len(rows) == 4 and "meshlm bench --layouts" in table
    assert (run / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    acts = {tuple(c.strip() for c in r.split("|")[1:3]): float(r.split("|")[8]) for r in rows}
    assert acts[("data=8", "full")] < acts[("data=8", "elementwise")]  # recomputation stores less
    mfus = [float(r.split("|")[6].strip().rstrip("%")) for r in rows]
    assert all(0 < m < 100 for m in mfus)


def test_compiled_step_is_reused_from_the_persistent_cache(tmp_path):
    """A second process compiling the same step loads it from JAX's persistent cache under
    $MESHLM_CACHE/xla (and says so); --no-compile-cache neither reads nor writes it."""
    args = ["train", "--dry-run", "--mesh", "data=2", "--set", "model.n_layers=2"]
    cache = str(tmp_path / "cache")
    first = _cli(*args, "--run-dir", str(tmp_path / "a"), MESHLM_CACHE=cache)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "train step compiled in" in first.stdout and "cache hit" not in first.stdout
    assert any((tmp_path / "cache" / "xla").iterdir())
    second = _cli(*args, "--run-dir", str(tmp_path / "b"), MESHLM_CACHE=cache)
    assert "(persistent compilation cache hit)" in second.stdout, second.stdout[:2000]
    assert json.loads((tmp_path / "b" / "run.json").read_text())["compile_cache_hit"] is True
    off = _cli(*args, "--no-compile-cache", "--run-dir", str(tmp_path / "c"), MESHLM_CACHE=str(tmp_path / "none"))
    assert off.returncode == 0 and "cache hit" not in off.stdout and not (tmp_path / "none" / "xla").exists()
