"""What SGLang needs to serve on a CPU-only machine, applied only when serving on CPU."""

from __future__ import annotations

from typing import Any

import torch


def native_rotary_on_cpu(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``RotaryEmbedding.__init__``: use the native rotary path on CPU.

    SGLang 0.5.17 treats a device as CPU only with ``SGLANG_USE_CPU_ENGINE=1`` (its sgl_kernel
    CPU engine); otherwise a non-CUDA ``RotaryEmbedding`` imports ``vllm._custom_ops`` and
    fails. With ``--device cpu`` this sets the module's ``_is_cpu`` flag, which only selects
    the native path there. Mirrored by ``patches/sglang-0.5.17/0002-rotary-native-on-cpu.diff``.
    """
    if serving_device() == "cpu":
        from sglang.srt.layers.rotary_embedding import base

        base._is_cpu = True


def serving_device() -> str:
    """The ``--device`` of this SGLang process (a guess from torch before args are published)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return str(get_server_args().device)
    except ValueError:  # "Global server args is not set yet!"
        return "cuda" if torch.cuda.is_available() else "cpu"
