"""The acceptance surrogate for every candidate budget from ONE DDTree build.

Under the drafter's factorised distribution Q = prod_d q_d, the expected number of accepted draft
tokens of a prefix-closed tree T is sum_{u in T} q(u) (DDTree Prop. 1; BASTION Prop. 2.2): the
walk accepts a depth-d node u exactly when the target's first d tokens equal u's path, and those
events are disjoint across the nodes of one depth. DDTree's tree at budget B is nested: its first
N nodes BY SCORE (score descending, ties toward shallower) are the optimal N-tree. Slots are in
breadth-first order, not score order, so the nodes are ranked once (a stable sort of the slots by
score: breadth-first slots make ties go to the shallower node, as the builder ranks them) and
the prediction for every budget N is a prefix sum over the ranked probabilities.

Everything here is batched, fixed-shape and sync-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_tree_spec.config import DEFAULT_BUDGETS, candidate_budgets  # noqa: F401 (API)
from sglang_tree_spec.tree.ddtree import DraftTree


@dataclass(frozen=True)
class RankedNodes:
    """A batch of trees' nodes in score order (the nesting order).

    Attributes:
        probs: ``[bs, B]`` float32 node path probabilities q(u), descending; 0 for padding.
        depths: ``[bs, B]`` int64 depth (1..L) of each ranked node; padding keeps depth 1.
        slots: ``[bs, B]`` int64 the node's slot in the breadth-first tree.
    """

    probs: torch.Tensor
    depths: torch.Tensor
    slots: torch.Tensor


def rank_nodes(logprobs: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor) -> RankedNodes:
    """Sort a tree's nodes by score, descending, ties toward the lower (shallower) slot.

    Args:
        logprobs: ``[bs, B]`` path log-probabilities (``DraftTree.logprobs``).
        depths: ``[bs, B]`` int64 node depths (``DraftTree.depths``).
        valid: ``[bs, B]`` bool (``DraftTree.valid``).
    """
    score = torch.where(valid, logprobs.float(), float("-inf"))  # [bs, B]
    sorted_score, slots = torch.sort(score, dim=1, descending=True, stable=True)
    return RankedNodes(
        probs=sorted_score.exp(),  # exp(-inf) = 0 for padding
        depths=depths.gather(1, slots),
        slots=slots,
    )


def budget_index(budgets: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """``[C]`` int64 tensor of the candidate budgets (gather indices into a prefix sum)."""
    return torch.tensor(budgets, dtype=torch.long, device=device)


def prefix_sums_at(weights: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Sum of the first N ranked weights for every N in ``budgets``.

    Args:
        weights: ``[bs, B]`` per ranked node (probabilities, or calibrated probabilities).
        budgets: ``[C]`` int64 candidate budgets; budgets above B read the whole tree.

    Returns:
        ``[bs, C]`` float32; column c is sum_{j < budgets[c]} weights[:, j] (0 for budget 0).
    """
    csum = torch.nn.functional.pad(weights.cumsum(dim=1), (1, 0))  # [bs, B + 1]
    return csum.index_select(1, budgets.clamp(max=weights.shape[1]))


def expected_accept(tree: DraftTree, budgets: tuple[int, ...]) -> torch.Tensor:
    """Uncalibrated surrogate: expected accepted draft tokens (bonus excluded) per budget.

    Returns:
        ``[bs, C]`` float32; the expected committed tokens of budget N are 1 + this.
    """
    ranked = rank_nodes(tree.logprobs, tree.depths, tree.valid)
    return prefix_sums_at(ranked.probs, budget_index(budgets, tree.device))


def top_nodes(tree: DraftTree, n: int, ranked_slots: torch.Tensor | None = None) -> DraftTree:
    """The optimal ``n``-node tree inside a larger DDTree: its first ``n`` nodes by score.

    Equal to ``build_ddtree(..., budget=n)`` on the same inputs (nesting), without a second
    build: the kept nodes are prefix closed (a child never outranks its parent) and keep their
    breadth-first order; parents are renumbered. Sync-free, ``[bs, n]`` tensors.
    ``ranked_slots``: ``[bs, B]`` the tree's :func:`rank_nodes` slots when already ranked.
    """
    bs, b = tree.tokens.shape
    if not 1 <= n <= b:
        raise ValueError(f"n must be in 1..{b}, got {n}")
    if n == b:
        return tree
    if ranked_slots is None:
        ranked_slots = rank_nodes(tree.logprobs, tree.depths, tree.valid).slots
    keep = torch.zeros(bs, b, dtype=torch.bool, device=tree.device)
    keep.scatter_(1, ranked_slots[:, :n], True)  # [bs, B], n per row
    new_slot = keep.long().cumsum(dim=1) - 1  # [bs, B] index among kept nodes
    # Kept slots in breadth-first order: the k-th kept slot is where new_slot == k.
    order = torch.where(keep, new_slot, n)  # dropped slots to a spill column
    old_of_new = torch.zeros(bs, n + 1, dtype=torch.long, device=tree.device)
    old_of_new.scatter_(1, order, torch.arange(b, device=tree.device).expand(bs, b))
    old = old_of_new[:, :n]  # [bs, n] old slot of each new node

    def take(x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, old)

    parents_old = take(tree.parents)  # [bs, n], -1 for depth-1 nodes
    parents = torch.where(
        parents_old >= 0, new_slot.gather(1, parents_old.clamp(min=0)), parents_old
    )
    return DraftTree(
        tokens=take(tree.tokens),
        parents=parents,
        depths=take(tree.depths),
        logprobs=take(tree.logprobs),
        valid=take(tree.valid),
        max_depth=tree.max_depth,
    )
