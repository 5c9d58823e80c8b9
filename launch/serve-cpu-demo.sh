#!/usr/bin/env bash
# Serve the project's small pair with DDTREE through the unmodified SGLang launcher, on CPU.
#
#   bash launch/setup-dev.sh && bash launch/serve-cpu-demo.sh            # budget 16, port 30000
#   BUDGET=32 PORT=30001 bash launch/serve-cpu-demo.sh
#   curl -s localhost:30000/generate -H 'Content-Type: application/json' \
#     -d '{"text": "def read_config(path):\n", "sampling_params": {"max_new_tokens": 48}}'
#
# The pair (a 2.2M-parameter Llama target and its DFlash drafter, trained by this project on
# Python's standard library) ships inside the package. Everything DDTREE needs on CPU (tree-mask
# verify attention, KV moves, slot writes) comes from the plugin's hooks, loaded by SGLang's
# plugin entry point; the command below is SGLang's own. Set SPEC=none for plain decoding.
#
# GPU launch lines (same plugin; DDTREE turns CUDA graphs off until the capture honours the tree
# mask; not yet measured here):
#   python -m sglang.launch_server --model-path Qwen/Qwen3-8B \
#     --speculative-algorithm DDTREE --speculative-draft-model-path z-lab/Qwen3-8B-DFlash-b16 \
#     --speculative-num-draft-tokens 33 --attention-backend triton
#   python -m sglang.launch_server --model-path <smollm2-135m-instruct checkpoint> \
#     --speculative-algorithm DDTREE --speculative-draft-model-path <its DFlash drafter> \
#     --speculative-num-draft-tokens 17 --attention-backend triton \
#     --speculative-token-map <its drafter>/token_map_8192.pt   # draft from 8,192 of 49,152 ids
#   (`sglang-tree-spec models fetch smollm2-135m-instruct` makes the target checkpoint offline)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-.venv/bin/python}
pair=$("$python" -c "from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR; print(SMALL_PAIR_DIR)")
args=(
  --model-path "$pair/target" --device cpu --attention-backend torch_native --dtype float32
  --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" --max-total-tokens 16384
  --max-running-requests "${MAX_RUNNING:-16}" --random-seed 0
  --sleep-on-idle  # without it an idle CPU scheduler spins one core
)
if [ "${SPEC:-ddtree}" != none ]; then
  args+=(--speculative-algorithm DDTREE --speculative-draft-model-path "$pair/drafter"
         --speculative-num-draft-tokens "$(( ${BUDGET:-16} + 1 ))")
fi
echo "serve-cpu-demo: python -m sglang.launch_server ${args[*]}"
exec "$python" -m sglang.launch_server "${args[@]}"
