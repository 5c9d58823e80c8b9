"""``top_nodes``: the first ``n`` nodes of a DDTree by score are the DDTree of budget ``n``."""

from __future__ import annotations

import math

import pytest
import torch
from tree_helpers import assert_well_formed, random_marginals

from sglang_tree_spec.control import expected_accept, top_nodes
from sglang_tree_spec.tree import build_ddtree

FIELDS = ("tokens", "parents", "depths", "logprobs", "valid")
CERTAIN = (0.0, math.log(1e-6), math.log(1e-7))  # rank 0 certain, the others distinct


def certain_marginals(seed: int, certain: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2, 5, 3]`` random top-K marginals, log-prob 0 for rank 0 at the ``certain`` depths
    (0-based): there a child ties its parent's score."""
    lp, tok = random_marginals(2, 5, 3, vocab=12, seed=seed, sharpness=1.0)
    lp = lp.clone()
    lp[:, list(certain)] = torch.tensor(CERTAIN)
    return lp, tok


@pytest.mark.parametrize("certain", [(1, 3), (0, 2), (4,)])
@pytest.mark.parametrize("seed", range(3))
def test_top_nodes_equal_the_ddtree_of_the_smaller_budget_when_children_tie(certain, seed):
    """Guards the nesting order's tie rule (score descending, then the shallower slot): when a
    child ties its parent at log-prob 0, ranking the deeper slot first keeps the child and
    drops its parent, an orphan that no DDTree contains, while the expected acceptance (a sum
    over the same scores) does not change. Ties between nodes of one depth under different
    parents are left out: there either node is optimal and the builder may take either."""
    lp, tok = certain_marginals(seed, certain)
    big = 40
    tree = build_ddtree(lp, tok, big)
    budgets = tuple(range(1, big))
    predicted = expected_accept(tree, budgets)
    for c, n in enumerate(budgets):
        sub = top_nodes(tree, n)
        exact = build_ddtree(lp, tok, n)
        for name in FIELDS:
            assert torch.equal(getattr(sub, name), getattr(exact, name)), (n, name)
        assert_well_formed(sub, lp, tok)
        mass = exact.logprobs.exp().where(exact.valid, 0).sum(dim=1)
        assert torch.allclose(predicted[:, c], mass, rtol=1e-5), n
