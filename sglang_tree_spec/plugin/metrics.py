"""DDTREE's Prometheus series, beside SGLang's own (``--enable-metrics``).

SGLang's scheduler writes its metrics through ``prometheus_client`` in multiprocess mode (the
server's ``/metrics`` merges every process's files), so series created in the scheduler process,
where the worker runs, appear on the same endpoint with no hook. Published from TP rank 0 only
(like SGLang's scheduler metrics), with SGLang's ``model_name`` label:

* ``sglang:ddtree_steps_total{budget}``: decode steps verified at each budget (0: plain step).
* ``sglang:ddtree_budget``: the last step's budget.
* ``sglang:ddtree_verified_requests_total``, ``sglang:ddtree_accepted_tokens_total`` (auto):
  drafted request-steps and the accepted draft tokens over them (exact).
* ``sglang:ddtree_calibrated_requests_total``, ``sglang:ddtree_predicted_accept_tokens_total``,
  ``sglang:ddtree_calibrated_accepted_tokens_total`` (auto): the request-steps the calibration
  learnt from (one drafted step's in ``ControlConfig.held_observe_every``, forecast or held,
  counting for its stride), the calibrated predicted accepted draft tokens over them and their
  observed ones: predicted / calibrated accepted is the mean predicted / observed accept length
  over any window, on the same steps (a grafted tree, ``--speculative-ddtree-graft``, is not
  a nested DDTree: its held steps do not calibrate, and the sample is every forecast step).
* ``sglang:ddtree_calibrated_squared_error_total`` (auto): the sum over those request-steps of
  (weight x (predicted - accepted))^2; its square root over the calibrated request-steps is the
  standard error of the mean predicted-minus-observed gap (is a 10% gap noise?).
* ``sglang:ddtree_timed_steps_total``, ``sglang:ddtree_step_time_abs_rel_error_total``,
  ``sglang:ddtree_step_time_predicted_seconds_total``,
  ``sglang:ddtree_step_time_measured_seconds_total`` (auto): steps the latency model was
  checked on, the sum of |predicted - measured| / measured, and their predicted and measured
  times (the ratio of the rates: the model's bias over any window).

The worker publishes the controller's cumulative :class:`~sglang_tree_spec.control.ControlStats`
(a device read) every few dozen steps and before every prefill, so a window that ends when the
server goes idle is complete once the next request has been admitted.
"""

from __future__ import annotations

from typing import Any

from sglang_tree_spec.control import ControlStats


class DDTreeMetrics:
    """Counters fed from cumulative controller stats (each publish adds what is new)."""

    def __init__(self, model_name: str, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge  # after PROMETHEUS_MULTIPROC_DIR

        registry = REGISTRY if registry is None else registry
        self.labels = {"model_name": model_name}
        names = list(self.labels)

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(
                f"sglang:ddtree_{name}", text, labelnames=[*names, *extra], registry=registry
            )

        self.steps = counter("steps", "DDTREE decode steps per tree budget", ("budget",))
        self.budget = Gauge(
            "sglang:ddtree_budget",
            "DDTREE budget of the last decode step",
            labelnames=names,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.request_steps = counter("verified_requests", "DDTREE drafted request-steps")
        self.observed = counter("accepted_tokens", "DDTREE accepted draft tokens")
        self.calibrated_steps = counter(
            "calibrated_requests", "DDTREE request-steps calibrated (held steps sampled, weighted)"
        )
        self.predicted = counter(
            "predicted_accept_tokens", "DDTREE predicted accepted draft tokens (calibrated steps)"
        )
        self.calibrated = counter(
            "calibrated_accepted_tokens", "DDTREE accepted draft tokens (calibrated steps)"
        )
        self.squared_error = counter(
            "calibrated_squared_error",
            "DDTREE sum of (weight x (predicted - accepted draft tokens))^2 (calibrated steps)",
        )
        self.timed_steps = counter("timed_steps", "DDTREE steps the latency model was checked on")
        self.latency_error = counter(
            "step_time_abs_rel_error", "DDTREE sum of |predicted - measured| / measured step time"
        )
        self.latency_predicted = counter(
            "step_time_predicted_seconds", "DDTREE predicted time of the checked steps"
        )
        self.latency_measured = counter(
            "step_time_measured_seconds", "DDTREE measured time of the checked steps"
        )
        for metric in (
            self.request_steps,
            self.observed,
            self.calibrated_steps,
            self.predicted,
            self.calibrated,
            self.squared_error,
            self.timed_steps,
            self.latency_error,
            self.latency_predicted,
            self.latency_measured,
        ):
            metric.labels(**self.labels)  # exported at 0 from the start, as Prometheus expects
        self._last = ControlStats(None, 0.0, 0.0, 0, {}, [], 0.0, 0)

    def publish(self, stats: ControlStats) -> None:
        """Add what ``stats`` (cumulative since start-up) holds beyond the last publish."""
        last = self._last
        for budget, count in stats.budget_counts.items():
            new = count - last.budget_counts.get(budget, 0)
            if new > 0:
                self.steps.labels(**self.labels, budget=str(budget)).inc(new)
        if stats.last_budget is not None:
            self.budget.labels(**self.labels).set(stats.last_budget)
        for metric, now, before in (
            (self.request_steps, stats.request_steps, last.request_steps),
            (self.observed, stats.accepted_tokens, last.accepted_tokens),
            (
                self.calibrated_steps,
                stats.calibrated_request_steps,
                last.calibrated_request_steps,
            ),
            (self.predicted, stats.predicted_accept_tokens, last.predicted_accept_tokens),
            (
                self.calibrated,
                stats.calibrated_accepted_tokens,
                last.calibrated_accepted_tokens,
            ),
            (
                self.squared_error,
                stats.calibration_squared_error,
                last.calibration_squared_error,
            ),
            (self.timed_steps, stats.latency_steps, last.latency_steps),
            (
                self.latency_error,
                stats.latency_mean_abs_rel_error * stats.latency_steps,
                last.latency_mean_abs_rel_error * last.latency_steps,
            ),
            (
                self.latency_predicted,
                stats.latency_predicted_seconds,
                last.latency_predicted_seconds,
            ),
            (self.latency_measured, stats.latency_measured_seconds, last.latency_measured_seconds),
        ):
            if now > before:
                metric.labels(**self.labels).inc(now - before)
        self._last = stats


def read_ddtree_metrics(text: str) -> dict[str, float]:
    """The ``sglang:ddtree_*`` samples of a ``/metrics`` page, keyed by name and labels
    (``model_name`` dropped), e.g. ``{"steps_total{budget=8}": 120.0, ...}``."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("sglang:ddtree_"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.removeprefix("sglang:ddtree_").partition("{")
        kept = [
            pair.replace('"', "")
            for pair in labels.rstrip("}").split(",")
            if pair and not pair.startswith("model_name=")
        ]
        if not name.endswith("_created"):
            samples[name + (f"{{{','.join(kept)}}}" if kept else "")] = float(value)
    return samples
