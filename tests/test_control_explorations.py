"""Budget control's explorations (``policies.Explorations``): every so many drafted steps, the
stalest contender's cell is re-measured."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from control_helpers import (
    neutral,
    one_thread,  # noqa: F401 (autouse: one intra-op thread)
    roofline_controller,
    step_budget,
    strong_or_useless_tree,
)

from sglang_tree_spec.control import (
    BudgetController,
    LatencyConfig,
    LatencyModel,
)


def exploring_controller():
    """Auto at batch size 1 profiling each cell once, exploring every 4th drafted step, and a
    strong drafter's forecast."""
    ctl = roofline_controller(profile_steps=1, explore_every=4)
    tree = strong_or_useless_tree(1, strong=True)
    return ctl, ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)


def test_exploration_re_measures_plain_steps_while_auto_drafts():
    """C(bs, 0) is measured by plain steps only: while auto sits at a budget > 0, the stalest
    cell is sometimes budget 0's, and then a plain step (no draft) comes right before the
    exploration step, which takes the stalest budget > 0. A strong drafter keeps auto drafting."""
    ctl, fc = exploring_controller()
    steps, reasons = [], []
    profile = len(ctl.config.budgets) + 1  # budget 4 twice: once after the plain step
    for _ in range(profile + 16):  # the profile, then 16 steps
        budget, drafted = step_budget(ctl, 1, fc)
        ctl.record_step(1, budget, 0.01 + 2e-4 * budget, drafted)  # drafting pays
        steps.append((budget, drafted))
        reasons.append(ctl.reason)
    assert set(reasons[:profile]) == {"profile"}
    assert [reasons[profile + i] for i in (3, 4, 5, 8, 12)] == ["explore"] * 5
    assert {reasons[profile + i] for i in (0, 1, 2, 6, 7)} == {"expired"}  # no hold
    after = steps[profile:]
    plain = [i for i, (_, drafted) in enumerate(after) if not drafted]
    assert plain == [3]  # budget 0's cell (stamped at the profile) is explored first, once
    assert after[3] == (0, False)
    assert ctl.latency.count[0][0] == 2  # the profile's plain step and the explored one
    best = after[0][0]
    assert best > 0 and [b for i, (b, _) in enumerate(after) if i not in (3, 4, 5, 8, 12)] == (
        [best] * 11
    )
    assert len({after[i][0] for i in (4, 8, 12)} - {best}) == 3  # then the stalest > 0
    assert after[5] == after[4]  # after the plain step one step more (the first is not timed)


def test_an_exploration_takes_one_plain_step_even_when_its_time_is_lost():
    """The exploration's plain step comes once per exploration: when its time is not recorded
    (the SGLang worker drops a step's time when a prefill runs before the next step), budget 0
    stays the stalest cell, and the exploration still drafts next (it once took plain steps
    until the batch changed)."""
    ctl, fc = exploring_controller()
    drafted_flags = []
    profile = len(ctl.config.budgets) + 1  # budget 4 twice: once after the plain step
    for _ in range(profile + 40):  # the profile, then 40 steps
        budget, drafted = step_budget(ctl, 1, fc)
        if drafted or ctl.latency.count[0][0] == 0:  # the profile's plain step alone is timed
            ctl.record_step(1, budget, 0.01 + 2e-4 * budget, drafted)
        drafted_flags.append(drafted)
    after = drafted_flags[profile:]
    plain = [i for i, drafted in enumerate(after) if not drafted]
    assert ctl.latency.count[0][0] == 1
    assert len(plain) >= 4 and all(b - a >= 4 for a, b in itertools.pairwise(plain))


