"""The successor table ``M[V, k]``: each token's likely next tokens, shared by all requests.

Graft's retrieval source (``design.md`` section 3, Successor table). Row ``x`` holds up to ``k``
token ids, best first; :data:`UNKNOWN` marks a rank nothing has filled yet. The known entries of
a row are always a prefix of it and are distinct, so retrieved siblings never repeat a token.

Two writers:

* :meth:`SuccessorTable.update` -- the target's verify logits. For every verified node (token
  ``x``, target logits at that node), row ``x`` becomes ``topk(logits, k)``: the target's own
  best successors of ``x`` in the context just verified. One batched call per step, fixed shapes,
  no host synchronisation.
* :meth:`SuccessorTable.observe` -- bigrams of token sequences (prompts), a cold-start fill:
  an observed successor only takes a free rank, never replaces a target-written entry.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

UNKNOWN = -1  # table entry (and lookup result) meaning "no successor known"


def _last_of_group(group: torch.Tensor) -> torch.Tensor:
    """``[M]`` bool: entry ``i`` is the last (highest index) entry of its group.

    Args:
        group: ``[M]`` int64 non-negative group ids.
    """
    m = group.shape[0]
    position = torch.arange(m, device=group.device)
    order = (group * m + position).argsort()  # by group, then position; keys are unique
    sorted_group = group[order]
    last_sorted = torch.ones(m, dtype=torch.bool, device=group.device)
    last_sorted[:-1] = sorted_group[1:] != sorted_group[:-1]
    return torch.zeros_like(last_sorted).scatter_(0, order, last_sorted)


def _first_of_group(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First occurrence and occurrence ordinal of each entry within its group.

    Args:
        group: ``[M]`` int64 non-negative group ids.

    Returns:
        ``(is_first [M] bool, ordinal [M] int64)``: ``ordinal`` counts the earlier entries of the
        same group.
    """
    m = group.shape[0]
    position = torch.arange(m, device=group.device)
    order = (group * m + position).argsort()
    sorted_group = group[order]
    first_sorted = torch.ones(m, dtype=torch.bool, device=group.device)
    first_sorted[1:] = sorted_group[1:] != sorted_group[:-1]
    group_start = torch.where(first_sorted, position, 0).cummax(dim=0).values
    ordinal = torch.empty_like(position).scatter_(0, order, position - group_start)
    is_first = torch.zeros_like(first_sorted).scatter_(0, order, first_sorted)
    return is_first, ordinal


