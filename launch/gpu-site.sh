#!/usr/bin/env bash
# An offline SGLang 0.5.17 site for a GPU machine that has Python 3.12 + torch 2.11.0 (CUDA 13),
# triton, numpy, pytest, ... but no network, packed small enough to be carried there in parts.
#
#   bash launch/gpu-site.sh OUTDIR [PART_MIB]   # here, where PyPI is reachable (about 4 minutes)
#   bash launch/gpu-site.sh --list              # the packages and what is trimmed, nothing fetched
#
# OUTDIR gets site-part-00, site-part-01, ... (45 MB of xz tar split at PART_MIB, default 36 MiB, so
# that each part fits beside this checkout's ~25 MiB under a 64 MiB transfer). On the GPU machine:
#   cat OUTDIR/site-part-* | xz -dc | tar x -C /root        # -> /root/gsite
#   export PYTHONPATH=/root/gsite
#   bash launch/gpu-validate.sh --site /root/gsite ...      # installs this plugin into it
#
# What an H100 run of 2026-11-26 taught (each line cost a failed server start there):
# - sglang 0.5.17 pins transformers 5.12.1; with the image's 5.17.0 every server exits
#   ("'qwen3_asr' is already used by a Transformers config"), so transformers + tokenizers
#   0.22.2 travel (modular_* sources and the modeling files of models other than
#   llama / qwen2 / qwen3 are dropped: sglang skips the model files that need them).
# - imported at start-up but missing from a plain sglang wheel list: loguru (compressed-tensors),
#   jsonschema + its three helpers (serving_chat), opentelemetry-api (fastapi 0.165),
#   ipython-pygments-lexers; tvm_ffi needs its libtvm_ffi_testing.so.
# - flashinfer's JIT sources (flashinfer/data) are needed: sgl_kernel's bf16 rmsnorm JIT-builds
#   flashinfer's norm op at the first forward (nvcc + ninja, in the image). float32 does not run
#   at all on CUDA ("rmsnorm ... failed to dispatch data type Float"): serve bf16 / fp16 there.
set -euo pipefail

wheels=(
  sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11
  transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1 compressed-tensors==0.18.0 loguru
  jsonschema jsonschema-specifications referencing rpds-py opentelemetry-api fastapi starlette
  uvicorn pydantic pydantic-core annotated-types typing-inspection orjson pyzmq msgspec
  partial-json-parser pybase64 setproctitle openai==2.6.1 distro jiter sniffio gguf dill
  python-multipart soundfile cffi pycparser IPython ipython-pygments-lexers prompt-toolkit pexpect
  ptyprocess traitlets decorator matplotlib-inline stack-data asttokens executing pure-eval
  wcwidth
)
# Paths removed from the unpacked site (globs, relative to it): not imported by a text server.
trim=(
  'sglang/multimodal_gen' 'sglang/test' 'sglang/srt/grpc/_core*.so' 'sglang/srt/server/_core*.so'
  'sglang/srt/multimodal/_core*.so' 'xgrammar/lib' 'xgrammar/include' 'tvm_ffi/3rdparty'
  'transformers/models/*/modular_*.py'
)
keep_modeling='^transformers/models/(llama|qwen2|qwen3|auto)/'

if [[ ${1:-} == --list ]]; then
  printf 'wheel %s\n' "${wheels[@]}"
  printf 'trim %s\n' "${trim[@]}"
  echo "trim transformers/models/*/modeling_*.py except ${keep_modeling}"
  exit 0
fi
out=${1:?usage: gpu-site.sh OUTDIR [PART_MIB] | --list}
part_mib=${2:-36}
mkdir -p "$out/wheels" "$out/stage/gsite"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$out/wheels" "${wheels[@]}"
# sglang-kernel: only the eagerly loaded sm90 op library (flash_ops, 1.1 GB, loads lazily).
for wheel in "$out"/wheels/*.whl; do
  python3 -m zipfile -e "$wheel" "$out/stage/gsite"
done
site="$out/stage/gsite"
(cd "$site" && rm -rf sgl_kernel/flash_ops* sgl_kernel/infllm_ops* sgl_kernel/flashmla_ops* \
  sgl_kernel/sm100 && for pattern in "${trim[@]}"; do rm -rf $pattern; done &&
  find transformers/models -name 'modeling_*.py' | grep -Ev "$keep_modeling" | xargs rm -f &&
  find . -name __pycache__ -prune -exec rm -rf {} +)
tar cf - -C "$out/stage" gsite | xz -9 -T0 | split -b "${part_mib}m" -d - "$out/site-part-"
rm -rf "$out/stage" "$out/wheels"
ls -la "$out"/site-part-*
