"""One speculative decode step, written once for the reference engine and the SGLang worker.

Pure torch: no SGLang, no transformers. The engine (:mod:`sglang_tree_spec.engine`) and the
worker (:mod:`sglang_tree_spec.plugin.worker`) each supply a :class:`StepBackend`, the four
operations that touch their models and caches, and call :func:`decode_step`:

    draft top-K -> select tree -> layout -> verify -> accept -> learn -> keep

Sizes: ``bs`` requests, ``L`` drafted depths, ``K`` top-K per depth, ``B`` tree budget, ``W =
B + 1`` verify-window slots (the root, i.e. the last bonus token, is slot 0), ``P = min(L, B) +
1`` slots of the longest path, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_tree_spec.config import TreeConfig
from sglang_tree_spec.step_times import PhaseTimer
from sglang_tree_spec.tree import (
    AcceptResult,
    DraftTree,
    VerifyLayout,
    build_verify_layout,
    counter_uniforms,
    greedy_accept,
    sample_accept,
)
from sglang_tree_spec.tree.select import (
    ChainSelector,
    DDTreeSelector,
    TreeSelector,
    empty_tree,
)


class StepBackend(Protocol):
    """The model-side operations of a decode step (an engine's or a server's)."""

    def draft_topk(
        self, bonus: torch.Tensor, prefix_lens: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward over ``[bonus, MASK x L]``: top-K ``[bs, L, K]`` log-probs
        (sorted descending) and token ids of the drafted depths."""
        ...

    def verify(self, layout: VerifyLayout, prefix_lens: torch.Tensor) -> torch.Tensor:
        """One target forward over the ``[bs, W]`` window with the tree's ancestor mask,
        writing the window's KV; ``[bs, W, V]`` logits under the target's logit processors."""
        ...

    def keep(self, path_slots: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """Make the accepted path the requests' next cached tokens: window slot
        ``path_slots[b, j]`` (``[bs, P]``, -1 past the path) becomes position ``prefix + j``
        for ``j < commit_lens[b]``, in the target's KV and the drafter's context."""
        ...


@dataclass(frozen=True)
class Sampling:
    """The target's decoding rule for each row of the batch.

    Attributes:
        temperature, top_k, top_p, min_p: ``[bs]`` as SGLang's sampler reads them
            (temperature <= 0: greedy row).
        seeds: ``[bs]`` int64; a seeded row's coin for the token at position ``p`` is
            ``counter_uniforms(seed, p)``: the same token whatever the tree, budget or batch.
        seeded: ``[bs]`` bool; unseeded rows draw fresh coins from the step's generator.
        all_greedy: every row greedy (no coins, no probabilities).
        all_seeded: every row seeded (host flag: no generator draw).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    seeded: torch.Tensor
    all_greedy: bool
    all_seeded: bool

    @classmethod
    def greedy(cls, batch_size: int, device: torch.device | str) -> Sampling:
        zeros = torch.zeros(batch_size, device=device)
        long = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(zeros, long, zeros + 1, zeros, long, long.bool(), True, True)

    def coins(
        self, prefix_lens: torch.Tensor, depth_count: int, generator: torch.Generator | None
    ) -> torch.Tensor:
        """``[bs, depth_count]`` float64 uniforms: coin ``d`` draws the token at position
        ``prefix + d`` (the root's prediction is depth 0)."""
        depth = torch.arange(depth_count, device=prefix_lens.device)
        keyed = counter_uniforms(self.seeds, prefix_lens[:, None] + depth)
        if self.all_seeded:
            return keyed
        fresh = torch.rand(keyed.shape, generator=generator, dtype=torch.float64)
        return torch.where(self.seeded[:, None], keyed, fresh.to(keyed.device))

    def accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        prefix_lens: torch.Tensor,
        generator: torch.Generator | None,
    ) -> AcceptResult:
        """The target's own rule on ``[bs, W, V]`` verify logits (greedy, or sampled)."""
        if self.all_greedy:
            return greedy_accept(tree, logits.argmax(dim=-1))
        return sample_accept(
            tree,
            logits,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            uniforms=self.coins(prefix_lens, tree.max_depth + 1, generator),
        )


@dataclass(frozen=True)
class StepResult:
    """What one decode step committed.

    Attributes:
        tree: the ``[bs, B]`` verified trees.
        accept: the acceptance (``accept_len``, ``bonus``, paths and committed tokens).
        commit_lens: ``[bs]`` int64 tokens committed (accepted drafts + the bonus).
        committed_tokens: ``[bs, P]`` int64, -1 after ``commit_lens``.
        topk_logprobs: ``[bs, L, K]`` the drafter's top-K log-probs (None when not drafted).
    """

    tree: DraftTree
    accept: AcceptResult
    commit_lens: torch.Tensor
    committed_tokens: torch.Tensor
    topk_logprobs: torch.Tensor | None


def decode_step(
    backend: StepBackend,
    selector: TreeSelector | None,
    budget: int,
    sampling: Sampling,
    bonus: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    timer: PhaseTimer,
    generator: torch.Generator | None = None,
) -> StepResult:
    """Draft, select, verify, accept and keep one step for ``bs`` requests.

    Args:
        backend: the model-side operations.
        selector: the tree selector; ``None`` or ``budget == 0`` runs a plain step (the root
            alone is verified).
        budget: B, the step's node budget (every request of the step the same, so a batch
            size and budget are one fixed shape).
        sampling: the target's decoding rule per row.
        bonus: ``[bs]`` int64 the last committed token of each request (not yet cached).
        prefix_lens: ``[bs]`` int64 tokens in each request's KV cache.
        timer: marks the phases draft, tree, verify, accept, commit.
        generator: coins of unseeded sampled rows.
    """
    bs = bonus.shape[0]
    timer.start()
    topk_logprobs = None
    if selector is None or budget == 0:
        tree = empty_tree(bs, bonus.device)
    else:
        topk_logprobs, topk_tokens = backend.draft_topk(bonus, prefix_lens, selector.topk)
        timer.mark("draft")
        tree = selector.select(topk_logprobs, topk_tokens, bonus, budget)  # [bs, B]
    layout = build_verify_layout(tree, bonus, prefix_lens)  # [bs, W] tokens and positions
    timer.mark("tree")
    logits = backend.verify(layout, prefix_lens)  # [bs, W, V]
    timer.mark("verify")
    accept = sampling.accept(tree, logits, prefix_lens, generator)
    if selector is not None and budget > 0:
        selector.learn(tree, layout.tokens, logits, accept.committed_tokens)
    path_width = min(tree.max_depth, tree.budget) + 1  # P
    commit_lens = accept.accept_len + 1  # [bs]
    timer.mark("accept")
    backend.keep(accept.accepted_slots[:, :path_width], commit_lens)
    timer.mark("commit")
    timer.end_step(bs)
    return StepResult(
        tree, accept, commit_lens, accept.committed_tokens[:, :path_width], topk_logprobs
    )


def make_selector(
    config: TreeConfig,
    vocab_size: int,
    device: torch.device | str,
    stage: object | None = None,
) -> TreeSelector | None:
    """The selector of a :class:`TreeConfig` (``None`` when it drafts nothing).

    ``stage`` is the stage rule (:class:`~sglang_tree_spec.graft.StageConfig`) of
    ``graft="stage"``. Host tensors take the pruned DDTree builder.
    """
    if not config.drafts:
        return None
    if config.chain:
        return ChainSelector()
    prune = torch.device(device).type == "cpu"
    if config.graft == "none":
        return DDTreeSelector(config.k, prune=prune)
    from sglang_tree_spec.graft import Grafter

    return Grafter(
        config.graft, vocab_size, config.table_k, device, stage, topk=config.k, prune=prune
    )
