"""Budget control's latency model C(bs, N): the roofline prior, cells set by their first times and
moved by switches, the machine's load."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from control_helpers import (
    neutral,
    one_thread,  # noqa: F401 (autouse: one intra-op thread)
)

from sglang_tree_spec.control import (
    DEVICES,
    MODEL_SHAPES,
    BudgetController,
    LatencyConfig,
    LatencyModel,
    dflash_drafter,
    isotonic,
    roofline_step_seconds,
    verify_seconds,
)


def test_latency_prior_is_monotone_in_budget_and_batch():
    target = MODEL_SHAPES["qwen3-8b"]
    drafter = dflash_drafter(target, 5)
    budgets = (0, 1, 4, 8, 16, 32, 64, 128)
    for device in DEVICES.values():
        table = [
            [roofline_step_seconds(target, device, bs, n, 1024, drafter, 16) for n in budgets]
            for bs in (1, 2, 4, 8, 16, 64)
        ]
        for row in table:
            assert all(a < b for a, b in itertools.pairwise(row))
        for col in zip(*table, strict=True):
            assert all(a < b for a, b in itertools.pairwise(col))
    # H100, Qwen3-8B: a plain step at bs 1 reads the weights in a few ms; at bs 64 a 16-node
    # tree is compute-bound and costs over 2.5 plain steps.
    h100 = DEVICES["h100"]
    plain = roofline_step_seconds(target, h100, 1, 0, 1024)
    assert 4e-3 < plain < 15e-3
    assert roofline_step_seconds(target, h100, 64, 16, 1024) > 2.5 * roofline_step_seconds(
        target, h100, 64, 0, 1024
    )


# Target verify of 1 / 8 / 16 / 32 tokens a request in ms, at context 512-1023 (bs 1) and < 2048
# (bs 8): eagle-harness 0.1.3's profile mi355x-qwen3.8-27b-tp1, cost/bs_*/model_llm/*interval_0.
MEASURED_VERIFY_MS = {1: (11.99, 14.33, 15.50, 17.02), 8: (12.67, 15.92, 20.50, 28.65)}


def test_the_prior_prices_a_wide_verify_as_measured():
    """A GPU prior's verify step (the step at budget w - 1 less its draft overhead, no drafter)
    over its one-token step at the same batch size is within 3% of the measured ratio at every
    width: at bs 1 a 32-token verify costs 1.42 one-token ones, where the flat roofline read 1.00
    up to its compute ridge."""
    target = MODEL_SHAPES["qwen3-8b"]
    for device in (DEVICES["h100"], DEVICES["h200"]):
        for bs, measured in MEASURED_VERIFY_MS.items():
            plain = roofline_step_seconds(target, device, bs, 0, 1024)
            for width, ms in zip((8, 16, 32), measured[1:], strict=True):
                verify = roofline_step_seconds(target, device, bs, width - 1, 1024)
                ratio = (verify - device.draft_overhead_s) / plain
                assert ratio == pytest.approx(ms / measured[0], rel=0.03), (device.name, bs, width)
    # The CPU's prior has no such term (its verify is compute-bound from the first tokens).
    cpu = DEVICES["cpu"]
    assert verify_seconds(target, cpu, 1, 32, 1024) == 0.0


def test_latency_refinement_converges_to_measured_times():
    budgets = (0, 8, 32)
    buckets = (1, 4, 16, 64)
    model = LatencyModel.from_roofline(
        MODEL_SHAPES["llama-3.1-8b"], DEVICES["h200"], budgets, bs_buckets=buckets
    )
    truth = [[2.0 * p + 3e-3 for p in row] for row in model.prior]  # "a different device"
    assert model.seconds(1, 8) == pytest.approx(model.prior[0][1])  # nothing measured yet
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):  # measure only bs 1 and 16 (bucket 16 as bs 13), 5% noise
        for bs, bucket in ((1, 0), (13, 2)):
            for c, n in enumerate(budgets):
                noise = 1.0 + 0.05 * (2 * torch.rand(1, generator=gen).item() - 1)
                model.record(bs, n, truth[bucket][c] * noise)
    a, b = model.calibration()
    assert a == pytest.approx(2.0, rel=0.15) and b == pytest.approx(3e-3, abs=2e-3)
    for bucket, bs in enumerate(buckets):  # buckets 4 and 64 never measured: calibrated prior
        for c, n in enumerate(budgets):
            assert model.seconds(bs, n) == pytest.approx(truth[bucket][c], rel=0.06), (bs, n)
    assert model.mean_abs_rel_error() < 0.2
    measured = sum(truth[0]) + sum(truth[2])  # ~ the 60 rounds' mean (noise +-5%)
    assert model.measured_seconds == pytest.approx(60 * measured, rel=0.02)
    assert model.predicted_seconds == pytest.approx(model.measured_seconds, rel=0.15)
    assert not model.record(1, 5, 0.1)  # not a candidate: ignored
    for _ in range(30):  # a measured cell drifts (thermal, a neighbour): its EMA follows
        model.record(1, 32, 1.5 * truth[0][2])
    assert model.seconds(1, 32) == pytest.approx(1.5 * truth[0][2], rel=0.02)


def test_an_unmeasured_cell_keeps_its_columns_ratio_to_its_rows_measured_cells():
    """A row with some cells measured scales its others, read from the measured buckets, by
    how its measured cells compare with those buckets: budget 4 at batch size 2 costs 1.5x
    its batch-size-1 cell, so budgets 0 and 8 there read 1.5x theirs, not 1x (which made them
    look cheap next to the measured cell)."""
    model = LatencyModel([[0.01, 0.01, 0.01]] * 2, (0, 4, 8), bs_buckets=(1, 2))
    for budget, seconds in ((0, 0.010), (4, 0.012), (8, 0.016)):
        for _ in range(3):
            model.record(1, budget, seconds)
    model.record(2, 4, 0.018)
    assert model.load == pytest.approx(1.0)
    assert model.row(2) == pytest.approx([0.015, 0.018, 0.024])


def test_a_held_cells_steps_refit_no_row_and_every_decision_reads_a_fresh_one(monkeypatch):
    """A step of the cell before it, once that cell is settled and weighs its most, moves no
    cell, only the calibration's weights: its step-time error reads its row as last fitted (no
    refit per held step), while a decision's read (:meth:`row`) is refitted to the calibration
    as it stands (here batch size 2's row, read from batch size 1's through the calibrated
    priors). A switch moves two cells, and the next step's error reads its row refitted."""
    prior = [[0.01, 0.02, 0.04], [0.02, 0.03, 0.06]]
    model = LatencyModel(prior, (0, 4, 8), bs_buckets=(1, 2))
    times = {0: 0.010, 4: 0.014, 8: 0.030}  # not on one line with the priors
    for _ in range(3):
        for budget, seconds in times.items():
            model.record(1, budget, seconds)
    for budget, seconds in times.items():  # each settles at its full weight
        for _ in range(int(model.config.max_weight)):
            model.record(1, budget, seconds)
    fits = []
    fit_row = model._fit_row
    monkeypatch.setattr(model, "_fit_row", lambda bucket: fits.append(bucket) or fit_row(bucket))
    stale = model.row(2)
    fits.clear()
    for seconds in (0.031, 0.029, 0.032):  # held: no cell moves, no refit
        model.record(1, 8, seconds)
    assert fits == []
    fresh = [model.load * c for c in fit_row(1)]
    assert fresh != pytest.approx(stale, rel=1e-4)  # the calibration's weights moved
    assert model.row(2) == pytest.approx(fresh, rel=1e-12) and fits == [1]  # a decision's read
    model.record(1, 0, 0.010)  # a switch: both cells move
    fits.clear()
    model.record(1, 0, 0.010)
    assert fits == [0]


