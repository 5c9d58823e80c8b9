"""Admission checks the plugin adds to every request its server sees, speculative or not.

Each refuses, with an HTTP 400, a request that would otherwise kill the scheduler (and every
user of the server would lose service):

* SGLang passes a request's ``input_ids`` to the scheduler unchecked: one id outside the
  vocabulary (or a negative one) indexes past the embedding, an ``IndexError`` on CPU (a
  device-side assert on GPU).
* SGLang refuses a prompt of no tokens only where it sees one before tokenizing: an empty
  ``input_ids`` list, an empty OpenAI ``prompt`` and, on 0.5.17, an empty ``text``. A ``text``
  that tokenizes to nothing (``""`` on 0.5.23, which no longer refuses it before tokenizing;
  spaces under a whitespace-splitting tokenizer) or an empty prompt inside a batch reaches the
  prefill with zero tokens. Alone in its batch it kills the scheduler (the last-token index of
  an empty extend is out of bounds); batched with others it is answered from another prompt's
  last hidden state.
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


EMPTY_PROMPT = "Prompt cannot be empty: it has no tokens."
"""The refusal of a prompt of no tokens (SGLang's wording for an empty OpenAI prompt, with why)."""


def refuse_empty_prompts(_manager: Any, obj: Any, input_ids: Any) -> None:
    """BEFORE hook on ``TokenizerManager._validate_one_request`` (called for every request, and
    for each one of a batch, with its tokens after tokenization and multimodal expansion): a
    prompt of no tokens is refused with a ``ValueError``, the client's HTTP 400. Requests whose
    prompt is not their token ids (``input_embeds``, multimodal inputs, whose processor may supply
    the ids) are left to SGLang. Mirrored by
    ``patches/sglang-<release>/0016-tokenizer-manager-refuses-empty-prompts.diff``.
    """
    if input_ids is None or len(input_ids) > 0:
        return
    if obj.input_embeds is not None or obj.contains_mm_input():
        return
    raise ValueError(EMPTY_PROMPT)
