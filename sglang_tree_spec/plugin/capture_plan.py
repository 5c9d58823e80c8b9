"""The device memory of DDTREE's verify graphs, and the batch size DDTREE speculates at.

:class:`~sglang_tree_spec.plugin.graphs.DDTreeVerifyGraphs` captures one graph per (batch
size, window) and keeps, for all of them together:

* static inputs sized for the largest shape: input ids, positions and KV slots (int64, one per
  verify token), sequence lengths and request rows (int64, one per request) and the FULL_MASK
  tree mask (bool, ``max_bs * W * (max_context + W)``);
* one set of outputs, every shape writing a view of it (as SGLang's decode graph runner shares
  its logits buffer): the fp32 logits ``[max_bs * W, vocab]`` (SGLang's own shared graph
  output buffer where the model runner has one large enough) and the hidden states the drafter
  reads ``[max_bs * W, hidden_width]`` in the model's dtype;
* the graph pool, shared by every shape: at least the largest graph's LM-head output before
  its copy into the fp32 buffer, ``[max_bs * W, vocab]`` in the model's dtype (the layers'
  activations are smaller at these widths);
* on a backend whose captured verify wrappers are kept per shape (flashinfer:
  ``graphs.WrappersPerBatchSize``), each shape's wrappers: flashinfer gives every prefill
  wrapper its own integer workspace on the device and a pinned host copy of it.

``W`` is the largest verify window (largest budget + 1). :func:`verify_plan` counts those
bytes; :func:`speculation_cap` is the largest batch size whose plan fits in
:data:`CAPTURE_SHARE` of the device's memory: DDTREE captures its verify graphs up to it, and a
larger batch takes plain steps (budget 0: the root alone, no tree) instead of a tree verify
whose outputs would not fit. :func:`dflash_plan` is the same count for SGLang's DFLASH (its
decode graph runner at the drafter's block, one shared logits buffer, hidden states per shape).
Pure arithmetic: no SGLang, no device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

# DDTREE's verify graphs and outputs may take this share of device memory: SGLang keeps at
# least 10 GiB outside its KV pool on a device above 60 GiB for activations and graphs.
CAPTURE_SHARE = 0.05
INDEX_BYTES = 8  # int64 ids, positions, KV slots, lengths and rows
LOGITS_BYTES = 4  # the verify's fp32 logits (SGLang's graph output dtype)
# A flashinfer prefill wrapper's own buffers (flashinfer 0.6-0.7 BatchPrefillWithPagedKVCache
# Wrapper.__init__): an 8 MiB integer workspace and a 32768-entry int32 KV-lengths buffer on the
# device, and an 8 MiB pinned host copy of the workspace.
FLASHINFER_WRAPPER_BYTES = (8 << 20) + 4 * 32768
FLASHINFER_WRAPPER_PINNED_BYTES = 8 << 20
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    """Bytes of one capture plan (see the module doc); ``shapes``: captured graphs."""

    batch_sizes: tuple[int, ...]
    budgets: tuple[int, ...]
    shapes: int
    inputs: int  # static ids, positions, KV slots, lengths, rows
    mask: int  # the static tree mask
    logits: int  # fp32 graph outputs
    hidden: int  # hidden-state graph outputs
    pool: int  # the graph pool's peak (the largest graph's LM-head output)
    wrappers: int = 0  # the attention backend's verify wrappers kept per shape (device)
    pinned: int = 0  # their pinned host memory (not device memory: not in ``total``)

    @property
    def total(self) -> int:
        return self.inputs + self.mask + self.logits + self.hidden + self.pool + self.wrappers

    def line(self) -> str:
        """The plan in one line (the start-up log)."""
        sizes = self.batch_sizes
        shown = f"{list(sizes)}" if len(sizes) <= 8 else f"[{sizes[0]}, ..., {sizes[-1]}]"
        return (
            f"{self.shapes} shapes ({len(sizes)} batch sizes {shown} x budgets "
            f"{list(self.budgets)}), {self.total / GIB:.2f} GiB: logits {self.logits / GIB:.2f}, "
            f"hidden states {self.hidden / GIB:.2f}, tree mask {self.mask / GIB:.2f}, inputs "
            f"{self.inputs / GIB:.3f}, graph pool >= {self.pool / GIB:.2f}"
            + (
                f", backend wrappers {self.wrappers / GIB:.2f} (+ {self.pinned / GIB:.2f} GiB "
                "pinned host memory)"
                if self.wrappers
                else ""
            )
        )


def verify_plan(
    batch_sizes: Iterable[int],
    budgets: Iterable[int],
    *,
    vocab: int,
    hidden_width: int,
    max_context: int,
    dtype_bytes: int,
    wrapper_bytes: tuple[int, int] = (0, 0),
) -> CapturePlan:
    """DDTREE's verify graphs at ``batch_sizes`` x ``budgets`` (window = budget + 1): one
    output set sized for the largest shape. ``hidden_width``: the hidden states the target
    captures for the drafter (hidden size x target layers read); ``max_context``: a
    ``req_to_token`` row (the tree mask's prefix columns); ``wrapper_bytes``: the device and
    pinned host bytes of the backend wrappers each shape keeps (:func:`kept_wrapper_bytes`)."""
    sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
    budgets = tuple(sorted(set(int(b) for b in budgets)))
    if not sizes:
        return CapturePlan((), budgets, 0, 0, 0, 0, 0, 0)
    max_bs, window = sizes[-1], budgets[-1] + 1
    tokens = max_bs * window
    shapes = len(sizes) * len(budgets)
    return CapturePlan(
        batch_sizes=sizes,
        budgets=budgets,
        shapes=shapes,
        inputs=INDEX_BYTES * (3 * tokens + 3 * max_bs),
        mask=tokens * (max_context + window),
        logits=LOGITS_BYTES * tokens * vocab,
        hidden=dtype_bytes * tokens * hidden_width,
        pool=dtype_bytes * tokens * vocab,
        wrappers=shapes * wrapper_bytes[0],
        pinned=shapes * wrapper_bytes[1],
    )


def kept_wrapper_bytes(kept_per_shape: bool, wrappers_per_shape: int = 1) -> tuple[int, int]:
    """Device and pinned host bytes of the verify wrappers a shape keeps: flashinfer's
    ``wrappers_per_shape`` prefill wrappers when kept per shape, else none."""
    if not kept_per_shape:
        return (0, 0)
    count = int(wrappers_per_shape)
    return (count * FLASHINFER_WRAPPER_BYTES, count * FLASHINFER_WRAPPER_PINNED_BYTES)


def speculation_cap(
    budgets: Iterable[int],
    device_bytes: int,
    *,
    share: float = CAPTURE_SHARE,
    vocab: int,
    hidden_width: int,
    max_context: int,
    dtype_bytes: int,
    wrapper_bytes: tuple[int, int] = (0, 0),
    batch_sizes: Iterable[int] = (),
) -> int:
    """The largest batch size whose verify plan (:func:`verify_plan`, sized by its largest
    shape) fits in ``share`` of ``device_bytes``; 0 when not even one request's does. With
    wrappers kept per shape the plan captures ``batch_sizes`` up to the cap."""
    budgets = tuple(budgets)
    limit = share * device_bytes
    sizes = sorted(set(int(b) for b in batch_sizes))

    def fits(bs: int) -> bool:
        plan = verify_plan(
            [b for b in sizes if b < bs] + [bs],
            budgets,
            vocab=vocab,
            hidden_width=hidden_width,
            max_context=max_context,
            dtype_bytes=dtype_bytes,
            wrapper_bytes=wrapper_bytes,
        )
        return plan.total <= limit

    low, high = 0, 1
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def dflash_plan(
    batch_sizes: Iterable[int],
    block: int,
    *,
    vocab: int,
    hidden_width: int,
    dtype_bytes: int,
) -> CapturePlan:
    """SGLang's DFLASH target-verify graphs at ``batch_sizes`` (one window: the drafter's
    ``block``): its decode graph runner's static inputs (ids, positions, KV slots, lengths,
    rows; no tree mask: DFLASH verifies a causal chain), one shared fp32 logits buffer, the
    hidden states each shape's graph returns from the pool, and the largest graph's LM-head
    output."""
    sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
    if not sizes:
        return CapturePlan((), (block - 1,), 0, 0, 0, 0, 0, 0)
    max_bs = sizes[-1]
    tokens = max_bs * block
    return CapturePlan(
        batch_sizes=sizes,
        budgets=(block - 1,),
        shapes=len(sizes),
        inputs=INDEX_BYTES * (3 * tokens + 3 * max_bs),
        mask=0,
        logits=LOGITS_BYTES * tokens * vocab,
        hidden=dtype_bytes * block * sum(sizes) * hidden_width,
        pool=dtype_bytes * tokens * vocab,
    )
