"""The budget controller: one choice per decode step for the whole batch.

N* = argmax_N sum_i (1 + A_i(N)) / C(bs, N) over the candidate budgets, A_i the calibrated
surrogate of request i, ties toward the smaller budget. The objective is the batch's predicted
committed tokens per second. At bs = 1 it is BASTION's rule; at large bs the target forward turns
compute-bound, C(bs, N) grows with bs * (N + 1) and N* shrinks. The mechanisms around it (the
start-up profile, plain runs, explorations, holds) are policies (:mod:`.policies`).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import replace
from functools import partial

import torch

from sglang_tree_spec.control.calibration import AcceptCalibrator, Factors
from sglang_tree_spec.control.config import ControlConfig
from sglang_tree_spec.control.latency import LatencyModel, bucket_of
from sglang_tree_spec.control.plan import Forecast, StepOutcome, StepPlan
from sglang_tree_spec.control.policies import Choice, Explorations, Holds, PlainRuns, Profile
from sglang_tree_spec.control.surrogate import budget_index, prefix_sums_at, rank_nodes
from sglang_tree_spec.control.totals import ControlStats, Totals


def best_budget(
    committed: list[float],
    seconds: list[float],
    budgets: tuple[int, ...],
    max_budget: int | None = None,
    tie_rtol: float = 1e-6,
    min_budget: int = 0,
) -> int:
    """Host argmax of committed[c] / seconds[c] over ``budgets`` (sorted ascending), ties
    (within ``tie_rtol``) toward the smaller budget; budgets above ``max_budget`` or below
    ``min_budget`` skipped (``budgets[0]`` when none is left).

    Args:
        committed: ``[C]`` predicted committed tokens of the batch, sum_i (1 + A_i(N)).
        seconds: ``[C]`` step time C(bs, N).
    """
    best, best_rate = budgets[0], -1.0
    for column, budget in enumerate(budgets):
        if max_budget is not None and budget > max_budget:
            break
        if budget < min_budget:
            continue
        rate = committed[column] / seconds[column]
        if rate > best_rate * (1.0 + tie_rtol):
            best, best_rate = budget, rate
    return best


class BudgetController:
    """Chooses each step's budget; holds the calibration (device) and latency (host) state.

    The step's interface is :meth:`plan`, :meth:`resolve` and :meth:`outcome`
    (:mod:`.plan`); they compose the finer calls below, which tests and benchmarks drive one
    at a time."""

    def __init__(
        self,
        config: ControlConfig,
        latency: LatencyModel | None,
        max_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if config.auto:
            if latency is None:
                raise ValueError("auto budget control needs a latency model")
            if latency.budgets != config.budgets:
                raise ValueError(f"latency budgets {latency.budgets} != {config.budgets}")
        self.config = config
        self.latency = latency
        self.calibrator = AcceptCalibrator(max_slots, config.max_depth, config.calibration, device)
        self.totals = Totals(device)
        self._budgets_t = budget_index(config.budgets, device)  # [C]
        # per request slot and candidate: the decayed average of its forecasts' A_i(N), and
        # whether it has one (a forecast's tree may not reach every candidate)
        self._average_accept = torch.zeros(max_slots, len(config.budgets), device=device)
        self._averaged = torch.zeros_like(self._average_accept, dtype=torch.bool)
        self.last_budget: int | None = None
        self.budget_counts: dict[int, int] = {}
        self.steps_since_draft = 0
        self.arrivals = 0  # requests arrived since the last forecast
        self.drafted_steps = 0  # drafted auto steps after the profile (held ones too)
        self._drafted_seen = 0  # drafted steps on the calibration's stride (_stride)
        self._after_plain = False  # this drafted step follows a plain one (record_step)
        self.reason = ""  # why the last step has its budget (one of REASONS)
        self.profile, self.plain_runs = Profile(config), PlainRuns(config)
        self.explorations, self.holds = Explorations(config), Holds(config)
        self.policies = (self.profile, self.plain_runs, self.explorations, self.holds)

    @property
    def auto(self) -> bool:
        return self.config.auto

    @property
    def plain_run(self) -> bool:
        """The last forecast preferred plain steps: the steps draft only to probe."""
        return self.plain_runs.active

    def plan(self, bs: int, drafts: bool = True) -> StepPlan:
        """Host only: whether the step drafts (``drafts``: it can), and its budget when no
        forecast is needed, else the width of the tree to forecast from."""
        if not (drafts and self.should_draft(bs)):
            self.choose(None, bs)
            return StepPlan(bs, False, 0, 0, self.reason)
        held = self.held_budget(bs)
        width = self.tree_budget(bs) if held is None else held
        return StepPlan(bs, True, held, width, self.reason)

    def resolve(self, plan: StepPlan, rows: torch.Tensor, tree) -> Forecast:
        """A forecasting plan's choice from ``tree`` (a ``DraftTree`` of ``plan.width``): the
        forecast with its ``budget`` (the step's one host read)."""
        forecast = self.forecast(rows, tree.logprobs, tree.depths, tree.valid)
        return replace(forecast, budget=self.choose(forecast, plan.bs))

    def outcome(self, out: StepOutcome, started: float | None = None) -> torch.Tensor | None:
        """Learn from a verified step (sync-free); ``started``: its ``perf_counter`` start,
        to time it here (None: the caller times it, :meth:`record_step`). Returns the step's
        ``[2]`` predicted and accepted draft tokens when it was calibrated, else None."""
        calibrated, plan = None, out.plan
        if out.forecast is not None:
            calibrated = self.observe(out.forecast, out.budget, out.accept_len, out.nested)
        elif plan.draft:
            self.observe_committed(out.budget, out.accept_len)
            if out.nested:  # the DDTree at its budget: its nodes' probabilities calibrate
                tree = out.tree
                calibrated = self.observe_held(
                    out.rows, tree.logprobs, tree.depths, tree.valid, out.accept_len
                )
        if started is not None:
            seconds = time.perf_counter() - started
            forecast = out.forecast is not None
            self.record_step(plan.bs, out.budget, seconds, plan.draft, forecast, out.forwards)
        return calibrated

    def should_draft(self, bs: int) -> bool:
        """Host only: False for a plain step (a plain run, a profiled or explored budget 0)."""
        if not self.auto:
            self.reason = "fixed"
            return self.config.fixed_budget > 0
        for policy in self.policies:
            say = policy.drafts(self, bs)
            if say is not None:
                drafts, self.reason = say
                return drafts
        return True  # held_budget names the drafted step's reason

    def held_budget(self, bs: int) -> int | None:
        """Host only, for a step that drafts: its budget when no forecast is needed, counted
        as the step's choice; None: forecast and :meth:`choose`."""
        if not self.auto:
            self.reason = "fixed"
            return self._count(self.config.fixed_budget)
        after_plain, self.steps_since_draft = self.steps_since_draft > 0, 0
        self._after_plain = after_plain  # its time is not its budget's alone (record_step)
        for policy in self.policies:
            say = policy.budget(self, bs, after_plain)
            if say is not None:
                budget, self.reason = say
                return None if budget is None else self._count(budget)
        self.reason = "expired"
        return None

    def tree_budget(self, bs: int) -> int:
        """Host only: a forecast's tree, the largest candidate's (it predicts every one)."""
        return self.config.max_budget

    def forecast(self, rows, logprobs, depths, valid) -> Forecast:
        """Sync-free predictions from the step's tree (``DraftTree`` fields, ``[bs, B]``):
        every candidate up to B is its top-N prefix."""
        ranked = rank_nodes(logprobs, depths, valid)
        weights = self.calibrator.node_weights(ranked.probs, ranked.depths)  # [bs, B]
        factors = self.calibrator.factors(rows)
        accept = prefix_sums_at(weights, self._budgets_t).mul_(factors.scale.unsqueeze(1))
        accept = accept.clamp_(0.0, float(self.config.max_depth))  # [bs, C]
        reached = bisect_right(self.config.budgets, logprobs.shape[1])  # candidates <= B
        expected = self._average(rows, accept, reached)
        return Forecast(
            rows, ranked.probs, ranked.depths, weights, ranked.slots, factors, accept, expected
        )

    def _average(self, rows: torch.Tensor, accept: torch.Tensor, reached: int) -> torch.Tensor:
        """Sync-free: ``[bs, C]`` each request's decayed average of its forecasts' A_i(N)
        (``choice_decay``), this one's included, for the first ``reached`` candidates; one
        above them keeps its average (or reads this forecast's, not kept, while it has none)."""
        decay = self.config.choice_decay
        if not decay:
            return accept
        seen = self._averaged[rows]  # [bs, C]
        average = torch.where(seen, self._average_accept[rows], accept)
        average[:, :reached].mul_(decay).add_(accept[:, :reached], alpha=1.0 - decay)
        self._average_accept[rows] = average
        self._averaged[rows, :reached] = True
        return average

    def _count(self, budget: int) -> int:
        self.last_budget = budget  # the step's choice
        self.budget_counts[budget] = self.budget_counts.get(budget, 0) + 1
        return budget

    def choose(self, forecast: Forecast | None, bs: int) -> int:
        """The step's budget as a host int. With a forecast: ONE host read of the ``[C]``
        batch totals sum_i (1 + A_i(N)), then the argmax of totals / C(bs, N) over the
        candidates the tree reaches; when that is 0, this step (its draft paid for) verifies
        the best budget > 0 and the policies decide on plain steps. ``forecast=None``: 0, a
        step that did not draft. Fixed: the fixed budget, no read."""
        if not self.auto:
            return self._count(self.config.fixed_budget)
        if forecast is None:
            self.steps_since_draft += 1
            for policy in self.policies:
                policy.skipped(self, bs)
            return self._count(0)
        self.steps_since_draft = self.arrivals = 0
        self.drafted_steps += 1
        totals = self.totals.read((1.0 + forecast.expected).sum(0))  # [C] THE read
        seconds = self.latency.row(bs)
        budgets, tie = self.config.budgets, self.config.tie_rtol
        choice = partial(best_budget, totals, seconds, budgets, forecast.tree_budget, tie)
        best = choice()
        verified = best if best != 0 else choice(min_budget=1)  # the draft is paid for
        made = Choice(bs, totals, seconds, forecast.tree_budget, best, verified)
        for policy in self.policies:
            policy.chose(self, made)
        return self._count(verified)

    def observe_committed(self, budget: int, accept_len: torch.Tensor) -> None:
        """Host only, after a drafted auto step that did not forecast: its accepted tokens join
        the totals and the policies' averages at the next read (forecast steps alone are the
        hard ones: a biased sample)."""
        if not self.auto or budget == 0:
            return
        self.totals.count(accept_len, self.config.budgets[0] == 0)
        for policy in self.policies:
            policy.committed(self, budget, accept_len)

    def observe(
        self, forecast: Forecast, budget: int, accept_len: torch.Tensor, sampled: bool = True
    ) -> torch.Tensor | None:
        """Sync-free update after a step that forecast and verified ``budget`` (its top-N
        nodes); ``accept_len``: ``[bs]`` accepted draft tokens. ``sampled``: the tree is the
        forecast's DDTree, calibrated on the drafted steps' stride
        (``held_observe_every``); else (a grafted tree) every forecast step is. Returns the
        step's ``[2]`` predicted and accepted draft tokens when calibrated, else None."""
        n = min(budget, forecast.tree_budget)
        if n <= 0:
            return None
        self.totals.count(accept_len, False)
        weight = self._stride() if sampled else 1
        if not weight:
            return None
        mass = self.calibrator.depth_mass(forecast.probs[:, :n], forecast.depths[:, :n])
        depth_cal = forecast.weights[:, :n].sum(1)  # [bs]
        return self._learn(forecast.rows, mass, depth_cal, forecast.factors, accept_len, weight)

    def _stride(self) -> int:
        """One more drafted step on the calibration's stride; the steps it stands for when it
        is the stride's turn, else 0."""
        every = self.config.held_observe_every
        self._drafted_seen += 1
        return 0 if self._drafted_seen % every else every

    def observe_held(self, rows, logprobs, depths, valid, accept_len) -> torch.Tensor | None:
        """Sync-free update after a drafted auto step that did not forecast verified the
        DDTree of these ``[bs, N]`` fields, on the stride (held steps calibrate too, or the
        forecasts would predict the hard steps alone). No ranking: the mass per depth is one
        scatter. Returns what :meth:`observe` returns."""
        if not self.auto or logprobs.shape[1] == 0:
            return None
        weight = self._stride()
        if not weight:
            return None
        cal = self.calibrator
        probs = torch.where(valid, logprobs.float().exp(), 0.0)  # [bs, N]
        mass = cal.depth_mass(probs, depths)  # [bs, L+1]
        depth_cal = mass @ cal.depth_table()  # [bs]
        return self._learn(rows, mass, depth_cal, cal.factors(rows), accept_len, weight)

    def _learn(self, rows, mass, depth_cal, factors: Factors, accept_len, weight: int):
        """Fold one verified step, standing for ``weight`` steps, into the calibration and the
        totals: ``[bs, L+1]`` raw mass per depth, ``[bs]`` its depth-calibrated sum. Returns
        the step's unweighted ``[2]`` predicted and accepted draft tokens."""
        predicted = (depth_cal * factors.scale).clamp_(0.0, float(self.config.max_depth))
        accepted = accept_len.to(predicted.dtype)
        error = (predicted - accepted).square_()
        step = torch.stack([predicted, accepted, error], dim=1).sum(0)  # [3] unweighted
        self.totals.add(step, weight, accept_len.numel())
        self.calibrator.update(rows, mass, depth_cal, accepted, weight, factors)
        return step[:2]

    def record_step(self, bs, budget, seconds, drafted=True, forecast=False, forwards=1) -> None:
        """Host: a measured step time of ``forwards`` target forwards (budget 0's cell is per
        forward). Not recorded: a drafted step verified at 0 (it paid the drafter), a time a
        policy drops, the first drafted step after a plain one (its drafter catches up on the
        plain forwards' context: a cost of the plain run, not of its budget)."""
        if self.latency is None or (budget == 0 and drafted):
            return
        if not all(p.keeps_time(self, budget, drafted, forecast) for p in self.policies):
            return
        if drafted and self._after_plain:  # (set by held_budget)
            return
        for policy in self.policies:
            policy.timing(self, bs, budget)
        if self.latency.record(bs, budget, seconds / forwards):
            for policy in self.policies:
                policy.timed(self, bs, budget)

    def latency_line(self, bs: int) -> str:
        """Host: C(bs, N) per candidate in ms and the steps measured in its cell,
        ``"0:6.1/12 4:7.0/80 ..."``, for the log."""
        row = self.latency.row(bs)
        counts = self.latency.count[bucket_of(self.latency.bs_buckets, bs)]
        cells = zip(self.config.budgets, row, counts, strict=True)
        return " ".join(f"{b}:{1e3 * s:.1f}/{n}" for b, s, n in cells)

    def reset(self, rows: torch.Tensor) -> None:
        """Sync-free: slots ``rows`` (``[n]`` int64) start a new request's history."""
        self.calibrator.reset(rows)
        self._averaged[rows] = False
        self.arrivals += rows.numel()

    def stats(self) -> ControlStats:
        """Reads the device accumulators (a sync): for periodic logs and metrics."""
        totals, latency = self.totals, self.latency
        timed = latency is not None
        predicted, calibrated, squared_error = totals.read(totals.calibrated)
        return ControlStats(
            last_budget=self.last_budget,
            predicted_accept_tokens=predicted,
            accepted_tokens=totals.accepted_tokens,
            request_steps=totals.request_steps,
            budget_counts=dict(sorted(self.budget_counts.items())),
            depth_scale=self.calibrator.depth_scale().tolist(),
            latency_mean_abs_rel_error=latency.mean_abs_rel_error() if timed else 0.0,
            latency_steps=latency.recorded_steps if timed else 0,
            latency_predicted_seconds=latency.predicted_seconds if timed else 0.0,
            latency_measured_seconds=latency.measured_seconds if timed else 0.0,
            calibrated_accepted_tokens=calibrated,
            calibrated_request_steps=totals.calibrated_steps,
            calibration_squared_error=squared_error,
        )
