"""Where meshlm's step differs from PyTorch's: forward, backward and optimizer timed apart, side by
side in one process, on the models and batch of `benchmarks/vs_pytorch.py`.

For each family and size, in alternating rounds (median step time):

- forward: meshlm's eval step (forward and loss) on one device / PyTorch eager's loss under `torch.no_grad()`
  (neither keeps anything for a backward pass);
- forward + backward: meshlm's `make_grad_step` (the train step's gradients, before the optimizer)
  / PyTorch's `loss.backward()`;
- the whole train step (AdamW with clipping): meshlm's `make_train_step` / PyTorch eager's.

Backward is the difference of the first two, the optimizer that of the last two. That optimizer
column is rough: meshlm's train step also assembles each step's batch on the host, computes the
gradient norm and its non-finite bookkeeping, and syncs once per round where the first two phases
sync every call; PyTorch's forward + backward leaves out the clipping norm.

With `--cores 1` the process (XLA's and PyTorch's threads alike) is pinned to one core first, which
takes thread scheduling out of the comparison and leaves the work each framework does (its table
goes to section `step_phases_1core`, appended to BENCHMARKS.md if it has no markers yet).

    python benchmarks/step_phases.py [--cores 2] [--sizes small,medium] [--families gpt,llama] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys

import _cores  # jax-free

if __name__ == "__main__":  # pinned before JAX and PyTorch size their thread pools
    ARGS = _cores.side_by_side_args()
    _cores.pin(ARGS.cores)

import vs_pytorch as vs  # first: meshlm's host allocator settings and JAX_PLATFORMS=cpu, before JAX loads

# isort: split
import time

import jax
import numpy as np
import torch

from _markdown import publish
from meshlm.data.loader import WindowLoader, process_batch
from meshlm.parallel.mesh import make_layout
from meshlm.platform.hardware import cpu_description
from meshlm.step import batch_sharding, make_eval_step, make_grad_step
from meshlm.train_state import init_state, setup

PHASES = ("forward", "forward + backward", "train step")


def meshlm_phases(family: str, size: str) -> dict:
    run = vs.meshlm_config(family, size)
    layout = make_layout(run.parallel, jax.devices()[:1])
    specs, tx, shardings = setup(run, layout)
    params = init_state(specs, layout, tx, 0).params
    tokens = np.random.default_rng(0).integers(0, vs.VOCAB, 20 * vs.BATCH * (vs.SEQ + 1)).astype(np.int32)
    batch = process_batch(WindowLoader(tokens, vs.SEQ, vs.BATCH, seed=0), 0, batch_sharding(layout))
    loss = make_eval_step(run, layout, shardings.params)  # the forward pass and the loss, no dropout
    grads = make_grad_step(run, layout, shardings.params)
    step, sync = vs.meshlm_stepper(run)
    return {
        "forward": (lambda: jax.block_until_ready(loss(params, batch)), lambda: None),
        "forward + backward": (lambda: jax.block_until_ready(grads(params, batch, 0)), lambda: None),
        "train step": (step, sync),
    }


def torch_phases(family: str, size: str) -> dict:
    cfg = vs.meshlm_config(family, size).model
    torch.manual_seed(0)
    model = vs.torch_model(cfg)
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (vs.BATCH, vs.SEQ + 1))

    def forward():
        with torch.no_grad():
            return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss

    def forward_backward():
        model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss.backward()
        model.zero_grad(set_to_none=True)

    step, sync = vs.torch_stepper(cfg, compiled=False)
    return {"forward": (forward, lambda: None), "forward + backward": (forward_backward, lambda: None)} | {
        "train step": (step, sync)
    }


def main(args: argparse.Namespace) -> None:
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    command = " ".join(["python benchmarks/step_phases.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {cpu_description()}, {cores} CPU core{'s' * (cores > 1)}, "
        f"torch {torch.__version__} eager, jax {jax.__version__}, meshlm on 1 device; vocab {vs.VOCAB}, seq {vs.SEQ}, "
        f"batch {vs.BATCH}, fp32; median ms of {args.rounds} alternating rounds of {args.steps} steps)",
        "",
        "| family | size | forward: meshlm / PyTorch | backward | optimizer | train step | meshlm / PyTorch: "
        "forward | backward | step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            variants = {("meshlm", k): v for k, v in meshlm_phases(family, size).items()}
            variants |= {("torch", k): v for k, v in torch_phases(family, size).items()}
            ms = {k: t * 1e3 for k, t in vs.time_variants(variants, args.rounds, args.steps).items()}
            split = {}
            for fw in ("meshlm", "torch"):
                f, fb, st = (ms[(fw, p)] for p in PHASES)
                split[fw] = {"forward": f, "backward": fb - f, "optimizer": st - fb, "step": st}
            m, t = split["meshlm"], split["torch"]
            cells = [f"{m[p]:.0f} / {t[p]:.0f}" for p in ("forward", "backward", "optimizer", "step")]
            ratios = [f"{m[p] / t[p]:.2f}x" for p in ("forward", "backward", "step")]
            lines.append(f"| {family} | {size} | " + " | ".join(cells + ratios) + " |")
            print(lines[-1], flush=True)
    publish(f"step_phases_{cores}core", lines, args.write)


if __name__ == "__main__":
    main(ARGS)
