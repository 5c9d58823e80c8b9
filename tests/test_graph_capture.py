"""The device path of the core traces as one graph: no host synchronisation, no data-dependent
control flow or shapes. torch.compile(fullgraph=True) fails on any `.item()`, `bool(tensor)`,
`.tolist()` or value-dependent shape, so these traces stand in for CUDA-graph capture in CI."""

from __future__ import annotations

import warnings

import pytest
import torch
from tree_helpers import random_marginals

from sglang_tree_spec.tree import (
    build_ddtree,
    build_verify_layout,
    greedy_accept,
    sample_accept,
    write_full_mask,
)


def one_graph(fn):
    return torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lru_cache.*")
        yield
    torch._dynamo.reset()


def test_decode_step_core_traces_as_one_graph():
    lp, tok = random_marginals(3, 6, 8, vocab=40, seed=0)
    root, prefix = torch.tensor([1, 2, 3]), torch.tensor([4, 9, 6])

    def step(lp, tok, root, prefix, argmax, logits, uniforms, mask_buffer):
        tree = build_ddtree(lp, tok, 16, validate=False)
        layout = build_verify_layout(tree, root, prefix)
        indptr = write_full_mask(layout.ancestor_mask, prefix, mask_buffer)
        greedy = greedy_accept(tree, argmax)
        sampled = sample_accept(
            tree, logits, torch.tensor([1.0, 0.7, 0.0]), 0, 0.9, uniforms=uniforms
        )
        return tree, layout, indptr, greedy, sampled

    args = (
        lp,
        tok,
        root,
        prefix,
        torch.randint(0, 40, (3, 17)),
        torch.randn(3, 17, 40),
        torch.rand(3, 7, dtype=torch.float64),  # a coin per depth: L + 1 = 7
        torch.zeros(2000, dtype=torch.bool),
    )
    traced = one_graph(step)(*args)
    eager = step(*args[:-1], torch.zeros(2000, dtype=torch.bool))
    for got, expected in zip(traced, eager, strict=True):
        for a, b in zip(_tensors(got), _tensors(expected), strict=True):
            assert torch.equal(a, b)


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    return [v for v in vars(value).values() if torch.is_tensor(v)]


def test_pruning_is_a_host_only_path():
    """The pruned loop reads values (it may stop early), so it must not trace as one graph;
    the default loop does."""
    lp, tok = random_marginals(2, 6, 8, vocab=40, seed=1)
    one_graph(lambda lp, tok: build_ddtree(lp, tok, 16, validate=False))(lp, tok)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        one_graph(lambda lp, tok: build_ddtree(lp, tok, 16, validate=False, prune=True))(lp, tok)
