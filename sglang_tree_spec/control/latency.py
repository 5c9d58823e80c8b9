"""Step latency C(bs, N): a roofline prior, calibrated and refined online by measured steps.

C(bs, N) is the wall time of one whole decode step of a batch of ``bs`` requests at budget N:
for N > 0 the drafter forward, the tree and a target forward over bs * (N + 1) tokens; for
N = 0 one plain target forward (no drafter, bs tokens): a plain step runs several
(``control.PLAIN_FORWARDS``), one token a request each, and is recorded per forward.

Prior (BASTION appendix F, simplified to the dominant terms), per forward of ``tokens`` tokens of
``bs`` requests at context ``c``:

    bytes = params * dtype + bs * (c + tokens / bs) * 2 * layers * kv_heads * hd * dtype
    flops = 2 * matmul_params * tokens + 4 * layers * q_heads * hd * tokens * (c + tokens / bs)
    t     = max(bytes / (bandwidth * bw_eff) + verify, flops / (peak * flops_eff))

plus a fixed per-step overhead (scheduler, launches, sampling) and, for N > 0, a per-step draft
overhead (tree build, layout) and the drafter's own roofline over bs * block tokens.

``verify`` (the target's verify only, zero for a plain step and on the CPU) is what a measured
verify costs over its first token a request that the weight reads do not hide, in units of one
request's one-token step ``t1`` (overhead + forward), for ``w = N + 1`` tokens a request:

    verify = t1 * max(verify_width * sqrt(w - 1), verify_token * bs * (w - 1))

One request pays for its width (as the square root of its extra tokens: kernels' latency, not
FLOPs); a batch pays per extra token, from the first one (compute that does not overlap the
weight reads). Without it the roofline is flat up to the compute ridge (150-230 tokens a
forward on an H100 / H200), and wide trees look free at small batches.

Online (host floats, no device work): every measured step feeds (a) a per-device linear
calibration measured ~= a * prior + b (decayed least squares over all cells, BASTION's
"static linear calibration" learned online) and (b) the cells' log costs. Step times on a
shared machine swing with its speed: bursts (the OS, a neighbour, the server's own other work:
periods twice the usual, several in a row) and slower drifts (on this 2-core VM a fixed budget's
16-step median ranges over +-16% within a run), while a cell is only measured when its budget
runs. So a cell's times compared with each other measure the machine, not the cell; the one
measure of one cell's cost against another's is a switch between them: two consecutive steps,
one speed of the machine. A cell's cost is set by its first ``first_steps`` times, each over
the speed of the last step of a settled cell before it (its time over its cost: a switch's
measure, so a burst that both steps share cancels; over the load's median, which lags a burst
by several steps, a cell first measured or re-measured in one read the burst as its cost), or
over the load before any cell is settled (the start-up profile's first round), their lower
median (a warm-up step alone does not set it); after that only
switches move costs, each moving the two cells' log-cost difference toward the one it measured
(a cell's first switches averaged, later ones ``pair_rate`` of the way; the error clipped to
``pair_clip``: a burst across a switch is not a cost).
The machine's load is the median ratio of the last ``load_window`` steps' times to their
cells' costs, and a row is read back times it. Earlier, every time was stored over the load and
each cell read the median of its own: a burst while one budget held raised its cell before the
load caught up, the choice left it, and the budget chosen next was measured as the burst ended,
its times divided by a load still high: cells read as cheap as the moments they were chosen at
(small-pair server at batch size 1: budget 4 at 0.85x budget 16's cost where its steps took
0.95x, and auto chose it on 7% of steps). A batch-size bucket's row is then made
non-decreasing in N (a weighted isotonic fit, measured cells weighing by their step counts;
unmeasured cells clamped between their measured neighbours): a bigger tree never costs less.

Batch sizes map to buckets as the device runs them: the smallest bucket >= bs where CUDA graphs
pad a batch to their captured sizes (:data:`DEFAULT_BS_BUCKETS`), every batch size where nothing
pads (:func:`bs_buckets_for` a CPU: a step of 11 requests costs less than one of 16, and a
bucket of both reads whichever batch size its budget happened to run at). An unmeasured cell
reads the measured cells of its column in the nearest buckets, as ratios to the calibrated
prior (linear in bs between one below and one above, else the one side's), else the calibrated
prior itself, scaled by how its row's measured cells compare with the same reading of theirs
(a row keeps its columns' ratios); so with every
batch size a bucket, the start-up profile fills the :data:`DEFAULT_BS_BUCKETS` rows alone
(``profile_buckets``) and the sizes between them read their measured neighbours until measured.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from dataclasses import dataclass

DEFAULT_BS_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
EXACT_BS_BUCKETS: tuple[int, ...] = tuple(range(1, DEFAULT_BS_BUCKETS[-1] + 1))


def bs_buckets_for(device_type: str) -> tuple[int, ...]:
    """The batch sizes a device's decode steps run at: CUDA graphs pad a batch to the
    next captured size (:data:`DEFAULT_BS_BUCKETS`); a CPU runs every size as it is."""
    return EXACT_BS_BUCKETS if device_type == "cpu" else DEFAULT_BS_BUCKETS


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape for the roofline.

    Attributes:
        params: total parameters (bytes read per forward = params * dtype_bytes).
        tied_embeddings: the LM head is the embedding matrix (counted once in params and used
            as a matmul); untied: the input embedding is a gather, not a matmul.
    """

    name: str
    params: float
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool
    dtype_bytes: int = 2

    @property
    def matmul_params(self) -> float:
        return self.params if self.tied_embeddings else self.params - self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """A device's roofline figures (dense peak, not sparse) and per-step overheads."""

    name: str
    mem_bandwidth: float  # bytes / s
    peak_flops: float  # FLOP / s at the model dtype
    bw_efficiency: float
    flops_efficiency: float
    step_overhead_s: float  # every step: scheduler, kernel launches, sampling, host sync
    draft_overhead_s: float  # every drafted step: tree build, verify layout, acceptance
    verify_width: float = 0.0  # one request's verify: x t1 per sqrt(extra tokens a request)
    verify_token: float = 0.0  # a batch's verify: x t1 per extra token of the batch


