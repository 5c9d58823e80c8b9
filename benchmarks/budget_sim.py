"""Budget policies on a simulated clock: exact decoding, step times from a table.

The reference engine decodes the held-out prompts for real under each policy (the same greedy
tokens for all of them; each step's tree, acceptance and the controller's forecasts are the real
ones), and each step is charged the time of its cell in a table of measured step times C(bs, N)
instead of its wall time, plus, for a step that forecast, ``--forecast-ms``, and for a drafted
step right after a plain one, ``--after-plain-ms`` (both measured through SGLang; see the
defaults). Output tokens / simulated seconds then compares policies without this machine's
+-10% drift between runs, which on a real server hides differences of a few percent
(``serve_throughput.py`` needs 12+ waves to tell 3%).

Policies: ``fixed:N``; ``auto`` (the product's controller, as ``step.make_controller`` sets it,
with the table for its latency model: no start-up profile, no exploration), and ``auto`` with
``ControlConfig`` fields overridden: ``auto:hold=8:holdmax=32:hard=1:tie=0.01:obs=4:decay=0.5``
(``hold_steps``, ``hold_max_steps``, ``hard_plain_steps``, ``tie_rtol``, ``held_observe_every``,
``choice_decay``; every key: ``step.AUTO_OVERRIDES``). Batches are static
(``--batch-size`` prompts from start to end, shrinking as they finish), not SGLang's continuous
batching: arrivals are not simulated.

    python benchmarks/budget_sim.py --batch-sizes 2 4 8 --prompts 32 \\
        --policies fixed:4 fixed:8 fixed:16 auto auto:hard=0 auto:hold=4

Default cells: the latency model's cells in ``DDTREE budgets`` log lines of DDTREE auto servers
(small pair, SGLang 0.5.17, this 2-core CPU, concurrency 2 / 4 / 8 runs of 2026-11-26), ms per
step (budget 0: per forward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from common import command_line, environment, portable, portable_record
from tqdm import tqdm

from sglang_tree_spec import step
from sglang_tree_spec.control import BudgetController, ControlConfig, LatencyModel
from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target
from sglang_tree_spec.engine.spec_engine import MAX_REQUESTS
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts

BUDGETS = (0, 4, 8, 16, 32)
DEFAULT_CELLS_MS = {  # batch-size bucket -> C(bs, N) for N in BUDGETS
    1: (5.0, 10.8, 10.8, 11.3, 11.6),
    2: (5.5, 11.2, 12.6, 13.5, 15.0),
    4: (6.3, 13.5, 14.5, 16.0, 19.2),
    8: (8.2, 16.0, 20.4, 22.8, 29.9),
}
# Measured with a per-step log of a clone (concurrency 2, SGLang 0.5.17, small pair): a step
# that forecast took 0.7-1.0 ms more than a held step of the same budget (12.7 ms at B 8), and
# a drafted step right after a plain one 0.5 ms more again. Concurrency 8 (session 30,
# instrumented clone): the forecast's tree phase ~0.9 ms above a held B 8's, its calibration
# 0.1 ms; its draft phase ~0.5 ms more as well (all depths drafted; forecasts follow plain
# steps, which AFTER_PLAIN_MS charges, and arrivals).
FORECAST_MS = 1.0
AFTER_PLAIN_MS = 0.5


class ClockedController(BudgetController):
    """A budget controller whose steps are charged from a table instead of timed."""

    def __init__(self, config, latency, cells_s, forecast_s, after_plain_s) -> None:
        super().__init__(config, latency, MAX_REQUESTS)
        self.cells_s, self.forecast_s, self.after_plain_s = cells_s, forecast_s, after_plain_s
        self.clock_s, self.steps, self.plain_forwards = 0.0, 0, 0
        self._last_plain = False

    def record_step(self, bs, budget, seconds, drafted=True, forecast=False, forwards=1) -> None:
        bucket = min(b for b in self.cells_s if b >= bs)
        self.clock_s += self.cells_s[bucket][BUDGETS.index(budget)] * forwards
        self.clock_s += self.forecast_s if forecast else 0.0
        self.clock_s += self.after_plain_s if budget > 0 and self._last_plain else 0.0
        self._last_plain = budget == 0
        self.steps += 1
        self.plain_forwards += forwards if budget == 0 else 0


def controller_for(policy: str, engine, cells_s, forecast_s, after_plain_s) -> BudgetController:
    """The :class:`ClockedController` of a policy string (see the module docstring); auto is
    ``step.make_controller``'s configuration for ``engine`` without its profile and
    exploration (the cells are known), with the policy's overrides."""
    name, *options = policy.split(":")
    if name == "fixed":
        budget = int(options[0])
        config = ControlConfig(budgets=(budget,), fixed_budget=budget)
        return ClockedController(config, None, cells_s, forecast_s, after_plain_s)
    try:
        fields = {"profile_steps": 0, "explore_every": 0} | step.auto_overrides(policy)
    except ValueError as error:
        raise SystemExit(f"budget_sim: {error} (or fixed:N)") from None
    buckets = tuple(sorted(cells_s))
    latency = LatencyModel([list(cells_s[b]) for b in buckets], BUDGETS, bs_buckets=buckets)
    max_depth = engine.drafter.block_size - 1
    product = step.make_controller(engine.config, max_depth, MAX_REQUESTS, "cpu", latency, fields)
    return ClockedController(product.config, latency, cells_s, forecast_s, after_plain_s)


