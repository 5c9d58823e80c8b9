"""sglang-tree-spec: tree speculative decoding (DDTree, Graft, batch-aware budgets) for SGLang."""

__version__ = "0.1.0"
