"""Documents, in order, into `<split>-NNNNN.bin` token shards: the every-k-th-document split with
global document numbers (`Merge`), written by shard writers that hash as they go (`ShardWriter`);
chat and completion records packed into rows with their flags (`PackedMerge`)."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np

from meshlm.config import ConfigError
from meshlm.data import corpus
from meshlm.data import tokenizer as toks
from meshlm.data import units as U

SPLITS = ("train", "val")


class ShardWriter:
    """Appends token arrays to `<split>-NNNNN.bin` files of at most `shard_tokens` tokens each."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int, suffix: str = ".bin"):
        self.root, self.split, self.dtype, self.limit, self.suffix = root, split, dtype, shard_tokens, suffix
        self.shards: list[dict] = []
        self.file = None
        self.documents = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}{self.suffix}"
        self.file = open(self.root / name, "wb")  # noqa: SIM115 (closed in _close / close)
        self.shards.append({"file": name, "tokens": 0})
        self.hash = hashlib.blake2b(digest_size=16)

    def _close(self) -> None:
        self.file.close()
        self.shards[-1]["blake2b"] = self.hash.hexdigest()
        self.file = None

    def write(self, ids: np.ndarray, documents: int = 1) -> None:
        self.documents += documents
        while len(ids):
            if self.file is None:
                self._open()
            room = self.limit - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self.file.write(part)  # the array's own buffer: no copy for the file or the hash
            self.hash.update(part)
            self.shards[-1]["tokens"] += len(part)
            if self.shards[-1]["tokens"] == self.limit:
                self._close()

    def close(self) -> list[dict]:
        if self.file is None and not self.shards:
            self._open()  # an empty split still gets one (empty) shard
        if self.file is not None:
            self._close()
        return self.shards


def held_out_tail(text: str, period: int) -> list[tuple[str, str]]:
    """A corpus of fewer than `period` documents: its last one split by characters, the head
    trained on and the tail held out, so both splits exist."""
    cut = int(len(text) * (1 - 1 / period))
    return [("train", text[:cut]), ("val", text[cut:])]


class Merge:
    """Documents of the units, in order, into the train / val shard writers: document number g
    (from 1) goes to validation when g % period == 0. The first period - 1 documents are held back
    until document `period` arrives, since a corpus of fewer documents holds out the tail of its
    last one instead (`prepare._split`). With a cap (`max_bytes`), the document that crosses it is
    read again, cut (`corpus.capped`) and encoded here."""

    def __init__(self, units, writers, tok, period, field, strict, max_bytes):
        self.units, self.writers, self.tok, self.period = units, writers, tok, period
        self.field, self.strict, self.max_bytes = field, strict, max_bytes
        self.eot, self.dtype = toks.eot_id(tok), writers["train"].dtype
        self.counts = np.zeros(tok.get_vocab_size(), dtype=np.int64)
        self.skips = U.Skips(strict=False)
        self.n = 0  # documents taken
        self.text_bytes = 0  # their UTF-8 bytes (the cap)
        self.bytes = 0  # input bytes of the units merged (throughput)
        self.held: list[np.ndarray] = []
        self.last: tuple[int, int] | str | None = None  # the last held document: (unit, index) or its text

    def add(self, i: int, result: dict) -> bool:
        """Take unit i's documents; False once the cap is reached (no more units needed)."""
        self.skips.add(result["skipped"], list(result["examples"]))
        self.bytes += self.units[i].nbytes
        tokens, doc_tokens, doc_bytes = result["tokens"], result["doc_tokens"], result["doc_bytes"]
        take = len(doc_tokens)
        if self.max_bytes:
            cum = self.text_bytes + np.cumsum(doc_bytes)
            take = int(np.searchsorted(cum, self.max_bytes, side="right"))  # documents within the cap
        offsets = np.concatenate([[0], np.cumsum(doc_tokens[:take])])
        where = [(i, j) for j in range(take)] if self.n < self.period else None
        self._take(tokens[: offsets[-1]], offsets, where, result["counts"] if take == len(doc_tokens) else None)
        self.text_bytes += int(doc_bytes[:take].sum())
        if take == len(doc_tokens):
            return not (self.max_bytes and self.text_bytes >= self.max_bytes)
        if self.text_bytes < self.max_bytes:  # the cap falls inside document `take`: cut it
            self._cut_tail(i, take)
        return False

    def _cut_tail(self, i: int, j: int) -> None:
        docs = (t for u in self.units[i:] for t in U.documents(u, self.field, U.Skips(self.strict)))
        docs = itertools.islice(docs, j, None)
        for text in corpus.capped(docs, self.max_bytes, self.text_bytes):
            ids = self.tok.encode(text, add_special_tokens=False).ids
            self._take(np.asarray([*ids, self.eot], self.dtype), np.array([0, len(ids) + 1]), [text])

    def _take(self, tokens: np.ndarray, offsets: np.ndarray, where: list | None, counts=None) -> None:
        """Documents tokens[offsets[d]:offsets[d + 1]], numbered from self.n + 1 (`counts`: the
        unigram counts of all of `tokens`, made by the worker)."""
        k = len(offsets) - 1
        d = 0
        while d < k and self.n + 1 < self.period:  # held back: fewer than `period` documents so far
            self.held.append(np.array(tokens[offsets[d] : offsets[d + 1]]))
            self.last = where[d]
            self.n, d = self.n + 1, d + 1
        if d == k:
            return
        if self.held:  # document number `period` is here: the held ones are training documents
            self._train(np.concatenate(self.held), len(self.held))
            self.held, self.last = [], None
        val_tokens = []
        first = d + (-(self.n + 1)) % self.period  # the first d' >= d with (n + 1 + d' - d) % period == 0
        start = d
        for v in range(first, k, self.period):
            if v > start:
                self._write("train", tokens[offsets[start] : offsets[v]], v - start)
            doc = tokens[offsets[v] : offsets[v + 1]]
            self._write("val", doc, 1)
            val_tokens.append(doc)
            start = v + 1
        if start < k:
            self._write("train", tokens[offsets[start] : offsets[k]], k - start)
        if counts is None or d > 0:
            counts = np.bincount(tokens[offsets[d] :], minlength=len(self.counts))
        self.counts += counts
        if val_tokens:
            self.counts -= np.bincount(np.concatenate(val_tokens), minlength=len(self.counts))
        self.n += k - d

    def _write(self, split: str, tokens: np.ndarray, docs: int) -> None:
        self.writers[split].write(tokens, docs)

    def _train(self, tokens: np.ndarray, docs: int) -> None:
        self._write("train", tokens, docs)
        self.counts += np.bincount(tokens, minlength=len(self.counts))

    def finish(self) -> None:
        """With fewer than `period` documents: all but the last train, the last one's tail held out."""
        if not self.held:
            return
        if len(self.held) > 1:
            self._train(np.concatenate(self.held[:-1]), len(self.held) - 1)
        if isinstance(self.last, str):
            text = self.last
        else:
            i, j = self.last
            text = next(itertools.islice(U.documents(self.units[i], self.field, U.Skips(self.strict)), j, None))
        for split, part in held_out_tail(text, self.period):
            ids = np.asarray([*self.tok.encode(part, add_special_tokens=False).ids, self.eot], self.dtype)
            if split == "train":
                self._train(ids, 1)
            else:
                self._write("val", ids, 1)


