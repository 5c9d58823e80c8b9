"""Pure-torch tree speculative decoding core: DDTree selection, verify layout, acceptance, and
the draft top-K of a vocabulary-parallel LM head.

Device-agnostic, batched, fixed-shape and free of host synchronisation on the hot path; no
SGLang or transformers imports.
"""

from sglang_tree_spec.tree.accept import (
    AcceptResult,
    counter_uniforms,
    greedy_accept,
    sample_accept,
    sample_tokens,
    target_probs,
)
from sglang_tree_spec.tree.ddtree import (
    DraftTree,
    build_chain,
    build_ddtree,
    build_ddtree_reference,
    topk_from_logits,
)
from sglang_tree_spec.tree.layout import (
    EagleRetrieve,
    VerifyLayout,
    ancestor_mask,
    build_verify_layout,
    eagle_retrieve_arrays,
    full_mask_indptr,
    write_full_mask,
)
from sglang_tree_spec.tree.vocab_parallel import vocab_parallel_topk

__all__ = [
    "AcceptResult",
    "DraftTree",
    "EagleRetrieve",
    "VerifyLayout",
    "ancestor_mask",
    "build_chain",
    "build_ddtree",
    "build_ddtree_reference",
    "build_verify_layout",
    "counter_uniforms",
    "eagle_retrieve_arrays",
    "full_mask_indptr",
    "greedy_accept",
    "sample_accept",
    "sample_tokens",
    "target_probs",
    "topk_from_logits",
    "vocab_parallel_topk",
    "write_full_mask",
]
