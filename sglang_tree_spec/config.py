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


@dataclass(frozen=True)
class TreeConfig:
    """What a decode step drafts and verifies.

    Attributes:
        budget: B, draft nodes per request and step (the verify window is B + 1: the root, the
            last bonus token, comes first). 0 drafts nothing: plain decoding, one token a step.
        topk: K, tokens per drafted depth. ``None`` (the default) is the budget, which makes
            the tree exactly the budget's most probable prefixes; a smaller K is an
            approximation that trims the drafter's top-K.
        graft: ``"none"``, ``"stage"`` (Graft's prune-then-graft rule) or ``"unified"`` (one
            best-first choice over drafted and retrieved nodes).
        chain: the DFlash chain: the top-1 token at every drafted depth (L nodes, no tree).
        table_k: successors per token in Graft's shared table.
    """

    budget: int = 64
    topk: int | None = None
    graft: str = "none"
    chain: bool = False
    table_k: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be an int in [0, {MAX_BUDGET}], got {self.budget!r}")
        if self.topk is not None and (not isinstance(self.topk, int) or self.topk < 1):
            raise ValueError(f"topk must be an int >= 1, got {self.topk!r}")
        if self.graft not in GRAFT_POLICIES:
            raise ValueError(f"graft must be one of {GRAFT_POLICIES}, got {self.graft!r}")
        if self.chain and self.graft != "none":
            raise ValueError("the chain drafts one path: it takes no grafting")
        if self.table_k < 1:
            raise ValueError(f"table_k must be >= 1, got {self.table_k}")

    @property
    def k(self) -> int:
        """Tokens per drafted depth the drafter's top-K must give."""
        if self.chain:
            return 1
        return self.topk if self.topk is not None else max(self.budget, 1)

    @property
    def drafts(self) -> bool:
        """Whether a step runs the drafter at all."""
        return self.chain or self.budget > 0

    @property
    def method(self) -> str:
        """The reference engine's name for this configuration."""
        if self.chain:
            return "chain"
        if self.budget == 0:
            return "ar"
        return "ddtree" if self.graft == "none" else f"ddtree-graft-{self.graft}"

    @classmethod
    def for_method(cls, method: str, budget: int = 64, topk: int | None = None) -> TreeConfig:
        """The configuration of one of :data:`METHODS` (``ar``: budget 0)."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "ar":
            return cls(budget=0)
        if method == "chain":
            return cls(budget=budget, chain=True)
        graft = method.removeprefix("ddtree-graft-") if method != "ddtree" else "none"
        return cls(budget=budget, topk=topk, graft=graft)
