"""Weighted mixtures of corpora (`data.mixture`), with Megatron's blend semantics.

Sample g of a run (g = step * global_batch + row) comes from source d(g) and is that source's
k(g)-th sample. Each source reads its own samples as a lone corpus would (`WindowLoader`, its own
permutation per epoch, seeded by (train.seed, d)), so a small source repeats (epochs) on its own
while a large one has not finished its first pass.

Which source: Megatron's greedy (the blended dataset's `build_blending_indices`). Sample i goes to
the source furthest behind its share, argmax_d w_d max(i, 1) - c_d (c_d: samples it has had so far;
ties go to the first source; so samples 0 and 1 are both weighed at 1). The weights are normalised
and quantised to multiples of 1/PERIOD (largest remainders; every source keeps at least one). With
integer shares W_d every block of PERIOD samples gives source d exactly W_d, and the blocks from
sample PERIOD on repeat (block 0 differs only by weighing sample 0 at 1): two blocks are computed
once, and any sample's source, its index in that source and every source's count so far are
lookups. Nothing but the step is needed to resume, at any step, with any number of processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshlm.config import ConfigError
from meshlm.data.loader import WindowLoader

PERIOD = 1 << 16  # weights are quantised to multiples of 1 / PERIOD


def names(paths: list[str]) -> list[str]:
    """Short, distinct names of the sources (metrics keys): each path's last part."""
    base = [Path(p.rstrip("/")).name or p for p in paths]
    return [b if base.count(b) == 1 else f"{b}#{i}" for i, b in enumerate(base)]


def quantise(weights: list[float]) -> np.ndarray:
    """Integer shares W_d, summing to PERIOD, of the normalised weights (largest remainders, each >= 1)."""
    if len(weights) > PERIOD:
        raise ConfigError(f"data.mixture has {len(weights)} sources; at most {PERIOD}")
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * PERIOD
    shares = np.maximum(1, np.floor(exact)).astype(np.int64)
    rest = PERIOD - int(shares.sum())
    if rest >= 0:
        shares[np.argsort(-(exact - shares), kind="stable")[:rest]] += 1
    for _ in range(-rest):  # tiny weights raised to 1 took more than there was: take from the largest
        shares[int(np.argmax(shares))] -= 1
    return shares


def schedule(shares: np.ndarray) -> np.ndarray:
    """The sources of samples 0 .. 2 PERIOD - 1: Megatron's greedy on integer shares, its error
    PERIOD x (w_d max(i, 1) - c_d) kept in integers. Each block of PERIOD samples gives source d
    exactly its share W_d (at sample PERIOD every error is a multiple of PERIOD, above -PERIOD, and
    they sum to 0: all are 0), so from sample PERIOD on the blocks repeat; block 0 differs from them
    only in weighing sample 0 at max(0, 1) = 1."""
    out = np.empty(2 * PERIOD, dtype=np.int32)
    if len(shares) > 16:  # many sources: numpy per sample (argmax: the first of the largest)
        taken = np.zeros(len(shares), dtype=np.int64)
        for i in range(2 * PERIOD):
            out[i] = d = int(np.argmax(shares * max(i, 1) - taken))
            taken[d] += PERIOD
        return out
    w = [int(x) for x in shares]
    taken = [0] * len(w)
    pick = range(len(w))
    for i in range(2 * PERIOD):
        t = max(i, 1)
        d = max(pick, key=lambda d: w[d] * t - taken[d])  # the first of the largest
        taken[d] += PERIOD
        out[i] = d
    return out


