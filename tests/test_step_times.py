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
