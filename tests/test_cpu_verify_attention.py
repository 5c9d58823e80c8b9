"""The CPU target-verify attention (``plugin.cpu.verify_attention``) against a naive loop.

Each verify token must attend exactly to its request's cached prefix plus the window slots its
mask allows: the tree's ancestors (FULL_MASK), the whole window (a non-causal drafter block), or
the earlier window slots (a chain).
"""

from __future__ import annotations

import pytest
import torch
from tree_helpers import random_marginals

from sglang_tree_spec.plugin.cpu import verify_attention, verify_index
from sglang_tree_spec.tree import build_ddtree, build_verify_layout, write_full_mask

HEADS, KV_HEADS, DIM = 4, 2, 8


def naive(query, k_cache, v_cache, slots, allowed, scale):
    """One token at a time: softmax over the allowed KV slots, GQA by head repetition."""
    out = torch.empty(query.shape[0], HEADS, DIM, dtype=query.dtype)
    group = HEADS // KV_HEADS
    for t in range(query.shape[0]):
        keys = k_cache[slots[allowed[t]]]  # [n, KV_HEADS, D]
        values = v_cache[slots[allowed[t]]]
        for h in range(HEADS):
            weights = torch.softmax(keys[:, h // group] @ query[t, h] * scale, dim=0)
            out[t, h] = weights @ values[:, h // group]
    return out


@pytest.mark.parametrize("mode", ["tree", "bidirectional", "causal"])
def test_verify_attention_matches_a_naive_loop(mode):
    gen = torch.Generator().manual_seed(0)
    bs, budget = 3, 6
    window = budget + 1
    prefix_lens = torch.tensor([5, 0, 11])
    slots_total = 64
    req_to_token = torch.randperm(slots_total, generator=gen)[: 3 * 20].view(3, 20)
    req_pool_indices = torch.tensor([2, 0, 1])
    k_cache = torch.randn(slots_total, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(slots_total, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    query = torch.randn(bs * window, HEADS, DIM, generator=gen, dtype=torch.float64)

    lp, tok = random_marginals(bs, 4, 3, vocab=50, seed=1)
    tree = build_ddtree(lp, tok, budget)
    ancestors = build_verify_layout(tree, torch.zeros(bs, dtype=torch.long), prefix_lens)
    flat = None
    if mode == "tree":
        sizes = window * (prefix_lens + window)
        flat = torch.empty(int(sizes.sum()), dtype=torch.bool)
        write_full_mask(ancestors.ancestor_mask, prefix_lens, flat)

    out = torch.empty_like(query)
    scale = DIM**-0.5
    index = verify_index(
        req_to_token, req_pool_indices, prefix_lens, window,
        flat_mask=flat, causal=mode != "bidirectional",
    )  # fmt: skip
    verify_attention(query, out, k_cache, v_cache, index, scale=scale, enable_gqa=True)

    for b in range(bs):
        prefix = int(prefix_lens[b])
        slots = req_to_token[req_pool_indices[b], : prefix + window]
        window_allowed = {
            "tree": ancestors.ancestor_mask[b],
            "bidirectional": torch.ones(window, window, dtype=torch.bool),
            "causal": torch.ones(window, window, dtype=torch.bool).tril(),
        }[mode]
        allowed = torch.cat([torch.ones(window, prefix, dtype=torch.bool), window_allowed], 1)
        rows = slice(b * window, (b + 1) * window)
        expected = naive(query[rows], k_cache, v_cache, slots, allowed, scale)
        torch.testing.assert_close(out[rows], expected)


@pytest.mark.parametrize(
    ("prefix", "window", "masked"),
    [((7,), 1, False), ((7, 7), 1, False), ((7, 4), 1, True), ((7,), 3, True)],
)
def test_plain_steps_of_one_length_attend_unmasked(prefix, window, masked):
    """A plain step (``W = 1``) of requests of one length attends to every column: the index
    carries no mask (SDPA's unmasked fast path) and the output is the naive loop's; ragged
    lengths or a causal window keep the mask."""
    gen = torch.Generator().manual_seed(3)
    bs = len(prefix)
    prefix_lens = torch.tensor(prefix)
    req_to_token = torch.randperm(64, generator=gen)[: bs * 16].view(bs, 16)
    req_pool_indices = torch.arange(bs).flip(0)
    k_cache = torch.randn(64, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(64, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    query = torch.randn(bs * window, HEADS, DIM, generator=gen, dtype=torch.float64)
    index = verify_index(
        req_to_token, req_pool_indices, prefix_lens, window, flat_mask=None, causal=True
    )
    assert (index.allowed is not None) == masked
    out = torch.empty_like(query)
    verify_attention(query, out, k_cache, v_cache, index, scale=DIM**-0.5, enable_gqa=True)
    for b in range(bs):
        length = int(prefix_lens[b]) + window
        slots = req_to_token[req_pool_indices[b], :length]
        allowed = torch.ones(window, length, dtype=torch.bool).tril(length - window)
        rows = slice(b * window, (b + 1) * window)
        expected = naive(query[rows], k_cache, v_cache, slots, allowed, DIM**-0.5)
        torch.testing.assert_close(out[rows], expected)
