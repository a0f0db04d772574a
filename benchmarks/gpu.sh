#!/usr/bin/env bash
# One GPU machine, offline, under 10 minutes: llama-1b and gpt-1.3b training steps at their best
# planned layout -> tokens/s, MFU, HFU, peak device memory, compile time (benchmarks/gpu.py).
# Needs a Python with jax[cuda] and meshlm's dependencies: PYTHON=/path/to/python (default: the
# repository's .venv, else python3). Extra arguments go to gpu.py (e.g. --steps 5 --write).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$PYTHON" -c 'import jax, sys; d = jax.devices()[0]; sys.exit(0 if d.platform == "gpu" else
  f"benchmarks/gpu.sh needs a GPU; JAX sees {d.platform} ({d.device_kind}). For the CPU path: python benchmarks/gpu.py --recipes tiny")'
export PYTHONPATH="src:benchmarks${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 570 "$PYTHON" benchmarks/gpu.py "$@"