# Fitted to a public per-token cost table (eagle-harness 0.1.3's shipped profile
# mi355x-qwen3.8-27b-tp1, target verify at context 512-1023 (bs 1) and < 2048 (bs 8)):
# 11.99 / 14.33 / 15.50 / 17.02 ms at bs 1 and 12.67 / 15.92 / 20.50 / 28.65 ms at bs 8 for
# 1 / 8 / 16 / 32 tokens a request; least squares of the bs 1 rows' extra over 11.99 ms on
# sqrt(w - 1), of the bs 8 rows' on 8 * (w - 1). Taken as ratios to a one-token step, so the
# same on H100 / H200 (their FLOP/byte ridges, 295 / 206, are near the MI355X's ~310). That
# target is a hybrid (3 of 4 layers linear attention): a dense one may pay less for width.
GPU_VERIFY_WIDTH = 0.075  # bs 1 at 8 / 16 / 32 tokens: x 1.20 / 1.29 / 1.42, as measured
GPU_VERIFY_TOKEN = 0.0054  # bs 8: x 1.28 / 1.61 / 2.26 (measured 1.26 / 1.62 / 2.26)


DEVICES: dict[str, DeviceSpec] = {
    # H100 SXM5 80 GB: HBM3 3.35 TB/s, bf16 dense 989 TFLOP/s.
    "h100": DeviceSpec(
        "H100 SXM", 3.35e12, 989e12, 0.80, 0.60, 2.0e-3, 0.5e-3, GPU_VERIFY_WIDTH, GPU_VERIFY_TOKEN
    ),
    # H200 SXM 141 GB: HBM3e 4.8 TB/s, same compute as H100.
    "h200": DeviceSpec(
        "H200 SXM", 4.8e12, 989e12, 0.80, 0.60, 2.0e-3, 0.5e-3, GPU_VERIFY_WIDTH, GPU_VERIFY_TOKEN
    ),
    # 2 x86 cores with AVX2 FMA, float32: 2 cores * 32 FLOP/cycle * ~3 GHz, ~20 GB/s DRAM.
    "cpu": DeviceSpec("CPU 2 cores AVX2 fp32", 20e9, 192e9, 0.5, 0.3, 5.0e-3, 2.0e-3),
}

