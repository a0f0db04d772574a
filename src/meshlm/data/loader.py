"""Deterministic batches: batch n of a run is a pure function of (seed, n).

Each shard's tokens are cut into non-overlapping windows of seq_len + 1 tokens; the windows of all
shards are numbered globally. Each epoch visits them in a fresh permutation drawn from
(seed, epoch). Global sample g = n * B + j of step n is window perm_{g // N}[g % N]. Nothing but the
step is needed to resume, and the global batch does not depend on how many processes or devices
read it: each process reads only the rows its devices hold (`process_batch`).

With `eot_id` set (document masking), a batch also carries `segment_ids` (which document of the
row each position belongs to) and `positions` (the position within that document).

Packed chat / completion datasets (`flags`: one byte a token, `units.FLAG_*`) are read as rows of
seq_len + 1 tokens one after another (no overlap: a row is whole records); a batch then also
carries `mask` (1 where the target is a trained token), and its segments come from the records'
starts, not from end-of-text tokens (a chat template may use those inside a conversation).

With context parallelism (`order`: the layout's `context_order`) every array's sequence axis is put
into storage order here, once: with load balancing, context rank i then holds chunks i and 2c-1-i
of the original sequence. The loss is a sum over tokens, so nothing downstream undoes it.
"""

from __future__ import annotations

import jax
import numpy as np

from meshlm.config import ConfigError
from meshlm.data.units import FLAG_START, FLAG_TRAINED
from meshlm.parallel.rules import reorder_sequence


class WindowLoader:
    def __init__(
        self,
        shards: np.ndarray | list[np.ndarray],
        seq_len: int,
        global_batch: int,
        seed: int | tuple[int, ...],
        name: str = "train",
        eot_id: int | None = None,
        order: tuple[int, ...] | None = None,
        flags: list[np.ndarray] | None = None,
    ):
        self.shards = [shards] if isinstance(shards, np.ndarray) else list(shards)
        self.seq_len, self.global_batch, self.seed, self.eot_id = seq_len, global_batch, seed, eot_id
        self.order, self.flags = order, flags
        # packed rows (flags): windows are the rows, seq_len + 1 tokens each, one after another
        self.stride = seq_len + 1 if flags is not None else seq_len
        extra = 0 if flags is not None else 1
        per_shard = np.array([max(0, (len(s) - extra) // self.stride) for s in self.shards], dtype=np.int64)
        self.first_window = np.concatenate([[0], np.cumsum(per_shard)])  # window id where each shard starts
        self.n_windows = int(self.first_window[-1])
        if self.n_windows < 1:
            raise ConfigError(
                f"{name} split has {sum(len(s) for s in self.shards)} tokens, fewer than one window of "
                f"seq_len+1={seq_len + 1}; use more data or a shorter train.seq_len"
            )
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([*np.atleast_1d(self.seed).tolist(), epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n_windows), epoch
        return self._perm

    def window_ids(self, step: int, rows: slice = slice(None)) -> np.ndarray:
        return self.sample_windows(step * self.global_batch + np.arange(self.global_batch)[rows])

    def sample_windows(self, g: np.ndarray) -> np.ndarray:
        """Window ids of samples `g` (sample g of epoch g // n_windows: that epoch's permutation)."""
        out = np.empty(len(g), dtype=np.int64)
        for epoch in np.unique(g // self.n_windows):
            sel = g // self.n_windows == epoch
            out[sel] = self._permutation(int(epoch))[g[sel] % self.n_windows]
        return out

    def _window(self, wid: int) -> np.ndarray:
        shard = int(np.searchsorted(self.first_window, wid, side="right")) - 1
        start = (wid - int(self.first_window[shard])) * self.stride
        tokens = self.shards[shard][start : start + self.seq_len + 1]
        if self.flags is None:
            return tokens
        return np.stack(
            [np.asarray(tokens, np.int32), np.asarray(self.flags[shard][start : start + self.seq_len + 1], np.int32)]
        )

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Rows `rows` of global batch `step`: inputs and next-token targets, int32 [rows, seq_len]
        (plus segment_ids and positions with document masking), in context storage order."""
        return self.rows([self._window(int(i)) for i in self.window_ids(step, rows)])

    def rows(self, windows: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Windows of seq_len + 1 tokens as a batch (inputs, targets, segments), in storage order;
        packed rows ([tokens, flags] each) also give the loss mask, and their documents' segments."""
        w = np.stack([np.asarray(x, dtype=np.int32) for x in windows])
        if w.ndim == 3:
            tokens, flags = w[:, 0], w[:, 1]
            out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
            out["mask"] = (flags[:, 1:] & FLAG_TRAINED).astype(np.int32)
            out |= packed_segments(flags[:, :-1])
            return {k: reorder_sequence(v, self.order) for k, v in out.items()}
        out = {"inputs": w[:, :-1], "targets": w[:, 1:]}
        if self.eot_id is not None:
            out |= document_segments(out["inputs"], self.eot_id)
        return {k: reorder_sequence(v, self.order) for k, v in out.items()}

    def source_tokens(self, steps: int) -> dict[str, int]:
        """Tokens trained on per source after `steps` steps ({}: one source; see `data.mixture`)."""
        return {}


def document_segments(inputs: np.ndarray, eot_id: int) -> dict[str, np.ndarray]:
    """segment_ids [b, t]: the number of end-of-text tokens before t in the row (an end-of-text
    token belongs to the document it ends; non-decreasing along the row, which the Pallas GPU kernel
    under all_gather relies on: `kernels.pallas_gpu_attention_at`); positions [b, t]: t minus its
    document's start."""
    is_eot = (inputs == eot_id).astype(np.int32)
    segment_ids = np.cumsum(is_eot, axis=1) - is_eot
    t = np.arange(inputs.shape[1], dtype=np.int32)[None, :]
    starts = np.zeros_like(inputs, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = is_eot[:, :-1] == 1
    positions = t - np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    return {"segment_ids": segment_ids.astype(np.int32), "positions": positions.astype(np.int32)}


def packed_segments(flags: np.ndarray) -> dict[str, np.ndarray]:
    """segment_ids and positions of packed rows from their flags: a document starts where
    FLAG_START is set (every row starts one); non-decreasing, as `document_segments`'."""
    starts = (flags & FLAG_START) > 0
    t = np.arange(flags.shape[1], dtype=np.int32)[None, :]
    positions = t - np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    return {"segment_ids": np.cumsum(starts, axis=1).astype(np.int32), "positions": positions.astype(np.int32)}


def local_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...], devices=None) -> slice:
    """The smallest row range of a global [B, ...] batch that `devices` (default: this process's
    devices) hold under `sharding`."""
    index_map = sharding.devices_indices_map(shape)
    devices = sharding.addressable_devices if devices is None else set(devices)
    starts, stops = [], []
    for d in devices:
        rows = index_map[d][0]
        starts.append(rows.start or 0)
        stops.append(shape[0] if rows.stop is None else rows.stop)
    return slice(min(starts), max(stops))


def process_batch(loader: WindowLoader, step: int, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Global batch `step` as global arrays, this process reading only the rows its devices hold."""
    shape = (loader.global_batch, loader.seq_len)
    rows = local_rows(sharding, shape)
    local = loader.batch(step, rows)

    def piece(v, idx):
        r = idx[0]
        lo = (r.start or 0) - rows.start
        hi = (shape[0] if r.stop is None else r.stop) - rows.start
        return v[lo:hi][:, idx[1]]

    return {k: jax.make_array_from_callback(shape, sharding, lambda idx, v=v: piece(v, idx)) for k, v in local.items()}
