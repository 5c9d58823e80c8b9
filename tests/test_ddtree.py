"""DDTree selection: optimality, structure, nesting, agreement with the paper's heap, errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tree_helpers import assert_well_formed, node_paths, random_marginals

from sglang_tree_spec.tree import (
    build_ddtree,
    build_ddtree_reference,
    topk_from_logits,
)

FIELDS = ("tokens", "parents", "depths", "logprobs", "valid")


def lattice_prefixes(lp: torch.Tensor, tok: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every prefix of one request's top-K lattice with its probability (float64)."""
    depth, k = lp.shape
    out: dict[tuple[int, ...], float] = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            tokens = tuple(int(tok[i, r]) for i, r in enumerate(ranks))
            out[tokens] = math.exp(sum(float(lp[i, r]) for i, r in enumerate(ranks)))
    return out


def best_valid_tree_value(probs: dict[tuple[int, ...], float], budget: int) -> float:
    """Max surrogate sum over ALL prefix-closed node sets of size <= budget (brute force)."""
    prefixes = list(probs)
    best = 0.0
    for size in range(1, budget + 1):
        for subset in itertools.combinations(prefixes, size):
            chosen = set(subset)
            if all(p[:-1] in chosen for p in chosen if len(p) > 1):
                best = max(best, sum(probs[p] for p in chosen))
    return best


@pytest.mark.parametrize(
    ("depth", "k", "budget"),
    [(1, 3, 2), (2, 2, 3), (3, 2, 4), (3, 2, 6), (2, 3, 5), (4, 2, 5)],
)
def test_optimal_against_all_valid_trees(depth, k, budget):
    """Brute force over every prefix-closed node set: the built tree attains the optimum."""
    for seed in range(3):
        lp, tok = random_marginals(2, depth, k, vocab=7, seed=seed, sharpness=1.5)
        tree = build_ddtree(lp, tok, budget)
        assert_well_formed(tree, lp, tok)
        for b in range(2):
            probs = lattice_prefixes(lp[b], tok[b])
            got = tree.logprobs[b][tree.valid[b]].double().exp().sum().item()
            assert got == pytest.approx(best_valid_tree_value(probs, budget), rel=1e-5)


@pytest.mark.parametrize(("depth", "k"), [(3, 3), (4, 2), (2, 5)])
def test_node_set_is_the_most_probable_prefixes(depth, k):
    lp, tok = random_marginals(3, depth, k, vocab=9, seed=depth * 10 + k)
    lattice_size = sum(k**d for d in range(1, depth + 1))
    for budget in (1, 2, 5, lattice_size - 1, lattice_size, lattice_size + 4):
        tree = build_ddtree(lp, tok, budget)
        assert_well_formed(tree, lp, tok)
        for b in range(3):
            probs = lattice_prefixes(lp[b], tok[b])
            expected = sorted(probs, key=lambda p: (-probs[p], len(p)))[:budget]
            paths = node_paths(
                tree.parents[b].tolist(), tree.tokens[b].tolist(), tree.valid[b].tolist()
            )
            assert set(paths[: min(budget, lattice_size)]) == set(expected)
            assert int(tree.valid[b].sum()) == min(budget, lattice_size)


@pytest.mark.parametrize("k", [8, 32])
@pytest.mark.parametrize("budget", [16, 64, 256, 1024])
def test_matches_heap_at_realistic_sizes(k, budget):
    lp, tok = random_marginals(2, 15, k, vocab=200, seed=budget + k, sharpness=2.5)
    fast = build_ddtree(lp, tok, budget, vocab_size=200)
    heap = build_ddtree_reference(lp, tok, budget, vocab_size=200)
    for field in FIELDS:
        assert torch.equal(getattr(fast, field), getattr(heap, field)), field
    assert fast.max_depth == heap.max_depth == 15


@pytest.fixture(params=[False, True], ids=["fixed-shape", "pruned"])
def beam_mode(request):
    """``prune`` for both beam loops: the pruned one stops at the first hopeless depth, the
    fixed-shape one runs every depth."""
    return request.param


def test_both_beam_loops_agree_with_heap(beam_mode):
    for budget, sharpness in [(64, 4.0), (256, 1.0), (256, 8.0), (1024, 3.0)]:
        lp, tok = random_marginals(3, 15, 64, vocab=300, seed=budget, sharpness=sharpness)
        fast = build_ddtree(lp, tok, budget, prune=beam_mode)
        heap = build_ddtree_reference(lp, tok, budget)
        for field in FIELDS:
            assert torch.equal(getattr(fast, field), getattr(heap, field)), field


