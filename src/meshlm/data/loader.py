"""Deterministic batches: batch n of a run is a pure function of (seed, n).

The token stream is cut into non-overlapping windows of seq_len + 1 tokens. Each epoch visits the
windows in a fresh permutation drawn from (seed, epoch). Global sample g = n * B + j of step n is
window perm_{g // N}[g % N]. Nothing but the step is needed to resume, and the global batch does not
depend on how many processes or devices read it: each reader takes the rows it holds.
"""

from __future__ import annotations

import numpy as np

from meshlm.config import ConfigError


class WindowLoader:
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, name: str = "train"):
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(
                f"{name} split has {len(tokens)} tokens, fewer than one window of seq_len+1={seq_len + 1}; "
                "use more data or a shorter train.seq_len"
            )
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n_windows), epoch
        return self._perm

    def window_ids(self, step: int, rows: slice = slice(None)) -> np.ndarray:
        g = step * self.global_batch + np.arange(self.global_batch)[rows]
        out = np.empty(len(g), dtype=np.int64)
        for epoch in np.unique(g // self.n_windows):
            sel = g // self.n_windows == epoch
            out[sel] = self._permutation(int(epoch))[g[sel] % self.n_windows]
        return out

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Rows `rows` of global batch `step`: inputs and next-token targets, int32 [rows, seq_len]."""
        starts = self.window_ids(step, rows) * self.seq_len
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        w = np.asarray(self.tokens[idx], dtype=np.int32)
        return {"inputs": w[:, :-1], "targets": w[:, 1:]}


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token unigram distribution: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
