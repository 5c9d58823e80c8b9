"""The DDTREE step's own Triton kernels, each replacing a run of small torch ops outside graphs.

* :func:`full_mask`: SGLang's flat FULL_MASK tree mask of a verify window in ONE launch (the
  torch version, :func:`~sglang_tree_spec.tree.layout.write_full_mask`, is about a dozen ops:
  the indptr's cumsum, the index arithmetic, a fill and a scatter).

A kernel runs where Triton runs it: on CUDA, and on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, how CI runs it); elsewhere the torch version stands in, counted as the
one launch it replaces (:data:`LAUNCHES`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sglang_tree_spec.plugin.cpu import triton_interpreted
from sglang_tree_spec.tree.layout import write_full_mask

logger = logging.getLogger(__name__)

# Called with a kernel's name at each launch, the torch stand-in's included (step accounting,
# ``plugin/accounting.py``); empty otherwise.
LAUNCHES: list[Callable[[str], None]] = []
_FAILED: list[str] = []  # why a kernel failed to compile or launch here (then torch stands in)
_BLOCK = 1024  # mask entries a program writes per iteration (one row chunk)


def runs_triton(device: torch.device) -> bool:
    """Whether Triton launches kernels on ``device``'s tensors here."""
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreted())


def full_mask(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, out: torch.Tensor) -> None:
    """Write SGLang's flat FULL_MASK of a verify window into ``out`` in one launch.

    Request ``b``'s block is ``W`` rows of ``prefix_lens[b] + W`` columns, row-major, the
    blocks one after another: column ``c`` of row ``i`` is True for ``c < prefix_lens[b]``
    (the cached prefix), else ``tree_mask[b, i, c - prefix_lens[b]]``. Entries past the last
    block are set True (``out`` may be sized from host upper bounds).

    Args:
        tree_mask: ``[bs, W, W]`` bool ancestor mask of the window's slots.
        prefix_lens: ``[bs]`` int64 cached tokens of each request (on the device).
        out: 1-D bool, at least ``sum(W * (prefix_lens + W))`` entries.
    """
    for observe in LAUNCHES:
        observe("full_mask")
    if not runs_triton(out.device) or _FAILED:
        _full_mask_stand_in(tree_mask, prefix_lens, out)
        return
    import triton

    bs, window = tree_mask.shape[0], tree_mask.shape[1]
    rows = mask_rows_per_program(window, out.device)
    try:
        _full_mask_kernel()[(bs + 1, triton.cdiv(window, rows))](
            tree_mask.contiguous().view(torch.uint8),
            prefix_lens.to(torch.int64),
            out.view(torch.uint8),
            out.numel(),
            bs,
            window,
            BS_BLOCK=triton.next_power_of_2(bs),
            ROWS=rows,
            BLOCK=_BLOCK,
        )
    except Exception as error:  # a server keeps serving: the torch mask is the same mask
        _FAILED.append(f"{type(error).__name__}: {error}")
        logger.warning("DDTREE tree-mask kernel failed (%s); torch from now on", _FAILED[0])
        _full_mask_stand_in(tree_mask, prefix_lens, out)


def mask_rows_per_program(window: int, device: torch.device) -> int:
    """Window rows one program of the mask kernel writes: one on a GPU (a program a row
    keeps long prefixes parallel); every row of a request under the interpreter, which runs
    programs one after another, each at a fixed cost."""
    if device.type == "cuda" or not _ONE_PROGRAM_A_REQUEST_INTERPRETED:
        return 1
    import triton

    return triton.next_power_of_2(window)


_ONE_PROGRAM_A_REQUEST_INTERPRETED = True  # (tests turn it off to interpret the GPU's tiling)


def _full_mask_stand_in(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, out: torch.Tensor):
    """The torch version, where no Triton runs (``CPU_ONLY_SITES``: one launch on a GPU)."""
    write_full_mask(tree_mask, prefix_lens.to(torch.int64), out)


_KERNEL = None


def _full_mask_kernel():
    """The jitted kernel, defined on first use (importing the plugin needs no Triton)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def full_mask_kernel(
        tree_ptr, prefix_ptr, out_ptr, out_size, bs, window,
        BS_BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # program (b, g): rows g * ROWS .. of request b; programs (bs, g): the tail past the
        # last block
        b = tl.program_id(0)
        g = tl.program_id(1)
        requests = tl.arange(0, BS_BLOCK)
        prefixes = tl.load(prefix_ptr + requests, mask=requests < bs, other=0)
        start = tl.sum(tl.where(requests < b, window * (prefixes + window), 0))  # block b's
        if b < bs:
            prefix = tl.sum(tl.where(requests == b, prefixes, 0))  # (0-d: no scalar load)
            row_len = prefix + window
            row = g * ROWS + tl.arange(0, ROWS)  # [ROWS]
            row_ok = row < window
            row_start = start + row * row_len  # [ROWS]
            for chunk in range(0, row_len, BLOCK):
                col = chunk + tl.arange(0, BLOCK)  # [BLOCK]
                in_tree = col >= prefix
                tree_col = tl.where(in_tree, col - prefix, 0)
                ok = row_ok[:, None] & (col < row_len)[None, :]  # [ROWS, BLOCK]
                ancestor = tl.load(
                    tree_ptr + (b * window + row[:, None]) * window + tree_col[None, :],
                    mask=ok & in_tree[None, :],
                    other=1,
                )
                value = tl.where(in_tree[None, :], ancestor, 1).to(tl.uint8)
                tl.store(out_ptr + row_start[:, None] + col[None, :], value, mask=ok)
        else:
            stride = tl.num_programs(1) * BLOCK
            for chunk in range(start + g * BLOCK, out_size, stride):
                entry = chunk + tl.arange(0, BLOCK)
                tl.store(out_ptr + entry, tl.full((BLOCK,), 1, tl.uint8), mask=entry < out_size)

    _KERNEL = full_mask_kernel
    return _KERNEL
