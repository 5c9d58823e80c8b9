"""The reference engine's :class:`~sglang_tree_spec.step.StepBackend`: a transformers target
with a DynamicCache and a DFlash drafter with its context cache, for one batch of requests.

Cache layout (see :mod:`sglang_tree_spec.engine.kv`): request ``b`` owns columns
``0 .. prefix_lens[b] - 1`` of every layer; a verify appends the ``W`` window slots after the
longest row, and :meth:`TransformersBackend.keep` moves the accepted path behind each prefix.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from sglang_tree_spec.drafters.dflash import DFlashContextCache, DFlashDrafter
from sglang_tree_spec.engine.kv import keep_window_slots, select_requests, verify_attention_mask
from sglang_tree_spec.tree import VerifyLayout, topk_from_logits
from sglang_tree_spec.tree.draft_vocab import DraftVocab


class TransformersBackend:
    """Draft, verify and keep for the requests of one :meth:`SpecEngine.generate` call.

    Args:
        target: the transformers causal LM.
        drafter: the DFlash drafter, or None (plain decoding only).
        cache: the target's KV cache after the prefill.
        draft_cache: the drafter's context (None without a drafter).
        prefix_lens: ``[bs]`` cached tokens per request; updated by :meth:`keep`.
        draft_vocab: the draft top-K's vocabulary shortlist (None: the whole vocabulary).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDrafter | None,
        cache: DynamicCache,
        draft_cache: DFlashContextCache | None,
        prefix_lens: torch.Tensor,
        draft_vocab: DraftVocab | None = None,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.draft_vocab = draft_vocab
        self.cache, self.draft_cache = cache, draft_cache
        self.prefix_lens = prefix_lens
        self._past_len = 0  # cache columns before the last verify window
        self._hidden: tuple[torch.Tensor, ...] | None = None  # of the last verify

    def draft_topk(
        self, bonus: torch.Tensor, prefix_lens: torch.Tensor, k: int, depths: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self.drafter.block_token_ids(bonus)  # [bs, L + 1]
        embed = self.target.get_input_embeddings()
        head = self.target.get_output_embeddings()
        if self.draft_vocab is None:
            logits = self.draft_cache.draft_logits(blocks, embed, head, depths)  # [bs, D, V]
            return topk_from_logits(logits, k)
        weight, ids = self.draft_vocab.weight, self.draft_vocab.token_ids  # [S, H], [S]
        hidden = self.draft_cache.draft_hidden(blocks, embed)[:, 1 : depths + 1]  # [bs, D, H]
        logits = self.drafter.output_logits(torch.matmul(hidden.to(weight.dtype), weight.T))
        return topk_from_logits(logits, k, ids)

    def verify(self, layout: VerifyLayout, prefix_lens: torch.Tensor) -> torch.Tensor:
        self._past_len = self.cache.layers[0].keys.shape[2]
        mask = verify_attention_mask(
            prefix_lens, self._past_len, layout.ancestor_mask, self.target.dtype
        )
        out = self.target(
            input_ids=layout.tokens,
            attention_mask=mask,
            position_ids=layout.positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.drafter is not None,
        )
        self._hidden = out.hidden_states
        return out.logits  # [bs, W, V]

    def keep(self, path_slots: torch.Tensor, commit_lens: torch.Tensor) -> None:
        new_lens = keep_window_slots(self.cache, self.prefix_lens, self._past_len, path_slots)
        if self.drafter is not None:
            features = self.drafter.target_hidden_features(self._hidden)  # [bs, W, F]
            index = path_slots.clamp_min(0)[:, :, None].expand(-1, -1, features.shape[2])
            self.draft_cache.append(features.gather(1, index), commit_lens)
        self.prefix_lens, self._hidden = new_lens, None

    def keep_requests(self, index: torch.Tensor) -> None:
        """Keep only the requests at ``index`` (in that order), e.g. after some finished."""
        select_requests(self.cache, index)
        if self.draft_cache is not None:
            self.draft_cache.keep(index)
        self.prefix_lens = self.prefix_lens.index_select(0, index)
