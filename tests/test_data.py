"""Data preparation (real BPE training, cached token arrays) and the deterministic loader."""

import dataclasses
import json
import math

import numpy as np
import pytest

from meshlm.config import ConfigError, DataConfig
from meshlm.data import corpus
from meshlm.data.loader import WindowLoader, document_segments, local_rows, process_batch
from meshlm.data.prepare import load as load_prepared
from meshlm.data.prepare import prepare, unigram_entropy
from meshlm.data.tokenizer import EOT, load
from meshlm.data.units import Unit

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
    assert len(logs) == 4  # "preparing" + "prepared", twice
    assert sorted(p.name for p in a.root.iterdir()) == [
        "index.json",
        "tokenizer.json",
        "train-00000.bin",
        "val-00000.bin",
    ]
    for path in a.root.iterdir():
        assert path.read_bytes() == (b.root / path.name).read_bytes(), path.name
    again = prepare(_cfg(text_dir, tmp_path / "a"), 300, log=logs.append)
    assert len(logs) == 4 and again.root == a.root  # cache hit: nothing rebuilt
    meta = a.meta
    assert meta["documents"] == {"train": 38, "val": 2} and meta["train_tokens"] > meta["val_tokens"] > 0
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
    with pytest.raises(ConfigError, match=r"uses a tokenizer of .* tokens but model.vocab_size=100"):
        prepare(_cfg(text_dir, tmp_path / "c", tokenizer=str(a.tokenizer_path)), 100, log=lambda _: None)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read tokenizer"):
        prepare(_cfg(text_dir, tmp_path / "d", tokenizer=str(bad)), 300, log=lambda _: None)


def test_truncated_or_corrupt_shard_is_detected(text_dir, tmp_path):
    cfg = _cfg(text_dir, tmp_path)
    data = prepare(cfg, 300, log=lambda _: None)
    path = data.root / "train-00000.bin"
    good = path.read_bytes()
    path.write_bytes(good[:-10])
    with pytest.raises(ConfigError, match=r"truncated or corrupt: .* expected"):
        prepare(cfg, 300, log=lambda _: None)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(ConfigError, match=r"is corrupt .*BLAKE2b"):
        prepare(cfg, 300, log=lambda _: None)
    prepare(dataclasses.replace(cfg, verify=False), 300, log=lambda _: None)  # sizes only: passes
    path.unlink()
    with pytest.raises(ConfigError, match="is missing"):
        prepare(dataclasses.replace(cfg, verify=False), 300, log=lambda _: None)


def test_bad_paths_and_empty_corpus(tmp_path):
    with pytest.raises(ConfigError, match="data path not found"):
        corpus.resolve_files(("/no/such/dir",))
    (tmp_path / "blank.txt").write_text("   \n\n")
    with pytest.raises(ConfigError, match="corpus is empty"):
        prepare(_cfg(tmp_path, tmp_path / "cache"), 300)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="contains no corpus files"):
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


def test_unigram_entropy(text_dir, tmp_path):
    assert unigram_entropy(np.bincount([0, 1, 2, 3] * 10, minlength=8)) == pytest.approx(math.log(4))
    assert unigram_entropy(np.array([7, 0, 0])) == pytest.approx(0.0)
    # the index's value is the entropy of the training tokens as written
    data = prepare(_cfg(text_dir, tmp_path), 300, log=lambda _: None)
    counts = np.bincount(np.asarray(data.tokens("train"), dtype=np.int64), minlength=300)
    assert data.meta["train_unigram_entropy"] == pytest.approx(unigram_entropy(counts), rel=1e-12)


def test_index_is_json(text_dir, tmp_path):
    data = prepare(_cfg(text_dir, tmp_path), 300, log=lambda _: None)
    assert json.loads((data.root / "index.json").read_text()) == data.meta


