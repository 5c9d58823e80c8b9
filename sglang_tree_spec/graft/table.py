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

Partitions (tenant isolation): the table can hold ``P`` independent ``[V, k]`` tables. Every
read and write takes an optional per-entry partition index: an entry of partition ``p`` reads
and writes only partition ``p``'s rows, never another's, so requests of different partitions
cannot see what the others wrote. Partition ``-1`` (:data:`NO_PARTITION`) reads nothing (every
row UNKNOWN) and writes nothing. Without partition indices every entry is in partition 0, the
single shared table. Which request goes to which partition is the caller's choice
(:class:`~sglang_tree_spec.graft.partitions.TablePartitions`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

UNKNOWN = -1  # table entry (and lookup result) meaning "no successor known"
NO_PARTITION = -1  # partition index of an entry that reads and writes no table


def _last_of_group(group: torch.Tensor) -> torch.Tensor:
    """``[M]`` bool: entry ``i`` is the last (highest index) entry of its group.

    Args:
        group: ``[M]`` int64 non-negative group ids.
    """
    m = group.shape[0]
    sorted_group, order = group.sort(stable=True)  # by group, then position
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
    sorted_group, order = group.sort(stable=True)  # by group, then position
    first_sorted = torch.ones(m, dtype=torch.bool, device=group.device)
    first_sorted[1:] = sorted_group[1:] != sorted_group[:-1]
    group_start = torch.where(first_sorted, position, 0).cummax(dim=0).values
    ordinal = torch.empty_like(position).scatter_(0, order, position - group_start)
    is_first = torch.zeros_like(first_sorted).scatter_(0, order, first_sorted)
    return is_first, ordinal


class SuccessorTable:
    """``P`` partitions of an ``[V, k]`` int32 table of successor token ids (``P = 1``: one table
    shared by every request of an engine).

    Memory: ``P * V * k * 4`` bytes (V = 151,936, k = 8: 4.9 MB per partition), plus one scratch
    row that absorbs the writes a batched call discards.

    Every method takes an optional ``partitions`` tensor, broadcast against the leading
    (request) dimensions of its tokens: the partition of each entry, ``0 .. P - 1``, or
    :data:`NO_PARTITION`. None means partition 0 everywhere.

    Args:
        vocab_size: V.
        k: successors kept per token (ranks ``0 .. k - 1``, best first).
        device: where the table lives (the target's device).
        partitions: P, independent tables.
    """

    def __init__(
        self,
        vocab_size: int,
        k: int = 8,
        device: torch.device | str = "cpu",
        partitions: int = 1,
    ) -> None:
        if vocab_size < 1 or not 1 <= k <= vocab_size or partitions < 1:
            raise ValueError(
                f"need vocab_size >= 1, 1 <= k <= vocab_size and partitions >= 1, got "
                f"{vocab_size}, {k}, {partitions}"
            )
        self.vocab_size = vocab_size
        self.k = k
        self.partitions = partitions
        self._sink = partitions * vocab_size
        # Row P * V is a sink: writes that a fixed-shape call must issue but discard land there.
        self._rows = torch.full((self._sink + 1, k), UNKNOWN, dtype=torch.int32, device=device)

    @property
    def table(self) -> torch.Tensor:
        """``[V, k]`` int32 view of partition 0 (the whole table when ``P = 1``)."""
        return self.partition(0)

    def partition(self, index: int) -> torch.Tensor:
        """``[V, k]`` int32 view of partition ``index``."""
        if not 0 <= index < self.partitions:
            raise ValueError(f"partition {index} is not in [0, {self.partitions})")
        return self._rows[index * self.vocab_size : (index + 1) * self.vocab_size]

    @property
    def device(self) -> torch.device:
        return self._rows.device

    def reset(self, partition: int | None = None) -> None:
        """Forget every successor (of one partition only, when given)."""
        if partition is None:
            self._rows.fill_(UNKNOWN)
        else:
            self.partition(partition).fill_(UNKNOWN)

    def _row_index(self, tokens: torch.Tensor, partitions: torch.Tensor | None) -> torch.Tensor:
        """Row of each ``(token, partition)`` entry (int64, ``tokens``' shape): ``p * V +
        token``, or ``-1`` for an UNKNOWN token or :data:`NO_PARTITION`."""
        tokens = tokens.to(device=self.device, dtype=torch.long)
        if partitions is None:
            return tokens.clamp_min(UNKNOWN)
        parts = self._partitions(partitions, tokens)
        index = parts * self.vocab_size + tokens
        return torch.where((tokens >= 0) & (parts >= 0), index, -1)

    def _partitions(self, partitions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``partitions`` (``[bs]`` or broadcastable) as int64 of ``tokens``' shape: a ``[bs]``
        vector is aligned with the leading dimension of ``tokens``."""
        parts = partitions.to(device=self.device, dtype=torch.long)
        if parts.dim() == 1 and tokens.dim() > 1:
            parts = parts.view(-1, *([1] * (tokens.dim() - 1)))
        return parts.expand_as(tokens)

    def update(
        self,
        tokens: torch.Tensor,
        logits: torch.Tensor,
        valid: torch.Tensor | None = None,
        partitions: torch.Tensor | None = None,
    ) -> None:
        """Write ``row[tokens[i]] = topk(logits[i], k)`` for every valid verified node, at once.

        When several valid entries share a token (in one partition), the last one (highest
        ``i``) wins, whatever the device: only that entry writes the row, the others write the
        sink row. The engine passes the verify window request by request, slots in
        breadth-first order, so the deepest, latest-verified context of a token wins.

        Args:
            tokens: ``[M]`` int token of each verified node.
            logits: ``[M, V]`` the target's logits at each node (its next-token scores).
            valid: optional ``[M]`` bool; false entries (padding slots) write nothing.
            partitions: optional ``[M]`` int partition of each entry.
        """
        if logits.shape != (tokens.shape[0], self.vocab_size):
            raise ValueError(
                f"logits must be [M, V] = [{tokens.shape[0]}, {self.vocab_size}], "
                f"got {tuple(logits.shape)}"
            )
        index = self._row_index(tokens, partitions)
        if valid is not None:
            index = torch.where(valid.to(self.device), index, -1)
        group = torch.where(index >= 0, index, self._sink)
        writes = _last_of_group(group) & (group < self._sink)
        successors = torch.topk(logits, self.k, dim=-1, sorted=True).indices.to(torch.int32)
        self._rows.index_copy_(0, torch.where(writes, group, self._sink), successors)

    def observe(self, token_ids: torch.Tensor, partitions: torch.Tensor | None = None) -> None:
        """Warm start from the bigrams ``(t[j], t[j + 1])`` along the last dim of ``token_ids``.

        Rule: an observed successor ``b`` of ``a`` takes the first free rank of row ``a`` unless
        ``b`` is already in the row; a full row is left alone, so target-written rows (always
        full) never change. Within one call, the distinct successors of ``a`` fill its free
        ranks in order of first occurrence (row-major over ``token_ids``); the surplus is
        dropped. Negative ids are padding: bigrams touching them are skipped. Each sequence
        writes its own partition's rows.

        Args:
            token_ids: ``[..., T]`` int token ids, ``-1`` padded.
            partitions: optional ``[...]`` int partition of each sequence.
        """
        ids = token_ids.to(device=self.device, dtype=torch.long)
        prev = ids[..., :-1]
        if partitions is not None:
            parts = partitions.to(device=self.device, dtype=torch.long)
            prev = self._row_index(prev, parts.reshape(*parts.shape, 1).expand_as(prev))
        prev = prev.reshape(-1)  # [N] rows (tokens when unpartitioned)
        succ = ids[..., 1:].reshape(-1)
        if prev.numel() == 0:
            return
        usable = (prev >= 0) & (succ >= 0)
        prev, succ = prev.clamp_min(0), succ.clamp_min(0)
        row = self._rows[prev]  # [N, k]
        keep = usable & ~(row == succ.unsqueeze(1)).any(dim=1)
        pair = torch.where(keep, prev * self.vocab_size + succ, self._sink * self.vocab_size)
        first_pair, _ = _first_of_group(pair)
        keep &= first_pair
        _, ordinal = _first_of_group(torch.where(keep, prev, self._sink))
        rank = (row != UNKNOWN).sum(dim=1) + ordinal  # known entries are a prefix of the row
        write = keep & (rank < self.k)
        index = (torch.where(write, prev, self._sink), torch.where(write, rank, 0))
        self._rows.index_put_(index, succ.to(torch.int32))

    def rows(self, tokens: torch.Tensor, partitions: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., k]`` int64 successor rows of ``tokens [...]``; an UNKNOWN token (or
        :data:`NO_PARTITION`) gives an all-UNKNOWN row."""
        index = self._row_index(tokens, partitions)
        rows = self._rows[index.clamp_min(0)].to(torch.long)
        return torch.where((index >= 0).unsqueeze(-1), rows, UNKNOWN)

    def lookup(
        self,
        parent_tokens: torch.Tensor,
        ranks: torch.Tensor,
        partitions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``M[parent, rank]`` as int64, broadcasting ``parent_tokens`` against ``ranks``
        (``partitions``: ``[bs]``, aligned with their leading dimension).

        An UNKNOWN parent gives UNKNOWN, so a lookup chain stops at the first unknown token.
        """
        parent_tokens, ranks = torch.broadcast_tensors(parent_tokens.to(torch.long), ranks)
        index = self._row_index(parent_tokens, partitions)
        found = self._rows[index.clamp_min(0), ranks.to(torch.long)].to(torch.long)
        return torch.where(index >= 0, found, UNKNOWN)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"table": [P * V, k] int32}`` (a copy), for a persisted warm-up."""
        return {"table": self._rows[: self._sink].clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a table saved by :meth:`state_dict` (same ``P``, ``V`` and ``k``)."""
        table = state["table"]
        if tuple(table.shape) != (self._sink, self.k):
            raise ValueError(
                f"table of shape {tuple(table.shape)} does not fit [P * V, k] = "
                f"[{self._sink}, {self.k}]"
            )
        self._rows[: self._sink].copy_(table.to(torch.int32))
