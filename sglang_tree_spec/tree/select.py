"""Tree selection behind one interface: the drafter's top-K in, a ``[bs, B]`` DraftTree out.

A selector is what the decode step asks for a tree (:class:`TreeSelector`). This module has
the two without state, :class:`DDTreeSelector` and :class:`ChainSelector`; Graft's
:class:`~sglang_tree_spec.graft.Grafter` is the third, with its shared successor table.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from sglang_tree_spec.tree.ddtree import DraftTree, build_chain, build_ddtree
from sglang_tree_spec.tree.graphs import TreeGraphs


class TreeSelector(Protocol):
    """Selects each step's draft trees and learns from their verification.

    Attributes:
        topk: K, the top-K per drafted depth :meth:`select` reads.
        nested: its tree at budget N is the N best nodes (by log-prob) of its tree at any
            larger budget, so budget control can build once and cut (DDTree's nesting).
        prune: the host DDTree builder's early stop (for host tensors only).
    """

    topk: int
    nested: bool
    prune: bool

    def select(
        self,
        topk_logprobs: torch.Tensor,
        topk_tokens: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int,
    ) -> DraftTree:
        """``[bs, budget]`` trees from ``[bs, L, K]`` top-K marginals and ``[bs]`` roots."""
        ...

    def learn(
        self,
        tree: DraftTree,
        window_tokens: torch.Tensor,
        logits: torch.Tensor,
        committed: torch.Tensor,
    ) -> None:
        """After verify: ``[bs, W]`` window tokens, ``[bs, W, V]`` target logits, ``[bs, L + 1]``
        committed tokens (-1 padded)."""
        ...

    def observe_prompts(self, token_ids: torch.Tensor) -> None:
        """Prompts about to be prefilled, ``[n, T]`` token ids (-1 = padding)."""
        ...


class DDTreeSelector:
    """DDTree: the budget's most probable prefixes of the top-K lattice.

    Args:
        topk: K tokens per depth.
        prune: the host builder's early stop (:func:`build_ddtree`); pass it for host tensors
            only (it reads scores back).
        graphs: replay the batched build from CUDA graphs (:class:`TreeGraphs`, device
            tensors); its trees are valid until the next build of the same shape.
    """

    nested = True

    def __init__(self, topk: int, prune: bool = False, graphs: TreeGraphs | None = None) -> None:
        if prune and graphs is not None:
            raise ValueError("DDTreeSelector: the pruned host builder cannot be graphed")
        self.topk, self.prune, self.graphs = topk, prune, graphs

    def select(self, topk_logprobs, topk_tokens, root_tokens, budget) -> DraftTree:
        if self.graphs is not None:
            return self.graphs.build(topk_logprobs, topk_tokens, budget)
        return build_ddtree(topk_logprobs, topk_tokens, budget, validate=False, prune=self.prune)

    def learn(self, tree, window_tokens, logits, committed) -> None:
        pass

    def observe_prompts(self, token_ids) -> None:
        pass


class ChainSelector(DDTreeSelector):
    """The DFlash chain: one path of the top-1 token at every drafted depth (``L`` nodes)."""

    nested = False  # one shape: L nodes whatever the budget

    def __init__(self) -> None:
        super().__init__(topk=1)

    def select(self, topk_logprobs, topk_tokens, root_tokens, budget) -> DraftTree:
        return build_chain(topk_logprobs, topk_tokens)


def empty_tree(batch_size: int, device: torch.device | str) -> DraftTree:
    """No draft nodes (``max_depth`` 0): the verify window is the root alone, a plain step.
    One per size and device, shared (it has no elements to write)."""
    return _empty_tree(batch_size, str(torch.device(device)))


@functools.lru_cache(maxsize=256)
def _empty_tree(batch_size: int, device: str) -> DraftTree:
    long = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
    return DraftTree(
        tokens=long,
        parents=long,
        depths=long,
        logprobs=torch.zeros(batch_size, 0, device=device),
        valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
        max_depth=0,
    )
