"""Interleaved train-step timing shared by the benchmarks: compile every variant first, then time
one step of each per round, so a noisy moment on this shared machine hits all variants alike."""

from __future__ import annotations

import contextlib
import resource
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


def timed_steps(cfg: RunConfig, steps: int, warm: int = 1) -> tuple:
    """One variant alone (an accelerator's own figures, not interleaved): `cfg`'s train step compiled
    on its own mesh, `warm` untimed steps, then `steps` timed: (the compiled step, the last step's
    metrics, the median step seconds, compile seconds). The state is freed on return."""
    from meshlm.parallel.mesh import make_layout

    fn, state, batch = prepared_step(cfg, make_layout(cfg.parallel))
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(warm):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return compiled, metrics, statistics.median(times), compile_s


SETTLED_FAULTS = 2000  # minor page faults per step (8 MiB) below which the host heap counts as settled


def median_step_seconds(
    variants: dict[Hashable, tuple], rounds: int, settle: int = 0, growth: dict | None = None
) -> dict[Hashable, float]:
    """{key: median seconds of one train step} for each (config, layout), on random tokens; a third
    element, a context manager, is entered while that variant is traced and compiled.

    `settle` > 0: before timing, up to that many untimed rounds until a round in which no step
    faults in more than `SETTLED_FAULTS` fresh pages. Under `host_memory`'s allocator settings the
    heap keeps what it frees, but it fragments and grows over a program's first steps (several, for
    a pipeline's large temporary buffers); a step that grows it pays for the kernel zeroing fresh
    pages, which is not the program's own cost. Prints how many rounds it took. `growth`, a dict, is
    filled with {key: (timed steps that faulted in `SETTLED_FAULTS` pages or more, the median of
    the others or None)}: a program whose heap keeps growing (zb1's, BENCHMARKS.md) never settles."""
    steps = {}
    for key, (cfg, layout, *traced_in) in variants.items():
        with traced_in[0] if traced_in else contextlib.nullcontext():  # a variant's own trace-time setting
            fn, state, batch = prepared_step(cfg, layout)
            state, m = fn(state, batch)  # compile
            jax.block_until_ready(m)
        steps[key] = [fn, state, batch, []]
    for n in range(1, settle + 1):
        faults = max(_step(entry)[1] for entry in steps.values())
        if faults < SETTLED_FAULTS or n == settle:
            print(f"heap: {n} untimed rounds, the last one's most faulting step faulted {faults} pages")
            break
    for _ in range(rounds):
        for entry in steps.values():
            entry[3].append(_step(entry))
    if growth is not None:
        for key, entry in steps.items():
            calm = [s for s, faults in entry[3] if faults < SETTLED_FAULTS]
            growth[key] = (len(entry[3]) - len(calm), statistics.median(calm) if calm else None)
    return {key: statistics.median(s for s, _ in entry[3]) for key, entry in steps.items()}


def _step(entry: list) -> tuple[float, int]:
    """One step of a prepared variant (its state advanced in place): (seconds, minor page faults)."""
    fn, state, batch, _ = entry
    faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    entry[1], m = fn(state, batch)
    jax.block_until_ready(m)
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