def test_unpadded_batch_sizes_are_cells_of_their_own_between_profiled_neighbours():
    """Where nothing pads a batch (a CPU), every batch size is a cell: a step of 11 requests
    is not recorded as one of 16 (which costs more). Only the usual buckets are profiled; a
    size between them reads its column's measured neighbours (linear in bs) until measured."""
    from sglang_tree_spec.control.latency import (
        DEFAULT_BS_BUCKETS,
        EXACT_BS_BUCKETS,
        bs_buckets_for,
    )

    assert bs_buckets_for("cpu") == EXACT_BS_BUCKETS == tuple(range(1, 257))
    assert bs_buckets_for("cuda") == DEFAULT_BS_BUCKETS  # CUDA graphs pad to these
    budgets = (0, 4)
    exact = EXACT_BS_BUCKETS[:16]
    model = LatencyModel(
        [[0.01, 0.01]] * 16, budgets, bs_buckets=exact, profile_buckets=(1, 2, 4, 8, 16)
    )
    assert [bs for bs in exact if model.profiles(bs)] == [1, 2, 4, 8, 16]
    model.record(8, 4, 0.010)
    model.record(16, 4, 0.020)
    assert model.seconds(12, 4) == pytest.approx(0.015)  # between its measured neighbours
    assert model.seconds(4, 4) == pytest.approx(0.010)  # one side: its ratio to the prior
    model.record(11, 4, 0.012)
    assert model.seconds(11, 4) == pytest.approx(0.012)
    assert model.seconds(16, 4) == pytest.approx(0.020)  # bs 11 did not move bs 16's cell
    assert model.seconds(12, 4) == pytest.approx(0.0136)  # now between 11 and 16
    model.forget(11, 4)
    assert model.seconds(11, 4) == pytest.approx(0.01375)  # between 8 and 16 again
    ctl = BudgetController(neutral(budgets=budgets, profile_steps=1), model, max_slots=16)
    assert ctl.should_draft(12) and ctl.held_budget(12) is None  # not profiled: a forecast
    assert not ctl.should_draft(4)  # profiled: budget 0's cell first, by a plain step