def test_exploration_re_measures_the_stalest_budget_without_a_forecast():
    """After the profile, every ``explore_every``-th drafted step takes the budget > 0
    measured longest ago, whatever the model prefers, without a forecast (it costs what a
    held step of that budget costs); a plain run's probes always forecast."""
    steep = [[0.01] + [0.012] + [1.0] * 4] * 3  # the model wants 4 (trees above cost 100x)
    budgets = (0, 4, 8, 16, 32, 64)
    ctl = BudgetController(
        neutral(budgets=budgets, profile_steps=1, explore_every=4),
        LatencyModel(steep, budgets, bs_buckets=(1, 8, 64)),
        max_slots=8,
    )
    tree = strong_or_useless_tree(1, strong=True)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    for _ in range(len(budgets) + 1):  # the profile (budget 4 twice: after the plain step)
        budget, drafted = step_budget(ctl, 1, None)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], drafted)
    chosen = []
    for _ in range(12):
        budget, drafted = step_budget(ctl, 1, fc)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], drafted)
        chosen.append(budget)
    # budget 0's cell (the profile's) is the stalest first: a plain step, then the stalest > 0
    # (for two steps: the first after a plain step is not timed)
    assert chosen == [4, 4, 4, 0, 8, 8, 4, 4, 16, 4, 4, 4]
    useless = roofline_controller(profile_steps=1, explore_every=2)
    bad = strong_or_useless_tree(1, strong=False)
    bad_fc = useless.forecast(torch.arange(1), bad.logprobs, bad.depths, bad.valid)
    for _ in range(len(budgets) + 1):
        budget, drafted = step_budget(useless, 1, None)
        useless.record_step(1, budget, 0.01 * (budget + 1), drafted)
    probes = []
    for _ in range(40):
        budget, drafted = step_budget(useless, 1, bad_fc)
        useless.record_step(1, budget, 0.01 * (budget + 1), drafted)
        probes.append(budget)
    assert set(probes) == {0, 4}  # probes forecast (and verify at 4): no exploration


def test_explorations_re_measure_the_contenders_alone():
    """With ``explore_margin``, an exploration re-measures only the budgets whose predicted
    rate at the bucket's last forecast was within that fraction of the best (a budget far
    behind cannot become the choice by a fresher time; at batch size 16 budget 32 costs twice
    budget 4's step); with margin 1 every budget takes its turn, plain steps included."""
    budgets = (0, 4, 8, 16, 32, 64)
    row = [0.01, 0.012, 0.0125, 1.0, 1.0, 1.0]  # 4 and 8 close; bigger trees 80x dearer

    def chosen(margin: float) -> list[tuple[int, bool]]:
        ctl = BudgetController(
            neutral(budgets=budgets, profile_steps=1, explore_every=4, explore_margin=margin),
            LatencyModel([row] * 3, budgets, bs_buckets=(1, 8, 64)),
            max_slots=8,
        )
        tree = strong_or_useless_tree(1, strong=True)
        fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
        steps = []
        profile = len(budgets) + 1  # budget 4 twice: once after the plain step
        for _ in range(profile + 32):  # the profile, then 32 steps
            budget, drafted = step_budget(ctl, 1, fc)
            ctl.record_step(1, budget, row[budgets.index(budget)], drafted)
            steps.append((budget, drafted))
        return steps[profile:]

    contenders = chosen(0.3)
    assert {b for b, _ in contenders} == {4, 8} and all(drafted for _, drafted in contenders)
    everyone = chosen(1.0)
    assert {b for b, _ in everyone} == set(budgets)  # 16, 32, 64 and a plain step too
    assert (0, False) in everyone


