"""Retrieval templates over successor ranks (the stage policy's static Token Recycling shape).

A template is a tree of *rank paths* rooted at the bonus token: node ``(r_1, ..., r_d)`` is
retrieved as ``M[M[...M[root, r_1]...], r_d]``. With a per-rank acceptance probability ``a_r``
(the chance that rank ``r`` of an accepted token's row is the target's next token), the
surrogate of a rank path is ``prod_i a_{r_i}``, and the best-first template of ``T`` nodes is the
DDTree of a stationary lattice: every depth has the same ``k`` "tokens" (the ranks) with
log-probs ``log a_r``. So :func:`rank_template` is :func:`~sglang_tree_spec.tree.build_ddtree`
over that lattice. This gives Token Recycling's shape: higher ranks get wider, deeper subtrees,
the rank-0 chain is the deepest branch, and templates are nested (the first ``n`` nodes in
priority order are the best ``n``-node template), so one envelope serves every stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sglang_tree_spec.tree.ddtree import build_ddtree

# Static prior P(rank r of an accepted token's row is the target's next token), used by the
# stage policy's template and in the prior of the unified policy's edge estimate. A strong rank
# 0 makes the rank-0 chain the deepest branch: a 52-node, 9-deep template spreads 5 + 9 + 10 +
# 9 + 9 + 7 + 1 + 1 + 1 over its depths (the paper's hand-made d0 template: 8 + 10 + 8 + 6 +
# 5 + 4 + 4 + 4 + 3; a product of per-rank rates cannot keep width that deep).
DEFAULT_RANK_PRIOR = (0.75, 0.12, 0.07, 0.045, 0.03, 0.02, 0.014, 0.01)


@dataclass(frozen=True)
class RankTemplate:
    """A template of ``T`` rank-path nodes in breadth-first order. All tensors ``[T]`` int64.

    Attributes:
        ranks: the successor rank of each node in its parent's row.
        parents: template index of the parent, -1 under the root.
        depths: 1 .. max_depth.
        priority: position in best-first order (0 = best); a parent's is below its children's.
        valid: bool, false for padding (when the rank lattice has fewer than ``T`` paths).
    """

    ranks: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    priority: torch.Tensor
    valid: torch.Tensor

    @property
    def size(self) -> int:
        return self.ranks.shape[0]


def best_first_position(scores: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` position of each entry in (score descending, index ascending) order.

    On a breadth-first tree whose children never score above their parents, this order is
    prefix closed: every node comes after its parent.
    """
    order = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices  # -0.0 ties 0.0
    position = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, position)


def rank_template(rank_probs: torch.Tensor, size: int, max_depth: int) -> RankTemplate:
    """The best-first template of ``size`` nodes at most ``max_depth`` deep.

    Args:
        rank_probs: ``[k]`` acceptance probability of each rank, in (0, 1], any order.
    """
    k = rank_probs.shape[0]
    log_probs, ranks = torch.sort(rank_probs.float().log(), descending=True)
    lattice_lp = log_probs.expand(1, max_depth, k)
    tree = build_ddtree(lattice_lp, ranks.expand(1, max_depth, k), size, validate=False)
    return RankTemplate(
        ranks=tree.tokens[0],
        parents=tree.parents[0],
        depths=tree.depths[0],
        priority=best_first_position(tree.logprobs[0]),
        valid=tree.valid[0],
    )


@functools.cache
def static_template(size: int, max_depth: int, k: int, device: torch.device) -> RankTemplate:
    """:func:`rank_template` of the static prior (:func:`static_template_prior`), cached."""
    return rank_template(static_template_prior(k).to(device), size, max_depth)


def static_template_prior(k: int) -> torch.Tensor:
    """``[k]`` float32 :data:`DEFAULT_RANK_PRIOR`, extended geometrically past its length."""
    prior = list(DEFAULT_RANK_PRIOR[:k])
    while len(prior) < k:
        prior.append(prior[-1] * 0.7)
    return torch.tensor(prior)
