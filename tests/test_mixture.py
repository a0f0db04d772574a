"""Weighted data mixtures (`data.mixture`): Megatron's greedy blend against a plain reference, the
per-source fractions, each source's own epochs, batches that depend on the step alone (resume at
any step, any number of processes), and a run that logs the tokens each source gave."""

import dataclasses
import json

import numpy as np
import pytest

from helpers import tiny_config
from meshlm.config import ConfigError, DataConfig
from meshlm.data import mixture as M
from meshlm.data.loader import WindowLoader
from meshlm.data.prepare import write_dataset
from meshlm.data.units import Unit
from meshlm.validation import validate


def megatron_greedy(weights: list[float], n: int) -> np.ndarray:
    """The reference: Megatron-Core's `build_blending_indices` (helpers.cpp) transcribed, float
    weights, one sample at a time: sample i goes to argmax_d w_d max(i, 1) - c_d, the first source
    on ties (its loop keeps the first maximum)."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.zeros(len(w))
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        errors = w * max(i, 1) - counts
        d = int(np.argmax(errors))
        out[i] = d
        counts[d] += 1
    return out


def test_blend_is_megatrons_greedy():
    """On weights that are multiples of 1/PERIOD (so quantising changes nothing), across two block
    boundaries: sample for sample the reference's sources, and each source's index is its count so far."""
    weights = [0.5, 0.25, 0.125, 0.125]
    odd = list(M.quantise([0.1, 0.2, 0.7]) / M.PERIOD)  # quantised: the reference gets those; the largest
    n = 2 * M.PERIOD + 3000  # last, so sample PERIOD (every error 0: to the first source) starts a new block
    g = np.arange(n)
    for ws in (weights, odd):
        blend = M.Blend(ws)
        source, index = blend.assign(g)
        np.testing.assert_array_equal(source, megatron_greedy(ws, n))
        for d in range(len(ws)):
            np.testing.assert_array_equal(index[source == d], np.arange(int((source == d).sum())))
        counts = np.stack([np.cumsum(source == d) for d in range(len(ws))], axis=1)
        for k in (1, 17, M.PERIOD, M.PERIOD + 1, 2 * M.PERIOD + 5, n):
            np.testing.assert_array_equal(blend.counts(k), counts[k - 1])
    assert M.Blend([3, 1]).shares.tolist() == [3 * M.PERIOD // 4, M.PERIOD // 4]  # weights are normalised


def test_fractions_follow_the_weights_within_one_sample():
    """Over 10k samples each source's fraction is within 1% of its weight (the issue's bar); over
    two periods every prefix holds each source within three samples of its share n w (Megatron's
    max(i, 1) weighs samples 0 and 1 alike: 2.16 at most measured over 20 random sets of 2-8)."""
    rng = np.random.default_rng(0)
    for ws in ([0.7, 0.2, 0.1], list(rng.random(7)), [0.999, 0.001]):
        blend = M.Blend(ws)
        w = np.asarray(ws) / np.sum(ws)
        source, _ = blend.assign(np.arange(10_000))
        np.testing.assert_allclose(np.bincount(source, minlength=len(w)) / 10_000, w, atol=0.01)
        source, _ = blend.assign(np.arange(2 * M.PERIOD))
        counts = np.stack([np.cumsum(source == d) for d in range(len(w))], axis=1)
        share = np.arange(1, 2 * M.PERIOD + 1)[:, None] * (blend.shares / M.PERIOD)[None, :]
        assert np.abs(counts - share).max() < 3
        assert abs(blend.shares / M.PERIOD - w).max() <= 1 / M.PERIOD


def test_quantise_keeps_every_source():
    shares = M.quantise([1.0] + [1e-9] * 5)
    assert shares.sum() == M.PERIOD and shares.min() == 1 and shares[0] == M.PERIOD - 5


def _loaders(tokens_a, tokens_b, seed=5, rows=8):
    a = WindowLoader(tokens_a, 8, rows, (seed, 0))
    b = WindowLoader(tokens_b, 8, rows, (seed, 1))
    return M.MixtureLoader([a, b], [0.25, 0.75], ["a", "b"], rows), a, b


def test_each_source_reads_as_a_lone_corpus_and_epochs_on_its_own():
    """Source d's samples, in the order the mixture takes them, are the samples of a loader over
    that source alone (its own permutation per epoch): the small source wraps into new epochs (each
    a fresh permutation of all its windows) while the large one is still in its first."""
    small = (np.arange(8 * 5 + 1) % 200).astype(np.uint16)  # 5 windows
    large = (np.arange(8 * 400 + 1) % 200 + 300).astype(np.uint16)  # 400 windows, ids >= 300
    mix, a, b = _loaders(small, large)
    steps = 10
    got = np.concatenate([mix.batch(s)["inputs"] for s in range(steps)])
    from_a = got[got[:, 0] < 300]
    n_a = len(from_a)
    assert n_a == mix.blend.counts(steps * 8)[0] == 20  # a quarter of 80 samples
    alone = np.concatenate([a.rows([a._window(int(w)) for w in a.sample_windows(np.arange(n_a))])["inputs"]])
    np.testing.assert_array_equal(from_a, alone)
    for epoch in range(4):  # 20 samples of a 5-window source: 4 epochs, each every window once
        ids = a.sample_windows(np.arange(5 * epoch, 5 * epoch + 5))
        assert sorted(ids.tolist()) == [0, 1, 2, 3, 4]
    ids_b = b.sample_windows(np.arange(60))
    assert len(set(ids_b.tolist())) == 60  # the large source has not repeated a window
    assert mix.source_tokens(steps) == {"tokens/a": 20 * 8, "tokens/b": 60 * 8}


@pytest.mark.parametrize("resume_at", [0, 9, 123])
def test_batches_depend_on_the_step_alone(resume_at):
    """A fresh loader (a resumed run) at step k, read by 1, 2 or 4 processes in row blocks, gives the
    batches of one uninterrupted reader."""
    small = (np.arange(8 * 7 + 1) % 97).astype(np.uint16)
    large = (np.arange(8 * 50 + 1) % 89 + 100).astype(np.uint16)
    reference, _, _ = _loaders(small, large)
    for _ in range(resume_at):  # the uninterrupted reader has read every batch before
        reference.batch(_)
    for processes in (1, 2, 4):
        readers = [_loaders(small, large)[0] for _ in range(processes)]
        per = 8 // processes
        for step in range(resume_at, resume_at + 2):
            parts = [r.batch(step, slice(p * per, (p + 1) * per)) for p, r in enumerate(readers)]
            for key in ("inputs", "targets"):
                glued = np.concatenate([part[key] for part in parts])
                np.testing.assert_array_equal(glued, reference.batch(step)[key])


def test_config_errors_name_the_entry():
    base = tiny_config("gpt")
    for bad in ("a/b", "0:a", "-1:a", "x:a", "0.5:"):
        with pytest.raises(ConfigError, match=r"data\.mixture entry"):
            validate(dataclasses.replace(base, data=DataConfig(mixture=(bad,))))
    with pytest.raises(ConfigError, match=r"drop data\.paths"):
        validate(dataclasses.replace(base, data=DataConfig(mixture=("1:a",), paths=("b",))))


def test_a_mixture_run_logs_tokens_per_source(tmp_path, capsys):
    """Two prepared sources sharing a tokenizer; a run on 0.75 / 0.25 logs the tokens each gave (the
    blend's counts), records the sources in run.json, shows them in the report, and `meshlm eval`
    asks which source to evaluate. A source with another tokenizer is refused."""
    from meshlm.inference import eval_tokens
    from meshlm.observe.run_report import _summary, read_run
    from meshlm.trainer import train

    quiet = lambda _: None
    words = [["alpha", "beta", "gamma", "delta"], ["one", "two", "three", "four"]]
    rng = np.random.default_rng(0)
    texts = [[" ".join(rng.choice(w, 12)) for _ in range(200)] for w in words]
    web = write_dataset([Unit("texts", texts=tuple(texts[0]))], tmp_path / "web", vocab_size=300, log=quiet)
    code = write_dataset(
        [Unit("texts", texts=tuple(texts[1]))], tmp_path / "code", tokenizer=str(web.tokenizer_path), log=quiet
    )
    other = write_dataset([Unit("texts", texts=tuple(texts[1]))], tmp_path / "other", vocab_size=300, log=quiet)
    cfg = tiny_config("gpt", dict(data=2), steps=6, log_every=3, eval_every=6, seq_len=32)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=320))
    mix = (f"0.75:{web.root}", f"0.25:{code.root}")
    cfg = validate(dataclasses.replace(cfg, data=DataConfig(mixture=mix)))
    result = train(cfg, tmp_path / "run", quiet=True)
    assert np.isfinite(result.val_loss)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if "loss" in r and "event" not in r}
    for step in (3, 6):
        n = step * cfg.train.global_batch
        expected = M.Blend([0.75, 0.25]).counts(n) * cfg.train.seq_len
        assert [logged[step]["tokens/web"], logged[step]["tokens/code"]] == expected.tolist()
        assert sum(expected) == n * cfg.train.seq_len
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [(p["name"], p["weight"]) for p in info["data"]["mixture"]] == [("web", 0.75), ("code", 0.25)]
    summary = "\n".join(_summary(read_run(tmp_path / "run")))
    assert "tokens per source" in summary and "web 1,152 (75.0%, weight 75.0%), code 384 (25.0%" in summary
    with pytest.raises(ConfigError, match=r"trained on a data\.mixture"):
        eval_tokens(type("M", (), {"tokenizer": object()})(), run_dir=tmp_path / "run")
    bad = validate(dataclasses.replace(cfg, data=DataConfig(mixture=(f"1:{web.root}", f"1:{other.root}"))))
    with pytest.raises(ConfigError, match="different tokenizers"):
        train(bad, tmp_path / "bad", quiet=True)
