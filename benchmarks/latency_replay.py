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

``--truth DIR`` replays the log's REAL step times instead, and reads the truth from the same
server's pinned budgets (``serve_throughput.py ... ddtree:auto/4 ddtree:auto/8 ...`` with
``SGLANG_TREE_SPEC_STEP_LOG=DIR``: their ``steps_*-pin<N>_*.csv``, each budget's mean step
time and tokens per step at every batch size it ran 30+ steps at, interleaved with auto's
over the whole run). At each forecast step whose batch size has every budget > 0 pinned and
measured in the model, it scores the model's ratios of neighbouring budgets against those
means, and the choice regret of the latency model alone: 1 - the true tokens/s of the budget
the model's row would choose for the pinned budgets' mean tokens per step over the best
one's. ``--latency KEY=VALUE`` sets a ``LatencyConfig`` field of the replayed model (in either
mode), so estimators can be compared on real times (a truth that is a whole run's mean favours
slow estimators).

    python benchmarks/latency_replay.py benchmarks/results/steps_auto_cpu_small_pair_c4_c8.csv
    python benchmarks/latency_replay.py DIR/steps_auto_123.csv --truth DIR --latency pair_rate=0.05
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import math
import random
import statistics
from pathlib import Path

from sglang_tree_spec.control import AUTO, BudgetController, ControlConfig
from sglang_tree_spec.control.latency import (
    EXACT_BS_BUCKETS,
    LatencyConfig,
    LatencyModel,
    bucket_of,
)

BUDGETS = (0, 4, 8, 16, 32)
MIN_TRUTH_STEPS = 30  # a pinned budget's steps at one batch size for its mean to be the truth


def true_seconds(bs: int, budget: int, shifted: bool) -> float:
    """A row shaped like the small pair's on this CPU (ms): plain forwards ~0.45x a drafted
    step, larger trees dearer, more so at larger batch sizes."""
    base = 12.0 + 1.2 * bs
    if budget == 0:
        return 0.45 * base / 1e3
    cost = base * (1.0 + 0.012 * budget * (1.0 + bs / 8))
    return cost * (1.25 if shifted and budget >= 16 else 1.0) / 1e3


def fresh_model(args: argparse.Namespace) -> tuple[LatencyModel, BudgetController]:
    """A latency model with a flat prior (``--latency``'s config) and a controller that
    records into it by the product's rules (no forecast step, no drafted budget 0,
    forgetting)."""
    model = LatencyModel(
        [[0.01] * len(BUDGETS)] * len(EXACT_BS_BUCKETS), BUDGETS, EXACT_BS_BUCKETS,
        LatencyConfig(**args.latency),
    )  # fmt: skip
    config = ControlConfig(budgets=BUDGETS, forget_after=args.forget_after)
    return model, BudgetController(config, model, max_slots=1)


def replay(steps, args: argparse.Namespace, seed: int) -> list[float]:
    """Log errors of the sampled within-row ratios over one replay (``args.repeats`` passes)."""
    rnd = random.Random(seed)
    model, controller = fresh_model(args)
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
            controller.drafted_steps += drafted  # as held_budget and choose count them
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


def pinned_truth(folder: Path) -> dict[tuple[int, int], tuple[float, float]]:
    """(batch size, budget) -> (mean seconds, mean tokens) of a step of the pinned budgets'
    step logs in ``folder`` (``steps_*-pin<N>_*.csv``), where they ran ``MIN_TRUTH_STEPS``+."""
    steps: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for path in sorted(folder.glob("steps_*-pin*_*.csv")):
        if not path.stem.rsplit("_", 1)[0].rsplit("-pin", 1)[1].isdigit():
            continue  # a pinned auto variant, not a budget
        with path.open() as f:
            for r in csv.DictReader(f):
                steps.setdefault((int(r["bs"]), int(r["budget"])), []).append(
                    (float(r["seconds"]), int(r["tokens"]))
                )
    return {
        cell: (statistics.mean(s for s, _ in rows), statistics.mean(t for _, t in rows))
        for cell, rows in steps.items()
        if len(rows) >= MIN_TRUTH_STEPS
    }


