"""Shared by the budget-control tests: trees of a strong or a useless drafter, controllers."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tree_spec.control import (
    DEVICES,
    MODEL_SHAPES,
    BudgetController,
    ControlConfig,
    LatencyModel,
    dflash_drafter,
)
from sglang_tree_spec.tree import build_ddtree

# Every mechanism around the objective off (ControlConfig's defaults are the shipped auto
# values): each test switches on the ones it checks.
NEUTRAL = {
    "profile_steps": 0,
    "explore_every": 0,
    "explore_steps": 1,
    "explore_margin": 1.0,
    "explore_inverted": None,
    "explore_stale_neighbours": False,
    "forget_after": None,
    "hold_steps": 1,
    "hold_max_steps": None,
    "tie_rtol": 1e-6,
    "choice_decay": 0.0,
    "hard_plain_steps": 0,
    "plain_long_decay": None,
    "held_observe_every": 1,
}


def neutral(**fields) -> ControlConfig:
    """A control config with the mechanisms off but for ``fields``."""
    return ControlConfig(**(NEUTRAL | fields))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread (two spin-waiting threads on a loaded CPU cost 5x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FLAT_64 = LatencyModel([[0.01] * 6] * 3, (0, 4, 8, 16, 32, 64), bs_buckets=(1, 8, 64))


def strong_or_useless_tree(bs: int, strong: bool, budget: int = 64):
    """A 15-deep tree: two likely tokens per position (0.6 and 0.39, so every added node still
    adds), or probabilities ~1e-9."""
    depth, k = 15, 8
    lp = torch.full((bs, depth, k), -30.0)
    lp[..., 0] = math.log(0.6) if strong else -20.0
    lp[..., 1] = math.log(0.39) if strong else -21.0
    lp[..., 2:] -= torch.arange(2, k).float()  # sorted descending
    tok = torch.arange(k).expand(bs, depth, k)
    return build_ddtree(lp, tok, budget)


def roofline_controller(budgets=(0, 4, 8, 16, 32, 64), **kwargs):
    latency = LatencyModel.from_roofline(
        MODEL_SHAPES["qwen3-8b"],
        DEVICES["h100"],
        budgets,
        drafter=dflash_drafter(MODEL_SHAPES["qwen3-8b"], 5),
        block=16,
    )
    return BudgetController(neutral(budgets=budgets, **kwargs), latency, max_slots=64)


def step_budget(ctl: BudgetController, bs: int, fc) -> tuple[int, bool]:
    """One step's budget as ``decode_step`` asks for it: plain, given without a forecast
    (fixed, profiled, explored, held) or chosen from ``fc``; and whether the step drafted."""
    if not ctl.should_draft(bs):
        return ctl.choose(None, bs), False
    held = ctl.held_budget(bs)
    return (held if held is not None else ctl.choose(fc, bs)), True
