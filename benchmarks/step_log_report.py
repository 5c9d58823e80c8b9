"""Summarise the per-step CSVs a server writes under ``SGLANG_TREE_SPEC_STEP_LOG=DIR``.

One table per log file (one server: ``steps_<budget>_<pid>.csv``): for every (kind, budget)
the steps, their share of the server's decode time, the mean batch size, committed tokens per
request-step and committed tokens per millisecond. Kinds: ``forecast`` (auto chose the budget
this step), ``held`` (a fixed budget, or auto holding, exploring or profiling one), ``plain``
(no draft). Reading auto's rows beside the fixed servers' shows where auto's time goes.

    SGLANG_TREE_SPEC_STEP_LOG=/tmp/steps python benchmarks/serve_throughput.py ...
    python benchmarks/step_log_report.py /tmp/steps
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path


def kind(row: dict[str, str]) -> str:
    if row["drafted"] == "0":
        return "plain"
    return "forecast" if row["forecast"] == "1" else "held"


def report(path: Path) -> str:
    """A markdown table of one server's steps."""
    groups: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    total = 0.0
    with path.open() as f:
        for row in csv.DictReader(f):
            cell = groups[(kind(row), int(row["budget"]))]
            seconds = float(row["seconds"])
            cell[0] += 1
            cell[1] += seconds
            cell[2] += int(row["bs"])
            cell[3] += int(row["tokens"])
            total += seconds
    lines = [
        f"### {path.name}: {sum(c[0] for c in groups.values())} steps, {total:.1f} s",
        "| kind | budget | steps | time share | mean bs | tokens / request-step | tokens / ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (k, budget), (steps, seconds, rows, tokens) in sorted(groups.items()):
        lines.append(
            f"| {k} | {budget} | {steps} | {seconds / max(total, 1e-9):.1%} | "
            f"{rows / steps:.1f} | {tokens / max(rows, 1):.2f} | {tokens / (1e3 * seconds):.3f} |"
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
