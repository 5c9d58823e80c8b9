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
    """Budget control's settings, one line of why each; evidence: benchmarks/README.md, "Tuned
    settings". The auto fields default to their shipped values (:data:`~.presets.AUTO`).

    Attributes:
        budgets: sorted candidate budgets (each one fixed shape); 0 = a plain step.
        fixed_budget: None = auto; a number = always that budget (no reads, no latency model).
        max_depth: L, drafted positions per step (the drafter's block - 1).
        probe_every: a plain run re-forecasts after this many steps: a drafter may pay again.
        probe_max_every: probes of a drafter that still does not pay double up to this.
        plain_decay: plain runs start and end on a decayed average, not on one noisy forecast.
        plain_long_decay: and a long-run one (None: none): a hard stretch does not outlive itself.
        hard_plain_steps: plain steps after a hard forecast while drafting pays (text stretches).
        profile_steps: times per cell before the latency model is trusted (the start-up profile).
        explore_every: drafted steps between re-measurements of a stale contender (0: never).
        explore_steps: an exploration's budget holds this many steps: several fresh times.
        explore_margin: contenders lie within this of the best rate: others cost speed for nothing.
        explore_inverted: a cell dearer than a larger budget's by this is a contender (None: off).
        explore_stale_neighbours: the best's neighbours measured long ago stay contenders.
        forget_after: drafted steps after which a cell restarts from fresh times (0: never).
        hold_steps: a forecast's choice holds this many drafted steps: forecasts cost more.
        hold_max_steps: a choice made again holds twice as long, up to this (None: no doubling).
        tie_rtol: rates within this of the best tie toward the smaller budget (model error).
        choice_decay: the choice reads each request's decayed average forecast (one is noisy).
        held_observe_every: calibrate on one drafted step in this many: unbiased, fewer ops.
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
