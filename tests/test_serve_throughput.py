"""benchmarks/serve_throughput.py's summary of auto against the best fixed budget."""

from __future__ import annotations

import itertools
import math

import pytest
from benchmark_helpers import load_benchmark


def row(config: str, conc: int, waves: list[float]) -> dict:
    return {
        "config": config,
        "concurrency": conc,
        "output_tokens_per_s": sum(waves) / len(waves),
        "repeats_tokens_per_s": waves,
    }


def auto_line(bench, control: dict) -> str:
    """The markdown table of one ddtree:auto row with the round summary ``control``."""
    row = {"config": "ddtree:auto", "concurrency": 1, "output_tokens_per_s": 1.0, "tau": 1.0,
           "ttft_p50_ms": 1, "itl_p50_ms": 1, "itl_p99_ms": 1, "mismatched_outputs": 0,
           "speedup_vs_none": None, "repeats_tokens_per_s": [1.0], "control": control}  # fmt: skip
    env = {"device": "cpu", "target": "t", "prompts": 1, "prompt_tokens": 1, "new_tokens": 1,
           "command": "c"}  # fmt: skip
    return bench.markdown([row], env)


def summary_table(bench, rows: list[dict]) -> str:
    """The markdown of ``row``-made rows (their other columns filled in, no DDTREE metrics)."""
    return bench.markdown(
        [r | {"tau": 1.0, "ttft_p50_ms": 1, "itl_p50_ms": 1, "itl_p99_ms": 1,
              "mismatched_outputs": 0, "speedup_vs_none": None,
              "control": {"predicted_accept": None, "step_time_error": None, "budget_steps": {}}}
         for r in rows],
        {"device": "cpu", "target": "t", "prompts": 1, "prompt_tokens": 1, "new_tokens": 1,
         "command": "c"},
    )  # fmt: skip


def test_auto_is_compared_wave_by_wave_with_the_best_fixed_budget_of_its_concurrency():
    bench = load_benchmark("serve_throughput")
    rows = [
        row("none", 1, [50.0, 50.0, 50.0]),
        row("chain", 1, [200.0, 200.0, 200.0]),  # not a ddtree budget: never "best fixed"
        row("ddtree:4", 1, [90.0, 110.0, 100.0]),
        row("ddtree:8", 1, [120.0, 100.0, 110.0]),  # best at 1 (110 tok/s)
        row("ddtree:auto", 1, [60.0, 100.0, 110.0]),
        row("ddtree:4", 2, [100.0, 100.0]),
        row("ddtree:auto", 2, [90.0, 110.0]),
        row("ddtree:8", 4, [100.0]),  # no auto at 4: no line
    ]
    first, second = bench.auto_vs_best_fixed(rows)
    assert first["concurrency"] == 1 and first["best_fixed"] == "ddtree:8"
    assert first["ratio"] == pytest.approx(90.0 / 110.0)
    # wave i against wave i: 0.5, 1.0, 1.0 (sorted or pooled pairs would differ)
    assert (first["wave_min"], first["wave_median"], first["wave_max"]) == (0.5, 1.0, 1.0)
    # 95% interval: the ratio times exp(+-1.96 sd / sqrt(3)) of the log ratios (ln 0.5, 0, 0)
    half = 1.96 * math.log(2) / math.sqrt(3) / math.sqrt(3)  # sd of (ln 0.5, 0, 0): ln 2 / sqrt 3
    low, high = first["ratio_interval"]
    assert (low, high) == pytest.approx((90 / 110 * math.exp(-half), 90 / 110 * math.exp(half)))
    assert second["best_fixed"] == "ddtree:4" and second["ratio"] == pytest.approx(1.0)
    assert (second["wave_min"], second["wave_max"]) == (0.9, 1.1)
    table = summary_table(bench, rows)
    assert f"| 1 | ddtree:auto | ddtree:8 | 0.818 | {low:.3f}-{high:.3f} | 1.000 | 0.50-1.00 |" in (
        table
    )
    assert "Identical servers" not in table  # no replica ran


