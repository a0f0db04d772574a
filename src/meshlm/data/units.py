"""Work units: a corpus cut into pieces that any process, on any host, tokenizes on its own.

A unit is one of:
    text     a run of whole text files (one document each), about `unit_bytes` together
    jsonl    the lines of an uncompressed JSONL file that *start* inside a byte range
             (so a line is never cut and never read twice), or a whole `.gz` / `.zst` file
    parquet  a range of one Parquet file's row groups
    arrow    a range of record batches of one Arrow stream file (a `datasets.save_to_disk` directory)
    texts    documents given in memory (the Python API and tests)

Units are planned from the file list and its metadata alone, in input order. The documents of
units 0, 1, ... read in that order are exactly the inputs' documents in order, whatever process
reads each unit and however big units are: that is what makes a parallel preparation's bytes equal
a serial one's.

Bad input: with `Skips(strict=True)` (the default) the first bad file, line or record raises a
ConfigError naming it. With `strict=False` it is skipped and counted by cause, and the first few
are named (`EXAMPLES`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshlm.config import ConfigError
from meshlm.data import corpus

CAUSES = {
    "not_text": "files that are not text",
    "unreadable": "files that could not be read",
    "not_json": "lines that are not JSON",
    "no_field": "records without the field",
    "bad_text": "records whose text is not valid Unicode",
    "bad_record": "chat or completion records that could not be rendered",
}
EXAMPLES = 5  # bad inputs named in the index and `meshlm data info`
VERSION = 1  # of what `encode` returns: a kept unit of another version is encoded again


@dataclass(frozen=True)
class Unit:
    kind: str  # text | jsonl | parquet | arrow | texts
    paths: tuple[str, ...] = ()
    start: int = 0  # jsonl: byte offset; parquet: row group; arrow: record batch
    end: int = -1  # exclusive; -1: to the end of the file
    nbytes: int = 0  # input bytes it covers (progress, MB/s)
    texts: tuple[str, ...] = ()  # kind "texts"

    def key(self) -> str:
        """Identity of the unit and of the files' current state (size, mtime): a finished unit
        kept from an interrupted preparation is reused only if this is unchanged."""
        h = hashlib.blake2b(digest_size=8)
        h.update(json.dumps([self.kind, self.paths, self.start, self.end]).encode())
        for p in self.paths:
            st = os.stat(p)
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        for t in self.texts:
            h.update(t.encode("utf-8", "surrogatepass") + b"\x00")
        return h.hexdigest()


@dataclass
class Skips:
    """Bad input met while reading: raised at once (strict), or counted by cause."""

    strict: bool = True
    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def __call__(self, cause: str, where, message: str, n: int = 1) -> None:
        """`where` is a string or a callable making one (a line number is counted only if needed)."""
        if self.strict or len(self.examples) < EXAMPLES:
            text = f"{where() if callable(where) else where}: {message}"
            if self.strict:
                raise ConfigError(text)
            self.examples.append(text)
        self.counts[cause] = self.counts.get(cause, 0) + n

    def add(self, counts: dict[str, int], examples: list[str]) -> None:
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        self.examples = (self.examples + list(examples))[:EXAMPLES]


# ----------------------------------------------------------------------------------------- planning


def auto_unit_bytes(files: list[Path]) -> int:
    """A 64th of the inputs, between 1 and 64 MiB: enough units to keep every process busy to the
    end (the last units are small next to the whole), few enough to cost nothing each. It depends
    on the inputs alone, so a preparation resumed with another process count finds its units."""
    total = sum(f.stat().st_size for f in files)
    return int(min(64 << 20, max(1 << 20, total // 64)))


def plan(files: list[Path], unit_bytes: int = 0) -> list[Unit]:
    """Cut `files` (in order) into units of about `unit_bytes` (0: `auto_unit_bytes`) input bytes."""
    unit_bytes = unit_bytes or auto_unit_bytes(files)
    units: list[Unit] = []
    run: list[str] = []
    run_bytes = 0

    def flush():
        nonlocal run, run_bytes
        if run:
            units.append(Unit("text", tuple(run), nbytes=run_bytes))
        run, run_bytes = [], 0

    for f in files:
        k = corpus.kind(f) or "text"
        size = f.stat().st_size
        if k == "text":
            run.append(str(f))
            run_bytes += size
            if run_bytes >= unit_bytes:
                flush()
            continue
        flush()
        if k == "jsonl" and not corpus.compressed(f):
            units += [
                Unit("jsonl", (str(f),), a, min(a + unit_bytes, size), min(unit_bytes, size - a))
                for a in range(0, size, unit_bytes)
            ]
        elif k in ("parquet", "arrow"):
            units += _grouped(f, k, size, unit_bytes)
        else:
            units.append(Unit(k, (str(f),), nbytes=size))
    flush()
    return units


def _grouped(path: Path, kind: str, size: int, unit_bytes: int) -> list[Unit]:
    """Units of consecutive Parquet row groups / Arrow record batches of about `unit_bytes`
    (by their uncompressed size, scaled to the file's bytes for progress)."""
    try:
        sizes = _parquet_group_bytes(path) if kind == "parquet" else _arrow_batch_bytes(path)
    except Exception:  # an unreadable file: one unit, whose reader names the problem (or skips it)
        return [Unit(kind, (str(path),), nbytes=size)]
    total = max(1, sum(sizes))
    out, start, acc = [], 0, 0
    for i, b in enumerate(sizes):
        acc += b
        if acc >= unit_bytes or i == len(sizes) - 1:
            out.append(Unit(kind, (str(path),), start, i + 1, size * acc // total))
            start, acc = i + 1, 0
    return out


def _parquet_group_bytes(path: Path) -> list[int]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]


def _arrow_batch_bytes(path: Path) -> list[int]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:  # zero-copy: only the batches' metadata is read
        return [batch.nbytes for batch in pa.ipc.open_stream(source)]


# ------------------------------------------------------------------------------------------ reading


def documents(unit: Unit, field: str = "text", skips: Skips | None = None) -> Iterator[str]:
    """The non-blank documents of `unit`, in order."""
    skips = skips if skips is not None else Skips()
    readers = {"text": _text, "jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}
    docs = iter(unit.texts) if unit.kind == "texts" else readers[unit.kind](unit, field, skips)
    for text in docs:
        if text.strip():
            yield text


FORMATS = "UTF-8 text, JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or a datasets.save_to_disk directory"


def _text(unit: Unit, field: str, skips: Skips) -> Iterator[str]:
    for path in unit.paths:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            skips("unreadable", path, f"cannot read ({e.strerror or e})")
            continue
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd")
        if b"\x00" in raw or bad > 0.05 * max(1, len(text)):
            why = "contains NUL bytes" if b"\x00" in raw else f"{bad} of {len(text)} characters are not valid UTF-8"
            skips("not_text", path, f"not a text file ({why}); give {FORMATS}")
            continue
        yield text


def _zstd_lines(path: str) -> Iterator[bytes]:
    """The lines of a .zst file (one frame or several). A stream that ends inside a frame raises
    EOFError, as gzip does: zstandard's own stream reader would end there silently."""
    try:
        import zstandard
    except ImportError:
        raise ConfigError(f"{path}: .zst input needs the zstandard package: pip install zstandard") from None
    dctx, rest, obj, fed = zstandard.ZstdDecompressor(), b"", None, False
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            out = []
            while chunk:
                obj = obj or dctx.decompressobj()
                try:
                    out.append(obj.decompress(chunk))
                except zstandard.ZstdError as e:
                    raise ValueError(f"zstd: {e}") from None
                fed = not obj.eof
                chunk = obj.unused_data if obj.eof else b""
                obj = None if obj.eof else obj
            lines = (rest + b"".join(out)).split(b"\n")
            rest = lines.pop()
            yield from (line + b"\n" for line in lines)
    if fed:
        raise EOFError("the .zst stream ends inside a frame (truncated)")
    if rest:
        yield rest


def _compressed_lines(path: str) -> Iterator[bytes]:
    if path.lower().endswith(".zst"):
        yield from _zstd_lines(path)
        return
    with gzip.open(path, "rb") as f:
        yield from f


def _line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at byte `offset` of an uncompressed file."""
    n = 1
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 24))
            if not chunk:
                break
            n += chunk.count(b"\n")
            offset -= len(chunk)
    return n


def _lines(unit: Unit) -> Iterator[tuple[int, int, bytes]]:
    """(byte offset, 0 for compressed files; 1-based line number within the unit; line) of the
    lines the unit owns."""
    path = unit.paths[0]
    if corpus.compressed(Path(path)):
        yield from ((0, n, line) for n, line in enumerate(_compressed_lines(path), 1))
        return
    with open(path, "rb") as f:
        pos = unit.start
        if pos > 0:  # a line that began before the range belongs to the previous unit
            f.seek(pos - 1)
            if f.read(1) != b"\n":
                pos += len(f.readline())
        n = 0
        while unit.end < 0 or pos < unit.end:
            line = f.readline()
            if not line:
                return
            n += 1
            yield pos, n, line
            pos += len(line)


def _where(path: str, unit: Unit, at: int, n: int, strict: bool) -> str:
    """`path:line`. Inside a byte range that starts past the file's beginning the line number costs a
    scan of everything before it: only a strict failure pays it; a skipped line is named by its
    byte offset (`path@byte N`), so skipping stays linear in the file."""
    if unit.start == 0 or corpus.compressed(Path(path)):
        return f"{path}:{n}"
    return f"{path}:{_line_number(path, at)}" if strict else f"{path}@byte {at}"


def _records(unit: Unit, skips: Skips) -> Iterator[tuple[dict, object, bool]]:
    """(record, where: a callable naming its line, whether the line has a \\u escape: only one can
    make a lone surrogate) of every JSONL line of the unit that is a JSON object."""
    path = unit.paths[0]
    lines = _lines(unit)
    while True:
        try:
            at, n, line = next(lines)
        except StopIteration:
            return
        except (OSError, EOFError, ValueError) as e:  # a corrupt or truncated .gz / .zst stream
            skips("unreadable", path, f"cannot read ({e})")
            return
        if not line.strip():
            continue
        where = lambda at=at, n=n: _where(path, unit, at, n, skips.strict)
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError as e:
            skips("not_json", where, f"not valid JSON ({e.msg})")
            continue
        if not isinstance(record, dict):
            skips("no_field", where, f"not a JSON object ({type(record).__name__}); each line must be one")
            continue
        yield record, where, b"\\u" in line


def _jsonl(unit: Unit, field: str, skips: Skips) -> Iterator[str]:
    for record, where, escaped in _records(unit, skips):
        if field not in record:
            keys = ", ".join(record)
            skips("no_field", where, f"no field {field!r} (has: {keys}); choose it with --field / data.field")
            continue
        text = str(record[field])
        if escaped and _lone_surrogate(text):
            skips("bad_text", where, "the text has a lone UTF-16 surrogate (an escape like \\ud83d alone)")
            continue
        yield text


def structured(unit: Unit, field: str, kind: str, skips: Skips) -> Iterator[tuple[object, object]]:
    """(record, where) of a chat or completion unit (JSONL only): a chat record's `field` as checked
    messages, a completion record's (prompt, completion)."""
    from meshlm.data.chat import ChatError, check_messages

    if unit.kind != "jsonl":
        where = unit.paths[0] if unit.paths else "the given texts"
        raise ConfigError(f"{where}: --format {kind} reads JSONL records (.jsonl, .jsonl.gz, .jsonl.zst)")
    need = (field,) if kind == "chat" else ("prompt", "completion")
    for record, where, escaped in _records(unit, skips):
        missing = [k for k in need if k not in record]
        if missing:
            keys = ", ".join(record)
            skips("no_field", where, f"no field {missing[0]!r} (has: {keys})")
            continue
        try:
            if kind == "chat":
                value = check_messages(record[field])
                texts = [m["content"] for m in value]
            else:
                value = (record["prompt"], record["completion"])
                if not all(isinstance(v, str) for v in value):
                    raise ChatError("prompt and completion must be strings")
                texts = list(value)
        except ChatError as e:
            skips("bad_record", where, str(e))
            continue
        if escaped and any(_lone_surrogate(t) for t in texts):
            skips("bad_text", where, "the text has a lone UTF-16 surrogate (an escape like \\ud83d alone)")
            continue
        yield value, where


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _pyarrow(path: str, module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{path}: Parquet and Arrow inputs need pyarrow: pip install 'meshlm[parquet]'") from None


def _parquet(unit: Unit, field: str, skips: Skips) -> Iterator[str]:
    path = unit.paths[0]
    pq = _pyarrow(path, "pyarrow.parquet")
    try:
        pf = pq.ParquetFile(path)
        groups = range(unit.start, pf.metadata.num_row_groups if unit.end < 0 else unit.end)
        if field not in pf.schema_arrow.names:
            rows = sum(pf.metadata.row_group(i).num_rows for i in groups)
            skips("no_field", path, f"no column {field!r} (has: {', '.join(pf.schema_arrow.names)})", n=rows)
            return
        yield from _values(pf.iter_batches(row_groups=list(groups), columns=[field], batch_size=1024), field)
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        skips("unreadable", path, f"cannot read Parquet ({e})")


def _arrow(unit: Unit, field: str, skips: Skips) -> Iterator[str]:
    path = unit.paths[0]
    pa = _pyarrow(path, "pyarrow")
    try:
        with pa.memory_map(path) as source:
            reader = pa.ipc.open_stream(source)
            if field not in reader.schema.names:
                rows = sum(
                    b.num_rows for i, b in enumerate(reader) if i >= unit.start and (unit.end < 0 or i < unit.end)
                )
                skips("no_field", path, f"no column {field!r} (has: {', '.join(reader.schema.names)})", n=rows)
                return
            batches = (b for i, b in enumerate(reader) if i >= unit.start and (unit.end < 0 or i < unit.end))
            yield from _values(batches, field)
    except ConfigError:
        raise
    except Exception as e:
        skips("unreadable", path, f"cannot read Arrow ({e})")


def _values(batches, field: str) -> Iterator[str]:
    for batch in batches:
        for value in batch.column(field).to_pylist():
            if value is not None:
                yield str(value)


# ----------------------------------------------------------------------------------------- encoding

_TOKENIZERS: dict[str, object] = {}  # this process's loaded tokenizers, by key


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer as its JSON and a key made once, loaded once per process (a real tokenizer's
    JSON is megabytes: hashing or parsing it for every unit would cost more than some units).
    `without_json()` is what a task carries to a process that already loaded it."""

    key: str
    json: str | None = None

    @staticmethod
    def of(tokenizer) -> TokenizerSource:
        from meshlm.data import tokenizer as toks

        return TokenizerSource(toks.fingerprint(tokenizer), tokenizer.to_str())

    def without_json(self) -> TokenizerSource:
        return TokenizerSource(self.key)

    def load(self):
        if self.key not in _TOKENIZERS:
            from tokenizers import Tokenizer

            if self.json is None:
                raise RuntimeError("this process has not loaded the tokenizer (TokenizerSource.load with its JSON)")
            _TOKENIZERS.clear()
            _TOKENIZERS[self.key] = Tokenizer.from_str(self.json)
        return _TOKENIZERS[self.key]


def encode(unit: Unit, tokenizer: TokenizerSource, field: str = "text", strict: bool = True, fmt=None) -> dict:
    """Tokenize one unit: its tokens (each document followed by the end-of-text id) and their
    unigram counts, each document's token count and UTF-8 byte count, and the bad input skipped;
    for chat and completion records (`fmt`: a `chat.Format`) also each token's flags (FLAG_*).
    Runs in any process."""
    from meshlm.data import tokenizer as toks

    tok = tokenizer.load()
    eot = toks.eot_id(tok)
    dtype = np.dtype(np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32)
    skips = Skips(strict)
    if fmt is not None and fmt.packed:
        return _encode_records(unit, tok, eot, dtype, field, fmt, skips)
    pieces: list[np.ndarray] = []  # one array a batch: 2-4 bytes a token held, not a Python int's 30
    doc_tokens: list[int] = []
    doc_bytes: list[int] = []
    batch: list[str] = []

    # encode_batch_fast: the same ids as encode_batch without the character offsets (1.4-1.8x faster here)
    encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def flush():
        flat: list[int] = []
        for e in encode_batch(batch, add_special_tokens=False):
            ids = e.ids
            flat.extend(ids)
            flat.append(eot)
            doc_tokens.append(len(ids) + 1)
        pieces.append(np.asarray(flat, dtype=dtype))
        batch.clear()

    size = 0
    for text in documents(unit, field, skips):
        batch.append(text)
        doc_bytes.append(len(text.encode("utf-8")))
        size += len(text)
        if size >= 1 << 21:
            flush()
            size = 0
    flush()
    tokens = np.concatenate(pieces)
    return {
        "tokens": tokens,
        "counts": np.bincount(tokens, minlength=tok.get_vocab_size()).astype(np.int64),  # summed by the driver
        "doc_tokens": np.asarray(doc_tokens, dtype=np.int64),
        "doc_bytes": np.asarray(doc_bytes, dtype=np.int64),
        "skipped": skips.counts,
        "examples": skips.examples,
    }


FLAG_TRAINED = 1  # the token is a training target (the loss mask of the position before it)
FLAG_START = 2  # a document (conversation) starts at this token


def _encode_records(unit: Unit, tok, eot: int, dtype, field: str, fmt, skips: Skips) -> dict:
    """`encode` for chat / completion records: each record's rendered text, tokenized as one string
    (as `transformers`' apply_chat_template(tokenize=True) does), then the end-of-text id; flags
    mark the trained tokens (never a record's first: nothing precedes it) and each record's start."""
    from meshlm.data.chat import ChatError, Renderer, trained_tokens

    renderer = Renderer.of(fmt)
    texts, spans, eot_trained, doc_bytes = [], [], [], []
    for record, where in structured(unit, field, fmt.kind, skips):
        try:
            text, trained, last = renderer.spans(record)
        except ChatError as e:
            skips("bad_record", where, str(e))
            continue
        texts.append(text)
        spans.append(trained)
        eot_trained.append(last)
        doc_bytes.append(len(text.encode("utf-8")))
    ids: list[int] = []
    flags: list[int] = []
    doc_tokens: list[int] = []
    for i in range(0, len(texts), 256):
        for e, sp, last in zip(
            tok.encode_batch(texts[i : i + 256], add_special_tokens=False),
            spans[i : i + 256],
            eot_trained[i : i + 256],
            strict=True,
        ):
            doc = [FLAG_TRAINED if m else 0 for m in trained_tokens(e.offsets, sp)]
            doc.append(FLAG_TRAINED if last else 0)  # the end-of-text after it
            doc[0] = FLAG_START  # never a target: nothing of its document precedes it
            ids.extend(e.ids)
            ids.append(eot)
            flags.extend(doc)
            doc_tokens.append(len(e.ids) + 1)
    tokens = np.asarray(ids, dtype=dtype)
    return {
        "tokens": tokens,
        "flags": np.asarray(flags, dtype=np.uint8),
        "counts": np.bincount(tokens, minlength=tok.get_vocab_size()).astype(np.int64),
        "doc_tokens": np.asarray(doc_tokens, dtype=np.int64),
        "doc_bytes": np.asarray(doc_bytes, dtype=np.int64),
        "skipped": skips.counts,
        "examples": skips.examples,
    }
