#!/usr/bin/env bash
# Set up the development environment in .venv (idempotent): the package in editable mode with
# its test and lint tools, then SGLang 0.5.17 for CPU. torch 2.11.0 comes from PyPI (a CUDA build
# of ~4.5 GB with its nvidia-* wheels; it runs on CPU-only machines too).
#
# SGLang is installed with --no-deps plus the pure-Python list in
# launch/sglang-cpu-requirements.txt (pins and where they come from are documented there):
# its declared dependencies include CUDA-only wheels. sglang-kernel is never installed here.
# A second run skips the SGLang step while the installed version and the requirements file are
# unchanged (a stamp in .venv records both).
#
#   bash launch/setup-dev.sh        # then: .venv/bin/python -m pytest
#   PYTHON=python3.12 bash launch/setup-dev.sh   # choose the interpreter for a new .venv
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
sglang_version=0.5.17
requirements=launch/sglang-cpu-requirements.txt
stamp=.venv/.sglang-cpu-stamp
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if [ ! -x .venv/bin/python ]; then
  echo "setup-dev: creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
echo "setup-dev: installing sglang-tree-spec[dev] (first run downloads torch, a few minutes)"
"${pip[@]}" -e '.[dev]'

want="sglang==$sglang_version $(sha256sum "$requirements" | cut -c1-16)"
have_sglang=$(.venv/bin/python -c \
  'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [ "$have_sglang" = "$sglang_version" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup-dev: sglang $sglang_version (CPU) already installed"
else
  echo "setup-dev: installing sglang $sglang_version for CPU (--no-deps + $requirements)"
  "${pip[@]}" -r "$requirements"
  "${pip[@]}" --no-deps "sglang==$sglang_version"
  echo "$want" >"$stamp"
fi
echo "setup-dev: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
