"""Host values onto the device without waiting for the device's queued work.

A plain host-to-CUDA copy from pageable memory synchronises the stream: under SGLang's overlap
scheduler that makes the host wait for every kernel queued before it (the previous step's
included). Copied from pinned memory with ``non_blocking=True`` it is queued like a kernel (the
caching host allocator keeps the pinned block alive until the copy has run). On other devices it
is an ordinary copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Called with each copy's result (step accounting, ``plugin/accounting.py``); empty otherwise.
OBSERVERS: list[Callable[[torch.Tensor], None]] = []


def to_device(values: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
    """``values`` (a host tensor, or what ``torch.tensor`` takes) as a tensor on ``device``."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        result = host.to(device)
    else:
        result = host.pin_memory().to(device, non_blocking=True)
    for observe in OBSERVERS:
        observe(result)
    return result
