"""Reference engine on PyTorch + transformers: the oracle and the CPU path."""

from sglang_tree_spec.engine.spec_engine import (
    GRAFT_METHODS,
    METHODS,
    GenerationResult,
    RequestStats,
    SpecEngine,
)

__all__ = ["GRAFT_METHODS", "METHODS", "GenerationResult", "RequestStats", "SpecEngine"]
