"""Each request's newest output tokens on the device: exact penalties under overlap scheduling.

Penalties and ``min_new_tokens`` are computed from a request's committed output
(:mod:`.penalties`). Without overlap scheduling SGLang has appended every committed token to
``req.output_ids`` before the next step runs. Under overlap it runs step ``N + 1`` before it
processes step ``N``'s result: ``req.output_ids`` then lacks the tokens step ``N`` committed
(or the first token, when step ``N`` was the request's prefill). SGLang's own one-token decoding
accepts that lag (its penalties run one token late under overlap); DDTREE must not, since the
penalised distribution is the target's law.

:class:`RecentOutputs` keeps, per ``req_to_token`` row, the number of output tokens committed so
far and the newest ``width`` of them, both on the device and updated by the worker at every
step (no host read). When a step starts, a request's missing tokens are the newest
``count - len(req.output_ids)`` of them: at most one step's worth (SGLang keeps at most one
result unprocessed), so ``width`` = the most tokens a step commits.
"""

from __future__ import annotations

import torch

from sglang_tree_spec.host_copy import to_device


class RecentOutputs:
    """Output count and newest ``width`` output tokens of every request row, on ``device``."""

    def __init__(self, rows: int, width: int, device: torch.device | str) -> None:
        self.width = int(width)
        # [rows, width] the newest output tokens, oldest first
        self.tokens = torch.zeros(rows, self.width, dtype=torch.int64, device=device)
        self.counts = torch.zeros(rows, dtype=torch.int64, device=device)

    def prefilled(
        self, rows: torch.Tensor, first_tokens: torch.Tensor, host_counts: list[int]
    ) -> None:
        """A prefill of ``rows`` sampled ``first_tokens [bs]``; the requests had
        ``host_counts`` output tokens before it (0, or the outputs of a retracted request whose
        prompt now holds them). An intermediate chunk of a chunked prefill is overwritten by
        the request's last chunk, which precedes its first decode step."""
        before = to_device(host_counts, self.counts.device, torch.int64)
        self.counts[rows] = before + 1
        ones = torch.ones_like(before)
        self._push(rows, first_tokens.to(torch.int64).view(-1, 1), ones)

    def committed(self, rows: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """A decode step committed ``tokens [bs, P]`` (the first ``lens [bs]`` of each row)."""
        self.counts[rows] += lens.to(torch.int64)
        self._push(rows, tokens.to(torch.int64), lens.to(torch.int64))

    def _push(self, rows: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        joined = torch.cat([self.tokens[rows], tokens], dim=1)  # [bs, width + P]
        newest = lens[:, None] + torch.arange(self.width, device=lens.device)  # last `width`
        self.tokens[rows] = joined.gather(1, newest)

    def missing(
        self, rows: torch.Tensor, host_counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The output tokens not yet in the requests' host ``output_ids`` (whose lengths are
        ``host_counts``): ``tokens [bs, width]``, ``valid [bs, width]`` (the newest ``count -
        host_count`` entries) and every request's true output count ``[bs]``."""
        counts = self.counts[rows]
        host = to_device(host_counts, counts.device, torch.int64)
        first = self.width - (counts - host)  # [bs] first missing entry
        valid = torch.arange(self.width, device=counts.device)[None, :] >= first[:, None]
        return self.tokens[rows], valid, counts
