#!/usr/bin/env bash
# One TPU chip, offline, under 10 minutes: the Pallas kernels checked on the chip against the host
# CPU, the attention and grouped-GEMM rates the planner assumes, and training steps beside the
# planner's prediction (benchmarks/tpu.py; results in $OUT/tpu.json or ./tpu.json).
# Needs a Python with JAX on a TPU. meshlm's pure-Python dependencies missing there are installed
# from wheels in .whl-tpu/ (`pip download` them where pip reaches an index: see docs/tpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ -d .whl-tpu ] && ! "$PYTHON" -c 'import optax, zstandard' 2>/dev/null; then
  PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --isolated -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/meshlm-site .whl-tpu/*.whl
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/meshlm-site"
fi
"$PYTHON" -c 'import jax, sys; d = jax.devices()[0]; sys.exit(0 if d.platform == "tpu" else
  f"benchmarks/tpu.sh needs a TPU; JAX sees {d.platform}. Off a TPU: python benchmarks/tpu.py --smoke")'
export PYTHONPATH="src:benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 560 "$PYTHON" benchmarks/tpu.py "$@"
