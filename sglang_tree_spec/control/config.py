"""The budget controller's configuration: every auto field defaults to its shipped value."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_tree_spec.control.calibration import CalibrationConfig
from sglang_tree_spec.control.presets import AUTO
from sglang_tree_spec.control.surrogate import DEFAULT_BUDGETS

# Why a step has its budget (BudgetController.reason; the step log's last column). Steps that
# forecast: "arrivals" (as many requests arrived since the last forecast as the batch holds),
# "probe" (a plain run drafts to re-forecast), "grew" (the batch outgrew its held choice's),
# "expired" (no hold left: it ran out, or none was made). Steps that do not: "held" (a forecast's
# choice holds), "explore" (re-measuring a stale cell, or the plain step before one), "profile"
# (the start-up profile), "plain" (a plain run's step), "fixed" (a fixed budget).
REASONS = ("arrivals", "probe", "grew", "expired", "held", "explore", "profile", "plain", "fixed")


@dataclass(frozen=True)
class ControlConfig:
    """One line of why per field; the values' evidence: benchmarks/README.md, "Tuned settings".

    Attributes:
        budgets: sorted candidate budgets (:func:`candidate_budgets`); 0 = a plain step.
        fixed_budget: None = auto; a number = always that budget (no reads, no latency model).
        max_depth: L, drafted positions per step (the drafter's block - 1).
        probe_every: a plain run drafts (and re-forecasts) after this many steps
            (:class:`~.policies.PlainRuns`), so a drafter that starts paying is noticed.
        probe_max_every: each probe after which drafting still does not pay doubles the
            interval up to this: a useless drafter costs one probe in this many steps.
        plain_decay: plain runs start and end on the drafted steps' decayed average (this factor
            per step) of committed tokens per plain forward, not on one noisy forecast.
        plain_long_decay: a long-run average beside it (None: none); a run starts only when
            neither pays, so a hard stretch of a paying drafter does not outlive itself.
        hard_plain_steps: a forecast that prefers plain steps while drafting pays on average is
            followed by this many plain steps (0: none): hard text comes in stretches.
        profile_steps: the start-up profile measures each cell this many times before trusting
            the latency model (:class:`~.policies.Profile`).
        explore_every: every this many drafted steps one re-measures the stalest contender's
            cell (0: never; :class:`~.policies.Explorations`): a cell set under load recovers.
        explore_steps: an exploration's budget holds this many drafted steps, so its cell reads
            several fresh times.
        explore_margin: contenders are the budgets within this fraction of the best predicted
            rate: re-measuring a budget that loses by more than the cells' noise costs speed.
        explore_inverted: a cell dearer than a larger budget's by this fraction stays a
            contender (None: never): a larger tree is never less work.
        explore_stale_neighbours: the best's neighbours whose cells are ``forget_after`` steps
            old stay contenders: a cell read too dear once is measured again.
        forget_after: a cell last measured this many drafted steps ago drops its cost at its
            next time (None: ``explore_every``; 0: never): what changed is the cell itself.
        hold_steps: a forecast's budget > 0 holds this many drafted steps of the same batch
            (:class:`~.policies.Holds`): a forecast costs more than a held step.
        hold_max_steps: a choice made again holds twice as long, up to this (None:
            ``hold_steps`` always): a choice that keeps being made needs fewer forecasts.
        tie_rtol: objectives within this relative margin of the best count as ties (toward the
            smaller budget): neighbouring rates are closer than the latency model's error.
        choice_decay: the choice reads each request's decayed average of its forecasts (this
            weight on the average so far; 0: the step's own): one step's forecast is noisy.
        held_observe_every: the calibration learns from one drafted step in this many, each
            standing for its stride: an unbiased sample at a fraction of the ops.
        calibration: the acceptance calibration's decays and priors.
    """

    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    fixed_budget: int | None = None
    max_depth: int = 15
    probe_every: int = AUTO["probe_every"]
    probe_max_every: int = AUTO["probe_max_every"]
    plain_decay: float = AUTO["plain_decay"]
    plain_long_decay: float | None = AUTO["plain_long_decay"]
    hard_plain_steps: int = AUTO["hard_plain_steps"]
    profile_steps: int = AUTO["profile_steps"]
    explore_every: int = AUTO["explore_every"]
    explore_steps: int = AUTO["explore_steps"]
    explore_margin: float = AUTO["explore_margin"]
    explore_inverted: float | None = AUTO["explore_inverted"]
    explore_stale_neighbours: bool = AUTO["explore_stale_neighbours"]
    forget_after: int | None = AUTO["forget_after"]
    hold_steps: int = AUTO["hold_steps"]
    hold_max_steps: int | None = AUTO["hold_max_steps"]
    tie_rtol: float = AUTO["tie_rtol"]
    choice_decay: float = AUTO["choice_decay"]
    held_observe_every: int = AUTO["held_observe_every"]
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def __post_init__(self) -> None:
        budgets = list(self.budgets)
        if not budgets or budgets != sorted(set(budgets)) or budgets[0] < 0:
            raise ValueError(f"budgets must be sorted, distinct and >= 0: {self.budgets}")
        if not 1 <= self.probe_every <= self.probe_max_every:
            raise ValueError(
                f"need 1 <= probe_every <= probe_max_every: {self.probe_every}, "
                f"{self.probe_max_every}"
            )
        if not 0.0 <= self.choice_decay < 1.0:
            raise ValueError(f"choice_decay must be in [0, 1), got {self.choice_decay}")
        if not 0.0 <= self.plain_decay < 1.0:
            raise ValueError(f"plain_decay must be in [0, 1), got {self.plain_decay}")
        if self.plain_long_decay is not None and not 0.0 <= self.plain_long_decay < 1.0:
            raise ValueError(f"plain_long_decay must be in [0, 1), got {self.plain_long_decay}")
        counts = (self.hold_steps, self.explore_steps, self.held_observe_every)
        if min(counts) < 1:
            raise ValueError(
                f"hold_steps, explore_steps and held_observe_every must be >= 1: {counts}"
            )
        if self.hold_max_steps is not None and self.hold_max_steps < self.hold_steps:
            raise ValueError(
                f"hold_max_steps must be >= hold_steps: {self.hold_max_steps}, {self.hold_steps}"
            )
        if self.fixed_budget is not None and self.fixed_budget < 0:
            raise ValueError(f"fixed_budget must be >= 0, got {self.fixed_budget}")

    @property
    def auto(self) -> bool:
        return self.fixed_budget is None

    @property
    def max_budget(self) -> int:
        """The largest tree a drafted step may build (every candidate nests in it)."""
        return self.fixed_budget if self.fixed_budget is not None else self.budgets[-1]
