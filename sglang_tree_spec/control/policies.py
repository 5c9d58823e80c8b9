"""Budget control's mechanisms around the objective: small policies behind one protocol.

:class:`~.controller.BudgetController` keeps the objective, the calibration and the latency
model; each mechanism below sees the controller through the hooks of :class:`Policy` (each a
no-op by default) and keeps its own state. The controller asks its policies in order
(``Profile``, ``PlainRuns``, ``Explorations``, ``Holds``); the first with a say decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_tree_spec.control.latency import bucket_of

if TYPE_CHECKING:
    from sglang_tree_spec.control.config import ControlConfig
    from sglang_tree_spec.control.controller import BudgetController

# A policy's say on a drafted step: (budget, reason), budget None: forecast now.
Say = tuple[int | None, str]


@dataclass(frozen=True)
class Choice:
    """A forecast's choice: the ``[C]`` predicted committed tokens of the batch and step times
    C(bs, N), the tree's size, the argmax ``best`` and the ``verified`` budget (> 0)."""

    bs: int
    totals: list[float]
    seconds: list[float]
    tree_budget: int
    best: int
    verified: int


class Policy:
    """The hooks a budget mechanism has; each a no-op (no say, nothing to do) by default."""

    def drafts(self, ctl: BudgetController, bs: int) -> tuple[bool, str] | None:
        """Whether the step drafts, and why; None: no say."""
        return None

    def budget(self, ctl: BudgetController, bs: int, after_plain: bool) -> Say | None:
        """A drafted step's budget without a forecast; None: no say."""
        return None

    def skipped(self, ctl: BudgetController, bs: int) -> None:
        """A step that did not draft."""

    def chose(self, ctl: BudgetController, choice: Choice) -> None:
        """After a forecast's choice (host)."""

    def committed(self, ctl: BudgetController, budget: int, accept_len: torch.Tensor) -> None:
        """A drafted step that did not forecast was verified at ``budget``."""

    def keeps_time(self, ctl: BudgetController, budget: int, drafted: bool, forecast: bool) -> bool:
        """Whether a measured step's time may set its cell."""
        return True

    def timing(self, ctl: BudgetController, bs: int, budget: int) -> None:
        """Before a kept time is recorded."""

    def timed(self, ctl: BudgetController, bs: int, budget: int) -> None:
        """After a kept time set its cell."""


class Profile(Policy):
    """The start-up profile: every candidate's C(bs, N) measured ``profile_steps`` times in
    the first profiled batch-size bucket (:meth:`LatencyModel.profiles`), round robin so one
    slow spell does not set whole cells; every later bucket profiles its contenders alone
    (``explore_margin`` at its first forecast: a budget that loses by more is not worth its
    profile steps). Budget 0's profile steps are plain steps."""

    def __init__(self, config: ControlConfig) -> None:
        self.steps = config.profile_steps
        self.whole = False  # a bucket's row has every candidate measured

    def next(self, ctl: BudgetController, bs: int) -> int | None:
        """The first candidate of the fewest measurements in its cell while under
        ``profile_steps``; None once the bucket is profiled (or before its first forecast)."""
        latency = ctl.latency
        if not latency.profiles(bs):
            return None
        if not self.whole:
            self.whole = any(min(row) >= self.steps for row in latency.count)
        bucket = bucket_of(latency.bs_buckets, bs)
        every = ctl.config.budgets
        budgets = ctl.explorations.contenders.get(bucket) if self.whole else every
        if budgets is None:
            return None
        counts = latency.count[bucket]
        fewest, budget = min((counts[every.index(b)], b) for b in budgets)
        return budget if fewest < self.steps else None

    def drafts(self, ctl, bs):
        profiled = self.next(ctl, bs)
        return None if profiled is None else (profiled != 0, "profile")

    def budget(self, ctl, bs, after_plain):
        profiled = self.next(ctl, bs)
        return None if profiled is None else (profiled, "profile")


