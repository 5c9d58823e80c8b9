"""Acceptance: walk a verified draft tree with the target's own decoding rule.

Inputs are the target's outputs at every verify-window slot (slot 0 = root, slot ``i + 1`` =
node ``i``, see :mod:`sglang_tree_spec.tree.layout`). Everything is batched with fixed shapes:
no Python loop per request and no host synchronisation.

Greedy: a node matches when its token is the target's argmax at its parent; a node is accepted
when it and all its ancestors match. Siblings carry distinct tokens, so the accepted nodes form
one path; the target's argmax at its deepest node is the bonus token.

Sampling (lossless for any draft): the target samples its own token at every slot, by inverse
CDF with one coin per depth (all slots of a depth share it), and the walk is the greedy walk
against those draws. The token committed at depth d is the target's draw with coin d in the
context of the tokens committed before it, exactly what the target alone would sample with the
same coins; a coin decides at most one committed token and no decision looks at a later coin.
With coins keyed by the token position (:func:`counter_uniforms`) a request's sampled output
is therefore the same for every tree, budget and batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sglang_tree_spec.tree.ddtree import DraftTree
from sglang_tree_spec.tree.layout import slot_parents


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of one verify step for a batch. ``L`` = ``tree.max_depth``.

    Attributes:
        accept_len: ``[bs]`` int64 accepted draft tokens, bonus excluded (0..L).
        bonus: ``[bs]`` int64 the target's token after the accepted path.
        accepted_slots: ``[bs, L + 1]`` int64 window slots of the path, root (0) first, then
            depth 1..accept_len; -1 after.
        committed_tokens: ``[bs, L + 1]`` int64 the tokens this step commits: the accepted draft
            tokens then the bonus; -1 after. ``accept_len + 1`` of them are real.
    """

    accept_len: torch.Tensor
    bonus: torch.Tensor
    accepted_slots: torch.Tensor
    committed_tokens: torch.Tensor

    @property
    def deepest_slot(self) -> torch.Tensor:
        """``[bs]`` window slot of the last accepted node (0 when none was accepted)."""
        return _deepest_slot(self.accept_len, self.accepted_slots)


