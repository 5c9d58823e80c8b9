"""Where a decode step spends its time: the step's own phase timer.

:func:`sglang_tree_spec.step.decode_step` marks its phases (draft, tree, verify, accept,
commit) on a :class:`PhaseTimer`. The server enables it with ``SGLANG_TREE_SPEC_STEP_TIMES=N``
(N > 0: the mean time per phase logged every N decode steps); the reference engine and the
benchmarks read :attr:`PhaseTimer.last_step` after every step.

Off by default: timing a GPU step honestly needs a device synchronisation at every phase
boundary, which the hot path must not pay.

:class:`StepLog` (``SGLANG_TREE_SPEC_STEP_LOG=DIR``, server only) writes one CSV line per decode
step: batch size, budget, whether it drafted or forecast, target forwards, committed tokens and
the step's period (the latency model's measurement), for reading the budget control step by
step (``benchmarks/step_log_report.py``); with ``SGLANG_TREE_SPEC_STEP_TIMES`` too, the step's
seconds per phase (:data:`PHASES`; blank without it); and for a step the budget control
calibrated on (a sampled drafted step; a grafted tree's forecast step) its predicted and
accepted draft tokens summed over its requests (blank for the others). Each line reads the
committed tokens (and those sums): a device read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

ENV_FLAG = "SGLANG_TREE_SPEC_STEP_TIMES"
LOG_ENV_FLAG = "SGLANG_TREE_SPEC_STEP_LOG"
# The phases decode_step marks, in order (observe: the budget controller's update after verify).
PHASES = ("draft", "tree", "verify", "accept", "commit", "observe")
STEP_LOG_HEADER = (
    "bs,budget,drafted,forecast,forwards,tokens,seconds,"
    + ",".join(PHASES)
    + ",predicted,accepted,reason"
)


class StepLog:
    """One CSV line per decode step into ``DIR/steps_<label>_<pid>.csv`` (``label``: the
    server's budget, ``auto`` or a number). :meth:`from_env` returns None when the variable is
    unset, so the hot path pays one ``is None`` test."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # line-buffered, lives as long as the worker
        if self._file.tell() == 0:
            self._file.write(STEP_LOG_HEADER + "\n")

    @classmethod
    def from_env(cls, label: str) -> StepLog | None:
        folder = os.environ.get(LOG_ENV_FLAG, "")
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"steps_{label}_{os.getpid()}.csv"))

    def write(
        self, bs: int, budget: int, drafted: bool, forecast: bool, forwards: int, tokens: int,
        seconds: float, phases: dict[str, float] | None, calibrated: list[float] | None,
        reason: str,
    ) -> None:  # fmt: skip
        """``phases``: seconds per phase (:attr:`PhaseTimer.last_step`), None when untimed;
        ``calibrated``: [predicted, accepted] draft tokens (``StepResult.calibrated``), None
        when the step was not calibrated; ``reason``: why the step has its budget
        (``StepResult.reason``)."""
        times = ",".join(
            "" if phases is None else f"{phases.get(phase, 0.0):.6f}" for phase in PHASES
        )
        sums = "," if calibrated is None else f"{calibrated[0]:.4f},{calibrated[1]:.0f}"
        self._file.write(
            f"{bs},{budget},{int(drafted)},{int(forecast)},{forwards},{tokens},{seconds:.6f},"
            f"{times},{sums},{reason}\n"
        )


class PhaseTimer:
    """Mean wall time per named phase of a step, reported every ``every`` steps.

    Call :meth:`start` at the top of a step, :meth:`mark` at the end of each phase (the phase
    runs from the previous mark) and :meth:`end_step` last. Disabled, every call is a no-op.
    """

    def __init__(
        self,
        enabled: bool,
        device: torch.device | str,
        report: Callable[[str], None] | None,
        every: int = 50,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled, self.every, self.report, self.clock = enabled, every, report, clock
        is_cuda = torch.device(device).type == "cuda"
        self._sync = torch.cuda.synchronize if is_cuda else (lambda: None)
        self._totals: dict[str, float] = {}
        self.last_step: dict[str, float] = {}  # seconds per phase of the last step
        self._steps = self._rows = 0
        self._last = 0.0

    @classmethod
    def from_env(cls, device: torch.device | str, report: Callable[[str], None]) -> PhaseTimer:
        """Enabled by ``SGLANG_TREE_SPEC_STEP_TIMES=N``: a report every N steps."""
        every = int(os.environ.get(ENV_FLAG, "0") or 0)
        return cls(every > 0, device, report, every=max(every, 1))

    def start(self) -> None:
        if self.enabled:
            self._sync()
            self._last = self.clock()
            self.last_step = {}

    def mark(self, phase: str) -> None:
        if self.enabled:
            self._sync()
            now = self.clock()
            self.last_step[phase] = self.last_step.get(phase, 0.0) + now - self._last
            self._totals[phase] = self._totals.get(phase, 0.0) + now - self._last
            self._last = now

    def end_step(self, batch_size: int) -> None:
        if not self.enabled:
            return
        self._steps += 1
        self._rows += batch_size
        if self.report is not None and self._steps % self.every == 0:
            self.report(self.summary())
            self._totals, self._steps, self._rows = {}, 0, 0

    @property
    def steps(self) -> int:
        """Steps since the last report (all steps when nothing reports)."""
        return self._steps

    def totals(self) -> dict[str, float]:
        """Seconds per phase over :attr:`steps`."""
        return dict(self._totals)

    def summary(self) -> str:
        """One line: mean ms and share of the step per phase since the last report."""
        step = sum(self._totals.values())
        parts = [
            f"{name} {1e3 * total / self._steps:.2f} ms ({100 * total / step:.0f}%)"
            for name, total in self._totals.items()
        ]
        return (
            f"step times over {self._steps} steps (mean batch {self._rows / self._steps:.1f}): "
            f"{1e3 * step / self._steps:.2f} ms = " + ", ".join(parts)
        )
