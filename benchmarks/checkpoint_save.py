"""What a checkpoint costs the step loop: asynchronous vs synchronous Orbax saves, side by side.

One process, a gpt model of --d-model x --layers (fp32 masters + AdamW: 12 bytes per parameter in
the state) on a data=2 mesh of simulated CPU devices. Measured in one run:
  - the median step time with no save in flight;
  - async: how long `save()` blocks the loop (device -> host copy + metadata), how long until the
    step is committed in the background, and the median time of the steps that ran meanwhile;
  - sync: how long a blocking save stops the loop.
The first save of a process (checksum compile, Orbax start-up) is reported separately.

    python benchmarks/checkpoint_save.py [--d-model 512 --layers 8] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _markdown import write_section

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from meshlm.checkpoint import Checkpointer, describe
from meshlm.config import CheckpointConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.parallel.mesh import make_layout
from meshlm.step import make_train_step
from meshlm.train_state import init_state, setup
from meshlm.validation import validate


def timed_step(step_fn, state, batch):
    t = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    return state, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--baseline-steps", type=int, default=6)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    model = ModelConfig(
        vocab_size=8192, d_model=args.d_model, n_layers=args.layers, n_heads=8, max_seq_len=128, dtype="float32"
    )
    cfg = validate(
        RunConfig(model=model, parallel=ParallelConfig(data=2), train=TrainConfig(steps=100, global_batch=4))
    )
    layout = make_layout(cfg.parallel)
    specs, tx, shardings = setup(cfg, layout)
    state = init_state(specs, layout, tx, 0)
    step_fn = make_train_step(cfg, layout, tx, shardings)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, model.vocab_size, (4, 129)).astype(np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    state_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6

    for _ in range(2):  # compile and warm up
        state, _ = timed_step(step_fn, state, batch)
    base = []
    for _ in range(args.baseline_steps):
        state, dt = timed_step(step_fn, state, batch)
        base.append(dt)

    with tempfile.TemporaryDirectory() as tmp:
        first = Checkpointer(f"{tmp}/warm", CheckpointConfig(async_save=True))
        t = time.perf_counter()
        first.save(state, {})
        first.close()
        first_s = time.perf_counter() - t

        ck = Checkpointer(f"{tmp}/async", CheckpointConfig(async_save=True))
        t0 = time.perf_counter()
        ck.save(state, {})
        blocked = time.perf_counter() - t0
        during, committed = [], None
        while committed is None:
            state, dt = timed_step(step_fn, state, batch)  # the saved buffers are donated here
            during.append(dt)
            if not ck.manager.is_saving_in_progress():
                committed = time.perf_counter() - t0
        ck.close()

        both = {"params": state.params, "opt_state": state.opt_state}
        describe(both)  # compiled by the saves above already; timed warm
        t = time.perf_counter()
        describe(both)
        checksum_s = time.perf_counter() - t

        sync = Checkpointer(f"{tmp}/sync", CheckpointConfig(async_save=False))
        t = time.perf_counter()
        sync.save(state, {})
        sync_s = time.perf_counter() - t
        sync.close()

    step = statistics.median(base)
    rows = [
        f"Command: `python benchmarks/checkpoint_save.py --d-model {args.d_model} --layers {args.layers}` "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores): gpt h={args.d_model} L={args.layers}, "
        f"train state {state_mb:,.0f} MB (fp32 params + AdamW), data=2 simulated CPU devices, local disk.",
        "",
        "| | seconds | in steps |",
        "|---|---:|---:|",
        f"| train step, no save in flight (median of {len(base)}) | {step:.3f} | 1.00 |",
        f"| async save: loop blocked in `save()` | {blocked:.3f} | {blocked / step:.2f} |",
        f"| ... of which the on-device checksum pass (`checkpoint.describe`) | {checksum_s:.3f} | "
        f"{checksum_s / step:.2f} |",
        f"| async save: committed after (steps kept running) | {committed:.3f} | {committed / step:.2f} |",
        f"| steps during the background write: median of {len(during)} | {statistics.median(during):.3f} | "
        f"{statistics.median(during) / step:.2f} |",
        f"| sync save: loop blocked | {sync_s:.3f} | {sync_s / step:.2f} |",
        f"| first save of a process (checksum compile + Orbax start-up) | {first_s:.3f} | {first_s / step:.2f} |",
    ]
    table = "\n".join(rows)
    print(table)
    if args.write:
        write_section("checkpoint_save", table)


if __name__ == "__main__":
    sys.exit(main())