def _accepted_path(tree: DraftTree, passed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Close a per-node decision over ancestors and read off the accepted path.

    Args:
        passed: ``[bs, B]`` bool, node ``i`` is taken if its parent is accepted (at most one
            passing child per parent).

    Returns:
        ``(accept_len [bs], path [bs, L + 1])``: the path's window slots by depth, root first,
        -1 past ``accept_len``.
    """
    bs, budget, depth_max = tree.batch_size, tree.budget, tree.max_depth
    device = tree.device
    root = torch.ones(bs, 1, dtype=torch.bool, device=device)
    accepted = torch.cat([root, passed & tree.valid], dim=1)  # [bs, D]
    # Pointer doubling: with `covered` ancestors folded in, AND in the row of the ancestor
    # covered + 1 steps up (the root points at itself and is always accepted).
    jump, covered = slot_parents(tree).clamp_min(0), 0
    while covered < depth_max:
        accepted = accepted & accepted.gather(1, jump)
        jump = jump.gather(1, jump)
        covered = 2 * covered + 1
    depths = torch.cat([torch.zeros(bs, 1, dtype=torch.long, device=device), tree.depths], 1)
    accepted_depth = torch.where(accepted, depths, 0)
    accept_len = accepted_depth.max(dim=1).values  # one path: its deepest node's depth
    # Each accepted slot lands in its depth's column; the others in a discarded column.
    slots = torch.arange(budget + 1, device=device).expand(bs, budget + 1)
    column = torch.where(accepted, depths, depth_max + 1)
    path = torch.full((bs, depth_max + 2), -1, dtype=torch.long, device=device)
    path.scatter_(1, column, slots)
    return accept_len, path[:, : depth_max + 1]


def _committed_tokens(
    tree: DraftTree, accept_len: torch.Tensor, path: torch.Tensor, bonus: torch.Tensor
) -> torch.Tensor:
    """``[bs, L + 1]``: the path's draft tokens, then the bonus, then -1."""
    bs, depth_max = tree.batch_size, tree.max_depth
    path_tokens = tree.tokens.gather(1, (path[:, 1:] - 1).clamp_min(0))  # [bs, L]
    committed = torch.cat([path_tokens, bonus.unsqueeze(1)], dim=1)
    position = torch.arange(depth_max + 1, device=tree.device).expand(bs, depth_max + 1)
    length = accept_len.unsqueeze(1)
    committed = torch.where(position == length, bonus.unsqueeze(1), committed)
    return torch.where(position <= length, committed, -1)


def _deepest_slot(accept_len: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    return path.gather(1, accept_len.unsqueeze(1)).squeeze(1)


def greedy_accept(tree: DraftTree, target_argmax: torch.Tensor) -> AcceptResult:
    """Greedy acceptance.

    Args:
        tree: ``[bs, B]`` draft trees.
        target_argmax: ``[bs, B + 1]`` the target's argmax token at each window slot (slot 0 =
            its prediction after the root).
    """
    if target_argmax.shape != (tree.batch_size, tree.budget + 1):
        raise ValueError(
            f"target_argmax must be [bs, budget + 1] = {(tree.batch_size, tree.budget + 1)}, "
            f"got {tuple(target_argmax.shape)}"
        )
    target_argmax = target_argmax.to(torch.long)
    if tree.budget == 0:  # a plain step: the root alone, its argmax is the bonus
        return _root_only(target_argmax[:, 0])
    predicted_at_parent = target_argmax.gather(1, tree.parent_slots())  # [bs, B]
    matches = tree.tokens == predicted_at_parent
    accept_len, path = _accepted_path(tree, matches)
    bonus = target_argmax.gather(1, _deepest_slot(accept_len, path).unsqueeze(1)).squeeze(1)
    return AcceptResult(accept_len, bonus, path, _committed_tokens(tree, accept_len, path, bonus))


def _root_only(bonus: torch.Tensor) -> AcceptResult:
    """The acceptance of an empty tree (``max_depth`` 0): nothing accepted, ``bonus`` ``[bs]``
    committed; what the general walk returns for it, with no op of its own."""
    zeros = _root_path(bonus.shape[0], str(bonus.device))  # [bs, 1]
    return AcceptResult(zeros.view(-1), bonus, zeros, bonus.unsqueeze(1))


@functools.lru_cache(maxsize=256)
def _root_path(bs: int, device: str) -> torch.Tensor:
    """``[bs, 1]`` int64 zeros, one per size and device, shared and never written."""
    return torch.zeros(bs, 1, dtype=torch.long, device=device)


def _per_row(value: torch.Tensor | float | int, bs: int, dtype, device) -> torch.Tensor:
    """Broadcast a scalar or ``[bs]`` sampling parameter to a ``[bs, 1]`` tensor."""
    return torch.as_tensor(value, dtype=dtype, device=device).expand(bs).reshape(bs, 1)


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    min_p: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """The target's sampling distribution, as SGLang's sampler defines it.

    ``softmax(logits / temperature)``; top-k keeps the ``top_k`` most probable tokens
    (``top_k <= 0`` or ``>= V``: all); top-p drops a token when the probability mass sorted
    strictly before it already exceeds ``top_p`` (computed before the top-k cut, as SGLang does);
    min-p drops a token below ``min_p`` times the most probable one; then renormalise.
    ``temperature <= 0`` means greedy: a one-hot at the argmax.

    Args:
        logits: ``[bs, N, V]`` (N slots per request) or ``[bs, V]``.
        temperature, top_k, top_p, min_p: scalars or ``[bs]`` per-request values.

    Returns:
        float32 probabilities of the shape of ``logits``.
    """
    squeeze = logits.dim() == 2
    if squeeze:
        logits = logits.unsqueeze(1)
    bs, _, vocab = logits.shape
    device = logits.device
    temp = _per_row(temperature, bs, torch.float32, device).view(bs, 1, 1)
    k = _per_row(top_k, bs, torch.long, device).view(bs, 1, 1)
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    p = _per_row(top_p, bs, torch.float32, device).view(bs, 1, 1)
    floor = _per_row(min_p, bs, torch.float32, device).view(bs, 1, 1)

    greedy = temp <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temp)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    rank = torch.arange(vocab, device=device).view(1, 1, vocab)
    keep = (rank < k) & (mass_before <= p) & (sorted_probs >= floor * sorted_probs[..., :1])
    sorted_probs = torch.where(keep, sorted_probs, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, sorted_ids, sorted_probs)
    filtered = filtered / filtered.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    out = torch.where(greedy, one_hot, filtered)
    return out.squeeze(1) if squeeze else out


def _sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw. ``probs`` ``[bs, V]`` (any positive scale), ``uniform`` ``[bs]``."""
    cdf = probs.double().cumsum(dim=1)
    threshold = (uniform.double() * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    return index.clamp_max(probs.shape[1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    *,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row from the target's sampling distribution (plain decoding).

    Args:
        logits: ``[bs, V]``.
        uniforms: ``[bs]`` coins in [0, 1) for an inverse-CDF draw; ``temperature <= 0`` rows
            return the argmax whatever the coin.

    Returns:
        ``[bs]`` int64 token ids.
    """
    return _sample_from(target_probs(logits, temperature, top_k, top_p), uniforms)


def slot_depths(tree: DraftTree) -> torch.Tensor:
    """``[bs, B + 1]`` int64 depth of every window slot (root 0; padding slots 0)."""
    depths = torch.where(tree.valid, tree.depths, 0)
    root = torch.zeros(tree.batch_size, 1, dtype=depths.dtype, device=depths.device)
    return torch.cat([root, depths], dim=1)


def sample_accept(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    *,
    min_p: torch.Tensor | float = 0.0,
    uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Lossless acceptance under the target's sampling rule: the target samples, the tree matches.

    Every window slot draws the target's token there by inverse CDF (token-id order) with the
    coin of its depth: ``uniforms[:, d]`` for every slot of depth ``d`` (the root is depth 0).
    The walk then is :func:`greedy_accept` against those draws: from the root, move to the
    child whose token is the draw, and commit the first draw that leaves the tree as the bonus.
    So the committed tokens are exactly what the target alone samples with coin ``d`` for the
    ``d``-th token of the step, whatever the tree: exact in distribution, and with coins keyed
    by position (:func:`counter_uniforms`) reproducible across budgets, trees and batches.

    Args:
        tree: ``[bs, B]`` draft trees (distinct sibling tokens).
        target_logits: ``[bs, B + 1, V]`` target logits at every window slot.
        temperature, top_k, top_p, min_p: scalars or ``[bs]``; see :func:`target_probs`. A
            request with ``temperature <= 0`` is accepted greedily (its distribution is one-hot).
        uniforms: optional ``[bs, L + 1]`` coins in [0, 1), one per depth (``L`` =
            ``tree.max_depth``). Drawn from ``generator`` when omitted.

    Returns:
        An :class:`AcceptResult`.
    """
    bs, budget, depth_max = tree.batch_size, tree.budget, tree.max_depth
    if target_logits.dim() != 3 or target_logits.shape[:2] != (bs, budget + 1):
        raise ValueError(
            f"target_logits must be [bs, budget + 1, V] with bs={bs}, budget={budget}; "
            f"got {tuple(target_logits.shape)}"
        )
    if uniforms is None:
        uniforms = torch.rand(
            bs, depth_max + 1, generator=generator, device=tree.device, dtype=torch.float64
        )
    elif uniforms.shape != (bs, depth_max + 1):
        raise ValueError(
            f"uniforms must be [bs, max_depth + 1] = {(bs, depth_max + 1)}, "
            f"got {tuple(uniforms.shape)}"
        )
    probs = target_probs(target_logits, temperature, top_k, top_p, min_p)  # [bs, D, V]
    coins = uniforms.to(tree.device).gather(1, slot_depths(tree))  # [bs, D]
    drawn = _sample_from(probs.flatten(0, 1), coins.flatten()).view(bs, budget + 1)
    return greedy_accept(tree, drawn)


def _as_int64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >> bits`` on the unsigned 64-bit pattern of an int64 tensor."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Reproducible uniforms in [0, 1): a SplitMix64 hash of (seed, counter), batched.

    The same (seed, counter) always gives the same number on any device and in any batch, so
    a request with a sampling seed draws the same coins wherever it is scheduled (the counter
    is a token position, so every coin of a request is a distinct draw).

    Args:
        seeds: ``[bs]`` int64 per-request seeds.
        counters: ``[bs, N]`` int64 (e.g. the positions of the verify window's slots).

    Returns:
        ``[bs, N]`` float64 uniforms with 53 random bits.
    """
    golden = _as_int64(0x9E3779B97F4A7C15)
    x = seeds.to(torch.int64).view(-1, 1) * golden + counters.to(torch.int64)
    x = x + golden
    x = (x ^ _logical_shift_right(x, 30)) * _as_int64(0xBF58476D1CE4E5B9)
    x = (x ^ _logical_shift_right(x, 27)) * _as_int64(0x94D049BB133111EB)
    x = x ^ _logical_shift_right(x, 31)
    return _logical_shift_right(x, 11).to(torch.float64) * (2.0**-53)
