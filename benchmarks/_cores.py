"""Pin a benchmark to some of the CPUs, before JAX and PyTorch size their thread pools (jax-free)."""

from __future__ import annotations

import os


def pin(cores: int) -> None:
    """Run this process on `cores` of the CPUs it may use (0: all of them)."""
    if cores:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
