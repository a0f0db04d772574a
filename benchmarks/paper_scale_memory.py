"""Activation memory of P2's 22B model at its own layout (tensor=8, s=2048, b=4), measured on this
CPU by compiling the residual function with 8 simulated devices (nothing is allocated), next to the
formula, each row as a percentage of the tensor-parallel row (what P2's Figure 7 plots), and P2's
own reading of Figure 7 (text: SP + selective under 20% of the TP baseline, full recompute about
10%). Figure 7 prints no GiB values, so none are quoted here.

    python benchmarks/paper_scale_memory.py [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _markdown import publish

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses

from meshlm import accounting, recipes
from meshlm.config import RematConfig
from meshlm.insight.memory import measure_activations
from meshlm.parallel.mesh import make_layout

GiB = 2**30
ROWS = [  # (label, sequence parallel, policy, what P2's text says of this bar of Figure 7)
    ("tensor parallel", False, "elementwise", "100% (baseline)"),
    ("tensor + sequence parallel", True, "elementwise", "about half"),
    ("tensor parallel + selective", False, "selective", "about half"),
    ("tensor + sequence parallel + selective", True, "selective", "under 20%"),
    ("full recompute", False, "full", "about 10%"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    base = recipes.get("gpt-22b")
    lines = [
        f"Command: `{' '.join(['python benchmarks/paper_scale_memory.py', *sys.argv[1:]])}` "
        f"({time.strftime('%Y-%m-%d')}; gpt-22b: h=6144, a=64, L=48, s=2048, b=4, tensor=8, bf16, dropout 0.1)",
        "",
        "| configuration | measured GiB/device | formula GiB | ratio | % of TP | P2's text on Fig. 7 | compile s |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    baseline = None
    for label, sp, policy, fig7 in ROWS:
        cfg = dataclasses.replace(
            base,
            parallel=dataclasses.replace(base.parallel, sequence_parallel=sp),
            remat=RematConfig(policy),
        )
        t0 = time.time()
        measured = measure_activations(cfg, make_layout(cfg.parallel)).activation_bytes
        formula = accounting.activation_memory(cfg)["total"]
        baseline = baseline or measured
        lines.append(
            f"| {label} | {measured / GiB:.2f} | {formula / GiB:.2f} | {measured / formula:.5f} | "
            f"{100 * measured / baseline:.1f}% | {fig7} | {time.time() - t0:.1f} |"
        )
        print(lines[-1], flush=True)
    publish("paper_scale_memory", lines, args.write)


if __name__ == "__main__":
    main()
