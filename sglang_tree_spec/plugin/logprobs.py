"""``return_logprob`` for DDTREE: the committed tokens' log-probs, into SGLang's result.

SGLang's spec-v2 output processor reads, for a decode batch of ``bs`` requests whose result
has stride ``P`` (``speculative_num_draft_tokens``): ``next_token_logprobs`` ``[bs, P]`` (row
``i``, column ``j``: the ``j``-th committed token of request ``i``), and per flat row ``i * P +
j`` the top log-probs (``top_logprobs_num``) and the asked-for ids' log-probs
(``token_ids_logprob``). Each comes from the verify logits at the accepted path's slots
(:func:`sglang_tree_spec.tree.logprobs.path_logprobs`), the distribution the target alone
would sample that token from.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_tree_spec.tree.logprobs import path_logprobs, token_logprobs


def fill_decode_logprobs(
    batch: Any,
    logits_output: Any,
    logits: torch.Tensor,
    accepted_slots: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    """Write the log-probs of ``tokens [bs, P]`` (committed, -1 padded) into
    ``logits_output`` for a ``batch`` with ``return_logprob`` (``logits [bs, W, V]``,
    ``accepted_slots [bs, P]`` the path's window slots)."""
    info = batch.sampling_info
    greedy = info is None or info.is_all_greedy
    temperature = None if greedy else info.temperatures.view(-1)
    logprobs = path_logprobs(logits, accepted_slots, temperature)  # [bs, P, V]
    bs, width, _ = logprobs.shape
    logits_output.next_token_logprobs = token_logprobs(logprobs, tokens)  # [bs, P]
    flat = logprobs.flatten(0, 1)  # [bs * P, V]
    top_nums = list(batch.top_logprobs_nums or [])
    if any(num > 0 for num in top_nums):
        values, ids = flat.topk(max(top_nums), dim=-1)
        rows = [(i * width + j, top_nums[i]) for i in range(bs) for j in range(width)]
        logits_output.next_token_top_logprobs_val = [values[r, :k] for r, k in rows]
        logits_output.next_token_top_logprobs_idx = [ids[r, :k] for r, k in rows]
    token_ids = list(batch.token_ids_logprobs or [])
    if any(ids is not None for ids in token_ids):
        vals, idxs = [], []
        for i in range(bs):
            wanted = token_ids[i]
            index = None if wanted is None else torch.tensor(wanted, device=flat.device)
            for j in range(width):
                vals.append(flat[i * width + j, index] if index is not None else flat[0, :0])
                idxs.append(wanted if wanted is not None else [])
        logits_output.next_token_token_ids_logprobs_val = vals
        logits_output.next_token_token_ids_logprobs_idx = idxs
