#!/usr/bin/env bash
# Train the DFlash drafter (block 16) of SmolLM2-135M-Instruct on CPU, end to end, with the
# project's recipe: fetch the target -> regenerate training data with the target (its greedy
# answers to TRAINING prompts only: stdlib code, gsm_symbolic train templates, ShareGPT) ->
# train the drafter -> save it in bf16 -> print its SHA256.
#
#   bash launch/setup-dev.sh && bash launch/train-smollm2-drafter.sh
#
# The defaults replay the run that made the drafter shipped until commit 1b5b8b5 (the shipped one,
# sglang_tree_spec/assets/smollm2-135m-instruct-dflash, was made in two stages with RECIPE=long:
# INIT_FROM_TARGET, then MORE; see below and its BUILD.json), on a shared 2-core
# CPU in about 1.5 hours: regeneration was stopped after 576 + 512 prompts of its two shards
# (MAX_PROMPTS, per shard), and training ran in STAGES, each `total:batch:anchors:stop` (the
# cosine schedule spans `total` steps; the run resumes from its checkpoint and stops at `stop`):
# the batch was halved at step 80 and the total shortened three times to finish in time. For a
# longer run set e.g. MAX_PROMPTS="0 0" (all prompts) STAGES="3000:4:64:3000".
#
# Long runs (RECIPE=long): the target's features at the drafter's layers and its top-k next
# tokens are computed once per record and cached in $WORK/features (bf16 + int32, 2,336 bytes
# per token: about 0.43 GB for the shipped data's 184k tokens; built once, resumable), so each
# step runs the drafter only; the loss runs over a shortlist (labels + cached target top-TOPK +
# NEGATIVES sampled negatives; the full loss for the first FULL_LOSS_STEPS steps, where the
# shortlist is least faithful). The last HELDOUT records are held out and their slot-1
# acceptance is printed every EVAL_EVERY steps. One stage of STEPS steps (batch BATCH, ANCHORS
# anchors); it stops at STEPS, after MAX_MINUTES of training, or once the held-out slot-1
# acceptance reaches STOP_ACC, whichever comes first; the same command resumes it (checkpoint
# every SAVE_EVERY steps in $WORK/train-long). INIT_FROM=<drafter dir> starts the run from that
# drafter's weights (e.g. the shipped one, sglang_tree_spec/assets/smollm2-135m-instruct-dflash)
# instead of a random init, with a fresh optimizer and schedule (peak learning rate LR, 2e-3 by
# default; a lower one keeps more of what the drafter it starts from learnt). INIT_FROM_TARGET=1
# starts the drafter's two layers as copies of the target's layers 28 and 29, the ones after its
# last feature layer (27), instead of a random init (`train-drafter --init-from-target`).
#
#   RECIPE=long MAX_MINUTES=240 STOP_ACC=0.6 bash launch/train-smollm2-drafter.sh
#
# MORE="CODE CHAT MATH" (long recipe) regenerates further training items: the first CODE / CHAT /
# MATH items of each domain's pool that data.jsonl does not hold, appended after it (the held-out
# records, the last ones, are then new ones). The shipped drafter's stage 2 (its BUILD.json) was
# MORE="2400 240 240" from stage 1's drafter (the assets folder at commit 9e100a0) at LR=1e-3,
# 1250 steps, seed 1 (26 min; 16 min of generation):
#
#   RECIPE=long MORE="2400 240 240" INIT_FROM=<stage 1's drafter> \
#     LR=1e-3 STEPS=1250 FULL_LOSS_STEPS=0 EVAL_EVERY=100 bash launch/train-smollm2-drafter.sh
#
# REFERENCE="CODE CHAT MATH" (long recipe) adds that many training items per domain as their
# reference conversations (`models regen-data --reference`: the stdlib function, the ShareGPT
# replies; no generation, so ~8x the data in the same CPU time; items already regenerated are
# left out), trained with teacher labels (the target's cached greedy choices, only along its
# greedy path: `train-drafter --teacher-labels`); the held-out records stay the last
# regenerated ones. Its cache and checkpoints are $WORK/features-reference and
# $WORK/train-reference.
#
#   RECIPE=long REFERENCE="6255 300 300" INIT_FROM=sglang_tree_spec/assets/smollm2-135m-instruct-dflash \
#     LR=1e-3 STEPS=1000 bash launch/train-smollm2-drafter.sh
#
# Output: $OUT (default <cache root>/drafters/smollm2-135m-instruct-dflash, where
# `sglang-tree-spec demo` looks first), work files (data, fp32 checkpoints every 40 steps,
# train_log.jsonl) in $WORK. Every stage resumes: regeneration skips the records already written,
# training continues from the last checkpoint. Regeneration runs one single-thread process per
# shard (one per core); training uses THREADS torch threads.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-.venv/bin/python}
cli=(.venv/bin/sglang-tree-spec)
export OMP_WAIT_POLICY=PASSIVE  # spinning OpenMP threads slow everything on a shared machine
cache=$("$python" -c "from sglang_tree_spec.models.zoo import cache_root; print(cache_root())")
name=smollm2-135m-instruct
work=${WORK:-$cache/work/$name-dflash}
out=${OUT:-$cache/drafters/$name-dflash}
read -r -a max_prompts <<< "${MAX_PROMPTS:-576 512}"
stages=${STAGES:-"600:4:64:40 430:4:64:80 820:2:32:200 660:2:32:400 560:2:32:560"}
threads=${THREADS:-2}
recipe=${RECIPE:-replay}
train=$work/train
extra=()
case "$recipe" in
  replay) ;;
  long)
    steps=${STEPS:-20000}
    stages="$steps:${BATCH:-4}:${ANCHORS:-64}:$steps"
    train=$work/train-long
    features=$work/features
    if [ -n "${REFERENCE:-}" ]; then
      train=$work/train-reference
      features=$work/features-reference
    fi
    extra=(--feature-cache "$features" --cache-topk "${TOPK:-8}" --cache-batch-size 1
      --shortlist-negatives "${NEGATIVES:-2048}" --full-loss-steps "${FULL_LOSS_STEPS:-200}"
      --heldout-records "${HELDOUT:-32}"
      --eval-every "${EVAL_EVERY:-200}" --save-every "${SAVE_EVERY:-100}")
    if [ -n "${MAX_MINUTES:-}" ]; then extra+=(--max-minutes "$MAX_MINUTES"); fi
    if [ -n "${STOP_ACC:-}" ]; then extra+=(--stop-heldout-acc "$STOP_ACC"); fi
    if [ -n "${INIT_FROM:-}" ]; then extra+=(--init-from "$INIT_FROM"); fi
    if [ -n "${INIT_FROM_TARGET:-}" ]; then extra+=(--init-from-target); fi
    if [ -n "${REFERENCE:-}" ]; then extra+=(--teacher-labels); fi
    ;;
  *)
    echo "train-smollm2-drafter: RECIPE=$recipe is neither replay nor long" >&2
    exit 2
    ;;
