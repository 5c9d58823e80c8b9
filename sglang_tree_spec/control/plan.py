"""What the decode step and the budget controller hand each other: a plan, a forecast, an outcome.

Per step, three calls (:func:`sglang_tree_spec.step.decode_step`)::

    plan = controller.plan(bs)                    # draft or not; a held budget, or a width
    forecast = controller.resolve(plan, rows, t)  # only when plan.forecasts: t the width's tree
    controller.outcome(StepOutcome(plan, ...))    # learn from the verified step (and its time)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_tree_spec.control.calibration import Factors


@dataclass(frozen=True)
class StepPlan:
    """What a step does before it drafts (host values only).

    Attributes:
        bs: the batch size the plan was made for.
        draft: the step drafts; False: a plain step (budget 0, no drafter).
        budget: a drafted step's budget chosen without a forecast (fixed, profiled, explored,
            held), 0 for a plain step; None: the step forecasts (:meth:`resolve`).
        width: the largest tree the step builds (its drafted depths and top-K are bounded by
            it): the budget, or the forecast's tree; 0 for a plain step.
        reason: why the step has its budget (one of ``control.REASONS``).
    """

    bs: int
    draft: bool
    budget: int | None
    width: int
    reason: str

    @property
    def forecasts(self) -> bool:
        return self.draft and self.budget is None


@dataclass(frozen=True)
class Forecast:
    """Predictions for one drafted step, from :meth:`BudgetController.forecast`.

    Attributes:
        rows: ``[bs]`` int64 request slots.
        probs: ``[bs, B]`` ranked raw node probabilities (descending).
        depths: ``[bs, B]`` their depths.
        weights: ``[bs, B]`` depth-calibrated ranked node probabilities.
        slots: ``[bs, B]`` int64 the ranked nodes' slots in the tree (for :func:`top_nodes`).
        factors: each request's calibration factors (:meth:`AcceptCalibrator.factors`), read
            once for the prediction and the update.
        accept: ``[bs, C]`` calibrated expected accepted draft tokens A_i(N) per candidate.
        expected: ``[bs, C]`` what the choice reads: each request's decayed average of its
            forecasts' ``accept`` (``ControlConfig.choice_decay``; ``accept`` itself at 0).
        budget: the budget chosen from it (:meth:`BudgetController.resolve`); None before.
    """

    rows: torch.Tensor
    probs: torch.Tensor
    depths: torch.Tensor
    weights: torch.Tensor
    slots: torch.Tensor
    factors: Factors
    accept: torch.Tensor
    expected: torch.Tensor
    budget: int | None = None

    @property
    def tree_budget(self) -> int:
        return self.probs.shape[1]


@dataclass(frozen=True)
class StepOutcome:
    """What a planned step verified and accepted.

    Attributes:
        plan: the step's plan.
        rows: ``[bs]`` int64 request slots.
        budget: the verified budget (0: a plain step).
        tree: the verified ``[bs, budget]`` tree (a ``DraftTree``).
        accept_len: ``[bs]`` accepted draft tokens, bonus excluded.
        forecast: the step's forecast (None when the plan held a budget or did not draft).
        forwards: target forwards the step ran (a plain step may run several).
        nested: the tree is the DDTree at its budget, so its nodes' probabilities calibrate.
    """

    plan: StepPlan
    rows: torch.Tensor
    budget: int
    tree: object
    accept_len: torch.Tensor
    forecast: Forecast | None
    forwards: int
    nested: bool
