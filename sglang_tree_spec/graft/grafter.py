"""One graft method's state across decode steps, for any engine that drafts DDTrees.

A :class:`Grafter` is a :class:`~sglang_tree_spec.tree.select.TreeSelector`: it owns the
successor table (and, for ``unified``, the edge acceptance estimate) shared by every request of
one engine or server. Each step the decode step calls :meth:`Grafter.select` on the drafter's
top-K and, after the target verified the tree, :meth:`Grafter.learn` with the verify logits.
Pure torch, fixed shapes, no host reads (``prune`` aside, for host tensors).

Tenant isolation: with ``partitions > 1`` the table and the edge estimate hold that many
independent partitions; the caller binds each batch's requests to theirs (:meth:`Grafter.bind`)
before :meth:`~Grafter.observe_prompts`, :meth:`~Grafter.select` and :meth:`~Grafter.learn`,
and a request then reads and writes its own partition only.
"""

from __future__ import annotations

from typing import Literal

import torch

from sglang_tree_spec.graft.edges import EdgeAcceptance, edge_evidence
from sglang_tree_spec.graft.policies import StageConfig, graft_stage, graft_unified
from sglang_tree_spec.graft.table import SuccessorTable
from sglang_tree_spec.tree.ddtree import DraftTree, build_ddtree
from sglang_tree_spec.tree.layout import window_valid

GraftMethod = Literal["stage", "unified"]
GRAFT_METHODS: tuple[GraftMethod, ...] = ("stage", "unified")


class Grafter:
    """Successor retrieval grafted into DDTrees: ``stage`` or ``unified`` (see policies).

    Args:
        method: ``"stage"`` (Graft's prune-then-graft rule, thresholds in ``stage``) or
            ``"unified"`` (one best-first choice over drafted and retrieved nodes, edge
            probabilities learnt online).
        vocab_size: V of the successor table (the target's logits width).
        k: successors per token.
        device: where the state lives (the target's device).
        stage: the stage rule's checkpoints and thresholds (calibrate them on training
            prompts); ignored by ``unified``.
        topk: K, drafted tokens per depth.
        prune: the host DDTree builder's early stop (``stage`` builds a DDTree first).
        partitions: independent partitions of the table and the edge estimate (1: one state
            shared by every request).

    Attributes:
        nested: False: a grafted tree at a smaller budget is not a cut of a larger one.
        successors: the ``[V, k]`` :class:`SuccessorTable`.
        edge_acceptance: the :class:`EdgeAcceptance` of ``unified``, else None.
    """

    nested = False

    def __init__(
        self,
        method: GraftMethod,
        vocab_size: int,
        k: int = 8,
        device: torch.device | str = "cpu",
        stage: StageConfig | None = None,
        topk: int = 64,
        prune: bool = False,
        partitions: int = 1,
    ) -> None:
        if method not in GRAFT_METHODS:
            raise ValueError(f"graft method must be one of {GRAFT_METHODS}, got {method!r}")
        self.method, self.topk, self.prune = method, topk, prune
        self.stage = stage or StageConfig()
        self.partitions = partitions
        self.successors = SuccessorTable(vocab_size, k, device, partitions)
        unified = method == "unified"
        self.edge_acceptance = (
            EdgeAcceptance(k, device=device, partitions=partitions) if unified else None
        )
        self._evidence: tuple[torch.Tensor, torch.Tensor] | None = None  # of the last tree
        self._bound: torch.Tensor | None = None  # [bs] partitions of the current batch

    def bind(self, partitions: torch.Tensor | None, reset: tuple[int, ...] = ()) -> None:
        """The partition of each request of the batches to come, ``[bs]`` int (-1: none, the
        request reads nothing learnt and writes nothing); None: partition 0 for every request.
        ``reset``: partitions handed to a new owner, forgotten first."""
        for partition in reset:
            self.successors.reset(partition)
            if self.edge_acceptance is not None:
                self.edge_acceptance.reset(partition)
        self._bound = None if partitions is None else partitions.to(self.successors.device)

    def _partitions(self, batch_size: int) -> torch.Tensor | None:
        """The bound partitions, checked against the batch (host shapes only)."""
        if self._bound is not None and self._bound.shape != (batch_size,):
            raise ValueError(
                f"bound partitions of shape {tuple(self._bound.shape)} do not fit a batch of "
                f"{batch_size}"
            )
        return self._bound

    def observe_prompts(self, token_ids: torch.Tensor) -> None:
        """Warm start from the bigrams of ``[n, T]`` prompt token ids (-1 = padding)."""
        partitions = self._partitions(token_ids.shape[0])
        self.successors.observe(token_ids.to(self.successors.device), partitions)

    def select(
        self,
        topk_logprobs: torch.Tensor,
        topk_tokens: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int,
    ) -> DraftTree:
        """The grafted ``[bs, budget]`` trees (DraftTree invariants, ``max_depth`` = L).

        Args:
            topk_logprobs, topk_tokens: ``[bs, L, K]`` the drafter's top-K, sorted descending.
            root_tokens: ``[bs]`` bonus tokens.
            budget: B.
        """
        partitions = self._partitions(root_tokens.shape[0])
        if self.edge_acceptance is None:
            tree = build_ddtree(
                topk_logprobs, topk_tokens, budget, validate=False, prune=self.prune
            )
            return graft_stage(
                tree,
                topk_logprobs,
                topk_tokens,
                root_tokens,
                self.successors,
                self.stage,
                partitions,
            )
        grafted = graft_unified(
            budget,
            topk_logprobs,
            topk_tokens,
            root_tokens,
            self.successors,
            self.edge_acceptance,
            partitions,
        )
        # Edge acceptance is counted against the rows the tree was drafted from.
        self._evidence = edge_evidence(
            grafted, topk_logprobs, topk_tokens, root_tokens, self.successors, partitions
        )
        return grafted

    def learn(
        self,
        tree: DraftTree,
        window_tokens: torch.Tensor,
        logits: torch.Tensor,
        committed: torch.Tensor,
    ) -> None:
        """Refresh the state from one verify step of ``tree`` (the last one selected, or an
        empty tree: a plain step, whose root's logits still refresh the successor table).

        Args:
            tree: the verified ``[bs, B]`` trees.
            window_tokens: ``[bs, W]`` the verify window (root, then the nodes).
            logits: ``[bs, W, V]`` the target's logits at every window slot.
            committed: ``[bs, L + 1]`` committed tokens (accepted drafts, the bonus, -1 after).
        """
        partitions = self._partitions(window_tokens.shape[0])
        if self.edge_acceptance is not None and tree.budget > 0:  # (a plain step grafted nothing)
            if self._evidence is None:
                raise RuntimeError("Grafter.learn needs the tree of the last Grafter.select")
            self.edge_acceptance.observe(tree, *self._evidence, committed, partitions)
            self._evidence = None
        valid = window_valid(tree).flatten()
        if partitions is not None:  # one per window slot
            partitions = partitions.view(-1, 1).expand_as(window_tokens).flatten()
        self.successors.update(window_tokens.flatten(), logits.flatten(0, 1), valid, partitions)
