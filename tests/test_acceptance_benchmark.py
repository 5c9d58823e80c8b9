"""benchmarks/acceptance.py on the committed small pair, tiny: JSON structure, plot, exactness."""

from __future__ import annotations

import json

import pytest
from benchmark_helpers import load_benchmark


@pytest.fixture(scope="module")
def acceptance():
    return load_benchmark("acceptance")


def test_small_pair_run_writes_exact_results(acceptance, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "acceptance.json"
    argv = ["--prompts", "2", "--new-tokens", "8", "--budgets", "8", "4", "--out", str(out)]
    record = acceptance.main(argv)

    assert json.loads(out.read_text()) == record
    assert out.with_suffix(".png").stat().st_size > 0
    from common import portable  # benchmarks/ is importable once a benchmark is loaded

    # the command as written: the temporary folder as <tmp>, no machine path
    assert record["command"] == portable("python benchmarks/acceptance.py " + " ".join(argv))
    assert "<tmp>/" in record["command"] and str(tmp_path) not in json.dumps(record)
    assert record["pair"] == "small pair"
    assert record["settings"]["budgets"] == [4, 8]
    assert record["settings"]["new_tokens"] == 8 and record["settings"]["greedy"]
    assert list(record["domains"]) == ["code-stdlib"]  # no chat template: its own prompts
    assert record["domains"]["code-stdlib"]["prompts"] == 2
    for key in ("torch", "transformers", "torch_threads", "load_average_before", "dtype"):
        assert key in record["env"]

    assert record["mismatches"] == {"total": 0, "details": []}  # greedy: every method == ar
    rows = {row["label"]: row for row in record["rows"]}
    assert list(rows) == ["ar", "chain", "ddtree-4", "ddtree-8"]
    for label, row in rows.items():
        assert row["domain"] == "code-stdlib" and row["mismatches"] == 0
        assert 0 < row["tokens"] <= 2 * 8 and row["tok_s"] > 0 and row["wall_s"] > 0
        assert row["steps"] == sum(row["accept_hist"])
        committed = sum((n + 1) * c for n, c in enumerate(row["accept_hist"]))
        assert row["tau"] == pytest.approx(committed / row["steps"], abs=1e-4)
        low, high = row["tau_95ci"]
        assert low <= row["tau"] <= high
        assert row["budget"] == (int(label.split("-")[1]) if label.startswith("ddtree") else None)
    assert rows["ar"]["tau"] == 1.0 and rows["ar"]["speedup_vs_ar"] == 1.0
    assert all(rows[label]["tau"] >= 1.0 for label in ("chain", "ddtree-4", "ddtree-8"))
