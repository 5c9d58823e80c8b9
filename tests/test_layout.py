"""Verify layout: ancestor mask, positions, EAGLE retrieve arrays and the flat FULL_MASK."""

from __future__ import annotations

import pytest
import torch
from tree_helpers import random_marginals

from sglang_tree_spec.tree import (
    ancestor_mask,
    build_ddtree,
    build_verify_layout,
    eagle_retrieve_arrays,
    full_mask_indptr,
    write_full_mask,
)


def make_tree(bs=3, depth=6, k=4, budget=20, seed=0, vocab=30):
    lp, tok = random_marginals(bs, depth, k, vocab=vocab, seed=seed, sharpness=1.0)
    return build_ddtree(lp, tok, budget)


def naive_ancestors(parent_slots: list[int], slot: int) -> set[int]:
    out = {slot}
    while parent_slots[slot] >= 0:
        slot = parent_slots[slot]
        out.add(slot)
    return out


@pytest.mark.parametrize(
    ("depth", "k", "budget"), [(1, 4, 3), (3, 2, 14), (3, 2, 20), (15, 8, 64), (16, 3, 100)]
)
def test_ancestor_mask_is_the_ancestor_relation(depth, k, budget):
    tree = make_tree(depth=depth, k=k, budget=budget, seed=depth + budget)
    mask = ancestor_mask(tree)
    d = budget + 1
    assert mask.shape == (3, d, d) and mask.dtype == torch.bool
    for b in range(3):
        parent_slots = [-1] + [p + 1 for p in tree.parents[b].tolist()]
        for i in range(d):
            expected = naive_ancestors(parent_slots, i)
            got = set(torch.nonzero(mask[b, i]).flatten().tolist())
            assert got == expected, (b, i)


def test_positions_tokens_and_retrieve_arrays():
    tree = make_tree(depth=5, k=3, budget=25, seed=3)
    root = torch.tensor([7, 8, 9])
    prefix = torch.tensor([4, 0, 11])
    layout = build_verify_layout(tree, root, prefix)
    d = 26
    assert layout.tokens[:, 0].tolist() == [7, 8, 9]
    assert torch.equal(layout.tokens[:, 1:], tree.tokens)
    assert torch.equal(layout.positions[:, 0], prefix)
    assert torch.equal(layout.positions[:, 1:], prefix[:, None] + tree.depths)
    eagle = eagle_retrieve_arrays(tree)
    assert torch.equal(eagle.index, torch.arange(3 * d).view(3, d))
    for b in range(3):
        parent_slots = eagle.parent_slots[b].tolist()
        valid = [True, *tree.valid[b].tolist()]
        for i in range(d):
            children = [c for c in range(1, d) if valid[c] and parent_slots[c] == i]
            assert eagle.next_token[b, i].item() == (children[0] if children else -1)
            if i == 0 or not valid[i]:
                assert eagle.next_sibling[b, i].item() == -1
                continue
            later = [c for c in range(i + 1, d) if valid[c] and parent_slots[c] == parent_slots[i]]
            assert eagle.next_sibling[b, i].item() == (later[0] if later else -1)


def test_padding_is_unreachable():
    tree = make_tree(bs=2, depth=2, k=2, budget=10, seed=1)  # lattice of 6 < 10
    layout = build_verify_layout(tree, torch.tensor([1, 2]), torch.tensor([3, 3]))
    eagle = eagle_retrieve_arrays(tree)
    for b in range(2):
        reachable, frontier = set(), [0]
        while frontier:
            child = eagle.next_token[b, frontier.pop()].item()
            while child != -1:
                reachable.add(child)
                frontier.append(child)
                child = eagle.next_sibling[b, child].item()
        assert reachable == set(range(1, 7))
        # A padding row sees itself and the root only.
        for i in range(7, 11):
            assert torch.nonzero(layout.ancestor_mask[b, i]).flatten().tolist() == [0, i]


def test_full_mask_matches_per_request_construction():
    tree = make_tree(bs=3, depth=4, k=3, budget=9, seed=5)
    prefix = torch.tensor([5, 0, 2])
    mask = ancestor_mask(tree)
    d = 10
    blocks = [
        torch.cat([torch.ones(d, int(prefix[b]), dtype=torch.bool), mask[b]], dim=1).flatten()
        for b in range(3)
    ]
    expected = torch.cat(blocks)
    out = torch.zeros(expected.numel() + 17, dtype=torch.bool)
    indptr = write_full_mask(mask, prefix, out)
    assert torch.equal(out[: expected.numel()], expected)
    assert out[expected.numel() :].all()
    assert indptr.tolist() == [0, *torch.tensor([b.numel() for b in blocks]).cumsum(0).tolist()]
    assert torch.equal(indptr, full_mask_indptr(prefix, d))


def test_full_mask_overwrites_a_dirty_buffer():
    tree = make_tree(bs=2, depth=3, k=2, budget=5, seed=8)
    prefix = torch.tensor([1, 3])
    mask = ancestor_mask(tree)
    clean = torch.zeros(200, dtype=torch.bool)
    dirty = torch.rand(200) > 0.5
    write_full_mask(mask, prefix, clean)
    write_full_mask(mask, prefix, dirty)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("depth", [2, 4, 8, 16])
def test_ancestor_mask_reaches_the_root_of_a_full_depth_chain(depth):
    """Pointer doubling covers 1, 3, 7, 15, ... steps per round: at ``L = 2**r`` the last round
    is the one that reaches the deepest node's root. Certain marginals (one token per depth)
    give a chain of exactly ``L`` nodes; every slot must see itself, the root and every
    ancestor, and nothing below it."""
    lp = torch.zeros(2, depth, 1)
    tok = torch.arange(2 * depth).view(2, depth, 1) % 7
    tree = build_ddtree(lp, tok, depth)
    assert tree.depths[:, -1].tolist() == [depth, depth]  # a chain as deep as the block
    mask = ancestor_mask(tree)
    chain = torch.ones(depth + 1, depth + 1, dtype=torch.bool).tril()  # slot i sees 0..i
    for b in range(2):
        assert torch.nonzero(mask[b] != chain).tolist() == [], b  # [slot, slot] pairs wrong