def test_a_cell_dearer_than_a_larger_budgets_is_explored_whatever_its_rate():
    """A larger tree is never less work: a cell set dearer than a larger budget's (here budget
    4's profile times taken in a slow spell, 30 ms against budget 16's 16) is an artefact of
    when it was measured. The row's fit pools it up, its predicted rate falls more than
    ``explore_margin`` behind and explorations would never re-measure it; with
    ``explore_inverted`` it stays a contender, is explored, and its fresh times correct it."""
    budgets = (0, 4, 8, 16)
    true = {0: 0.008, 4: 0.010, 8: 0.014, 16: 0.016}
    slow_profile = dict(true) | {4: 0.030}

    def after_profile(inverted: float | None) -> tuple[list[int], BudgetController]:
        config = neutral(
            budgets=budgets, profile_steps=1, explore_every=4, explore_margin=0.15,
            explore_inverted=inverted,
        )  # fmt: skip
        ctl = BudgetController(
            config, LatencyModel([list(true.values())] * 3, budgets, (1, 8, 64)), max_slots=8
        )
        tree = strong_or_useless_tree(1, strong=True)
        fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
        steps = []
        for i in range(len(budgets) + 1 + 48):  # the profile (budget 4 twice), then 48 steps
            budget, drafted = step_budget(ctl, 1, fc)
            times = slow_profile if i <= len(budgets) else true
            ctl.record_step(1, budget, times[budget], drafted)
            steps.append(budget)
        return steps[len(budgets) + 1 :], ctl

    steps, ctl = after_profile(None)
    assert 4 not in steps and ctl.latency.inverted(1, 0.1) == [4]  # never re-measured
    steps, ctl = after_profile(0.1)
    assert 4 in steps and ctl.latency.inverted(1, 0.1) == []  # explored and corrected
    # Against ANY larger budget, beyond the margin: 4 and 8 exceed 16 (4 not 8 by 10%).
    model = LatencyModel([[0.01] * len(budgets)] * 3, budgets, (1, 8, 64))
    for budget, seconds in ((4, 0.020), (8, 0.021), (16, 0.015), (0, 0.0155)):
        for _ in range(3):
            model.record(1, budget, seconds)
    assert model.inverted(1, 0.1) == [4, 8] and model.inverted(1, 0.5) == []  # 0: 3% over


def test_a_neighbour_read_too_dear_is_explored_afresh_once_its_cell_is_stale():
    """The profile read budget 16 at 1.5x its cost, which puts it 27% behind budget 8 where it
    truly beats it by 10%: no contender, never re-measured, and 8 holds for good (seen on the
    small pair at batch size 1: B 16 and B 32 kept their 3 profile times through a whole run).
    With ``explore_stale_neighbours`` the best's neighbours whose cells are ``forget_after``
    drafted steps old are contenders: 16 is explored, its stale cost forgotten and set by its
    fresh times, and 16 holds; the stale neighbour below (8) is then re-measured once per
    ``forget_after`` drafted steps, and 4 (no neighbour of 16) never again."""
    budgets = (0, 4, 8, 16)
    tree = strong_or_useless_tree(1, strong=True)

    def run(stale: bool) -> tuple[list[int], list[int]]:
        config = neutral(
            budgets=budgets, profile_steps=1, explore_every=8, explore_margin=0.08,
            forget_after=48, hold_steps=4, explore_stale_neighbours=stale,
        )  # fmt: skip
        latency = LatencyModel([[0.01] * 4] * 2, budgets, (1, 8), LatencyConfig(first_steps=1))
        ctl = BudgetController(config, latency, max_slots=8)
        fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
        total = dict(zip(budgets, (1.0 + fc.expected).sum(0).tolist(), strict=True))
        scale = {4: 0.9, 8: 1.0, 16: 1.1}  # B N's true rate over B 8's
        true = {0: 0.02} | {b: 0.01 * total[b] / total[8] / scale[b] for b in scale}
        profile = true | {16: 1.5 * true[16]}
        steps = []
        for i in range(len(budgets) + 1 + 200):  # the profile (budget 4 twice), then 200
            budget, drafted = step_budget(ctl, 1, fc)
            ctl.record_step(1, budget, (profile if i <= len(budgets) else true)[budget], drafted)
            steps.append(budget)
        return steps[len(budgets) + 1 :], latency.count[0]

    trapped, counts = run(stale=False)
    assert set(trapped) == {8} and counts[3] == 1  # B 16: its one profile time
    steps, counts = run(stale=True)
    assert 16 in steps[:80] and steps[-100:].count(16) >= 95
    assert steps.count(4) == 1  # stale next to 8 once, then no neighbour of the best


