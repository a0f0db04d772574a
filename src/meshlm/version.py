"""meshlm's version and the git commit of its source tree: what run.json, every checkpoint's
metadata and a converted run record as the code that wrote them."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from meshlm import __version__


@functools.cache
def code_version() -> str:
    """meshlm's version plus the git commit of its source tree, if it is a checkout (one git call
    per process)."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{__version__}+{sha}" if sha else __version__
