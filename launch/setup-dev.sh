#!/usr/bin/env bash
# Set up the development environment in .venv (idempotent): the package in editable mode with
# its test and lint tools. torch 2.11.0 comes from PyPI (a CUDA build of ~4.5 GB with its
# nvidia-* wheels; it runs on CPU-only machines too).
#
#   bash launch/setup-dev.sh        # then: .venv/bin/python -m pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup-dev: creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
echo "setup-dev: installing sglang-tree-spec[dev] (first run downloads torch, a few minutes)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
echo "setup-dev: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
