"""Budget control's start-up profile (``policies.Profile``): every candidate's cell measured
before the latency model is trusted."""

from __future__ import annotations

import pytest
import torch
from control_helpers import (
    one_thread,  # noqa: F401 (autouse: one intra-op thread)
    roofline_controller,
    step_budget,
    strong_or_useless_tree,
)

from sglang_tree_spec.control.latency import bucket_of


def test_profile_measures_every_candidate_before_choosing():
    """With ``profile_steps``, each candidate's cell is measured (budget 0 without drafting)
    before the model chooses, round robin (every step a switch: a slow spell of the machine
    does not set whole cells); then the choice is the model's."""
    ctl = roofline_controller(profile_steps=2)
    tree = strong_or_useless_tree(1, strong=False)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    order = []
    for _ in range(2 * (len(ctl.config.budgets) + 1)):
        budget, drafted = step_budget(ctl, 1, None)  # a profile step needs no forecast
        ctl.record_step(1, budget, 0.01 * (budget + 1), drafted)
        order.append((budget, drafted))
    # the step after a plain one is not recorded (record_step): budget 4 runs twice a round
    assert order == 2 * ([(0, False), (4, True)] + [(b, True) for b in ctl.config.budgets[1:]])
    assert ctl.latency.count[0] == [2] * len(ctl.config.budgets)
    assert step_budget(ctl, 1, fc) == (4, True)  # profiled: useless drafter -> plain
    assert step_budget(ctl, 1, fc) == (0, False)


def test_the_drafted_step_after_a_plain_one_does_not_set_its_budgets_cell():
    """A drafted step right after a plain one pays the drafter's catch-up on the plain
    forwards' context. In the start-up profile's round robin that step is always budget 4's:
    recorded, budget 4's cell read the catch-up as its own cost (batch size 16 through SGLang:
    0.97x budget 8's cell for a true 0.85x) and auto never chose it again. Not recorded, the
    profile measures budget 4 on the next step and the cells keep their true ratio."""
    ctl = roofline_controller(budgets=(0, 4, 8), profile_steps=3)
    cost = {0: 0.013, 4: 0.0257, 8: 0.0304}  # per forward; held steps at batch size 16
    catch_up = 0.009  # the first drafted step after a plain one
    last_plain = False
    for _ in range(3 * 4):
        budget, drafted = step_budget(ctl, 16, None)
        ctl.record_step(16, budget, cost[budget] + (catch_up if last_plain else 0.0), drafted)
        last_plain = not drafted
    assert ctl.latency.count[bucket_of(ctl.latency.bs_buckets, 16)] == [3, 3, 3]
    row = ctl.latency.row(16)
    assert row[1] / row[2] == pytest.approx(cost[4] / cost[8], rel=0.02)


def test_after_one_whole_profile_a_bucket_profiles_its_contenders_alone():
    """Once one bucket's row is measured for every candidate, another profiled bucket forecasts
    first (its unmeasured cells read the measured row) and profiles only the budgets within
    ``explore_margin`` of the best: round robin, then the model's choice."""
    ctl = roofline_controller(profile_steps=2, explore_margin=0.15)
    cost = {0: 0.010, 4: 0.012, 8: 0.013, 16: 0.015, 32: 0.020, 64: 0.030}  # per forward
    # batch size 1: every candidate, twice (budget 4 once more a round: after the plain step)
    for _ in range(2 * (len(cost) + 1)):
        budget, drafted = step_budget(ctl, 1, None)
        ctl.record_step(1, budget, cost[budget], drafted)
    assert ctl.latency.count[0] == [2] * len(cost)
    tree = strong_or_useless_tree(2, strong=True)
    fc = ctl.forecast(torch.arange(2), tree.logprobs, tree.depths, tree.valid)
    assert ctl.should_draft(2) and ctl.held_budget(2) is None  # a forecast first
    ctl.choose(fc, 2)
    order = []
    for _ in range(6):
        budget, drafted = step_budget(ctl, 2, fc)
        ctl.record_step(2, budget, 1.5 * cost[budget], drafted)
        order.append(budget)
    assert order == [8, 16, 32, 8, 16, 32]  # the contenders, twice; 0, 4 and 64 lose by > 15%
    assert ctl.latency.count[1] == [0, 0, 2, 2, 2, 0]
    assert step_budget(ctl, 2, fc) == (16, True)  # profiled: the model's choice again
