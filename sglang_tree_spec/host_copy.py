"""Host values onto the device without waiting for the device's queued work.

A plain host-to-CUDA copy from pageable memory synchronises the stream: under SGLang's overlap
scheduler that makes the host wait for every kernel queued before it (the previous step's
included). Copied from pinned memory with ``non_blocking=True`` it is queued like a kernel (the
caching host allocator keeps the pinned block alive until the copy has run). On other devices it
is an ordinary copy.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
    """``values`` (a host tensor, or what ``torch.tensor`` takes) as a tensor on ``device``."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