class PackedMerge:
    """Records (conversations, prompt-completion pairs) of the units, in order, packed into rows of
    `row` tokens with their flags (units.FLAG_*). Record number g (from 1) goes to validation when
    g % period == 0, as documents do (`Merge`); with fewer than `period` records, the last one does.
    Each split packs next-fit, in order: a record that does not fit in the room left in the row
    starts the next row, the room padded with end-of-text tokens (one padding document, never
    trained); a record longer than a row is cut to one (counted in `truncated`)."""

    def __init__(self, units, writers, flag_writers, n_vocab: int, eot: int, period: int, row: int):
        self.units, self.writers, self.flag_writers = units, writers, flag_writers
        self.eot, self.period, self.row, self.dtype = eot, period, row, writers["train"].dtype
        self.counts = np.zeros(n_vocab, dtype=np.int64)
        self.skips = U.Skips(strict=False)
        self.n = 0
        self.bytes = 0
        self.text_bytes = 0
        self.held: list[tuple[np.ndarray, np.ndarray]] = []
        self.open = {s: ([], [], 0, 0) for s in SPLITS}  # tokens, flags, filled, records of the row being packed
        self.stats = {
            s: dict.fromkeys(("records", "truncated", "truncated_tokens", "trained", "padding"), 0) for s in SPLITS
        }

    def add(self, i: int, result: dict) -> bool:
        self.skips.add(result["skipped"], list(result["examples"]))
        self.bytes += self.units[i].nbytes
        self.text_bytes += int(result["doc_bytes"].sum())
        tokens, flags = result["tokens"], result["flags"]
        ends = np.cumsum(result["doc_tokens"])
        train = []
        for start, end in zip(np.concatenate([[0], ends[:-1]]), ends, strict=True):
            doc = (tokens[start:end], flags[start:end])
            self.n += 1
            if self.n < self.period:  # held back: the last of fewer than `period` records is validation's
                self.held.append(doc)
                continue
            for held in self.held:
                self._put("train", *held)
                train.append(held[0])
            self.held = []
            split = "val" if self.n % self.period == 0 else "train"
            self._put(split, *doc)
            if split == "train":
                train.append(doc[0])
        if train:
            self.counts += np.bincount(np.concatenate(train), minlength=len(self.counts))
        return True

    def _put(self, split: str, tokens: np.ndarray, flags: np.ndarray) -> None:
        st = self.stats[split]
        st["records"] += 1
        if len(tokens) > self.row:
            st["truncated"] += 1
            st["truncated_tokens"] += len(tokens) - self.row
            tokens, flags = tokens[: self.row], flags[: self.row]
        if len(tokens) > self.row - self.open[split][2]:
            self._flush(split)
        toks, flgs, filled, records = self.open[split]
        toks.append(tokens)
        flgs.append(flags)
        self.open[split] = (toks, flgs, filled + len(tokens), records + 1)

    def _flush(self, split: str) -> None:
        toks, flgs, filled, records = self.open[split]
        if not records:
            return
        pad = self.row - filled
        if pad:
            toks.append(np.full(pad, self.eot, dtype=self.dtype))
            padding = np.zeros(pad, dtype=np.uint8)
            padding[0] = U.FLAG_START
            flgs.append(padding)
        flags = np.concatenate(flgs)
        self.stats[split]["trained"] += int(np.count_nonzero(flags & U.FLAG_TRAINED))
        self.stats[split]["padding"] += pad
        self.writers[split].write(np.concatenate(toks), records)
        self.flag_writers[split].write(flags, 0)
        self.open[split] = ([], [], 0, 0)

    def finish(self) -> None:
        if self.held:
            if len(self.held) < 2 and not self.stats["val"]["records"]:
                raise ConfigError("chat / completion data needs at least 2 records (one is held out for validation)")
            for tokens, flags in self.held[:-1]:
                self._put("train", tokens, flags)
                self.counts += np.bincount(tokens, minlength=len(self.counts))
            self._put("val", *self.held[-1])
            self.held = []
        for split in SPLITS:
            self._flush(split)
