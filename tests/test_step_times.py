"""The opt-in step timer: per-phase means and shares, reported every N steps, free when off."""

from __future__ import annotations

from sglang_tree_spec.step_times import PhaseTimer


def fake_clock(times: list[float]):
    values = iter(times)
    return lambda: next(values)


def test_phase_timer_reports_mean_ms_and_shares_every_n_steps():
    lines: list[str] = []
    # Two steps: draft 2 ms then tree 6 ms, then draft 4 ms and tree 8 ms.
    clock = fake_clock([0.0, 0.002, 0.008, 1.0, 1.004, 1.012])
    timer = PhaseTimer(True, "cpu", lines.append, every=2, clock=clock)
    for batch in (4, 8):
        timer.start()
        timer.mark("draft")
        timer.mark("tree")
        timer.end_step(batch)
    assert len(lines) == 1
    assert "over 2 steps (mean batch 6.0): 10.00 ms" in lines[0]
    assert "draft 3.00 ms (30%)" in lines[0] and "tree 7.00 ms (70%)" in lines[0]


def test_disabled_phase_timer_never_reads_the_clock_or_reports():
    def clock() -> float:
        raise AssertionError("clock read while disabled")

    lines: list[str] = []
    timer = PhaseTimer(False, "cpu", lines.append, every=1, clock=clock)
    timer.start()
    timer.mark("draft")
    timer.end_step(3)
    assert lines == []


def test_step_log_carries_the_phases_its_report_averages(tmp_path):
    """With the phase timer on, every step-log line carries the step's seconds per phase and
    ``step_log_report`` adds their mean per (kind, budget); untimed lines leave them blank and
    the report shows no phase column. A calibrated step's line carries its predicted and
    accepted draft tokens, which the report averages per request-step (kind, budget)."""
    from benchmark_helpers import load_benchmark

    from sglang_tree_spec.step_times import PHASES, StepLog

    report = load_benchmark("step_log_report").report
    timed, untimed = tmp_path / "steps_auto_1.csv", tmp_path / "steps_16_2.csv"
    log = StepLog(str(timed))
    for scale in (1.0, 3.0):  # two held B 16 steps: each phase's mean is twice its first value
        phases = {phase: scale * 1e-3 * (i + 1) for i, phase in enumerate(PHASES)}
        calibrated = None if scale == 1.0 else [5.0, 3.0]
        log.write(2, 16, True, False, 1, 6, 0.02, phases, calibrated, "held")
    log.write(2, 0, False, False, 2, 4, 0.01, {"verify": 4e-3}, None, "plain")  # no draft
    log.write(3, 32, True, True, 1, 9, 0.02, None, [4.5, 6.0], "arrivals")  # a forecast at B 32
    StepLog(str(untimed)).write(1, 16, True, False, 1, 3, 0.01, None, None, "fixed")
    header, *rows = report(timed).splitlines()[1:]
    assert header.endswith(" / ".join(PHASES) + " ms | predicted / accepted (request-steps) |")
    held = next(row for row in rows if row.startswith("| held | 16 |"))
    assert held.endswith(" | 2.00 / 4.00 / 6.00 / 8.00 / 10.00 / 12.00 | 2.50 / 1.50 (2) |"), held
    plain = next(row for row in rows if row.startswith("| plain | 0 |"))
    assert plain.endswith(" | 0.00 / 0.00 / 4.00 / 0.00 / 0.00 / 0.00 | - |"), plain
    forecast = next(row for row in rows if row.startswith("| forecast | 32 |"))
    assert forecast.endswith(" | 1.50 / 2.00 (3) |"), forecast
    assert "observe" not in report(untimed) and untimed.read_text().endswith(",,,,,fixed\n")
    assert "predicted" not in report(untimed)