# ----------------------------------------------------------------------------- meshlm data prepare


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory, text_dir):
    """A text directory, a JSONL file (documents in field "body") and a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(5)
    with open(root / "docs.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"id": i, "body": " ".join(rng.choice(WORDS, 40))}) + "\n")
    rows = [" ".join(rng.choice(WORDS, 30)) for _ in range(25)]
    pq.write_table(pa.table({"body": rows, "n": list(range(25))}), root / "docs.parquet")
    return [str(text_dir), str(root / "docs.jsonl"), str(root / "docs.parquet")]


def _prepare_cli(inputs, out, *extra):
    from meshlm.cli import main

    return main(["data", "prepare", "--input", *inputs, "--out", str(out), "--field", "body", *extra])


def test_data_prepare_mixed_inputs_is_deterministic(mixed_inputs, tmp_path, capsys):
    args = ("--vocab-size", "300", "--shard-tokens", "20000", "--val-fraction", "0.1", "--workers", "2")
    assert _prepare_cli(mixed_inputs, tmp_path / "a", *args) == 0
    assert _prepare_cli(mixed_inputs, tmp_path / "b", *args) == 0
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and "train-00001.bin" in files
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    data = load_prepared(tmp_path / "a")
    docs = data.meta["documents"]
    assert docs["train"] + docs["val"] == 40 + 30 + 25 and docs["val"] == 9  # every 10th document
    shards = data.shards("train")
    assert len(shards) > 1 and all(len(s) <= 20000 for s in shards)
    assert sum(len(s) for s in shards) == data.meta["train_tokens"]
    eot = data.meta["eot_id"]
    assert sum(int((s == eot).sum()) for s in shards) == docs["train"]  # one end-of-text per document
    # a given tokenizer: the same ids
    assert _prepare_cli(mixed_inputs, tmp_path / "c", "--tokenizer", str(data.tokenizer_path), *args[2:]) == 0
    np.testing.assert_array_equal(load_prepared(tmp_path / "c").tokens("train"), data.tokens("train"))
    capsys.readouterr()
    from meshlm.cli import main

    assert main(["data", "info", str(tmp_path / "a")]) == 0
    assert "verified" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"body": "x"}\n{not json}\n', "docs.jsonl:2: not valid JSON"),
        ('{"text": "x"}\n', "docs.jsonl:1: no field 'body' (has: text)"),
    ],
)
def test_bad_jsonl_is_a_clear_error(tmp_path, capsys, content, message):
    (tmp_path / "docs.jsonl").write_text(content)
    assert _prepare_cli([str(tmp_path / "docs.jsonl")], tmp_path / "out", "--vocab-size", "300") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))  # nothing half-written


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("weights.bin", bytes(range(256)) * 64, "weights.bin: not a text file (contains NUL bytes)"),
        ("notes.txt", np.random.default_rng(0).integers(128, 256, 4000, dtype=np.uint8).tobytes(), "not valid UTF-8"),
    ],
)
def test_binary_input_is_refused_naming_the_file(tmp_path, capsys, name, content, message):
    (tmp_path / name).write_bytes(content)
    (tmp_path / "real.txt").write_text("plain text, " * 100)
    assert (
        _prepare_cli([str(tmp_path / "real.txt"), str(tmp_path / name)], tmp_path / "out", "--vocab-size", "300") == 2
    )
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_parquet_missing_column_and_empty_corpus(mixed_inputs, tmp_path, capsys):
    from meshlm.cli import main

    rc = main(["data", "prepare", "--input", mixed_inputs[2], "--out", str(tmp_path / "o"), "--vocab-size", "300"])
    assert rc == 2 and "no column 'text' (has: body, n)" in capsys.readouterr().err
    (tmp_path / "blank.jsonl").write_text('{"body": "  "}\n')
    assert _prepare_cli([str(tmp_path / "blank.jsonl")], tmp_path / "o", "--vocab-size", "300") == 2
    assert "corpus is empty" in capsys.readouterr().err


def test_prepared_dataset_feeds_the_run_config(mixed_inputs, tmp_path):
    assert _prepare_cli(mixed_inputs, tmp_path / "ds", "--vocab-size", "300") == 0
    data = prepare(DataConfig(paths=(str(tmp_path / "ds"),)), 320)
    assert data.root == tmp_path / "ds"
    with pytest.raises(ConfigError, match=r"tokenizer of 300 tokens but model.vocab_size=256"):
        prepare(DataConfig(paths=(str(tmp_path / "ds"),)), 256)
    with pytest.raises(ConfigError, match="among other inputs"):
        prepare(DataConfig(paths=(str(tmp_path / "ds"), mixed_inputs[1])), 320)


# ----------------------------------------------------------------------------- loader: shards, processes


def test_windows_stay_inside_shards_and_each_epoch_visits_all():
    shards = [np.arange(0, 23, dtype=np.uint16), np.arange(100, 136, dtype=np.uint16)]  # 3 + 5 windows of 7+1
    loader = WindowLoader(shards, 7, 4, seed=1)
    assert loader.n_windows == 3 + 5
    seen = []
    for step in range(2):  # one epoch
        rows = loader.batch(step)["inputs"]
        for r in rows:
            assert (r < 100).all() or (r >= 100).all()  # never straddles two shards
            np.testing.assert_array_equal(np.diff(r), 1)
            seen.append(int(r[0]))
    assert sorted(seen) == [0, 7, 14, 100, 107, 114, 121, 128]


@pytest.mark.parametrize("resume_at", [0, 3, 7])
def test_any_process_count_reads_the_same_global_batches(resume_at):
    """Processes read contiguous row blocks of each global batch; a run resumed at step k with
    1, 2 or 4 processes sees exactly the batches of an uninterrupted single-process run."""
    tokens = np.arange(5000, dtype=np.uint16) % 997
    reference = WindowLoader(tokens, 16, 8, seed=7)
    for processes in (1, 2, 4):
        readers = [WindowLoader(tokens, 16, 8, seed=7) for _ in range(processes)]
        per = 8 // processes
        for step in range(resume_at, resume_at + 3):
            parts = [r.batch(step, slice(p * per, (p + 1) * per)) for p, r in enumerate(readers)]
            for key in ("inputs", "targets"):
                glued = np.concatenate([part[key] for part in parts])
                np.testing.assert_array_equal(glued, reference.batch(step)[key])


def test_local_rows_are_the_rows_a_device_group_holds(devices):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshlm.config import ParallelConfig
    from meshlm.parallel.mesh import make_mesh

    mesh = make_mesh(ParallelConfig(data=2, tensor=4))
    sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
    # a "process" holding the first host's 4 devices (one data row-block, all tensor ranks)
    assert local_rows(sharding, (8, 16), devices[:4]) == slice(0, 4)
    assert local_rows(sharding, (8, 16), devices[4:]) == slice(4, 8)
    data8 = NamedSharding(make_mesh(ParallelConfig(data=8)), P(("data", "fsdp"), None))
    assert local_rows(data8, (16, 4), devices[2:4]) == slice(4, 8)
    assert local_rows(sharding, (8, 16)) == slice(0, 8)  # one process holds everything


def test_process_batch_builds_the_global_array(devices):
    import jax

    from meshlm.config import ParallelConfig
    from meshlm.parallel.mesh import make_layout
    from meshlm.step import batch_sharding

    layout = make_layout(ParallelConfig(data=2, fsdp=2, tensor=2))
    loader = WindowLoader(np.arange(3000, dtype=np.uint16) % 251, 16, 8, seed=0, eot_id=0)
    arrays = process_batch(loader, 5, batch_sharding(layout))
    want = loader.batch(5)
    assert set(arrays) == {"inputs", "targets", "segment_ids", "positions"}
    for k, v in arrays.items():
        assert v.sharding == batch_sharding(layout)
        np.testing.assert_array_equal(jax.device_get(v), want[k])


def test_document_segments():
    eot = 0
    inputs = np.array([[5, 6, 0, 7, 8, 9, 0, 0, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    out = document_segments(inputs, eot)
    np.testing.assert_array_equal(out["segment_ids"], [[0, 0, 0, 1, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(out["positions"], [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]])


def test_progress_bar_and_single_document(tmp_path, capsys):
    from meshlm.data.prepare import write_dataset

    text = " ".join(WORDS * 40)
    data = write_dataset(
        [Unit("texts", texts=(text,), nbytes=len(text))], tmp_path / "one", vocab_size=300, progress=True
    )
    assert "tokenizing" in capsys.readouterr().out
    # one document: its tail is held out, so both splits exist
    assert data.meta["documents"] == {"train": 1, "val": 1} and data.meta["val_tokens"] > 0


def test_a_cache_entry_prepared_meanwhile_is_kept_not_replaced(tmp_path):
    """Two processes preparing one cache entry (same fingerprinted sources): the one that finishes
    second keeps the first's dataset - another process may be reading it - and discards its own.
    A preparation without a source fingerprint (an explicit --out) still replaces what is there."""
    from meshlm.data.prepare import write_dataset

    texts = [Unit("texts", texts=tuple(" ".join(WORDS[i:] + WORDS[:i]) * 20 for i in range(len(WORDS))))]
    out, quiet = tmp_path / "entry", (lambda _: None)
    first = write_dataset(texts, out, vocab_size=300, source_fingerprint="key", log=quiet)
    (out / "a-reader-has-this-open").write_text("")
    second = write_dataset(texts, out, vocab_size=300, source_fingerprint="key", log=quiet)
    assert (out / "a-reader-has-this-open").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
    np.testing.assert_array_equal(np.asarray(second.tokens("train")), np.asarray(first.tokens("train")))
    write_dataset(texts, out, vocab_size=300, log=quiet)
    assert not (out / "a-reader-has-this-open").exists()


def test_a_dataset_of_another_format_is_a_clear_error(mixed_inputs, tmp_path):
    assert _prepare_cli(mixed_inputs[1:2], tmp_path / "ds", "--vocab-size", "300") == 0
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index | {"format": 2}))
    with pytest.raises(ConfigError, match=r"has dataset format 2, expected 3 or 4; prepare it again"):
        prepare(DataConfig(paths=(str(tmp_path / "ds"),)), 320)
