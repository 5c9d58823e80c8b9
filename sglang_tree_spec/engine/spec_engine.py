"""Reference speculative decoding engine on PyTorch + transformers.

The oracle for the SGLang plugin and the project's CPU path: plain decoding (``ar``), the DFlash
single chain (``chain``), DDTree (``ddtree``) and DDTree with Graft's retrieval grafted in
(``ddtree-graft-stage``, ``ddtree-graft-unified``) over one batch of requests of different
lengths. Every decode step is :func:`sglang_tree_spec.step.decode_step`, the same function the
SGLang worker runs, over a :class:`~sglang_tree_spec.engine.backend.TransformersBackend`; this
module adds the prefill, stop tokens and length limits, and per-request statistics.

The bonus token of a step is the root of the next one: it is committed but not yet in the KV
cache. ``ar`` is the same step with budget 0 (a window of the root alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from sglang_tree_spec.config import METHODS, TreeConfig
from sglang_tree_spec.control import LatencyModel, dflash_drafter
from sglang_tree_spec.control.latency import bs_buckets_for, device_spec, shape_of
from sglang_tree_spec.drafters.dflash import DFlashDrafter
from sglang_tree_spec.engine.backend import TransformersBackend
from sglang_tree_spec.engine.kv import check_plain_cache, verify_attention_mask
from sglang_tree_spec.graft import StageConfig, stage_confidences
from sglang_tree_spec.step import Sampling, decode_step, make_controller, make_selector
from sglang_tree_spec.step_times import PHASES, PhaseTimer
from sglang_tree_spec.tree import counter_uniforms, sample_tokens
from sglang_tree_spec.tree.draft_vocab import check_token_map, draft_vocab

MAX_REQUESTS = 4096  # prompts per generate call (slots of the budget controller's history)


@dataclass
class RequestStats:
    """Per-request speculation statistics.

    Attributes:
        steps: decode steps (target forwards after the prefill).
        accept_hist: ``accept_hist[n]`` = steps that accepted ``n`` draft tokens.
        commit_lengths: tokens committed by each step in order (accepted drafts + bonus; the
            first entry is the prefill's token), before any cut at a stop token or the limit.
        budgets: the budget of each decode step (budget control may change it every step).
        seconds: wall time per phase (draft / select / verify / accept) of the batch steps the
            request took part in (the prefill counts as verify).
    """

    steps: int = 0
    accept_hist: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
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
    """The active requests. Tensors have the active batch as dim 0."""

    ids: list[int]  # request index of each row
    bonus: torch.Tensor  # [bs] committed token not yet in the cache (next root)
    seeds: torch.Tensor  # [bs] int64 sampling seed of each request
    backend: TransformersBackend  # caches and prefix lengths

    @property
    def size(self) -> int:
        return len(self.ids)


class SpecEngine:
    """Speculative decoding with a transformers target and a DFlash drafter.

    Args:
        target: a transformers causal LM (full attention), eval mode.
        drafter: a :class:`DFlashDrafter` for every method but ``ar``.
        method: one of :data:`~sglang_tree_spec.config.METHODS` (ignored when ``config`` is
            given).
        budget: DDTree node budget B (verify window B + 1); with ``auto``, the largest.
        auto: choose each step's budget (:mod:`sglang_tree_spec.control`).
        topk: tokens per drafted position (default: the budget; see :class:`TreeConfig`).
        stage: the stage rule of ``ddtree-graft-stage`` (calibrate it on training prompts), and
            the checkpoints :attr:`confidence_log` records.
        config: the tree configuration, instead of ``method`` / ``budget`` / ``topk``.

    Graft state, kept across :meth:`generate` calls and shared by all requests: ``grafter`` (a
    :class:`~sglang_tree_spec.graft.Grafter`, the step's selector) with its ``successors``
    table (warm-started from each prompt's bigrams) and, for ``ddtree-graft-unified``,
    ``edge_acceptance`` (its online edge probabilities), also exposed as attributes of the
    engine. Set ``confidence_log = []`` to record, for every speculative step,
    ``(stage_confidences [bs, C], accept_len [bs])`` (the input of
    :func:`~sglang_tree_spec.graft.calibrate_stage`). ``timer`` times every step's phases.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDrafter | None = None,
        method: str = "ddtree",
        budget: int = 64,
        topk: int | None = None,
        stage: StageConfig | None = None,
        config: TreeConfig | None = None,
        auto: bool = False,
        token_map: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        if config is None:
            if method not in METHODS:
                raise ValueError(f"method must be one of {METHODS}, got {method!r}")
            if not isinstance(budget, int) or budget < 1:
                raise ValueError(f"budget must be an int >= 1, got {budget!r}")
            config = TreeConfig.for_method(method, budget, topk, auto)
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        if config.drafts:
            if drafter is None:
                raise ValueError(f"method {config.method!r} needs a DFlash drafter")
            drafter.check_compatible(target.config)
            if drafter.config.vocab_size != self.vocab_size:
                raise ValueError(
                    f"drafter vocabulary {drafter.config.vocab_size} != target LM head "
                    f"{self.vocab_size}"
                )
        if not 1 <= config.k <= self.vocab_size:
            raise ValueError(f"topk must lie in [1, {self.vocab_size}], got {config.k}")
        self.target = target.eval()
        self.drafter = drafter.eval() if drafter is not None and config.drafts else None
        self.config = config
        self.method, self.budget, self.topk = config.method, config.budget, config.k
        self.device = target.device
        self.dtype = target.dtype
        self.stage = stage or StageConfig()
        self.selector = make_selector(config, self.vocab_size, self.device, self.stage)
        max_depth = drafter.block_size - 1 if drafter is not None else 0
        self.controller = make_controller(
            config, max_depth, MAX_REQUESTS, self.device, self._latency_model(config)
        )
        self.grafter = self.selector if config.graft != "none" else None
        self.successors = self.grafter.successors if self.grafter else None
        self.edge_acceptance = self.grafter.edge_acceptance if self.grafter else None
        self.confidence_log: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.timer = PhaseTimer(True, self.device, report=None)
        self.draft_vocab = None  # the draft top-K's shortlist (SGLang's --speculative-token-map)
        if token_map is not None and self.drafter is not None:
            ids = check_token_map(
                torch.as_tensor(token_map), self.vocab_size, self.topk, "token_map"
            )
            head = target.get_output_embeddings().weight.detach()
            self.draft_vocab = draft_vocab(ids, head, 0, self.vocab_size)

    def _latency_model(self, config: TreeConfig) -> LatencyModel | None:
        """The roofline prior of this target and drafter on this device (auto budget only)."""
        if not config.auto:
            return None
        dtype_bytes = torch.finfo(self.dtype).bits // 8
        params = sum(p.numel() for p in self.target.parameters())
        target = shape_of("target", self.target.config.to_dict(), params, dtype_bytes)
        drafter = dflash_drafter(target, self.drafter.config.num_hidden_layers)
        device = "cpu" if self.device.type == "cpu" else torch.cuda.get_device_name(self.device)
        return LatencyModel.from_roofline(
            target,
            device_spec(device),
            config.budgets,
            drafter=drafter,
            block=self.drafter.block_size,
            bs_buckets=bs_buckets_for(self.device.type),
        )

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
        self.controller.reset(torch.arange(len(prompts), device=self.device))
        stops = set(self._default_stops() if stop_token_ids is None else stop_token_ids)
        base_seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        sampling = (temperature, top_k, top_p)
        results: list[GenerationResult | None] = [None] * len(prompts)
        outputs: list[list[int]] = [[] for _ in prompts]
        if self.selector is not None:
            width = max(len(p) for p in prompts)
            padded = [p + [-1] * (width - len(p)) for p in prompts]
            self.selector.observe_prompts(torch.tensor(padded, device=self.device))
        stats = [RequestStats() for _ in prompts]

        batch = self._prefill(prompts, sampling, base_seed, stats)
        first = [[int(t)] for t in batch.bonus.tolist()]
        self._commit(batch, first, outputs, results, stats, stops, max_new_tokens)
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
        if len(prompts) > MAX_REQUESTS:
            raise ValueError(f"at most {MAX_REQUESTS} prompts per call, got {len(prompts)}")
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

    def _sampling(self, sampling, seeds: torch.Tensor) -> Sampling:
        """The engine's one sampling rule for every row, every row seeded."""
        temperature, top_k, top_p = sampling
        bs = seeds.shape[0]
        if temperature <= 0:
            return Sampling.greedy(bs, self.device)
        full = lambda value, dtype: torch.full((bs,), value, dtype=dtype, device=self.device)  # noqa: E731
        return Sampling(
            temperature=full(temperature, torch.float32),
            top_k=full(top_k, torch.long),
            top_p=full(top_p, torch.float32),
            min_p=full(0.0, torch.float32),
            seeds=seeds,
            seeded=full(True, torch.bool),
            all_greedy=False,
            all_seeded=True,
        )

    def _prefill(self, prompts, sampling, base_seed, stats) -> _Batch:
        """One target forward over the right-padded prompts; samples the first token."""
        self.timer.start()
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
        rule = self._sampling(sampling, seeds)
        last_logits = out.logits[torch.arange(bs), lengths - 1]  # [bs, V]
        coin = counter_uniforms(seeds, (lengths - 1).unsqueeze(1))[:, 0]
        bonus = sample_tokens(last_logits, rule.temperature, rule.top_k, rule.top_p, uniforms=coin)
        draft_cache = None
        if self.drafter is not None:
            draft_cache = self.drafter.new_cache(bs)
            features = self.drafter.target_hidden_features(out.hidden_states)
            draft_cache.append(features, lengths)
        self.timer.mark("verify")
        for i in range(bs):
            stats[i].seconds["verify"] += self.timer.last_step["verify"]
        backend = TransformersBackend(
            self.target, self.drafter, cache, draft_cache, lengths, self.draft_vocab
        )
        return _Batch(list(range(bs)), bonus, seeds, backend)

    def _step(self, batch: _Batch, sampling, stats) -> list[list[int]]:
        """One decode step (:func:`decode_step`); returns each row's committed tokens."""
        backend = batch.backend
        result = decode_step(
            backend,
            self.selector,
            self.controller,
            self._sampling(sampling, batch.seeds),
            batch.bonus,
            backend.prefix_lens,
            torch.tensor(batch.ids, device=self.device),
            timer=self.timer,
        )
        batch.bonus = result.accept.bonus
        if self.confidence_log is not None and result.topk_logprobs is not None:
            confidence = stage_confidences(result.topk_logprobs, self.stage.depths)
            self.confidence_log.append((confidence.cpu(), result.accept.accept_len.cpu()))
        lens = result.commit_lens.tolist()
        rows_out = result.committed_tokens.tolist()
        for row, request in enumerate(batch.ids):
            if result.forwards > 1:  # a plain step: each forward committed one token
                for _ in range(result.forwards):
                    stats[request].record(0)
            else:
                stats[request].record(lens[row] - 1)
            stats[request].budgets.append(result.budget)
            for phase, seconds in self.timer.last_step.items():
                stats[request].seconds[phase] += seconds
        return [rows_out[row][: lens[row]] for row in range(batch.size)]

    # ------------------------------------------------------------------------- bookkeeping

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
        batch.backend.keep_requests(index)
        return _Batch(
            ids=[batch.ids[row] for row in alive],
            bonus=batch.bonus.index_select(0, index),
            seeds=batch.seeds.index_select(0, index),
            backend=batch.backend,
        )
