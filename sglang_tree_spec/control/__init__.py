"""Budget control: the batch's tree size chosen from predicted accepted tokens per second.

Pure torch (imports only torch and :mod:`sglang_tree_spec.tree`). One choice per step for the
whole batch, over a fixed sorted set of candidate budgets (each (bs bucket, N) is one fixed
shape): N* = argmax_N sum_i (1 + A_i(N)) / C(bs, N), ties toward the smaller N.

* Surrogate (:mod:`.surrogate`): A_i(N) from ONE DDTree built at ``tree_budget`` (the
  largest candidate): the first N nodes by score are the optimal N-tree (nesting), and its
  expected accepted length is the sum of their path probabilities; one sort + cumsum + gather
  gives ``[bs, C]``. The choice reads each request's decayed average of its forecasts
  (``ControlConfig.choice_decay``): one step's prediction is noisy, and the choice holds for
  several steps.
* Calibration (:mod:`.calibration`): per-depth (pooled) and per-request (slot-indexed) ratio
  estimators rescale the surrogate toward the observed accepted lengths of EVERY drafted step
  (forecast or held: forecast steps alone are the hard ones, and would calibrate low).
* Latency (:mod:`.latency`): C(bs, N) = per-cell log costs, each set by its cell's first
  times and then moved by switches between cells (two consecutive steps: one speed of the
  machine), read back times the machine's load now (so cells measured at different speeds of
  the machine compare as budgets), else the column's measured
  neighbouring batch sizes, else a roofline prior under an online linear calibration; host
  floats, ``record(bs, N, seconds)``.
* Budget 0 is a plain decode step (no drafter; C(bs, 0) is per target forward, a step may run
  several).
* Policies (:mod:`.policies`): the start-up profile, plain runs probed at growing intervals,
  explorations of stale cells and holds of a choice, each a small object behind one protocol;
  their shipped values are one table (:mod:`.presets`) read by :class:`ControlConfig`.

Per step (``rows``: ``[bs]`` int64 request slots, e.g. SGLang's ``req_pool_indices``), the
decode step's three calls (:func:`sglang_tree_spec.step.decode_step`)::

    ctl = BudgetController(
        ControlConfig(budgets=candidate_budgets(max_budget), max_depth=block - 1),
        LatencyModel.from_roofline(target_shape, DEVICES["h100"], budgets, drafter=..., block=...),
        max_slots=pool_size, device=device)            # ControlConfig(fixed_budget=32): fixed
    ctl.reset(new_rows)                                  # a request arrived in these slots
    t0 = time.perf_counter()
    plan = ctl.plan(bs)                                  # host, no sync
    if plan.forecasts:                                   # draft plan.width deep; one tree
        tree = build_ddtree(lp, tok, plan.width)         # [bs, width]
        forecast = ctl.resolve(plan, rows, tree)         # THE one host read
        n, tree_n = forecast.budget, top_nodes(tree, forecast.budget, forecast.slots)
    elif plan.draft:                                     # fixed, or a held auto choice
        forecast, n, tree_n = None, plan.budget, build_ddtree(lp, tok, plan.budget)
    ... verify tree_n (or plain forwards), accept -> result.accept_len [bs] ...
    ctl.outcome(StepOutcome(plan, rows, n, tree_n, result.accept_len, forecast, 1, True), t0)
    ctl.stats()                                          # every K steps, for logs / metrics

Fixed mode (``ControlConfig(fixed_budget=N)``) goes through the same calls with no host read
and needs no latency model.
"""

from sglang_tree_spec.control.calibration import AcceptCalibrator, CalibrationConfig
from sglang_tree_spec.control.config import REASONS, ControlConfig
from sglang_tree_spec.control.controller import BudgetController, best_budget
from sglang_tree_spec.control.latency import (
    DEFAULT_BS_BUCKETS,
    DEVICES,
    MODEL_SHAPES,
    DeviceSpec,
    LatencyConfig,
    LatencyModel,
    ModelShape,
    dflash_drafter,
    forward_seconds,
    isotonic,
    layer_params,
    roofline_step_seconds,
    verify_seconds,
)
from sglang_tree_spec.control.plan import Forecast, StepOutcome, StepPlan
from sglang_tree_spec.control.policies import Explorations, Holds, PlainRuns, Policy, Profile
from sglang_tree_spec.control.presets import AUTO, PLAIN_FORWARDS
from sglang_tree_spec.control.surrogate import (
    DEFAULT_BUDGETS,
    RankedNodes,
    candidate_budgets,
    expected_accept,
    prefix_sums_at,
    rank_nodes,
    top_nodes,
)
from sglang_tree_spec.control.totals import ControlStats

__all__ = [
    "AUTO",
    "DEFAULT_BS_BUCKETS",
    "DEFAULT_BUDGETS",
    "DEVICES",
    "MODEL_SHAPES",
    "PLAIN_FORWARDS",
    "REASONS",
    "AcceptCalibrator",
    "BudgetController",
    "CalibrationConfig",
    "ControlConfig",
    "ControlStats",
    "DeviceSpec",
    "Explorations",
    "Forecast",
    "Holds",
    "LatencyConfig",
    "LatencyModel",
    "ModelShape",
    "PlainRuns",
    "Policy",
    "Profile",
    "RankedNodes",
    "StepOutcome",
    "StepPlan",
    "best_budget",
    "candidate_budgets",
    "dflash_drafter",
    "expected_accept",
    "forward_seconds",
    "isotonic",
    "layer_params",
    "prefix_sums_at",
    "rank_nodes",
    "roofline_step_seconds",
    "top_nodes",
    "verify_seconds",
]