def test_step_log_report_weighs_autos_steps_against_its_pinned_budgets(tmp_path):
    """Beside its pinned budgets' logs (the same process), auto's steps are read per batch size
    against the best pinned budget's tokens per second: auto's ratio, and each (kind, budget)'s
    loss, the time its steps took beyond the best budget's for their tokens (summing to 1 -
    the ratio); the ratio split into auto's choices (its steps charged the pinned budgets' mean
    step times) and its steps' own cost (their time over that); a batch size whose pinned
    budgets ran too few steps is left out."""
    from benchmark_helpers import load_benchmark

    from sglang_tree_spec.step_times import StepLog

    bench = load_benchmark("step_log_report")
    auto = tmp_path / "steps_auto_7.csv"
    log = StepLog(str(auto))
    for reason in ("held", "held", "explore"):  # batch size 2: 3 held B 8 steps of 10 tokens
        log.write(2, 8, True, False, 1, 10, 0.010, None, None, reason)  # in 10 ms
    log.write(2, 8, True, True, 1, 10, 0.015, None, None, "expired")  # 5 ms dearer: 5 ms lost
    log.write(2, 0, False, False, 2, 4, 0.008, None, None, "plain")  # 4 tokens: 4 ms at 1 tok/ms
    pins = {4: (8, 0.010), 8: (10, 0.010)}  # (tokens, seconds) a step: B 8 is the best
    for budget, (tokens, seconds) in pins.items():
        pin = StepLog(str(tmp_path / f"steps_auto-pin{budget}_7.csv"))
        for _ in range(20):
            pin.write(2, budget, True, False, 1, tokens, seconds, None, None, "fixed")
        pin.write(4, budget, True, False, 1, tokens, seconds, None, None, "fixed")  # too few
    table = bench.versus_pinned(auto, sorted(tmp_path.glob("steps_auto-pin*_7.csv")), (2, 4))
    # auto: 44 tokens in 53 ms against 1 token / ms: 0.830; lost 5 (forecast) + 4 (plain)
    ratio = "batch size 2: auto 0.830x the best pinned budget (B 8; pinned: B 4 0.800, B 8 1.000)"
    assert ratio in table
    # charged the pinned B 8's 10 ms a step, its plain step its own 8: 44 tokens in 48 ms
    assert "its steps read 0.917x (its choices), and they took +10.4% longer" in table
    assert "| forecast | 8 | 1 | 28.3% | 15.00 | 10.00 | +9.4% |" in table
    assert "| held | 8 | 3 | 56.6% | 10.00 | 10.00 | +0.0% |" in table
    assert "| plain | 0 | 1 | 15.1% | 8.00 | - | +7.5% |" in table
    # the same losses per reason: the forecast's is its expired hold's
    assert "| forecast | expired | 1 | 28.3% | 15.00 | +9.4% |" in table
    assert "| held | explore | 1 | 18.9% | 10.00 | +0.0% |" in table
    assert "| held | held | 2 | 37.7% | 10.00 | +0.0% |" in table
    assert "| plain | plain | 1 | 15.1% | 8.00 | +7.5% |" in table
    assert "batch size 4" not in table


def test_step_log_report_splits_autos_own_cost_by_phase(tmp_path):
    """With phase times, the report adds per batch size the time auto's forecast and held steps
    took beyond the pinned steps of their budget, per phase and outside the step (period minus
    phases), as a share of auto's time there; plain steps (no pinned cell) and untimed lines are
    left out."""
    from benchmark_helpers import load_benchmark

    from sglang_tree_spec.step_times import PHASES, StepLog

    bench = load_benchmark("step_log_report")
    base = dict(zip(PHASES, (2e-3, 1e-3, 5e-3, 0.5e-3, 1e-3, 0.0), strict=True))  # 9.5 ms
    pin = StepLog(str(tmp_path / "steps_auto-pin8_3.csv"))
    for _ in range(20):  # pinned B 8: 9.5 ms of phases in a 10 ms period
        pin.write(2, 8, True, False, 1, 10, 0.010, base, None, "fixed")
    auto = tmp_path / "steps_auto_3.csv"
    log = StepLog(str(auto))
    log.write(2, 8, True, False, 1, 10, 0.011, {**base, "observe": 1e-3}, [2.0, 2.0], "held")
    log.write(2, 8, True, True, 1, 10, 0.012, {**base, "tree": 3e-3}, None, "expired")
    log.write(2, 0, False, False, 2, 4, 0.008, {"verify": 7e-3}, None, "plain")  # no cell
    log.write(2, 8, True, False, 1, 10, 0.030, None, None, "held")  # untimed
    table = bench.versus_pinned(auto, [tmp_path / "steps_auto-pin8_3.csv"], (2,))
    # auto's time at batch size 2: 11 + 12 + 8 + 30 = 61 ms
    names = " | ".join([*PHASES, "outside"])
    assert f"| kind | {names} |" in table
    # the held step: observe +1 ms (1.6%), outside +0.5 - 0.5 = 0; the forecast: tree +2 ms
    assert "| held | +0.0% | +0.0% | +0.0% | +0.0% | +0.0% | +1.6% | +0.0% |" in table
    assert "| forecast | +0.0% | +3.3% | +0.0% | +0.0% | +0.0% | +0.0% | +0.0% |" in table
    assert "| plain |" not in table.split(f"| kind | {names} |")[1]
