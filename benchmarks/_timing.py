"""Interleaved train-step timing shared by the benchmarks: compile every variant first, then time
one step of each per round, so a noisy moment on this shared machine hits all variants alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable

import jax
import numpy as np

from meshlm.config import RunConfig
from meshlm.parallel.rules import Layout
from meshlm.step import make_train_step
from meshlm.train_state import init_state, placement, setup


def prepared_step(cfg: RunConfig, layout: Layout) -> tuple:
    """(jitted train step, initial state, a batch of random tokens) for one config and layout."""
    specs, tx, shardings = setup(cfg, layout)
    state = init_state(specs, layout, tx, 0, **placement(cfg))
    rng = np.random.default_rng(0)
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    batch = {k: rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32) for k in ("inputs", "targets")}
    return make_train_step(cfg, layout, tx, shardings), state, batch


def median_step_seconds(variants: dict[Hashable, tuple[RunConfig, Layout]], rounds: int) -> dict[Hashable, float]:
    """{key: median seconds of one train step} for each (config, layout), on random tokens."""
    steps = {}
    for key, (cfg, layout) in variants.items():
        fn, state, batch = prepared_step(cfg, layout)
        state, m = fn(state, batch)  # compile
        jax.block_until_ready(m)
        steps[key] = [fn, state, batch, []]
    for _ in range(rounds):
        for entry in steps.values():
            fn, state, batch, times = entry
            t0 = time.perf_counter()
            entry[1], m = fn(state, batch)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
    return {key: statistics.median(entry[3]) for key, entry in steps.items()}
