"""Byte-level BPE tokenizers (Hugging Face `tokenizers`): train one on a corpus, or load a
`tokenizer.json`. Every tokenizer meshlm makes has the end-of-text token `<|endoftext|>`."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshlm.config import ConfigError

EOT = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE of at most `vocab_size` tokens (special token included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tokenizer file not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ConfigError(f"cannot read tokenizer {path}: {e}") from None


# End-of-text tokens of tokenizers meshlm may be given (GPT-2's and meshlm's own first, then Llama 3's,
# SentencePiece-style ones): the first one a tokenizer has separates documents.
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")


def eot_token(tok: Tokenizer) -> str:
    for name in EOT_NAMES:
        if tok.token_to_id(name) is not None:
            return name
    raise ConfigError(
        f"tokenizer has no end-of-text token (one of {', '.join(EOT_NAMES)}); add {EOT!r} as a special token"
    )


def eot_id(tok: Tokenizer) -> int:
    return tok.token_to_id(eot_token(tok))


def fingerprint(tok: Tokenizer) -> str:
    """Identity of a tokenizer (hash of its serialised form): recorded with data and checkpoints."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
