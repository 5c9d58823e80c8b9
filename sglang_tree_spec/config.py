"""One configuration of the draft tree, shared by the CLI, the engine, the benchmarks and the
server flags. One default per knob.

Pure Python: no torch, SGLang or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAFT_POLICIES = ("none", "stage", "unified")
# The reference engine's method names, each one TreeConfig (see TreeConfig.for_method).
METHODS = ("ar", "chain", "ddtree", "ddtree-graft-stage", "ddtree-graft-unified")
MAX_BUDGET = 1024
# The budgets budget control chooses from by default (capped at the configured budget, which is
# always a candidate). 0 is a plain decode step. On H100 / H200 the forecast
# (benchmarks/results/forecast_gpu.md) chooses each of 0-32 at some batch size 1-64; 64 it
# never chooses but stays: at bs 1 it is within 3% of 32, which a verify price fitted on
# another target and device cannot settle.
DEFAULT_BUDGETS: tuple[int, ...] = (0, 4, 8, 16, 32, 64)


def candidate_budgets(max_budget: int, base: tuple[int, ...] = DEFAULT_BUDGETS) -> tuple[int, ...]:
    """The sorted candidate set: ``base`` capped at ``max_budget``, plus ``max_budget`` itself.

    Budget 0 is a plain decode step (only the bonus token; expected committed tokens = 1); budget
    1 is the single most probable depth-1 node. ``max_budget`` (the largest tree the server
    reserves KV for) is always a candidate so a configured budget stays reachable.
    """
    if max_budget < 0 or any(b < 0 for b in base):
        raise ValueError(f"budgets must be >= 0, got max {max_budget} and {base}")
    return tuple(sorted({b for b in base if b <= max_budget} | {max_budget}))


@dataclass(frozen=True)
class TreeConfig:
    """What a decode step drafts and verifies.

    Attributes:
        budget: B, draft nodes per request and step (the verify window is B + 1: the root, the
            last bonus token, comes first). 0 drafts nothing: plain decoding, one token a step.
            With ``auto``, the largest budget the controller may choose.
        auto: choose each step's budget for the whole batch from the predicted accepted
            tokens per second (:mod:`sglang_tree_spec.control`) among ``candidates``.
        topk: K, tokens per drafted depth. ``None`` (the default) is the budget, which makes
            the tree exactly the budget's most probable prefixes; a smaller K is an
            approximation that trims the drafter's top-K.
        graft: ``"none"``, ``"stage"`` (Graft's prune-then-graft rule) or ``"unified"`` (one
            best-first choice over drafted and retrieved nodes).
        chain: the DFlash chain: the top-1 token at every drafted depth (L nodes, no tree).
        table_k: successors per token in Graft's shared table.
        table_partitions: independent partitions of Graft's table (tenant isolation: each
            request reads and writes its own; 1: one table shared by every request).
    """

    budget: int = 64
    topk: int | None = None
    graft: str = "none"
    chain: bool = False
    table_k: int = 8
    table_partitions: int = 1
    auto: bool = False
    candidates: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be an int in [0, {MAX_BUDGET}], got {self.budget!r}")
        if self.topk is not None and (not isinstance(self.topk, int) or self.topk < 1):
            raise ValueError(f"topk must be an int >= 1, got {self.topk!r}")
        if self.graft not in GRAFT_POLICIES:
            raise ValueError(f"graft must be one of {GRAFT_POLICIES}, got {self.graft!r}")
        if self.chain and self.graft != "none":
            raise ValueError("the chain drafts one path: it takes no grafting")
        if self.auto and self.chain:
            raise ValueError("the chain has one shape: it takes no budget control")
        if self.candidates is not None and (
            list(self.candidates) != sorted(set(self.candidates))
            or not 0 <= self.candidates[0]
            or self.candidates[-1] > self.budget
        ):
            raise ValueError(
                f"candidates must be sorted, distinct, in [0, budget={self.budget}]: "
                f"{self.candidates}"
            )
        if self.table_k < 1:
            raise ValueError(f"table_k must be >= 1, got {self.table_k}")
        if not isinstance(self.table_partitions, int) or self.table_partitions < 1:
            raise ValueError(f"table_partitions must be an int >= 1, got {self.table_partitions!r}")

    @property
    def k(self) -> int:
        """Tokens per drafted depth the drafter's top-K must give."""
        if self.chain:
            return 1
        return self.topk if self.topk is not None else max(self.budget, 1)

    @property
    def drafts(self) -> bool:
        """Whether a step may run the drafter at all."""
        return self.chain or self.budget > 0

    @property
    def budgets(self) -> tuple[int, ...]:
        """The budgets a step may take: the candidates under ``auto`` (by default 0, 4, 8,
        16, 32, 64 up to the budget, and the budget), else the budget alone."""
        if not self.auto:
            return (self.budget,)
        if self.candidates is not None:
            return self.candidates
        return candidate_budgets(self.budget)

    @property
    def method(self) -> str:
        """The reference engine's name for this configuration."""
        if self.chain:
            return "chain"
        if self.budget == 0:
            return "ar"
        return "ddtree" if self.graft == "none" else f"ddtree-graft-{self.graft}"

    @classmethod
    def for_method(
        cls, method: str, budget: int = 64, topk: int | None = None, auto: bool = False
    ) -> TreeConfig:
        """The configuration of one of :data:`METHODS` (``ar``: budget 0); ``auto`` chooses
        the budget each step up to ``budget``."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "ar":
            return cls(budget=0)
        if method == "chain":
            return cls(budget=budget, chain=True)
        graft = method.removeprefix("ddtree-graft-") if method != "ddtree" else "none"
        return cls(budget=budget, topk=topk, graft=graft, auto=auto)
