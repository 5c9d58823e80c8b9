"""The DDTREE speculative worker: SGLang's DFlash worker with a tree verify.

Prefill is DFlash's own (the target captures its hidden states at the drafter's layers and
they are projected into the draft KV cache). Each decode step is
:func:`sglang_tree_spec.step.decode_step`, the step the reference engine runs too, over an
:class:`~sglang_tree_spec.plugin.backend.SGLangBackend` for the batch: draft a DFlash block,
select the tree (DDTree, or Graft's ``--speculative-ddtree-graft``), verify the window of
``budget + 1`` slots in one target forward, accept with the target's own rule, keep the
accepted path. The worker turns the result into SGLang's ``GenerationBatchResult``.

Every request keeps ``W`` verify slots, so shapes are fixed for a batch size and budget. The
worker runs at any ``--tp-size`` (the draft top-K is merged from the vocabulary shards of the
target's LM head), with or without SGLang's overlap scheduler. Under overlap SGLang runs step
``N + 1`` before it processes step ``N``'s result, as for its DFlash worker: the step's bonus
tokens and sequence lengths come from SGLang's ``FutureMap`` (``batch.spec_info``,
``batch.seq_lens``), the step publishes its new lengths (``on_publish``) and returns the next
draft input; what the worker reads from the host requests themselves is either fixed for the
request's life (sampling parameters, seeds, isolation keys) or corrected on the device for the
unprocessed step (penalties: :mod:`.pending`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from functools import cache, partial
from typing import Any

import torch

from sglang_tree_spec.control import LatencyModel, dflash_drafter
from sglang_tree_spec.control.latency import bs_buckets_for, device_spec, shape_of
from sglang_tree_spec.graft import TablePartitions
from sglang_tree_spec.host_copy import to_device
from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.backend import SGLangBackend
from sglang_tree_spec.plugin.compat import check_worker_attributes
from sglang_tree_spec.plugin.deferred import DeferredContext
from sglang_tree_spec.plugin.graphs import (
    DDTreeVerifyGraphs,
    closure_tree_graphs,
    cpu_verify_graphs_requested,
)
from sglang_tree_spec.plugin.logprobs import fill_decode_logprobs
from sglang_tree_spec.plugin.metrics import DDTreeMetrics
from sglang_tree_spec.plugin.penalties import batch_penalties, penalised
from sglang_tree_spec.plugin.pending import RecentOutputs
from sglang_tree_spec.plugin.samples import SampleNumbers, sample_index, sample_seed
from sglang_tree_spec.plugin.step_clock import StepClock
from sglang_tree_spec.plugin.validation import tree_config
from sglang_tree_spec.step import (
    Sampling,
    auto_overrides,
    decode_step,
    make_controller,
    make_selector,
)
from sglang_tree_spec.step_times import PhaseTimer, StepLog
from sglang_tree_spec.tree.draft_vocab import DraftVocab, check_token_map, draft_vocab

logger = logging.getLogger(__name__)
BUDGET_LOG_EVERY = 50  # decode steps between budget-control log lines (auto only)
# Benchmarks only: with this variable set to 1, a decode batch whose first request carries
# ``custom_params={"ddtree_budget": N}`` (N one of the server's candidate budgets) runs at the
# fixed budget N, the steps of a fixed-budget server, and on an auto server one carrying an
# ``auto:key=value`` string runs a second auto controller with those settings; so one server
# measures its own auto against its own fixed budgets and variants
# (``benchmarks/serve_throughput.py``'s ``ddtree:auto/N``): on this CPU two servers of one
# command differ by up to ~5% for a whole run, more than what sets auto apart from the best
# fixed budget. Off: the parameter is ignored.
PIN_ENV_FLAG = "SGLANG_TREE_SPEC_PIN_BUDGET"
PIN_PARAM = "ddtree_budget"
EAGER_DRAFT_ENV = "SGLANG_TREE_SPEC_EAGER_DRAFT"  # 1: no CUDA graph for the drafter's block
DRAFT_GRAPHS_LINE = "DDTREE drafter block: SGLang's draft graphs (as DFLASH's)"
# Tree graphs captured at start-up up to this batch size (larger ones on first use): ~25 shapes
# a size with six budgets, and SGLang's default capture sizes reach 256 on a large GPU.
TREE_GRAPHS_START_UP_MAX_BS = 64


def batch_sampling(batch: Any, device: torch.device | str) -> Sampling:
    """The :class:`Sampling` rule of a scheduled batch (SGLang's ``sampling_info``)."""
    info = batch.sampling_info
    bs = len(batch.reqs)
    if info is None or info.is_all_greedy:
        return Sampling.greedy(bs, device)
    seeds = [req.sampling_params.sampling_seed for req in batch.reqs]
    # n > 1: sample i of a seeded request draws its own coins (plugin/samples.py).
    seeds = [
        None if seed is None else sample_seed(seed, sample_index(req))
        for seed, req in zip(seeds, batch.reqs, strict=True)
    ]
    return Sampling(
        temperature=info.temperatures.view(-1),
        top_k=info.top_ks.view(-1),
        top_p=info.top_ps.view(-1),
        min_p=info.min_ps.view(-1) if info.need_min_p_sampling else torch.zeros(bs, device=device),
        seeds=to_device([seed or 0 for seed in seeds], device, torch.int64),
        seeded=to_device([seed is not None for seed in seeds], device, torch.bool),
        all_greedy=False,
        all_seeded=all(seed is not None for seed in seeds),
    )


def _metrics(server_args: Any, tp_rank: int) -> DDTreeMetrics | None:
    """DDTREE's Prometheus series when SGLang exports metrics (``--enable-metrics``), on TP
    rank 0 like SGLang's scheduler metrics."""
    if not getattr(server_args, "enable_metrics", False) or tp_rank != 0:
        return None
    return DDTreeMetrics(str(server_args.served_model_name))


class DDTreeWorkerMixin:
    """DFlash drafting, a tree of ``budget`` nodes, one tree verify per step: the methods of
    the DDTREE worker, over SGLang's ``DFlashWorkerV2`` (:func:`ddtree_worker_class`)."""

    def __init__(self, server_args: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(server_args, *args, **kwargs)
        check_worker_attributes(self)
        server_args = compat.resolved(server_args)  # 0.5.23: resolved values, a view
        self.config = tree_config(server_args)
        self._init_block(server_args)
        self._init_step_tools(server_args)
        self._init_selector()
        self.draft_vocab = self._draft_vocab(server_args)
        self._samples = SampleNumbers()  # n > 1: the sample index of seeded requests
        self._init_table(server_args)
        self._init_step_state(server_args)
        self._log_start(server_args)

    def _init_block(self, server_args: Any) -> None:
        """The drafter's block and SGLang's per-block draft inputs."""
        from sglang.srt.speculative.draft_worker_common import (
            build_block_pos_offsets,
            make_draft_block_spec_info,
        )

        # DFlashWorkerV2 takes its block from --speculative-num-draft-tokens; for DDTREE
        # that is the verify window (budget + 1) and the block is the drafter's.
        self.block_size = int(server_args.speculative_dflash_block_size)
        if compat.SERVES_DFLASH2[compat.release()]:  # DFlash2's convolutions run
            self.draft_model.set_block_size(self.block_size)  # over blocks of this size
        self.block_pos_offsets = build_block_pos_offsets(length=self.block_size, device=self.device)
        self.draft_block_spec_info = make_draft_block_spec_info(
            draft_token_num=self.block_size, device=self.device
        )

    def _init_step_tools(self, server_args: Any) -> None:
        """The coins' generator and the phase timer; DFlash's fused KV write and draft
        sampler off (DDTREE writes the drafter's KV and reads the block itself)."""
        # Unseeded rows' coins, drawn on the device (no host draw, no copy).
        self._generator = torch.Generator(device=self.device).manual_seed(
            int(server_args.random_seed or 0)
        )
        self._timer = PhaseTimer.from_env(self.device, partial(logger.info, "DDTREE %s"))
        self._use_fused_kv_materialize = False
        self._fused_kv_helper = None
        self._draft_sampler = None

    def _init_selector(self) -> None:
        """The target's vocabulary, its TP group and the tree selector (with its tree-build
        graphs where the selector has them)."""
        from sglang.srt.distributed import get_tp_group

        # Token ids the target can emit (its LM head may carry padding rows beyond them).
        self.vocab_size = int(self.target_worker.model_runner.model_config.vocab_size)
        self.tp_group = get_tp_group()  # the LM head's vocabulary is split over its ranks
        self._clock = StepClock(self.tp_group, self.config.auto)  # one clock for all ranks
        self.selector = make_selector(self.config, self.vocab_size, self.device)
        if self.device == "cpu" and cpu_verify_graphs_requested():
            self.selector = closure_tree_graphs(self.selector)
        tree_graphs = getattr(self.selector, "graphs", None)
        if tree_graphs is not None:
            logger.info(
                "DDTREE tree builds: one graph per (batch size, budget) (%s)",
                "CUDA graphs" if tree_graphs.mode == "cuda" else "closure replay",
            )

    def _init_table(self, server_args: Any) -> None:
        """Who shares Graft's successor table (``--speculative-ddtree-table``)."""
        self.table_mode = str(getattr(server_args, "speculative_ddtree_table", "shared"))
        self._table_owners = (
            TablePartitions(self.config.table_partitions)
            if self.table_mode != "shared" and self.config.graft != "none"
            else None
        )

    def _init_step_state(self, server_args: Any) -> None:
        """What the decode steps keep between them: controllers, pins, overlap bookkeeping,
        the step clock's open step, logs, graphs and metrics (most built on first use)."""
        self._controller = None  # built on first use: the request pool comes later
        self._pinned: dict[str, tuple[Any, StepLog | None]] | None = (
            {} if os.environ.get(PIN_ENV_FLAG) == "1" else None
        )
        self._recent: RecentOutputs | None = None  # likewise; kept under overlap only
        self._deferred: DeferredContext | None = None  # built at the first plain step
        self._deferred_sized = False
        self.overlap = not bool(server_args.disable_overlap_schedule)
        self._steps = 0
        # _time_steps: (controller, step log, bs, budget, drafted, forecast, forwards,
        # committed, calibrated, phases, reason, start)
        self._open_step: tuple | None = None
        self._label = "auto" if self.config.auto else str(self.config.budget)
        self._step_log = StepLog.from_env(self._label)  # None unless SGLANG_TREE_SPEC_STEP_LOG
        self.verify_graphs = None  # CPU closure replay, when asked (init_cuda_graphs)
        # Batches above the verify graphs' speculation cap take plain steps (init_cuda_graphs).
        self.speculation_cap: int | None = None
        self._native_controller = None
        self.metrics = _metrics(server_args, self.tp_group.rank_in_group)

    def _log_start(self, server_args: Any) -> None:
        """The worker's start-up line: method, budget, block, top-K, graft, vocabulary."""
        logger.info(
            "DDTREE worker: %s, budget %s, drafter block %d, top-K %d, graft %s%s, "
            "LM head over %d vocabulary shard(s)%s, overlap scheduling %s",
            self.config.method,
            f"auto over {self.config.budgets}" if self.config.auto else self.config.budget,
            self.block_size,
            self.config.k,
            self.config.graft,
            self._table_line(),
            self.tp_group.world_size,
            ""
            if self.draft_vocab is None
            else f", drafts from {server_args.speculative_token_map} "
            f"({self.draft_vocab.token_ids.numel()} ids a shard)",
            "on" if self.overlap else "off",
        )

    def _draft_vocab(self, server_args: Any) -> DraftVocab | None:
        """The draft top-K's shortlist of ``--speculative-token-map`` (None: the whole
        vocabulary), this rank's rows of the target's LM head
        (:mod:`sglang_tree_spec.tree.draft_vocab`)."""
        path = getattr(server_args, "speculative_token_map", None)
        if path is None:
            return None
        from sglang.srt.speculative.spec_utils import load_token_map

        source = f"--speculative-token-map {path}"
        ids = check_token_map(load_token_map(path), self.vocab_size, self.config.k, source)
        lm_head = self.target_worker.model_runner.model.lm_head
        if self.tp_group.world_size == 1:
            return draft_vocab(ids, lm_head.weight[: self.vocab_size], 0, self.vocab_size)
        shard = lm_head.shard_indices
        return draft_vocab(
            ids,
            lm_head.weight[: shard.num_org_elements_padded],
            int(shard.padded_org_vocab_start_index),
            self.vocab_size,
            self.tp_group.world_size,
        )

    @property
    def controller(self) -> Any:
        """The budget controller, one history slot per ``req_to_token`` row."""
        if self._controller is None:
            self._controller = make_controller(
                self.config,
                self.block_size - 1,
                int(self.model_runner.req_to_token_pool.req_to_token.shape[0]),
                self.device,
                self._latency_model() if self.config.auto else None,
            )
        return self._controller

    def step_controller(self, reqs: list[Any]) -> tuple[Any, StepLog | None]:
        """The decode step's budget controller and step log: the server's, or under
        :data:`PIN_ENV_FLAG` the one the batch's first request pins (:meth:`_pinned_controller`)
        with a step log of its own (``steps_<label>-pin<pin>_<pid>.csv``), one per pin,
        built at its first use. A pin that names neither is ignored, with a warning."""
        if self.speculation_cap is not None and len(reqs) > self.speculation_cap:
            return self.native_controller, self._step_log
        if self._pinned is None:
            return self.controller, self._step_log
        params = reqs[0].sampling_params.custom_params
        pin = params.get(PIN_PARAM) if isinstance(params, dict) else None
        if pin is None:
            return self.controller, self._step_log
        key = repr(pin)  # any JSON value (a list is not hashable)
        if key not in self._pinned:
            controller = self._pinned_controller(pin)
            if controller is None:
                logger.warning(
                    "DDTREE: %s=%s is neither one of the server's budgets %s nor, on an "
                    "auto server, an auto[:key=value...] variant: ignored",
                    PIN_PARAM, key, self.config.budgets,
                )  # fmt: skip
                self._pinned[key] = (self.controller, self._step_log)  # warned once
            else:
                label = str(pin).replace(":", "_").replace("=", "")
                log = StepLog.from_env(f"{self._label}-pin{label}")
                self._pinned[key] = (controller, log)
        return self._pinned[key]

    @property
    def native_controller(self) -> Any:
        """Budget 0 every step: a batch above the speculation cap decodes plainly (its
        tree verify's outputs would not fit the memory the capture plan allows)."""
        if self._native_controller is None:
            rows = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
            plain = replace(self.config, budget=0, auto=False, candidates=None)
            self._native_controller = make_controller(plain, self.block_size - 1, rows, self.device)
        return self._native_controller

    def _pinned_controller(self, pin: Any) -> Any:
        """A fixed controller at budget ``pin`` (one of the server's candidates), or on an
        auto server a second auto controller with ``pin``'s settings
        (``auto:hard=0``, :func:`~sglang_tree_spec.step.auto_overrides`; its own latency
        model and calibration): a variant measured in the same process as the server's
        own. None for anything else."""
        rows = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
        depth = self.block_size - 1
        if type(pin) is int and pin in self.config.budgets:
            fixed = replace(self.config, budget=pin, auto=False, candidates=None)
            return make_controller(fixed, depth, rows, self.device)
        if not isinstance(pin, str) or not self.config.auto:
            return None
        try:
            overrides = auto_overrides(pin)
            latency = self._latency_model()
            return make_controller(self.config, depth, rows, self.device, latency, overrides)
        except ValueError:
            return None

    @property
    def recent(self) -> RecentOutputs:
        """Every request row's output count and newest tokens (:mod:`.pending`); kept
        under overlap only (synchronous, ``req.output_ids`` is complete at every step)."""
        if self._recent is None:
            rows = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
            self._recent = RecentOutputs(rows, self.block_size, self.device)
        return self._recent

    def deferred_context(self, hidden: torch.Tensor | None = None) -> Any:
        """The plain steps' pending drafter context (:mod:`.deferred`), sized at the first
        call with the target's hidden states ``hidden [bs, W, Hc]``; None when a buffer of
        every request row would not fit its size limit (the context is then written every
        step, as DFlash does)."""
        if not self._deferred_sized and hidden is not None:
            rows = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
            per_token = hidden.shape[-1] * hidden.element_size()
            self._deferred = DeferredContext.for_pool(rows, per_token)
            self._deferred_sized = True
        return self._deferred

    def _latency_model(self) -> LatencyModel:
        """The roofline prior of this target and drafter on this device."""
        runner = self.target_worker.model_runner
        dtype_bytes = torch.finfo(next(runner.model.parameters()).dtype).bits // 8
        params = sum(p.numel() for p in runner.model.parameters())
        hf_config = runner.model_config.hf_config.to_dict()
        target = shape_of("target", hf_config, params, dtype_bytes)
        drafter_layers = self.draft_model_runner.model_config.hf_config.num_hidden_layers
        device = "cpu" if self.device == "cpu" else torch.cuda.get_device_name(self.device)
        return LatencyModel.from_roofline(
            target,
            device_spec(str(device)),
            self.config.budgets,
            drafter=dflash_drafter(target, drafter_layers),
            block=self.block_size,
            bs_buckets=bs_buckets_for(torch.device(self.device).type),
        )

    def _maybe_build_draft_sampler(self) -> None:
        """No greedy sampler in the drafter's graph: DDTREE reads the block's hidden
        states (its top-K comes from the target's LM head, ``SGLangBackend.draft_topk``)."""
        return None

    def init_cuda_graphs(self) -> None:
        """On CUDA the drafter's block is replayed from SGLang's draft graphs, captured
        as DFLASH captures them (without its sampler; ``SGLANG_TREE_SPEC_EAGER_DRAFT=1``:
        eager); on CPU it runs eagerly."""
        if self.device == "cpu" or os.environ.get(EAGER_DRAFT_ENV) == "1":
            self._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=False)
            logger.info("DDTREE drafter block: eager")
        else:
            super().init_cuda_graphs()
            logger.info(DRAFT_GRAPHS_LINE)
        # On CUDA SGLang has built the target's verify graphs by now (plugin/graphs.py,
        # through its decode graph runner hook); on CPU only when asked (tests), the same
        # runner replays its captured closures.
        if self.device == "cpu" and cpu_verify_graphs_requested():
            self.verify_graphs = DDTreeVerifyGraphs(self.target_worker.model_runner)
        self._capture_tree_graphs()

    def _capture_tree_graphs(self) -> None:
        """The tree builds and greedy acceptances of every budget, captured now at the
        verify graphs' batch sizes (padded to them as the verify is), not while serving
        (each capture waits for the device)."""
        tree_graphs = getattr(self.selector, "graphs", None)
        runner = self.verify_graphs or getattr(
            self.target_worker.model_runner, compat.MODEL_RUNNER_GRAPH_RUNNER, None
        )
        self.speculation_cap = getattr(runner, "speculation_cap", None)
        batch_sizes = getattr(runner, "capture_bs", None)
        if tree_graphs is None or not batch_sizes:
            return
        tree_graphs.set_batch_sizes(batch_sizes)
        with torch.no_grad():  # (not inference mode: steps write the static inputs)
            shapes = tree_graphs.capture_all(
                self.config.budgets, self.block_size - 1, self.selector.topk, self.device,
                max_batch_size=TREE_GRAPHS_START_UP_MAX_BS,
            )  # fmt: skip
        logger.info(
            "DDTREE tree graphs: %d shapes captured at start-up (batch sizes %s, up to %d)",
            shapes, tree_graphs.batch_sizes, TREE_GRAPHS_START_UP_MAX_BS,
        )  # fmt: skip

    def forward_batch_generation(
        self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None, **kwargs: Any
    ) -> Any:
        """Prefill and idle batches are DFlash's; decode batches run the tree step.
        (``kwargs``: later releases pass more, e.g. 0.5.23's ``pp_proxy_tensors``.)"""
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._extend(batch, on_publish, grammar_barrier, **kwargs)
        if batch.forward_mode.is_idle():
            self._open_step = None
            return super().forward_batch_generation(batch, on_publish, grammar_barrier, **kwargs)
        if batch.has_grammar and grammar_barrier is not None:
            grammar_barrier()  # the previous result's tokens into the grammars first
        return self._decode(batch, on_publish)

    def _extend(self, batch: Any, on_publish: Any, grammar_barrier: Any, **kwargs: Any) -> Any:
        """A prefill batch: the new requests' rows start afresh, then DFlash's prefill (ours
        where 0.5.17's refuses log-probs)."""
        self._open_step = None  # a prefill ends the run of back-to-back decode steps
        if self.metrics is not None:  # the decode steps so far, before new requests
            self.metrics.publish(self.controller.stats())
        self._bind_table(batch.reqs)
        self._samples.number(batch.reqs)
        self._observe_prompts(batch.reqs)
        rows = batch.req_pool_indices.to(torch.int64)
        self._reset_rows(rows, batch.reqs)
        outputs_before = [len(req.output_ids) for req in batch.reqs]
        if batch.return_logprob and compat.is_release("0.5.17"):
            out = self._prefill(batch, on_publish)  # 0.5.17's refuses log-probs
        else:
            out = super().forward_batch_generation(batch, on_publish, grammar_barrier, **kwargs)
        if self.overlap:
            self.recent.prefilled(rows, out.next_token_ids, outputs_before)
        return out

    def _reset_rows(self, rows: torch.Tensor, reqs: list[Any]) -> None:
        """Forget what earlier requests left in the rows ``rows [bs]`` the new ``reqs`` take:
        controller histories (the pinned ones' too) and the deferred drafter context."""
        self.controller.reset(rows)
        for pinned, _ in (self._pinned or {}).values():
            if pinned is not self.controller:  # (an ignored pin runs the server's)
                pinned.reset(rows)
        if self._deferred is not None:
            self._deferred.reset(compat.req_rows(reqs))

    def _prefill(self, batch: Any, on_publish: Any) -> Any:
        """DFlash's prefill with ``return_logprob`` (SGLang 0.5.17's DFlash worker refuses
        it): the target's prefill forward samples the first token and computes its
        log-probs and the prompt's, capturing the hidden states the drafter reads, which
        are projected into the draft KV cache at the prompt's slots."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

        out = self.target_worker.forward_batch_generation(
            batch, capture_hidden_mode=CaptureHiddenMode.FULL
        )
        out.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        device = out.next_token_ids.device
        positions = torch.cat(
            [
                torch.arange(start, start + length, device=device)
                for start, length in zip(batch.prefix_lens, batch.extend_lens, strict=True)
            ]
        )
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=out.logits_output.hidden_states,
            cache_loc=batch.out_cache_loc,
            positions=positions,
        )
        out.logits_output.hidden_states = None
        out.next_draft_input = make_draft_input_v2(
            bonus_tokens=out.next_token_ids, new_seq_lens=batch.seq_lens
        )
        return out

    def _decode(self, batch: Any, on_publish: Any) -> Any:
        """One tree step for a decode batch (:func:`~sglang_tree_spec.step.decode_step`),
        returned as SGLang's ``GenerationBatchResult``."""
        if batch.seq_lens.is_cuda:  # under overlap gathered on SGLang's schedule stream:
            # keep its memory from being reused there while this step still reads it
            batch.seq_lens.record_stream(torch.cuda.current_stream(batch.seq_lens.device))
        prefix_lens = batch.seq_lens.to(torch.int64)  # [bs] tokens in the KV cache
        backend, plain_forwards = self._step_backend(batch)
        self._bind_table(batch.reqs)
        start = self._time_steps()
        controller, step_log = self.step_controller(batch.reqs)
        result = decode_step(
            backend,
            self.selector,
            controller,
            batch_sampling(batch, self.device),
            batch.spec_info.bonus_tokens.to(torch.int64),  # [bs] slot-0 tokens
            prefix_lens,
            backend.rows,
            timer=self._timer,
            generator=self._generator,
            time_step=False,  # timed by _time_steps
            plain_forwards=plain_forwards,
        )
        bs = len(batch.reqs)
        self._open_step = self._step_record(controller, step_log, bs, result, start)
        self._log_budgets(bs)
        new_seq_lens = prefix_lens + result.commit_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._batch_result(batch, backend, result, new_seq_lens)

    def _step_backend(self, batch: Any) -> tuple[SGLangBackend, int | None]:
        """The step's backend over ``batch`` and its plain forwards (``control.PLAIN_FORWARDS``:
        1 where grammars or penalties cannot see past forward 1's token, else None)."""
        backend = SGLangBackend(self, batch)
        rows = backend.rows  # [bs] int64 request rows
        plain_forwards = None
        if backend.constrained:  # the grammars are not past forward 1's token
            plain_forwards = 1
        if any(penalised(req.sampling_params) for req in batch.reqs):
            plain_forwards = 1  # the host requests' penalty state lacks forward 1's token
            # req.output_ids lacks the previous step's tokens under overlap: the device
            # keeps them (RecentOutputs).
            recent = self.recent if self.overlap else None
            backend.penalties = partial(batch_penalties, batch.reqs, recent=recent, rows=rows)
        return backend, plain_forwards

    def _step_record(
        self, controller: Any, step_log: StepLog | None, bs: int, result: Any, start: float
    ) -> tuple:
        """What :meth:`_time_steps` closes the step with at the next one's start (the step
        log's device values kept only when there is a log)."""
        drafted = result.topk_logprobs is not None
        logged = step_log is not None
        committed = result.commit_lens if logged else None
        calibrated = result.calibrated if logged else None
        phases = self._timer.last_step if self._timer.enabled else None  # a new dict a step
        return (
            controller, step_log, bs, result.budget, drafted, result.forecast,
            result.forwards, committed, calibrated, phases, result.reason, start,
        )  # fmt: skip

    def _batch_result(
        self, batch: Any, backend: SGLangBackend, result: Any, new_seq_lens: torch.Tensor
    ) -> Any:
        """SGLang's ``GenerationBatchResult`` of the step: ``[bs * P]`` committed tokens
        (padding as token 0), their log-probs when asked, the next draft input."""
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

        out_tokens = result.committed_tokens.clamp_min(0)  # [bs, P]
        if self.overlap:
            self.recent.committed(backend.rows, out_tokens, result.commit_lens)
        if batch.return_logprob:
            width = out_tokens.shape[1]
            fill_decode_logprobs(
                batch,
                backend.logits_output,
                result.logits,
                result.accept.accepted_slots[:, :width],
                result.committed_tokens,
            )
        return GenerationBatchResult(
            logits_output=backend.logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=result.commit_lens.to(torch.int32),
            can_run_cuda_graph=backend.can_run_cuda_graph,
            next_draft_input=make_draft_input_v2(
                bonus_tokens=result.accept.bonus, new_seq_lens=new_seq_lens
            ),
            speculative_num_draft_tokens=out_tokens.shape[1],
            new_seq_lens=new_seq_lens,
        )

    def _time_steps(self) -> float:
        """The latency model's step time: from one decode step's start to the next one's,
        when nothing but the scheduler ran between them. That period is what a step costs
        the server (the scheduler's output processing and scheduling included, which the
        step alone would leave out), and it needs no device sync: the scheduler's own
        read of each step's tokens bounds it. Returns this step's start. With
        ``SGLANG_TREE_SPEC_STEP_LOG``, the closed step's line (:class:`StepLog`)."""
        now = time.perf_counter()
        if self._open_step is not None:
            (controller, step_log, bs, budget, drafted, forecast, forwards, committed,
             calibrated, phases, reason, start) = self._open_step  # fmt: skip
            elapsed = self._clock.elapsed(now - start, budget)
            controller.record_step(bs, budget, elapsed, drafted, forecast, forwards)
            if step_log is not None:
                tokens = int(committed.sum())
                sums = None if calibrated is None else calibrated.tolist()
                step_log.write(
                    bs, budget, drafted, forecast, forwards, tokens, elapsed, phases, sums,
                    reason,
                )  # fmt: skip
        return now

    def _log_budgets(self, bs: int) -> None:
        """Every ``BUDGET_LOG_EVERY`` steps: the metrics, and under auto a log line with
        the chosen budgets and the predicted vs observed accepted lengths (one device
        read)."""
        self._steps += 1
        if self._steps % BUDGET_LOG_EVERY or not (self.config.auto or self.metrics):
            return
        stats = self.controller.stats()
        if self.metrics is not None:
            self.metrics.publish(stats)
        if not self.config.auto:
            return
        logger.info(
            "DDTREE budgets over %d steps: %s, accept length predicted %.2f observed %.2f "
            "(+-%.2f, 95%%; all drafted steps %.2f), step time model error %.0f%%, at batch "
            "size %d (ms) %s",
            self._steps,
            stats.budget_counts,
            stats.mean_predicted_accept,
            stats.mean_calibrated_accept,
            1.96 * stats.accept_gap_stderr,
            stats.mean_observed_accept,
            100 * stats.latency_mean_abs_rel_error,
            bs,
            self.controller.latency_line(bs),
        )

    def _table_line(self) -> str:
        """How the graft table is shared, for the start-up line."""
        if self.config.graft == "none":
            return ""
        if self._table_owners is None:
            return ", table shared"
        return f", table {self.table_mode} ({self._table_owners.count} partitions)"

    def _bind_table(self, reqs: list[Any]) -> None:
        """``--speculative-ddtree-table per-key`` / ``off``: bind each request of the batch
        to its isolation key's partition of Graft's table (per-key: SGLang's prefix-cache
        key, ``extra_key`` / ``cache_salt``; off: the request itself)."""
        if self._table_owners is None:
            return
        if self.table_mode == "off":
            keys = [req.rid for req in reqs]
        else:
            keys = [compat.isolation_key(req) for req in reqs]
        partitions, reset = self._table_owners.assign(keys)
        self.selector.bind(torch.tensor(partitions, dtype=torch.int64), reset)

    def _observe_prompts(self, reqs: list[Any]) -> None:
        """Show the selector the prompts being prefilled (Graft warms its table)."""
        if self.selector is None:
            return
        prompts = [list(req.origin_input_ids) for req in reqs]
        width = max((len(p) for p in prompts), default=0)
        if width < 2:
            return
        padded = torch.tensor([p + [-1] * (width - len(p)) for p in prompts])
        self.selector.observe_prompts(padded.clamp_max(self.vocab_size - 1))


@cache
def ddtree_worker_class() -> type:
    """The DDTREE worker class: :class:`DDTreeWorkerMixin` over SGLang's ``DFlashWorkerV2``,
    defined on first use (SGLang's worker module is imported at run time, not with the plugin)."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    class DDTreeWorker(DDTreeWorkerMixin, DFlashWorkerV2):
        """DFlash drafting, a tree of ``budget`` nodes, one tree verify per step."""

    return DDTreeWorker