def test_a_cell_is_set_by_its_first_times_and_then_moved_by_switches_alone():
    """A cell's first ``first_steps`` times set its cost (their lower median: a slow warm-up
    step does not). After that, one cell's times compared with each other measure the
    machine, not the cell: a lasting slowdown while one budget runs moves the load, and the
    other cell with it. Only a switch between cells measures one cost against the other:
    the first switches are averaged, so a few reach the true ratio, and later ones move it a
    tenth of the way (``pair_rate``): a burst across one switch then moves the ratio by
    ``pair_rate * pair_clip`` at most."""
    budgets = (0, 8)
    model = LatencyModel([[1.0, 1.0]], budgets, bs_buckets=(1,))
    for seconds in (5.0, 0.2, 0.3):  # a slow first step (warm-up), then the real cost
        model.record(1, 8, seconds)
    assert model.seconds(1, 8) == pytest.approx(0.3)
    for _ in range(8):  # the machine twice as slow while budget 8 runs
        model.record(1, 8, 0.6)
    assert model.load == pytest.approx(2.0)
    assert model.seconds(1, 8) == pytest.approx(0.6)
    for _ in range(3):  # budget 0's first times, at the slow speed: its cost at load 1 is 0.1
        model.record(1, 0, 0.2)
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(3.0)
    for _ in range(4):  # budget 8 truly costs 3.3 plain steps: four switches each way...
        model.record(1, 8, 0.66)
        model.record(1, 0, 0.2)
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(3.3, rel=0.01)  # ... find it
    assert plain == pytest.approx(0.2, rel=0.01)  # times the load, as measured now
    for _ in range(40):  # established cells
        model.record(1, 8, 0.66)
        model.record(1, 0, 0.2)
    model.record(1, 8, 1.32)  # a burst of twice the time across a switch: the ratio moves 2%
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(3.3 * math.exp(0.02), rel=1e-3)
    for _ in range(200):  # the cost of 8 changes to 4.5 plain steps: switches follow
        model.record(1, 0, 0.2)
        model.record(1, 8, 0.9)
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(4.5, rel=0.01)
    model.forget(1, 8)  # a forgotten cell's next first times set it afresh
    for _ in range(3):
        model.record(1, 8, 0.4)
    assert model.row(1)[1] == pytest.approx(0.4, rel=0.01)
    with pytest.raises(ValueError):
        LatencyModel([[1.0, 1.0]], budgets, (1,), LatencyConfig(load_window=0))


def test_cells_measured_at_other_speeds_of_the_machine_compare_as_budgets():
    """The machine slows down by a third while budget 8 runs (a neighbour, the OS): budget
    16, measured before at the old speed, must still read what it costs at the new one, or
    the choice would compare two speeds of the machine instead of two budgets (8's times
    alone would make 16 look 25% cheaper than 8 pays after it). The load follows the
    slowdown, the cells keep their relative costs, and a burst shorter than half the load
    window moves neither."""
    budgets = (8, 16)
    model = LatencyModel([[1.0, 1.0]], budgets, bs_buckets=(1,))
    for _ in range(8):  # both measured at the machine's usual speed: 16 costs 10% more
        model.record(1, 8, 0.010)
        model.record(1, 16, 0.011)
    model.record(1, 8, 0.010)
    assert model.load == pytest.approx(1.0)
    for _ in range(3):  # a burst of three steps: the load (median of 8 ratios) holds
        model.record(1, 8, 0.020)
    assert model.load == pytest.approx(1.0)
    for _ in range(16):  # then the machine is a third slower for good, while 8 runs
        model.record(1, 8, 0.0133)
    assert model.load == pytest.approx(1.33)
    eight, sixteen = model.row(1)
    assert eight == pytest.approx(0.0133)
    assert sixteen / eight == pytest.approx(1.1)  # 16's cost, at today's speed
    model.record(1, 16, 0.0146)  # 16 at the new speed: agrees, nothing moves
    assert model.row(1) == pytest.approx([0.0133, 0.0146], rel=0.01)


