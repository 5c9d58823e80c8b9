"""benchmarks/step_overhead.py, one block: both sides commit the same tokens; the record."""

from __future__ import annotations

import json

from benchmark_helpers import load_benchmark


def test_step_overhead_compares_before_and_after_on_every_cell(tmp_path):
    out = tmp_path / "step.json"
    record = load_benchmark("step_overhead").main(
        ["--repeats", "1", "--block", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == record
    cells = {(r["policy"], r["bs"], r["budget"]) for r in record["rows"]}
    assert cells == {(p, bs, b) for p in ("ddtree", "unified") for bs in (1, 16) for b in (16, 64)}
    assert all(r["before_ms"] > 0 and r["after_ms"] > 0 for r in record["rows"])
