"""Reference speculative decoding engine on PyTorch + transformers.

The oracle for the SGLang plugin and the project's CPU path: plain decoding (``ar``), the DFlash
single chain (``chain``), DDTree (``ddtree``) and DDTree with Graft's retrieval grafted in
(``ddtree-graft-stage``, ``ddtree-graft-unified``) over one batch of requests of different
lengths, all built on :mod:`sglang_tree_spec.tree` and :mod:`sglang_tree_spec.graft`.

One decode step for the active requests (bs of them):

1. draft   -- one drafter forward over ``[bonus, MASK x (L)]`` gives top-K marginals ``[bs, L, K]``;
2. select  -- the draft tree (``build_ddtree`` or ``build_chain``; for the graft methods, then
              ``graft_stage`` / ``graft_unified``) and its verify layout;
3. verify  -- one target forward over root + tree (``W = B + 1`` slots) with the ancestor mask,
              positions ``prefix_len + depth``;
4. accept  -- ``greedy_accept`` / ``sample_accept``; keep the accepted path's KV only; append the
              committed tokens' target hidden states to the drafter's context; graft methods
              refresh the successor table from the verify logits of every window slot.

The bonus token of a step is the root of the next one: it is committed but not yet in the KV
cache. ``ar`` is the same loop with an empty tree (a window of the root alone).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from sglang_tree_spec.drafters.dflash import DFlashContextCache, DFlashDrafter
from sglang_tree_spec.engine.kv import (
    check_plain_cache,
    keep_window_slots,
    select_requests,
    verify_attention_mask,
)
from sglang_tree_spec.graft import Grafter, StageConfig, stage_confidences
from sglang_tree_spec.tree import (
    DraftTree,
    build_chain,
    build_ddtree,
    build_verify_layout,
    counter_uniforms,
    greedy_accept,
    sample_accept,
    sample_tokens,
    topk_from_logits,
)

GRAFT_METHODS = ("ddtree-graft-stage", "ddtree-graft-unified")
METHODS = ("ar", "chain", "ddtree", *GRAFT_METHODS)
PHASES = ("draft", "select", "verify", "accept")


@dataclass
class RequestStats:
    """Per-request speculation statistics.

    Attributes:
        steps: decode steps (target forwards after the prefill).
        accept_hist: ``accept_hist[n]`` = steps that accepted ``n`` draft tokens.
        commit_lengths: tokens committed by each step in order (accepted drafts + bonus; the
            first entry is the prefill's token), before any cut at a stop token or the limit.
        seconds: wall time per phase (draft / select / verify / accept) of the batch steps the
            request took part in (the prefill counts as verify).
    """

    steps: int = 0
    accept_hist: list[int] = field(default_factory=list)
    commit_lengths: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def tau(self) -> float:
        """Mean tokens committed per step, the bonus included."""
        total = sum((n + 1) * count for n, count in enumerate(self.accept_hist))
        return total / max(self.steps, 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """``[d - 1]``: fraction of steps that accepted at least ``d`` draft tokens."""
        out, at_least = [], self.steps
        for count in self.accept_hist[:-1] if self.accept_hist else []:
            at_least -= count
            out.append(at_least / max(self.steps, 1))
        return out

    def record(self, accept_len: int) -> None:
        if accept_len >= len(self.accept_hist):
            self.accept_hist.extend([0] * (accept_len + 1 - len(self.accept_hist)))
        self.accept_hist[accept_len] += 1
        self.steps += 1


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded, stop token included) and statistics."""

    tokens: list[int]
    stats: RequestStats
    finish_reason: str  # "stop" or "length"


@dataclass
class _Batch:
    """State of the active requests. All tensors have the active batch as dim 0."""

    ids: list[int]  # request index of each row
    prefix_lens: torch.Tensor  # [bs] tokens in the target KV cache
    bonus: torch.Tensor  # [bs] committed token not yet in the cache (next root)
    cache: DynamicCache
    draft_cache: DFlashContextCache | None
    seeds: torch.Tensor  # [bs] int64 sampling seed of each request

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def past_len(self) -> int:
        return self.cache.layers[0].keys.shape[2]


class SpecEngine:
    """Speculative decoding with a transformers target and a DFlash drafter.

    Args:
        target: a transformers causal LM (full attention), eval mode.
        drafter: a :class:`DFlashDrafter` for every method but ``ar``.
        method: one of :data:`METHODS`.
        budget: DDTree node budget B (verify window B + 1).
        topk: tokens per drafted position for DDTree (default ``min(budget, 64)``).
        stage: the stage rule of ``ddtree-graft-stage`` (calibrate it on training prompts), and
            the checkpoints :attr:`confidence_log` records.
        successors_k: ranks per row of the successor table.

    Graft state, kept across :meth:`generate` calls and shared by all requests: ``grafter`` (a
    :class:`~sglang_tree_spec.graft.Grafter`) with its ``successors`` table (warm-started from
    each prompt's bigrams) and, for ``ddtree-graft-unified``, ``edge_acceptance`` (its online
    edge probabilities), also exposed as attributes of the engine. Set
    ``confidence_log = []`` to record, for every speculative step, ``(stage_confidences
    [bs, C], accept_len [bs])`` (the input of :func:`~sglang_tree_spec.graft.calibrate_stage`).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDrafter | None = None,
        method: str = "ddtree",
        budget: int = 64,
        topk: int | None = None,
        stage: StageConfig | None = None,
        successors_k: int = 8,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        if method != "ar":
            if drafter is None:
                raise ValueError(f"method {method!r} needs a DFlash drafter")
            drafter.check_compatible(target.config)
            if drafter.config.vocab_size != self.vocab_size:
                raise ValueError(
                    f"drafter vocabulary {drafter.config.vocab_size} != target LM head "
                    f"{self.vocab_size}"
                )
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be an int >= 1, got {budget!r}")
        topk = min(budget, 64) if topk is None else topk
        if not 1 <= topk <= self.vocab_size:
            raise ValueError(f"topk must lie in [1, {self.vocab_size}], got {topk}")
        self.target = target.eval()
        self.drafter = drafter.eval() if drafter is not None else None
        self.method = method
        self.budget = budget
        self.topk = topk
        self.device = target.device
        self.dtype = target.dtype
        self.stage = stage or StageConfig()
        self.grafter = (
            Grafter(
                method.removeprefix("ddtree-graft-"),
                self.vocab_size,
                successors_k,
                self.device,
                self.stage,
            )
            if method in GRAFT_METHODS
            else None
        )
        self.successors = self.grafter.successors if self.grafter else None
        self.edge_acceptance = self.grafter.edge_acceptance if self.grafter else None
        self.confidence_log: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    # ------------------------------------------------------------------------- public API

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[GenerationResult]:
        """Generate for a batch of token-id prompts (of any lengths).

        ``temperature = 0`` is greedy. ``stop_token_ids`` defaults to the target's EOS ids
        (pass ``[]`` to disable); a stop token is kept in the output. ``seed`` makes sampling
        reproducible: request ``i``'s coin for a token is a hash of (``seed + i``, its position),
        so every method (``ar`` included) samples the same tokens for the same seed.
        """
        prompts = [list(p) for p in prompts]
        self._check_request(prompts, max_new_tokens, temperature, top_p, top_k)
        stops = set(self._default_stops() if stop_token_ids is None else stop_token_ids)
        base_seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        sampling = (temperature, top_k, top_p)
        results: list[GenerationResult | None] = [None] * len(prompts)
        outputs: list[list[int]] = [[] for _ in prompts]
        if self.grafter is not None:
            width = max(len(p) for p in prompts)
            padded = [p + [-1] * (width - len(p)) for p in prompts]
            self.grafter.observe_prompts(torch.tensor(padded))
        stats = [RequestStats() for _ in prompts]

        batch = self._prefill(prompts, sampling, base_seed, stats)
        self._commit(
            batch,
            [[int(t)] for t in batch.bonus.tolist()],
            outputs,
            results,
            stats,
            stops,
            max_new_tokens,
        )
        batch = self._drop_finished(batch, results)
        while batch is not None:
            committed = self._step(batch, sampling, stats)
            self._commit(batch, committed, outputs, results, stats, stops, max_new_tokens)
            batch = self._drop_finished(batch, results)
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------------- checks

    def _check_request(self, prompts, max_new_tokens, temperature, top_p, top_k) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(
                f"bad sampling parameters: temperature={temperature}, top_p={top_p}, top_k={top_k}"
            )

    def _default_stops(self) -> list[int]:
        config = getattr(self.target, "generation_config", None) or self.target.config
        eos = getattr(config, "eos_token_id", None)
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    # ------------------------------------------------------------------------- phases

    def _timed(self, stats: list[RequestStats], batch_ids: list[int], phase: str, start: float):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        for i in batch_ids:
            stats[i].seconds[phase] += elapsed
        return time.perf_counter()

    def _prefill(self, prompts, sampling, base_seed, stats) -> _Batch:
        """One target forward over the right-padded prompts; samples the first token."""
        start = time.perf_counter()
        bs = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        input_ids = torch.zeros(bs, width, dtype=torch.long, device=self.device)
        for i, prompt in enumerate(prompts):
            input_ids[i, : len(prompt)] = torch.tensor(prompt, device=self.device)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        zero = torch.zeros(bs, dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.target.config)
        out = self.target(
            input_ids=input_ids,
            attention_mask=verify_attention_mask(zero, 0, causal.expand(bs, -1, -1), self.dtype),
            position_ids=torch.arange(width, device=self.device).expand(bs, width),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=self.drafter is not None,
        )
        check_plain_cache(cache)
        seeds = torch.arange(bs, device=self.device) + base_seed
        last_logits = out.logits[torch.arange(bs), lengths - 1]  # [bs, V]
        uniforms = self._coins(seeds, (lengths - 1).unsqueeze(1), sampling)[:, 0]
        bonus = sample_tokens(last_logits, *self._sampling_rows(sampling, bs), uniforms=uniforms)
        draft_cache = None
        if self.drafter is not None:
            draft_cache = self.drafter.new_cache(bs)
            features = self.drafter.target_hidden_features(out.hidden_states)
            draft_cache.append(features, lengths)
        self._timed(stats, list(range(bs)), "verify", start)
        return _Batch(list(range(bs)), lengths, bonus, cache, draft_cache, seeds)

    def _draft_tree(self, batch: _Batch) -> tuple[DraftTree, torch.Tensor]:
        """Draft a block from each bonus token and select the tree. ``[bs, B or L]``, and the
        drafter's top-K log-probs ``[bs, L, K]``."""
        blocks = self.drafter.block_token_ids(batch.bonus)
        embed, head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        topk = 1 if self.method == "chain" else self.topk
        lp, tok = topk_from_logits(batch.draft_cache.draft_logits(blocks, embed, head), topk)
        if self.method == "chain":
            return build_chain(lp, tok), lp
        tree = build_ddtree(lp, tok, self.budget, vocab_size=self.vocab_size, validate=False)
        if self.grafter is not None:
            tree = self.grafter.graft(tree, lp, tok, batch.bonus)
        return tree, lp

    def _step(self, batch: _Batch, sampling, stats) -> list[list[int]]:
        """One speculative (or plain) decode step; returns each row's committed tokens."""
        ids, bs = batch.ids, batch.size
        start = time.perf_counter()
        tree, draft_lp = self._draft_tree(batch) if self.method != "ar" else (None, None)
        start = self._timed(stats, ids, "draft", start)

        if tree is None:
            tokens = batch.bonus.view(bs, 1)
            positions = batch.prefix_lens.view(bs, 1)
            window_mask = torch.ones(bs, 1, 1, dtype=torch.bool, device=self.device)
        else:
            layout = build_verify_layout(tree, batch.bonus, batch.prefix_lens)
            tokens, positions, window_mask = layout.tokens, layout.positions, layout.ancestor_mask
        past_len = batch.past_len
        mask = verify_attention_mask(batch.prefix_lens, past_len, window_mask, self.dtype)
        start = self._timed(stats, ids, "select", start)

        out = self.target(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
            output_hidden_states=tree is not None,
        )
        start = self._timed(stats, ids, "verify", start)

        # A coin per token this step can commit, keyed by the position it is drawn at (the
        # root's, prefix_len, plus its depth): every method draws the same token there.
        depth_count = 1 if tree is None else tree.max_depth + 1
        positions = batch.prefix_lens.unsqueeze(1) + torch.arange(depth_count, device=self.device)
        uniforms = self._coins(batch.seeds, positions, sampling)  # [bs, L + 1]
        rows = self._sampling_rows(sampling, bs)
        if tree is None:
            bonus = sample_tokens(out.logits[:, 0], *rows, uniforms=uniforms[:, 0])
            path = torch.zeros(bs, 1, dtype=torch.long, device=self.device)
            accept_len = torch.zeros(bs, dtype=torch.long, device=self.device)
            committed = bonus.view(bs, 1)
        else:
            if sampling[0] <= 0:
                result = greedy_accept(tree, out.logits.argmax(dim=-1))
            else:
                result = sample_accept(tree, out.logits, *rows, uniforms=uniforms)
            bonus, path, accept_len = result.bonus, result.accepted_slots, result.accept_len
            committed = result.committed_tokens  # the accepted drafts, then the bonus
            if self.grafter is not None:
                self.grafter.learn(tree, tokens, out.logits, committed)
            if self.confidence_log is not None:
                confidence = stage_confidences(draft_lp, self.stage.depths)
                self.confidence_log.append((confidence.cpu(), accept_len.cpu()))
        new_lens = keep_window_slots(batch.cache, batch.prefix_lens, past_len, path)
        if tree is not None:
            features = self.drafter.target_hidden_features(out.hidden_states)  # [bs, W, F]
            index = path.clamp_min(0)[:, :, None].expand(-1, -1, features.shape[2])
            batch.draft_cache.append(features.gather(1, index), new_lens - batch.prefix_lens)
        batch.prefix_lens, batch.bonus = new_lens, bonus
        self._timed(stats, ids, "accept", start)

        lens = (accept_len + 1).tolist()
        rows_out = committed.tolist()
        for row, request in enumerate(ids):
            stats[request].record(lens[row] - 1)
        return [rows_out[row][: lens[row]] for row in range(bs)]

    # ------------------------------------------------------------------------- bookkeeping

    def _coins(self, seeds: torch.Tensor, positions: torch.Tensor, sampling) -> torch.Tensor:
        """``[bs, n]`` uniforms for the tokens drawn at ``positions`` ``[bs, n]``: a hash of
        (request seed, position), so a request draws the same coin for the same token whatever
        batch, method or tree it runs with. Greedy decoding uses no coin: zeros."""
        if sampling[0] <= 0:
            return torch.zeros(positions.shape, dtype=torch.float64, device=self.device)
        return counter_uniforms(seeds, positions)

    def _sampling_rows(self, sampling, bs: int) -> tuple[torch.Tensor, ...]:
        temperature, top_k, top_p = sampling
        full = lambda value, dtype: torch.full((bs,), value, dtype=dtype, device=self.device)  # noqa: E731
        return full(temperature, torch.float32), full(top_k, torch.long), full(top_p, torch.float32)

    def _commit(self, batch, committed, outputs, results, stats, stops, max_new_tokens) -> None:
        """Append committed tokens, cutting at a stop token or the length limit."""
        for row, request in enumerate(batch.ids):
            stats[request].commit_lengths.append(len(committed[row]))
            for token in committed[row]:
                outputs[request].append(token)
                reason = "stop" if token in stops else None
                if reason is None and len(outputs[request]) >= max_new_tokens:
                    reason = "length"
                if reason is not None:
                    results[request] = GenerationResult(outputs[request], stats[request], reason)
                    break

    def _drop_finished(self, batch: _Batch, results) -> _Batch | None:
        """Remove finished requests from the batch; ``None`` when none is left."""
        alive = [row for row, request in enumerate(batch.ids) if results[request] is None]
        if not alive:
            return None
        if len(alive) == batch.size:
            return batch
        index = torch.tensor(alive, device=self.device)
        select_requests(batch.cache, index)
        if batch.draft_cache is not None:
            batch.draft_cache.keep(index)
        return _Batch(
            ids=[batch.ids[row] for row in alive],
            prefix_lens=batch.prefix_lens.index_select(0, index),
            bonus=batch.bonus.index_select(0, index),
            cache=batch.cache,
            draft_cache=batch.draft_cache,
            seeds=batch.seeds.index_select(0, index),
        )
