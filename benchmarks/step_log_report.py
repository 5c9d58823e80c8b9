"""Summarise the per-step CSVs a server writes under ``SGLANG_TREE_SPEC_STEP_LOG=DIR``.

One table per log file (one server: ``steps_<budget>_<pid>.csv``): for every (kind, budget) the
steps, their share of the server's decode time, the mean batch size, committed tokens per
request-step and committed tokens per millisecond, and, when the server also ran with
``SGLANG_TREE_SPEC_STEP_TIMES=N``, the mean milliseconds of each phase of the step
(``step_times.PHASES``); and for auto, over the steps it calibrated on (forecast steps and the
sampled held ones), the mean predicted and accepted draft tokens per request-step (where its
predictions miss, by kind of step). Kinds: ``forecast`` (auto chose the budget this step),
``held`` (a fixed budget, or auto holding, exploring or profiling one), ``plain`` (no draft).
Reading auto's rows beside the fixed servers' shows where auto's time goes.

    SGLANG_TREE_SPEC_STEP_LOG=/tmp/steps SGLANG_TREE_SPEC_STEP_TIMES=1000000 \
        python benchmarks/serve_throughput.py ...
    python benchmarks/step_log_report.py /tmp/steps
"""

from __future__ import annotations

import argparse
import csv
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the SGLANG_TREE_SPEC_STEP_LOG folder")
    args = parser.parse_args()
    files = sorted(args.folder.glob("steps_*.csv"))
    if not files:
        raise SystemExit(f"no steps_*.csv under {args.folder}")
    print("\n\n".join(report(path) for path in files))


if __name__ == "__main__":
    main()