def test_a_replica_is_a_second_server_of_its_configuration_and_measures_their_spread():
    """``CONFIG@N`` launches CONFIG's command in another server; a fixed budget's replica is
    never the best fixed budget (the luckiest of more servers would read auto lower), an auto
    replica is compared with the best fixed budget like auto, and each replica's tok/s over
    its original's, wave by wave, is the run's control: what identical servers differ by."""
    bench = load_benchmark("serve_throughput")
    args = bench.parse_args([])
    for config in ("ddtree:8", "ddtree:auto", "none"):
        assert bench.server_command(args, config + "@2", 1234) == bench.server_command(
            args, config, 1234
        )
    rows = [
        row("ddtree:8", 1, [100.0, 100.0]),
        row("ddtree:8@2", 1, [120.0, 100.0]),  # faster, yet not the best fixed budget
        row("ddtree:auto", 1, [90.0, 110.0]),
        row("ddtree:auto@2", 1, [95.0, 95.0]),
    ]
    versus = bench.auto_vs_best_fixed(rows)
    assert [(v["auto"], v["best_fixed"]) for v in versus] == [
        ("ddtree:auto", "ddtree:8"),
        ("ddtree:auto@2", "ddtree:8"),
    ]
    assert [v["ratio"] for v in versus] == pytest.approx([1.0, 0.95])
    spread = bench.replica_spread(rows)
    assert [(v["replica"], v["original"]) for v in spread] == [
        ("ddtree:8@2", "ddtree:8"),
        ("ddtree:auto@2", "ddtree:auto"),
    ]
    assert [v["ratio"] for v in spread] == pytest.approx([1.1, 0.95])
    assert (spread[0]["wave_min"], spread[0]["wave_max"]) == pytest.approx((1.0, 1.2))
    table = summary_table(bench, rows)
    assert "| 1 | ddtree:8@2 | 1.100 |" in table and "| 1 | ddtree:auto@2 | 0.950 |" in table


def test_round_summary_reads_the_latency_models_bias_from_the_metrics():
    bench = load_benchmark("serve_throughput")
    before = {"step_time_predicted_seconds_total": 1.0, "step_time_measured_seconds_total": 1.0}
    after = {
        "steps_total{budget=8}": 20.0,
        "timed_steps_total": 20.0,
        "step_time_abs_rel_error_total": 2.0,
        "step_time_predicted_seconds_total": 2.1,  # 1.1 s predicted over the round
        "step_time_measured_seconds_total": 2.0,  # 1.0 s measured
    }
    control = bench.control_summary(before, after)
    assert control["budget_steps"] == {8: 20}
    assert control["step_time_error"] == 0.1
    assert control["step_time_predicted_over_measured"] == 1.1
    assert "| 10% (1.10) |" in auto_line(bench, control | {"predicted_accept": None})


def test_round_summary_gives_the_calibration_gap_its_interval():
    """sqrt(sum of squared weighted errors) / calibrated request-steps: 25 over 100 steps is a
    standard error of 0.05, shown as the gap's 95% interval, +-0.10."""
    bench = load_benchmark("serve_throughput")
    before = {"calibrated_requests_total": 100.0, "calibrated_squared_error_total": 11.0}
    after = {
        "calibrated_requests_total": 200.0,
        "predicted_accept_tokens_total": 50.0,
        "calibrated_accepted_tokens_total": 40.0,
        "calibrated_squared_error_total": 36.0,
        "verified_requests_total": 300.0,
    }
    control = bench.control_summary(before, after)
    assert control["accept_gap_stderr"] == 0.05
    assert (control["predicted_accept"], control["observed_accept"]) == (0.5, 0.4)
    assert "| 0.50/0.40 +-0.10 (n 300) |" in auto_line(bench, control)


def test_a_tiny_run_writes_its_table_and_keeps_the_server_logs_where_asked(tmp_path, monkeypatch):
    """One real CPU server (no speculation), one request of 4 tokens: the JSON and markdown
    table are written and the server's log lands in ``--logs`` (the GPU runs carry it back),
    with the scheduler's garbage collector frozen after the warm-up (no full collection of its
    ~670k objects in a measured wave).
    The environment (commit, load average) is read before the servers run: a commit made
    during a 20-minute run was recorded as the code it measured."""
    serve_throughput = load_benchmark("serve_throughput")
    out, logs = tmp_path / "table.json", tmp_path / "servers"
    calls = []
    for name in ("environment", "measure"):
        real = getattr(serve_throughput, name)
        monkeypatch.setattr(
            serve_throughput,
            name,
            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a),
        )
    record = serve_throughput.main(
        ["--configs", "none", "--concurrency", "1", "--prompts", "1", "--new-tokens", "4",
         "--repeats", "1", "--logs", str(logs), "--out", str(out)]
    )  # fmt: skip
    assert [(r["config"], r["concurrency"]) for r in record["rows"]] == [("none", 1)]
    assert record["rows"][0]["output_tokens_per_s"] > 0
    assert out.is_file() and out.with_suffix(".md").is_file()
    server_log = (logs / "none.log").read_text()
    assert "sglang.launch_server" in server_log.splitlines()[0]
    assert "Freezing GC in Scheduler process" in server_log
    assert calls == ["environment", "measure"]