def replay_real(rows: list[dict], truth: dict, args: argparse.Namespace) -> dict[str, object]:
    """The log's real times into a fresh model; per batch size, the log errors of its
    neighbouring budgets' ratios and the regret of its choice at each scored forecast."""
    model, controller = fresh_model(args)
    drafted_budgets = [b for b in BUDGETS if b > 0]
    errors: dict[int, list[float]] = {}
    regrets: dict[int, list[float]] = {}
    after_plain = False
    for r in rows:
        bs, budget = int(r["bs"]), int(r["budget"])
        drafted, forecast = r["drafted"] == "1", r["forecast"] == "1"
        bucket = bucket_of(model.bs_buckets, bs)
        scored = all((bs, b) in truth for b in drafted_budgets) and all(
            (bucket, BUDGETS.index(b)) in model._cost for b in drafted_budgets
        )
        if forecast and scored:
            row = dict(zip(BUDGETS, model.row(bs), strict=True))
            for low, high in itertools.pairwise(drafted_budgets):
                true_ratio = truth[bs, high][0] / truth[bs, low][0]
                errors.setdefault(bs, []).append(math.log(row[high] / row[low] / true_ratio))
            rate = {b: truth[bs, b][1] / truth[bs, b][0] for b in drafted_budgets}
            chosen = max(drafted_budgets, key=lambda b: truth[bs, b][1] / row[b])
            regrets.setdefault(bs, []).append(1.0 - rate[chosen] / max(rate.values()))
        controller.drafted_steps += drafted  # as held_budget and choose count them
        controller._after_plain = drafted and after_plain  # (held_budget sets it)
        controller.record_step(
            bs, budget, float(r["seconds"]), drafted, forecast, int(r["forwards"])
        )
        after_plain = not drafted
    return {"errors": errors, "regrets": regrets}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step_log", type=Path, help="an auto server's per-step CSV")
    parser.add_argument("--repeats", type=int, default=4, help="passes over the log")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--drift", type=float, default=0.02)
    parser.add_argument("--burst-rate", type=float, default=0.01)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--forget-after", type=int, default=AUTO["forget_after"])
    parser.add_argument("--shift", action="store_true")
    parser.add_argument("--truth", type=Path, help="the same server's pinned budgets' step logs")
    parser.add_argument(
        "--latency", action="append", default=[], metavar="KEY=VALUE",
        help="a LatencyConfig field of the replayed model (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    defaults = dataclasses.asdict(LatencyConfig())
    latency = {}
    for item in args.latency:
        key, _, value = item.partition("=")
        if key not in defaults:
            parser.error(f"--latency {item}: not a LatencyConfig field ({', '.join(defaults)})")
        latency[key] = type(defaults[key])(value)
    args.latency = latency
    if args.truth is not None:
        return main_real(args)
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


def main_real(args: argparse.Namespace) -> dict[str, float]:
    """``--truth``: the real times replayed, scored against the pinned budgets' means."""
    with args.step_log.open() as f:
        rows = list(csv.DictReader(f))
    truth = pinned_truth(args.truth)
    scored = replay_real(rows, truth, args)
    errors, regrets = scored["errors"], scored["regrets"]
    if not regrets:
        raise SystemExit(
            f"no forecast step at a batch size every pinned budget of {args.truth} ran"
        )
    print(f"{len(rows)} real steps, truth: pinned budgets of {args.truth}, latency {args.latency}")
    for bs in sorted(regrets):
        e = errors[bs]
        print(
            f"  batch size {bs}: {len(regrets[bs])} forecasts, ratio error rms "
            f"{math.sqrt(statistics.mean(x * x for x in e)):.3f} mean {statistics.mean(e):+.3f} "
            f"(log), choice regret {statistics.mean(regrets[bs]):.4f}"
        )
    every = [x for e in errors.values() for x in e]
    result = {
        "rms": math.sqrt(statistics.mean(x * x for x in every)),
        "regret": statistics.mean(x for r in regrets.values() for x in r),
    }
    print(f"ratio error rms {result['rms']:.3f}, regret {result['regret']:.4f} (every forecast)")
    return result


if __name__ == "__main__":
    main()
