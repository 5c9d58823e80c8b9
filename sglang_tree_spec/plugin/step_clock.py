"""One step clock for every tensor-parallel rank.

Under auto each rank chooses the step's budget from its own latency model, which learns from
the step times it measures. Two ranks' clocks never read alike, so their models drift apart
and, at a near tie, choose different budgets: different verify windows, mismatched
collectives, a hang on NCCL. :class:`StepClock` makes every rank learn from rank 0's step
times (one small broadcast over the TP group's CPU side a step, under auto at TP > 1 only), so
every rank's controller sees the same inputs and makes the same choice. Fixed budgets need no
sharing: nothing a rank measures decides them.
"""

from __future__ import annotations

import os
from typing import Any

SKEW_ENV = "SGLANG_TREE_SPEC_TEST_STEP_SKEW"
"""Tests: ``RANK:SECONDS``, TP rank ``RANK``'s clock reads ``SECONDS`` slow per tree node of a
step (a skew that depends on the budget, so an unshared clock would choose differently)."""


def _skew(rank: int) -> float:
    value = os.environ.get(SKEW_ENV, "")
    if not value:
        return 0.0
    skewed_rank, seconds = value.split(":")
    return float(seconds) if int(skewed_rank) == rank else 0.0


class StepClock:
    """The step times a rank's controller learns from: its own at TP 1 or under a fixed
    budget, rank 0's under auto at TP > 1."""

    def __init__(self, tp_group: Any, auto: bool) -> None:
        self.tp_group = tp_group
        self.shared = auto and tp_group.world_size > 1
        self.skew = _skew(tp_group.rank_in_group)

    def elapsed(self, seconds: float, budget: int) -> float:
        """The step time to learn from, given this rank's measured ``seconds`` of a step at
        ``budget``. Every rank calls it once a step, in the same order (the steps are the
        same on every rank)."""
        seconds += self.skew * budget
        if self.shared:
            seconds = float(self.tp_group.broadcast_object(seconds, src=0))
        return seconds
