"""Drafters that propose tokens for tree speculative decoding."""

from sglang_tree_spec.drafters.dflash import (
    DFlashContextCache,
    DFlashDrafter,
    DrafterConfigError,
    build_target_layer_ids,
    pad_features,
    select_target_features,
)

__all__ = [
    "DFlashContextCache",
    "DFlashDrafter",
    "DrafterConfigError",
    "build_target_layer_ids",
    "pad_features",
    "select_target_features",
]