MODEL_SHAPES: dict[str, ModelShape] = {
    "qwen3-8b": ModelShape("Qwen3-8B", 8.19e9, 36, 4096, 32, 8, 128, 12288, 151936, False),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 8.03e9, 32, 4096, 32, 8, 128, 14336, 128256, False),
    "smollm2-135m": ModelShape("SmolLM2-135M", 134.5e6, 30, 576, 9, 3, 64, 1536, 49152, True),
}


def shape_of(name: str, config: dict, params: float, dtype_bytes: int) -> ModelShape:
    """The :class:`ModelShape` of a decoder from its config's fields (a transformers
    ``config.to_dict()``: ``hidden_size``, ``num_hidden_layers``, ...) and parameter count."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return ModelShape(
        name,
        float(params),
        int(config["num_hidden_layers"]),
        hidden,
        heads,
        int(config.get("num_key_value_heads") or heads),
        int(config.get("head_dim") or hidden // heads),
        int(config["intermediate_size"]),
        int(config["vocab_size"]),
        bool(config.get("tie_word_embeddings", False)),
        dtype_bytes,
    )


def device_spec(device: str) -> DeviceSpec:
    """The roofline figures of a device: ``"cpu"``, or a CUDA device's name (H200 when it
    says so, else H100's figures)."""
    if device == "cpu":
        return DEVICES["cpu"]
    return DEVICES["h200"] if "H200" in device.upper() else DEVICES["h100"]


def layer_params(hidden: int, q_heads: int, kv_heads: int, head_dim: int, ffn: int) -> float:
    """Parameters of one dense SwiGLU decoder layer (attention + MLP, norms ignored)."""
    attention = 2.0 * hidden * (q_heads + kv_heads) * head_dim
    return attention + 3.0 * hidden * ffn


def dflash_drafter(target: ModelShape, layers: int) -> ModelShape:
    """A DFlash drafter of ``target``: ``layers`` decoder layers of the target's widths, the
    target's LM head shared (read and multiplied once per drafted position)."""
    per_layer = layer_params(
        target.hidden, target.q_heads, target.kv_heads, target.head_dim, target.ffn
    )
    return ModelShape(
        f"DFlash-{layers}L({target.name})",
        layers * per_layer + target.vocab * target.hidden,
        layers,
        target.hidden,
        target.q_heads,
        target.kv_heads,
        target.head_dim,
        target.ffn,
        target.vocab,
        True,
        target.dtype_bytes,
    )


def forward_seconds(
    shape: ModelShape,
    device: DeviceSpec,
    bs: int,
    tokens_per_request: int,
    context: int,
    unhidden_s: float = 0.0,
) -> float:
    """Roofline time of one forward of ``bs`` requests, ``tokens_per_request`` new tokens each;
    ``unhidden_s`` (:func:`verify_seconds`) adds to the memory-bound time, under the compute
    bound."""
    tokens = bs * tokens_per_request
    span = context + tokens_per_request
    weight_bytes = shape.params * shape.dtype_bytes
    kv_bytes = bs * span * shape.kv_bytes_per_token
    flops = 2.0 * shape.matmul_params * tokens
    flops += 4.0 * shape.layers * shape.q_heads * shape.head_dim * tokens * span
    memory_s = (weight_bytes + kv_bytes) / (device.mem_bandwidth * device.bw_efficiency)
    compute_s = flops / (device.peak_flops * device.flops_efficiency)
    return max(memory_s + unhidden_s, compute_s)


