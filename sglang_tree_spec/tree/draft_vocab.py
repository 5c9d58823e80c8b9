"""The drafter's vocabulary shortlist (SGLang's ``--speculative-token-map``, the engine's
``token_map``).

A token map (a ``torch.save``'d list of token ids, as SGLang's EAGLE reads it; FR-Spec's
frequency-ranked draft vocabulary) restricts the draft top-K to those ids: the LM head that
scores the drafter's hidden states multiplies their rows only. On a large vocabulary that head is
the dearest part of a draft (SmolLM2: 49,152 x 576 per drafted depth). The target still
verifies with its whole vocabulary, so a shortlist changes which trees are drafted, never a
committed token.

Under tensor parallelism each rank keeps the map's ids within its vocabulary shard, padded to
the count of the rank with the most (padding columns carry the id ``vocab_size``, which the
merged top-K never returns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class TokenMapError(ValueError):
    """A token map DDTREE cannot draft from (a one-line ``DDTREE:`` message)."""


@dataclass(frozen=True)
class DraftVocab:
    """One rank's rows of the shortlist.

    Attributes:
        token_ids: ``[S]`` int64 the token id of each row (``vocab_size``: padding).
        weight: ``[S, H]`` the target LM head's rows for them (padding: row 0), contiguous.
    """

    token_ids: torch.Tensor
    weight: torch.Tensor


def check_token_map(ids: torch.Tensor, vocab_size: int, topk: int, source: str) -> torch.Tensor:
    """The map's ids as ``[S]`` int64, or a :class:`TokenMapError` naming what is wrong;
    ``source`` names the map in it (e.g. ``"--speculative-token-map map.pt"``)."""
    ids = torch.as_tensor(ids).to(torch.int64).flatten()
    if ids.numel() == 0:
        raise TokenMapError(f"DDTREE: {source} holds no token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise TokenMapError(
            f"DDTREE: {source} has ids outside the target's vocabulary "
            f"[0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}"
        )
    if ids.unique().numel() != ids.numel():
        raise TokenMapError(f"DDTREE: {source} repeats token ids")
    if ids.numel() < topk:
        raise TokenMapError(
            f"DDTREE: {source} has {ids.numel()} ids, fewer than the "
            f"draft top-K ({topk}, --speculative-ddtree-topk)"
        )
    return ids


def draft_vocab(
    ids: torch.Tensor,
    shard_weight: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    world_size: int = 1,
) -> DraftVocab:
    """This rank's shortlist rows.

    Args:
        ids: ``[S]`` int64 checked token ids (:func:`check_token_map`).
        shard_weight: ``[V_shard, H]`` this rank's LM head rows, for ids ``vocab_start + j``
            (every rank's shard has the same size).
        vocab_start: this rank's first id.
        vocab_size: the target's real vocabulary size (the padding id).
        world_size: ranks sharing the vocabulary.
    """
    shard = shard_weight.shape[0]
    ids = ids.to(shard_weight.device)
    ranks = torch.div(ids, shard, rounding_mode="floor")  # [S] the rank holding each id
    width = int(torch.bincount(ranks, minlength=world_size).max())  # the largest rank's count
    mine = ids[ranks == vocab_start // shard] if world_size > 1 else ids
    rows = torch.zeros(width, dtype=torch.int64, device=ids.device)
    rows[: mine.numel()] = mine - vocab_start
    token_ids = torch.full_like(rows, vocab_size)
    token_ids[: mine.numel()] = mine
    return DraftVocab(token_ids=token_ids, weight=shard_weight[rows].contiguous())
