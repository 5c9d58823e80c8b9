"""The budget controller: one choice per decode step for the whole batch.

N* = argmax_N sum_i (1 + A_i(N)) / C(bs, N) over the candidate budgets, A_i the calibrated
surrogate of request i, ties toward the smaller budget. The objective is the batch's predicted
committed tokens per second. At bs = 1 it is BASTION's rule; at large bs the target forward turns
compute-bound, C(bs, N) grows with bs * (N + 1) and N* shrinks.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import partial

import torch

from sglang_tree_spec.control.calibration import AcceptCalibrator, CalibrationConfig, Factors
from sglang_tree_spec.control.latency import LatencyModel, bucket_of
from sglang_tree_spec.control.surrogate import (
    DEFAULT_BUDGETS,
    budget_index,
    prefix_sums_at,
    rank_nodes,
)

# Why a step has its budget (BudgetController.reason; the step log's last column). Steps that
# forecast: "arrivals" (as many requests arrived since the last forecast as the batch holds),
# "probe" (a plain run drafts to re-forecast), "grew" (the batch outgrew its held choice's),
# "expired" (no hold left: it ran out, or none was made). Steps that do not: "held" (a forecast's
# choice holds), "explore" (re-measuring a stale cell, or the plain step before one), "profile"
# (the start-up profile), "plain" (a plain run's step), "fixed" (a fixed budget).
REASONS = ("arrivals", "probe", "grew", "expired", "held", "explore", "profile", "plain", "fixed")

# Drafted steps whose accept lengths may wait for a host read (BudgetController._count_accepted):
# a bound on the tensors kept alive where no forecast reads them (the start-up profile, long
# explorations), one sync in this many steps there.
PENDING_STEPS = 256


def best_budget(
    committed: list[float],
    seconds: list[float],
    budgets: tuple[int, ...],
    max_budget: int | None = None,
    tie_rtol: float = 1e-6,
    min_budget: int = 0,
) -> int:
    """Host argmax of committed[c] / seconds[c] over ``budgets`` (sorted ascending), ties
    (within ``tie_rtol``) toward the smaller budget; budgets above ``max_budget`` or below
    ``min_budget`` skipped (``budgets[0]`` when none is left).

    Args:
        committed: ``[C]`` predicted committed tokens of the batch, sum_i (1 + A_i(N)).
        seconds: ``[C]`` step time C(bs, N).
    """
    best, best_rate = budgets[0], -1.0
    for column, budget in enumerate(budgets):
        if max_budget is not None and budget > max_budget:
            break
        if budget < min_budget:
            continue
        rate = committed[column] / seconds[column]
        if rate > best_rate * (1.0 + tie_rtol):
            best, best_rate = budget, rate
    return best


@dataclass(frozen=True)
class ControlConfig:
    """Attributes:
    budgets: sorted candidate budgets (use :func:`candidate_budgets`); 0 = plain decode.
    fixed_budget: None = auto; a number = always that budget (no reads, no latency needed).
    max_depth: L, drafted positions per step (the drafter's block - 1).
    probe_every: while auto prefers plain steps (budget 0), draft (and re-forecast) after this
        many steps; that probe verifies at the best budget > 0 (its draft is paid for), which
        also keeps the drafted cells' step times fresh. Each probe after which drafting still
        does not pay on average (``plain_decay``) doubles the interval, up to
        ``probe_max_every`` (a useless drafter then costs one probe in ``probe_max_every``
        steps); a probe after which it pays ends the plain run.
        A plain run also probes once as many requests have arrived (``reset``) as the batch
        holds: the forecast was made for text the batch no longer decodes (at batch size 1,
        every new request is forecast on its first decode step).
    probe_max_every: the longest interval between probes.
    plain_decay: plain runs start and end on what drafting pays ON AVERAGE: the drafted
        steps' decayed sums (this factor per drafted step) of committed tokens per request
        (a forecast step's predicted, every other drafted step's observed:
        :meth:`BudgetController.observe_committed`) and of step time in plain-step units
        (C(bs, N) / C(bs, 0)). A run starts when
        a step's forecast prefers plain steps and those sums say a drafted step commits fewer
        tokens per second than a plain one; it ends at the probe after which they say it
        commits more. One uncertain step amid predictable text does not stop a drafter that
        pays on the whole (it takes ``hard_plain_steps`` plain steps at most), nor does one
        lucky probe restart a drafter that does not.
    profile_steps: auto measures every candidate's C(bs, N) this many times in the first
        batch-size bucket that the latency model profiles (:meth:`LatencyModel.profiles`)
        before trusting the model (the start-up profile, served in-line: a budget never
        changes a token, so the profile costs speed only, for a few steps); every other
        profiled bucket then measures its contenders alone (``explore_margin`` at its first
        forecast, its unmeasured cells read from the measured buckets).
    explore_every: after the profile, every this many drafted steps (held ones included; no
        forecast on an exploration step) re-measure the contender (``explore_margin``) whose
        cell in this batch-size bucket was measured longest ago (0: never), so a cell measured
        once under a burst of load is not avoided for ever; when that is budget 0, the step
        before the exploration step is a plain one (no draft), and the exploration step then
        takes the stalest contender > 0 (of every budget > 0 when there is none).
    explore_margin: the contenders of a bucket are the budgets whose rate at its last forecast
        was within this fraction of the best (every budget before a forecast, and with
        margin 1): a stale cell matters where it can change the choice, and re-measuring a
        budget that loses by more than the cells' noise (5-10% on this CPU) would cost speed
        for nothing (budget 32 at batch size 16 costs twice budget 4's step).
    explore_inverted: a budget whose measured C(bs, N) exceeds a larger budget's by more than
        this fraction is one of its bucket's contenders whatever its predicted rate (None:
        never; :meth:`LatencyModel.inverted`), so explorations re-measure it. Cells of one row
        are set at different times, each normalised by the machine's load read then; when that
        read is off (a bucket first measured while the load follows another), the smaller
        budgets can read dearer than the larger ones: small pair at concurrency 16 through
        SGLang, B 4 and B 8 set at 33.2 and 31.6 ms (at load 1) against B 16's 28.4, fitted
        all three at 27.5-29 ms where B 4's steps took ~20, B 4 predicted more than
        ``explore_margin`` behind, never explored again, and B 16 held at 0.92x B 4's
        tokens/s (one of two auto servers of one run).
    explore_below_best: the drafted budget just below the forecast's best is one of its
        bucket's contenders whatever its predicted rate, so explorations switch between it and
        the best and correct their cells' ratio (:meth:`LatencyModel._pair`). A row's cells are
        set by a few profile steps each; once a smaller budget falls more than
        ``explore_margin`` behind on a ratio set wrong there, nothing re-measures it (small
        pair at concurrency 16 through SGLang: B 16's cell read 1.14x B 4's where
        its steps took 1.45x, B 4 never explored, B 16 held). Exploring the smaller neighbour
        costs fewer accepted tokens, never a dearer step, and the rate is unimodal in N, so a
        best budget that is wrong walks down one candidate at a time. Not auto's default:
        ``auto:below=1`` paired per wave against auto in the same server (small pair, 12
        waves, concurrency 1 / 2 / 4 / 8 / 16) read 1.059 / 1.002 / 0.983 / 1.010 / 0.987
        (see benchmarks/README.md, tuned settings), within the run's noise.
    explore_stale_neighbours: the drafted budgets next to the forecast's best (the one below
        and the one above) are contenders of its bucket whatever their predicted rate while
        their cell there was last measured ``forget_after`` or more drafted steps ago, or
        never: the next exploration re-measures such a cell afresh (its stale cost forgotten,
        :meth:`BudgetController.record_step`), after which its rate alone makes it a
        contender again. A cell read too dear, by the start-up profile or under a burst of
        load, is otherwise never measured again once it falls more than ``explore_margin``
        behind: small pair through SGLang (benchmarks/README.md, tuned settings), the profile
        set B 16 and B 32 at batch size 1 at 1.45x and 1.6x B 8's cost (pinned, their steps
        took 1.06x and 1.13x), their cells kept those 3 times for the whole run, and auto
        held B 8 through all 24 waves at concurrency 1, at 0.944x pinned B 32's tokens/s; a
        new bucket's never-measured neighbour likewise (batch size 16: B 8 first
        measured after 14 of 20 waves). It costs ``explore_steps`` steps at a neighbour once
        in ``forget_after`` drafted steps.
    profile_neighbours: a bucket that profiles its contenders alone (every one after the
        first whole profile, ``profile_steps``) profiles the candidates next to its latest
        forecast's best too (the one below, 0 included, and the one above), whatever their
        predicted rate, and as that best moves, next to the new one: a walk to the measured
        best, ``profile_steps`` steps a candidate at most, once a bucket. A new bucket's
        unmeasured cells read its measured neighbours' through the roofline prior, and where
        the prior's growth in N is off, the contenders are the wrong ones: small pair at
        concurrency 16 through SGLang, batch size 16
        read B 8 at 1.45x B 4's cost (49.3 against 34.1 ms; pinned, its steps took 1.18x), so
        B 8 was no contender, was not profiled, and auto held B 4 there for 14 of 20 waves
        until one forecast's margin let B 8 in (pinned, B 8 read 1.02x B 4's tokens/s at
        batch size 16). Unlike a contender, a neighbour is not explored again. Not auto's
        default: ``auto:near=1`` paired per wave against auto in the same server (small pair,
        12 waves, concurrency 2 / 4 / 8 / 16) read 1.014 / 1.010 / 0.972 / 0.983
        (see benchmarks/README.md, tuned settings), within the run's noise.
    explore_steps: an exploration step's budget holds for this many drafted steps (it
        included), so the re-measured cell reads several fresh times; one more after a plain
        step (the first drafted step after one is not timed: :meth:`BudgetController.record_step`).
    forget_after: a cell last measured this many drafted steps ago or more drops its cost at
        its next measurement (None: ``explore_every``; 0: never), so its fresh times set it
        afresh: a switch moves a cost a tenth of the way (``LatencyConfig.pair_rate``). The
        latency model's load already rescales times taken at another speed of the machine; this is
        for what changed the cell itself (longer contexts, other requests).
    hold_steps: a budget > 0 chosen by a forecast holds for this many drafted steps (the forecast
        step included) while the batch is the same: the steps after it draft and build at that
        budget alone, like a fixed budget (no forecast, no ranking, a tree no larger than verified;
        the calibration still learns from them, :meth:`observe_held`). 1: every drafted step
        forecasts. As many requests arriving as the batch holds (a renewed batch), a batch that
        grows, a probe and the profile end a hold; an exploration interrupts it, and it goes
        on after the exploration with the steps it had left (a forecast there cost more than
        the step it replaced: after an exploration came 19-22% of the forecasts at batch
        sizes 1-4 on this CPU through SGLang); one request of several
        arriving does not (at concurrency 2-8 one arrives every few steps, and forecast steps cost
        more than held ones), nor do requests leaving: the rest were forecast, and a smaller batch
        costs less per node (at concurrency 16 the batch shrinks request by request as a wave ends,
        and ending the hold there made every second step of the tail a forecast), nor do new
        requests replacing them up to the batch the choice was made for (a batch "grows" past
        the forecast's batch only; a hold whose batch followed the batch down as requests left
        made each replacement at a steady concurrency forecast: 93 of 993 steps at batch size
        4, small pair through SGLang, against 16).
    hold_max_steps: a forecast that chooses the budget the forecast before it chose holds twice
        as long as that one's hold, up to this many drafted steps (None: ``hold_steps``
        always); a different choice, or a plain run between them, holds ``hold_steps`` again.
        A choice that keeps being made needs its forecasts less often, and a forecast step
        costs more than a held one (the largest candidate's tree, ranking, choosing, a
        calibration update: +0.7-1.2 ms on CPU through SGLang, on ~20% of auto's steps).
        Arrivals and probes still end a hold early.
    tie_rtol: objectives within this relative margin of the best count as ties.
    choice_decay: the choice reads each request's decayed average of its forecasts' A_i(N)
        (this weight on the average so far per forecast; 0: the forecast step's own). One
        step's prediction is noisy: on a hard step every (1 + A(N)) / C(bs, N) is close and the
        smallest budget wins, on an easy one the largest, and either choice then holds for
        ``hold_steps`` steps whose text regresses to the mean (replayed small-pair steps at
        batch size 2: held steps accepted 2.06 draft tokens where their forecasts predicted
        2.36 at the chosen budget): the request's average predicts them better than the one
        step that chose their budget. A request arriving in a slot starts a new average.
    plain_long_decay: a second, long-run average of the same sums (this factor per drafted
        step; None: none). With it, drafting "does not pay" only when neither average pays:
        a hard stretch that pulls the recent average under a plain step's rate, for a drafter
        that pays on the whole, takes ``hard_plain_steps`` plain steps at a time (or, with
        none, verifies the cheapest budget > 0, which holds like any choice) instead of a
        plain run whose probes at growing intervals outlive the stretch.
    hard_plain_steps: a forecast that prefers plain steps while drafting pays on average (a
        hard stretch of text, not a useless drafter) is followed by this many plain steps,
        then a probe (0: none, drafting goes on). Hard text comes in stretches: the step after
        one whose drafts do not pay tends not to pay either.
    full_forecast_every: a forecast builds the largest candidate's tree (every candidate
        predicted) once in this many forecasts of a batch-size bucket, and the bucket's first
        forecast and a renewed batch's (as many arrivals as it holds) always; the others
        build the tree of the candidate above the largest contender of its last such full
        forecast (``explore_margin``), its reach, and choose among the candidates up to it (1:
        every forecast is full). A forecast at the reach drafts a smaller top-K (fewer depths
        too when the reach is under the drafter's block) and ranks a smaller tree: at batch
        size 8, where B 4-8 contend and B 32 reads 0.78-0.85x the best, a full forecast step
        took 3.7 ms more than B 8's pinned step and one reaching B 8 alone 1.7 ms (small pair
        on this CPU through SGLang). A budget above the reach keeps its
        per-request averages (``choice_decay``) until the next full forecast (a smaller tree's
        prediction for it is clamped to the tree's whole sum).
        Not auto's default (``step.make_controller`` leaves it at 1): ``auto:full=4`` paired
        per wave against auto in the same server (small pair, 12 waves, concurrency 1 / 2 / 4
        / 8 / 16) read 1.024 / 1.059 / 1.012 / 1.015 / 0.978, and
        the other way round, as the default against ``auto:full=1``, 0.999 / 1.004 / 0.971 /
        0.970 / 0.984 (see benchmarks/README.md, tuned settings). Without the renewed batch's
        full forecast it read 1.067 and 1.069 at concurrency 16 in two runs (its forecast
        steps' phases were no cheaper there), and 0.953 and 0.981 at concurrency 1 (one
        request's reach carried over to the next).
    held_observe_every: the calibration learns from every this many drafted steps, forecast
        or held (:meth:`BudgetController.observe` and :meth:`~BudgetController.observe_held`;
        1: all of them; a grafted tree: from every forecast step alone), each standing for its
        stride (weight and decay of that many steps: unweighted, the hard forecast steps would
        weigh more in the calibration than in the steps served, and predict low). A fixed
        stride is an unbiased sample of the drafted steps (it does not look at their text),
        and each update is ~30 small tensor ops: on CPU through SGLang 0.3 ms of a 12.5 ms step
        at batch size 1, paid on most steps of an auto server and on none of a fixed one's.
    calibration: the acceptance calibration's decays and priors.
    """

    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    fixed_budget: int | None = None
    max_depth: int = 15
    probe_every: int = 4
    probe_max_every: int = 64
    plain_decay: float = 0.95
    profile_steps: int = 0
    explore_every: int = 0
    explore_steps: int = 1
    explore_inverted: float | None = None
    explore_below_best: bool = False
    explore_stale_neighbours: bool = False
    profile_neighbours: bool = False
    forget_after: int | None = None
    explore_margin: float = 1.0
    hold_steps: int = 1
    hold_max_steps: int | None = None
    tie_rtol: float = 1e-6
    choice_decay: float = 0.0
    plain_long_decay: float | None = None
    hard_plain_steps: int = 0
    full_forecast_every: int = 1
    held_observe_every: int = 1
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def __post_init__(self) -> None:
        budgets = list(self.budgets)
        if not budgets or budgets != sorted(set(budgets)) or budgets[0] < 0:
            raise ValueError(f"budgets must be sorted, distinct and >= 0: {self.budgets}")
        if not 1 <= self.probe_every <= self.probe_max_every:
            raise ValueError(
                f"need 1 <= probe_every <= probe_max_every: {self.probe_every}, "
                f"{self.probe_max_every}"
            )
        if not 0.0 <= self.choice_decay < 1.0:
            raise ValueError(f"choice_decay must be in [0, 1), got {self.choice_decay}")
        if not 0.0 <= self.plain_decay < 1.0:
            raise ValueError(f"plain_decay must be in [0, 1), got {self.plain_decay}")
        if self.plain_long_decay is not None and not 0.0 <= self.plain_long_decay < 1.0:
            raise ValueError(f"plain_long_decay must be in [0, 1), got {self.plain_long_decay}")
        counts = (
            self.hold_steps,
            self.explore_steps,
            self.held_observe_every,
            self.full_forecast_every,
        )
        if min(counts) < 1:
            raise ValueError(
                "hold_steps, explore_steps, held_observe_every and full_forecast_every must "
                f"be >= 1: {counts}"
            )
        if self.hold_max_steps is not None and self.hold_max_steps < self.hold_steps:
            raise ValueError(
                f"hold_max_steps must be >= hold_steps: {self.hold_max_steps}, {self.hold_steps}"
            )
        if self.fixed_budget is not None and self.fixed_budget < 0:
            raise ValueError(f"fixed_budget must be >= 0, got {self.fixed_budget}")

    @property
    def max_budget(self) -> int:
        """The largest tree a drafted step may build (auto builds
        :meth:`BudgetController.tree_budget`, at most this; every candidate up to the built size
        is a prefix of it)."""
        return self.fixed_budget if self.fixed_budget is not None else self.budgets[-1]


@dataclass(frozen=True)
class Forecast:
    """Predictions for one drafted step, from :meth:`BudgetController.forecast`.

    Attributes:
        rows: ``[bs]`` int64 request slots.
        probs: ``[bs, B]`` ranked raw node probabilities (descending).
        depths: ``[bs, B]`` their depths.
        weights: ``[bs, B]`` depth-calibrated ranked node probabilities.
        slots: ``[bs, B]`` int64 the ranked nodes' slots in the tree (for :func:`top_nodes`).
        factors: each request's calibration factors (its own history's and its age's, and
            their product r_i * g_a(i): :meth:`AcceptCalibrator.factors`), for the update too.
        accept: ``[bs, C]`` calibrated expected accepted draft tokens A_i(N) per candidate.
        expected: ``[bs, C]`` what the choice reads: each request's decayed average of its
            forecasts' ``accept`` (``ControlConfig.choice_decay``; ``accept`` itself at 0).
    """

    rows: torch.Tensor
    probs: torch.Tensor
    depths: torch.Tensor
    weights: torch.Tensor
    slots: torch.Tensor
    factors: Factors
    accept: torch.Tensor
    expected: torch.Tensor

    @property
    def tree_budget(self) -> int:
        return self.probs.shape[1]


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
            covers, so predicted / calibrated accepted tokens compares like with like (for a
            grafted tree too, whose prediction covers its forecast steps alone).
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
        taken as independent; the uncentred residuals make it a little wide when the prediction
        is biased). With few calibrated steps (a server that mostly decodes plainly) a gap of
        10% can be noise: the 95% interval is +-1.96 of this."""
        return self.calibration_squared_error**0.5 / max(self.calibrated_request_steps, 1.0)


class BudgetController:
    """Chooses each step's budget; holds the calibration (device) and latency (host) state."""

    def __init__(
        self,
        config: ControlConfig,
        latency: LatencyModel | None,
        max_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if config.fixed_budget is None:
            if latency is None:
                raise ValueError("auto budget control needs a latency model")
            if latency.budgets != config.budgets:
                raise ValueError(f"latency budgets {latency.budgets} != {config.budgets}")
        self.config = config
        self.latency = latency
        self.calibrator = AcceptCalibrator(max_slots, config.max_depth, config.calibration, device)
        self._budgets_t = budget_index(config.budgets, device)  # [C]
        # per request slot and candidate: the decayed average of its forecasts' A_i(N), and
        # whether it has one (a forecast's tree may not reach every candidate)
        self._average_accept = torch.zeros(max_slots, len(config.budgets), device=device)
        self._averaged = torch.zeros_like(self._average_accept, dtype=torch.bool)
        # draft tokens summed over the calibrated request-steps (held steps sampled, weighted):
        # [predicted, accepted, squared weighted error]; and their count
        self._totals = torch.zeros(3, dtype=torch.float64, device=device)
        self._weights: dict[int, torch.Tensor] = {}  # weight -> [3] (_total_weights)
        self._calibrated_steps = 0.0
        # every drafted auto step's accepted draft tokens and request-steps (host). A step's
        # ``[bs]`` accept lengths (the caller's own tensor, kept by reference: no device op on
        # the step) wait in ``_pending`` for the next host read (a forecast's, or stats()),
        # which reads them behind its own values (:meth:`_read`)
        self._accepted_tokens = 0.0
        self._request_steps = 0
        self._pending: list[tuple[torch.Tensor, bool]] = []  # (accept lengths, a held step's)
        self.last_budget: int | None = None
        self.budget_counts: dict[int, int] = {}
        self._plain = False  # the last forecast preferred plain steps: draft only to probe
        self._probe_interval = config.probe_every  # steps from one probe to the next
        self._steps_since_draft = 0
        self._arrivals = 0  # requests arrived since the last forecast
        self._drafted_steps = 0  # drafted auto steps after the profile (held ones too)
        self._plain_explored = -1  # the drafted-step count at the last plain exploration step
        # per average (recent: plain_decay; long-run: plain_long_decay), decayed sums over
        # drafted steps of committed tokens per request and of step time / C(bs, 0)
        long = config.plain_long_decay
        self._gain_decays = (config.plain_decay,) + (() if long is None else (long,))
        self._drafted_gain = [[0.0, 0.0] for _ in self._gain_decays]
        # the held steps since the last forecast: (budget, batch size) each (their cost is
        # priced when they are folded in) and, once read, their accepted draft tokens per request
        self._held: list[tuple[int, int]] = []
        self._held_accepted: list[float] = []
        self._drafted_seen = 0  # drafted steps on the calibration's stride (_stride)
        self._measured_at: dict[int, dict[int, int]] = {}  # bucket -> budget -> step stamp
        self._contenders: dict[int, list[int]] = {}  # bucket -> its last forecast's contenders
        self._neighbours: dict[int, list[int]] = {}  # bucket -> its last best and beside it
        # bucket -> (the reach of its forecasts, forecasts since its last full one)
        self._reach: dict[int, tuple[int, int]] = {}
        self._profiled_whole = False  # a bucket's row has every candidate measured
        # (budget, batch size, steps left, its steps' REASONS: "held", or "explore")
        self._hold: tuple[int, int, int, str] | None = None
        self._resume: tuple[int, int, int, str] | None = None  # the hold an exploration paused
        self._last_hold: tuple[int, int] | None = None  # (budget, steps) of the last choice's
        self._after_plain = False  # this drafted step follows a plain one (record_step)
        self.reason = ""  # why the last step has its budget (one of REASONS)

    @property
    def auto(self) -> bool:
        return self.config.fixed_budget is None

    def _to_profile(self, bs: int) -> int | None:
        """The first candidate of the fewest measurements in its C(bs, N) cell while that is
        under ``profile_steps``, or None once the bucket is profiled (or is not one the
        profile fills: :meth:`LatencyModel.profiles`). Round robin (0, 4, 8, ..., 0, 4, ...):
        every step a switch, each cell's times spread over the profile, so one slow spell of
        the machine does not set whole cells (measured in a row, budgets 8-32 at batch size 4
        read 1.6x budget 4's step where they cost 1.2x, and were never explored again).

        Every candidate until one bucket's profile has measured them all; after that, a
        bucket's contenders (``ControlConfig.explore_margin``) at its first forecast, which
        reads its unmeasured cells from the measured buckets (:meth:`LatencyModel.row`): a
        budget that loses by more than the margin there is not worth its profile steps
        (SmolLM2 at batch size 16: budgets 1-8 cost up to 2x a plain step and were never
        chosen, yet took 12 of a 2-wave round's 38 steps). None before that forecast. The
        contenders are the bucket's latest forecast's: one that joins them later with fewer
        than ``profile_steps`` times is measured the same way before the next forecast, and so
        are the candidates next to its best (``ControlConfig.profile_neighbours``)."""
        latency = self.latency
        if not latency.profiles(bs):
            return None
        steps = self.config.profile_steps
        if not self._profiled_whole:
            self._profiled_whole = any(min(row) >= steps for row in latency.count)
        bucket = bucket_of(latency.bs_buckets, bs)
        every = self.config.budgets
        budgets = self._contenders.get(bucket) if self._profiled_whole else every
        if budgets is None:
            return None
        if bucket in self._neighbours:  # (profile_neighbours)
            budgets = {*budgets, *self._neighbours[bucket]}
        counts = latency.count[bucket]
        fewest, budget = min((counts[every.index(b)], b) for b in budgets)
        return budget if fewest < steps else None

    def _stalest(self, bs: int, drafted: bool) -> int:
        """The contender of ``bs``'s bucket (``ControlConfig.explore_margin``) measured
        longest ago; ``drafted``: among the contenders > 0 (every budget > 0 when none is)."""
        bucket = bucket_of(self.latency.bs_buckets, bs)
        stamps = self._measured_at.setdefault(bucket, {})
        budgets = self._contenders.get(bucket, self.config.budgets)
        if drafted:
            budgets = [b for b in budgets if b > 0] or [b for b in self.config.budgets if b > 0]
        return min(budgets, key=lambda b: stamps.get(b, -1))

    def _explores_plain(self, bs: int) -> bool:
        """The next drafted step is an exploration step, budget 0's cell is the stalest
        contender and no plain step has explored it yet: take one plain step first (C(bs, 0)
        is measured by plain steps only, and auto sitting at a budget > 0 takes none). Once:
        a plain step does not advance the drafted steps, so the exploration stays next, and
        budget 0 can stay the stalest (its new time not recorded, or stamped at the same
        drafted step as another contender's); without the mark every later step was plain
        (whole waves of plain steps at concurrency 1 and 4 through SGLang)."""
        return (
            self._explores_next()
            and self._plain_explored != self._drafted_steps
            and self._stalest(bs, drafted=False) == 0
        )

    def _explores_next(self) -> bool:
        """The next drafted step after the profile is an exploration step."""
        every = self.config.explore_every
        return bool(every) and (self._drafted_steps + 1) % every == 0

    def tree_budget(self, bs: int) -> int:
        """Host only: the tree a drafted step that forecasts builds (and the depths it drafts),
        the forecast's reach. Fixed: the budget. Auto: the largest candidate on a full forecast
        (``ControlConfig.full_forecast_every``) and for a renewed batch (as many arrivals as it
        holds), so it predicts every candidate, else the reach of the bucket's last full
        forecast (:meth:`_note_reach`). At batch size 1 a reach carried over to the next
        request held one request's hard text against it (B 4 on 17% of a run's steps at
        0.90x B 16's tokens/s, small pair through SGLang).
        Reaching one candidate above the last choice instead (as auto once did) saved the
        larger trees while the choice stayed below them, but trapped it where the rate is not
        concave in N (batch size 2 on this CPU: B 4 -> 8 costs 1.4 ms, 8 -> 16 0.9 ms; auto
        held B 4 where B 16 was best); the contenders' margin and the periodic full forecast
        keep a budget that can win within reach."""
        if not self.auto:
            return self.config.fixed_budget
        largest = self.config.budgets[-1]
        reach = self._reach.get(bucket_of(self.latency.bs_buckets, bs))
        renewed = self._arrivals >= bs  # the reach was the requests' that left
        if reach is None or renewed or reach[1] + 1 >= self.config.full_forecast_every:
            return largest
        return reach[0]

    def held_budget(self, bs: int) -> int | None:
        """Host only, for a step that drafts: its budget when no forecast is needed, counted
        as the step's choice; None: forecast and :meth:`choose`. Fixed: the fixed budget.
        Auto: the profiled budget while the bucket is profiled, the stalest budget > 0 on an
        exploration step (``ControlConfig.explore_every``; so both measure the step a budget
        costs without a forecast), else the last forecast's choice while it holds
        (``ControlConfig.hold_steps``)."""
        if not self.auto:
            self.reason = "fixed"
            return self._count(self.config.fixed_budget)
        after_plain, self._steps_since_draft = self._steps_since_draft > 0, 0
        self._after_plain = after_plain  # its time is not its budget's alone (record_step)
        profiled = self._to_profile(bs)
        if profiled is not None:  # > 0: should_draft takes budget 0's profile steps plain
            self.reason = "profile"
            return self._count(profiled)
        if not self._plain and self._explores_next():
            self._drafted_steps += 1
            budget = self._stalest(bs, drafted=True)
            # after a plain step, one step more: the first one's time is not the budget's
            steps = self.config.explore_steps + after_plain
            self._resume = self._hold  # the hold it interrupts goes on after it
            self._hold = (budget, bs, steps - 1, "explore") if steps > 1 else None
            self.reason = "explore"
            return self._count(budget)
        hold = self._hold
        if hold is None and self._resume is not None:  # an exploration ended
            hold, self._resume = self._resume, None
        if hold is None or bs > hold[1] or self._arrivals >= bs:
            self._hold = None
            self.reason = self._forecast_reason(hold, bs)
            return None
        budget, chosen_for, left, self.reason = hold
        self._hold = (budget, chosen_for, left - 1, self.reason) if left > 1 else None
        self._drafted_steps += 1
        return self._count(budget)

    def _forecast_reason(self, hold: tuple[int, int, int, str] | None, bs: int) -> str:
        """Host: why a drafted step forecasts (one of ``REASONS``), in the order that
        :meth:`should_draft` and :meth:`held_budget` test."""
        if self._arrivals >= bs:
            return "arrivals"
        if self._plain:
            return "probe"
        return "grew" if hold is not None else "expired"

    def should_draft(self, bs: int) -> bool:
        """Host only. False while auto keeps choosing 0 (except for its probes, see
        ``ControlConfig.probe_every``) or profiles budget 0: a plain decode step then skips
        the drafter entirely."""
        if not self.auto:
            self.reason = "fixed"
            return self.config.fixed_budget > 0
        profiled = self._to_profile(bs)
        if profiled is not None:
            self.reason = "profile"
            return profiled != 0
        if self._plain:
            self.reason = "plain"  # a drafting probe's reason: held_budget's
            return self._arrivals >= bs or self._steps_since_draft + 1 >= self._probe_interval
        if self._explores_plain(bs):
            self.reason = "explore"
            return False
        return True  # held_budget names the drafted step's reason

    def forecast(
        self,
        rows: torch.Tensor,
        logprobs: torch.Tensor,
        depths: torch.Tensor,
        valid: torch.Tensor,
    ) -> Forecast:
        """Sync-free predictions from the step's tree (``DraftTree`` fields, ``[bs, B]``).

        Build the tree at :meth:`tree_budget`; every candidate up to it is its top-N prefix.
        """
        ranked = rank_nodes(logprobs, depths, valid)
        weights = self.calibrator.node_weights(ranked.probs, ranked.depths)  # [bs, B]
        factors = self.calibrator.factors(rows)
        accept = prefix_sums_at(weights, self._budgets_t).mul_(factors.scale.unsqueeze(1))
        accept = accept.clamp_(0.0, float(self.config.max_depth))  # [bs, C]
        reached = bisect_right(self.config.budgets, logprobs.shape[1])  # candidates <= B
        expected = self._average(rows, accept, reached)
        return Forecast(
            rows,
            ranked.probs,
            ranked.depths,
            weights,
            ranked.slots,
            factors,
            accept,
            expected,
        )

    def _average(self, rows: torch.Tensor, accept: torch.Tensor, reached: int) -> torch.Tensor:
        """Sync-free: ``[bs, C]`` each request's decayed average of its forecasts' A_i(N), this
        one's included (a request's first forecast starts it), for the first ``reached``
        candidates (those the tree reaches); a candidate above them keeps its average (or
        reads this forecast's clamped value, not kept, while it has none)."""
        decay = self.config.choice_decay
        if not decay:
            return accept
        seen = self._averaged[rows]  # [bs, C]
        average = torch.where(seen, self._average_accept[rows], accept)
        average[:, :reached].mul_(decay).add_(accept[:, :reached], alpha=1.0 - decay)
        self._average_accept[rows] = average
        self._averaged[rows, :reached] = True
        return average

    def _count(self, budget: int) -> int:
        self.last_budget = budget
        self.budget_counts[budget] = self.budget_counts.get(budget, 0) + 1
        return budget

    def choose(self, forecast: Forecast | None, bs: int) -> int:
        """The step's budget as a host int.

        Auto with a forecast: ONE host read of the ``[C]`` batch totals sum_i (1 + A_i(N)),
        then the argmax of totals / C(bs, N) on the host. Candidates above the tree's size are
        skipped. When that argmax is 0 (plain steps pay more than drafting returns), this
        step, whose draft is paid for, verifies at the best budget > 0, and the following steps
        skip the drafter until the next probe: after ``ControlConfig.hard_plain_steps`` when
        drafting pays on average (``ControlConfig.plain_decay``), else at growing intervals
        while drafting still does not pay on average. ``forecast=None`` (a step that did not
        draft): 0. Fixed mode: the fixed budget, no read.
        """
        if not self.auto:
            return self._count(self.config.fixed_budget)
        if forecast is None:
            self._steps_since_draft += 1
            if not self._plain and self._to_profile(bs) is None and self._explores_plain(bs):
                self._plain_explored = self._drafted_steps  # the exploration drafts next
            return self._count(0)
        self._steps_since_draft = self._arrivals = 0
        self._drafted_steps += 1
        self._resume = None
        totals = self._read((1.0 + forecast.expected).sum(0))  # [C] THE read
        self._fold_held()
        seconds = self.latency.row(bs)
        choice = partial(
            best_budget,
            totals,
            seconds,
            self.config.budgets,
            max_budget=forecast.tree_budget,
            tie_rtol=self.config.tie_rtol,
        )
        best = choice()
        verified = best if best != 0 else choice(min_budget=1)  # the draft is paid for
        self._note_contenders(bs, totals, seconds, forecast.tree_budget, best)
        self._note_reach(bs, forecast.tree_budget)
        if self.config.budgets[0] == 0:
            column = self.config.budgets.index(verified)
            self._add_drafted_gain(totals[column] / bs, seconds[column] / seconds[0])
        pays = self._drafting_pays()
        hard = self.config.hard_plain_steps
        if best == 0 and pays and hard:  # a hard stretch amid paying drafts: plain, briefly
            self._plain, self._probe_interval = True, hard + 1
        elif self._plain and pays:  # a probe: drafting pays again on average, the run ends
            self._plain, self._probe_interval = False, self.config.probe_every
        elif self._plain:  # a probe after which drafting still does not pay: probe less often
            self._probe_interval = min(2 * self._probe_interval, self.config.probe_max_every)
        elif best == 0 and not pays:  # plain steps pay more, now and on average: a plain run
            self._plain = True
        if self._plain:
            self._last_hold = None  # after a plain run, the next choice holds hold_steps
        elif self.config.hold_steps > 1:  # best, or the cheapest > 0
            self._hold = (verified, bs, self._hold_length(verified) - 1, "held")
        return self._count(verified)

    def _hold_length(self, budget: int) -> int:
        """Host: the drafted steps a forecast's choice of ``budget`` holds for: ``hold_steps``,
        twice the last choice's when that chose ``budget`` too, at most ``hold_max_steps``."""
        steps, cap = self.config.hold_steps, self.config.hold_max_steps
        if cap is not None and self._last_hold is not None and self._last_hold[0] == budget:
            steps = min(2 * self._last_hold[1], cap)
        self._last_hold = (budget, steps)
        return steps

    def _note_contenders(
        self, bs: int, totals: list[float], seconds: list[float], tree_budget: int, best: int
    ) -> None:
        """Host: the budgets whose predicted rate is within ``ControlConfig.explore_margin``
        of the best, for ``bs``'s bucket's explorations (those above the tree's size, not
        predicted, with margin 1 alone), those whose cell reads dearer than a larger
        budget's (``ControlConfig.explore_inverted``) and the drafted budget below ``best``,
        the forecast's choice (``ControlConfig.explore_below_best``), the stale cells next to
        it (``ControlConfig.explore_stale_neighbours``); and, for the profile
        alone, the candidates next to ``best`` (``ControlConfig.profile_neighbours``)."""
        margin, budgets = self.config.explore_margin, self.config.budgets
        bucket = bucket_of(self.latency.bs_buckets, bs)
        at = budgets.index(best)
        if self.config.profile_neighbours:
            self._neighbours[bucket] = self._beside(at)
        rates = [t / c for t, c in zip(totals, seconds, strict=True)]
        top = max(r for b, r in zip(budgets, rates, strict=True) if b <= tree_budget)
        inverted = self.config.explore_inverted
        suspect = set() if inverted is None else set(self.latency.inverted(bs, inverted))
        if self.config.explore_below_best and at > 0 and budgets[at - 1] > 0:
            suspect.add(budgets[at - 1])
        if self.config.explore_stale_neighbours:
            suspect.update(self._stale_neighbours(bucket, at))
        self._contenders[bucket] = [
            b
            for b, r in zip(budgets, rates, strict=True)
            if (r >= (1.0 - margin) * top if b <= tree_budget else margin >= 1.0) or b in suspect
        ]

    def _forget_after(self) -> int:
        """Host: drafted steps after which a cell is stale (``ControlConfig.forget_after``;
        0: never)."""
        after = self.config.forget_after
        return self.config.explore_every if after is None else after

    def _beside(self, at: int) -> list[int]:
        """Host: ``budgets[at]`` and the candidates next to it (below, 0 included, and above)."""
        budgets = self.config.budgets
        return list(budgets[max(at - 1, 0) : at + 2])

    def _stale_neighbours(self, bucket: int, at: int) -> list[int]:
        """Host: the drafted budgets next to ``budgets[at]`` whose cell in ``bucket`` was last
        measured ``_forget_after()`` or more drafted steps ago, or never
        (``ControlConfig.explore_stale_neighbours``)."""
        after, budgets = self._forget_after(), self.config.budgets
        if not after:
            return []
        stamps = self._measured_at.get(bucket, {})
        return [
            b
            for b in self._beside(at)
            if b > 0 and b != budgets[at] and self._drafted_steps - stamps.get(b, -after) >= after
        ]

    def _note_reach(self, bs: int, tree_budget: int) -> None:
        """Host, after :meth:`_note_contenders`: a full forecast (its tree larger than the
        bucket's reach, or the largest candidate's) sets the bucket's reach, the candidate
        above its largest contender, and restarts the count of forecasts to the next full one;
        a forecast at the reach counts one more. One candidate of slack: the contenders are
        one forecast's, and at batch size 1 one request's (reaching the largest contender
        alone, one variant held B 8 at 0.95x B 16's tokens/s for most of a run: a forecast
        that put B 16 behind B 8 by the margin kept it out of reach until the next full one,
        and B 8 chosen again held twice as long each time). Nothing to note when every
        forecast is full."""
        if self.config.full_forecast_every == 1:
            return
        bucket = bucket_of(self.latency.bs_buckets, bs)
        reach = self._reach.get(bucket)
        if reach is not None and tree_budget <= reach[0] < self.config.budgets[-1]:
            self._reach[bucket] = (reach[0], reach[1] + 1)
            return
        budgets = self.config.budgets
        largest = max(self._contenders[bucket])  # one candidate above it
        self._reach[bucket] = (budgets[min(budgets.index(largest) + 1, len(budgets) - 1)], 0)

    def observe_committed(self, budget: int, accept_len: torch.Tensor) -> None:
        """Host only, after a drafted step that did not forecast (held, explored or profiled;
        auto): its accepted draft tokens join the metrics' totals and, with plain steps among
        the candidates, its committed tokens per request and its cost in plain forwards join
        the drafting-pays average, all at the next forecast's host read (no device op, no
        latency model read per step).
        Forecast steps alone would be a biased sample: they are the hard ones (a request's first
        steps, the probe after a plain step), and on them alone drafting looked not to pay
        where the held steps it governs did (plain runs at concurrency 2 on this CPU)."""
        if not self.auto or budget == 0:
            return
        held = self.config.budgets[0] == 0
        self._count_accepted(accept_len, held)
        if held:
            self._held.append((budget, accept_len.numel()))

    def _fold_held(self) -> None:
        """Host, after a read: the held steps since the last forecast join the drafted steps'
        decayed sums, in order."""
        if not self._held:
            return
        budgets, rows = self.config.budgets, {}
        costs = []  # each held step's C(bs, N) / C(bs, 0), at the model's times now
        for budget, bs in self._held:
            seconds = rows.get(bs) or rows.setdefault(bs, self.latency.row(bs))
            costs.append(seconds[budgets.index(budget)] / seconds[0])
        for decay, gain in zip(self._gain_decays, self._drafted_gain, strict=True):
            weight = 1.0
            tokens = cost = accepted = 0.0  # decayed sums, the latest step weighted 1
            for step_cost, step_accepted in zip(
                reversed(costs), reversed(self._held_accepted), strict=True
            ):
                tokens, cost = tokens + weight, cost + weight * step_cost  # (+1: the bonus)
                accepted += weight * step_accepted
                weight *= decay
            gain[0], gain[1] = weight * gain[0] + accepted + tokens, weight * gain[1] + cost
        self._held, self._held_accepted = [], []

    def _add_drafted_gain(self, tokens_per_request: float, plain_steps: float) -> None:
        for decay, gain in zip(self._gain_decays, self._drafted_gain, strict=True):
            gain[0] = decay * gain[0] + tokens_per_request
            gain[1] = decay * gain[1] + plain_steps

    def _drafting_pays(self) -> bool:
        """Host: in the recent or the long-run average (``ControlConfig.plain_long_decay``),
        the drafted steps' decayed committed tokens per request exceed their decayed step time
        in plain forwards (a plain forward commits one token per request)."""
        return any(tokens > plain_steps for tokens, plain_steps in self._drafted_gain)

    def observe(
        self, forecast: Forecast, budget: int, accept_len: torch.Tensor, sampled: bool = True
    ) -> torch.Tensor | None:
        """Sync-free update after acceptance of a step that forecast and verified ``budget``
        (its top-N nodes). ``accept_len``: ``[bs]`` accepted draft tokens, bonus excluded. A
        budget-0 step carries no information and is skipped. ``sampled``: the verified tree is
        the forecast's DDTree, whose held steps are calibrated too (:meth:`observe_held`): the
        step takes its turn on their stride of ``ControlConfig.held_observe_every`` drafted
        steps, standing for that many; else (a grafted tree) every forecast step is calibrated,
        standing for itself. Returns the step's ``[2]`` predicted and accepted draft tokens
        summed over its requests when calibrated (else None): the per-step record of the
        calibration (:class:`~sglang_tree_spec.step_times.StepLog`)."""
        n = min(budget, forecast.tree_budget)
        if n <= 0:
            return None
        self._count_accepted(accept_len, held=False)
        weight = self._stride() if sampled else 1
        if not weight:
            return None
        cal = self.calibrator
        mass = cal.depth_mass(forecast.probs[:, :n], forecast.depths[:, :n])  # [bs, L+1]
        depth_cal = forecast.weights[:, :n].sum(1)  # [bs]
        return self._learn(forecast.rows, mass, depth_cal, forecast.factors, accept_len, weight)

    def _stride(self) -> int:
        """Host: one more drafted step on the calibration's stride; the steps it stands for
        when it is the stride's turn (``ControlConfig.held_observe_every``), else 0."""
        every = self.config.held_observe_every
        self._drafted_seen += 1
        return 0 if self._drafted_seen % every else every

    def observe_held(
        self,
        rows: torch.Tensor,
        logprobs: torch.Tensor,
        depths: torch.Tensor,
        valid: torch.Tensor,
        accept_len: torch.Tensor,
    ) -> torch.Tensor | None:
        """Sync-free update after a drafted step that did not forecast (held, explored or
        profiled; auto only) verified the DDTree whose ``DraftTree`` fields are given
        (``[bs, N]``). Forecast steps are the hard ones (a request's first steps, the step
        after a plain run): calibrated on them alone, the predictions would be right there and
        low for the held steps each forecast governs, and a uniformly low A compresses the
        ratios (1 + A(N)) / (1 + A(N')) toward the smaller budget. Every
        ``ControlConfig.held_observe_every``-th drafted step, forecast (:meth:`observe`) or
        not, is calibrated instead (and its prediction summed for the metrics;
        :meth:`observe_committed` counts every step's accepted tokens). Sums over nodes need no
        ranking: the raw mass per depth is one scatter of the valid nodes' probabilities, its
        calibrated sum one product with the depth factors (~30 small ops, ~0.1 ms on this CPU
        alone, 0.3 ms in a server). Returns what :meth:`observe` returns for a calibrated step,
        None for the others."""
        if not self.auto or logprobs.shape[1] == 0:
            return None
        weight = self._stride()
        if not weight:
            return None
        cal = self.calibrator
        probs = torch.where(valid, logprobs.float().exp(), 0.0)  # [bs, N]
        mass = cal.depth_mass(probs, depths)  # [bs, L+1]
        depth_cal = mass @ cal.depth_table()  # [bs]
        return self._learn(rows, mass, depth_cal, cal.factors(rows), accept_len, weight)

    def _learn(
        self, rows, mass, depth_cal, factors: Factors, accept_len, weight: int
    ) -> torch.Tensor:
        """Fold one verified step into the calibration and the predicted/observed totals:
        ``[bs, L+1]`` raw predicted mass per depth, ``[bs]`` its depth-calibrated sum, the
        calibration's ``factors`` (read once: the prediction's and the update's), and accepted
        draft tokens. ``weight``: the steps it stands for (a drafted step observed for its
        stride of ``held_observe_every``): the mix of forecast (hard) and held steps in the
        calibration stays that of the steps served.
        Returns the step's ``[2]`` predicted and accepted draft tokens, unweighted (what
        :meth:`observe` returns)."""
        predicted = (depth_cal * factors.scale).clamp_(0.0, float(self.config.max_depth))
        accepted = accept_len.to(predicted.dtype)
        error = (predicted - accepted).square_()
        step = torch.stack([predicted, accepted, error], dim=1).sum(0)  # [3] unweighted
        self._totals.addcmul_(step, self._total_weights(weight))
        self._calibrated_steps += weight * accept_len.numel()
        self.calibrator.update(rows, mass, depth_cal, accepted, weight, factors)
        return step[:2]

    def _total_weights(self, weight: int) -> torch.Tensor:
        """``[3]`` what a step standing for ``weight`` steps adds to ``_totals`` per unit:
        weight, weight and weight^2 (a squared error of ``weight`` equal ones)."""
        weights = self._weights.get(weight)
        if weights is None:
            weights = torch.tensor([weight, weight, weight * weight], dtype=torch.float64)
            weights = self._weights[weight] = weights.to(self._totals.device)
        return weights

    def _count_accepted(self, accept_len: torch.Tensor, held: bool) -> None:
        """Host only: a drafted step's ``[bs]`` accept lengths (sampled for calibration or not:
        the metrics' exact totals; ``held``: its per-request mean joins the held steps'), read
        with the next host read; a long run without one (the start-up profile) is read at
        ``PENDING_STEPS`` steps, one sync in that many."""
        self._request_steps += accept_len.numel()
        self._pending.append((accept_len, held))
        if len(self._pending) >= PENDING_STEPS:
            self._read(self._totals[:0])

    def _read(self, values: torch.Tensor) -> list[float]:
        """THE host read of a step or of :meth:`stats`: ``values`` (``[n]``) with the pending
        accept lengths behind them in one transfer. Those join the host totals (a held step's
        per-request mean, the held steps'); returns ``values`` as floats."""
        n, pending = values.numel(), self._pending
        read = (
            torch.cat([values, *(a for a, _ in pending)]).tolist() if pending else values.tolist()
        )
        at = n
        for accept_len, held in pending:
            bs = accept_len.numel()
            accepted = sum(read[at : at + bs])
            at += bs
            self._accepted_tokens += accepted
            if held:
                self._held_accepted.append(accepted / bs)
        self._pending = []
        return read[:n]

    def record_step(
        self,
        bs: int,
        budget: int,
        seconds: float,
        drafted: bool = True,
        forecast: bool = False,
        forwards: int = 1,
    ) -> None:
        """Host: a measured step time of ``forwards`` target forwards (budget 0's cell is per
        forward: a plain step may run several). A drafted step verified at budget 0 is not a plain
        decode step (it paid the drafter) and is not recorded; nor, while choices hold
        (``hold_steps > 1``), is a step that forecast: its extra cost (the ranking and a tree
        one candidate larger) does not depend on the budget it chooses, and recorded it would
        raise the cell of whichever budget is being held above the cells measured by held and
        exploration steps, pushing the choice off the budget that pays. Nor is the first
        drafted step after a plain one: its drafter catches up on the plain forwards' context
        (at batch size 16 on CPU through SGLang, +10-30% on the step), a cost of the plain run,
        not of its budget; the start-up profile's round robin put budget 4 after every plain
        step, so its cell read that cost as its own (34.4 ms where its held steps take 25.7, at
        0.97x budget 8's cell for a true 0.85x), and auto, never choosing nor exploring it at
        batch size 16 again, held budget 8 at 0.90x budget 4's tokens/s. Budget 0's cell
        leaves that catch-up out: plain runs look a little cheaper than they are."""
        if self.latency is None or (budget == 0 and drafted):
            return
        if forecast and self.config.hold_steps > 1:
            return
        if drafted and self._after_plain:  # (set by held_budget: a time dropped between
            return  # a plain step and this one does not hide that it came after one)
        bucket = bucket_of(self.latency.bs_buckets, bs)
        stamps = self._measured_at.setdefault(bucket, {})
        after = self._forget_after()
        if after and budget in stamps and self._drafted_steps - stamps[budget] >= after:
            self.latency.forget(bs, budget)  # stale
        if self.latency.record(bs, budget, seconds / forwards):
            stamps[budget] = self._drafted_steps

    def latency_line(self, bs: int) -> str:
        """Host: the latency model's C(bs, N) per candidate in ms and the steps measured in its
        cell, ``"0:6.1/12 4:7.0/80 ..."`` (a measured cell's cost, else the calibrated prior),
        for the log."""
        row = self.latency.row(bs)
        counts = self.latency.count[bucket_of(self.latency.bs_buckets, bs)]
        cells = zip(self.config.budgets, row, counts, strict=True)
        return " ".join(f"{b}:{1e3 * s:.1f}/{n}" for b, s, n in cells)

    def reset(self, rows: torch.Tensor) -> None:
        """Sync-free: slots ``rows`` (``[n]`` int64) start a new request's history."""
        self.calibrator.reset(rows)
        self._averaged[rows] = False
        self._arrivals += rows.numel()

    def stats(self) -> ControlStats:
        """Reads the device accumulators (a sync): for periodic logs and metrics."""
        predicted, calibrated, squared_error = self._read(self._totals)
        return ControlStats(
            last_budget=self.last_budget,
            predicted_accept_tokens=predicted,
            accepted_tokens=self._accepted_tokens,
            request_steps=self._request_steps,
            budget_counts=dict(sorted(self.budget_counts.items())),
            depth_scale=self.calibrator.depth_scale().tolist(),
            latency_mean_abs_rel_error=(
                self.latency.mean_abs_rel_error() if self.latency is not None else 0.0
            ),
            latency_steps=self.latency.recorded_steps if self.latency is not None else 0,
            latency_predicted_seconds=(
                self.latency.predicted_seconds if self.latency is not None else 0.0
            ),
            latency_measured_seconds=(
                self.latency.measured_seconds if self.latency is not None else 0.0
            ),
            calibrated_accepted_tokens=calibrated,
            calibrated_request_steps=self._calibrated_steps,
            calibration_squared_error=squared_error,
        )
