"""Penalties and ``min_new_tokens`` of a scheduled decode batch, for the tree verify.

SGLang's DFlash-family decode never feeds accepted tokens to its penalizers, and its forward
copy of the sampling info carries no orchestrator. The DDTREE worker therefore reads each
request's state from the request itself: its committed output tokens (``req.output_ids``, the
last bonus included: SGLang's penalizers count output tokens only, never the prompt), its
penalty parameters and its stop tokens (the set SGLang's ``min_new_tokens`` penalizer masks),
and :func:`sglang_tree_spec.tree.penalties.penalize_tree_logits` penalises every verify slot
by its own path.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.pending import RecentOutputs
from sglang_tree_spec.tree.penalties import TreePenalties


def penalised(params: Any) -> bool:
    """Whether a request's ``SamplingParams`` set a penalty or ``min_new_tokens``."""
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_new_tokens > 0
    )


def stop_tokens(req: Any) -> list[int]:
    """The tokens SGLang's ``min_new_tokens`` penalizer masks for ``req``: its
    ``stop_token_ids``, the tokenizer's additional stop ids and EOS, and (0.5.23) the
    request's ``eos_token_ids``."""
    stops = set(req.sampling_params.stop_token_ids or ())
    tokenizer = getattr(req, "tokenizer", None)
    if tokenizer is not None:
        stops |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
    if not compat.is_release("0.5.17"):
        stops |= set(getattr(req, "eos_token_ids", None) or ())
    return sorted(token for token in stops if token is not None)


def batch_penalties(
    reqs: list[Any],
    vocab_size: int,
    device: torch.device | str,
    recent: RecentOutputs | None = None,
    rows: torch.Tensor | None = None,
) -> TreePenalties | None:
    """The :class:`TreePenalties` of a decode batch's requests, or None when none is
    penalised (the verify logits are then left exactly as they were).

    ``recent`` (the worker's :class:`~.pending.RecentOutputs`, with the batch's request
    ``rows``) adds the output tokens SGLang has not appended to ``req.output_ids`` yet (overlap
    scheduling: the previous step's result is processed after this step starts)."""
    params = [req.sampling_params for req in reqs]
    if not any(penalised(p) for p in params):
        return None
    outputs = [list(req.output_ids) for req in reqs]
    state = TreePenalties.from_outputs(
        outputs,
        [p.frequency_penalty for p in params],
        [p.presence_penalty for p in params],
        [p.repetition_penalty for p in params],
        [p.min_new_tokens for p in params],
        [stop_tokens(req) for req in reqs],
        vocab_size,
        device,
    )
    if recent is None:
        return state
    return state.with_missing(*recent.missing(rows, [len(out) for out in outputs]))
