#!/usr/bin/env bash
# Set up a fresh checkout: create .venv (if missing) and install asyncdiloco into it with
# its test, bench, tensorboard and ray extras. torch is installed first and pinned (2.13.0), so the range in
# pyproject.toml is already satisfied and pip never pulls a different (CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,bench,tensorboard,ray]"
.venv/bin/python -c "import asyncdiloco, torch, grpc; print(f'asyncdiloco ready: torch {torch.__version__}, grpcio {grpc.__version__}')"
