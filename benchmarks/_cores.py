"""Pin a benchmark to some of the CPUs, before JAX and PyTorch size their thread pools (jax-free)."""

from __future__ import annotations

import argparse
import os


def pin(cores: int) -> None:
    """Run this process on `cores` of the CPUs it may use (0: all of them)."""
    if cores:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])


def side_by_side_args(sizes: str = "small,medium") -> argparse.Namespace:
    """The command line of the side-by-side runs against PyTorch (vs_pytorch.py, step_phases.py,
    gemm_rates.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=sizes)
    ap.add_argument("--families", default="gpt,llama")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--cores", type=int, default=0, help="run on this many of the allowed CPUs only (0: all)")
    ap.add_argument("--write", action="store_true")
    return ap.parse_args()
