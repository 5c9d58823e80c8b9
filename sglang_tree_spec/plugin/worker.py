"""The DDTREE speculative worker: SGLang 0.5.17's DFlash worker with a tree verify.

Prefill is DFlash's own (the target captures its hidden states at the drafter's layers and
they are projected into the draft KV cache). Each decode step then:

1. drafts one block ``[bonus, MASK x (block - 1)]`` with the DFlash drafter (one forward);
2. takes per-position top-K log-probs of slots ``1..L`` through the target's LM head;
3. builds the DDTree of ``budget`` nodes (:func:`sglang_tree_spec.tree.build_ddtree`), with
   ``--speculative-ddtree-graft unified`` grafts retrieved tokens into it from a successor
   table shared by all requests (:class:`sglang_tree_spec.graft.Grafter`), and lays it out:
   ``W = budget + 1`` window slots at positions ``prefix + depth``, written to KV slots
   ``prefix .. prefix + W - 1`` of each request, with SGLang's FULL_MASK tree mask;
4. verifies the whole tree in one target forward and accepts with the target's own rule
   (:func:`greedy_accept` / :func:`sample_accept`);
5. moves the accepted path's target KV to the contiguous slots ``prefix .. prefix + a`` and
   writes the drafter's context KV for those tokens from the target hidden states;
6. returns ``a + 1`` committed tokens per request (accepted drafts, then the bonus); with
   grafting, the table takes the top-k of every verified node's logits.

Every request keeps ``W`` verify slots, so shapes are fixed for a batch size. The worker runs
synchronously (no overlap scheduling) with TP 1. Sizes come from the scheduler's host copy of
the sequence lengths, so the step itself reads no device tensor back (only the tree build's early
stop does, and only on host tensors).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from sglang_tree_spec.graft import Grafter
from sglang_tree_spec.plugin.step_times import PhaseTimer
from sglang_tree_spec.tree import (
    build_ddtree,
    build_verify_layout,
    counter_uniforms,
    greedy_accept,
    sample_accept,
    topk_from_logits,
    vocab_parallel_topk,
    write_full_mask,
)

logger = logging.getLogger(__name__)


def ddtree_worker_class() -> type:
    """:class:`DDTreeWorker`, defined on first use (it subclasses an SGLang class)."""
    global _WORKER_CLASS
    if _WORKER_CLASS is None:
        _WORKER_CLASS = _define_worker()
    return _WORKER_CLASS


_WORKER_CLASS: type | None = None


def _define_worker() -> type:
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.draft_worker_common import (
        build_block_pos_offsets,
        make_draft_block_spec_info,
        make_draft_input_v2,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class DDTreeWorker(DFlashWorkerV2):
        """DFlash drafting, a DDTree of ``budget`` nodes, one tree verify per step."""

        def __init__(self, server_args: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(server_args, *args, **kwargs)
            # DFlashWorkerV2 takes its block from --speculative-num-draft-tokens; for DDTREE
            # that is the verify window (budget + 1) and the block is the drafter's.
            self.block_size = int(server_args.speculative_dflash_block_size)
            self.budget = int(server_args.speculative_num_draft_tokens) - 1
            self.window = self.budget + 1
            # Top-K per depth: the budget by default, which makes the tree exact.
            self.topk = int(getattr(server_args, "speculative_ddtree_topk", None) or self.budget)
            self._block_pos_offsets = build_block_pos_offsets(
                length=self.block_size, device=self.device
            )
            self._draft_block_spec_info = make_draft_block_spec_info(
                draft_token_num=self.block_size, device=self.device
            )
            self._generator = torch.Generator().manual_seed(int(server_args.random_seed or 0))
            self._timer = PhaseTimer.from_env(self.device, partial(logger.info, "DDTREE %s"))
            self._use_fused_kv_materialize = False
            self._fused_kv_helper = None
            self._draft_sampler = None
            # Token ids the target can emit (its LM head may carry padding rows beyond them).
            self.vocab_size = int(self.target_worker.model_runner.model_config.vocab_size)
            self._tp_group = get_tp_group()  # the LM head's vocabulary is split over its ranks
            graft = getattr(server_args, "speculative_ddtree_graft", "none")
            self._grafter = (
                Grafter(graft, self.vocab_size, device=self.device) if graft != "none" else None
            )
            logger.info(
                "DDTREE worker: budget %d (window %d), drafter block %d, top-K %d, graft %s, "
                "LM head over %d vocabulary shard(s)",
                self.budget,
                self.window,
                self.block_size,
                self.topk,
                graft,
                self._tp_group.world_size,
            )

        def init_cuda_graphs(self) -> None:
            self._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=False)

        def forward_batch_generation(
            self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None
        ) -> Any:
            if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
                if self._grafter is not None:
                    self._observe_prompts(batch.reqs)
                return super().forward_batch_generation(batch, on_publish, grammar_barrier)
            if batch.forward_mode.is_idle():
                return super().forward_batch_generation(batch, on_publish, grammar_barrier)
            if batch.has_grammar:
                raise NotImplementedError("DDTREE: grammar-constrained decoding is not supported")
            return self._decode_step(batch, on_publish)

        # --- one decode step --------------------------------------------------------------

        def _decode_step(self, batch: Any, on_publish: Any) -> Any:
            bs = len(batch.seq_lens)
            prefix_lens = batch.seq_lens.to(torch.int64)  # [bs] tokens in the KV cache
            bonus = batch.spec_info.bonus_tokens.to(torch.int64)  # [bs] slot-0 tokens
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            timer = self._timer
            timer.start()

            topk_logprobs, topk_tokens = self._draft_topk(batch, bonus, prefix_lens)
            timer.mark("draft")
            tree = build_ddtree(topk_logprobs, topk_tokens, self.budget, validate=False)
            if self._grafter is not None:
                tree = self._grafter.graft(tree, topk_logprobs, topk_tokens, bonus)
            layout = build_verify_layout(tree, bonus, prefix_lens)

            window_pos = prefix_lens[:, None] + torch.arange(self.window, device=self.device)
            window_locs = req_to_token[batch.req_pool_indices[:, None], window_pos].to(
                torch.int64
            )  # [bs, W] KV slots reserved for this step
            host_lens = self._host_prefix_lens(batch, prefix_lens)
            mask_size = self.window * int((host_lens + self.window).sum())  # FULL_MASK entries
            mask = torch.empty(mask_size, dtype=torch.bool, device=self.device)
            write_full_mask(layout.ancestor_mask, prefix_lens, mask)
            timer.mark("tree")
            logits_output, can_run_graph = self._verify(
                batch, layout.tokens, layout.positions, window_locs, mask
            )
            timer.mark("verify")
            logits = logits_output.next_token_logits  # [bs * W, V]
            if batch.sampling_info is not None:
                apply_dflash_verify_logits_adjustments(
                    next_token_logits=logits,
                    sampling_info=batch.sampling_info,
                    draft_token_num=self.window,
                )
            window_logits = logits.view(bs, self.window, -1)  # [bs, W, V]
            result = self._accept(batch, tree, window_logits, prefix_lens)
            if self._grafter is not None:
                self._grafter.learn(tree, layout.tokens, window_logits, result.committed_tokens)
            commit_lens = (result.accept_len + 1).to(torch.int32)  # [bs]
            # A path has at most min(L, budget) nodes after the root: P = min(L + 1, W) slots.
            path_width = min(result.accepted_slots.shape[1], self.window)
            path_slots = result.accepted_slots[:, :path_width]  # [bs, P] root first, then -1
            timer.mark("accept")

            self._keep_accepted_path(
                path_slots, window_locs, window_pos, logits_output.hidden_states, commit_lens
            )
            logits_output.hidden_states = None
            timer.mark("commit")
            timer.end_step(bs)

            new_seq_lens = prefix_lens + commit_lens.to(torch.int64)
            if on_publish is not None:
                on_publish(new_seq_lens)
            out_tokens = result.committed_tokens[:, :path_width].clamp_min(0)  # [bs, P]
            return GenerationBatchResult(
                logits_output=logits_output,
                next_token_ids=out_tokens.reshape(-1),
                accept_lens=commit_lens,
                can_run_cuda_graph=can_run_graph,
                next_draft_input=make_draft_input_v2(
                    bonus_tokens=result.bonus, new_seq_lens=new_seq_lens
                ),
                speculative_num_draft_tokens=path_width,
                new_seq_lens=new_seq_lens,
            )

        def _keep_accepted_path(
            self,
            path_slots: torch.Tensor,
            window_locs: torch.Tensor,
            window_pos: torch.Tensor,
            hidden_states: torch.Tensor,
            commit_lens: torch.Tensor,
        ) -> None:
            """Make the accepted path the request's next ``a + 1`` cached tokens.

            Args:
                path_slots: ``[bs, P]`` window slots of the path, root first, -1 after it.
                window_locs, window_pos: ``[bs, W]`` KV slots and positions of the window.
                hidden_states: ``[bs * W, H]`` the target's captured hidden states.
                commit_lens: ``[bs]`` int32 ``a + 1``.

            The target KV of path slot ``j`` moves to window slot ``j`` (position prefix + j);
            off the path the move is a no-op. The drafter's context KV for those positions is
            written from the path's target hidden states.
            """
            bs, width = path_slots.shape
            slots = path_slots.clamp_min(0)
            dst_locs = window_locs[:, :width]
            src_locs = torch.where(path_slots >= 0, window_locs.gather(1, slots), dst_locs)
            self.model_runner.token_to_kv_pool.move_kv_cache(dst_locs.flatten(), src_locs.flatten())
            hidden = hidden_states.view(bs, self.window, -1)
            path_hidden = hidden.gather(1, slots[:, :, None].expand(-1, -1, hidden.shape[-1]))
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=path_hidden.reshape(-1, hidden.shape[-1]),
                cache_loc=dst_locs.reshape(-1),
                cache_loc_2d=dst_locs,
                positions=window_pos[:, :width].reshape(-1),
                commit_lens=commit_lens,
            )

        def _observe_prompts(self, reqs: list[Any]) -> None:
            """Warm the successor table with the bigrams of the prompts being prefilled."""
            prompts = [list(req.origin_input_ids) for req in reqs]
            width = max((len(p) for p in prompts), default=0)
            if width < 2:
                return
            padded = torch.tensor([p + [-1] * (width - len(p)) for p in prompts])
            self._grafter.observe_prompts(padded.clamp_max(self.vocab_size - 1))

        @staticmethod
        def _host_prefix_lens(batch: Any, prefix_lens: torch.Tensor) -> torch.Tensor:
            """``[bs]`` prefix lengths on the host: the scheduler's copy, else one device read."""
            if batch.seq_lens_cpu is not None:
                return batch.seq_lens_cpu.to(torch.int64)
            return prefix_lens.cpu()

        def _draft_topk(
            self, batch: Any, bonus: torch.Tensor, prefix_lens: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """One drafter forward; top-K ``[bs, L, K]`` log-probs and ids of slots 1..L."""
            bs, block = bonus.shape[0], self.block_size
            block_ids = torch.full(
                (bs, block), int(self._mask_token_id), dtype=torch.int64, device=self.device
            )
            block_ids[:, 0] = bonus
            positions = prefix_lens[:, None] + self._block_pos_offsets  # [bs, block]
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            block_locs = req_to_token[batch.req_pool_indices[:, None], positions].to(torch.int64)
            target_model = self.target_worker.model_runner.model
            draft_dtype = next(self.draft_model.parameters()).dtype
            input_embeds = target_model.get_input_embeddings()(block_ids).to(draft_dtype)
            seq_lens_cpu = self._host_prefix_lens(batch, prefix_lens).to(torch.int32)
            forward_batch = ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY,
                batch_size=bs,
                input_ids=block_ids.flatten(),
                req_pool_indices=batch.req_pool_indices,
                seq_lens=prefix_lens,
                out_cache_loc=block_locs.flatten(),
                seq_lens_sum=int(seq_lens_cpu.sum()),
                seq_lens_cpu=seq_lens_cpu,
                positions=positions.flatten(),
                input_embeds=input_embeds.view(bs * block, -1),
                spec_algorithm=SpeculativeAlgorithm.DFLASH,
                spec_info=self._draft_block_spec_info,
                capture_hidden_mode=CaptureHiddenMode.NULL,
            )
            with torch.inference_mode():
                draft_out = self.draft_model_runner.forward(forward_batch)
                hidden = draft_out.logits_output.hidden_states.view(bs, block, -1)[:, 1:]
                return self._topk_of_lm_head(target_model.lm_head, hidden)

        def _topk_of_lm_head(
            self, lm_head: Any, hidden: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Top-K ``[bs, L, K]`` of the target's LM head on drafter states ``[bs, L, H]``.

            Under tensor parallelism the head is vocabulary-parallel: each rank multiplies by
            its own rows only and :func:`vocab_parallel_topk` merges the ranks' top-K with two
            ``[bs, L]`` all-reduces and one ``[bs, L, K]`` all-gather, never the dense logits.
            """
            k = min(self.topk, self.vocab_size)
            if self._tp_group.world_size == 1:
                weight = lm_head.weight[: self.vocab_size]  # [V, H] without padding rows
                return topk_from_logits(torch.matmul(hidden.to(weight.dtype), weight.T), k)
            # Rank r's rows are ids padded_start + j (the same count on every rank); ids at or
            # past the real vocabulary are padding and never drafted.
            shard = lm_head.shard_indices
            weight = lm_head.weight[: shard.num_org_elements_padded]  # [V_shard, H]
            return vocab_parallel_topk(
                torch.matmul(hidden.to(weight.dtype), weight.T),  # [bs, L, V_shard]
                k,
                vocab_start=int(shard.padded_org_vocab_start_index),
                vocab_size=self.vocab_size,
                group=self._tp_group.device_group,
            )

        def _verify(
            self,
            batch: Any,
            tokens: torch.Tensor,
            positions: torch.Tensor,
            window_locs: torch.Tensor,
            mask: torch.Tensor,
        ) -> tuple[Any, bool]:
            """One target forward over every request's ``W`` window slots with the tree mask."""
            verify_input = DFlashVerifyInput(
                draft_token=tokens.reshape(-1),
                positions=positions.reshape(-1),
                draft_token_num=self.window,
                custom_mask=mask,
                capture_hidden_mode=CaptureHiddenMode.FULL,
            )
            batch.out_cache_loc = window_locs.reshape(-1)
            seq_lens_cpu, seq_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
            if seq_lens_cpu is not None:
                batch.seq_lens_cpu = seq_lens_cpu + self.window
                batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
            forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
            out = self.target_worker.forward_batch_generation(
                batch=None,
                forward_batch=forward_batch,
                is_verify=True,
                skip_attn_backend_init=True,
            )
            return out.logits_output, bool(out.can_run_cuda_graph)

        def _accept(
            self, batch: Any, tree: Any, logits: torch.Tensor, prefix_lens: torch.Tensor
        ) -> Any:
            """Greedy or sampled acceptance of ``[bs, W, V]`` verify logits."""
            info = batch.sampling_info
            if info is None or info.is_all_greedy:
                return greedy_accept(tree, logits.argmax(dim=-1))
            return sample_accept(
                tree,
                logits,
                temperature=info.temperatures.view(-1),
                top_k=info.top_ks.view(-1),
                top_p=info.top_ps.view(-1),
                min_p=info.min_ps.view(-1) if info.need_min_p_sampling else 0.0,
                uniforms=self._coins(batch, prefix_lens),
            )

        def _coins(self, batch: Any, prefix_lens: torch.Tensor) -> torch.Tensor:
            """``[bs, L + 1]`` uniforms, one per depth: coin ``d`` draws the token after the
            root and ``d`` accepted drafts (see :func:`sample_accept`).

            A request with a sampling seed draws ``counter_uniforms(seed, prefix + d)``, keyed
            by the position the token is drawn at: the same coin for the same token whatever
            the tree, budget or batch, so its output is reproducible. Others draw from the
            worker's generator, seeded with ``--random-seed``.
            """
            seeds = [req.sampling_params.sampling_seed for req in batch.reqs]
            bs, depth_count = len(seeds), self.block_size  # L + 1 = the drafter's block
            fresh = torch.rand(bs, depth_count, generator=self._generator, dtype=torch.float64)
            if all(seed is None for seed in seeds):
                return fresh.to(self.device)
            seeded = torch.tensor([seed is not None for seed in seeds], device=self.device)
            seed_values = torch.tensor([seed or 0 for seed in seeds], device=self.device)
            positions = prefix_lens[:, None] + torch.arange(depth_count, device=self.device)
            return torch.where(
                seeded[:, None], counter_uniforms(seed_values, positions), fresh.to(self.device)
            )

    return DDTreeWorker
