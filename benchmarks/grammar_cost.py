"""Benchmark: the host cost of masking a tree verify by each request's grammar (plugin/grammar.py).

Per decode step a constrained batch pays: the slots' parents from the layout, one depth-first
walk per constrained request (xgrammar's matcher advanced and rolled back along every path, a
bitmask row filled per reached slot) and the masking of the ``[bs * W, V]`` logits. Timed here
on CPU with SGLang's xgrammar backend on the small pair's tokenizer (V 2048) and a JSON schema,
at bs 1 and 16 and budgets 8 and 32, every request constrained, on trees whose every node the
grammar allows (each slot's first two allowed tokens as its children, breadth first): the walk
reaches all ``B + 1`` slots, its most expensive case.

    python benchmarks/grammar_cost.py --out benchmarks/results/grammar_cost_cpu.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, command_line, environment, portable

from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR
from sglang_tree_spec.plugin.grammar import (
    apply_token_bitmask,
    bitmask_words,
    slot_parents,
    tree_token_bitmask,
)
from sglang_tree_spec.tree import build_verify_layout
from sglang_tree_spec.tree.ddtree import DraftTree

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}
CHILDREN = 2  # allowed children per slot of the benchmark trees


def allowed(row: torch.Tensor, vocab: int, count: int) -> list[int]:
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().view(-1)[:count].tolist()


def on_grammar_tree(grammar, vocab: int, budget: int) -> DraftTree:
    """A tree of ``budget`` nodes the grammar allows throughout (breadth first)."""
    row = torch.full((1, bitmask_words(vocab)), -1, dtype=torch.int32)
    paths, tokens, parents, depths = [[]], [], [], []
    queue = [0]
    while queue and len(tokens) < budget:
        slot = queue.pop(0)
        for token in paths[slot]:
            grammar.accept_token(token)
        grammar.fill_vocab_mask(row, 0)
        if paths[slot]:
            grammar.rollback(len(paths[slot]))
        for token in allowed(row[0], vocab, CHILDREN):
            if len(tokens) == budget:
                break
            tokens.append(token)
            parents.append(slot - 1)
            depths.append(len(paths[slot]) + 1)
            paths.append([*paths[slot], token])
            queue.append(len(paths) - 1)
    n = len(tokens)
    return DraftTree(
        tokens=torch.tensor([tokens]),
        parents=torch.tensor([parents]),
        depths=torch.tensor([depths]),
        logprobs=torch.zeros(1, n),
        valid=torch.ones(1, n, dtype=torch.bool),
        max_depth=max(depths),
    )


def batched(tree: DraftTree, bs: int) -> DraftTree:
    return DraftTree(
        *(t.repeat(bs, 1) for t in (tree.tokens, tree.parents, tree.depths, tree.logprobs)),
        valid=tree.valid.repeat(bs, 1),
        max_depth=tree.max_depth,
    )


def time_step(grammars, layout, prefix, vocab, repeats) -> dict[str, float]:
    """Median seconds of each part of one step's grammar work."""
    parts = {"parents": [], "walk": [], "apply": []}
    bs, window = layout.tokens.shape
    for _ in range(repeats):
        logits = torch.randn(bs * window, vocab)
        start = time.perf_counter()
        parents = slot_parents(layout.ancestor_mask, layout.positions - prefix)
        mid = time.perf_counter()
        mask = tree_token_bitmask(grammars, layout.tokens, parents, vocab)
        walked = time.perf_counter()
        apply_token_bitmask(logits, mask)
        end = time.perf_counter()
        parts["parents"].append(mid - start)
        parts["walk"].append(walked - mid)
        parts["apply"].append(end - walked)
    return {name: statistics.median(values) for name, values in parts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (host work)")
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar_cost_cpu.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoTokenizer

    target = SMALL_PAIR_DIR / "target"
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    backend = XGrammarGrammarBackend(AutoTokenizer.from_pretrained(target), vocab_size=vocab)
    grammar = backend.dispatch_json(json.dumps(SCHEMA))
    env = environment("cpu")  # the load before the run
    torch.manual_seed(0)
    rows = []
    for budget in args.budgets:
        tree = on_grammar_tree(grammar, vocab, budget)
        for bs in args.batch_sizes:
            trees = batched(tree, bs)
            prefix = torch.full((bs,), 40)
            layout = build_verify_layout(trees, torch.zeros(bs, dtype=torch.long), prefix)
            grammars = [grammar.copy() for _ in range(bs)]
            parts = time_step(grammars, layout, prefix[:, None], vocab, args.repeats)
            total = sum(parts.values())
            nodes = bs * (budget + 1)
            rows.append((bs, budget, tree.max_depth, parts, total, total / nodes))
            print(f"bs {bs} B {budget}: {1e3 * total:.2f} ms a step", flush=True)
    lines = [
        "# Grammar masking cost per decode step (CPU)",
        "",
        f"`{portable(command_line('benchmarks/grammar_cost.py', argv))}`",
        "",
        f"Code {env['code']}; torch {env['torch']}; {env['platform']}; {env['torch_threads']}"
        f" torch threads; load average {env['load_average_before']}. JSON schema through"
        f" SGLang's xgrammar backend, small pair tokenizer (V {vocab}); every request"
        f" constrained, every tree node on the grammar ({CHILDREN} allowed children a slot,"
        f" breadth first): the walk's worst case. Medians of {args.repeats} steps.",
        "",
        "| bs | budget | tree depth | parents (ms) | walk (ms) | apply mask (ms) | total (ms) |"
        " per slot (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for bs, budget, depth, parts, total, per in rows:
        lines.append(
            f"| {bs} | {budget} | {depth} | {1e3 * parts['parents']:.3f} |"
            f" {1e3 * parts['walk']:.3f} | {1e3 * parts['apply']:.3f} | {1e3 * total:.3f} |"
            f" {1e6 * per:.1f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
