"""Graft: a shared successor table, grafted into DDTree trees at a fixed budget.

Pure torch, batched, no SGLang or transformers imports. :class:`SuccessorTable` is refreshed
from the target's verify logits; :func:`graft_stage` (Graft's prune-then-graft rule) and
:func:`graft_unified` (one best-first choice over draft and retrieved nodes) rewrite a DDTree's
slots without changing its shape; :class:`EdgeAcceptance` learns the unified policy's edge
probabilities online; :class:`Grafter` carries one method's state across decode steps.
:class:`TablePartitions` gives each isolation key (a tenant) its own partition of that state.
"""

from sglang_tree_spec.graft.edges import EdgeAcceptance, edge_evidence, evidence_classes
from sglang_tree_spec.graft.grafter import GRAFT_METHODS, Grafter
from sglang_tree_spec.graft.partitions import TablePartitions
from sglang_tree_spec.graft.policies import (
    StageConfig,
    calibrate_stage,
    graft_stage,
    graft_unified,
    stage_confidences,
)
from sglang_tree_spec.graft.table import NO_PARTITION, UNKNOWN, SuccessorTable
from sglang_tree_spec.graft.template import (
    DEFAULT_RANK_PRIOR,
    RankTemplate,
    rank_template,
)

__all__ = [
    "DEFAULT_RANK_PRIOR",
    "GRAFT_METHODS",
    "NO_PARTITION",
    "UNKNOWN",
    "EdgeAcceptance",
    "Grafter",
    "RankTemplate",
    "StageConfig",
    "SuccessorTable",
    "TablePartitions",
    "calibrate_stage",
    "edge_evidence",
    "evidence_classes",
    "graft_stage",
    "graft_unified",
    "rank_template",
    "stage_confidences",
]
