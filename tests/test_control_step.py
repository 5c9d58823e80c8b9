"""The decode step's interface to budget control: a plan, a forecast's resolution, the outcome.

``plan`` / ``resolve`` / ``outcome`` compose the controller's finer calls in the order the step
made them one at a time; driven over the same trees and times, both make the same decisions
under the shipped auto values (every policy in play). ``decode_step`` makes at most three
controller calls a step.
"""

from __future__ import annotations

import pytest
import torch
from control_helpers import (
    neutral,
    one_thread,  # noqa: F401 (autouse: one intra-op thread)
    strong_or_useless_tree,
)
from tree_helpers import small_pair

import sglang_tree_spec.engine.spec_engine as spec_engine
from sglang_tree_spec import step
from sglang_tree_spec.control import (
    BudgetController,
    ControlConfig,
    LatencyModel,
    Policy,
    StepOutcome,
    top_nodes,
)
from sglang_tree_spec.engine import SpecEngine

BUDGETS = (0, 4, 8, 16, 32)
CELLS = [[0.005, 0.0108, 0.0108, 0.0113, 0.0116], [0.0063, 0.0135, 0.0145, 0.016, 0.0192]]


def stretches(bs: int, steps: int) -> list[tuple[object, torch.Tensor, float]]:
    """Per step: a strong or a useless drafter's 32-node tree (in stretches, so plain runs start
    and end), the accept lengths a verify of it gives, and a load factor on the step's time."""
    strong, useless = (strong_or_useless_tree(bs, s, budget=32) for s in (True, False))
    out = []
    for i in range(steps):
        good = (i // 23) % 3 != 2
        accept = torch.full((bs,), 3 if good else 0, dtype=torch.long)
        out.append((strong if good else useless, accept, 1.0 + 0.4 * ((i * 7919) % 13 == 0)))
    return out


def seconds(bs: int, budget: int, load: float) -> float:
    return CELLS[0 if bs <= 1 else 1][BUDGETS.index(budget)] * load


def fine_step(ctl: BudgetController, bs, tree, accept, load) -> tuple:
    """One step through the finer calls, in the order the step makes them."""
    rows, fc = torch.arange(bs), None
    if not ctl.should_draft(bs):
        budget, drafted = ctl.choose(None, bs), False
    else:
        drafted, held = True, ctl.held_budget(bs)
        width = ctl.tree_budget(bs) if held is None else held
        if held is None:
            widest = top_nodes(tree, width)
            fc = ctl.forecast(rows, widest.logprobs, widest.depths, widest.valid)
            budget = ctl.choose(fc, bs)
            ctl.observe(fc, budget, accept, True)
        else:
            budget, verified = held, top_nodes(tree, held)
            ctl.observe_committed(budget, accept)
            ctl.observe_held(rows, verified.logprobs, verified.depths, verified.valid, accept)
    forwards = 1 if drafted else 2
    ctl.record_step(
        bs, budget, seconds(bs, budget, load) * forwards, drafted, fc is not None, forwards
    )
    return budget, drafted, fc is not None, ctl.reason


def planned_step(ctl: BudgetController, bs, tree, accept, load) -> tuple:
    """The same step through the step's three calls (timed by the caller, as the worker does)."""
    rows, fc, verified = torch.arange(bs), None, None
    plan = ctl.plan(bs)
    budget = plan.budget
    if plan.forecasts:
        widest = top_nodes(tree, plan.width)
        fc = ctl.resolve(plan, rows, widest)
        budget = fc.budget
    elif plan.draft:
        verified = top_nodes(tree, budget)
    forwards = 1 if plan.draft else 2
    ctl.outcome(StepOutcome(plan, rows, budget, verified, accept, fc, forwards, True))
    ctl.record_step(
        bs, budget, seconds(bs, budget, load) * forwards, plan.draft, fc is not None, forwards
    )
    return budget, plan.draft, fc is not None, plan.reason


@pytest.mark.parametrize("bs", [1, 4])
def test_the_steps_three_calls_decide_as_the_finer_calls_do(bs):
    def run(step_fn) -> tuple[list, object]:
        latency = LatencyModel([list(row) for row in CELLS], BUDGETS, bs_buckets=(1, 8))
        ctl = BudgetController(ControlConfig(budgets=BUDGETS), latency, max_slots=8)
        ctl.reset(torch.arange(bs))
        trace = [step_fn(ctl, bs, *inputs) for inputs in stretches(bs, 300)]
        return trace, ctl.stats()

    fine, fine_stats = run(fine_step)
    planned, planned_stats = run(planned_step)
    assert planned == fine
    assert planned_stats == fine_stats
    reasons = {reason for *_, reason in fine}
    assert {"profile", "held", "explore", "plain", "probe"} <= reasons  # every policy in play


def test_outcome_times_the_step_when_given_its_start():
    latency = LatencyModel([list(row) for row in CELLS], BUDGETS, bs_buckets=(1, 8))
    ctl = BudgetController(neutral(budgets=BUDGETS), latency, max_slots=8)
    tree = strong_or_useless_tree(1, True, budget=32)
    plan = ctl.plan(1)
    fc = ctl.resolve(plan, torch.arange(1), tree)
    outcome = StepOutcome(
        plan, torch.arange(1), fc.budget, None, torch.ones(1, dtype=torch.long), fc, 1, True
    )
    ctl.outcome(outcome)  # the caller times it
    assert latency.recorded_steps == 0
    ctl.outcome(outcome, started=0.0)
    assert latency.count[0][BUDGETS.index(fc.budget)] == 1


def test_policies_default_to_no_say():
    """With no-op policies alone, every step drafts and forecasts: a useless drafter's forecast
    verifies the cheapest budget > 0 and no plain run follows."""
    latency = LatencyModel([[0.001] + [1.0] * 4] * 2, BUDGETS, bs_buckets=(1, 8))
    ctl = BudgetController(ControlConfig(budgets=BUDGETS), latency, max_slots=8)
    ctl.policies = (Policy(),)
    useless = strong_or_useless_tree(1, False, budget=32)
    for _ in range(10):
        plan = ctl.plan(1)
        assert plan.forecasts and plan.width == 32 and plan.reason == "expired"
        assert ctl.resolve(plan, torch.arange(1), useless).budget == 4


def test_decode_step_makes_at_most_three_controller_calls():
    target, drafter, prompts = small_pair(torch.float32)
    engine = SpecEngine(target, drafter, method="ddtree", budget=32, auto=True)
    real, calls = engine.controller, []

    class Counting:
        def __getattr__(self, name):
            attr = getattr(real, name)
            if callable(attr):

                def counted(*args, **kwargs):
                    calls[-1].append(name)
                    return attr(*args, **kwargs)

                return counted
            return attr

    decode_step = step.decode_step

    def counted_step(backend, selector, controller, *args, **kwargs):
        calls.append([])
        return decode_step(backend, selector, Counting(), *args, **kwargs)

    spec_engine.decode_step = counted_step
    try:
        engine.generate(prompts, 24, stop_token_ids=[])
    finally:
        spec_engine.decode_step = decode_step
    assert len(calls) >= 10
    assert all(len(made) <= 3 for made in calls), calls
    assert {tuple(made) for made in calls} <= {("plan", "outcome"), ("plan", "resolve", "outcome")}
    assert ("plan", "resolve", "outcome") in {tuple(made) for made in calls}