class SuccessorTable:
    """An ``[V, k]`` int32 table of successor token ids, shared by every request of an engine.

    Memory: ``V * k * 4`` bytes (V = 151,936, k = 8: 4.9 MB), plus one scratch row that absorbs
    the writes a batched call discards.

    Args:
        vocab_size: V.
        k: successors kept per token (ranks ``0 .. k - 1``, best first).
        device: where the table lives (the target's device).
    """

    def __init__(self, vocab_size: int, k: int = 8, device: torch.device | str = "cpu") -> None:
        if vocab_size < 1 or not 1 <= k <= vocab_size:
            raise ValueError(
                f"need vocab_size >= 1 and 1 <= k <= vocab_size, got {vocab_size}, {k}"
            )
        self.vocab_size = vocab_size
        self.k = k
        # Row V is a sink: writes that a fixed-shape call must issue but discard land there.
        self._rows = torch.full((vocab_size + 1, k), UNKNOWN, dtype=torch.int32, device=device)

    @property
    def table(self) -> torch.Tensor:
        """``[V, k]`` int32 view of the table."""
        return self._rows[: self.vocab_size]

    @property
    def device(self) -> torch.device:
        return self._rows.device

    def reset(self) -> None:
        """Forget every successor."""
        self._rows.fill_(UNKNOWN)

    def update(
        self, tokens: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor | None = None
    ) -> None:
        """Write ``row[tokens[i]] = topk(logits[i], k)`` for every valid verified node, at once.

        When several valid entries share a token, the last one (highest ``i``) wins, whatever
        the device: only that entry writes the row, the others write the sink row. The engine
        passes the verify window request by request, slots in breadth-first order, so the
        deepest, latest-verified context of a token wins.

        Args:
            tokens: ``[M]`` int token of each verified node.
            logits: ``[M, V]`` the target's logits at each node (its next-token scores).
            valid: optional ``[M]`` bool; false entries (padding slots) write nothing.
        """
        if logits.shape != (tokens.shape[0], self.vocab_size):
            raise ValueError(
                f"logits must be [M, V] = [{tokens.shape[0]}, {self.vocab_size}], "
                f"got {tuple(logits.shape)}"
            )
        tokens = tokens.to(device=self.device, dtype=torch.long)
        group = tokens if valid is None else torch.where(valid, tokens, self.vocab_size)
        writes = _last_of_group(group) & (group < self.vocab_size)
        successors = torch.topk(logits, self.k, dim=-1, sorted=True).indices.to(torch.int32)
        self._rows.index_copy_(0, torch.where(writes, tokens, self.vocab_size), successors)

    def observe(self, token_ids: torch.Tensor) -> None:
        """Warm start from the bigrams ``(t[j], t[j + 1])`` along the last dim of ``token_ids``.

        Rule: an observed successor ``b`` of ``a`` takes the first free rank of row ``a`` unless
        ``b`` is already in the row; a full row is left alone, so target-written rows (always
        full) never change. Within one call, the distinct successors of ``a`` fill its free
        ranks in order of first occurrence (row-major over ``token_ids``); the surplus is
        dropped. Negative ids are padding: bigrams touching them are skipped.

        Args:
            token_ids: ``[..., T]`` int token ids, ``-1`` padded.
        """
        ids = token_ids.to(device=self.device, dtype=torch.long)
        prev = ids[..., :-1].reshape(-1)  # [N]
        succ = ids[..., 1:].reshape(-1)
        if prev.numel() == 0:
            return
        usable = (prev >= 0) & (succ >= 0)
        prev, succ = prev.clamp_min(0), succ.clamp_min(0)
        row = self._rows[prev]  # [N, k]
        keep = usable & ~(row == succ.unsqueeze(1)).any(dim=1)
        pair = torch.where(keep, prev * self.vocab_size + succ, self.vocab_size**2)
        first_pair, _ = _first_of_group(pair)
        keep &= first_pair
        _, ordinal = _first_of_group(torch.where(keep, prev, self.vocab_size))
        rank = (row != UNKNOWN).sum(dim=1) + ordinal  # known entries are a prefix of the row
        write = keep & (rank < self.k)
        index = (torch.where(write, prev, self.vocab_size), torch.where(write, rank, 0))
        self._rows.index_put_(index, succ.to(torch.int32))

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` int64 successor rows of ``tokens [...]``; an UNKNOWN token gives an
        all-UNKNOWN row."""
        tokens = tokens.to(torch.long)
        rows = self._rows[tokens.clamp_min(0)].to(torch.long)
        return torch.where((tokens >= 0).unsqueeze(-1), rows, UNKNOWN)

    def lookup(self, parent_tokens: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """``M[parent, rank]`` as int64, broadcasting ``parent_tokens`` against ``ranks``.

        An UNKNOWN parent gives UNKNOWN, so a lookup chain stops at the first unknown token.
        """
        parent_tokens, ranks = torch.broadcast_tensors(parent_tokens.to(torch.long), ranks)
        found = self._rows[parent_tokens.clamp_min(0), ranks.to(torch.long)].to(torch.long)
        return torch.where(parent_tokens >= 0, found, UNKNOWN)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"table": [V, k] int32}`` (a copy), for a persisted warm-up."""
        return {"table": self.table.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a table saved by :meth:`state_dict` (same ``V`` and ``k``)."""
        table = state["table"]
        if tuple(table.shape) != (self.vocab_size, self.k):
            raise ValueError(
                f"table of shape {tuple(table.shape)} does not fit [V, k] = "
                f"[{self.vocab_size}, {self.k}]"
            )
        self.table.copy_(table.to(torch.int32))
