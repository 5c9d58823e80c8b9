"""Benchmark: the host-side cost of a decode step's tree work, before and after the shared step.

Times what a step spends outside the two model forwards (select + graft + layout + accept) on
synthetic drafter top-K and target logits, at bs 1 and 16, B 16 and 64, for DDTree and for
unified grafting, in alternating blocks of warm calls in one run:

* ``before`` -- the work the pre-shared-step code did (main at 77a34e2): the unified policy
  built a full DDTree and discarded it, and the verify layout also built SGLang's EAGLE
  retrieve arrays, which nothing on the serving path read;
* ``after`` -- :func:`sglang_tree_spec.step` 's selectors and the lean layout.

Both sides run the same acceptance and the same pruned host builder (CPU). Greedy acceptance
is checked to commit the same tokens on both sides.

    python benchmarks/step_overhead.py --out benchmarks/results/step_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import RESULTS, command_line, environment, paired_medians, portable_record

from sglang_tree_spec.config import TreeConfig
from sglang_tree_spec.graft import EdgeAcceptance, SuccessorTable, graft_unified
from sglang_tree_spec.step import make_selector
from sglang_tree_spec.tree import (
    build_ddtree,
    build_verify_layout,
    eagle_retrieve_arrays,
    greedy_accept,
)

DEPTH, VOCAB = 15, 2048  # the small pair's drafter block (16) and vocabulary


def inputs(bs: int, budget: int, seed: int) -> dict[str, torch.Tensor]:
    """Drafter top-K ``[bs, L, B]``, roots, prefix lengths and target argmax ``[bs, B + 1]``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, DEPTH, VOCAB, generator=gen) * 4.0
    lp, tok = torch.log_softmax(logits, dim=-1).topk(budget, dim=-1)
    return {
        "lp": lp,
        "tok": tok,
        "roots": torch.randint(0, VOCAB, (bs,), generator=gen),
        "prefix": torch.randint(50, 500, (bs,), generator=gen),
        "argmax": tok[:, :, 0].repeat(1, -(-(budget + 1) // DEPTH))[:, : budget + 1],
    }


def warm_table(k: int = 8) -> SuccessorTable:
    table = SuccessorTable(VOCAB, k, "cpu")
    gen = torch.Generator().manual_seed(0)
    table.observe(torch.randint(0, VOCAB, (4, 4096), generator=gen))
    return table


def before_step(policy: str, budget: int, x: dict, table, edges) -> torch.Tensor:
    """Select + layout + accept as the code before the shared step did it."""
    tree = build_ddtree(x["lp"], x["tok"], budget, validate=False, prune=True)
    if policy == "unified":
        tree = graft_unified(tree.budget, x["lp"], x["tok"], x["roots"], table, edges)
    layout = build_verify_layout(tree, x["roots"], x["prefix"])
    eagle_retrieve_arrays(tree)  # the old layout built these every step
    return greedy_accept(tree, x["argmax"]).committed_tokens, layout


def after_step(selector, budget: int, x: dict) -> torch.Tensor:
    tree = selector.select(x["lp"], x["tok"], x["roots"], budget)
    layout = build_verify_layout(tree, x["roots"], x["prefix"])
    return greedy_accept(tree, x["argmax"]).committed_tokens, layout


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="alternating blocks")
    parser.add_argument("--block", type=int, default=10, help="warm calls per block")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_overhead_cpu.json")
    args = parser.parse_args(argv)
    env = environment("cpu")
    rows = []
    print(f"{'policy':8s} {'bs':>3} {'B':>3} {'before ms':>10} {'after ms':>9} {'ratio':>6}")
    for policy in ("ddtree", "unified"):
        for bs in (1, 16):
            for budget in (16, 64):
                x = inputs(bs, budget, seed=bs * 100 + budget)
                table, edges = warm_table(), EdgeAcceptance(8)
                graft = "unified" if policy == "unified" else "none"
                selector = make_selector(TreeConfig(budget=budget, graft=graft), VOCAB, "cpu")
                if policy == "unified":
                    selector.successors, selector.edge_acceptance = table, edges
                old = before_step(policy, budget, x, table, edges)[0]
                new = after_step(selector, budget, x)[0]
                if not torch.equal(old, new):
                    raise AssertionError(f"{policy} bs={bs} B={budget}: committed tokens differ")
                before_ms, after_ms, ratio = paired_medians(
                    lambda x=x, b=budget, p=policy, t=table, e=edges: before_step(p, b, x, t, e),
                    lambda x=x, b=budget, s=selector: after_step(s, b, x),
                    args.repeats,
                    args.block,
                    "cpu",
                )
                rows.append(
                    {
                        "policy": policy,
                        "bs": bs,
                        "budget": budget,
                        "before_ms": round(before_ms, 3),
                        "after_ms": round(after_ms, 3),
                        "before_over_after": round(ratio, 3),
                    }
                )
                print(
                    f"{policy:8s} {bs:3d} {budget:3d} {before_ms:10.3f} {after_ms:9.3f} "
                    f"{ratio:6.2f}",
                    flush=True,
                )
    record = {
        "command": command_line("benchmarks/step_overhead.py", argv),
        "env": env,
        "settings": {"depth": DEPTH, "vocab": VOCAB, "repeats": args.repeats, "block": args.block},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = portable_record(record)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
