"""Preparation at scale: work units in several processes and on Ray give the bytes of one process
(and of an independent reference), a killed preparation resumes to the same bytes, every input
format users have (JSONL .gz/.zst, Parquet globs, `datasets` directories), bad input skipped and
counted."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import subprocess_env
from meshlm.cli import main
from meshlm.data.prepare import load
from meshlm.data.tokenizer import eot_id
from test_data import WORDS as BASE_WORDS

WORDS = [*BASE_WORDS, "é", "中"]  # and characters of 2 and 3 UTF-8 bytes


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Text files, a JSONL file (blank records among them), the same format gzip- and
    zstd-compressed, two Parquet files of several row groups (named by a glob) and a `datasets`
    save_to_disk directory of two Arrow files: (the --input arguments, every document in order as an
    independent reader sees it)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root = tmp_path_factory.mktemp("scale")
    rng = np.random.default_rng(2)
    doc = lambda n: " ".join(rng.choice(WORDS, int(rng.integers(1, n))))
    (root / "texts").mkdir()
    for i in range(12):
        (root / "texts" / f"{i:02d}.txt").write_text(doc(300))
    jsonl = [doc(80) if i % 17 else "  " for i in range(400)]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(jsonl)))
    packed = [doc(40) for _ in range(60)]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in packed).encode()
    (root / "b.jsonl.gz").write_bytes(gzip.compress(raw[: len(raw) // 2].rsplit(b"\n", 1)[0] + b"\n"))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    rows = [[doc(50) for _ in range(150)] for _ in range(2)]
    for i, r in enumerate(rows):
        pq.write_table(pa.table({"text": r}), root / f"p{i}.parquet", row_group_size=20)
    hf = [doc(30) for _ in range(200)]
    datasets.Dataset.from_dict({"text": hf}).save_to_disk(str(root / "hf"), num_shards=2)
    args = [str(root / "texts"), str(root / "a.jsonl"), str(root / "b.jsonl.gz"), str(root / "c.jsonl.zst")]
    args += [str(root / "p*.parquet"), str(root / "hf")]
    docs = [(root / "texts" / f"{i:02d}.txt").read_text() for i in range(12)] + jsonl
    with gzip.open(root / "b.jsonl.gz", "rt") as f:
        docs += [json.loads(line)["text"] for line in f]
    docs += packed + rows[0] + rows[1] + list(datasets.load_from_disk(str(root / "hf"))["text"])
    return args, [d for d in docs if d.strip()]


def _prepare(inputs, out, *extra) -> int:
    return main(["data", "prepare", "--input", *inputs, "--out", str(out), "--val-fraction", "0.1", *extra])


def test_any_number_of_processes_gives_the_reference_bytes(inputs, tmp_path):
    """Units of 4 kB (byte ranges of the JSONL file, row groups, Arrow batches, runs of text files):
    1, 2 and 4 processes write the same bytes, and those are the documents encoded one by one,
    every 10th to validation (a reader that shares no code). Ray tasks: test_multiprocess.py."""
    args, docs = inputs
    assert _prepare(args, tmp_path / "p1", "--vocab-size", "300", "--processes", "1") == 0
    tok = str(tmp_path / "p1" / "tokenizer.json")
    runs = [("p2", "--processes", "2"), ("p4", "--processes", "4")]
    for name, *how in runs:
        assert _prepare(args, tmp_path / name, "--tokenizer", tok, "--unit-mb", "0.004", *how) == 0
    ref = load(tmp_path / "p1")
    for name, *_ in runs:
        assert sorted(os.listdir(tmp_path / name)) == sorted(os.listdir(tmp_path / "p1"))
        for f in os.listdir(tmp_path / "p1"):
            assert (tmp_path / name / f).read_bytes() == (tmp_path / "p1" / f).read_bytes(), (name, f)
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(tok)
    split = {"train": [], "val": []}
    for n, d in enumerate(docs, 1):
        split["val" if n % 10 == 0 else "train"] += [*t.encode(d, add_special_tokens=False).ids, eot_id(t)]
    for s in ("train", "val"):
        np.testing.assert_array_equal(np.asarray(ref.tokens(s)), split[s])
    assert ref.meta["documents"] == {"train": len(docs) - len(docs) // 10, "val": len(docs) // 10}
    assert not list(tmp_path.glob(".*.work"))  # the work units are removed once published
    # the index's entropy is the written training tokens' (summed from the workers' counts, less validation)
    counts = np.bincount(np.asarray(load(tmp_path / "p4").tokens("train")), minlength=300)
    p = counts[counts > 0] / counts.sum()
    assert load(tmp_path / "p4").meta["train_unigram_entropy"] == pytest.approx(float(-(p * np.log(p)).sum()), 1e-12)


@pytest.mark.parametrize("cap", [60_000, 700])
def test_a_capped_preparation_in_processes_equals_the_reference(inputs, tmp_path, cap):
    """--max-mb: documents in order until `cap` bytes of UTF-8 text, the one that crosses it cut
    (never inside a character: the cap is moved to fall inside one), read in 4 kB units by 2
    processes. Near 700 bytes there are fewer than 10 documents, so the last one's tail is held out."""
    args, docs = inputs
    stream = "".join(docs).encode()  # (blank documents are already out)
    cap = next(c for c in range(cap, len(stream)) if stream[c] & 0xC0 == 0x80)  # a continuation byte
    assert _prepare(args, tmp_path / "p1", "--vocab-size", "300", "--processes", "1") == 0
    tok = str(tmp_path / "p1" / "tokenizer.json")
    extra = ["--tokenizer", tok, "--unit-mb", "0.004", "--processes", "2", "--max-mb", str(cap / 1e6)]
    assert _prepare(args, tmp_path / "capped", *extra) == 0
    kept, total = [], 0
    for d in docs:  # the cap, written out plainly
        raw = d.encode()
        if len(raw) > cap - total:
            d = raw[: cap - total].decode("utf-8", errors="ignore")
            raw = raw[: cap - total]
        if d.strip():
            kept.append(d)
            total += len(raw)
        if total >= cap:
            break
    if len(kept) < 10:
        cut = int(len(kept[-1]) * 0.9)
        pairs = [("train", d) for d in kept[:-1]] + [("train", kept[-1][:cut]), ("val", kept[-1][cut:])]
    else:
        pairs = [("val" if n % 10 == 0 else "train", d) for n, d in enumerate(kept, 1)]
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(tok)
    split = {"train": [], "val": []}
    for s, d in pairs:
        split[s] += [*t.encode(d, add_special_tokens=False).ids, eot_id(t)]
    data = load(tmp_path / "capped")
    for s in ("train", "val"):
        np.testing.assert_array_equal(np.asarray(data.tokens(s)), split[s])
    assert (len(kept) < 10) == (cap < 1000) and any("é" in d or "中" in d for d in kept)


