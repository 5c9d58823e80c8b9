"""What SGLang 0.5.17 lacks to serve DDTREE on a CPU-only machine, as hook callables.

Each hook leaves GPU serving unchanged (it defers to SGLang's original off CPU, or only adds
what was missing: the torch-native backend's target verify, the drafter's embeddings in the
served dtype). Under Triton's interpreter (``TRITON_INTERPRET=1``, :mod:`.interpreter`) SGLang's
Triton kernels run on CPU tensors, and the hooks that stand in for a Triton kernel step aside so
that the real kernel runs. :mod:`.hooks` lists them with their upstream diffs.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)


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


def native_kv_move_on_cpu(original: Any, pool: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND hook on ``MHATokenToKVPool._init_kv_copy_and_warmup``: no Triton on CPU.

    A speculative server sizes a KV pool that can move KV rows (accepted tree nodes are moved
    to their final slots), and 0.5.17 warms a Triton copy kernel for that, which needs a GPU.
    On CPU the pool uses its native torch move instead (what ``SGLANG_NATIVE_MOVE_KV_CACHE=1``
    selects), unless Triton's interpreter runs the kernel there. Mirrored by
    ``patches/sglang-0.5.17/0005-native-kv-move-on-cpu.diff``.
    """
    if torch.device(pool.device).type != "cpu":
        return original(pool, *args, **kwargs)
    if triton_interpreted():
        interpreted_kernel("KV copy")
        return original(pool, *args, **kwargs)
    pool._kv_copy_config = None
    pool.use_native_move_kv_cache = True
    return None


def torch_native_draft_backend_on_cpu(original: Any, *args: Any, **kwargs: Any) -> str:
    """AROUND hook on ``draft_worker_common._resolve_draft_attention_backend_fallback``.

    SGLang's draft workers accept GPU attention backends only and fall back to flashinfer;
    on CPU the drafter must run on the torch-native backend like the target, or on the triton
    backend under Triton's interpreter when that is the one asked for. Mirrored by
    ``patches/sglang-0.5.17/0006-torch-native-draft-backend-on-cpu.diff``.
    """
    draft_args = kwargs.get("draft_server_args", args[0] if args else None)
    if draft_args is None or str(draft_args.device) != "cpu":
        return original(*args, **kwargs)
    asked = draft_args.speculative_draft_attention_backend
    if asked is None:
        asked, _ = draft_args.get_attention_backends()  # the target's prefill backend
    if asked == "triton" and triton_interpreted():
        return original(*args, **kwargs)
    return "torch_native"


