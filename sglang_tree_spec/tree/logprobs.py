"""Log-probs of the committed tokens, read from the verify logits.

The token committed at depth ``j + 1`` of a step (an accepted draft or the bonus) is what the
target predicts at the ``j``-th slot of the accepted path, so its log-prob under the target
is read from that slot's verify logits: the same logits (after the same adjustments) a decode
step without speculation would sample it from. Pure torch, batched, no host synchronisation.
"""

from __future__ import annotations

import torch


def path_logprobs(
    logits: torch.Tensor,
    accepted_slots: torch.Tensor,
    temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[bs, P, V]`` the target's log-probs at the slots that predicted the committed tokens.

    As SGLang's sampler returns them: ``log_softmax(logits)`` for an all-greedy batch (the
    target's distribution before any temperature), else ``log(softmax(logits / temperature))``
    (temperature 1 on greedy rows); ``-inf`` clamped to the dtype's lowest finite value.

    Args:
        logits: ``[bs, W, V]`` verify logits (after the target's logit adjustments).
        accepted_slots: ``[bs, P]`` window slots of the accepted path, root first, -1 past it
            (rows past the path read slot 0 and are never committed).
        temperature: ``[bs]`` per-request temperatures, or None for an all-greedy batch.
    """
    bs, _, vocab = logits.shape
    slots = accepted_slots.clamp_min(0)
    rows = logits.gather(1, slots[:, :, None].expand(bs, slots.shape[1], vocab)).float()
    if temperature is None:
        logprobs = torch.log_softmax(rows, dim=-1)
    else:
        logprobs = torch.log(torch.softmax(rows / temperature.view(bs, 1, 1).float(), dim=-1))
    return logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[bs, P]`` log-prob of ``tokens [bs, P]`` (-1 padding reads token 0) in ``[bs, P, V]``."""
    return logprobs.gather(2, tokens.clamp_min(0).unsqueeze(2)).squeeze(2)