def test_host_loop_skips_what_cannot_enter():
    """Host tensors take the pruned loop: far fewer beam entries than the fixed-shape loop
    (fewer depths, narrower blocks), and the same tree field for field."""
    from sglang_tree_spec.tree import ddtree

    lp, tok = random_marginals(4, 15, 64, vocab=4096, seed=3, sharpness=4.0)
    pruned = ddtree._host_beams(lp.float(), 256)
    fixed = ddtree._fixed_beams(lp.float(), 256)
    assert fixed.scores.shape[1] == 256 + 14 * 255
    assert pruned.scores.shape[1] < fixed.scores.shape[1] // 2
    assert int(pruned.layout.depths.max()) < 14
    tree = build_ddtree(lp, tok, 256, prune=True)
    heap = build_ddtree_reference(lp, tok, 256)
    for field in FIELDS:
        assert torch.equal(getattr(tree, field), getattr(heap, field)), field


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_tied_scores_keep_the_optimal_multiset(beam_mode, k):
    """Log-probs on a coarse grid tie often: every budget still gets a well-formed tree whose
    (score, depth) multiset is the heap's, i.e. the candidate pruning never loses a node that
    only a tie separates from the answer."""
    for seed in range(4):
        lp, tok = random_marginals(3, 6, k, vocab=12, seed=seed, sharpness=1.0)
        lp = (lp * 2).round() / 2  # steps of 0.5 nats: many exact ties, still sorted
        for budget in (1, 2, 3, 4, 5, 7, 9, 16, 33):
            tree = build_ddtree(lp, tok, budget, prune=beam_mode)
            heap = build_ddtree_reference(lp, tok, budget)
            assert_well_formed(tree, lp, tok)
            for b in range(3):
                got = sorted(zip(tree.logprobs[b].tolist(), tree.depths[b].tolist(), strict=True))
                want = sorted(zip(heap.logprobs[b].tolist(), heap.depths[b].tolist(), strict=True))
                assert got == want, (seed, budget, b)


def test_well_formed_at_realistic_size():
    lp, tok = random_marginals(2, 15, 32, vocab=100, seed=5)
    tree = build_ddtree(lp, tok, 256)
    assert_well_formed(tree, lp, tok)
    assert tree.valid.all()


def test_k_above_budget_is_truncated_exactly():
    lp, tok = random_marginals(2, 6, 40, vocab=60, seed=2)
    a = build_ddtree(lp, tok, 8)
    b = build_ddtree(lp[..., :8], tok[..., :8], 8)
    for field in FIELDS:
        assert torch.equal(getattr(a, field), getattr(b, field))


@pytest.mark.parametrize("small", [1, 5, 17, 63])
def test_nested(small):
    """The first N nodes by (score, depth) of a B-tree are the optimal N-tree."""
    lp, tok = random_marginals(3, 15, 16, vocab=50, seed=small)
    big = build_ddtree(lp, tok, 64)
    little = build_ddtree(lp, tok, small)
    for b in range(3):
        big_paths = node_paths(
            big.parents[b].tolist(), big.tokens[b].tolist(), big.valid[b].tolist()
        )
        order = sorted(range(64), key=lambda i: (-big.logprobs[b, i].item(), len(big_paths[i])))
        best_of_big = {big_paths[i] for i in order[:small]}
        little_paths = node_paths(
            little.parents[b].tolist(), little.tokens[b].tolist(), little.valid[b].tolist()
        )
        assert set(little_paths) == best_of_big
        assert all(p[:-1] in best_of_big for p in best_of_big if len(p) > 1)


def test_batch_rows_are_independent():
    lp, tok = random_marginals(4, 10, 8, vocab=30, seed=9)
    together = build_ddtree(lp, tok, 40)
    for b in range(4):
        alone = build_ddtree(lp[b : b + 1], tok[b : b + 1], 40)
        for field in FIELDS:
            assert torch.equal(getattr(together, field)[b], getattr(alone, field)[0])


def test_ties_go_to_shallower_nodes(beam_mode):
    # Depth 1: two tokens at 0.5; depth 2: one token at probability 1 (log 0).
    lp = torch.tensor([[[math.log(0.5), math.log(0.5)], [0.0, float("-inf")]]])
    tok = torch.tensor([[[3, 4], [5, 6]]])
    tree = build_ddtree(lp, tok, 2, prune=beam_mode)
    assert tree.depths[0].tolist() == [1, 1]
    assert sorted(tree.tokens[0].tolist()) == [3, 4]
    tree3 = build_ddtree(lp, tok, 3, prune=beam_mode)
    assert tree3.depths[0].tolist() == [1, 1, 2]
    assert tree3.tokens[0, 2].item() == 5
    heap = build_ddtree_reference(lp, tok, 3)
    assert torch.equal(tree3.depths, heap.depths)


