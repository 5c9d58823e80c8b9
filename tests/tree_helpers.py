"""Shared helpers for the core tests: random draft marginals, tree walks, the tree checker."""

from __future__ import annotations

import pytest
import torch

from sglang_tree_spec.tree.ddtree import LOGPROB_FLOOR


def random_marginals(
    bs: int,
    depth: int,
    k: int,
    vocab: int,
    seed: int,
    sharpness: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probs ``[bs, depth, k]`` (sorted descending) and token ids of random
    per-position softmax marginals over ``vocab`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=generator) * sharpness
    return torch.log_softmax(logits, dim=-1).topk(k, dim=-1)


def node_paths(parents: list[int], tokens: list[int], valid: list[bool]) -> list[tuple[int, ...]]:
    """Token path (root excluded) of every valid node of one request's tree, by node index."""
    paths: list[tuple[int, ...]] = []
    for i, (parent, token) in enumerate(zip(parents, tokens, strict=True)):
        if not valid[i]:
            paths.append(())
            continue
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


def assert_well_formed(tree, topk_logprobs, topk_tokens) -> None:
    """Invariants of the DraftTree contract, checked with plain Python loops.

    Structure: valid prefix, breadth-first, parents before children at depth - 1, distinct
    sibling tokens, padding conventions. Log-probs: each node's is the sum of its path's
    floored marginals, a token outside the top-K at its depth counting ``LOGPROB_FLOOR``.
    """
    bs, budget = tree.tokens.shape
    for b in range(bs):
        parents = tree.parents[b].tolist()
        depths = tree.depths[b].tolist()
        tokens = tree.tokens[b].tolist()
        valid = tree.valid[b].tolist()
        n_valid = sum(valid)
        assert valid == [True] * n_valid + [False] * (budget - n_valid), "padding must trail"
        assert depths[:n_valid] == sorted(depths[:n_valid]), "breadth-first order"
        siblings: dict[int, set[int]] = {}
        for i in range(n_valid):
            p = parents[i]
            assert p < i
            assert (p == -1) == (depths[i] == 1)
            assert depths[i] <= tree.max_depth
            if p >= 0:
                assert depths[i] == depths[p] + 1
                assert valid[p]
            assert tokens[i] not in siblings.setdefault(p, set()), "sibling tokens distinct"
            siblings[p].add(tokens[i])
        for i, path in enumerate(node_paths(parents, tokens, valid)[:n_valid]):
            total = 0.0
            for d, token in enumerate(path):
                row = topk_tokens[b, d].tolist()
                if token in row:
                    total += float(topk_logprobs[b, d, row.index(token)].clamp_min(LOGPROB_FLOOR))
                else:
                    total += LOGPROB_FLOOR
            assert tree.logprobs[b, i].item() == pytest.approx(total, rel=1e-5, abs=1e-5)
        for i in range(n_valid, budget):
            assert (parents[i], depths[i], tokens[i]) == (-1, 1, 0)
            assert tree.logprobs[b, i].item() == float("-inf")


def small_pair(dtype: torch.dtype, prompts: int = 3) -> tuple:
    """The committed small pair on CPU in ``dtype`` and ``prompts`` held-out prompts (their last
    96 tokens): ``(target, drafter, prompt ids)`` for the engine."""
    from sglang_tree_spec.engine.loading import load_drafter, load_target
    from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts

    cpu = torch.device("cpu")
    target, tokenizer = load_target(SMALL_PAIR_DIR / "target", cpu, dtype)
    drafter = load_drafter(SMALL_PAIR_DIR / "drafter", cpu, dtype)
    texts = heldout_prompts(prompts)
    return target, drafter, [tokenizer.encode(t, add_special_tokens=False)[-96:] for t in texts]
