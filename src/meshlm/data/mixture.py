"""Weighted mixtures of corpora (`data.mixture`), with Megatron's blend semantics.

Sample g of a run (g = step * global_batch + row) comes from source d(g) and is that source's
k(g)-th sample. Each source reads its own samples as a lone corpus would (`WindowLoader`, its own
permutation per epoch, seeded by (train.seed, d)), so a small source repeats (epochs) on its own
while a large one has not finished its first pass.

Which source: Megatron's greedy (the blended dataset's `build_blending_indices`). Sample i goes to
the source furthest behind its share, argmax_d w_d max(i, 1) - c_d (c_d: samples it has had so far;
ties go to the first source; so samples 0 and 1 are both weighed at 1). The weights are normalised
and quantised to multiples of 1/PERIOD (largest remainders; every source keeps at least one). With
integer shares W_d the greedy is periodic from sample 1 on: samples 1..PERIOD give exactly W_d to
source d, and so does every later PERIOD. So the schedule is sample 0 and one period, computed once,
and any sample's source, its index in that source and every source's count so far are lookups.
Nothing but the step is needed to resume, at any step, with any number of processes.
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


def schedule(shares: np.ndarray) -> tuple[int, np.ndarray]:
    """(the source of sample 0, the sources of samples 1..PERIOD): Megatron's greedy on integer
    shares, its error PERIOD x (w_d max(i, 1) - c_d) kept in integers."""
    first = int(np.argmax(shares))  # sample 0: every count is 0, the error w_d x 1
    out = np.empty(PERIOD, dtype=np.int32)
    if len(shares) > 16:  # many sources: numpy per sample (argmax: the first of the largest)
        taken = np.zeros(len(shares), dtype=np.int64)
        taken[first] = PERIOD
        for i in range(1, PERIOD + 1):
            out[i - 1] = d = int(np.argmax(shares * i - taken))
            taken[d] += PERIOD
        return first, out
    w = [int(x) for x in shares]
    taken = [0] * len(w)
    taken[first] = PERIOD
    pick = range(len(w))
    for i in range(1, PERIOD + 1):
        d = max(pick, key=lambda d: w[d] * i - taken[d])  # the first of the largest
        taken[d] += PERIOD
        out[i - 1] = d
    return first, out


class Blend:
    """The assignment of samples to sources for given weights."""

    def __init__(self, weights: list[float]):
        self.shares = quantise(weights)
        self.first, self.period = schedule(self.shares)
        self.rank = np.zeros(PERIOD, dtype=np.int64)  # index of period sample r among its source's
        for d in range(len(self.shares)):
            (at,) = np.nonzero(self.period == d)
            self.rank[at] = np.arange(len(at))

    def assign(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of global samples `g`."""
        g = np.asarray(g, dtype=np.int64)
        q, r = np.divmod(np.maximum(g - 1, 0), PERIOD)
        d = np.where(g == 0, self.first, self.period[r])
        index = (d == self.first) + q * self.shares[d] + self.rank[r]
        return d, np.where(g == 0, 0, index)

    def counts(self, n: int) -> np.ndarray:
        """Samples of each source among the first n."""
        out = np.zeros(len(self.shares), dtype=np.int64)
        if n <= 0:
            return out
        q, r = divmod(int(n) - 1, PERIOD)
        out[self.first] += 1
        return out + q * self.shares + np.bincount(self.period[:r], minlength=len(self.shares))


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