def verify_seconds(
    target: ModelShape, device: DeviceSpec, bs: int, tokens_per_request: int, context: int
) -> float:
    """What a target verify of ``tokens_per_request`` tokens a request costs over its first one
    beyond the roofline: ``t1 * max(verify_width * sqrt(w - 1), verify_token * bs * (w - 1))``,
    ``t1`` one request's one-token step (see the module docstring; 0 on the CPU)."""
    extra = tokens_per_request - 1
    if extra <= 0 or not (device.verify_width or device.verify_token):
        return 0.0
    t1 = device.step_overhead_s + forward_seconds(target, device, 1, 1, context)
    return t1 * max(device.verify_width * math.sqrt(extra), device.verify_token * bs * extra)


def roofline_step_seconds(
    target: ModelShape,
    device: DeviceSpec,
    bs: int,
    budget: int,
    context: int,
    drafter: ModelShape | None = None,
    block: int = 16,
) -> float:
    """Prior C(bs, N): one decode step at budget N (0 = plain decode, no drafter)."""
    unhidden = verify_seconds(target, device, bs, budget + 1, context)
    seconds = device.step_overhead_s + forward_seconds(
        target, device, bs, budget + 1, context, unhidden
    )
    if budget > 0:
        seconds += device.draft_overhead_s
        if drafter is not None:
            seconds += forward_seconds(drafter, device, bs, block, context)
    return seconds