class Blend:
    """The assignment of samples to sources for given weights: block 0 (samples 0 .. PERIOD - 1),
    then the steady block (PERIOD .. 2 PERIOD - 1) repeated."""

    def __init__(self, weights: list[float]):
        self.shares = quantise(weights)
        both = schedule(self.shares)
        self.blocks = (both[:PERIOD], both[PERIOD:])
        for block in self.blocks:
            assert (np.bincount(block, minlength=len(self.shares)) == self.shares).all()
        self.ranks = []  # index of each block sample among its source's samples of the block
        for block in self.blocks:
            rank = np.zeros(PERIOD, dtype=np.int64)
            for d in range(len(self.shares)):
                (at,) = np.nonzero(block == d)
                rank[at] = np.arange(len(at))
            self.ranks.append(rank)

    def assign(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of global samples `g`."""
        g = np.asarray(g, dtype=np.int64)
        q, r = np.divmod(g, PERIOD)  # block q (0: the first), position r
        steady = q > 0
        d = np.where(steady, self.blocks[1][r], self.blocks[0][r])
        rank = np.where(steady, self.ranks[1][r], self.ranks[0][r])
        return d, q * self.shares[d] + rank

    def counts(self, n: int) -> np.ndarray:
        """Samples of each source among the first n."""
        q, r = divmod(max(int(n), 0), PERIOD)
        block = self.blocks[1] if q > 0 else self.blocks[0]
        return q * self.shares + np.bincount(block[:r], minlength=len(self.shares))


class MixtureLoader:
    """A `WindowLoader` over several sources (`sources`: one loader each, same seq_len, end-of-text
    id and sequence order), batch n a pure function of (seed, n) as for one corpus."""

    def __init__(self, sources: list[WindowLoader], weights: list[float], names: list[str], global_batch: int):
        self.sources, self.names, self.blend = sources, names, Blend(weights)
        self.global_batch, self.seq_len = global_batch, sources[0].seq_len
        self.n_windows = sum(s.n_windows for s in sources)

    @property
    def weights(self) -> list[float]:
        """The weights used: the quantised shares as fractions."""
        return [float(s) / PERIOD for s in self.blend.shares]

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        g = step * self.global_batch + np.arange(self.global_batch)[rows]
        source, index = self.blend.assign(g)
        windows: list = [None] * len(g)
        for d in np.unique(source):
            (at,) = np.nonzero(source == d)
            loader = self.sources[int(d)]
            for j, wid in zip(at, loader.sample_windows(index[at]), strict=True):
                windows[j] = loader._window(int(wid))
        return self.sources[0].rows(windows)

    def source_tokens(self, steps: int) -> dict[str, int]:
        """Tokens trained on per source after `steps` steps (metrics `tokens/<source>`)."""
        counts = self.blend.counts(steps * self.global_batch) * self.seq_len
        return {f"tokens/{name}": int(c) for name, c in zip(self.names, counts, strict=True)}


def loaders(cfg, sources: list, eot: int | None, order) -> tuple[MixtureLoader, MixtureLoader]:
    """The train and validation loaders of `cfg.data.mixture` over its prepared `sources` (validation:
    the same weights, seed train.seed + 1). Source d's loaders are seeded (seed, d)."""
    tc = cfg.train
    entries = cfg.data.mixture_sources()
    weights, labels = [w for w, _ in entries], names([p for _, p in entries])

    def split(name: str, what: str, seed: int) -> MixtureLoader:
        per_source = [
            WindowLoader(
                data.shards(name),
                tc.seq_len,
                tc.global_batch,
                (seed, d),
                f"{what} split of {data.root}",
                eot,
                order,
                data.flags(name) if data.packed else None,
            )
            for d, data in enumerate(sources)
        ]
        return MixtureLoader(per_source, weights, labels, tc.global_batch)

    return split("train", "train", tc.seed), split("val", "validation", tc.seed + 1)


def describe(loader: MixtureLoader, sources: list) -> str:
    parts = (
        f"{n} {w:.4f} ({d.meta['train_tokens']:,} tokens)"
        for n, w, d in zip(loader.names, loader.weights, sources, strict=True)
    )
    return "data.mixture (Megatron's blend; each source epochs on its own): " + ", ".join(parts)
