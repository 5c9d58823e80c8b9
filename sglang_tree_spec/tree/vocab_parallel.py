"""Per-position top-K log-probs from a vocabulary-parallel LM head, without dense logits.

Under tensor parallelism each rank's LM head holds a contiguous shard of the vocabulary, so
each rank computes logits ``[bs, L, V_shard]`` for ids ``vocab_start .. vocab_start + V_shard``
(the last shard may end in padding rows beyond the real vocabulary). The draft tree needs only
the top-K tokens per position with their log-probabilities. Instead of gathering the dense
logits (``bs * L * V`` values per rank), each rank sends:

* two ``[bs, L]`` all-reduces (the max and the sum of exponentials), giving the global
  log-normaliser exactly as a dense ``log_softmax`` would;
* one all-gather of its local top-K values and global ids, ``[bs, L, K]`` each;

and every rank merges the ``world * K`` candidates into the same global top-K. The global top-K
lies within the union of the local top-Ks, so the result equals :func:`topk_from_logits` on the
dense logits (up to the order of exactly tied values).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_topk(
    shard_logits: torch.Tensor,
    k: int,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top-``k`` log-probs and token ids of vocabulary-sharded logits.

    Args:
        shard_logits: ``[bs, L, V_shard]`` this rank's logits for ids ``vocab_start + j``; every
            rank passes the same ``bs, L, V_shard``.
        k: tokens kept per position, ``1 <= k <= vocab_size``.
        vocab_start: the first vocabulary id of this rank's shard.
        vocab_size: the real vocabulary size; ids at or beyond it (padding rows) never count.
        group: the tensor-parallel process group (default: the world).
        token_ids: ``[V_shard]`` int64 the token id of each of this rank's columns when the
            drafter scores a vocabulary shortlist (ids at or beyond ``vocab_size`` are
            padding); None: ``vocab_start + j``.

    Returns:
        ``(topk_logprobs, topk_tokens)``: float32 and int64 ``[bs, L, k]``, sorted descending,
        identical on every rank.
    """
    if shard_logits.dim() != 3:
        raise ValueError(f"shard_logits must be [bs, L, V_shard], got {tuple(shard_logits.shape)}")
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-K of {k} is out of range for a vocabulary of {vocab_size}")
    shard_size = shard_logits.shape[-1]
    ids = (
        torch.arange(vocab_start, vocab_start + shard_size, device=shard_logits.device)
        if token_ids is None
        else token_ids
    )
    logits = shard_logits.float().masked_fill(ids >= vocab_size, float("-inf"))

    # Global log-normaliser: max, then the sum of exponentials below it.
    log_norm = logits.amax(dim=-1)  # [bs, L]
    dist.all_reduce(log_norm, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(logits - log_norm.unsqueeze(-1)).sum(dim=-1)  # [bs, L]
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    log_norm = log_norm + sum_exp.log()

    # Local candidates, then the same global merge on every rank.
    local_k = min(k, shard_size)
    values, index = torch.topk(logits, local_k, dim=-1, sorted=False)  # [bs, L, local_k]
    world, bs = dist.get_world_size(group), values.shape[0]
    # Gathered along dim 0 (rank-major), the layout every backend accepts.
    all_values = values.new_empty((world * bs, *values.shape[1:]))
    all_ids = index.new_empty((world * bs, *index.shape[1:]))
    dist.all_gather_into_tensor(all_values, values.contiguous(), group=group)
    dist.all_gather_into_tensor(all_ids, ids[index].contiguous(), group=group)
    # [world, bs, L, local_k] -> [bs, L, world * local_k]
    candidates = all_values.view(world, *values.shape).permute(1, 2, 0, 3).flatten(2)
    candidate_ids = all_ids.view(world, *index.shape).permute(1, 2, 0, 3).flatten(2)
    best, position = torch.topk(candidates, k, dim=-1, sorted=True)
    return best - log_norm.unsqueeze(-1), candidate_ids.gather(-1, position)
