"""The latency model under a known truth: an auto server's steps replayed with synthetic times.

A per-step log (``SGLANG_TREE_SPEC_STEP_LOG``, one CSV per server) gives the order of batch
sizes and budgets an auto server ran. This replays that order into a fresh
:class:`~sglang_tree_spec.control.LatencyModel` (the steps the controller records: no forecast
step, no drafted budget-0 step), each step timed as its TRUE cost (a fixed table, below; per
forward for a plain step) times a machine speed that drifts (AR(1) in log, sd ``--drift`` per
step) and bursts (probability ``--burst-rate`` per step, 10-80 steps of +15-40%) times per-step
noise (sd ``--noise`` in log), and reports how far the model's within-row ratios C(bs, N) /
C(bs, 4) stray from the truth (rms and worst log error, sampled along the replay at batch sizes
2 / 4 / 8). With ``--shift`` budgets >= 16 truly cost 25% more from the middle of the replay on,
and the error is read over the last quarter: how fast a stale cell follows (``forget_after``).
On a real server the truth is unknown and the machine's swings hide a few percent
(``serve_throughput.py`` needs 12+ waves); here estimators can be compared exactly.

    python benchmarks/latency_replay.py benchmarks/results/steps_auto_cpu_small_pair_c4_c8.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import statistics
from pathlib import Path

from sglang_tree_spec.control import BudgetController, ControlConfig
from sglang_tree_spec.control.latency import EXACT_BS_BUCKETS, LatencyModel, bucket_of
from sglang_tree_spec.step import FORGET_AFTER, HOLD_STEPS

BUDGETS = (0, 4, 8, 16, 32)


def true_seconds(bs: int, budget: int, shifted: bool) -> float:
    """A row shaped like the small pair's on this CPU (ms): plain forwards ~0.45x a drafted
    step, larger trees dearer, more so at larger batch sizes."""
    base = 12.0 + 1.2 * bs
    if budget == 0:
        return 0.45 * base / 1e3
    cost = base * (1.0 + 0.012 * budget * (1.0 + bs / 8))
    return cost * (1.25 if shifted and budget >= 16 else 1.0) / 1e3


def replay(steps, args: argparse.Namespace, seed: int) -> list[float]:
    """Log errors of the sampled within-row ratios over one replay (``args.repeats`` passes)."""
    rnd = random.Random(seed)
    model = LatencyModel([[0.01] * len(BUDGETS)] * len(EXACT_BS_BUCKETS), BUDGETS, EXACT_BS_BUCKETS)
    # the product's recording rules (no forecast step, no drafted budget 0, forgetting)
    config = ControlConfig(budgets=BUDGETS, hold_steps=HOLD_STEPS, forget_after=args.forget_after)
    controller = BudgetController(config, model, max_slots=1)
    drift, burst_left, burst, errors = 0.0, 0, 0.0, []
    for rep in range(args.repeats):
        shifted = args.shift and rep >= args.repeats // 2
        scored = not args.shift or rep == args.repeats - 1
        for bs, budget, drafted, forecast in steps:
            drift = 0.97 * drift + rnd.gauss(0.0, args.drift)
            if burst_left == 0 and rnd.random() < args.burst_rate:
                burst_left, burst = rnd.randint(10, 80), rnd.uniform(0.15, 0.4)
            speed = drift + (burst if burst_left else 0.0) + rnd.gauss(0.0, args.noise)
            burst_left = max(0, burst_left - 1)
            controller._drafted_steps += drafted  # as held_budget and choose count them
            seconds = true_seconds(bs, budget, shifted) * math.exp(speed)
            controller.record_step(bs, budget, seconds, drafted, forecast)
            if scored and bs in (2, 4, 8) and rnd.random() < 0.05:
                bucket = bucket_of(model.bs_buckets, bs)
                row = model.row(bs)
                measured = [c for c in range(1, len(BUDGETS)) if (bucket, c) in model._cost]
                if 1 in measured:
                    for c in measured[1:]:
                        truth = true_seconds(bs, BUDGETS[c], shifted) / true_seconds(bs, 4, shifted)
                        errors.append(math.log(row[c] / row[1] / truth))
    return errors


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step_log", type=Path, help="an auto server's per-step CSV")
    parser.add_argument("--repeats", type=int, default=4, help="passes over the log")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--drift", type=float, default=0.02)
    parser.add_argument("--burst-rate", type=float, default=0.01)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--forget-after", type=int, default=FORGET_AFTER)
    parser.add_argument("--shift", action="store_true")
    args = parser.parse_args(argv)
    with args.step_log.open() as f:
        steps = [
            (int(r["bs"]), int(r["budget"]), r["drafted"] == "1", r["forecast"] == "1")
            for r in csv.DictReader(f)
        ]
    runs = [replay(steps, args, seed) for seed in range(args.seeds)]
    rms = statistics.mean(math.sqrt(statistics.mean(e * e for e in r)) for r in runs)
    worst = statistics.mean(max(abs(e) for e in r) for r in runs)
    print(
        f"{len(steps)} steps x {args.repeats}, {args.seeds} seeds"
        f"{', budgets >= 16 +25% from the middle' if args.shift else ''}: "
        f"ratio error rms {rms:.3f}, worst {worst:.3f} (log; mean over seeds)"
    )
    return {"rms": rms, "worst": worst}


if __name__ == "__main__":
    main()
