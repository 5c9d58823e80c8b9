"""DDTREE's Prometheus series: each publish adds only what is new since the last one."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sglang_tree_spec.control import ControlStats
from sglang_tree_spec.plugin.metrics import DDTreeMetrics, read_ddtree_metrics


def stats(last, pred, obs, count, budgets, err, timed) -> ControlStats:
    """``pred`` / ``obs``: mean accept lengths over the ``count`` request-steps, half of them
    calibrated (observed 0.8 x ``obs`` there); the ``timed`` steps took 10 ms each, predicted
    11."""
    timing = (err, timed, 0.011 * timed, 0.01 * timed)
    calibrated = (0.4 * obs * count, count / 2)
    return ControlStats(
        last, pred * count / 2, obs * count, count, budgets, [], *timing, *calibrated
    )


def test_publish_exports_the_cumulative_stats_once():
    registry = CollectorRegistry()
    metrics = DDTreeMetrics("tiny", registry)
    metrics.publish(stats(8, 2.0, 1.5, 10, {0: 3, 8: 7}, 0.1, 5))
    metrics.publish(stats(8, 2.0, 1.5, 10, {0: 3, 8: 7}, 0.1, 5))  # nothing new
    metrics.publish(stats(4, 2.5, 1.0, 20, {0: 3, 4: 2, 8: 9}, 0.2, 10))
    page = generate_latest(registry).decode()
    assert 'model_name="tiny"' in page
    samples = read_ddtree_metrics(page)
    assert samples["steps_total{budget=0}"] == 3
    assert samples["steps_total{budget=4}"] == 2
    assert samples["steps_total{budget=8}"] == 9
    assert samples["budget"] == 4
    assert samples["verified_requests_total"] == 20
    assert samples["accepted_tokens_total"] == 20.0
    assert samples["calibrated_requests_total"] == 10
    assert samples["predicted_accept_tokens_total"] == 25.0  # mean 2.5 over the 10 calibrated
    assert samples["calibrated_accepted_tokens_total"] == 8.0  # 0.8 x 1.0 over the 10
    assert samples["timed_steps_total"] == 10
    assert abs(samples["step_time_abs_rel_error_total"] - 2.0) < 1e-9  # 0.2 over 10 steps
    assert samples["step_time_predicted_seconds_total"] == pytest.approx(0.11)
    assert samples["step_time_measured_seconds_total"] == pytest.approx(0.1)


def test_the_calibrations_squared_error_is_a_counter_of_what_is_new():
    registry = CollectorRegistry()
    metrics = DDTreeMetrics("tiny", registry)
    first = stats(8, 2.0, 1.5, 10, {8: 10}, 0.1, 5)
    metrics.publish(dataclasses.replace(first, calibration_squared_error=9.0))
    metrics.publish(dataclasses.replace(first, calibration_squared_error=16.0))
    samples = read_ddtree_metrics(generate_latest(registry).decode())
    assert samples["calibrated_squared_error_total"] == 16.0


def test_counters_are_exported_before_they_count():
    """A useless drafter accepts nothing: its accepted-token counter must still read 0 (a
    missing series broke the benchmark's round summary and leaves dashboards without data)."""
    registry = CollectorRegistry()
    metrics = DDTreeMetrics("tiny", registry)
    metrics.publish(stats(4, 0.1, 0.0, 10, {0: 50, 4: 10}, 0.1, 5))
    samples = read_ddtree_metrics(generate_latest(registry).decode())
    assert samples["accepted_tokens_total"] == 0.0
    assert samples["verified_requests_total"] == 10


def test_read_ddtree_metrics_ignores_sglangs_own_series():
    page = (
        'sglang:spec_accept_length{model_name="m"} 2.5\n'
        "# HELP sglang:ddtree_steps_total DDTREE decode steps per tree budget\n"
        'sglang:ddtree_steps_total{budget="16",model_name="m"} 4.0\n'
        'sglang:ddtree_steps_created{budget="16",model_name="m"} 1.7e9\n'
    )
    assert read_ddtree_metrics(page) == {"steps_total{budget=16}": 4.0}