def isotonic(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (pool adjacent
    violators: a run that decreases is replaced by its weighted mean)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight, length = blocks.pop()
            last = blocks[-1]
            total = last[1] + weight
            last[0] = (last[0] * last[1] + mean * weight) / total
            last[1], last[2] = total, last[2] + length
    return [mean for mean, _, length in blocks for _ in range(int(length))]


def bucket_of(buckets: tuple[int, ...], bs: int) -> int:
    """Index of the smallest bucket >= bs (the last bucket for larger batches)."""
    return min(bisect.bisect_left(buckets, bs), len(buckets) - 1)


@dataclass(frozen=True)
class LatencyConfig:
    """Attributes:
    first_steps: a cell's first this many times set its cost (the lower median of each over
        the speed of the last settled cell's step before it): a warm-up step alone does not.
    load_window: the machine's load is the median ratio of this many latest times to their
        cells.
    pair_rate: each switch between two measured cells moves their log-cost difference this
        fraction of the way to the one the switch measured (its error clipped to
        ``pair_clip``), once both cells have seen enough switches: a cell's own share of the
        move is 1 / (2 + its switches so far) until that falls to half this (its first switches
        are averaged, not decayed: a cell set by a few steps in a burst of load is corrected
        by its next switches, not a tenth of the way each).
    pair_clip: the largest log-cost error one switch moves by (a burst of load across a switch
        is not a cost).
    calib_decay: per-measurement decay of the linear calibration's sums.
    max_weight: a measured cell's weight in its row's isotonic fit is the number of times it
        was measured, up to this.
    """

    first_steps: int = 3
    load_window: int = 8
    pair_rate: float = 0.1
    pair_clip: float = 0.2
    calib_decay: float = 0.995
    max_weight: float = 8.0


class LatencyModel:
    """C(bs, N) over ``bs_buckets`` x ``budgets``; host floats only (no device reads)."""

    def __init__(
        self,
        prior: list[list[float]],
        budgets: tuple[int, ...],
        bs_buckets: tuple[int, ...] = DEFAULT_BS_BUCKETS,
        config: LatencyConfig = LatencyConfig(),
        profile_buckets: tuple[int, ...] | None = None,
    ) -> None:
        """``profile_buckets``: the buckets whose rows the start-up profile fills (None: all
        of ``bs_buckets``; see :meth:`profiles`)."""
        if len(prior) != len(bs_buckets) or any(len(row) != len(budgets) for row in prior):
            raise ValueError("prior must be [len(bs_buckets)][len(budgets)]")
        if config.load_window < 1 or config.first_steps < 1:
            raise ValueError("load_window and first_steps must be >= 1")
        self.prior = [list(map(float, row)) for row in prior]
        self.budgets = tuple(budgets)
        self.bs_buckets = tuple(bs_buckets)
        self.config = config
        profiled = self.bs_buckets if profile_buckets is None else profile_buckets
        self._profiled = frozenset(profiled) & frozenset(self.bs_buckets)
        self._measured = [[] for _ in budgets]  # per column, sorted buckets with a cost
        self._col = {b: i for i, b in enumerate(self.budgets)}
        self._cost: dict[tuple[int, int], float] = {}  # (bucket, column) -> log s at load 1
        self._first: dict[tuple[int, int], list[float]] = {}  # a cell's first log s / load
        self._switches: dict[tuple[int, int], int] = {}  # per cell, switches it has seen
        self._last: tuple[tuple[int, int], float] | None = None  # last cell, its log time
        self.count = [[0] * len(budgets) for _ in bs_buckets]
        self._sums = [0.0] * 5  # decayed w, x, y, xx, xy of (prior, measured)
        self._abs_rel_err = 0.0
        self._err_count = 0
        self.predicted_seconds = 0.0  # summed over the recorded steps, each before its update
        self.measured_seconds = 0.0
        self._rows: dict[int, list[float]] = {}  # bucket -> its row as last fitted
        self._fitted: set[int] = set()  # buckets whose row is fitted to the cells as they are
        self._residuals = collections.deque(maxlen=config.load_window)  # log time - its cost
        self.load = 1.0  # the machine's speed now over its speed when the cells were measured
        self._settled_speed: float | None = None  # log speed of the last settled cell's step

    @classmethod
    def from_roofline(
        cls,
        target: ModelShape,
        device: DeviceSpec,
        budgets: tuple[int, ...],
        *,
        context: int = 1024,
        drafter: ModelShape | None = None,
        block: int = 16,
        bs_buckets: tuple[int, ...] = DEFAULT_BS_BUCKETS,
        config: LatencyConfig = LatencyConfig(),
    ) -> LatencyModel:
        """The roofline prior over ``bs_buckets`` (:func:`bs_buckets_for` the device); the
        profile fills the :data:`DEFAULT_BS_BUCKETS` rows."""
        prior = [
            [roofline_step_seconds(target, device, bs, n, context, drafter, block) for n in budgets]
            for bs in bs_buckets
        ]
        return cls(prior, budgets, bs_buckets, config, profile_buckets=DEFAULT_BS_BUCKETS)

    def profiles(self, bs: int) -> bool:
        """The start-up profile measures ``bs``'s bucket (the others read their measured
        neighbours, see :meth:`row`)."""
        return self.bs_buckets[bucket_of(self.bs_buckets, bs)] in self._profiled

    def calibration(self) -> tuple[float, float]:
        """(a, b) of measured ~= a * prior + b; (1, 0) before any measurement."""
        w, x, y, xx, xy = self._sums
        if w <= 0.0 or x <= 0.0:
            return 1.0, 0.0
        det = w * xx - x * x
        if det > 1e-9 * x * x:
            a = (w * xy - x * y) / det
            if a > 0.0:
                return a, (y - a * x) / w
        return y / x, 0.0  # one distinct prior value (or a negative slope): a ratio only

    def calibrated_prior(self, bucket: int, column: int) -> float:
        a, b = self.calibration()
        x = self.prior[bucket][column]
        return max(a * x + b, 0.05 * a * x)

    def seconds(self, bs: int, budget: int) -> float:
        """C(bs, N) in seconds (see :meth:`row`)."""
        return self.row(bs)[self._col[budget]]

    def row(self, bs: int) -> list[float]:
        """``[C]`` C(bs, N) for every candidate budget, non-decreasing in N: the measured cells'
        costs under a weighted isotonic fit (weights: step counts), and between them the
        column's nearest measured buckets (:meth:`_unmeasured`), clamped to the fitted cells on
        either side; times the machine's current load."""
        return [self.load * seconds for seconds in self._unloaded_row(bs)]

    def _unloaded_row(self, bs: int) -> list[float]:
        bucket = bucket_of(self.bs_buckets, bs)
        if bucket not in self._fitted:
            self._rows[bucket] = self._fit_row(bucket)
            self._fitted.add(bucket)
        return self._rows[bucket]

    def _fit_row(self, bucket: int) -> list[float]:
        measured = [c for c in range(len(self.budgets)) if (bucket, c) in self._cost]
        counts = self.count[bucket]
        fitted = dict(
            zip(
                measured,
                isotonic(
                    [math.exp(self._cost[bucket, c]) for c in measured],
                    [min(float(counts[c]), self.config.max_weight) for c in measured],
                ),
                strict=True,
            )
        )
        level = self._level(bucket, measured)
        row = []
        for column in range(len(self.budgets)):
            if column in fitted:
                row.append(fitted[column])
                continue
            below = [fitted[c] for c in measured if c < column]
            above = [fitted[c] for c in measured if c > column]
            value = level * self._unmeasured(bucket, column)
            value = max(value, below[-1]) if below else value
            row.append(min(value, above[0]) if above else value)
        return row

    def _level(self, bucket: int, measured: list[int]) -> float:
        """How a row's measured cells compare with what its neighbours predict for them
        (:meth:`_unmeasured`; geometric mean; 1 with none): its unmeasured cells are scaled
        by it, so they keep their columns' ratios to the measured ones. A bucket that profiles
        its contenders alone (``policies.Profile``) measures some cells; read as
        its neighbours' costs, the others looked as much cheaper as the bucket costs more
        than its neighbours predict, and were chosen for it."""
        if not measured:
            return 1.0
        logs = [self._cost[bucket, c] - math.log(self._unmeasured(bucket, c)) for c in measured]
        return math.exp(sum(logs) / len(logs))

    def _unmeasured(self, bucket: int, column: int) -> float:
        """A cell read from other buckets: its calibrated prior times the measured /
        calibrated-prior ratio of its column's nearest measured buckets other than its own
        (linear in the batch size between the one below and the one above, else the one
        side's; 1 when the column has none)."""
        rows = self._measured[column]
        at = bisect.bisect_left(rows, bucket)
        past = at + 1 if at < len(rows) and rows[at] == bucket else at
        near = rows[max(at - 1, 0) : at] + rows[past : past + 1]
        ratio = [
            math.exp(self._cost[r, column]) / self.calibrated_prior(r, column) for r in near
        ] or [1.0]
        if len(near) == 2:
            lo, hi = (self.bs_buckets[r] for r in near)
            ratio[0] += (ratio[1] - ratio[0]) * (self.bs_buckets[bucket] - lo) / (hi - lo)
        return ratio[0] * self.calibrated_prior(bucket, column)

    def record(self, bs: int, budget: int, seconds: float) -> bool:
        """Fold in one measured step; False (ignored) for a budget outside the candidates."""
        column = self._col.get(budget)
        if column is None or not seconds > 0.0:
            return False
        bucket = bucket_of(self.bs_buckets, bs)
        # the row as last fitted: refitted after a step that moved a cell, not after one that
        # only moved the calibration (a held budget's steps: a refit each, for this error
        # alone, cost them more than the rest of the controller's work on a step)
        row = self._rows.get(bucket)
        predicted = self.load * (self._unloaded_row(bs) if row is None else row)[column]
        self._abs_rel_err += abs(predicted - seconds) / seconds
        self._err_count += 1
        self.predicted_seconds += predicted
        self.measured_seconds += seconds
        cell, x = (bucket, column), math.log(seconds)
        if cell not in self._cost:  # unmeasured (or forgotten): its first times set it
            self._first[cell] = []
            bisect.insort(self._measured[column], bucket)
        first = self._first.get(cell)
        count = self.count[bucket][column] = self.count[bucket][column] + 1
        moved = first is not None or count <= self.config.max_weight  # a cell's cost or weight
        if first is not None:  # at the speed the cells were measured at
            speed = math.log(self.load) if self._settled_speed is None else self._settled_speed
            first.append(x - speed)
            self._cost[cell] = statistics.median_low(first)
            if len(first) == self.config.first_steps:
                del self._first[cell]
        elif self._last is not None and self._last[0] != cell and self._last[0] in self._cost:
            self._pair(self._last[0], self._last[1], cell, x)
            moved = True
        self._last = (cell, x)
        self._residuals.append(x - self._cost[cell])
        if first is None:  # a settled cell: this step's speed, a switch's measure for the next
            self._settled_speed = self._residuals[-1]
        self.load = math.exp(statistics.median_low(self._residuals))
        prior, y = self.prior[bucket][column], math.exp(self._cost[cell])
        d = self.config.calib_decay
        for i, v in enumerate((1.0, prior, y, prior * prior, prior * y)):
            self._sums[i] = self._sums[i] * d + v
        self._fitted.clear()  # the calibration moved every prior: a decision refits its row
        if moved:
            self._rows.clear()
        return True

    def _pair(self, a: tuple[int, int], xa: float, b: tuple[int, int], xb: float) -> None:
        """A switch from cell ``a`` (log time ``xa``) to cell ``b`` (``xb``): two times taken
        at one speed of the machine, the only measure of one cell's cost against another's
        (times of one cell in a row are compared with themselves). Their log-cost difference
        moves toward the measured one (error clipped), each cell by its own share
        (``LatencyConfig.pair_rate``)."""
        clip, floor = self.config.pair_clip, 0.5 * self.config.pair_rate
        error = max(-clip, min(clip, (xb - xa) - (self._cost[b] - self._cost[a])))
        for cell, sign in ((a, -1.0), (b, 1.0)):
            seen = self._switches.get(cell, 0)
            self._cost[cell] += sign * max(floor, 1.0 / (2 + seen)) * error
            self._switches[cell] = seen + 1

    def inverted(self, bs: int, margin: float) -> list[int]:
        """The budgets of ``bs``'s bucket whose measured cost exceeds a larger budget's measured
        cost by more than ``margin`` (a fraction). A larger tree is never less work: such a
        cell was set at another speed of the machine than the larger one (a row's cells are
        measured at different times, each normalised by the load read then), and the row's
        isotonic fit pools it up to the larger one's. Re-measuring it next to the others (a
        switch, :meth:`_pair`) is what corrects it (``ControlConfig.explore_inverted``)."""
        bucket = bucket_of(self.bs_buckets, bs)
        measured = [c for c in range(len(self.budgets)) if (bucket, c) in self._cost]
        cost, excess = [self._cost[bucket, c] for c in measured], math.log1p(margin)
        return [
            self.budgets[c]
            for i, c in enumerate(measured)
            if any(cost[i] > larger + excess for larger in cost[i + 1 :])
        ]

    def forget(self, bs: int, budget: int) -> None:
        """Drop the cost of ``bs``'s bucket's ``budget`` cell (its count stays: the profile is
        not repeated); its next ``first_steps`` times set it afresh."""
        column, bucket = self._col.get(budget), bucket_of(self.bs_buckets, bs)
        if column is not None and (bucket, column) in self._cost:
            del self._cost[bucket, column]
            self._first.pop((bucket, column), None)
            self._switches.pop((bucket, column), None)
            self._measured[column].remove(bucket)
            self._rows.clear()
            self._fitted.clear()

    def mean_abs_rel_error(self) -> float:
        """Mean |predicted - measured| / measured of every recorded step, before its update
        (from its bucket's row as last fitted, times the load then)."""
        return self._abs_rel_err / max(self._err_count, 1)

    @property
    def recorded_steps(self) -> int:
        """How many steps :meth:`mean_abs_rel_error` covers."""
        return self._err_count
