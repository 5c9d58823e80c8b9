"""Frequency, presence and repetition penalties and ``min_new_tokens``, exact inside a tree.

Without speculation the target's token at output position ``n`` is drawn from logits penalised
by the counts of the ``n`` output tokens before it. In a verify window, the slot of a node at
depth ``d`` predicts output position ``n + d`` (``n`` = the request's committed output tokens,
the root included), so its logits need the counts of the committed output PLUS the tokens of
its own path (its ancestors and itself, the root excluded: the root is committed). Each slot
therefore gets:

* the request's base penalty (the committed output's), one ``[bs, V]`` tensor broadcast over
  the window, as SGLang applies it to a plain decode step; then
* a sparse correction at the at most ``L`` tokens of its own path: their penalised logits are
  recomputed from the raw logits with the path's counts added (never a dense ``[bs, W, V]``
  count tensor);
* ``min_new_tokens``: the stop tokens are masked at the slots whose output length ``n + d`` is
  below the minimum.

The arithmetic is SGLang's penalizers' (0.5.17 / 0.5.23), step for step, so the penalised
logits equal those of a plain decode step bit for bit: the additive penalty
``(0 - frequency_count) - presence`` (frequency counts cumulated one occurrence at a time),
added to the logits, then the repetition scaling ``x * r`` for ``x < 0`` else ``x / r``,
then ``-inf`` at masked stop tokens. Pure torch, batched, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_tree_spec.host_copy import to_device


@dataclass(frozen=True)
class TreePenalties:
    """The penalty state of ``bs`` requests at the start of a decode step.

    Attributes:
        frequency, presence, repetition: ``[bs]`` float32 per-request penalties (neutral: 0, 0,
            1).
        base_frequency: ``[bs, V]`` float32 ``frequency`` added once per occurrence of each
            token in the committed output (one addition at a time, as SGLang cumulates).
        base_presence: ``[bs, V]`` float32 ``presence`` at the tokens of the committed output.
        base_repetition: ``[bs, V]`` float32 ``repetition`` at those tokens, 1 elsewhere.
        min_new_tokens: ``[bs]`` int64 (0: none).
        output_lens: ``[bs]`` int64 output tokens committed so far (the root included).
        stop_tokens: ``[bs, V]`` bool the tokens ``min_new_tokens`` masks.
    """

    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    base_frequency: torch.Tensor
    base_presence: torch.Tensor
    base_repetition: torch.Tensor
    min_new_tokens: torch.Tensor
    output_lens: torch.Tensor
    stop_tokens: torch.Tensor

    @classmethod
    def from_outputs(
        cls,
        outputs: list[list[int]],
        frequency: list[float],
        presence: list[float],
        repetition: list[float],
        min_new_tokens: list[int],
        stop_tokens: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> TreePenalties:
        """The state after the committed ``outputs`` (one token list per request)."""
        bs = len(outputs)
        f32 = {"dtype": torch.float32, "device": device}
        freq = to_device(frequency, device, torch.float32)
        pres = to_device(presence, device, torch.float32)
        rep = to_device(repetition, device, torch.float32)
        width = max((len(out) for out in outputs), default=0)
        ids = torch.full((bs, width + 1), vocab_size, dtype=torch.int64)  # col V: padding
        for row, out in enumerate(outputs):
            ids[row, : len(out)] = torch.tensor(out, dtype=torch.int64)
        base_freq, base_pres, base_rep = _count(
            torch.zeros(bs, vocab_size + 1, **f32),
            torch.zeros(bs, vocab_size + 1, **f32),
            torch.ones(bs, vocab_size + 1, **f32),
            to_device(ids, device),
            freq,
            pres,
            rep,
        )
        stop_width = max((len(s) for s in stop_tokens), default=0)
        stop_ids = torch.full((bs, stop_width + 1), vocab_size, dtype=torch.int64)
        for row, stops in enumerate(stop_tokens):
            stop_ids[row, : len(stops)] = torch.tensor(sorted(stops), dtype=torch.int64)
        stop = torch.zeros(bs, vocab_size + 1, dtype=torch.bool, device=device)
        stop.scatter_(1, to_device(stop_ids, device), True)
        return cls(
            frequency=freq,
            presence=pres,
            repetition=rep,
            base_frequency=base_freq[:, :vocab_size],
            base_presence=base_pres[:, :vocab_size],
            base_repetition=base_rep[:, :vocab_size],
            min_new_tokens=to_device(min_new_tokens, device, torch.int64),
            output_lens=to_device([len(o) for o in outputs], device, torch.int64),
            stop_tokens=stop[:, :vocab_size],
        )

    def with_missing(
        self, tokens: torch.Tensor, valid: torch.Tensor, output_lens: torch.Tensor
    ) -> TreePenalties:
        """The state after the committed output plus ``tokens [bs, M]`` where ``valid [bs,
        M]`` (output tokens the host's lists lack yet: overlap scheduling), with
        ``output_lens [bs]`` the true output counts. Same arithmetic as :meth:`from_outputs`:
        one frequency addition per occurrence (equal addends, so the order is immaterial)."""
        bs, vocab_size = self.base_frequency.shape
        pad = torch.zeros(bs, 1, dtype=torch.float32, device=tokens.device)
        freq, pres, rep = _count(
            torch.cat([self.base_frequency, pad], dim=1),
            torch.cat([self.base_presence, pad], dim=1),
            torch.cat([self.base_repetition, pad + 1], dim=1),
            torch.where(valid, tokens, vocab_size),  # column V: padding
            self.frequency,
            self.presence,
            self.repetition,
        )
        return TreePenalties(
            frequency=self.frequency,
            presence=self.presence,
            repetition=self.repetition,
            base_frequency=freq[:, :vocab_size],
            base_presence=pres[:, :vocab_size],
            base_repetition=rep[:, :vocab_size],
            min_new_tokens=self.min_new_tokens,
            output_lens=output_lens.to(torch.int64),
            stop_tokens=self.stop_tokens,
        )


def _count(
    base_freq: torch.Tensor,
    base_pres: torch.Tensor,
    base_rep: torch.Tensor,
    ids: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
    rep: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bases ``[bs, V + 1]`` (column V: padding) after the tokens ``ids [bs, M]`` (V where
    none): one ``freq`` addition per occurrence, ``pres`` and ``rep`` set where a token
    occurs. In place; returns the three bases."""
    ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    base_freq.scatter_add_(1, ids, freq[:, None] * ones)
    base_pres.scatter_(1, ids, pres[:, None] * ones)
    base_rep.scatter_(1, ids, rep[:, None] * ones)
    return base_freq, base_pres, base_rep


def _scaled(values: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """SGLang's repetition scaling: ``x * s`` where ``x < 0``, else ``x / s``."""
    return torch.where(values < 0, values * scaling, values / scaling)


def path_slots(ancestor_mask: torch.Tensor, depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[bs, W, max_depth]``: entry ``k`` of slot ``s`` is its ``k``-th ancestor (``k = 0``:
    itself), 0 (the root) past the root.

    Args:
        ancestor_mask: ``[bs, W, W]`` bool, ``mask[b, s, j]``: ``j`` is ``s`` or an ancestor.
        depths: ``[bs, W]`` int64 slot depths (root 0).
    """
    bs, window = depths.shape
    slots = torch.arange(window, device=depths.device)
    above = ancestor_mask & (slots[None, :] != slots[:, None])  # strict ancestors
    parent = torch.where(above, depths[:, None, :] + 1, 0).argmax(dim=2)  # deepest; root: 0
    chain = [slots.expand(bs, window)]
    for _ in range(max_depth - 1):
        chain.append(parent.gather(1, chain[-1]))
    return torch.stack(chain, dim=2)


def penalize_tree_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    penalties: TreePenalties,
    max_depth: int,
) -> torch.Tensor:
    """Penalise verify logits in place, each slot by its own path's counts; returns them.

    Args:
        logits: ``[bs, W, V]`` raw verify logits (slot 0 the root).
        tokens: ``[bs, W]`` int64 window tokens (root, then nodes).
        ancestor_mask: ``[bs, W, W]`` bool (see :mod:`sglang_tree_spec.tree.layout`).
        depths: ``[bs, W]`` int64 slot depths (root 0).
        penalties: the requests' state before the step.
        max_depth: the deepest a slot can be (bounds the path length ``L``).
    """
    bs, window, _ = logits.shape
    depth_bound = max(1, min(max_depth, window - 1))
    chain = path_slots(ancestor_mask, depths, depth_bound)  # [bs, W, L]
    on_path = chain != 0  # the root's token is committed: in the base counts already
    path_tokens = tokens.gather(1, chain.flatten(1)).view(bs, window, depth_bound)
    # Every entry writes the value of some token of its slot's path; entries past the path
    # repeat entry 0 (the slot's own token, or the root's for the root slot), so duplicate
    # writes carry equal values.
    index = torch.where(on_path, path_tokens, path_tokens[:, :, :1])  # [bs, W, L]
    raw = logits.gather(2, index).float()
    same = (index[:, :, :, None] == path_tokens[:, :, None, :]) & on_path[:, :, None, :]
    count = same.sum(dim=3)  # [bs, W, L] occurrences of the entry's token on the path

    def per_token(base: torch.Tensor) -> torch.Tensor:  # [bs, V] -> [bs, W, L]
        return base.gather(1, index.flatten(1)).view(bs, window, depth_bound)

    freq = penalties.frequency.view(bs, 1, 1)
    frequency_total = per_token(penalties.base_frequency)
    for occurrence in range(depth_bound):  # one addition per occurrence, as SGLang cumulates
        frequency_total = torch.where(count > occurrence, frequency_total + freq, frequency_total)
    seen = count > 0
    presence_total = torch.where(
        seen, penalties.presence.view(bs, 1, 1), per_token(penalties.base_presence)
    )
    repetition_total = torch.where(
        seen, penalties.repetition.view(bs, 1, 1), per_token(penalties.base_repetition)
    )
    additive = (0.0 - frequency_total) - presence_total
    path_values = _scaled(raw + additive, repetition_total)

    base_additive = (0.0 - penalties.base_frequency) - penalties.base_presence  # [bs, V]
    logits.add_(base_additive[:, None, :].to(logits.dtype))
    logits.copy_(_scaled(logits, penalties.base_repetition[:, None, :].to(logits.dtype)))
    logits.scatter_(2, index, path_values.to(logits.dtype))
    short = penalties.output_lens[:, None] + depths < penalties.min_new_tokens[:, None]
    logits.masked_fill_(short[:, :, None] & penalties.stop_tokens[:, None, :], float("-inf"))
    return logits
