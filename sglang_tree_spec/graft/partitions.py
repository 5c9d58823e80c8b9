"""Which partition of the successor table each request reads and writes (tenant isolation).

Graft's successor table (and the unified policy's edge estimate) learns from every verified
request. Shared by all requests, it is a timing side channel between tenants: a request whose
text another tenant's request produced recently is drafted better, and its latency shows it.
:class:`TablePartitions` gives every *isolation key* (a tenant, or a single request) its own
partition of the table, so a request reads only what requests of its own key wrote:

* a partition has at most one owner key at a time, and a key at most one partition;
* a key without a partition takes a free one, else the least recently used one not used by
  the batch being assigned, which is forgotten first (handed back as ``reset``: the caller
  clears it before the batch reads it), so nothing of the previous owner can be read;
* when every partition is used by other keys of the same batch, the key gets
  :data:`~sglang_tree_spec.graft.table.NO_PARTITION`: its requests read nothing learnt and
  write nothing (still exact: grafting never changes an output token, only how many tokens a
  step accepts).

Pure Python, host side, one call per batch. Deterministic: the same batches in the same order
give the same partitions (so every tensor-parallel rank assigns alike).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from sglang_tree_spec.graft.table import NO_PARTITION


class TablePartitions:
    """Owner keys of ``count`` partitions, assigned batch by batch (least recently used).

    Args:
        count: partitions of the table (at least 1).
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"need at least one partition, got {count}")
        self.count = count
        self._partition_of: dict[Hashable, int] = {}
        self._owner: list[Hashable | None] = [None] * count
        self._owned = [False] * count
        self._last_batch = [0] * count  # batch number that last used each partition
        self._batch = 0

    def owner(self, partition: int) -> Hashable | None:
        """The key that owns ``partition`` (None when it was never handed out)."""
        return self._owner[partition]

    def assign(self, keys: Sequence[Hashable]) -> tuple[list[int], tuple[int, ...]]:
        """The partition of each request of a batch, by its isolation key.

        Returns:
            ``(partitions, reset)``: one partition per key (NO_PARTITION when none is left),
            and the partitions that changed owner in this call, to clear before use.
        """
        self._batch += 1
        assigned: dict[Hashable, int] = {}
        reset: list[int] = []
        for key in keys:
            if key in assigned:
                continue
            partition = self._partition_of.get(key)
            if partition is None:
                partition = self._take()
                if partition != NO_PARTITION:
                    self._hand_over(partition, key)
                    reset.append(partition)
            if partition != NO_PARTITION:
                self._last_batch[partition] = self._batch
            assigned[key] = partition
        return [assigned[key] for key in keys], tuple(reset)

    def _take(self) -> int:
        """A partition for a new key: a never-owned one, else the least recently used one
        that this batch does not use; NO_PARTITION when there is none."""
        free = [p for p in range(self.count) if not self._owned[p]]
        if free:
            return free[0]
        idle = [p for p in range(self.count) if self._last_batch[p] < self._batch]
        if not idle:
            return NO_PARTITION
        return min(idle, key=lambda p: (self._last_batch[p], p))

    def _hand_over(self, partition: int, key: Hashable) -> None:
        if self._owned[partition]:
            del self._partition_of[self._owner[partition]]
        self._owner[partition], self._owned[partition] = key, True
        self._partition_of[key] = partition
