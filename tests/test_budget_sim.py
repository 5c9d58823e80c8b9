"""benchmarks/budget_sim.py: steps are charged their table cells, and the cells drive auto."""

from __future__ import annotations

import json

import pytest
from benchmark_helpers import load_benchmark


def run(tmp_path, cells: str, *policies: str) -> dict:
    out = tmp_path / "sim.json"
    argv = ["--batch-sizes", "1", "--prompts", "2", "--new-tokens", "24", "--cells", cells]
    record = load_benchmark("budget_sim").main([*argv, "--policies", *policies, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    return {r["policy"]: r for r in record["runs"]}


def test_a_fixed_policy_is_charged_its_cell_per_step_and_auto_follows_the_cells(tmp_path):
    runs = run(tmp_path, "1:5,10,11,12,13", "fixed:8", "fixed:32")
    for policy, cell_ms in (("fixed:8", 11.0), ("fixed:32", 13.0)):
        r = runs[policy]
        assert r["seconds"] == pytest.approx(r["steps"] * cell_ms / 1e3)
        assert r["tokens_per_s"] == pytest.approx(2 * 24 / r["seconds"])
    cheap_plain = run(tmp_path, "1:1,100,100,100,100", "auto")["auto"]
    assert cheap_plain["plain_forwards"] > cheap_plain["steps"]  # mostly plain steps
    free_drafts = run(tmp_path, "1:100,1,1,1,1", "auto")["auto"]
    assert free_drafts["plain_forwards"] == 0
    assert max(free_drafts["budget_counts"].items(), key=lambda kv: kv[1])[0] >= 16
