"""benchmarks/latency_replay.py: the latency model replayed on a real auto server's steps
under a known truth finds the true within-row ratios when the machine holds still."""

from __future__ import annotations

from pathlib import Path

from benchmark_helpers import load_benchmark

STEP_LOG = Path(__file__).parent.parent / "benchmarks/results/steps_auto_cpu_small_pair_c4_c8.csv"


def test_the_model_finds_the_true_ratios_and_machine_noise_moves_them():
    replay = load_benchmark("latency_replay").main
    quiet = ["--drift", "0", "--burst-rate", "0", "--noise", "0"]
    still = replay([str(STEP_LOG), "--repeats", "1", "--seeds", "1", *quiet])
    assert still["worst"] < 1e-6, still
    noisy = replay([str(STEP_LOG), "--repeats", "1", "--seeds", "2"])
    assert 0.01 < noisy["rms"] < 0.2 and noisy["worst"] > 0.05, noisy
