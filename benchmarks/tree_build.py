"""Benchmark: batched on-device DDTree builder vs the paper's per-request heap.

Both builders get the same draft marginals (L = 15 positions, K = min(B, 64) tokens each) and
produce the same trees (node scores and depths checked once per configuration). The heap runs
per request on the host, as the reference implementation does; the batched builder runs on
``--device``. Both run under ``torch.inference_mode()``, as in SGLang's scheduler loop.
They are timed in alternating blocks of ``--block`` back-to-back calls, ``--repeats`` blocks
each: a block's median times a builder warm (as a server calling it every step sees it) and
the alternation makes slow drift on a shared machine hit both alike. The table shows the
medians over blocks and the median of the per-block-pair ratios (``--block 1`` alternates
single calls, which charges each builder for the cache state the other left).

    python benchmarks/tree_build.py                      # CPU
    python benchmarks/tree_build.py --device cuda --out benchmarks/results/tree_build_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
from common import paired_medians, portable_record

from sglang_tree_spec.tree import build_ddtree, build_ddtree_reference

BATCH_SIZES = (1, 4, 16)
BUDGETS = (16, 64, 256, 1024)
DEPTH = 15
VOCAB = 4096


def draft_marginals(bs: int, k: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K ``[bs, L, K]`` of random per-position softmaxes with drafter-like confidence."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, DEPTH, VOCAB, generator=gen) * 4.0
    lp, tok = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return lp.to(device), tok.to(device)


def run(device: str, repeats: int, block: int) -> list[dict]:
    rows = []
    prune = device == "cpu"  # the builder the serving path picks on host tensors
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'bs':>3} {'B':>5} {'K':>3} {'heap ms':>9} {'batched ms':>11} {'ratio':>7}")
    for bs in BATCH_SIZES:
        for budget in BUDGETS:
            k = min(budget, 64)
            lp, tok = draft_marginals(bs, k, device, seed=bs * 10_000 + budget)
            fast = build_ddtree(lp, tok, budget, validate=False, prune=prune)
            heap = build_ddtree_reference(lp, tok, budget, validate=False)
            # Same node multiset (exact float ties within a depth may be ordered differently).
            if not torch.equal(
                fast.logprobs.sort(dim=1).values, heap.logprobs.sort(dim=1).values
            ) or not torch.equal(fast.depths.sort(dim=1).values, heap.depths.sort(dim=1).values):
                raise AssertionError(f"builders disagree at bs={bs} B={budget}")
            heap_ms, fast_ms, ratio = paired_medians(
                lambda lp=lp, tok=tok, budget=budget: build_ddtree_reference(
                    lp, tok, budget, validate=False
                ),
                lambda lp=lp, tok=tok, budget=budget: build_ddtree(
                    lp, tok, budget, validate=False, prune=prune
                ),
                repeats,
                block,
                device,
            )
            print(f"{bs:>3} {budget:>5} {k:>3} {heap_ms:>9.3f} {fast_ms:>11.3f} {ratio:>6.1f}x")
            rows.append(
                {
                    "bs": bs,
                    "budget": budget,
                    "k": k,
                    "depth": DEPTH,
                    "heap_ms": heap_ms,
                    "batched_ms": fast_ms,
                    "heap_over_batched": ratio,
                }
            )
    return rows


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=21, help="blocks per builder")
    parser.add_argument("--block", type=int, default=5, help="back-to-back calls per block")
    parser.add_argument("--out", type=Path, help="write the rows and environment as JSON")
    args = parser.parse_args()
    if args.repeats < 1 or args.block < 1:
        parser.error("--repeats and --block must be >= 1")
    rows = run(args.device, args.repeats, args.block)
    if args.out:
        env = {
            "device": args.device,
            "device_name": torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "block": args.block,
            "load_average_1_5_15min": os.getloadavg(),  # other work sharing the machine
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(portable_record({"env": env, "rows": rows}), indent=2) + "\n"
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
