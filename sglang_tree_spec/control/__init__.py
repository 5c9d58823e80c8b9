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
  several); once a step's forecast chooses 0 and the
  drafted steps' decayed averages (every drafted step's committed tokens per request against
  its cost in plain forwards; a recent and a long-run one) say drafting does not pay either,
  the steps skip drafting and re-draft to re-forecast after ``probe_every`` steps, the interval
  doubling (up to ``probe_max_every``) while drafting still does not pay.

Per step (``rows``: ``[bs]`` int64 request slots, e.g. SGLang's ``req_pool_indices``)::

    ctl = BudgetController(
        ControlConfig(budgets=candidate_budgets(max_budget), max_depth=block - 1),
        LatencyModel.from_roofline(target_shape, DEVICES["h100"], budgets, drafter=..., block=...),
        max_slots=pool_size, device=device)            # ControlConfig(fixed_budget=32): fixed
    ctl.reset(new_rows)                                  # a request arrived in these slots
    t0 = time.perf_counter()
    drafted = ctl.should_draft(bs)                       # host, no sync
    held = ctl.held_budget(bs) if drafted else None      # fixed, or a held auto choice
    if held is not None:                                 # as a fixed budget: no forecast
        fc, n, tree_n = None, held, build_ddtree(lp, tok, held)
    elif drafted:
        tree = build_ddtree(lp, tok, ctl.tree_budget(bs))  # [bs, width]: draft that deep
        fc = ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid)   # sync-free
        n = ctl.choose(fc, bs)                           # host int: THE one host read
        tree_n = top_nodes(tree, n, fc.slots) if n > 0 else None  # the optimal n-tree
    else:
        fc, n = None, ctl.choose(None, bs)               # 0: plain decode step
    ... verify tree_n (or the bonus token alone), accept -> result.accept_len [bs] ...
    if fc is not None:                                   # sync-free calibration update, on
        ctl.observe(fc, n, result.accept_len)            # the drafted steps' stride
    elif held:                                           # the DDTree at n, no ranking
        ctl.observe_committed(n, result.accept_len)      # sync-free: the drafting-pays sums
        ctl.observe_held(rows, tree_n.logprobs, tree_n.depths, tree_n.valid, result.accept_len)
    ... the step's own end-of-step sync (committing tokens) ...
    ctl.record_step(bs, n, time.perf_counter() - t0, drafted, fc is not None)  # host
    ctl.stats()                                          # every K steps, for logs / metrics

Fixed mode (``ControlConfig(fixed_budget=N)``) goes through the same calls, returns N from
``held_budget`` (or 0 from ``choose`` when N = 0) with no host read, and needs no latency model.
Auto's choice holds for ``hold_steps`` drafted steps of the same batch (``held_budget``).
"""

from sglang_tree_spec.control.calibration import AcceptCalibrator, CalibrationConfig
from sglang_tree_spec.control.controller import (
    REASONS,
    BudgetController,
    ControlConfig,
    ControlStats,
    Forecast,
    best_budget,
)
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
)
from sglang_tree_spec.control.surrogate import (
    DEFAULT_BUDGETS,
    RankedNodes,
    candidate_budgets,
    expected_accept,
    prefix_sums_at,
    rank_nodes,
    top_nodes,
)

__all__ = [
    "DEFAULT_BS_BUCKETS",
    "DEFAULT_BUDGETS",
    "DEVICES",
    "MODEL_SHAPES",
    "REASONS",
    "AcceptCalibrator",
    "BudgetController",
    "CalibrationConfig",
    "ControlConfig",
    "ControlStats",
    "DeviceSpec",
    "Forecast",
    "LatencyConfig",
    "LatencyModel",
    "ModelShape",
    "RankedNodes",
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
]