def test_a_kept_unit_is_reused_only_while_its_files_are_unchanged(tmp_path):
    from meshlm.data import runner, units

    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n')
    (unit,) = units.plan([path])
    work = runner.WorkDir(tmp_path / "work", "tokenizer-and-field", strict=True)
    result = units.encode(unit, units.TokenizerSource.of(_tiny_tokenizer()))
    work.put(0, unit, result)
    assert work.has(0, unit) and work.get(0, unit)["doc_tokens"].tolist() == result["doc_tokens"].tolist()
    assert not runner.WorkDir(tmp_path / "work", "another tokenizer", strict=True).has(0, unit)
    path.write_text('{"text": "two"}\n')  # same size, a new modification time
    os.utime(path, ns=(1, 1))
    assert not work.has(0, units.plan([path])[0])
    skipped = dict(result, skipped={"not_json": 1}, examples=["a.jsonl:2: not valid JSON"])
    (unit,) = units.plan([path])
    work.put(0, unit, skipped)
    assert runner.WorkDir(tmp_path / "work", "tokenizer-and-field", strict=False).get(0, unit) is not None
    assert work.get(0, unit) is None  # a strict preparation must meet the bad line itself


def _tiny_tokenizer():
    from meshlm.data.tokenizer import train_bpe

    return train_bpe(["one two three"] * 3, 260)