def test_a_stale_cell_is_re_measured_by_fresh_times_alone():
    """A cell measured under another load (here budget 8 at 30 ms, nine times) is explored for
    ``explore_steps`` steps and then reads those fresh times alone, so auto moves to it once it
    has become cheap; a fresh time or three in a window of old ones would leave it at 30 ms."""
    budgets = (0, 4, 8, 16)
    then = {0: 0.010, 4: 0.012, 8: 0.030, 16: 1.0}
    now = {0: 0.010, 4: 0.012, 8: 0.0125, 16: 1.0}
    ctl = BudgetController(
        neutral(budgets=budgets, profile_steps=1, explore_every=4, explore_steps=3),
        LatencyModel([[then[b] for b in budgets]] * 2, budgets, bs_buckets=(1, 8)),
        max_slots=8,
    )
    tree = strong_or_useless_tree(1, strong=True)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    for _ in range(len(budgets) + 1):  # the profile, under the old load (budget 4 twice)
        budget, drafted = step_budget(ctl, 1, None)
        ctl.record_step(1, budget, then[budget], drafted)
    for _ in range(8):
        ctl.record_step(1, 8, then[8])
    steps = []
    for _ in range(12):
        budget, drafted = step_budget(ctl, 1, fc)
        ctl.record_step(1, budget, now[budget], drafted)
        steps.append(budget if drafted else "plain")
    # three forecasts at 4, budget 0's stale cell by a plain step, 8's by three held steps
    assert steps[:7] == [4, 4, 4, "plain", 8, 8, 8]
    assert ctl.latency.row(1)[budgets.index(8)] == pytest.approx(now[8])
    # 8 now pays more than 4; the exploration's held steps count as drafted: 16 is next
    assert steps[7:] == [8, 16, 16, 16, 8]


def test_an_exploration_interrupts_a_hold_which_goes_on_after_it():
    """An exploration step (and the steps its budget holds for) interrupts the held choice,
    which then goes on with the steps it had left, no forecast in between (on CPU through
    SGLang a forecast after every exploration was a fifth of auto's forecasts, each costing
    more than the held step it replaced); arrivals still end the resumed hold."""
    budgets = (4, 8, 16)
    steep = [[0.012, 1.0, 1.0]]  # the model wants 4
    config = neutral(budgets=budgets, profile_steps=1, explore_every=5, explore_steps=2,
                           hold_steps=6)  # fmt: skip
    ctl = BudgetController(config, LatencyModel(steep, budgets, bs_buckets=(1,)), max_slots=8)
    tree = strong_or_useless_tree(1, strong=True)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    steps = []  # (budget, forecast)
    for _ in range(len(budgets) + 40):
        held = ctl.held_budget(1)
        budget = held if held is not None else ctl.choose(fc, 1)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], True, held is None)
        steps.append((budget, held is None))
    steps = steps[len(budgets) :]  # after the profile
    explored = [i for i, (b, _) in enumerate(steps) if b != 4]
    assert len(explored) >= 8  # two steps an exploration, every fifth drafted step
    for i in explored:
        if i + 1 < len(steps) and steps[i + 1][0] == 4:
            assert not steps[i + 1][1]  # back to the hold: no forecast
    forecasts = [i for i, (_, forecast) in enumerate(steps) if forecast]
    for a, b in itertools.pairwise(forecasts):  # each hold: its 6 steps, explorations aside
        assert sum(1 for budget, _ in steps[a:b] if budget == 4) == 6
    run = 0
    while run < 2:  # to the end of the next exploration
        held = ctl.held_budget(1)
        budget = held if held is not None else ctl.choose(fc, 1)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], True, held is None)
        run = run + 1 if budget != 4 else 0
    resumed = copy.deepcopy(ctl)
    assert resumed.held_budget(1) == 4
    ctl.reset(torch.arange(1))  # an arrival at batch size 1 ends the hold, resumed or not
    assert ctl.held_budget(1) is None
