"""Admission checks the plugin adds to every request its server sees, speculative or not.

SGLang 0.5.17 passes a request's ``input_ids`` to the scheduler unchecked: one id outside the
vocabulary (or a negative one) indexes past the embedding, an ``IndexError`` that kills the
scheduler on CPU (a device-side assert on GPU), and every user of the server loses service.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def input_id_error(input_ids: Sequence[int], vocab_size: int) -> str | None:
    """Why ``input_ids`` cannot index an embedding of ``vocab_size`` rows (the first bad id,
    its position and the valid range), or None."""
    for position, token in enumerate(input_ids):
        if not 0 <= token < vocab_size:
            return (
                f"input id {token} at position {position} is not in the vocabulary: "
                f"valid token ids are [0, {vocab_size})"
            )
    return None


def refuse_out_of_vocab_input_ids(manager: Any, obj: Any, input_ids: Any) -> None:
    """BEFORE hook on ``TokenizerManager._validate_one_request`` (called for every request, and
    for each one of a batch, before it is sent to the scheduler): a ``ValueError`` there is the
    client's HTTP 400. Ids that only stand in for embeddings (``input_embeds``, multimodal
    placeholders) are not looked up and not checked. Mirrored by
    ``patches/sglang-0.5.17/0014-tokenizer-manager-refuses-out-of-vocab-input-ids.diff``.
    """
    if not input_ids or obj.input_embeds is not None or obj.contains_mm_input():
        return
    error = input_id_error(input_ids, manager.model_config.vocab_size)
    if error is not None:
        raise ValueError(error)
