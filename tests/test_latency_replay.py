"""benchmarks/latency_replay.py: the latency model replayed on a real auto server's steps
under a known truth finds the true within-row ratios when the machine holds still."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from benchmark_helpers import load_benchmark

from sglang_tree_spec.step_times import PHASES, STEP_LOG_HEADER

STEP_LOG = Path(__file__).parent.parent / "benchmarks/results/steps_auto_cpu_small_pair_c4_c8.csv"


def test_the_model_finds_the_true_ratios_and_machine_noise_moves_them():
    replay = load_benchmark("latency_replay").main
    quiet = ["--drift", "0", "--burst-rate", "0", "--noise", "0"]
    still = replay([str(STEP_LOG), "--repeats", "1", "--seeds", "1", *quiet])
    assert still["worst"] < 1e-6, still
    noisy = replay([str(STEP_LOG), "--repeats", "1", "--seeds", "2"])
    assert 0.01 < noisy["rms"] < 0.2 and noisy["worst"] > 0.05, noisy


def write_step_log(path: Path, steps: list[tuple[int, int, int, float, int]]) -> None:
    """Rows of (batch size, budget, forecast, seconds, tokens), drafted, one forward."""
    lines = [STEP_LOG_HEADER]
    for bs, budget, forecast, seconds, tokens in steps:
        times = "," * (len(PHASES) - 1)
        reason = "expired" if forecast else "held"
        lines.append(f"{bs},{budget},1,{forecast},1,{tokens},{seconds},{times},,,{reason}")
    path.write_text("\n".join(lines) + "\n")


MIN_TRUTH_STEPS = 30  # latency_replay.MIN_TRUTH_STEPS


def test_real_times_are_scored_against_the_pinned_budgets_of_the_same_server(tmp_path):
    """``--truth DIR``: the auto log's own times replayed, scored against the means of the
    pinned budgets' logs. Times that are the pinned means give no ratio error and no regret;
    pinned steps of B 16 costing 30% more than auto's make the model's B 16 / B 8 ratio read
    low by log 1.3, and the model's row then chooses B 16, which the truth rates below B 8."""
    cost = {4: 0.010, 8: 0.011, 16: 0.012, 32: 0.015}  # seconds at batch size 2
    tokens = {4: 5, 8: 6, 16: 7, 32: 7}  # per step, over 2 requests
    steps = []
    for _ in range(12):  # holds of every budget, each forecast followed by its held steps
        for budget in (4, 8, 16, 32):
            steps += [(2, budget, 1, cost[budget], tokens[budget])]
            steps += [(2, budget, 0, cost[budget], tokens[budget])] * 5
    auto = tmp_path / "steps_auto_1.csv"
    write_step_log(auto, steps)

    def pin(budget: int, factor: float = 1.0) -> None:
        rows = [(2, budget, 0, cost[budget] * factor, tokens[budget])] * MIN_TRUTH_STEPS
        write_step_log(tmp_path / f"steps_auto-pin{budget}_1.csv", rows)

    for budget in cost:
        pin(budget)
    write_step_log(tmp_path / "steps_auto-pinauto_hard0_1.csv", [(2, 4, 0, 1.0, 1)] * 40)
    replay = load_benchmark("latency_replay").main
    exact = replay([str(auto), "--truth", str(tmp_path)])
    assert exact["rms"] < 1e-6 and exact["regret"] == 0.0, exact
    pin(16, factor=1.3)  # B 16 truly dearer than auto's steps of it say
    dear = replay([str(auto), "--truth", str(tmp_path), "--latency", "pair_rate=0.05"])
    rate8, rate16 = tokens[8] / cost[8], tokens[16] / (1.3 * cost[16])
    assert dear["regret"] == pytest.approx(1.0 - rate16 / rate8)
    assert dear["rms"] == pytest.approx(math.log(1.3) * math.sqrt(2 / 3), rel=1e-6)
    with pytest.raises(SystemExit):
        replay([str(auto), "--truth", str(tmp_path), "--latency", "no_such_field=1"])
