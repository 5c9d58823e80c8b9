"""benchmarks/soak.py, short: 60 mixed requests at concurrency 8 against a real DDTREE server.

Greedy (plain, stop strings, penalties, ``return_logprob``) and seeded requests, 10% of them
aborted mid-stream (connection closed or ``/abort_request``): no request lost, every greedy
output equal to a synchronous no-speculation server's (aborted ones on their common part),
every seeded output equal to DDTREE's own replay where the first (prefill) token agrees, the KV
pool's used tokens back to their idle value, no Traceback / ERROR / leak line in the server log.
"""

from __future__ import annotations

import json

from benchmark_helpers import load_benchmark


def test_short_soak_is_exact_and_leaves_the_server_idle(tmp_path):
    import sglang  # noqa: F401  (fail, not skip, without SGLang)

    out = tmp_path / "soak.json"
    record = load_benchmark("soak").main(
        ["--requests", "60", "--concurrency", "8", "--max-new-tokens", "32", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == record
    s = record["summary"]
    assert s["requests"] == 60
    assert s["lost"] == [] and s["errors"] == []
    assert s["greedy_mismatches"] == []
    assert s["seeded_mismatches"] == []
    # Not vacuous: every kind served and compared, aborts happened, the pool was in use.
    assert set(s["kinds"]) == {"greedy", "stop", "penalty", "seeded"}
    seeded_apart = len(s["seeded_first_token_differs"])  # SGLang's unseeded prefill draw
    assert s["greedy_compared"] + s["seeded_compared"] + seeded_apart == 60
    assert s["seeded_compared"] > seeded_apart
    assert s["aborts"]["planned"] == 6
    assert s["aborts"]["closed_mid_stream"] + s["aborts"]["abort_request_ended_abort"] > 0
    assert s["kv_peak_used"] > 0
    assert s["kv_back_to_idle"], (s["kv_idle_before"], s["kv_idle_after"])
    assert s["server_log_problems"] == [] and s["baseline_log_problems"] == []
    assert all(v > 0 for v in record["run"]["rss_mib_after"].values())
