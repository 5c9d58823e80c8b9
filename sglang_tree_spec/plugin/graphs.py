"""Target-verify graphs with the tree mask: one captured shape per (batch size, budget).

SGLang 0.5.17 captures a DFlash-family target verify with ``custom_mask=None`` (its decode graph
runner's ``get_spec_info``), so a replayed DDTREE verify would attend causally: wrong tokens.
:class:`DDTreeVerifyGraphs` is the DDTREE target's decode graph runner instead, installed through
SGLang's own extension point ``ModelRunner._decode_cuda_graph_runner_cls``
(:func:`ddtree_decode_graph_runner_cls`, an AROUND hook). It keeps the interface the model
runner and ``DFlashVerifyInput.prepare_for_verify`` call (``can_run_graph``, ``load_batch``,
``execute``, ``bs``) and:

* captures every batch size SGLang would capture times every budget the server can pick
  (``TreeConfig.budgets``: each candidate under budget control, else the fixed budget), each
  as a closure that reads only static buffers: input ids, positions, sequence lengths (device
  and host), request rows, KV slots and the FULL_MASK tree mask, through one
  ``ForwardBatch`` per shape whose verify input carries the static mask buffer;
* at each step copies the step's inputs into those buffers (padding the batch up to the
  captured size) and replays the shape: a ``torch.cuda.CUDAGraph`` on CUDA, the closure itself
  on CPU, where nothing but the static buffers reaches it either;
* keeps ONE set of outputs for every shape, sized for the largest, each shape writing a view of
  it as SGLang's decode graph runner does: the fp32 logits (SGLang's shared graph output buffer
  where the model runner has one large enough, through ``ForwardBatch.next_token_logits_buffer``)
  and the hidden states the drafter reads, copied in by the captured forward; the rest of a
  forward's memory returns to the graph pool, so a shape costs no output memory of its own;
* keeps each shape's own captured attention state where the backend keys it by batch size
  alone (flashinfer's target-verify wrappers, each with its own plan workspace: the capture of
  a second budget would replace the first's, and its replays would plan the wrong window's
  wrappers): :class:`WrappersPerBatchSize` hands a shape's wrappers back before its replay
  plans them;
* captures batch sizes up to the speculation cap only (:mod:`.capture_plan`: the largest batch
  whose buffers, and the backend wrappers kept per shape, fit in a share of device memory);
  the worker runs larger batches as plain steps. The plan is logged at start-up.

On CPU SGLang captures no decode graph; with ``SGLANG_TREE_SPEC_CPU_VERIFY_GRAPHS=1`` the DDTREE
worker builds this runner itself (closure replay) and its verify runs through it, which is how
CI checks the capture/replay discipline against eager verify on a real server.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import torch

from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.capture_plan import (
    CAPTURE_SHARE,
    GIB,
    kept_wrapper_bytes,
    speculation_cap,
    verify_plan,
)

logger = logging.getLogger(__name__)

CPU_GRAPHS_ENV = "SGLANG_TREE_SPEC_CPU_VERIFY_GRAPHS"
"""Set to 1 on a CPU server: the DDTREE worker verifies, and builds its trees, through closure
replay (tests)."""


SPECULATION_CAP_ENV = "SGLANG_TREE_SPEC_SPECULATION_CAP"
"""A batch size: DDTREE speculates at most up to it (the capture plan's cap is kept where it
is lower); larger batches take plain steps, and no verify graph is captured above it."""


def forced_speculation_cap() -> int | None:
    value = os.environ.get(SPECULATION_CAP_ENV)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"DDTREE: {SPECULATION_CAP_ENV} is a batch size >= 1, got {value!r}")
    return int(value)


def cpu_verify_graphs_requested() -> bool:
    return os.environ.get(CPU_GRAPHS_ENV, "0") == "1"


def closure_tree_graphs(selector: Any) -> Any:
    """With :data:`CPU_GRAPHS_ENV` on a CPU server, a DDTree selector builds its trees as on
    CUDA (the batched build, static inputs and outputs: ``tree/graphs.py``), replayed as
    closures; other selectors are kept."""
    from sglang_tree_spec.tree.graphs import TreeGraphs
    from sglang_tree_spec.tree.select import DDTreeSelector

    if type(selector) is not DDTreeSelector:
        return selector
    return DDTreeSelector(selector.topk, graphs=TreeGraphs("closure"))


def ddtree_decode_graph_runner_cls(original: Any, model_runner: Any) -> type:
    """AROUND hook on ``ModelRunner._decode_cuda_graph_runner_cls``: the DDTREE target's decode
    graphs are :class:`DDTreeVerifyGraphs` (tree mask captured); every other runner (the
    drafter's, other algorithms') keeps SGLang's. Mirrored by
    ``patches/sglang-<release>/0021-ddtree-verify-graph-runner.diff``."""
    from sglang.srt.runtime_context import get_server_args

    from sglang_tree_spec.plugin.validation import ALGORITHM

    if get_server_args().speculative_algorithm == ALGORITHM and not model_runner.is_draft_worker:
        return DDTreeVerifyGraphs
    return original(model_runner)


class VerifyWrappers(Protocol):
    """The backend's captured target-verify state of each shape (batch size, window), beyond
    what SGLang's capture hooks rebuild per shape."""

    def keep(self, key: tuple[int, int]) -> None:
        """After the capture-time metadata of shape ``key``: keep what its graph reads."""

    def restore(self, key: tuple[int, int]) -> None:
        """Before the replay-time metadata of shape ``key``: hand it back to the backend."""


