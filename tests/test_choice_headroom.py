"""benchmarks/choice_headroom.py's policies over recorded steps."""

from __future__ import annotations

import pytest
import torch
from benchmark_helpers import load_benchmark


def test_policies_charge_each_step_its_choice():
    """An easy step (budget 8 commits 5 tokens) and a hard one (a plain step's 2 tokens beat
    any draft): fixed plain steps are the best fixed policy (4 tokens in 4 ms); choosing per
    step takes 8 then plain (7 tokens in 6 ms); the same choice one step late takes 8 twice."""
    bench = load_benchmark("choice_headroom")
    true = torch.tensor([[2.0, 2.0, 5.0, 5.0, 5.0], [2.0, 1.0, 1.0, 1.0, 1.0]])
    cost = torch.tensor([2.0, 4.0, 4.0, 4.0, 4.0])
    ratios = bench.policies(true, true, cost)  # a perfect surrogate
    assert ratios["fixed 0"] == 1.0 and ratios["fixed 8"] == pytest.approx(0.75)
    assert ratios["surrogate"] == pytest.approx(7 / 6)
    assert ratios["oracle"] == pytest.approx(7 / 6)
    assert ratios["surrogate, one step late"] == pytest.approx(6 / 8)
    assert ratios["surrogate, drafted only"] == pytest.approx(6 / 8)
    blind = bench.policies(torch.zeros_like(true), true, cost)  # predicts nothing: plain
    assert blind["surrogate"] == 1.0
