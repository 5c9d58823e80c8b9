"""The SGLang side of a DDTREE decode step: :class:`SGLangBackend`, a
:class:`~sglang_tree_spec.step.StepBackend` over the DDTREE worker's pools and runners.

For one scheduled decode batch it drafts a DFlash block, verifies a tree window and keeps the
accepted path, on SGLang's shared KV pool:

* the drafter's block ``[bonus, MASK x L]`` runs as a TARGET_VERIFY batch of the draft model
  at positions ``prefix .. prefix + L``; the draft top-K comes from the target's LM head
  (vocabulary-parallel under TP: merged top-K, never dense logits);
* the verify window (``W`` slots at positions ``prefix + depth``) is written to KV slots
  ``prefix .. prefix + W - 1`` of each request, with SGLang's FULL_MASK tree mask;
* the accepted path's target KV moves to the contiguous slots ``prefix .. prefix + a`` and the
  drafter's context KV for those tokens is written from the target's hidden states.

Sizes come from the scheduler's host lengths, exact or (under overlap) upper bounds
(:func:`host_lengths`), so no device tensor is read back here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from sglang_tree_spec.plugin import compat, kernels
from sglang_tree_spec.plugin.grammar import constrained, mask_verify_logits
from sglang_tree_spec.tree import (
    VerifyLayout,
    topk_from_logits,
    vocab_parallel_topk,
)
from sglang_tree_spec.tree.penalties import TreePenalties, penalize_tree_logits


def host_lengths(batch: Any) -> tuple[torch.Tensor, bool]:
    """``[bs]`` int64 host lengths of a decode batch and whether they are exact.

    Exact: the scheduler's ``seq_lens_cpu`` (synchronous scheduling, or relayed under overlap).
    Else, under overlap where no backend needs host lengths, the step's KV reservation
    (:func:`compat.reserved_lens`, at least the host's lagging committed length + 2 windows) bounds
    every length this step reaches (the cached prefix, at most one window past the host's, plus
    this step's window); sizes and plans read from it as from DFLASH's. Without either, the
    device lengths are read back (a blocking read)."""
    if batch.seq_lens_cpu is not None:
        return batch.seq_lens_cpu.to(torch.int64), True
    reserved = compat.reserved_lens(batch)
    if reserved is not None:
        return reserved.to(torch.int64), False
    return batch.seq_lens.cpu().to(torch.int64), True


_ALL_TRUE: dict[str, torch.Tensor] = {}


def _verify_mask(
    layout: VerifyLayout, prefix_lens: torch.Tensor, size: int, out: torch.Tensor | None
) -> torch.Tensor:
    """The verify's ``FULL_MASK`` of ``size`` entries (window x host lengths): each slot sees
    its prefix and its tree ancestors (one kernel, :func:`.kernels.full_mask`), written into
    ``out`` when given (the verify graph's static mask); a plain step's root its prefix and
    itself."""
    window = layout.tokens.shape[1]
    if window == 1:
        return _all_true(size, prefix_lens.device)
    mask = torch.empty(size, dtype=torch.bool, device=prefix_lens.device) if out is None else out
    kernels.full_mask(layout.ancestor_mask, prefix_lens, mask)
    return mask


def _all_true(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` bool all True: a view of one buffer per device, grown as needed (a plain
    verify's mask; masks are read, never written), so a plain step fills none."""
    buffer = _ALL_TRUE.get(str(device))
    if buffer is None or buffer.numel() < n:
        size = max(n, 2 * (0 if buffer is None else buffer.numel()))
        buffer = _ALL_TRUE[str(device)] = torch.ones(size, dtype=torch.bool, device=device)
    return buffer[:n]


@functools.lru_cache(maxsize=64)
def _offsets(window: int, device: str) -> torch.Tensor:
    """``[W]`` int64 ``0 .. W - 1``, one per window and device (read, never written)."""
    return torch.arange(window, device=device)


@functools.lru_cache(maxsize=256)
def _mask_block(bs: int, masks: int, mask_id: int, device: str) -> torch.Tensor:
    """``[bs, masks]`` int64 of the drafter's mask token, one per shape and device (read,
    never written): a block is the bonus and these."""
    return torch.full((bs, masks), mask_id, dtype=torch.int64, device=device)


class SGLangBackend:
    """Draft, verify and keep for one decode ``batch`` (a ``ModelWorkerBatch``) of ``worker``.

    After :meth:`verify`, ``logits_output`` and ``can_run_cuda_graph`` hold the target
    forward's outputs for the scheduler's result.
    """

    def __init__(self, worker: Any, batch: Any) -> None:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        self.worker, self.batch = worker, batch
        self._capture_full = CaptureHiddenMode.FULL
        self.req_to_token = worker.model_runner.req_to_token_pool.req_to_token
        # [bs] host lengths: exact, or upper bounds (no host lengths relayed under overlap)
        self.host_prefix_lens, self.host_lens_exact = host_lengths(batch)
        self.logits_output: Any = None
        self.can_run_cuda_graph = False
        self._window_locs: torch.Tensor | None = None  # [bs, W] KV slots of the window
        self._window_pos: torch.Tensor | None = None  # [bs, W] their positions
        self._verified = 0  # verifies so far: a plain step's forward i caches i more tokens
        # The batch's penalty state for a vocabulary size (None: no request is penalised).
        self.penalties: Callable[[int, torch.device], TreePenalties | None] | None = None
        self.constrained = constrained(batch.reqs)  # a grammar masks some request's slots

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        """``[bs, n]`` KV slots reserved at ``positions [bs, n]``."""
        rows = self.batch.req_pool_indices[:, None]
        return self.req_to_token[rows, positions].to(torch.int64)

    # --- draft --------------------------------------------------------------------------

    def draft_topk(
        self, bonus: torch.Tensor, prefix_lens: torch.Tensor, k: int, depths: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward over the whole block; top-K ``[bs, D, K]`` log-probs and ids
        of slots ``1 .. D``, ``D = min(L, depths)`` (the LM head runs on those slots only)."""
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
            ForwardMode,
        )
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        worker = self.worker
        self.write_deferred_context(prefix_lens)  # the block attends to every cached token
        bs, block = bonus.shape[0], worker.block_size
        masks = _mask_block(bs, block - 1, int(worker._mask_token_id), str(bonus.device))
        block_ids = torch.cat([bonus.view(bs, 1).to(torch.int64), masks], dim=1)  # [bs, block]
        positions = prefix_lens[:, None] + worker.block_pos_offsets  # [bs, block]
        target_model = worker.target_worker.model_runner.model
        draft_dtype = next(worker.draft_model.parameters()).dtype
        input_embeds = target_model.get_input_embeddings()(block_ids).to(draft_dtype)
        seq_lens_cpu = self.host_prefix_lens.to(torch.int32)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=self.batch.req_pool_indices,
            seq_lens=prefix_lens,
            out_cache_loc=self._slots(positions).flatten(),
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=positions.flatten(),
            input_embeds=input_embeds.view(bs * block, -1),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=worker.draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
        with torch.inference_mode():
            draft_out = worker.draft_model_runner.forward(forward_batch)
            hidden = draft_out.logits_output.hidden_states.view(bs, block, -1)[:, 1 : depths + 1]
            return self._topk_of_lm_head(target_model.lm_head, hidden, k, depths)

    def _topk_of_lm_head(
        self, lm_head: Any, hidden: torch.Tensor, k: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K ``[bs, L, K]`` of the target's LM head on drafter states ``[bs, L, H]``, on
        one rank written straight into the static inputs of the tree build it feeds (the
        step builds a tree of ``width`` nodes from it) when that build is captured.

        Under tensor parallelism the head is vocabulary-parallel: each rank multiplies by
        its own rows only and :func:`vocab_parallel_topk` merges the ranks' top-K with two
        ``[bs, L]`` all-reduces and one ``[bs, L, K]`` all-gather, never the dense logits.
        """
        vocab_size, group = self.worker.vocab_size, self.worker.tp_group
        shortlist = self.worker.draft_vocab  # --speculative-token-map (tree/draft_vocab.py)
        k = min(k, vocab_size)
        if group.world_size == 1:
            graphs = getattr(self.worker.selector, "graphs", None)
            out = None if graphs is None else graphs.build_inputs(*hidden.shape[:2], k, width)
            weight, ids = lm_head.weight[:vocab_size], None  # [V, H] without padding rows
            if shortlist is not None:  # [S, H] rows of the map's ids
                weight, ids = shortlist.weight, shortlist.token_ids
            logits = torch.matmul(hidden.to(weight.dtype), weight.T)
            return topk_from_logits(logits, k, ids, out=out)
        # Rank r's rows are ids padded_start + j (the same count on every rank); ids at or
        # past the real vocabulary are padding and never drafted.
        shard = lm_head.shard_indices
        weight = lm_head.weight[: shard.num_org_elements_padded]  # [V_shard, H]
        ids = None
        if shortlist is not None:  # this rank's ids of the map, padded to the largest count
            weight, ids = shortlist.weight, shortlist.token_ids
        return vocab_parallel_topk(
            torch.matmul(hidden.to(weight.dtype), weight.T),  # [bs, L, V_shard]
            k,
            vocab_start=int(shard.padded_org_vocab_start_index),
            vocab_size=vocab_size,
            group=group.device_group,
            token_ids=ids,
        )

    # --- verify -------------------------------------------------------------------------

    def verify(self, layout: VerifyLayout, prefix_lens: torch.Tensor) -> torch.Tensor:
        """One target forward over every request's ``W`` window slots with the tree mask;
        ``[bs, W, V]`` logits after SGLang's verify logit adjustments. A plain step's forward
        ``i`` (``i`` earlier forwards of this step, one token each) runs at ``prefix_lens`` =
        the batch's lengths + ``i``."""
        bs, window = layout.tokens.shape
        forward_batch = self._verify_forward_batch(layout, prefix_lens)
        self._target_forward(forward_batch)
        logits = self.logits_output.next_token_logits  # [bs * W, V]
        self._adjust_verify_logits(logits, layout, prefix_lens)
        return logits.view(bs, window, -1)

    def _verify_forward_batch(self, layout: VerifyLayout, prefix_lens: torch.Tensor) -> Any:
        """SGLang's ``ForwardBatch`` of the verify: the window's slots and KV locations, the
        tree mask, and the host lengths it is planned from (the batch's own lengths are put
        back once it is built)."""
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput

        batch = self.batch
        window = layout.tokens.shape[1]
        earlier, self._verified = self._verified, self._verified + 1
        window_pos = prefix_lens[:, None]  # [bs, W] KV positions of the window's slots
        if window > 1:
            window_pos = window_pos + _offsets(window, str(prefix_lens.device))
        self._window_pos, self._window_locs = window_pos, self._slots(window_pos)
        if self.host_lens_exact:
            host_lens = self.host_prefix_lens + earlier + window  # [bs] lengths after the window
        else:  # the reservation covers the window (see host_lengths)
            host_lens = self.host_prefix_lens
        host_sum = int(host_lens.sum())
        size = window * host_sum  # FULL_MASK entries
        runner = self._verify_runner()
        static = None if runner is None else runner.static_mask(len(host_lens), window, size)
        mask = _verify_mask(layout, prefix_lens, size, static)
        verify_input = DFlashVerifyInput(
            draft_token=layout.tokens.reshape(-1),
            positions=layout.positions.reshape(-1),
            draft_token_num=window,
            custom_mask=mask,
            capture_hidden_mode=self._capture_full,
        )
        batch.out_cache_loc = self._window_locs.reshape(-1)
        seq_lens, seq_lens_cpu, seq_lens_sum = (
            batch.seq_lens,
            batch.seq_lens_cpu,
            batch.seq_lens_sum,
        )
        if earlier:
            batch.seq_lens = prefix_lens.to(seq_lens.dtype)
        # The verify's host lengths, always given: the graph runner pads and plans from them
        # (a ``None`` here sent every GPU verify to the eager path).
        batch.seq_lens_cpu, batch.seq_lens_sum = host_lens, host_sum
        forward_batch, _ = verify_input.prepare_for_verify(batch, self.worker.target_worker)
        batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = (
            seq_lens,
            seq_lens_cpu,
            seq_lens_sum,
        )
        return forward_batch

    def _verify_runner(self) -> Any:
        """The DDTREE verify graphs the verify replays from: the worker's (CPU closure replay)
        or, on CUDA, the target model runner's (:mod:`.graphs`); None when there are none."""
        from sglang_tree_spec.plugin.graphs import DDTreeVerifyGraphs

        runner = self.worker.verify_graphs or getattr(
            self.worker.target_worker.model_runner, compat.MODEL_RUNNER_GRAPH_RUNNER, None
        )
        return runner if isinstance(runner, DDTreeVerifyGraphs) else None

    def _target_forward(self, forward_batch: Any) -> None:
        """The verify forward: replayed from the worker's verify graphs where they take it,
        else SGLang's target forward; sets ``logits_output`` and ``can_run_cuda_graph``."""
        worker = self.worker
        graphs = worker.verify_graphs  # CPU closure replay (tests); on CUDA SGLang's runner
        if graphs is not None and graphs.can_run_graph(forward_batch):
            self.logits_output, self.can_run_cuda_graph = self._replay(graphs, forward_batch), True
        else:  # (the runner logs the verifies of captured shapes it refused)
            out = worker.target_worker.forward_batch_generation(
                batch=None,
                forward_batch=forward_batch,
                is_verify=True,
                skip_attn_backend_init=True,
            )
            self.logits_output, self.can_run_cuda_graph = (
                out.logits_output,
                bool(out.can_run_cuda_graph),
            )

    def _adjust_verify_logits(
        self, logits: torch.Tensor, layout: VerifyLayout, prefix_lens: torch.Tensor
    ) -> None:
        """In place on the verify's ``logits [bs * W, V]``: penalties and grammar masks, each
        slot by its own path, around SGLang's verify logit adjustments (its order)."""
        from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments

        batch = self.batch
        bs, window = layout.tokens.shape
        state = None if self.penalties is None else self.penalties(logits.shape[-1], logits.device)
        if state is not None:  # each slot by its own path, before the bias (SGLang's order)
            penalize_tree_logits(
                logits.view(bs, window, -1),
                layout.tokens,
                layout.ancestor_mask,
                layout.positions - prefix_lens[:, None],
                state,
                int(self.worker.block_size) - 1,
            )
        if self.constrained:  # the root's one-token mask would mask every slot alike
            batch.sampling_info.grammar_mask = None
        if batch.sampling_info is not None:
            apply_dflash_verify_logits_adjustments(
                next_token_logits=logits,
                sampling_info=batch.sampling_info,
                draft_token_num=window,
            )
        if self.constrained:  # each slot by the grammar state of its own path, after the bias
            mask_verify_logits(
                batch.reqs,
                logits,
                layout.tokens,
                layout.ancestor_mask,
                layout.positions - prefix_lens[:, None],
                int(batch.sampling_info.vocab_size),
            )

    def _replay(self, graphs: Any, forward_batch: Any) -> Any:
        """The verify forward replayed by the worker's own graph runner (what SGLang's model
        runner does on CUDA: the verify under the target's forward context)."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        runner = self.worker.target_worker.model_runner
        with (
            torch.inference_mode(),
            forward_context(ForwardContext(attn_backend=runner.attn_backend)),
        ):
            return graphs.execute(forward_batch)

    # --- keep ---------------------------------------------------------------------------

    def keep(self, path_slots: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """Path slot ``j``'s target KV moves to window slot ``j`` (position prefix + j; off
        the path the move is a no-op; the root, ``j = 0``, is in place already, so a plain
        step moves nothing); the drafter's context KV for those positions is written from the
        path's target hidden states (a plain step's is deferred to the next draft,
        :mod:`.deferred`)."""
        bs, width = path_slots.shape
        window_locs = self._window_locs
        hidden = self.logits_output.hidden_states.view(bs, window_locs.shape[1], -1)
        deferred = self.worker.deferred_context(hidden)
        if width == 1 and deferred is not None:
            if deferred.is_full(self.host_rows):
                self.write_deferred_context(self._window_pos[:, 0])
            deferred.stash(self.host_rows, self.rows, self._window_pos[:, 0], hidden[:, 0])
            self.logits_output.hidden_states = None
            return
        slots = path_slots.clamp_min(0)
        dst_locs = window_locs[:, :width]
        if width > 1:
            moved = dst_locs[:, 1:]
            src_locs = torch.where(
                path_slots[:, 1:] >= 0, window_locs.gather(1, slots[:, 1:]), moved
            )
            self.worker.model_runner.token_to_kv_pool.move_kv_cache(
                moved.flatten(), src_locs.flatten()
            )
        path_hidden = hidden.gather(1, slots[:, :, None].expand(-1, -1, hidden.shape[-1]))
        self.worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=path_hidden.reshape(-1, hidden.shape[-1]),
            cache_loc=dst_locs.reshape(-1),
            cache_loc_2d=dst_locs,
            positions=self._window_pos[:, :width].reshape(-1),
            commit_lens=commit_lens.to(torch.int32),
        )
        self.logits_output.hidden_states = None

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """``[bs]`` int64 the batch's request rows (``req_pool_indices``), converted once."""
        return self.batch.req_pool_indices.to(torch.int64)

    @functools.cached_property
    def host_rows(self) -> list[int]:
        """The batch's request rows, from the host requests (no device read)."""
        return compat.req_rows(self.batch.reqs)

    def write_deferred_context(self, prefix_lens: torch.Tensor) -> None:
        """Write the batch's pending plain-step drafter context (:mod:`.deferred`), its
        requests having ``prefix_lens [bs]`` cached tokens now."""
        deferred = self.worker.deferred_context()
        if deferred is None:
            return
        taken = deferred.take(self.host_rows, self.rows, prefix_lens)
        if taken is None:
            return
        hidden, positions, counts = taken  # [bs, n, Hc], [bs, n], [bs]
        locs = self._slots(positions)  # [bs, n]
        self.worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden.reshape(-1, hidden.shape[-1]),
            cache_loc=locs.reshape(-1),
            cache_loc_2d=locs,
            positions=positions.reshape(-1),
            commit_lens=counts.to(torch.int32),
        )
