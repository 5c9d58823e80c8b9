"""Summarise the per-step CSVs a server writes under ``SGLANG_TREE_SPEC_STEP_LOG=DIR``.

One table per log file (one server: ``steps_<budget>_<pid>.csv``): for every (kind, budget) the
steps, their share of the server's decode time, the mean batch size, committed tokens per
request-step and committed tokens per millisecond, and, when the server also ran with
``SGLANG_TREE_SPEC_STEP_TIMES=N``, the mean milliseconds of each phase of the step
(``step_times.PHASES``); and for auto, over the steps it calibrated on (one drafted step in
``ControlConfig.held_observe_every``; a grafted tree's forecast steps), the mean predicted and
accepted draft tokens per request-step (where its predictions miss, by kind of step). Kinds:
``forecast`` (auto chose the budget this step), ``held`` (a fixed budget, or auto holding,
exploring or profiling one), ``plain`` (no draft). Reading auto's rows beside the fixed servers'
shows where auto's time goes.

When the auto server also ran pinned budgets (``serve_throughput.py``'s ``ddtree:auto/N``: their
steps in ``steps_auto-pin<N>_<pid>.csv``, the same process), :func:`versus_pinned` adds, for auto
and each auto variant pinned there (``steps_auto-pinauto..._<pid>.csv``), per batch size, its
committed tokens per second over the best pinned budget's, split in two (its choices: its steps
charged the mean step time of their pinned budget; their own cost: their time over that), and what
each of its (kind, budget) costs it: its time share, its mean step against the pinned budget's at
that batch size, and its loss, the time its steps took beyond what the best pinned budget needs for
their tokens, as a share of its time (the losses sum to 1 - its ratio; a negative loss: those steps
did better than the best budget's average). Logs with a ``reason`` column (``control.REASONS``: why
each step has its budget) add the same losses per reason: which forecasts (arrivals, expired holds,
a grown batch, probes) and which other steps (held choices, explorations, the profile, plain runs)
cost what. Logs with phase times (``SGLANG_TREE_SPEC_STEP_TIMES``) add, per batch size, the time
auto's forecast and held steps took beyond the pinned steps of the same budget, per phase and
outside the step (the scheduler's work), as a share of auto's time: where their own cost goes.

    SGLANG_TREE_SPEC_STEP_LOG=/tmp/steps SGLANG_TREE_SPEC_STEP_TIMES=1000000 \
        python benchmarks/serve_throughput.py ...
    python benchmarks/step_log_report.py /tmp/steps
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict
from pathlib import Path

from sglang_tree_spec.step_times import PHASES


def kind(row: dict[str, str]) -> str:
    if row["drafted"] == "0":
        return "plain"
    return "forecast" if row["forecast"] == "1" else "held"


def report(path: Path) -> str:
    """A markdown table of one server's steps."""
    groups: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    phase_sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0] * len(PHASES))
    calibrated: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    total = 0.0
    with path.open() as f:
        for row in csv.DictReader(f):
            key = (kind(row), int(row["budget"]))
            cell = groups[key]
            seconds = float(row["seconds"])
            cell[0] += 1
            cell[1] += seconds
            cell[2] += int(row["bs"])
            cell[3] += int(row["tokens"])
            total += seconds
            if row.get(PHASES[0]):  # timed (SGLANG_TREE_SPEC_STEP_TIMES)
                sums = phase_sums[key]
                for i, phase in enumerate(PHASES):
                    sums[i] += float(row[phase])
            if row.get("predicted"):  # a step the budget control calibrated on
                sums = calibrated[key]
                sums[0] += float(row["predicted"])
                sums[1] += float(row["accepted"])
                sums[2] += int(row["bs"])
    timed = " | " + " / ".join(PHASES) + " ms" if phase_sums else ""
    predicted = " | predicted / accepted (request-steps)" if calibrated else ""
    lines = [
        f"### {path.name}: {sum(c[0] for c in groups.values())} steps, {total:.1f} s",
        "| kind | budget | steps | time share | mean bs | tokens / request-step | tokens / ms"
        f"{timed}{predicted} |",
        "|---|---:|---:|---:|---:|---:|---:|"
        + ("---|" if timed else "")
        + ("---|" if predicted else ""),
    ]
    for key, (steps, seconds, rows, tokens) in sorted(groups.items()):
        k, budget = key
        phases = calibration = ""
        if timed:
            phases = " | " + " / ".join(f"{1e3 * x / steps:.2f}" for x in phase_sums[key])
        if predicted:
            p, a, n = calibrated.get(key, (0.0, 0.0, 0))
            calibration = f" | {p / n:.2f} / {a / n:.2f} ({n})" if n else " | -"
        lines.append(
            f"| {k} | {budget} | {steps} | {seconds / max(total, 1e-9):.1%} | "
            f"{rows / steps:.1f} | {tokens / max(rows, 1):.2f} | {tokens / (1e3 * seconds):.3f}"
            f"{phases}{calibration} |"
        )
    return "\n".join(lines)


