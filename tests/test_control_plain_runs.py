"""Budget control's plain runs (``policies.PlainRuns``): plain steps while drafting does not
pay, probed at growing intervals."""

from __future__ import annotations

import math

import torch
from control_helpers import (
    neutral,
    one_thread,  # noqa: F401 (autouse: one intra-op thread)
    roofline_controller,
    strong_or_useless_tree,
)

from sglang_tree_spec.control import (
    BudgetController,
    LatencyModel,
)
from sglang_tree_spec.tree import build_ddtree


def test_choice_useless_drafter_picks_plain_decode_and_stops_drafting():
    """The model prefers plain steps: the drafter is skipped except for probes, which
    re-forecast and, their draft paid for, verify at the cheapest budget > 0; each probe that
    still prefers plain steps doubles the interval (4, 8, then 8 at the cap)."""
    for bs in (1, 16):
        ctl = roofline_controller(probe_every=4, probe_max_every=8)
        tree = strong_or_useless_tree(bs, strong=False)
        fc = ctl.forecast(torch.arange(bs), tree.logprobs, tree.depths, tree.valid)
        assert ctl.should_draft(bs)
        assert ctl.choose(fc, bs) == 4  # drafted: verified, but plain steps follow
        drafted, chosen = [], []
        for _ in range(20):
            drafted.append(ctl.should_draft(bs))
            chosen.append(ctl.choose(fc if drafted[-1] else None, bs))
        probes = [False] * 3 + [True] + ([False] * 7 + [True]) * 2
        assert drafted == probes
        assert chosen == [4 if probe else 0 for probe in probes]
        assert ctl.stats().budget_counts == {0: 17, 4: 4}


def test_a_probe_that_prefers_drafting_ends_the_plain_run():
    """After plain steps, a probe whose forecast pays for drafting drafts again at once; the
    next plain run starts over at the shortest probe interval."""
    ctl = roofline_controller(probe_every=2, probe_max_every=64)
    useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
    plain_fc, strong_fc = (
        ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid) for t in (useless, strong)
    )
    trace = []
    for forecast in (plain_fc, plain_fc, plain_fc, strong_fc, plain_fc):
        while not ctl.should_draft(1):
            trace.append(ctl.choose(None, 1))
        trace.append(ctl.choose(forecast, 1))
    # plain after the first forecast; probes after 2, 4 then 8 steps; the strong probe drafts
    # (no plain step before the next forecast); a new plain run probes after 2 steps again.
    assert trace[:7] == [4, 0, 4, 0, 0, 0, 4] and trace[7:14] == [0] * 7
    assert trace[14] >= 32 and trace[15] == 4 and len(trace) == 16
    # the strong step still weighs in the drafted steps' average: drafting goes on a while
    weak_drafted = 1
    while ctl.should_draft(1):
        assert ctl.choose(plain_fc, 1) == 4
        weak_drafted += 1
    assert 3 <= weak_drafted <= 40
    assert [ctl.choose(None, 1), ctl.should_draft(1)] == [0, True]


def test_an_uncertain_step_amid_paying_drafts_does_not_start_a_plain_run():
    """A forecast preferring plain steps starts a plain run only when the drafted steps'
    decayed average does not pay either: one uncertain step in three keeps the drafter on; a
    drafter that stays useless after a strong step stops once the average falls below a plain
    step's rate."""
    ctl = roofline_controller(probe_every=4, probe_max_every=64)
    useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
    plain_fc, strong_fc = (
        ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid) for t in (useless, strong)
    )
    chosen = []
    for forecast in [strong_fc, strong_fc, plain_fc] * 10:
        assert ctl.should_draft(1)
        chosen.append(ctl.choose(forecast, 1))
    assert chosen[2::3] == [4] * 10 and min(chosen[0::3]) >= 32  # drafted every step
    rare = [strong_fc] + [plain_fc] * 80
    steps = 0
    while ctl.should_draft(1):
        ctl.choose(rare[steps], 1)
        steps += 1
    assert 2 <= steps <= 80  # the average fell below a plain step's rate: a plain run


def test_a_hard_step_amid_paying_drafts_takes_hard_plain_steps_then_forecasts_again():
    """With ``hard_plain_steps``, a forecast that prefers plain steps while drafting pays on
    average is followed by exactly that many plain steps and a probe; a probe that prefers
    drafting drafts on, one that still prefers plain steps takes the same short run again. A
    drafter that does not pay on average still gets a plain run probed at growing intervals."""

    def trace_of(forecasts, **kwargs):
        ctl = roofline_controller(probe_every=4, probe_max_every=64, **kwargs)
        useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
        fcs = {
            name: ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid)
            for name, t in (("plain", useless), ("strong", strong))
        }
        trace = []
        for name in forecasts:
            while not ctl.should_draft(1):
                trace.append(ctl.choose(None, 1))
            trace.append(ctl.choose(fcs[name], 1))
        return trace

    paying = ["strong", "strong", "plain"] * 4 + ["strong", "plain", "plain", "strong"]
    trace = trace_of(paying, hard_plain_steps=1)
    assert [b == 0 for b in trace] == (
        [False, False, False, True] * 4 + [False, False, True, False, True, False]
    )
    assert trace_of(paying, hard_plain_steps=2).count(0) == 2 * 6
    assert 0 not in trace_of(paying)  # hard_plain_steps = 0: drafting goes on
    useless = trace_of(["strong"] + ["plain"] * 30, hard_plain_steps=1)
    plain_runs = "".join("p" if b == 0 else "d" for b in useless).split("d")
    assert max(map(len, plain_runs)) >= 8  # not paying on average: probes at growing intervals


