"""Data preparation (real BPE training, cached token arrays) and the deterministic loader."""

import json
import math

import numpy as np
import pytest

from meshlm.config import ConfigError, DataConfig
from meshlm.data import corpus
from meshlm.data.loader import WindowLoader, unigram_entropy
from meshlm.data.prepare import prepare
from meshlm.data.tokenizer import EOT, load

WORDS = [
    "the",
    "a",
    "mesh",
    "shard",
    "tensor",
    "device",
    "token",
    "model",
    "layer",
    "batch",
    "data",
    "parallel",
    "gather",
    "scatter",
    "reduce",
]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(40):
        lines = [" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(60)]
        (root / f"doc{i:02d}.txt").write_text("\n".join(lines))
    (root / "ignored.bin").write_bytes(b"\x00\x01")  # not a text suffix: skipped
    return root


def _cfg(text_dir, cache, **kw) -> DataConfig:
    return DataConfig(paths=(str(text_dir),), cache_dir=str(cache), **kw)


def test_prepare_is_deterministic_and_cached(text_dir, tmp_path):
    logs = []
    a = prepare(_cfg(text_dir, tmp_path / "a"), 300, log=logs.append)
    b = prepare(_cfg(text_dir, tmp_path / "b"), 300, log=logs.append)
    assert len(logs) == 2
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        assert (a.root / name).read_bytes() == (b.root / name).read_bytes(), name
    again = prepare(_cfg(text_dir, tmp_path / "a"), 300, log=logs.append)
    assert len(logs) == 2 and again.root == a.root  # cache hit: nothing rebuilt
    meta = a.meta
    assert meta["documents"] == 40 and meta["train_tokens"] > meta["val_tokens"] > 0
    assert meta["tokenizer_vocab_size"] <= 300
    train = a.tokens("train")
    assert train.dtype == np.uint16 and int(train.max()) < 300
    assert int((train == meta["eot_id"]).sum()) == 38  # 40 docs, every 20th held out: 38 train docs
    tok = load(a.tokenizer_path)
    assert tok.token_to_id(EOT) == meta["eot_id"]
    text = "the mesh gathers a tensor."
    assert tok.decode(tok.encode(text).ids) == text  # byte-level BPE round-trips text


def test_changed_input_is_not_served_from_cache(text_dir, tmp_path):
    a = prepare(_cfg(text_dir, tmp_path), 300, log=lambda _: None)
    b = prepare(_cfg(text_dir, tmp_path), 256 + 64, log=lambda _: None)
    assert a.root != b.root


def test_given_tokenizer_is_used_and_checked(text_dir, tmp_path):
    a = prepare(_cfg(text_dir, tmp_path / "a"), 300, log=lambda _: None)
    b = prepare(_cfg(text_dir, tmp_path / "b", tokenizer=str(a.tokenizer_path)), 512, log=lambda _: None)
    assert b.meta["tokenizer_fingerprint"] == a.meta["tokenizer_fingerprint"]
    np.testing.assert_array_equal(b.tokens("train"), a.tokens("train"))
    with pytest.raises(ConfigError, match=r"tokenizer has .* tokens but model.vocab_size=100"):
        prepare(_cfg(text_dir, tmp_path / "c", tokenizer=str(a.tokenizer_path)), 100, log=lambda _: None)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read tokenizer"):
        prepare(_cfg(text_dir, tmp_path / "d", tokenizer=str(bad)), 300, log=lambda _: None)


def test_truncated_shard_is_detected(text_dir, tmp_path):
    data = prepare(_cfg(text_dir, tmp_path), 300, log=lambda _: None)
    path = data.root / "train.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        data.tokens("train")


def test_bad_paths_and_empty_corpus(tmp_path):
    with pytest.raises(ConfigError, match="data path not found"):
        corpus.resolve_files(("/no/such/dir",))
    (tmp_path / "blank.txt").write_text("   \n\n")
    with pytest.raises(ConfigError, match="corpus is empty"):
        prepare(_cfg(tmp_path, tmp_path / "cache"), 300)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="contains no text files"):
        corpus.resolve_files((str(empty),))


def test_builtin_corpus_is_the_stdlib():
    files = corpus.builtin_corpus_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert any(f.name == "json" or f.parent.name == "json" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)


def test_loader_is_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = WindowLoader(tokens, 9, 8, seed=3), WindowLoader(tokens, 9, 8, seed=3)
    for step in (5, 0, 12, 5):
        x, y = a.batch(step), b.batch(step)
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"][:, :-1], x["inputs"][:, 1:])  # next-token targets
        # any row range a process reads is exactly those rows of the global batch
        np.testing.assert_array_equal(a.batch(step, slice(2, 6))["inputs"], x["inputs"][2:6])
    assert not np.array_equal(a.batch(0)["inputs"], WindowLoader(tokens, 9, 8, seed=4).batch(0)["inputs"])


def test_each_epoch_visits_every_window_once():
    tokens = np.arange(10 * 7 + 1, dtype=np.uint16)
    loader = WindowLoader(tokens, 7, 5, seed=0)
    assert loader.n_windows == 10
    ids = np.concatenate([loader.window_ids(s) for s in range(4)])  # 20 samples = 2 epochs
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:]) == list(range(10))
    assert list(ids[:10]) != list(ids[10:])  # reshuffled per epoch


def test_loader_rejects_too_little_data():
    with pytest.raises(ConfigError, match="fewer than one window"):
        WindowLoader(np.arange(5, dtype=np.uint16), 8, 2, seed=0, name="validation")


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1, 2, 3] * 10), 8) == pytest.approx(math.log(4))
    assert unigram_entropy(np.zeros(7, dtype=np.int64), 8) == pytest.approx(0.0)


def test_meta_is_json(text_dir, tmp_path):
    data = prepare(_cfg(text_dir, tmp_path), 300, log=lambda _: None)
    assert json.loads((data.root / "meta.json").read_text()) == data.meta
