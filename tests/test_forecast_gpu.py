"""benchmarks/forecast_gpu.py: runs on the committed acceptance profile, labels itself a
forecast, and its auto column is never below any fixed column nor plain decoding."""

from __future__ import annotations

from benchmark_helpers import load_benchmark


def test_forecast_runs_and_auto_dominates(tmp_path):
    forecast = load_benchmark("forecast_gpu")
    out = tmp_path / "forecast.md"
    results = forecast.main(["--out", str(out)])
    text = out.read_text()
    assert text.startswith("# FORECAST") and "NOT measured" in text and "ASSUMED" in text
    assert len(results) == 2 * 5  # (H100, H200) x (2 targets x 2 profiles + SmolLM2)
    for res in results:
        assert [row["bs"] for row in res["rows"]] == [1, 2, 4, 8, 16, 32, 64]
        for row in res["rows"]:
            tok_s = row["tok_s"]
            fixed = [v for k, v in tok_s.items() if k.startswith("B") or k == "none"]
            assert tok_s["auto"] >= max(fixed) * (1 - 1e-9)
    # Compute-bound at bs 64: auto shrinks the tree on an 8B target.
    qwen = next(r for r in results if r["target"] == "Qwen3-8B" and "H100" in r["device"])
    assert qwen["rows"][-1]["auto_budget"] < qwen["rows"][0]["auto_budget"]


def test_profile_interpolation():
    forecast = load_benchmark("forecast_gpu")
    p = forecast.Profile("p", "test", 15, 1.5, {16: 2.0, 64: 3.0})
    assert p.tau(0) == 1.0 and p.tau(16) == 2.0 and p.tau(64) == 3.0 and p.tau(256) == 3.0
    assert 1.0 < p.tau(4) < p.tau(8) < 2.0 < p.tau(32) < 3.0
    assert forecast.Profile("q", "t", 15, 6.0, {15: 6.0}).tau(1) == 2.0  # capped at N + 1
