#!/usr/bin/env bash
# Create .venv in the repository and install labavg with its test tools.
# Without a torch in .venv it installs torch 2.13.0 (the CPU build on CPU machines); set
# TORCH_SPEC to ask for another, or install the torch build you want into .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Keep a torch that is already installed (e.g. a CUDA build a GPU user put there first).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e '.[dev]'
bash scripts/git-notebook-filter.sh
.venv/bin/python -c "import torch, mpi4py, kaldiio; print('labavg environment ready: torch', torch.__version__)"