class PlainRuns(Policy):
    """Plain steps while drafting does not pay. A run starts when a forecast prefers budget 0
    and the drafted steps' decayed averages (recent and long-run) of committed tokens per
    request against their cost in plain forwards say drafting does not pay either; it probes
    (drafts to re-forecast) after ``probe_every`` steps, the interval doubling up to
    ``probe_max_every`` while drafting still does not pay, and ends at a probe after which it
    pays. A hard forecast amid paying drafts takes ``hard_plain_steps`` plain steps alone."""

    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.active = False  # the last forecast preferred plain steps: draft only to probe
        self.interval = config.probe_every  # steps from one probe to the next
        long = config.plain_long_decay
        self.decays = (config.plain_decay,) + (() if long is None else (long,))
        # per average: decayed sums of committed tokens per request and of step time / C(bs, 0)
        self.gain = [[0.0, 0.0] for _ in self.decays]
        self.held: list[tuple[int, int]] = []  # (budget, batch size) of held steps to fold in

    def drafts(self, ctl, bs):
        if not self.active:
            return None  # a drafting probe's reason: the holds'
        probe = ctl.arrivals >= bs or ctl.steps_since_draft + 1 >= self.interval
        return probe, "plain"

    def committed(self, ctl, budget, accept_len):
        if ctl.config.budgets[0] == 0:  # the drafted steps that did not forecast join the
            self.held.append((budget, accept_len.numel()))  # average: forecasts are the hard ones

    def chose(self, ctl, choice):
        self._fold(ctl)
        config = self.config
        if config.budgets[0] == 0:
            column = config.budgets.index(choice.verified)
            seconds = choice.seconds
            self._add(choice.totals[column] / choice.bs, seconds[column] / seconds[0])
        pays = self.pays()
        hard = config.hard_plain_steps
        if choice.best == 0 and pays and hard:  # a hard stretch amid paying drafts: briefly
            self.active, self.interval = True, hard + 1
        elif self.active and pays:  # a probe: drafting pays again on average, the run ends
            self.active, self.interval = False, config.probe_every
        elif self.active:  # a probe after which drafting still does not pay: probe less often
            self.interval = min(2 * self.interval, config.probe_max_every)
        elif choice.best == 0 and not pays:  # plain steps pay more, now and on average
            self.active = True

    def pays(self) -> bool:
        """In the recent or the long-run average, drafted steps commit more tokens per request
        than their time in plain forwards (a plain forward commits one)."""
        return any(tokens > plain_steps for tokens, plain_steps in self.gain)

    def _add(self, tokens_per_request: float, plain_steps: float) -> None:
        for decay, gain in zip(self.decays, self.gain, strict=True):
            gain[0] = decay * gain[0] + tokens_per_request
            gain[1] = decay * gain[1] + plain_steps

    def _fold(self, ctl: BudgetController) -> None:
        """The held steps since the last forecast join the decayed sums, in order, each
        priced at the latency model's times now."""
        if not self.held:
            return
        budgets, rows, costs = ctl.config.budgets, {}, []
        for budget, bs in self.held:
            seconds = rows.get(bs) or rows.setdefault(bs, ctl.latency.row(bs))
            costs.append(seconds[budgets.index(budget)] / seconds[0])
        means = ctl.totals.held_means
        for decay, gain in zip(self.decays, self.gain, strict=True):
            weight = 1.0
            tokens = cost = accepted = 0.0  # decayed sums, the latest step weighted 1
            for step_cost, step_accepted in zip(reversed(costs), reversed(means), strict=True):
                tokens, cost = tokens + weight, cost + weight * step_cost  # (+1: the bonus)
                accepted += weight * step_accepted
                weight *= decay
            gain[0], gain[1] = weight * gain[0] + accepted + tokens, weight * gain[1] + cost
        self.held, ctl.totals.held_means = [], []