def test_a_killed_preparation_resumes_to_the_same_bytes(inputs, tmp_path):
    """SIGKILL (the process group: the driver and its workers) once some units are finished; the
    same command again reuses them and writes what an uninterrupted run writes."""
    args, _ = inputs
    opts = ["--vocab-size", "300", "--unit-mb", "0.002", "--val-fraction", "0.1"]
    cmd = [sys.executable, "-m", "meshlm", "data", "prepare", "--input", *args, *opts]
    work = tmp_path / ".killed.work"
    proc = subprocess.Popen(
        [*cmd, "--out", str(tmp_path / "killed"), "--processes", "2"],
        env=subprocess_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while len(list(work.glob("*.npz"))) < 8 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(list(work.glob("*.npz")))
    assert finished >= 8 and not (tmp_path / "killed").exists(), "killed too late: the preparation had finished"
    again = subprocess.run(
        [*cmd, "--out", str(tmp_path / "killed"), "--processes", "1"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stderr
    assert f"resuming: {finished} of" in again.stderr
    assert _prepare(args, tmp_path / "whole", *opts[:-2]) == 0
    for f in os.listdir(tmp_path / "whole"):
        assert (tmp_path / "killed" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f
    assert not work.exists()


def test_bad_input_is_skipped_and_counted_or_stops_the_strict_default(inputs, tmp_path, capsys):
    args, docs = inputs
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("caf\xe9 na\xefve ".encode("latin-1") * 50)
    (bad / "zz.jsonl").write_text('{"text": "fine one"}\n{broken\n{"body": "no text"}\n[1, 2]\n{"text": "fine two"}\n')
    damaged = "".join(json.dumps({"text": f"kept {i} {i * i}"}) + "\n" for i in range(20000)).encode()
    (bad / "trunc.jsonl.gz").write_bytes(gzip.compress(damaged)[:-100])
    with gzip.open(bad / "trunc.jsonl.gz", "rt") as f:  # the lines Python's own reader gives before the error
        before = []
        with pytest.raises(EOFError):
            for line in f:
                before.append(line)
    import zstandard

    (bad / "trunc.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(damaged)[:-100])
    partial = zstandard.ZstdDecompressor().stream_reader(open(bad / "trunc.jsonl.zst", "rb")).read()  # noqa: SIM115
    before = [line for line in before if line.endswith("\n")] + partial.splitlines(keepends=True)[:-1]
    (bad / "zz2.jsonl").write_text('{"text": "bad \\ud83d alone"}\n{"text": "a pair \\ud83d\\ude00 is fine"}\n')
    inputs_ = [*args, str(bad)]
    from meshlm.data.tokenizer import train_bpe

    train_bpe(docs, 300).save(str(tmp_path / "tok.json"))  # given, so the units start at once
    tok = ["--tokenizer", str(tmp_path / "tok.json")]
    assert _prepare(inputs_, tmp_path / "out", *tok, "--processes", "2") == 2
    err = capsys.readouterr().err
    assert "latin1.txt: not a text file (" in err  # the first bad input, by name
    assert "finished work units are kept in" in err and not (tmp_path / "out").exists()  # no dataset
    assert _prepare(inputs_, tmp_path / "out", *tok, "--on-error", "skip") == 0
    assert "resuming: " in capsys.readouterr().err  # the units the strict run finished
    assert _prepare(inputs_, tmp_path / "fresh", *tok, "--on-error", "skip") == 0  # the same bytes from scratch
    for f in os.listdir(tmp_path / "fresh"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "fresh" / f).read_bytes(), f
    meta = load(tmp_path / "out").meta
    assert meta["skipped"] == {"not_text": 1, "not_json": 1, "no_field": 2, "unreadable": 2, "bad_text": 1}
    assert sum(meta["documents"].values()) == len(docs) + 3 + len(before) > len(docs) + 3 + 20_000
    examples = meta["skipped_examples"]
    assert len(examples) == 5 and any(e.startswith(f"{bad / 'zz.jsonl'}:2: not valid JSON (") for e in examples)
    capsys.readouterr()
    assert main(["data", "info", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "skipped: 2 records without the field" in out and "skipped: 2 files that could not be read" in out


def test_a_datasets_dict_and_an_empty_glob_are_clear_errors(tmp_path, capsys):
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    assert _prepare([str(tmp_path / "dd")], tmp_path / "o", "--vocab-size", "300") == 2
    assert "holds several splits (train, test); give one, e.g." in capsys.readouterr().err
    assert _prepare([str(tmp_path / "*.parquet")], tmp_path / "o", "--vocab-size", "300") == 2
    assert "pattern matches nothing" in capsys.readouterr().err


def test_units_cut_a_jsonl_file_at_line_starts(tmp_path):
    """Byte ranges own the lines that start inside them: every line once, whatever the range size."""
    from meshlm.data import units

    lines = [json.dumps({"text": "x" * n}) for n in range(1, 60)]
    path = tmp_path / "l.jsonl"
    path.write_text("\n".join(lines))  # no newline at the end
    for size in (1, 7, 30, 64, 10_000):
        plan = units.plan([path], size)
        got = [d for u in plan for d in units.documents(u)]
        assert got == ["x" * n for n in range(1, 60)], size
        assert sum(u.nbytes for u in plan) == path.stat().st_size