def test_negative_zero_scores_keep_the_tree_prefix_closed(beam_mode):
    # -0.0 + 0.0 = +0.0: a child can carry +0.0 under a -0.0 parent; they must tie.
    lp = torch.tensor([[[-0.0], [0.0]]])
    tok = torch.tensor([[[1], [2]]])
    tree = build_ddtree(lp, tok, 1, prune=beam_mode)
    assert tree.depths.tolist() == [[1]] and tree.tokens.tolist() == [[1]]


def test_zero_probability_nodes_stay_valid_and_rank_last():
    lp = torch.tensor([[[0.0, float("-inf")], [math.log(0.9), math.log(0.1)]]])
    tok = torch.tensor([[[1, 2], [3, 4]]])
    tree = build_ddtree(lp, tok, 6)  # lattice: 2 + 4 = 6 prefixes
    assert tree.valid.all()
    assert_well_formed(tree, lp, tok)
    paths = node_paths(tree.parents[0].tolist(), tree.tokens[0].tolist(), [True] * 6)
    scores = tree.logprobs[0].tolist()
    positive = {path for path, lp_ in zip(paths, scores, strict=True) if lp_ > -1e29}
    assert positive == {(1,), (1, 3), (1, 4)}
    # The floored prefixes tie (-1e30 absorbs the rest), so only the node set is defined.
    assert set(paths) == {(1,), (2,), (1, 3), (1, 4), (2, 3), (2, 4)}


def test_lattice_smaller_than_budget_pads_at_the_end(beam_mode):
    lp, tok = random_marginals(2, 2, 2, vocab=5, seed=0)
    tree = build_ddtree(lp, tok, 10, prune=beam_mode)
    assert tree.valid.sum(dim=1).tolist() == [6, 6]
    assert_well_formed(tree, lp, tok)
    heap = build_ddtree_reference(lp, tok, 10)
    for field in FIELDS:
        assert torch.equal(getattr(tree, field), getattr(heap, field))


def test_half_precision_inputs():
    lp, tok = random_marginals(2, 8, 8, vocab=40, seed=4)
    tree = build_ddtree(lp.to(torch.bfloat16), tok.to(torch.int32), 32)
    assert tree.tokens.dtype == torch.long
    assert tree.valid.all()
    assert_well_formed(tree, lp.to(torch.bfloat16).float(), tok)


def test_topk_from_logits():
    logits = torch.randn(2, 3, 11)
    lp, tok = topk_from_logits(logits, 4)
    assert lp.shape == tok.shape == (2, 3, 4)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref.gather(-1, tok))
    assert (lp[..., 1:] <= lp[..., :-1]).all()
    with pytest.raises(ValueError, match="vocabulary"):
        topk_from_logits(logits, 12)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda lp, tok: (lp[0], tok[0], 4, None), r"\[bs, L, K\]"),
        (lambda lp, tok: (lp, tok[..., :2], 4, None), "same shape"),
        (lambda lp, tok: (lp, tok, 0, None), "budget"),
        (lambda lp, tok: (lp, tok, 2.0, None), "budget"),
        (lambda lp, tok: (lp, tok, True, None), "budget"),
        (lambda lp, tok: (tok, tok, 4, None), "floating point"),
        (lambda lp, tok: (lp, tok.float(), 4, None), "integer"),
        (lambda lp, tok: (lp.flip(-1), tok.flip(-1), 4, None), "sorted"),
        (lambda lp, tok: (lp, tok, 4, 2), "exceeds the vocabulary"),
        (lambda lp, tok: (lp, tok + 100, 4, 20), "outside the vocabulary"),
        (lambda lp, tok: (lp.abs(), tok, 4, None), "log-probabilities"),
        (lambda lp, tok: (torch.full_like(lp, float("nan")), tok, 4, None), "NaN"),
        (lambda lp, tok: (lp, torch.zeros_like(tok), 4, None), "repeats"),
        (lambda lp, tok: (lp[:, :0], tok[:, :0], 4, None), "empty"),
    ],
)
def test_bad_input_raises(mutate, message):
    lp, tok = random_marginals(2, 3, 3, vocab=20, seed=1)
    args = mutate(lp, tok)
    with pytest.raises(ValueError, match=message):
        build_ddtree(*args[:3], vocab_size=args[3])
    with pytest.raises(ValueError, match=message):
        build_ddtree_reference(*args[:3], vocab_size=args[3])