class Explorations(Policy):
    """Every ``explore_every`` drafted steps, re-measure the contender whose cell in the
    bucket was measured longest ago, for ``explore_steps`` steps, so a cell measured once under
    load is not avoided for ever. Contenders: budgets within ``explore_margin`` of the best
    predicted rate, cells dearer than a larger budget's (``explore_inverted``) and the best's
    stale neighbours (``explore_stale_neighbours``). When the stalest is budget 0, one plain
    step comes first (C(bs, 0) is measured by plain steps alone)."""

    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.measured_at: dict[int, dict[int, int]] = {}  # bucket -> budget -> step stamp
        self.contenders: dict[int, list[int]] = {}  # bucket -> its last forecast's contenders
        self.plain_explored = -1  # the drafted-step count at the last plain exploration step
        after = config.forget_after
        self.forget_after = config.explore_every if after is None else after  # 0: never

    def _next(self, ctl: BudgetController) -> bool:
        """The next drafted step is an exploration step."""
        every = self.config.explore_every
        return bool(every) and (ctl.drafted_steps + 1) % every == 0

    def _stalest(self, ctl: BudgetController, bs: int, drafted: bool) -> int:
        """The contender measured longest ago; ``drafted``: among those > 0 (every budget > 0
        when none is)."""
        bucket = bucket_of(ctl.latency.bs_buckets, bs)
        stamps = self.measured_at.setdefault(bucket, {})
        budgets = self.contenders.get(bucket, self.config.budgets)
        if drafted:
            budgets = [b for b in budgets if b > 0] or [b for b in self.config.budgets if b > 0]
        return min(budgets, key=lambda b: stamps.get(b, -1))

    def _explores_plain(self, ctl: BudgetController, bs: int) -> bool:
        """The exploration is next, budget 0's cell is the stalest and no plain step has
        explored it yet: once, or every later step would be plain."""
        return (
            self._next(ctl)
            and self.plain_explored != ctl.drafted_steps
            and self._stalest(ctl, bs, drafted=False) == 0
        )

    def drafts(self, ctl, bs):
        return (False, "explore") if self._explores_plain(ctl, bs) else None

    def budget(self, ctl, bs, after_plain):
        if ctl.plain_run or not self._next(ctl):
            return None
        ctl.drafted_steps += 1
        budget = self._stalest(ctl, bs, drafted=True)
        steps = self.config.explore_steps + after_plain  # the first after a plain step: untimed
        ctl.holds.interrupt((budget, bs, steps - 1, "explore") if steps > 1 else None)
        return budget, "explore"

    def skipped(self, ctl, bs):
        if ctl.plain_run or ctl.profile.next(ctl, bs) is not None:
            return
        if self._explores_plain(ctl, bs):
            self.plain_explored = ctl.drafted_steps  # the exploration drafts next

    def chose(self, ctl, choice):
        margin, budgets = self.config.explore_margin, self.config.budgets
        bucket = bucket_of(ctl.latency.bs_buckets, choice.bs)
        rates = [t / c for t, c in zip(choice.totals, choice.seconds, strict=True)]
        reached = [r for b, r in zip(budgets, rates, strict=True) if b <= choice.tree_budget]
        top = max(reached)
        inverted = self.config.explore_inverted
        suspect = set() if inverted is None else set(ctl.latency.inverted(choice.bs, inverted))
        if self.config.explore_stale_neighbours:
            suspect.update(self._stale_neighbours(ctl, bucket, budgets.index(choice.best)))
        self.contenders[bucket] = [
            b
            for b, r in zip(budgets, rates, strict=True)
            if (r >= (1.0 - margin) * top if b <= choice.tree_budget else margin >= 1.0)
            or b in suspect
        ]

    def _stale_neighbours(self, ctl: BudgetController, bucket: int, at: int) -> list[int]:
        """The drafted budgets next to ``budgets[at]`` whose cell was last measured
        ``forget_after`` or more drafted steps ago, or never."""
        after, budgets = self.forget_after, self.config.budgets
        if not after:
            return []
        stamps = self.measured_at.get(bucket, {})
        beside = budgets[max(at - 1, 0) : at + 2]
        return [
            b
            for b in beside
            if b > 0 and b != budgets[at] and ctl.drafted_steps - stamps.get(b, -after) >= after
        ]

    def timing(self, ctl, bs, budget):
        stamps = self.measured_at.setdefault(bucket_of(ctl.latency.bs_buckets, bs), {})
        after = self.forget_after
        if after and budget in stamps and ctl.drafted_steps - stamps[budget] >= after:
            ctl.latency.forget(bs, budget)  # stale: its fresh times set it afresh

    def timed(self, ctl, bs, budget):
        self.measured_at[bucket_of(ctl.latency.bs_buckets, bs)][budget] = ctl.drafted_steps


class Holds(Policy):
    """A forecast's budget > 0 holds for ``hold_steps`` drafted steps of the same batch (no
    forecast, a tree no larger than verified), twice as long when the forecast before chose it
    too, up to ``hold_max_steps``. As many arrivals as the batch holds, a batch that grows past
    the one the choice was made for, a probe and the profile end a hold; an exploration
    interrupts it, and it goes on after with the steps it had left."""

    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        # (budget, batch size, steps left, its steps' REASONS: "held", or "explore")
        self.hold: tuple[int, int, int, str] | None = None
        self.resume: tuple[int, int, int, str] | None = None  # the hold an exploration paused
        self.last: tuple[int, int] | None = None  # (budget, steps) of the last choice's hold

    def interrupt(self, hold: tuple[int, int, int, str] | None) -> None:
        """An exploration's own hold; the one it interrupts goes on after it."""
        self.resume, self.hold = self.hold, hold

    def budget(self, ctl, bs, after_plain):
        hold = self.hold
        if hold is None and self.resume is not None:  # an exploration ended
            hold, self.resume = self.resume, None
        if hold is None or bs > hold[1] or ctl.arrivals >= bs:
            self.hold = None
            return None, self._forecast_reason(ctl, hold, bs)
        budget, chosen_for, left, reason = hold
        self.hold = (budget, chosen_for, left - 1, reason) if left > 1 else None
        ctl.drafted_steps += 1
        return budget, reason

    @staticmethod
    def _forecast_reason(ctl: BudgetController, hold, bs: int) -> str:
        if ctl.arrivals >= bs:
            return "arrivals"
        if ctl.plain_run:
            return "probe"
        return "grew" if hold is not None else "expired"

    def chose(self, ctl, choice):
        self.resume = None
        if ctl.plain_run:
            self.last = None  # after a plain run, the next choice holds hold_steps
        elif self.config.hold_steps > 1:
            self.hold = (choice.verified, choice.bs, self._length(choice.verified) - 1, "held")

    def _length(self, budget: int) -> int:
        """``hold_steps``, twice the last choice's hold when that chose ``budget`` too, at most
        ``hold_max_steps``."""
        steps, cap = self.config.hold_steps, self.config.hold_max_steps
        if cap is not None and self.last is not None and self.last[0] == budget:
            steps = min(2 * self.last[1], cap)
        self.last = (budget, steps)
        return steps

    def keeps_time(self, ctl, budget, drafted, forecast):
        # a forecast step's extra cost does not depend on its budget: it would raise the held
        # budget's cell above those measured by held and exploration steps
        return not (forecast and self.config.hold_steps > 1)
