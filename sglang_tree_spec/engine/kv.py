"""Target KV cache for a batch of requests of different lengths (transformers DynamicCache).

Layout: every layer holds ``[bs, kv_heads, P, D]``; request ``b`` owns columns
``0 .. prefix_lens[b] - 1`` and the rest of its row is garbage that attention masks out. A
verify forward appends a window of ``W`` slots to every row (columns ``P .. P + W - 1``);
:func:`keep_window_slots` then moves each request's kept slots right after its prefix.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def check_plain_cache(cache: DynamicCache) -> None:
    """Refuse caches whose layers are not plain growing KV (sliding windows, offloading...)."""
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds != {DynamicLayer.__name__}:
        raise ValueError(f"only full-attention KV caches are supported, got layers {kinds}")


def verify_attention_mask(
    prefix_lens: torch.Tensor, past_len: int, window_mask: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive 4-D mask ``[bs, 1, W, past_len + W]`` for a forward over a window of slots.

    Args:
        prefix_lens: ``[bs]`` valid cached columns per request.
        past_len: P, columns already in the cache.
        window_mask: ``[bs, W, W]`` bool, which window slots each slot may see (the tree
            ancestor mask; causal for a chain or a prompt).
        dtype: the model's compute dtype (0 = attend, dtype min = masked).
    """
    bs, width, _ = window_mask.shape
    columns = torch.arange(past_len, device=prefix_lens.device)
    past = (columns[None, :] < prefix_lens[:, None])[:, None, :].expand(bs, width, past_len)
    allowed = torch.cat([past, window_mask], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=prefix_lens.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def keep_window_slots(
    cache: DynamicCache, prefix_lens: torch.Tensor, past_len: int, keep: torch.Tensor
) -> torch.Tensor:
    """Compact the cache after a window forward: keep ``keep`` slots behind each prefix.

    Args:
        prefix_lens: ``[bs]`` valid columns before the window.
        past_len: P, the cache length before the window was appended.
        keep: ``[bs, N]`` window slots to keep in order, -1 padded (e.g. the accepted path).

    Returns:
        ``[bs]`` new prefix lengths. The cache is rewritten to ``max(new lengths)`` columns.
    """
    kept = (keep >= 0).sum(dim=1)
    new_lens = prefix_lens + kept
    new_len = int(new_lens.max())
    columns = torch.arange(new_len, device=keep.device).expand(keep.shape[0], new_len)
    offset = (columns - prefix_lens[:, None]).clamp(0, keep.shape[1] - 1)
    window_column = past_len + keep.gather(1, offset).clamp_min(0)
    source = torch.where(columns < prefix_lens[:, None], columns, window_column)
    for layer in cache.layers:
        heads, head_dim = layer.keys.shape[1], layer.keys.shape[3]
        index = source[:, None, :, None].expand(-1, heads, -1, head_dim)
        layer.keys = layer.keys.gather(2, index)
        layer.values = layer.values.gather(2, index)
    return new_lens


def select_requests(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep only the requests at ``index`` (in that order)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
