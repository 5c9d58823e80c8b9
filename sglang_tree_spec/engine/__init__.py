"""Reference engine on PyTorch + transformers: the oracle and the CPU path."""

from sglang_tree_spec.config import METHODS
from sglang_tree_spec.engine.spec_engine import GenerationResult, RequestStats, SpecEngine

__all__ = ["METHODS", "GenerationResult", "RequestStats", "SpecEngine"]
