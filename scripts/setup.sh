#!/usr/bin/env bash
# Create .venv in the repository and install labavg with its test tools.
# CPU machines get torch 2.13.0 (the CPU build on these machines); set TORCH_SPEC to choose
# another build, e.g. TORCH_SPEC="torch==2.13.0" PIP_INDEX_URL=... for a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -c "import torch, mpi4py, kaldiio; print('labavg environment ready: torch', torch.__version__)"