def prefill_graph_off_on_cpu(original: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``ServerArgs._apply_cuda_graph_compatibility`` (SGLang 0.5.17).

    0.5.17 turns the prefill CUDA graph off on CPU only when ``SGLANG_USE_CPU_ENGINE=1`` (its
    ``is_cpu()``); with ``--device cpu`` alone it captures the ``tc_piecewise`` prefill graph at
    start-up and dies (``sglang::unified_attention_with_output`` has no CPU kernel), with or
    without speculation. On a CPU device the prefill graph is turned off, with one log line.
    (0.5.23 resolves it off on CPU itself.) Mirrored by
    ``patches/sglang-0.5.17/0020-prefill-cuda-graph-off-on-cpu.diff``.
    """
    result = original(server_args, *args, **kwargs)
    if str(server_args.device) != "cpu":
        return result
    from sglang.srt.model_executor.cuda_graph_config import Backend

    prefill = server_args.cuda_graph_config.prefill
    if prefill.backend != Backend.DISABLED:
        logger.info(
            "sglang-tree-spec: prefill CUDA graph (%s) turned off on --device cpu "
            "(its captured attention has no CPU kernel)",
            prefill.backend,
        )
        prefill.backend = Backend.DISABLED
    return result


def torch_native_draft_worker_backend_on_cpu(original: Any, *args: Any, **kwargs: Any) -> str:
    """AROUND hook on ``draft_worker_common.resolve_draft_worker_attention_backend`` (0.5.23).

    0.5.23's resolver (which replaced ``_resolve_draft_attention_backend_fallback``) reads the
    published bags and still falls back to flashinfer for any backend outside its draft list;
    on a CPU server the drafter keeps the torch-native backend. Mirrored by
    ``patches/sglang-0.5.23/0006-torch-native-draft-backend-on-cpu.diff``.
    """
    if serving_device() == "cpu":
        return "torch_native"
    return original(*args, **kwargs)


def assign_req_to_token_on_cpu(
    original: Any,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """AROUND hook on ``mem_cache.allocation.assign_req_to_token_pool_func``: torch on CPU.

    Writes ``req_to_token[req, start:end] = out_cache_loc[segment]`` for every request, the
    segments of ``out_cache_loc`` laid end to end. SGLang's CPU version needs its sgl_kernel
    CPU engine and its other version is a Triton kernel (which runs on CPU under Triton's
    interpreter). Mirrored by ``patches/sglang-0.5.17/0007-assign-req-to-token-on-cpu.diff``.
    """
    if req_to_token.device.type != "cpu" or triton_interpreted():
        if req_to_token.device.type == "cpu":
            interpreted_kernel("req_to_token slot assignment")
        return original(
            req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size
        )
    # One slice copy per request: host tensors, and a decode step's segments are a few slots
    # (a vectorised scatter cost ~60 us for one slot, 5x this).
    rows = req_pool_indices[:batch_size].tolist()
    starts, ends = start_offset[:batch_size].tolist(), end_offset[:batch_size].tolist()
    segment = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        req_to_token[row, start:end] = out_cache_loc[segment : segment + end - start]
        segment += end - start
    return None


def input_embeds_in_model_dtype(
    original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> dict:
    """AROUND hook on ``ModelRunner._extend_forward_kwargs``: embeddings in the model's dtype.

    SGLang 0.5.17 casts ``input_embeds`` (how a DFlash drafter receives its block) to bfloat16
    unconditionally, so a drafter served in float32 (``--dtype float32``, e.g. on CPU) fails
    in its first matmul. The cast goes to the runner's dtype instead. Mirrored by
    ``patches/sglang-0.5.17/0009-input-embeds-in-model-dtype.diff``.
    """
    model_kwargs = original(runner, forward_batch, *args, **kwargs)
    embeds = forward_batch.input_embeds
    if embeds is not None and forward_batch.replace_embeds is None:
        model_kwargs["input_embeds"] = embeds.to(runner.dtype)
    return model_kwargs


def no_pynccl_for_gloo_groups(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``parallel_state.init_model_parallel_group``: no NCCL in a gloo group.

    SGLang 0.5.17 asks every parallel group for a PyNccl communicator unless the device is an
    NPU or XPU; on a CPU device (gloo backend) with ``--tp-size`` > 1 that fails at start-up
    ("Expected a cuda device"). A gloo group does its collectives through torch.distributed.
    Mirrored by ``patches/sglang-0.5.17/0011-no-pynccl-for-gloo-groups.diff``.
    """
    bound = inspect.signature(original).bind(*args, **kwargs)
    if bound.arguments["backend"] == "gloo":
        bound.arguments["use_pynccl"] = False
    return original(*bound.args, **bound.kwargs)


def triton_interpreted() -> bool:
    """Whether Triton kernels run under Triton's interpreter here (``TRITON_INTERPRET``, read
    as Triton reads it), which runs them on CPU tensors."""
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing can interpret a kernel
        return False
    return bool(knobs.runtime.interpret)


@functools.cache
def interpreted_kernel(what: str) -> None:
    """Log once per process that SGLang's own Triton kernel for ``what`` runs on CPU here."""
    logger.info("sglang-tree-spec: %s runs SGLang's Triton kernel under Triton's interpreter", what)


def serving_device() -> str:
    """The ``--device`` of this SGLang process (a guess from torch before args are published)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return str(get_server_args().device)
    except ValueError:  # "Global server args is not set yet!"
        return "cuda" if torch.cuda.is_available() else "cpu"


def tree_verify_torch_backend() -> type:
    """``TorchNativeAttnBackend`` plus TARGET_VERIFY, for a REPLACE hook on that class.

    SGLang 0.5.17's torch-native backend (the one that runs on CPU) has no target-verify path:
    a verify batch has no ``extend_*_lens``. The subclass adds it and changes nothing else.
    Each request's ``W`` query tokens attend to its cached prefix and to the window, with

    * the custom mask of the verify input (SGLang's flat FULL_MASK: ``W`` rows by
      ``prefix + W`` columns per request) when there is one -- the DDTREE tree verify;
    * every window token, for non-causal layers (a DFlash drafter's block is ENCODER_ONLY);
    * a causal window otherwise (a chain verify).

    It reads the device lengths alone, so it declares ``needs_cpu_seq_lens = False``: SGLang's
    overlap scheduler then relays no host lengths to it (as for triton and flashinfer).
    Mirrored by ``patches/sglang-0.5.17/0004-torch-native-target-verify.diff``.
    """
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class TreeVerifyTorchNativeAttnBackend(TorchNativeAttnBackend):
        # Reads the device lengths only (TARGET_VERIFY too): overlap need not relay host ones.
        needs_cpu_seq_lens = False

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
                )
            heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
            query = q.reshape(-1, heads, layer.qk_head_dim)  # [bs * W, H, D]
            out = q.new_empty(query.shape[0], heads, layer.v_head_dim)
            verify_attention(
                query,
                out,
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self._verify_index(layer, forward_batch, query.shape[0]),
                scale=layer.scaling,
                enable_gqa=heads != kv_heads,
            )
            return out.view(out.shape[0], -1)

        def _verify_index(self, layer: Any, forward_batch: Any, tokens: int) -> VerifyIndex:
            """The forward's :func:`verify_index`, computed at its first layer: layers run in
            increasing ``layer_id``, so a ``layer_id`` not above the last one (or another
            batch, or another mask kind) starts a new forward, replayed graphs included."""
            bidirectional = layer.attn_type == AttentionType.ENCODER_ONLY
            key = (id(forward_batch), bidirectional)
            cached = getattr(self, "_ddtree_verify", None)
            if cached is None or cached[0] != key or layer.layer_id <= cached[1]:
                bs = forward_batch.seq_lens.shape[0]
                index = verify_index(
                    self.req_to_token_pool.req_to_token,
                    forward_batch.req_pool_indices,
                    forward_batch.seq_lens,
                    tokens // bs,
                    flat_mask=None if bidirectional else forward_batch.spec_info.custom_mask,
                    causal=not bidirectional,
                )
                cached = (key, layer.layer_id, index)
            self._ddtree_verify = (key, layer.layer_id, cached[2])
            return cached[2]

    return TreeVerifyTorchNativeAttnBackend


class VerifyIndex(NamedTuple):
    """What every layer of one verify forward shares (:func:`verify_index`).

    Attributes:
        slots: ``[bs, K]`` KV slot of each request's column ``k < prefix + W`` (0 past it),
            ``K`` the longest ``prefix + W``.
        allowed: ``[bs, 1, W, K]`` which columns each window token attends to; None when
            every token attends to every column (a plain step of requests of one length): the
            attention then runs unmasked, SDPA's fast path.
    """

    slots: torch.Tensor
    allowed: torch.Tensor | None


def verify_index(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    window: int,
    *,
    flat_mask: torch.Tensor | None,
    causal: bool,
) -> VerifyIndex:
    """The KV gather and the mask of every request's ``W`` verify tokens, once per forward
    (the same for every layer; computing it per layer cost more than the attention itself at
    small batches on CPU).

    Args:
        req_to_token: ``[rows, context]`` KV slots per request row; the window's KV is
            written at ``req_to_token[req, prefix : prefix + W]``.
        prefix_lens: ``[bs]`` cached tokens before the window.
        flat_mask: SGLang FULL_MASK (True = may attend) or None; not read for a 1-token
            window, whose row is its prefix and itself.
        causal: without a mask, window token ``i`` sees window tokens ``<= i``; else all.
    """
    bs = prefix_lens.shape[0]
    device = prefix_lens.device
    kv_lens = prefix_lens.to(torch.long) + window  # [bs]
    max_kv = int(kv_lens.max())
    columns = torch.arange(max_kv, device=device)  # [K]
    rows = torch.arange(window, device=device)  # [W]
    in_range = columns[None, :] < kv_lens[:, None]  # [bs, K]
    table_columns = columns.clamp_max(req_to_token.shape[1] - 1)
    slots = req_to_token[req_pool_indices.to(torch.long)[:, None], table_columns[None, :]]
    slots = torch.where(in_range, slots.to(torch.long), 0)  # [bs, K], padding -> slot 0

    if flat_mask is not None and window > 1:  # (a 1-token window sees its prefix and itself)
        # Request b's block: W rows of kv_len[b] columns from indptr[b] (see layout.py).
        indptr = torch.cumsum(window * kv_lens, 0) - window * kv_lens  # [bs]
        flat = indptr[:, None, None] + rows[None, :, None] * kv_lens[:, None, None]
        flat = flat + columns[None, None, :]  # [bs, W, K]
        allowed = flat_mask[torch.where(in_range[:, None, :], flat, 0)]
    elif causal:  # window row i sees every column up to prefix + i
        allowed = columns[None, None, :] <= (kv_lens - window)[:, None, None] + rows[None, :, None]
    else:
        allowed = torch.ones(bs, window, max_kv, dtype=torch.bool, device=device)
    allowed = allowed & in_range[:, None, :]  # [bs, W, K]
    if bool(allowed.all()):  # a host read, once per forward (this backend runs on CPU)
        return VerifyIndex(slots, None)
    return VerifyIndex(slots, allowed[:, None])


def verify_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: VerifyIndex,
    *,
    scale: float | None,
    enable_gqa: bool,
) -> None:
    """Attention of every request's ``W`` verify tokens over its prefix and window.

    One batched SDPA call: every request's KV is gathered to the longest ``prefix + W`` and the
    columns past a request's own length are masked out (``index``, :func:`verify_index`).

    Args:
        query: ``[bs * W, H, D]``; out: ``[bs * W, H, Dv]``, written in place.
        k_cache, v_cache: ``[slots, H_kv, D]`` KV pools.
    """
    bs = index.slots.shape[0]
    window = query.shape[0] // bs
    heads, dim = query.shape[1], query.shape[2]
    q = query.view(bs, window, heads, dim).transpose(1, 2)  # [bs, H, W, D]
    flat_slots = index.slots.view(-1)  # index_select: 2.5-5x faster than k_cache[slots] on CPU
    k = k_cache.index_select(0, flat_slots).view(bs, -1, *k_cache.shape[1:])  # [bs, K, H_kv, D]
    v = v_cache.index_select(0, flat_slots).view(bs, -1, *v_cache.shape[1:])
    k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)  # [bs, H_kv, K, D]
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=index.allowed, scale=scale, enable_gqa=enable_gqa
    )  # [bs, H, W, Dv]
    out.copy_(o.transpose(1, 2).reshape(out.shape))


def spec_relay_on_cpu(original: Any, future_map: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND hook on ``FutureMap._resolve_spec_extras`` (SGLang 0.5.17): no stream record on
    CPU.

    Under overlap scheduling 0.5.17 marks the relayed request indices as used by the current
    stream (``Tensor.record_stream``), which CPU tensors refuse ("unknown parameter type"):
    the first speculative decode step under overlap kills a CPU server. A CPU tensor has no
    stream to record, so the call is skipped for CPU tensors, as 0.5.23 does; GPU tensors are
    recorded as before. Mirrored by
    ``patches/sglang-0.5.17/0022-spec-relay-skips-stream-record-on-cpu.diff``.
    """
    if torch.device(future_map.device).type != "cpu":
        return original(future_map, *args, **kwargs)
    with no_stream_record_on_cpu():
        return original(future_map, *args, **kwargs)


@contextmanager
def no_stream_record_on_cpu() -> Iterator[None]:
    """``Tensor.record_stream`` skips CPU tensors (which refuse it) while open."""
    record_stream = torch.Tensor.record_stream

    def record_off_cpu(tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    torch.Tensor.record_stream = record_off_cpu
    try:
        yield
    finally:
        torch.Tensor.record_stream = record_stream


def xgrammar_bitmask_on_cpu(original: Any, vocab_size: int, batch_size: int) -> torch.Tensor:
    """AROUND hook on ``constrained.xgrammar_backend._allocate_token_bitmask`` (SGLang 0.5.17):
    an unpinned bitmask on CPU.

    0.5.17 always allocates the ``[batch_size, ceil(vocab_size / 32)]`` int32 grammar bitmask in
    pinned memory (for a non-blocking copy to the GPU), which needs a CUDA driver: without one
    the first grammar-constrained request kills a CPU server, with or without speculation ("Found
    no NVIDIA driver"). On a CPU device the mask never leaves host memory, so it is allocated
    unpinned (0.5.23 pins only where pinning exists). Mirrored by
    ``patches/sglang-0.5.17/0024-xgrammar-bitmask-unpinned-on-cpu.diff``.
    """
    if serving_device() != "cpu":
        return original(vocab_size, batch_size)
    from xgrammar import bitmask_dtype, get_bitmask_shape

    return torch.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=bitmask_dtype)


def xgrammar_mask_applied_on_cpu(
    original: Any, grammar: Any, logits: torch.Tensor, vocab_mask: torch.Tensor
) -> None:
    """AROUND hook on ``constrained.xgrammar_backend.XGrammarGrammar.apply_vocab_mask``
    (SGLang 0.5.17): xgrammar's CPU kernel for CPU logits.

    0.5.17 masks ``logits [bs, V]`` by the bitmask ``[bs, ceil(V / 32)]`` with a Triton (or
    HIP) kernel and raises "Unsupported device: cpu" for CPU logits, so a CPU server cannot
    sample a grammar-constrained request. CPU logits go through xgrammar's own CPU kernel (what
    0.5.23 does); other devices are unchanged. Mirrored by
    ``patches/sglang-0.5.17/0025-xgrammar-bitmask-applied-on-cpu.diff``.
    """
    if logits.device.type != "cpu":
        return original(grammar, logits=logits, vocab_mask=vocab_mask)
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, vocab_mask, backend="cpu")
    return None