def test_held_steps_that_pay_keep_a_hard_forecast_from_starting_a_plain_run():
    """Whether drafting pays on average counts the held steps too (committed tokens per request
    against the step's cost in plain forwards), not the forecast steps alone, which are the hard
    ones: after held steps committing 8 tokens a request, a forecast preferring plain steps takes
    ``hard_plain_steps`` plain steps and a probe; after held steps committing 1 (a drafter that
    does not pay), the same forecast starts a plain run probed at ``probe_every``."""

    def plain_steps_after(held_accept: int) -> int:
        ctl = roofline_controller(probe_every=8, probe_max_every=64, hard_plain_steps=1)
        useless = strong_or_useless_tree(2, strong=False)
        for _ in range(20):  # held steps at budget 16, two requests
            ctl.observe_committed(16, torch.full((2,), held_accept, dtype=torch.long))
        fc = ctl.forecast(torch.arange(2), useless.logprobs, useless.depths, useless.valid)
        assert ctl.choose(fc, 2) == 4  # prefers plain steps; this drafted step verifies
        steps = 0
        while not ctl.should_draft(2):
            assert ctl.choose(None, 2) == 0
            steps += 1
        return steps

    assert plain_steps_after(7) == 1  # drafting pays on average: one hard plain step
    assert plain_steps_after(0) == 7  # it does not: a plain run, the first probe after 8


def test_a_hard_stretch_does_not_start_a_plain_run_while_drafting_pays_in_the_long_run():
    """100 held steps paying twice what plain steps would, then 40 hard ones paying half, then
    a forecast preferring plain steps: on the recent average alone a plain run starts; with the
    long-run average (``plain_long_decay``) drafting still pays, the step verifies at the
    cheapest budget > 0 and that budget holds, like any choice, for ``hold_steps - 1`` drafted
    steps. A drafter that never paid gets its plain run either way."""
    budgets = (0, 4, 8)
    flat = LatencyModel([[0.01, 0.02, 0.02]] * 3, budgets, bs_buckets=(1, 2, 64))
    useless = strong_or_useless_tree(2, strong=False, budget=8)

    def after(held_accepts: list[int], long_decay: float | None) -> BudgetController:
        config = neutral(budgets=budgets, plain_long_decay=long_decay, hold_steps=4)
        ctl = BudgetController(config, flat, max_slots=2)
        for accept in held_accepts:  # held steps at budget 4 (two plain forwards' time)
            ctl.observe_committed(4, torch.tensor(accept).expand(2))
        fc = ctl.forecast(torch.arange(2), useless.logprobs, useless.depths, useless.valid)
        assert ctl.choose(fc, 2) == 4
        return ctl

    stretch = [3] * 100 + [0] * 40  # 4 tokens a request, then 1, for two forwards' time
    assert not after(stretch, None).should_draft(2)  # recent average alone: a plain run
    both = after(stretch, 0.995)
    assert both.should_draft(2)
    assert [both.held_budget(2) for _ in range(4)] == [4, 4, 4, None]  # held, then forecast
    assert not after([0] * 140, 0.995).should_draft(2)  # never paid: a plain run
    # 1.5 tokens a request for two plain forwards' time does not pay; 2.5 does
    assert not after([[1, 0]] * 140, 0.995).should_draft(2)
    assert after([[2, 1]] * 140, 0.995).should_draft(2)


def test_one_lucky_probe_does_not_restart_a_useless_drafter():
    """A probe whose own forecast pays (one likely token) but leaves the drafted steps'
    average below a plain step's rate verifies its tree and keeps the plain run; a strong
    probe ends it."""
    ctl = roofline_controller(probe_every=2, probe_max_every=8)
    lp = torch.full((1, 15, 8), -30.0) - torch.arange(8).float()
    lp[:, 0, 0] = math.log(0.5)  # depth 1: one token at 0.5, nothing deeper
    lucky = build_ddtree(lp, torch.arange(8).expand(1, 15, 8), 64)
    useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
    plain_fc, lucky_fc, strong_fc = (
        ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid)
        for t in (useless, lucky, strong)
    )

    def probe(forecast):
        while not ctl.should_draft(1):
            assert ctl.choose(None, 1) == 0
        return ctl.choose(forecast, 1)

    for _ in range(8):  # a useless drafter: a plain run, probed every 8 steps
        assert probe(plain_fc) == 4
    assert probe(lucky_fc) == 4  # this forecast alone pays (1.5 tokens for 1.2 plain steps)
    assert not ctl.should_draft(1)  # the average does not: still plain
    assert probe(strong_fc) >= 32
    assert ctl.should_draft(1)  # the average pays again: the run is over


def test_a_plain_run_probes_once_the_batch_is_renewed():
    """A plain run decided on one request's text does not outlive it: once as many requests
    have arrived as the batch holds, the next step drafts (a probe, the interval unchanged)."""
    for bs, arrivals in ((1, [1]), (4, [1, 2, 1])):
        ctl = roofline_controller(probe_every=64, probe_max_every=64)
        useless = strong_or_useless_tree(bs, strong=False)
        fc = ctl.forecast(torch.arange(bs), useless.logprobs, useless.depths, useless.valid)
        assert ctl.choose(fc, bs) == 4 and not ctl.should_draft(bs)  # a plain run starts
        for n in arrivals:
            assert not ctl.should_draft(bs)
            ctl.choose(None, bs)
            ctl.reset(torch.arange(n))
        assert ctl.should_draft(bs)  # renewed: probe
        assert ctl.choose(fc, bs) == 4 and not ctl.should_draft(bs)  # still useless: plain
        assert ctl.plain_runs.interval == 64