def _steps(path: Path) -> list[tuple[int, int, str, int, float, str]]:
    """``(bs, budget, kind, tokens, seconds, reason)`` of every line of a step log (reason:
    "" in a log without the column)."""
    with path.open() as f:
        return [
            (
                int(r["bs"]),
                int(r["budget"]),
                kind(r),
                int(r["tokens"]),
                float(r["seconds"]),
                r.get("reason") or "",
            )
            for r in csv.DictReader(f)
        ]


def versus_pinned(auto: Path, pinned: list[Path], batch_sizes: tuple[int, ...]) -> str:
    """Auto's steps against its own server's pinned budgets (``pinned``: the
    ``steps_auto-pin<N>_<pid>.csv`` of ``auto``'s process), per batch size in ``batch_sizes``
    (one whose pinned budgets ran fewer than 20 steps each is left out)."""
    mine = _steps(auto)
    cells: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0, 0])  # tokens, s, n
    for path in pinned:
        for bs, budget, _, tokens, seconds, _ in _steps(path):
            cell = cells[bs, budget]
            cell[0], cell[1], cell[2] = cell[0] + tokens, cell[1] + seconds, cell[2] + 1
    lines = [f"### {auto.name} against its pinned budgets"]
    for size in batch_sizes:
        rates = {b: t / s for (bs, b), (t, s, n) in cells.items() if bs == size and n >= 20}
        steps = [step for step in mine if step[0] == size]
        if not rates or not steps:
            continue
        best = max(rates, key=rates.get)
        time = sum(step[4] for step in steps)
        tokens = sum(step[3] for step in steps)
        ratio = tokens / time / rates[best]
        relative = ", ".join(f"B {b} {r / rates[best]:.3f}" for b, r in sorted(rates.items()))
        charged = sum(_pinned_time(cells, step) for step in steps)
        lines += [
            "",
            f"batch size {size}: auto {ratio:.3f}x the best pinned budget (B {best}; "
            f"pinned: {relative}); at the pinned budgets' mean step times its steps read "
            f"{tokens / charged / rates[best]:.3f}x (its choices), and they took "
            f"{time / charged - 1:+.1%} longer than that (their own cost)",
            "",
            "| kind | budget | steps | time share | ms / step | pinned ms / step | loss |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        groups: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        reasons: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for _, budget, k, tokens, seconds, reason in steps:
            for group in (groups[k, budget], reasons[k, reason]):
                group[0] += 1
                group[1] += seconds
                group[2] += seconds - tokens / rates[best]
        for (k, budget), (n, seconds, loss) in sorted(groups.items()):
            cell = cells.get((size, budget))
            pinned_ms = f"{1e3 * cell[1] / cell[2]:.2f}" if cell and cell[2] else "-"
            lines.append(
                f"| {k} | {budget} | {n} | {seconds / time:.1%} | {1e3 * seconds / n:.2f} | "
                f"{pinned_ms} | {_loss(loss, time)} |"
            )
        if any(reason for _, reason in reasons):
            lines += ["", "| kind | reason | steps | time share | ms / step | loss |"]
            lines.append("|---|---|---:|---:|---:|---:|")
            for (k, reason), (n, seconds, loss) in sorted(reasons.items()):
                lines.append(
                    f"| {k} | {reason} | {n} | {seconds / time:.1%} | "
                    f"{1e3 * seconds / n:.2f} | {_loss(loss, time)} |"
                )
        lines += _phase_excess(auto, pinned, size, time)
    return "\n".join(lines)


def _timed(path: Path, size: int) -> list[tuple[int, str, float, list[float]]]:
    """``(budget, kind, seconds, [phase seconds..., outside])`` of the timed drafted steps at
    batch size ``size`` (outside: the step's period beyond its phases, the scheduler's work)."""
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if int(r["bs"]) == size and r.get(PHASES[0])]
    steps = []
    for r in rows:
        if kind(r) == "plain":
            continue
        phases = [float(r[phase]) for phase in PHASES]
        seconds = float(r["seconds"])
        steps.append((int(r["budget"]), kind(r), seconds, [*phases, seconds - sum(phases)]))
    return steps