def test_a_result_names_the_commit_it_measured(monkeypatch):
    """Every benchmark's environment carries the checkout's commit (results of different code
    sat side by side in benchmarks/results/ with nothing to tell them apart); the table shows
    it beside the command, and outside a git checkout it says so."""
    common = load_benchmark("common")
    root = common.Path(common.__file__).resolve().parent.parent
    head = common.subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    code = common.environment("cpu")["code"]
    assert code in (head, head + "+dirty")
    env = {"device": "cpu", "target": "t", "prompts": 1, "prompt_tokens": 1, "new_tokens": 1,
           "command": "c", "code": code}  # fmt: skip
    assert f"(code {code})" in load_benchmark("serve_throughput").markdown([], env)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(common.subprocess, "run", no_git)
    assert common.code_version() == "unknown"


def test_a_pinned_budget_runs_in_its_auto_server_and_auto_is_compared_with_its_best():
    """``SERVER/N``: budget N pinned in SERVER's own (auto) server. Auto is compared with the
    best of its own server's pinned budgets (no server offset between them), apart from the
    fixed servers; a pinned budget is never a fixed server's, nor an auto, nor a replica of
    the server it runs in (a replica's pin is a replica of the original's pin)."""
    bench = load_benchmark("serve_throughput")
    assert (bench.server_of("ddtree:auto/8"), bench.pin_of("ddtree:auto/8")) == (
        "ddtree:auto",
        8,
    )
    assert bench.server_of("ddtree:auto@2/16") == "ddtree:auto@2"
    assert bench.base_config("ddtree:auto@2/16") == "ddtree:auto/16"
    assert bench.pin_of("ddtree:auto") is None
    for bad in ("ddtree:8/4", "ddtree:auto/x", "none/0", "ddtree:8/auto"):
        with pytest.raises(SystemExit, match="AUTO_SERVER/N"):
            bench.pin_of(bad)
    assert bench.pin_of("ddtree:auto/auto:hard=0:tie=0.03") == "auto:hard=0:tie=0.03"
    assert bench.step.auto_overrides("auto:hard=0:tie=0.03") == {
        "hard_plain_steps": 0,
        "tie_rtol": 0.03,
    }
    with pytest.raises(SystemExit, match="unknown auto option 'nope'"):
        bench.pin_of("ddtree:auto/auto:nope=1")
    budgets = bench.auto_budgets(bench.parse_args([]))
    assert budgets == (0, 4, 8, 16, 32)
    assert bench.pin_of("ddtree:auto/0", budgets) == 0
    with pytest.raises(SystemExit, match="not one of auto's budgets"):
        bench.pin_of("ddtree:auto/5", budgets)
    assert bench.auto_budgets(bench.parse_args(["--auto-candidates", "0,2,8"])) == (0, 2, 8)
    rows = [
        row("ddtree:8", 1, [130.0, 130.0]),  # a server of its own: best fixed, not best own
        row("ddtree:auto", 1, [100.0, 100.0]),
        row("ddtree:auto/4", 1, [90.0, 90.0]),
        row("ddtree:auto/8", 1, [110.0, 90.0]),  # best own (100 tok/s)
        row("ddtree:auto@2", 1, [99.0, 99.0]),
        row("ddtree:auto@2/8", 1, [90.0, 90.0]),  # auto@2's own
        row("ddtree:auto@2/4", 1, [120.0, 120.0]),  # not auto's own
        row("ddtree:auto/auto:hard=0", 1, [95.0, 95.0]),  # a variant: compared, never best
    ]
    own = bench.auto_vs_own_fixed(rows)
    assert [(v["auto"], v["best_fixed"]) for v in own] == [
        ("ddtree:auto", "ddtree:auto/8"),
        ("ddtree:auto/auto:hard=0", "ddtree:auto/8"),
        ("ddtree:auto@2", "ddtree:auto@2/4"),
    ]
    assert [v["ratio"] for v in own] == pytest.approx([1.0, 0.95, 99 / 120])
    assert (own[0]["wave_min"], own[0]["wave_max"]) == pytest.approx((100 / 110, 100 / 90))
    versus = bench.auto_vs_best_fixed(rows)
    assert [(v["auto"], v["best_fixed"]) for v in versus] == [
        ("ddtree:auto", "ddtree:8"),
        ("ddtree:auto@2", "ddtree:8"),
    ]
    spread = bench.replica_spread(rows)
    assert [(v["replica"], v["original"]) for v in spread] == [
        ("ddtree:auto@2", "ddtree:auto"),
        ("ddtree:auto@2/8", "ddtree:auto/8"),
        ("ddtree:auto@2/4", "ddtree:auto/4"),
    ]
    table = summary_table(bench, rows)
    assert "| 1 | ddtree:auto | ddtree:auto/8 | 1.000 |" in table
    assert "| 1 | ddtree:auto@2 | ddtree:auto@2/4 | 0.825 |" in table


