"""Benchmark: acceptance (tau) of DDTree against both Graft policies on the small pair.

For each budget: the stage thresholds are calibrated on DDTree steps over TRAINING prompts
(function prompts of the pair's training split), then ``ddtree``, ``ddtree-graft-stage`` (the
calibrated thresholds) and ``ddtree-graft-unified`` decode the held-out function prompts
greedily. Each method gets a fresh engine, so its successor table starts empty, is warmed by
each prompt's bigrams and learns online across the held-out prompts in order (batches of
``--batch-size``), as a server would. tau = tokens committed per target forward (bonus
included), pooled over every step of every request.

    python benchmarks/graft_acceptance.py                       # writes the CPU result file
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time
from pathlib import Path

import torch

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target
from sglang_tree_spec.graft import StageConfig, calibrate_stage
from sglang_tree_spec.models.small_pair import (
    SMALL_PAIR_DIR,
    corpus_files,
    function_prompts,
    heldout_prompts,
)

METHODS = ("ddtree", "ddtree-graft-stage", "ddtree-graft-unified")
DEFAULT_OUT = Path(__file__).parent / "results" / "graft_acceptance_cpu.json"


def training_prompts(count: int) -> list[str]:
    """``count`` function prompts spread evenly over the training split (calibration only)."""
    prompts = [p for f in corpus_files("train") for p in function_prompts(f.text)]
    return [prompts[i * len(prompts) // count] for i in range(count)]


def run(engine: SpecEngine, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:
    """Greedy decoding of ``prompts`` in batches; pooled tau and per-step wall time."""
    steps = committed = 0
    taus, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        for result in engine.generate(prompts[i : i + batch], new_tokens, stop_token_ids=[]):
            stats = result.stats
            steps += stats.steps
            committed += sum((n + 1) * c for n, c in enumerate(stats.accept_hist))
            taus.append(round(stats.tau, 4))
    wall = time.perf_counter() - start
    return {
        "tau": round(committed / steps, 4),
        "steps": steps,
        "per_prompt_tau": taus,
        "wall_s": round(wall, 2),
    }


def calibrate(engine: SpecEngine, prompts: list[list[int]], new_tokens: int, batch: int):
    """Stage thresholds from the engine's DDTree steps on ``prompts``."""
    engine.confidence_log = []
    run(engine, prompts, new_tokens, batch)
    confidence = torch.cat([c for c, _ in engine.confidence_log])
    accept_len = torch.cat([a for _, a in engine.confidence_log])
    engine.confidence_log = None
    return calibrate_stage(confidence, accept_len, engine.stage), int(accept_len.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair-dir", type=Path, default=SMALL_PAIR_DIR)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--heldout-prompts", type=int, default=24)
    parser.add_argument("--train-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    device = torch.device(args.device)
    target, tokenizer = load_target(args.pair_dir / "target", device)
    drafter = load_drafter(args.pair_dir / "drafter", device, torch.float32)
    encode = lambda texts: [tokenizer(t)["input_ids"] for t in texts]  # noqa: E731
    heldout = encode(heldout_prompts(args.heldout_prompts))
    train = encode(training_prompts(args.train_prompts))
    build = (args.pair_dir / "BUILD.json").read_bytes()

    results = []
    for budget in args.budgets:
        calibrator = SpecEngine(target, drafter, "ddtree", budget=budget, stage=StageConfig())
        stage, calibration_steps = calibrate(calibrator, train, args.new_tokens, args.batch_size)
        row = {
            "budget": budget,
            "stage": {
                "depths": stage.depths,
                "thresholds": [round(t, 5) for t in stage.thresholds],
                "keep_fractions": [round(f, 4) for f in stage.keep_fractions],
                "calibration_steps": calibration_steps,
            },
        }
        for method in METHODS:
            engine = SpecEngine(target, drafter, method, budget=budget, stage=stage)
            row[method] = run(engine, heldout, args.new_tokens, args.batch_size)
            print(f"B={budget:3d} {method:22s} tau={row[method]['tau']:.3f}", flush=True)
        results.append(row)

    record = {
        "pair": str(args.pair_dir),
        "pair_build_sha256": hashlib.sha256(build).hexdigest(),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "heldout_prompts": len(heldout),
        "train_prompts": len(train),
        "new_tokens": args.new_tokens,
        "batch_size": args.batch_size,
        "greedy": True,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
