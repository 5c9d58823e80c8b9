"""Budget control's holds (``policies.Holds``): a forecast's choice serves the next drafted steps
of its batch."""

from __future__ import annotations

import pytest
import torch
from control_helpers import (
    neutral,
    one_thread,  # noqa: F401 (autouse: one intra-op thread)
    strong_or_useless_tree,
)

from sglang_tree_spec.control import (
    BudgetController,
    LatencyModel,
)


def test_a_choice_holds_for_hold_steps_of_the_same_batch():
    """A forecast's budget > 0 serves the next ``hold_steps - 1`` drafted steps of the same
    batch without a forecast (counted as their choices); as many requests arriving as the
    batch holds or a batch that outgrows the one the choice was made for ends the hold (one
    arrival of several does not, nor do requests leaving, nor others replacing them), a
    forecast that prefers plain steps starts none. Each step names why
    it has its budget (``reason``, the step log's column)."""
    budgets = (0, 4, 8, 16, 32, 64)
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 8, 64))
    ctl = BudgetController(neutral(budgets=budgets, hold_steps=3), flat, max_slots=8)
    strong = strong_or_useless_tree(8, strong=True)
    rows = torch.arange(8)

    def forecast_step(bs: int = 8, reason: str = "expired") -> int:
        assert ctl.held_budget(bs) is None  # not held: this step forecasts
        assert ctl.reason == reason
        fc = ctl.forecast(rows[:bs], strong.logprobs[:bs], strong.depths[:bs], strong.valid[:bs])
        return ctl.choose(fc, bs)

    assert forecast_step() == 64
    assert [ctl.held_budget(8), ctl.held_budget(8)] == [64, 64] and ctl.reason == "held"
    assert ctl.stats().budget_counts == {64: 3}
    ctl.record_step(8, 64, 0.5, drafted=True, forecast=True)  # a forecast step's time: not
    ctl.record_step(8, 64, 0.02, drafted=True)  # recorded while choices hold; a held one is
    assert flat.count[1][budgets.index(64)] == 1 and flat.seconds(8, 64) == pytest.approx(0.02)
    every = BudgetController(neutral(budgets=budgets), flat, max_slots=8)  # no hold:
    every.record_step(8, 64, 0.02, drafted=True, forecast=True)  # every step forecasts
    assert flat.count[1][budgets.index(64)] == 2
    assert forecast_step() == 64  # the hold is over: forecast again
    ctl.reset(torch.tensor([3]))  # one request of 8 arrived: the hold goes on
    assert ctl.held_budget(8) == 64
    ctl.reset(torch.arange(7))  # as many arrivals as the batch holds: a renewed batch
    assert forecast_step(reason="arrivals") == 64
    assert ctl.held_budget(4) == 64  # requests left: the rest were forecast, held on
    assert ctl.held_budget(8) == 64  # others replaced them: the batch the choice was made for
    assert forecast_step(bs=4) == 64
    assert ctl.held_budget(5) is None and ctl.reason == "grew"  # the batch grew: forecast again
    useless = strong_or_useless_tree(8, strong=False)
    fc = ctl.forecast(rows, useless.logprobs, useless.depths, useless.valid)
    steep = LatencyModel([[0.01] + [1.0] * 5] * 3, budgets, bs_buckets=(1, 8, 64))
    ctl.latency = steep
    assert ctl.choose(fc, 8) == 4  # plain steps win: verified (paid for), nothing held
    for _ in range(ctl.config.probe_every - 1):  # a plain run, then a probe
        assert not ctl.should_draft(8) and ctl.reason == "plain"
        ctl.choose(None, 8)
    assert ctl.should_draft(8) and ctl.held_budget(8) is None and ctl.reason == "probe"
    fixed = BudgetController(neutral(fixed_budget=16), None, max_slots=8)
    assert [fixed.held_budget(8) for _ in range(5)] == [16] * 5  # fixed: held for ever
    assert fixed.reason == "fixed"
    with pytest.raises(ValueError, match="hold_steps"):
        neutral(hold_steps=0)
    with pytest.raises(ValueError, match="held_observe_every"):
        neutral(held_observe_every=0)


def test_a_choice_made_again_holds_twice_as_long_up_to_hold_max_steps():
    """With ``hold_max_steps``, a forecast that chooses what the forecast before it chose holds
    twice as long as that one did (2, 4, 8, then 8 at the cap): a choice that keeps being made
    needs fewer forecasts, each costlier than a held step. A different choice holds
    ``hold_steps`` again, as does the first choice after a plain run; without the cap every
    choice holds ``hold_steps``."""
    budgets = (0, 4, 8, 16, 32, 64)
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 8, 64))
    four = LatencyModel([[0.01, 0.01] + [1.0] * 4] * 3, budgets, bs_buckets=(1, 8, 64))
    rows = torch.arange(8)
    strong, useless = (strong_or_useless_tree(8, strong=s) for s in (True, False))

    def holds(ctl, steps: int, latency: LatencyModel) -> list[int]:
        """The lengths of the holds (forecast step included) over ``steps`` drafted steps."""
        ctl.latency, lengths = latency, []
        for _ in range(steps):
            if ctl.held_budget(8) is None:
                fc = ctl.forecast(rows, strong.logprobs, strong.depths, strong.valid)
                ctl.choose(fc, 8)
                lengths.append(0)
            lengths[-1] += 1
        return lengths

    config = neutral(budgets=budgets, hold_steps=2, hold_max_steps=8, hard_plain_steps=1)
    ctl = BudgetController(config, flat, max_slots=8)
    assert holds(ctl, 30, flat) == [2, 4, 8, 8, 8]  # 64 every time: doubled up to the cap
    assert holds(ctl, 14, four) == [2, 4, 8]  # 4 now: a new choice holds 2 again
    fc = ctl.forecast(rows, useless.logprobs, useless.depths, useless.valid)
    assert ctl.choose(fc, 8) == 4 and ctl.plain_run  # a hard step: a plain step follows ...
    assert holds(ctl, 6, four) == [2, 4]  # ... and the probe's choice of 4 holds 2 again
    plain = BudgetController(neutral(budgets=budgets, hold_steps=2), flat, max_slots=8)
    assert holds(plain, 8, flat) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="hold_max_steps"):
        neutral(hold_steps=4, hold_max_steps=2)