def test_on_a_gpu_each_server_runs_alone_with_its_pinned_configurations(tmp_path, monkeypatch):
    """A GPU holds one server at a time: the run measures server by server, and a pinned
    ``SERVER/N`` runs with its SERVER (in the same process), not in a server of its own."""
    bench = load_benchmark("serve_throughput")
    calls = []

    def fake_measure(args, configs, prompts, logs):
        calls.append(configs)
        return {
            c: [{"concurrency": 1, "output_tokens_per_s": 10.0, "repeats_tokens_per_s": [10.0],
                 "tau": 1.0, "ttft_p50_ms": 1, "itl_p50_ms": 1, "itl_p99_ms": 1,
                 "control": bench.control_summary({}, {}), "outputs": [[1]]}]
            for c in configs
        }  # fmt: skip

    monkeypatch.setattr(bench, "measure", fake_measure)
    configs = ["none", "ddtree:auto", "ddtree:8", "ddtree:auto/8", "ddtree:auto/auto:hard=0"]
    bench.main(["--device", "cuda", "--configs", *configs, "--concurrency", "1",
                "--out", str(tmp_path / "t.json"), "--logs", str(tmp_path / "logs")])  # fmt: skip
    assert calls == [
        ["none"],
        ["ddtree:auto", "ddtree:auto/8", "ddtree:auto/auto:hard=0"],
        ["ddtree:8"],
    ]


@pytest.mark.parametrize("n", [2, 3, 6, 7])
def test_each_configuration_follows_every_other_equally_often(n):
    """The rounds' orders (a Williams design): each runs every configuration once, and every
    configuration follows every other one equally often (once for even n, twice for odd n),
    so a cost of the wave before (another server's) falls on none of them alone."""
    bench = load_benchmark("serve_throughput")
    orders = bench.balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = [pair for order in orders for pair in itertools.pairwise(order)]
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
    assert sorted(follows) == sorted(pairs * (2 if n % 2 else 1))


def test_a_run_measures_its_rounds_in_the_balanced_orders(tmp_path, monkeypatch):
    """``measure`` runs round r in ``balanced_orders``' order r (cycling), each configuration
    on its own server (a pinned one in its auto server), group by group: at concurrency c each
    group of c prompts runs at once on every configuration before the next group runs on any
    (at concurrency 1 request by request), each configuration's wave then summed from its
    groups."""
    bench = load_benchmark("serve_throughput")
    calls = []
    for name in ("warm_up", "freeze_gc", "wait_until_healthy", "stop"):
        monkeypatch.setattr(bench, name, lambda *a, **k: None)
    monkeypatch.setattr(bench, "launch", lambda command, *a, **k: command)
    monkeypatch.setattr(bench, "free_port", itertools.count(1).__next__)
    monkeypatch.setattr(bench, "ddtree_metrics", lambda url: {})
    monkeypatch.setattr(bench, "summarise", lambda c, waves, control: waves)

    def fake_wave(url, prompts, c, new_tokens, pin):
        calls.append((url, pin, [p[0] for p in prompts], c))
        return {"replies": [(url, pin, p[0]) for p in prompts], "wall": len(calls)}

    monkeypatch.setattr(bench, "run_wave", fake_wave)
    configs = ["none", "chain", "ddtree:auto", "ddtree:auto/8"]
    args = bench.parse_args(["--configs", *configs, "--repeats", "5", "--concurrency", "2", "1"])
    results = bench.measure(args, configs, [[10], [11], [12]], tmp_path)
    orders = [[configs[i] for i in o] for o in bench.balanced_orders(len(configs))]
    rounds = [orders[r % len(orders)] for r in range(5)]
    ports = {"none": 1, "chain": 2, "ddtree:auto": 3, "ddtree:auto/8": 3}  # launch order
    urls = {config: f"http://127.0.0.1:{port}" for config, port in ports.items()}
    groups = {2: [[10, 11], [12]], 1: [[10], [11], [12]]}
    expected = [
        (urls[config], bench.pin_of(config), group, c)
        for c in (2, 1)
        for order in rounds
        for group in groups[c]
        for config in order
    ]
    assert calls == expected
    for config in configs:
        walls = [
            k + 1
            for k, call in enumerate(calls)
            if call[:2] == (urls[config], bench.pin_of(config))
        ]
        for c, waves, offset in ((2, results[config][0], 0), (1, results[config][1], 10)):
            n = len(groups[c])
            assert [w["replies"] for w in waves] == [
                [(urls[config], bench.pin_of(config), p) for p in (10, 11, 12)]
            ] * 5
            assert [w["wall"] for w in waves] == [
                sum(walls[offset + n * r : offset + n * (r + 1)]) for r in range(5)
            ]
