"""Shared helpers for the core tests: random draft marginals and tree walks."""

from __future__ import annotations

import torch


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