esac
shards=${#max_prompts[@]}
mkdir -p "$work"

target=$("${cli[@]}" models fetch "$name" | tail -n 1)
echo "target: $target"

pids=()
for ((i = 0; i < shards; i++)); do
  "${cli[@]}" models regen-data --target "$target" --out "$work/data.$i-of-$shards.jsonl" \
    --code 1100 --math 120 --chat 120 --max-prompt-tokens 384 --max-new-tokens 96 \
    --batch-size 32 --threads 1 --shard "$i/$shards" --max-prompts "${max_prompts[$i]}" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
cat "$work"/data.*-of-"$shards".jsonl > "$work/data.jsonl"
"$python" - "$work/data.jsonl" <<'EOF'
import json
import sys
from pathlib import Path

from sglang_tree_spec.models.regen_data import META_SUFFIX, summarize

path = Path(sys.argv[1])
summary = summarize(path)
Path(str(path) + META_SUFFIX).write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary))
EOF

data=$work/data.jsonl
if [ -n "${MORE:-}" ]; then
  # More regenerated records, appended after data.jsonl (first of each id): the cached features
  # of data.jsonl are a prefix of the new data's, so the cache is extended, not rebuilt.
  read -r more_code more_chat more_math <<< "$MORE"
  pids=()
  for ((i = 0; i < shards; i++)); do
    "${cli[@]}" models regen-data --target "$target" --out "$work/more.$i-of-$shards.jsonl" \
      --code "$more_code" --math "$more_math" --chat "$more_chat" --max-prompt-tokens 384 \
      --max-new-tokens 96 --batch-size 32 --threads 1 --shard "$i/$shards" \
      --skip-ids-from "$work/data.jsonl" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  "$python" - "$work/data-more.jsonl" "$work/data.jsonl" "$work"/more.*-of-"$shards".jsonl <<'EOF'
import json
import sys

seen = set()
with open(sys.argv[1], "w") as out:
    for name in sys.argv[2:]:
        for line in filter(str.strip, open(name)):
            record_id = json.loads(line)["id"]
            if record_id not in seen:
                seen.add(record_id)
                out.write(line.rstrip("\n") + "\n")
print(f"{len(seen)} records in {sys.argv[1]}")
EOF
  data=$work/data-more.jsonl
fi
vocab_data=$data
if [ -n "${REFERENCE:-}" ]; then
  read -r ref_code ref_chat ref_math <<< "$REFERENCE"
  "${cli[@]}" models regen-data --target "$target" --out "$work/reference.jsonl" --reference \
    --code "$ref_code" --chat "$ref_chat" --math "$ref_math" --max-prompt-tokens 768 \
    --max-new-tokens 256 --skip-ids-from "$data"
  # reference records first: the held-out records (the last ones) stay regenerated ones
  cat "$work/reference.jsonl" "$data" > "$work/data-reference.jsonl"
  data=$work/data-reference.jsonl
fi

for stage in $stages; do
  IFS=: read -r steps batch anchors stop <<< "$stage"
  OMP_NUM_THREADS=$threads "${cli[@]}" models train-drafter --target "$target" \
    --data "$data" --out "$train" --block-size 16 --num-layers 2 --gamma 7 \
    --seq-len 512 --lr "${LR:-2e-3}" --save-every 40 --log-every 10 --seed 0 --device cpu \
    --steps "$steps" --batch-size "$batch" --anchors-per-seq "$anchors" --stop-at "$stop" \
    "${extra[@]}"
done

"$python" - "$train" "$out" <<'EOF'
import sys

import torch

from sglang_tree_spec.drafters.dflash import DFlashDrafter

DFlashDrafter.from_pretrained(sys.argv[1], dtype=torch.bfloat16).save_pretrained(sys.argv[2])
EOF
cp "$train/train_log.jsonl" "$work/data.jsonl.meta.json" "$out/"
# The draft vocabulary (serve with --speculative-token-map $out/token_map_8192.pt): the data's
# ids by frequency, then the lowest unseen ids.
vocab=$("$python" -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
  "$target/config.json")
"$python" -m sglang_tree_spec.models.token_map --data "$vocab_data" --vocab-size "$vocab" \
  --size 8192 --out "$out/token_map_8192.pt"
echo "drafter: $out"
sha256sum "$out/model.safetensors"