def _phase_excess(auto: Path, pinned: list[Path], size: int, time: float) -> list[str]:
    """Auto's forecast and held steps at batch size ``size`` against the pinned steps of the
    same budget, per phase: the time they took beyond the pinned steps' mean, as a share of
    auto's ``time`` at that batch size (where its own cost goes). Empty for untimed logs."""
    means: dict[int, list[float]] = {}
    for path in pinned:
        steps = _timed(path, size)
        if steps:
            budget = steps[0][0]
            columns = zip(*(step[3] for step in steps), strict=True)
            means[budget] = [sum(column) / len(steps) for column in columns]
    excess: dict[str, list[float]] = defaultdict(lambda: [0.0] * (len(PHASES) + 1))
    for budget, k, _, phases in _timed(auto, size):
        if budget in means:
            sums = excess[k]
            for i, (mine, theirs) in enumerate(zip(phases, means[budget], strict=True)):
                sums[i] += mine - theirs
    if not excess:
        return []
    names = [*PHASES, "outside"]
    lines = [
        "",
        "| kind | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for k, sums in sorted(excess.items()):
        lines.append(f"| {k} | " + " | ".join(_loss(x, time) for x in sums) + " |")
    return lines


def _pinned_time(cells: dict, step: tuple) -> float:
    """A step of auto's charged the mean time of its pinned budget's steps at its batch size
    (its own time when that budget was not pinned, or it is a plain step)."""
    bs, budget, k, _, seconds, _ = step
    cell = cells.get((bs, budget))
    return cell[1] / cell[2] if k != "plain" and cell and cell[2] else seconds


def _loss(loss: float, time: float) -> str:
    return f"{round(loss / time, 4) + 0.0:+.1%}"  # (no -0.0%)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the SGLANG_TREE_SPEC_STEP_LOG folder")
    args = parser.parse_args()
    files = sorted(args.folder.glob("steps_*.csv"))
    if not files:
        raise SystemExit(f"no steps_*.csv under {args.folder}")
    tables = [report(path) for path in files]
    for path in files:  # auto and its variants (steps_auto-pinauto..._<pid>.csv)
        pid = path.stem.rsplit("_", 1)[1]
        pinned = [
            p for p in files if re.fullmatch(rf"steps_auto-pin\d+_{pid}", p.stem)
        ]  # the pinned budgets of its process
        if path.stem.startswith(("steps_auto_", "steps_auto-pinauto")) and pinned:
            tables.append(versus_pinned(path, pinned, (1, 2, 4, 8, 16)))
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