class PolicyRun(NamedTuple):
    """One policy at one batch size: output tokens over simulated seconds."""

    policy: str
    batch_size: int
    tokens: int
    seconds: float
    steps: int
    plain_forwards: int
    budget_counts: dict[int, int]
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def simulate(engine, policy, prompts, batch_size, new_tokens, cells_s, forecast_s, after_plain_s):
    """Decode ``prompts`` ``batch_size`` at a time under ``policy``; a :class:`PolicyRun`."""
    engine.controller = controller_for(policy, engine, cells_s, forecast_s, after_plain_s)
    outputs = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        outputs += [r.tokens for r in engine.generate(batch, new_tokens, stop_token_ids=[])]
    ctl = engine.controller
    return PolicyRun(
        policy,
        batch_size,
        sum(map(len, outputs)),
        ctl.clock_s,
        ctl.steps,
        ctl.plain_forwards,
        dict(sorted(ctl.budget_counts.items())),
        outputs,
    )


def parse_cells(items: list[str] | None) -> dict[int, tuple[float, ...]]:
    """``["2:5.5,11.2,12.6,13.5,15.0", ...]`` (ms) -> {bucket: seconds per budget}."""
    if not items:
        return {b: tuple(ms / 1e3 for ms in row) for b, row in DEFAULT_CELLS_MS.items()}
    cells = {}
    for item in items:
        bucket, _, row = item.partition(":")
        values = tuple(float(ms) / 1e3 for ms in row.split(","))
        if len(values) != len(BUDGETS):
            raise SystemExit(f"budget_sim: --cells {item!r} needs {len(BUDGETS)} values {BUDGETS}")
        cells[int(bucket)] = values
    return cells


def table(runs: list[PolicyRun]) -> str:
    lines = [
        "| bs | policy | sim tok/s | x best fixed | steps | plain forwards | budgets |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for bs in sorted({r.batch_size for r in runs}):
        group = [r for r in runs if r.batch_size == bs]
        fixed = [r.tokens_per_s for r in group if r.policy.startswith("fixed")]
        best = max(fixed) if fixed else None
        for r in group:
            ratio = f"{r.tokens_per_s / best:.3f}" if best else "-"
            counts = " ".join(f"{b}:{n}" for b, n in r.budget_counts.items())
            lines.append(
                f"| {bs} | {r.policy} | {r.tokens_per_s:.1f} | {ratio} | {r.steps} | "
                f"{r.plain_forwards} | {counts} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--policies", nargs="+", default=["fixed:4", "fixed:8", "fixed:16", "fixed:32", "auto"]
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cells", nargs="+", help="BS:c0,c4,c8,c16,c32 in ms (see docstring)")
    parser.add_argument("--forecast-ms", type=float, default=FORECAST_MS)
    parser.add_argument("--after-plain-ms", type=float, default=AFTER_PLAIN_MS)
    parser.add_argument("--out", type=Path, help="JSON record (+ .md beside it)")
    args = parser.parse_args(argv)
    cells = parse_cells(args.cells)
    if max(args.batch_sizes) > max(cells):
        parser.error(f"no cells for batch size {max(args.batch_sizes)} (buckets {sorted(cells)})")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    device = torch.device("cpu")
    target, tokenizer = load_target(SMALL_PAIR_DIR / "target", device)
    drafter = load_drafter(SMALL_PAIR_DIR / "drafter", device, torch.float32)
    texts = heldout_prompts(args.prompts)
    prompts = [tokenizer.encode(t, add_special_tokens=False)[-args.prompt_tokens :] for t in texts]
    engine = SpecEngine(target, drafter, method="ddtree", budget=BUDGETS[-1], auto=True)
    runs = []
    jobs = [(bs, p) for bs in args.batch_sizes for p in args.policies]
    for bs, policy in tqdm(jobs, desc="policies", unit="run", file=sys.stderr):
        runs.append(
            simulate(engine, policy, prompts, bs, args.new_tokens, cells,
                     args.forecast_ms / 1e3, args.after_plain_ms / 1e3)
        )  # fmt: skip
    reference: dict[int, list[list[int]]] = {}
    for r in runs:
        reference.setdefault(r.batch_size, r.outputs)
    mismatches = sum(r.outputs != reference[r.batch_size] for r in runs)
    cells_ms = {b: [round(1e3 * s, 2) for s in row] for b, row in cells.items()}
    header = (
        "Simulated clock (benchmarks/budget_sim.py): real decoding of the small pair, step "
        f"times from the table {json.dumps(cells_ms)} (ms, budgets {BUDGETS}), "
        f"+{args.forecast_ms} ms per forecast step, +{args.after_plain_ms} ms per drafted step "
        f"after a plain one; {args.prompts} prompts, {args.new_tokens} new tokens, greedy; "
        f"outputs differing between policies: {mismatches}."
    )
    command = f"Command: `{command_line('benchmarks/budget_sim.py', argv)}`"
    text = "\n\n".join([header, command, table(runs)])
    print(text)
    if mismatches:
        raise SystemExit("budget_sim: policies produced different greedy outputs")
    record = {
        "environment": environment(device),
        "command": command,
        "cells_ms": cells_ms,
        "forecast_ms": args.forecast_ms,
        "after_plain_ms": args.after_plain_ms,
        "runs": [
            {k: v for k, v in r._asdict().items() if k != "outputs"}
            | {"tokens_per_s": r.tokens_per_s}
            for r in runs
        ],
    }
    if args.out:
        record = portable_record(record)
        args.out.write_text(json.dumps(record, indent=1))
        args.out.with_suffix(".md").write_text(portable(text) + "\n")
        print(f"wrote {args.out} (+ .md)")
    return record


if __name__ == "__main__":
    main()
