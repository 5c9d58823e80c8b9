#!/usr/bin/env bash
# Set up a development environment (idempotent): the package in editable mode with its test and
# lint tools, then one SGLang release for CPU. torch comes from PyPI at that release's own pin (a
# CUDA build of ~4.5 GB with its nvidia-* wheels; it runs on CPU-only machines too).
#
# Releases (SGLANG_VERSION, default 0.5.17):
#   0.5.17  -> .venv          launch/sglang-cpu-requirements.txt         (torch 2.11.0)
#   0.5.23  -> .venv-0.5.23   launch/sglang-cpu-requirements-0.5.23.txt  (torch 2.14.1)
#
# SGLang is installed with --no-deps plus the release's pure-Python list (pins and where they
# come from are documented in the list): its declared dependencies include CUDA-only wheels.
# sglang-kernel is never installed here. The package itself is installed under the same list as
# constraints, so torch and transformers are the release's own from the start.
# A second run skips the SGLang step while the installed version and the requirements file are
# unchanged (a stamp in the venv records both).
#
#   bash launch/setup-dev.sh        # then: .venv/bin/python -m pytest
#   SGLANG_VERSION=0.5.23 bash launch/setup-dev.sh   # then: .venv-0.5.23/bin/python -m pytest
#   PYTHON=python3.12 bash launch/setup-dev.sh   # choose the interpreter for a new venv
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
sglang_version=${SGLANG_VERSION:-0.5.17}
case "$sglang_version" in
  0.5.17) venv=.venv requirements=launch/sglang-cpu-requirements.txt ;;
  0.5.23) venv=.venv-0.5.23 requirements=launch/sglang-cpu-requirements-0.5.23.txt ;;
  *)
    echo "setup-dev: SGLANG_VERSION=$sglang_version is not a tested release (0.5.17, 0.5.23)" >&2
    exit 2
    ;;
esac
stamp=$venv/.sglang-cpu-stamp
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

if [ ! -x "$venv/bin/python" ]; then
  # A new venv takes ~6 GB (torch's CUDA build and its nvidia-* wheels), plus pip's unpacking.
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "${free_kb:-0}" -lt $((8 * 1024 * 1024)) ]; then
    echo "setup-dev: only $((free_kb / 1024)) MB free under $PWD; a new $venv needs about 8 GB" >&2
    exit 1
  fi
  echo "setup-dev: creating $venv with $($python --version)"
  "$python" -m venv "$venv"
fi
echo "setup-dev: installing sglang-tree-spec[dev] into $venv (first run downloads torch, a few minutes)"
"${pip[@]}" -e '.[dev]' -c "$requirements"
# The DFlash authors' reference, the drafter tests' oracle: --no-deps, its pins (tqdm, datasets)
# conflict with the release's list and it needs nothing the venv lacks.
"${pip[@]}" --no-deps dflash==0.1.0

want="sglang==$sglang_version $(sha256sum "$requirements" | cut -c1-16)"
have_sglang=$("$venv/bin/python" -c \
  'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [ "$have_sglang" = "$sglang_version" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup-dev: sglang $sglang_version (CPU) already installed in $venv"
else
  echo "setup-dev: installing sglang $sglang_version for CPU into $venv (--no-deps + $requirements)"
  "${pip[@]}" -r "$requirements"
  "${pip[@]}" --no-deps "sglang==$sglang_version"
  echo "$want" >"$stamp"
fi
echo "setup-dev: $venv ready ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
