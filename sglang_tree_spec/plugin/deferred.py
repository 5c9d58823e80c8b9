"""The drafter's context KV of plain steps, written when the drafter next needs it.

Every committed token's target hidden states become the DFlash drafter's context KV (one
projection and, per drafter layer, a K/V projection, norm, rope and cache write). A plain step
(budget 0: auto found drafting not worth it) commits one token per request and drafts nothing,
so nothing reads that KV until the next drafted step. :class:`DeferredContext` keeps the plain
steps' hidden states instead and writes them in one batched append just before the drafter's
next forward (or when a request's buffer is full): the same KV at the same slots and
positions, written once per run of plain steps instead of once per step.

Only the rows of the batch being served are ever written: a request that finished (or was
retracted) with tokens pending leaves them unwritten, its slots may already hold another
request's KV, and its row starts empty again at its next prefill (:meth:`reset`). A request
SGLang finished after scheduling the batch (a grammar batch under overlap processes the previous
result first) has no row any more (``None``): nothing is pending or kept for it.

Pending tokens are always the newest of their request: a row with ``n`` pending tokens and
``prefix`` cached tokens has them at positions ``prefix - n .. prefix - 1``, stored at
``position % cap`` of the row's buffer.
"""

from __future__ import annotations

import torch

from sglang_tree_spec.host_copy import to_device

MAX_BUFFER_BYTES = 64 << 20  # the hidden-state buffer's size limit; deferral is off above it
MAX_PENDING = 64  # tokens a row keeps before a forced write (auto's longest probe interval)


class DeferredContext:
    """Per request row: how many plain-step tokens await their drafter context KV (host), and
    their target hidden states ``[rows, cap, Hc]`` (device, allocated at the first stash)."""

    def __init__(self, rows: int, cap: int) -> None:
        if cap < 2:
            raise ValueError(f"a deferred context needs a capacity of 2 or more, got {cap}")
        self.cap = cap
        self.counts = [0] * rows  # host: pending tokens of each row
        self.hidden: torch.Tensor | None = None

    @classmethod
    def for_pool(cls, rows: int, hidden_bytes: int) -> DeferredContext | None:
        """A context for ``rows`` request rows of ``hidden_bytes`` per token, holding up to
        :data:`MAX_PENDING` tokens a row within :data:`MAX_BUFFER_BYTES`; None (write every
        step, as DFlash does) when fewer than 2 a row fit."""
        cap = min(MAX_PENDING, MAX_BUFFER_BYTES // max(rows * hidden_bytes, 1))
        return cls(rows, cap) if cap >= 2 else None

    def reset(self, rows: list[int | None]) -> None:
        """Rows starting a new request (a prefill): nothing pending."""
        for row in rows:
            if row is not None:
                self.counts[row] = 0

    def pending(self, rows: list[int | None]) -> list[int]:
        """Host: the pending tokens of each of ``rows``."""
        return [0 if row is None else self.counts[row] for row in rows]

    def is_full(self, rows: list[int | None]) -> bool:
        """Host: some row of ``rows`` cannot take another token before a write."""
        return any(row is not None and self.counts[row] >= self.cap for row in rows)

    def stash(
        self,
        rows: list[int],
        rows_dev: torch.Tensor,
        prefix_lens: torch.Tensor,
        hidden: torch.Tensor,
    ) -> None:
        """A plain forward's committed tokens: ``hidden [bs, Hc]`` at positions ``prefix_lens
        [bs]`` of ``rows`` (host list and ``[bs]`` device copy). The caller empties full rows
        first (:meth:`is_full`)."""
        if self.hidden is None:
            shape = (len(self.counts), self.cap, hidden.shape[-1])
            self.hidden = torch.zeros(shape, dtype=hidden.dtype, device=hidden.device)
        self.hidden[rows_dev, prefix_lens % self.cap] = hidden
        for row in rows:
            if row is not None:
                self.counts[row] += 1

    def take(
        self, rows: list[int], rows_dev: torch.Tensor, prefix_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Empty ``rows``: their pending tokens as ``(hidden [bs, n, Hc], positions [bs, n],
        counts [bs])``, ``n`` the most pending, row ``b``'s first ``counts[b]`` entries real
        (the rest padding, at the row's last cached position); None when nothing is pending.

        Args:
            prefix_lens: ``[bs]`` the rows' cached tokens now (the pending ones included).
        """
        counts = self.pending(rows)
        width = max(counts, default=0)
        if width == 0:
            return None
        counts_dev = to_device(counts, prefix_lens.device, torch.int64)  # [bs]
        offsets = torch.arange(width, device=prefix_lens.device)
        positions = (prefix_lens - counts_dev)[:, None] + offsets  # [bs, n]
        positions = torch.minimum(positions, prefix_lens[:, None] - 1)  # padding: in range
        hidden = self.hidden[rows_dev[:, None], positions % self.cap]  # [bs, n, Hc]
        self.reset(rows)
        return hidden, positions, counts_dev