class StatePerShape:
    """A backend whose capture hook builds each shape's state anew and whose replay hook
    refills that shape's (triton: static views, one metadata per capture): nothing to keep."""

    def keep(self, key: tuple[int, int]) -> None:
        return None

    def restore(self, key: tuple[int, int]) -> None:
        return None


class WrappersPerBatchSize:
    """A backend that keeps its captured target-verify wrappers per batch size only, in the
    dict ``backend.<compat.BACKEND_VERIFY_WRAPPERS>[bs]`` (flashinfer). Its capture hook makes
    new wrappers for every shape and files them under the batch size, so after the capture of
    (bs, W') its replay hook plans the W' wrappers for a (bs, W) replay while the (bs, W) graph
    reads its own, unplanned (and, dropped from the dict, freed) plan workspace. Keeps every
    shape's wrappers and files them back before the shape's replay plans them."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.kept: dict[tuple[int, int], Any] = {}

    def _table(self) -> dict[int, Any]:
        return getattr(self.backend, compat.BACKEND_VERIFY_WRAPPERS)

    def keep(self, key: tuple[int, int]) -> None:
        self.kept[key] = self._table()[key[0]]

    def restore(self, key: tuple[int, int]) -> None:
        self._table()[key[0]] = self.kept[key]


def verify_wrappers(backend: Any) -> VerifyWrappers:
    """:class:`WrappersPerBatchSize` for a backend with a per-batch-size wrapper dict, else
    :class:`StatePerShape`."""
    if isinstance(getattr(backend, compat.BACKEND_VERIFY_WRAPPERS, None), dict):
        return WrappersPerBatchSize(backend)
    return StatePerShape()


class _Buffers:
    """The static inputs and outputs of every captured shape (views of them, sliced per shape);
    ``logits``: the fp32 ``[max_bs * max_window, vocab]`` output buffer; the hidden-state
    output is allocated at the first forward (its width is the model's capture)."""

    def __init__(
        self, max_bs: int, max_window: int, max_context: int, device: Any, logits: torch.Tensor
    ) -> None:
        tokens = max_bs * max_window
        self.tokens = tokens
        self.logits = logits
        self.hidden: torch.Tensor | None = None
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.seq_lens_cpu = torch.ones(max_bs, dtype=torch.int32)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # FULL_MASK: W rows of (prefix + W) columns per request.
        self.custom_mask = torch.ones(
            max_bs * max_window * (max_context + max_window), dtype=torch.bool, device=device
        )


class DDTreeVerifyGraphs:
    """The DDTREE target's verify graphs, one per (batch size, budget); see the module doc."""

    SEQ_LEN_FILL = 1  # a padded request: one cached token (row 0, slot 0: SGLang's padding)

    def __init__(
        self,
        model_runner: Any,
        *,
        batch_sizes: list[int] | None = None,
        budgets: tuple[int, ...] | None = None,
        replay: str | None = None,
    ) -> None:
        from sglang.srt.model_executor.runner.base_cuda_graph_runner import (
            get_batch_sizes_to_capture,
        )

        from sglang_tree_spec.plugin.validation import tree_config

        self.model_runner = model_runner
        self.device = model_runner.device
        self.attn_backend = model_runner.attn_backend
        server_args = compat.resolved(model_runner.server_args)
        if budgets is None:
            budgets = tree_config(server_args).budgets
        self.windows = sorted({int(b) + 1 for b in budgets})
        if batch_sizes is None:
            batch_sizes, _ = get_batch_sizes_to_capture(model_runner, self.windows[-1])
        self.replay_mode = replay or (
            "cuda" if torch.device(self.device).type == "cuda" else "closure"
        )
        self.max_context = int(model_runner.req_to_token_pool.req_to_token.shape[1])
        shape = self._model_shape(server_args)
        backend = self.attn_backend
        shape["wrapper_bytes"] = kept_wrapper_bytes(
            isinstance(getattr(backend, compat.BACKEND_VERIFY_WRAPPERS, None), dict),
            getattr(backend, compat.BACKEND_WRAPPERS_PER_SHAPE, 1),
        )  # (flashinfer's wrappers of every shape are kept: WrappersPerBatchSize)
        self.speculation_cap = speculation_cap(
            [w - 1 for w in self.windows],
            device_memory(self.device),
            batch_sizes=batch_sizes,
            **shape,
        )
        forced = forced_speculation_cap()
        if forced is not None:
            self.speculation_cap = min(self.speculation_cap, forced)
        # Batches above the cap take plain steps (the worker); capture at least batch size 1.
        self.capture_bs = sorted({b for b in batch_sizes if b <= self.speculation_cap}) or [1]
        self.max_bs = self.capture_bs[-1]
        self.plan = verify_plan(self.capture_bs, [w - 1 for w in self.windows], **shape)
        self.buffers = _Buffers(
            self.max_bs,
            self.windows[-1],
            self.max_context,
            self.device,
            self._logits_buffer(self.max_bs * self.windows[-1], shape["vocab"]),
        )
        self.bs = self.max_bs  # the padded batch size of the last load (SGLang reads it)
        self._batches: dict[tuple[int, int], Any] = {}
        self._graphs: dict[tuple[int, int], Any] = {}
        self._outputs: dict[tuple[int, int], Any] = {}
        self._loaded: tuple[Any, tuple[int, int], int] | None = None
        self.replays: dict[tuple[int, int], int] = {}
        self.eager_shapes: set[tuple[int, int]] = set()
        self.backend_plans = self._init_backend_graph_state()
        self.wrappers = verify_wrappers(self.attn_backend)
        self.capture()

    def _model_shape(self, server_args: Any) -> dict[str, int]:
        """What the capture plan reads of the target: vocabulary, the hidden states captured
        for the drafter (hidden size x the drafter's target layers), the tree mask's prefix
        columns and the model's dtype."""
        from sglang_tree_spec.plugin.validation import load_drafter

        config = self.model_runner.model_config
        drafter = load_drafter(
            server_args.speculative_draft_model_path, server_args.speculative_draft_model_revision
        )
        return {
            "vocab": int(config.vocab_size),
            "hidden_width": int(config.hidden_size) * len(drafter.target_layer_ids),
            "max_context": self.max_context,
            "dtype_bytes": torch.finfo(config.dtype).bits // 8,
        }

    def _logits_buffer(self, rows: int, vocab: int) -> torch.Tensor:
        """The fp32 ``[rows, vocab]`` logits output of every shape: SGLang's shared graph
        output buffer (the one its decode and prefill graphs write) when the model runner has
        one of ``rows`` rows, else the runner's own."""
        shared = getattr(self.model_runner, compat.MODEL_RUNNER_GRAPH_OUTPUT, None)
        if shared is not None and int(shared.max_rows) >= rows:
            self.shares_sglang_logits = True
            return shared.get_logits_buffer(vocab, rows=rows)
        self.shares_sglang_logits = False
        return torch.zeros(rows, vocab, dtype=torch.float32, device=self.device)

    def _init_backend_graph_state(self) -> bool:
        """The backend's buffers for captured metadata (triton, flashinfer; on a CPU too, under
        Triton's interpreter), refilled out of the graph at every load; False for a backend
        with none (torch_native reads the static views as they are). A CUDA capture needs them."""
        try:
            self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.windows[-1])
        except NotImplementedError:
            if self.replay_mode == "cuda":
                raise
            return False
        return True

    # --- SGLang 0.5.23 asks the runner class about gathers before building it -----------------

    @staticmethod
    def decode_graph_gather_requirements(model_runner: Any) -> tuple[bool, bool]:
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
            DecodeCudaGraphRunner,
        )

        return DecodeCudaGraphRunner.decode_graph_gather_requirements(model_runner)

    # --- capture ----------------------------------------------------------------------------

    def _static_batch(self, bs: int, window: int) -> Any:
        """The ForwardBatch of shape (bs, window): every tensor a view of the static buffers,
        its verify input carrying the static tree-mask buffer."""
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
            ForwardMode,
        )
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput

        buf, tokens = self.buffers, bs * window
        spec_info = DFlashVerifyInput(
            draft_token=None,
            positions=None,
            draft_token_num=window,
            custom_mask=buf.custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=buf.input_ids[:tokens],
            req_pool_indices=buf.req_pool_indices[:bs],
            seq_lens=buf.seq_lens[:bs],
            seq_lens_cpu=buf.seq_lens_cpu[:bs],
            orig_seq_lens=buf.seq_lens[:bs],
            out_cache_loc=buf.out_cache_loc[:tokens],
            seq_lens_sum=int(buf.seq_lens_cpu[:bs].sum()),
            return_logprob=False,
            positions=buf.positions[:tokens],
            spec_algorithm=self.model_runner.spec_algorithm,
            spec_info=spec_info,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            global_forward_mode=ForwardMode.TARGET_VERIFY,
            next_token_logits_buffer=buf.logits[:tokens],  # the logits processor writes it
        )

    def _closure(self, forward_batch: Any) -> Any:
        """The captured computation of one shape: reads ``forward_batch``'s static views only
        and writes its outputs into views of the shared static outputs."""
        model, backend = self.model_runner.model, self.attn_backend

        def run() -> Any:
            backend.init_forward_metadata_in_graph(forward_batch)
            output = model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
            return self._into_static_outputs(output, int(forward_batch.input_ids.shape[0]))

        return run

    def _into_static_outputs(self, output: Any, tokens: int) -> Any:
        """``output``'s logits and hidden states as views of the shared static outputs (the
        logits processor has written the logits there already unless it could not, e.g. a
        soft-capped or differently shaped result: then they are copied in)."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        buf = self.buffers
        logits = buf.logits[:tokens]
        if output.next_token_logits.data_ptr() != logits.data_ptr():
            logits.copy_(output.next_token_logits)
        hidden = output.hidden_states
        if hidden is not None:
            if buf.hidden is None:  # at the first (largest) shape's first forward
                with torch.inference_mode(False):
                    buf.hidden = torch.zeros(
                        (buf.tokens, hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device
                    )
            buf.hidden[:tokens].copy_(hidden)
            hidden = buf.hidden[:tokens]
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden)

    def capture(self) -> None:
        """Capture every (batch size, window), largest first (smaller graphs share its pool)."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self._seed_capture_inputs()
        pool, capture_context = None, None
        if self.replay_mode == "cuda":
            from sglang.srt.distributed.parallel_state import graph_capture

            pool = torch.cuda.graph_pool_handle()
            capture_context = graph_capture()
        stream_context = capture_context if capture_context is not None else _null()
        with stream_context as ctx, forward_context(ForwardContext(attn_backend=self.attn_backend)):
            for bs in reversed(self.capture_bs):
                for window in reversed(self.windows):
                    key = (bs, window)
                    forward_batch = self._static_batch(bs, window)
                    self._batches[key] = forward_batch
                    self._metadata_out_of_graph(
                        forward_batch, bs * window * (self.SEQ_LEN_FILL + window), True
                    )
                    self.wrappers.keep(key)
                    run = self._closure(forward_batch)
                    if self.replay_mode != "cuda":
                        self._graphs[key] = run
                        continue
                    with torch.inference_mode():
                        for _ in range(2):  # warm up (kernel autotune, lazy inits)
                            run()
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=ctx.stream):
                            self._outputs[key] = run()
                    self._graphs[key] = graph
        logger.info(
            "DDTREE verify graphs (%s): batch sizes %s x budgets %s",
            "CUDA graphs" if self.replay_mode == "cuda" else "closure replay",
            self.capture_bs,
            [w - 1 for w in self.windows],
        )
        if isinstance(self.wrappers, WrappersPerBatchSize):
            logger.info(
                "DDTREE verify graphs: the backend's target-verify wrappers kept per shape "
                "(%d sets)",
                len(self.wrappers.kept),
            )
        logger.info(
            "DDTREE capture plan: %s (logits %s); speculates up to batch size %d (%.0f%% of "
            "%.1f GiB), plain steps above",
            self.plan.line(),
            "in SGLang's shared graph output" if self.shares_sglang_logits else "own buffer",
            self.speculation_cap,
            100 * CAPTURE_SHARE,
            device_memory(self.device) / GIB,
        )

    def _seed_capture_inputs(self) -> None:
        """Capture reads real forwards: point every row at the padding row and slot."""
        buf = self.buffers
        buf.input_ids.zero_()
        buf.positions.zero_()
        buf.out_cache_loc.zero_()
        buf.req_pool_indices.zero_()
        buf.seq_lens.fill_(self.SEQ_LEN_FILL)
        buf.seq_lens_cpu.fill_(self.SEQ_LEN_FILL)
        buf.custom_mask.fill_(True)

    def _metadata_out_of_graph(self, forward_batch: Any, used: int, in_capture: bool) -> None:
        """The backend's out-of-graph metadata for a shape; it copies the mask into its own
        captured buffer (triton's ``_verify_mask``, flashinfer's ``plan``), so it is shown the
        ``used`` entries of the static mask only (its buffer may be sized for fewer columns)."""
        spec_info = forward_batch.spec_info
        spec_info.custom_mask = self.buffers.custom_mask[:used]
        try:
            self.attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        finally:
            spec_info.custom_mask = self.buffers.custom_mask

    # --- replay -----------------------------------------------------------------------------

    def _padded_bs(self, bs: int) -> int | None:
        return next((size for size in self.capture_bs if size >= bs), None)

    def static_mask(self, bs: int, window: int, size: int) -> torch.Tensor | None:
        """The static tree mask's first ``size`` entries when a verify of ``bs`` requests and
        ``window`` slots whose mask has ``size`` entries replays here (the step writes its mask
        there, and :meth:`load_batch` copies none), else None."""
        if window not in self.windows or self._padded_bs(bs) is None:
            return None
        if size > self._mask_room(bs, window):
            return None
        return self.buffers.custom_mask[:size]

    def _mask_room(self, bs: int, window: int) -> int:
        """Entries of the static mask a ``bs``-request verify can fill (the padding rows of
        the largest batch need theirs)."""
        pad = (self.max_bs - bs) * window * (self.SEQ_LEN_FILL + window)
        return self.buffers.custom_mask.numel() - pad

    def can_run_graph(self, forward_batch: Any) -> bool:
        """A tree verify (mask given) of a captured budget, at most the largest captured batch,
        whose mask fits the static buffer."""
        spec_info = forward_batch.spec_info
        if not forward_batch.forward_mode.is_target_verify() or spec_info is None:
            return False
        if getattr(spec_info, "custom_mask", None) is None:
            return False
        window = int(spec_info.draft_token_num)
        bs = forward_batch.batch_size
        if window not in self.windows or self._padded_bs(bs) is None:
            return False
        fits = forward_batch.seq_lens_cpu is not None and int(
            spec_info.custom_mask.numel()
        ) <= self._mask_room(bs, window)
        if not fits:
            self.log_eager_verify(forward_batch)
        return fits

    def log_eager_verify(self, forward_batch: Any) -> None:
        """Log (once per shape) a tree verify of a captured shape this runner could not serve
        (no host lengths, or a mask past its buffer), which runs eagerly."""
        shape = (forward_batch.batch_size, int(forward_batch.spec_info.draft_token_num) - 1)
        if shape not in self.eager_shapes:
            self.eager_shapes.add(shape)
            logger.info("DDTREE verify ran eagerly: batch size %d, budget %d", *shape)

    def load_batch(self, forward_batch: Any, pp_proxy_tensors: Any = None) -> None:
        """Copy the step's inputs into the static buffers of its padded shape."""
        buf = self.buffers
        raw_bs = forward_batch.batch_size
        window = int(forward_batch.spec_info.draft_token_num)
        bs = self._padded_bs(raw_bs)
        raw_tokens, tokens = raw_bs * window, bs * window
        buf.input_ids[:raw_tokens].copy_(forward_batch.input_ids)
        buf.positions[:raw_tokens].copy_(forward_batch.positions)
        buf.out_cache_loc[:raw_tokens].copy_(forward_batch.out_cache_loc)
        buf.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        buf.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        buf.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        mask = forward_batch.spec_info.custom_mask
        if mask.data_ptr() != buf.custom_mask.data_ptr():  # (else written in place: static_mask)
            buf.custom_mask[: mask.numel()].copy_(mask)
        if bs > raw_bs:  # padded requests: padding row and slot, one token, mask all True
            buf.input_ids[raw_tokens:tokens].zero_()
            buf.positions[raw_tokens:tokens].zero_()
            buf.out_cache_loc[raw_tokens:tokens].zero_()
            buf.seq_lens[raw_bs:bs].fill_(self.SEQ_LEN_FILL)
            buf.seq_lens_cpu[raw_bs:bs].fill_(self.SEQ_LEN_FILL)
            buf.req_pool_indices[raw_bs:bs].zero_()
            pad = (bs - raw_bs) * window * (self.SEQ_LEN_FILL + window)
            buf.custom_mask[mask.numel() : mask.numel() + pad].fill_(True)
        key = (bs, window)
        static = self._batches[key]
        static.seq_lens_sum = int(buf.seq_lens_cpu[:bs].sum())
        if self.backend_plans:
            used = mask.numel() + (bs - raw_bs) * window * (self.SEQ_LEN_FILL + window)
            self.wrappers.restore(key)
            self._metadata_out_of_graph(static, used, False)
        self.bs = bs
        self._loaded = (forward_batch, key, raw_tokens)

    def execute(self, forward_batch: Any, pp_proxy_tensors: Any = None) -> Any:
        """Replay the step's shape over the static buffers; outputs of the real rows."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        if self._loaded is None or self._loaded[0] is not forward_batch:
            self.load_batch(forward_batch)
        _, key, raw_tokens = self._loaded
        self._loaded = None
        if key not in self.replays:
            logger.info(
                "DDTREE verify graph replayed: batch size %d, budget %d", key[0], key[1] - 1
            )
        self.replays[key] = self.replays.get(key, 0) + 1
        output = self.replay_shape(key)
        hidden = output.hidden_states
        return LogitsProcessorOutput(
            next_token_logits=output.next_token_logits[:raw_tokens],
            hidden_states=hidden[:raw_tokens] if hidden is not None else None,
        )

    def replay_shape(self, key: tuple[int, int]) -> Any:
        """One replay of shape ``key`` over the static buffers (one launch on CUDA): views of
        the shared static outputs, which the next replay of any shape overwrites. The closure
        (CPU) writes them itself, as the graph does."""
        if self.replay_mode == "cuda":
            self._graphs[key].replay()
            return self._outputs[key]
        return self._graphs[key]()


def device_memory(device: Any) -> int:
    """Total memory of ``device`` in bytes (a GPU's, or on CPU the host's)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
