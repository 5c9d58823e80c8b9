"""How much can choosing the budget per step gain over the best fixed budget? An offline bound.

The reference engine decodes the small pair's held-out prompts with every step verifying the
largest candidate tree (B 32) and forecasting every step (the product's calibration, fed as if
``--calibrate-at`` had been verified). From each step's verified path and its nodes' ranks the
TRUE accepted length at every candidate N is read off (the N-tree is the top-N nodes by rank,
prefix-closed), beside the PREDICTED one. Steps are then charged from a table of step times
(``budget_sim``'s cells; a plain step is two target forwards committing two tokens a request)
and policies are compared on the same recorded steps (steps treated as independent: a policy's
different commit lengths would shift later steps, which this ignores):

* ``fixed N``: every step at N;
* ``surrogate``: each step at the argmax of (1 + predicted) / C (the product's rule), with plain
  steps allowed, and among drafted budgets only;
* ``... one step late``: the same choice made on the previous step's forecast, which is what a
  real controller can do for plain steps (deciding to skip the drafter needs no draft);
* ``oracle``: each step at the argmax of true tokens - lambda * C over lambda (the best
  per-step choice knowing the truth).

    python benchmarks/choice_headroom.py --batch-sizes 1 2 4 --prompts 32
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
from budget_sim import BUDGETS, parse_cells
from tqdm import tqdm

import sglang_tree_spec.engine.spec_engine as spec_engine
from sglang_tree_spec import step
from sglang_tree_spec.control import BudgetController, LatencyModel
from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target
from sglang_tree_spec.engine.spec_engine import MAX_REQUESTS
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts


class VerifyLargest(BudgetController):
    """Forecasts every step, verifies the largest candidate, and keeps the forecast."""

    def should_draft(self, bs: int) -> bool:
        return True

    def held_budget(self, bs: int) -> int | None:
        return None

    def tree_budget(self, bs: int) -> int:
        return self.config.budgets[-1]

    def choose(self, forecast, bs: int) -> int:
        return self.config.budgets[-1]

    def observe(self, forecast, budget, accept_len, sampled=True) -> None:
        self.last_forecast = forecast


def record_steps(engine, prompts, batch_size, new_tokens, calibrate_at):
    """Per step: ``[C]`` predicted and true committed tokens summed over the batch."""
    ctl = engine.controller
    column = BUDGETS.index(calibrate_at)
    steps = []
    decode_step = step.decode_step

    def recorded(*args, **kwargs):
        result = decode_step(*args, **kwargs)
        forecast = ctl.last_forecast
        slots = result.accept.accepted_slots[:, 1:]  # [bs, L] the path's window slots, -1 after
        n = forecast.slots.shape[1]
        order = torch.arange(n).expand_as(forecast.slots)
        rank = torch.empty_like(forecast.slots).scatter_(1, forecast.slots, order)  # slot -> rank
        ranks = torch.where(slots > 0, rank.gather(1, (slots - 1).clamp(0, n - 1)), n + 1)
        true = torch.stack([(ranks < b).sum(1) for b in BUDGETS], 1).float()  # [bs, C]
        assert (true[:, -1] == result.accept.accept_len).all()
        BudgetController.observe(ctl, forecast, calibrate_at, true[:, column].long(), False)
        bs = true.shape[0]
        predicted, true = forecast.accept.sum(0) + bs, true.sum(0) + bs
        predicted[0] = true[0] = 2.0 * bs  # a plain step: two forwards, two tokens a request
        steps.append((predicted, true))
        return result

    spec_engine.decode_step = recorded
    try:
        for start in range(0, len(prompts), batch_size):
            engine.generate(prompts[start : start + batch_size], new_tokens, stop_token_ids=[])
    finally:
        spec_engine.decode_step = decode_step
    steps = steps[len(steps) // 5 :]  # the calibration's warm-up
    return torch.stack([p for p, _ in steps]), torch.stack([t for _, t in steps])  # [S, C]


def policies(predicted, true, cost) -> dict[str, float]:
    """Tokens per second of each policy over the recorded steps, over the best fixed one's."""

    def rate(choice: torch.Tensor) -> float:
        return (true[torch.arange(len(choice)), choice].sum() / cost[choice].sum()).item()

    def late(choice: torch.Tensor) -> torch.Tensor:
        return torch.cat([choice[:1], choice[:-1]])

    fixed = {f"fixed {b}": rate(torch.full((len(true),), i)) for i, b in enumerate(BUDGETS)}
    best = max(fixed.values())
    pick = (predicted / cost).argmax(1)
    drafted = (predicted[:, 1:] / cost[1:]).argmax(1) + 1
    lambdas = torch.linspace(0.0, 4.0 * best, 401).tolist()
    rates = fixed | {
        "surrogate": rate(pick),
        "surrogate, drafted only": rate(drafted),
        "surrogate, one step late": rate(late(pick)),
        "surrogate, drafted only, one step late": rate(late(drafted)),
        "oracle": max(rate((true - lam * cost).argmax(1)) for lam in lambdas),
        "oracle, drafted only": max(
            rate((true[:, 1:] - lam * cost[1:]).argmax(1) + 1) for lam in lambdas
        ),
    }
    return {name: r / best for name, r in rates.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calibrate-at", type=int, default=16, choices=BUDGETS[1:])
    parser.add_argument("--cells", nargs="+", help="BS:c0,c4,c8,c16,c32 in ms (budget_sim's)")
    args = parser.parse_args(argv)
    cells = parse_cells(args.cells)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    target, tokenizer = load_target(SMALL_PAIR_DIR / "target", "cpu")
    drafter = load_drafter(SMALL_PAIR_DIR / "drafter", "cpu", torch.float32)
    texts = heldout_prompts(args.prompts)
    prompts = [tokenizer.encode(t, add_special_tokens=False)[-args.prompt_tokens :] for t in texts]
    engine = SpecEngine(target, drafter, method="ddtree", budget=BUDGETS[-1], auto=True)
    flat = LatencyModel([[1.0] * len(BUDGETS)], BUDGETS, bs_buckets=(MAX_REQUESTS,))
    max_depth = drafter.block_size - 1
    product = step.make_controller(engine.config, max_depth, MAX_REQUESTS, "cpu", flat)
    config = dataclasses.replace(product.config, profile_steps=0, explore_every=0, hold_steps=1)
    cells_ms = {b: [round(1e3 * s, 2) for s in row] for b, row in cells.items()}
    lines = [
        f"Per-step budget choice against the best fixed budget (small pair, {args.prompts} "
        f"prompts x {args.new_tokens} tokens, calibrated at B {args.calibrate_at}; step times "
        f"(ms, budgets {BUDGETS}, budget 0 per forward) {cells_ms})",
        "",
        "| bs | steps | policy | x best fixed |",
        "|---:|---:|---|---:|",
    ]
    for bs in tqdm(args.batch_sizes, desc="batch sizes", file=sys.stderr):
        engine.controller = VerifyLargest(config, flat, MAX_REQUESTS)
        predicted, true = record_steps(engine, prompts, bs, args.new_tokens, args.calibrate_at)
        cost = torch.tensor(cells[min(b for b in cells if b >= bs)]) * 1e3  # ms
        cost[0] *= 2.0  # a plain step's two forwards
        for name, ratio in policies(predicted, true, cost).items():
            lines.append(f"| {bs} | {len(true)} | {name} | {ratio:.3f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