def test_a_cell_first_measured_in_a_burst_reads_its_cost_not_the_burst():
    """A cell's first times are taken over the speed of the last step of a cell already set
    (a switch's measure), not over the load's median: a burst of a few steps has not moved
    that median yet, and a budget first measured (or re-measured after ``forget``) in one read
    1.5x its cost, then was avoided for it (``benchmarks/latency_replay.py``, an auto server's steps
    under a synthetic bursty machine: the worst log error of a row's ratios 0.20, 0.18 so)."""
    budgets = (0, 4, 8)
    model = LatencyModel([[1.0, 1.0, 1.0]], budgets, bs_buckets=(1,))
    for _ in range(4):  # plain steps and budget 4 at the machine's usual speed
        model.record(1, 0, 0.010)
        model.record(1, 4, 0.020)
    model.record(1, 4, 0.030)  # a burst: 1.5x, two steps so far
    model.record(1, 4, 0.030)
    assert model.load == pytest.approx(1.0)  # the load's median has not moved
    for _ in range(3):  # budget 8 (truly 25 ms) first measured in the burst
        model.record(1, 8, 0.0375)
    _, four, eight = model.row(1)
    assert eight / four == pytest.approx(1.25)
    model.forget(1, 8)  # re-measured in another burst: the same
    for _ in range(2):
        model.record(1, 4, 0.030)
    for _ in range(3):
        model.record(1, 8, 0.0375)
    _, four, eight = model.row(1)
    assert eight / four == pytest.approx(1.25)


def test_isotonic_pools_decreasing_runs_by_weight():
    assert isotonic([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 3.0, 2.0], [1, 1, 3]) == pytest.approx([1.0, 2.25, 2.25])
    assert isotonic([4.0, 1.0, 1.0, 5.0], [2, 1, 1, 1]) == pytest.approx([2.5, 2.5, 2.5, 5.0])


def test_a_row_never_predicts_a_bigger_tree_cheaper():
    """A cell measured under a burst (budget 8 here) is pooled with the bigger budget measured
    often, weighted by sample counts; an unmeasured cell's prior is clamped between its
    measured neighbours. Without this, the burst keeps budget 8 unchosen until re-measured."""
    budgets = (0, 4, 8, 16, 32)
    model = LatencyModel([[1.0, 2.0, 3.0, 4.0, 100.0]], budgets, bs_buckets=(1,))
    for _ in range(3):
        model.record(1, 0, 0.006)
        model.record(1, 8, 0.0135)  # a burst of load while budget 8 was profiled
    for _ in range(8):
        model.record(1, 16, 0.0105)
    row = model.row(1)
    assert row == sorted(row)
    assert row[2] == row[3] == pytest.approx((3 * 0.0135 + 8 * 0.0105) / 11)
    assert row[0] == pytest.approx(0.006)
    assert row[0] <= row[1] <= row[2]  # unmeasured 4: between its measured neighbours
    assert row[4] >= row[3]  # unmeasured 32: at least 16's


def test_the_log_line_shows_each_cells_time_and_measured_steps():
    """``latency_line``: C(bs, N) in ms and how many steps its cell has measured (a cell of
    few steps is the first suspect when auto avoids a budget)."""
    budgets = (0, 4, 8)
    model = LatencyModel([[0.01, 0.02, 0.03]], budgets, bs_buckets=(1,))
    ctl = BudgetController(neutral(budgets=budgets), model, max_slots=4)
    for _ in range(2):
        ctl.record_step(1, 4, 0.025)
    plain, four, eight = ctl.latency_line(1).split()
    assert four == "4:25.0/2"
    assert plain == "0:12.5/0" and eight == "8:37.5/0"  # the prior, scaled by 25 / 20


def test_a_plain_steps_time_is_recorded_per_forward():
    """Budget 0's cell is per target forward: a plain step of two forwards records half its
    time (so C(bs, 0) stays below every drafted cell and rate(0) = bs / C(bs, 0)); a drafted
    step records its whole time."""
    budgets = (0, 4, 8)
    model = LatencyModel([[1.0, 2.0, 3.0]], budgets, bs_buckets=(1,))
    ctl = BudgetController(neutral(budgets=budgets), model, max_slots=1)
    for _ in range(3):
        ctl.record_step(1, 0, 0.012, drafted=False, forwards=2)
        ctl.record_step(1, 8, 0.02)
    assert model.seconds(1, 0) == pytest.approx(0.006)
    assert model.seconds(1, 8) == pytest.approx(0.02)
