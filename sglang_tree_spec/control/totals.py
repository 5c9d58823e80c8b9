"""The budget controller's accepted-token totals and its one host read per forecast."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Drafted steps whose accept lengths may wait for a host read: a bound on the tensors kept alive
# where no forecast reads them (the start-up profile, long explorations).
PENDING_STEPS = 256


@dataclass(frozen=True)
class ControlStats:
    """Observability snapshot (reading it synchronises: call it for logs, not every step).

    Attributes:
        last_budget: the last step's budget (None before the first).
        predicted_accept_tokens: the calibrated prediction at the verified budget, summed over
            the calibrated request-steps: every ``ControlConfig.held_observe_every``-th drafted
            step's, forecast or held, each counting for its stride (a grafted tree's: every
            forecast step's, counting for itself; its held steps are not calibrated).
        accepted_tokens: accepted draft tokens over every drafted request-step (exact).
        request_steps: drafted request-steps (exact; budget-0 steps not counted).
        budget_counts: steps per chosen budget.
        depth_scale: per-depth calibration factors s_d.
        latency_mean_abs_rel_error: of predicted vs measured step times.
        latency_steps: how many measured steps that error covers.
        latency_predicted_seconds / latency_measured_seconds: those steps' predicted and
            measured times summed (their ratio: the model's bias over a run).
        calibrated_accepted_tokens / calibrated_request_steps: the accepted draft tokens and
            request-steps of the calibrated steps, weighted alike: the sample the prediction
            covers, so predicted / calibrated accepted tokens compares like with like.
        calibration_squared_error: sum over the calibrated request-steps of (weight x
            (predicted - accepted))^2, weight the steps each stands for: the variance of the
            predicted-minus-observed total (:attr:`accept_gap_stderr`).
    """

    last_budget: int | None
    predicted_accept_tokens: float
    accepted_tokens: float
    request_steps: int
    budget_counts: dict[int, int]
    depth_scale: list[float]
    latency_mean_abs_rel_error: float
    latency_steps: int = 0
    latency_predicted_seconds: float = 0.0
    latency_measured_seconds: float = 0.0
    calibrated_accepted_tokens: float = 0.0
    calibrated_request_steps: float = 0.0
    calibration_squared_error: float = 0.0

    @property
    def mean_predicted_accept(self) -> float:
        """Over the calibrated request-steps (the prediction's sample)."""
        return self.predicted_accept_tokens / max(self.calibrated_request_steps, 1.0)

    @property
    def mean_calibrated_accept(self) -> float:
        """Observed, over the same calibrated request-steps."""
        return self.calibrated_accepted_tokens / max(self.calibrated_request_steps, 1.0)

    @property
    def mean_observed_accept(self) -> float:
        return self.accepted_tokens / max(self.request_steps, 1)

    @property
    def accept_gap_stderr(self) -> float:
        """Standard error of ``mean_predicted_accept - mean_calibrated_accept`` (request-steps
        taken as independent). With few calibrated steps a gap of 10% can be noise: the 95%
        interval is +-1.96 of this."""
        return self.calibration_squared_error**0.5 / max(self.calibrated_request_steps, 1.0)


class Totals:
    """Accepted draft tokens of every drafted step and the calibrated steps' predictions.

    A step's ``[bs]`` accept lengths (the caller's own tensor, kept by reference: no device op
    on the step) wait for the next host read (a forecast's, or ``stats()``), which reads them
    behind its own values in one transfer (:meth:`read`)."""

    def __init__(self, device: torch.device | str) -> None:
        # draft tokens summed over the calibrated request-steps (held steps sampled, weighted):
        # [predicted, accepted, squared weighted error]; and their count
        self.calibrated = torch.zeros(3, dtype=torch.float64, device=device)
        self.calibrated_steps = 0.0
        self._weights: dict[int, torch.Tensor] = {}  # weight -> [3] (add)
        self.accepted_tokens = 0.0
        self.request_steps = 0
        self._pending: list[tuple[torch.Tensor, bool]] = []  # (accept lengths, keep its mean)
        self.held_means: list[float] = []  # read per-request means of the kept steps, in order

    def count(self, accept_len: torch.Tensor, keep_mean: bool) -> None:
        """Host only: a drafted step's ``[bs]`` accept lengths join the exact totals at the next
        read (``keep_mean``: its per-request mean joins :attr:`held_means`); a long run without
        a read (the start-up profile) is read at ``PENDING_STEPS`` steps."""
        self.request_steps += accept_len.numel()
        self._pending.append((accept_len, keep_mean))
        if len(self._pending) >= PENDING_STEPS:
            self.read(self.calibrated[:0])

    def read(self, values: torch.Tensor) -> list[float]:
        """THE host read of a step or of ``stats()``: ``values`` (``[n]``) with the pending
        accept lengths behind them in one transfer; returns ``values`` as floats."""
        n, pending = values.numel(), self._pending
        read = (
            torch.cat([values, *(a for a, _ in pending)]).tolist() if pending else values.tolist()
        )
        at = n
        for accept_len, keep_mean in pending:
            bs = accept_len.numel()
            accepted = sum(read[at : at + bs])
            at += bs
            self.accepted_tokens += accepted
            if keep_mean:
                self.held_means.append(accepted / bs)
        self._pending = []
        return read[:n]

    def add(self, step: torch.Tensor, weight: int, requests: int) -> None:
        """Sync-free: a calibrated step's ``[3]`` unweighted sums (predicted, accepted, squared
        error) standing for ``weight`` steps of ``requests`` request-steps each."""
        weights = self._weights.get(weight)
        if weights is None:  # weight, weight and weight^2 (a squared error of equal ones)
            weights = torch.tensor([weight, weight, weight * weight], dtype=torch.float64)
            weights = self._weights[weight] = weights.to(self.calibrated.device)
        self.calibrated.addcmul_(step, weights)
        self.calibrated_steps += weight * requests
