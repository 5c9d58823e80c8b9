"""Tree demo: what DDTree buys over a single drafted chain, on embedded draft marginals.

No model needed. The embedded default stands in for one DFlash drafter forward: 15 positions
whose confidence decays with depth, over a 32k vocabulary. For each budget the demo builds the
optimal tree, reports the surrogate expected accepted length (1 + sum of node probabilities, the
bonus included) next to the chain's, and checks it by simulation: continuations are sampled
from the same marginals and verified with ``greedy_accept`` exactly as a target would be.
"""

from __future__ import annotations

import time

import torch

from sglang_tree_spec.tree import (
    DraftTree,
    build_chain,
    build_ddtree,
    greedy_accept,
    topk_from_logits,
)

DEPTH = 15
VOCAB = 32_000
TOPK = 64


def embedded_marginals(seed: int = 0) -> torch.Tensor:
    """``[1, 15, 32000]`` draft logits: sharp near the root, flatter with depth."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, DEPTH, VOCAB, generator=gen)
    sharpness = torch.linspace(7.0, 3.5, DEPTH).view(1, DEPTH, 1)
    return logits * sharpness


def simulated_tau(tree: DraftTree, logits: torch.Tensor, samples: int, seed: int) -> float:
    """Mean tokens committed per step (bonus included) when the target's continuation is drawn
    from the draft marginals themselves, so the surrogate is the truth."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(logits[0].double(), dim=-1)  # [L, V]
    continuation = torch.stack(
        [
            torch.multinomial(probs[d], samples, replacement=True, generator=gen)
            for d in range(DEPTH)
        ],
        dim=1,
    )  # [samples, L]: y_1..y_L
    # The target's argmax at a slot of depth d is y_{d+1}; at depth L it is irrelevant.
    batch = DraftTree(*(t.expand(samples, -1) for t in _tensors(tree)), max_depth=tree.max_depth)
    slot_depths = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths[0]])
    target_argmax = continuation[:, slot_depths.clamp_max(DEPTH - 1)]
    result = greedy_accept(batch, target_argmax)
    return float((result.accept_len + 1).double().mean())


def _tensors(tree: DraftTree) -> tuple[torch.Tensor, ...]:
    return tree.tokens, tree.parents, tree.depths, tree.logprobs, tree.valid


def render(tree: DraftTree, max_lines: int = 24) -> list[str]:
    """ASCII drawing of request 0's tree, children in order, with node probabilities."""
    children: dict[int, list[int]] = {}
    for i in range(tree.budget):
        if tree.valid[0, i]:
            children.setdefault(int(tree.parents[0, i]), []).append(i)
    lines = ["(bonus)"]

    def walk(node: int, indent: str) -> None:
        kids = children.get(node, [])
        for n, child in enumerate(kids):
            last = n == len(kids) - 1
            p = float(tree.logprobs[0, child].exp())
            lines.append(
                f"{indent}{'└─' if last else '├─'} t{int(tree.tokens[0, child])} ({p:.3f})"
            )
            walk(child, indent + ("   " if last else "│  "))

    walk(-1, "")
    if len(lines) > max_lines:
        lines = [*lines[: max_lines - 1], f"... ({len(lines) - max_lines + 1} more lines)"]
    return lines


def run(budgets: tuple[int, ...] = (16, 64, 256), samples: int = 4000, seed: int = 0) -> None:
    logits = embedded_marginals(seed)
    topk_logprobs, topk_tokens = topk_from_logits(logits, TOPK)
    chain = build_chain(topk_logprobs, topk_tokens)
    chain_surrogate = 1.0 + float(chain.logprobs.exp().sum())
    chain_sim = simulated_tau(chain, logits, samples, seed)
    print(f"embedded draft marginals: L={DEPTH} positions, V={VOCAB}, top-K={TOPK}")
    print("tau = expected tokens committed per verify step, bonus included\n")
    header = (
        f"{'tree':<10} {'nodes':>5} {'depth':>5} {'tau (surrogate)':>16} {'tau (simulated)':>16}"
    )
    print(header)
    print(f"{'chain':<10} {DEPTH:>5} {DEPTH:>5} {chain_surrogate:>16.3f} {chain_sim:>16.3f}")
    for budget in budgets:
        start = time.perf_counter()
        tree = build_ddtree(topk_logprobs, topk_tokens, budget, vocab_size=VOCAB)
        build_ms = (time.perf_counter() - start) * 1e3
        surrogate = 1.0 + float(tree.logprobs.exp().sum())
        sim = simulated_tau(tree, logits, samples, seed)
        depth = int(tree.depths.max())
        print(
            f"{f'ddtree-{budget}':<10} {budget:>5} {depth:>5} {surrogate:>16.3f} {sim:>16.3f}"
            f"   ({surrogate / chain_surrogate:.2f}x chain, built in {build_ms:.1f} ms)"
        )
    print(f"\noptimal {budgets[0]}-node tree:")
    print("\n".join(render(build_ddtree(topk_logprobs, topk_tokens, budgets[0]))))
