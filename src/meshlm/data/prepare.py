"""Text -> tokenizer -> token arrays on disk, cached.

A prepared dataset is a directory:
    tokenizer.json   the tokenizer used
    train.bin        tokens of the training documents, each followed by <|endoftext|>
    val.bin          the same for the held-out documents (every k-th document, k = 1/val_fraction)
    meta.json        dtype, token counts, vocab size, tokenizer fingerprint, source fingerprint

The directory name is a hash of everything that determines its bytes (file contents, vocabulary
size, tokenizer, split), so a second run with the same inputs starts immediately, and a change of
input can never silently reuse stale tokens. It is written to a temporary directory and renamed
into place, so a killed preparation never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.config import ConfigError, DataConfig
from meshlm.data import corpus
from meshlm.data import tokenizer as toks

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PreparedData:
    root: Path
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.ndarray:
        path = self.root / f"{split}.bin"
        expected = self.meta[f"{split}_tokens"]
        size = path.stat().st_size if path.exists() else -1
        if size != expected * self.dtype.itemsize:
            raise ConfigError(
                f"data shard {path} is corrupt or truncated: {size} bytes, expected "
                f"{expected * self.dtype.itemsize}; delete {self.root} to rebuild it"
            )
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(expected,))

    @property
    def tokenizer_path(self) -> Path:
        return self.root / "tokenizer.json"


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm")) / "data"


def _fingerprint(docs: list[str], cfg: DataConfig, vocab_size: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT_VERSION, vocab_size, cfg.val_fraction]).encode())
    if cfg.tokenizer:
        h.update(Path(cfg.tokenizer).expanduser().read_bytes())
    for d in docs:
        h.update(hashlib.sha256(d.encode()).digest())
    return h.hexdigest()[:20]


def _encode(tok, docs: list[str], eot: int, dtype: np.dtype) -> np.ndarray:
    ids = tok.encode_batch(docs, add_special_tokens=False)
    parts = [np.asarray([*e.ids, eot], dtype=dtype) for e in ids]
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def prepare(cfg: DataConfig, vocab_size: int, log=print) -> PreparedData:
    """Return the prepared dataset for `cfg`, building and caching it if needed."""
    files = corpus.resolve_files(cfg.paths)
    docs = corpus.read_documents(files, int(cfg.max_corpus_mb * 1e6))
    key = _fingerprint(docs, cfg, vocab_size)
    root = cache_root(cfg) / key
    if (root / "meta.json").exists():
        return PreparedData(root, json.loads((root / "meta.json").read_text()))

    period = max(2, round(1 / cfg.val_fraction))
    val_docs = docs[period - 1 :: period]
    train_docs = [d for i, d in enumerate(docs) if i % period != period - 1]
    if not val_docs:  # a single document: hold out its tail
        cut = int(len(docs[0]) * (1 - cfg.val_fraction))
        train_docs, val_docs = [docs[0][:cut]], [docs[0][cut:]]
    log(f"preparing data: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} M chars -> {root}")
    if cfg.tokenizer:
        tok = toks.load(cfg.tokenizer)
    else:
        tok = toks.train_bpe(train_docs, vocab_size)
    if tok.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"tokenizer has {tok.get_vocab_size()} tokens but model.vocab_size={vocab_size}; "
            "raise model.vocab_size or use a smaller tokenizer"
        )
    eot = toks.eot_id(tok)
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    train, val = _encode(tok, train_docs, eot, dtype), _encode(tok, val_docs, eot, dtype)

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root.parent))
    try:
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        tok.save(str(tmp / "tokenizer.json"))
        meta = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "train_tokens": int(train.size),
            "val_tokens": int(val.size),
            "documents": len(docs),
            "vocab_size": vocab_size,
            "tokenizer_vocab_size": tok.get_vocab_size(),
            "tokenizer_fingerprint": toks.fingerprint(tok),
            "eot_id": eot,
            "source_fingerprint": key,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            tmp.rename(root)
        except OSError:  # another process prepared the same data first; use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PreparedData(root, json.loads((root / "meta.json").read_text()))
