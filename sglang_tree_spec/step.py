"""One speculative decode step, written once for the reference engine and the SGLang worker.

Pure torch: no SGLang, no transformers. The engine (:mod:`sglang_tree_spec.engine`) and the
worker (:mod:`sglang_tree_spec.plugin.worker`) each supply a :class:`StepBackend`, the four
operations that touch their models and caches, and call :func:`decode_step`:

    draft top-K -> choose budget -> select tree -> layout -> verify -> accept -> learn -> keep

The step asks the budget controller for a plan (draft or not; a held budget, or the width to
forecast from), resolves a forecasting plan from the widest tree, and hands back the outcome:
three controller calls (:mod:`sglang_tree_spec.control.plan`). A step that does not draft
(budget 0) runs ``control.PLAIN_FORWARDS`` plain target forwards instead, one token a request
each, reported as the chain they amount to.

Sizes: ``bs`` requests, ``L`` drafted depths (the drafter's block - 1, at most the largest
budget), ``K`` top-K per depth, ``B`` tree budget, ``W = B + 1`` verify-window slots (the root,
i.e. the last bonus token, is slot 0), ``P = min(L, B) + 1`` slots of the longest path, ``V``
vocabulary.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from sglang_tree_spec.config import TreeConfig
from sglang_tree_spec.control import (
    PLAIN_FORWARDS,
    BudgetController,
    ControlConfig,
    Forecast,
    LatencyModel,
    StepOutcome,
    top_nodes,
)
from sglang_tree_spec.step_times import PhaseTimer
from sglang_tree_spec.tree import (
    AcceptResult,
    DraftTree,
    VerifyLayout,
    build_ddtree,
    build_verify_layout,
    counter_uniforms,
    greedy_accept,
    sample_accept,
)
from sglang_tree_spec.tree.graphs import TreeGraphs
from sglang_tree_spec.tree.select import (
    ChainSelector,
    DDTreeSelector,
    TreeSelector,
    empty_tree,
)


class StepBackend(Protocol):
    """The model-side operations of a decode step (an engine's or a server's)."""

    def draft_topk(
        self, bonus: torch.Tensor, prefix_lens: torch.Tensor, k: int, depths: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward over ``[bonus, MASK x L]``: top-K ``[bs, D, K]`` log-probs
        (sorted descending) and token ids of the first ``D = min(L, depths)`` drafted depths
        (a tree of ``B`` nodes is at most ``B`` deep: the LM head skips the deeper slots)."""
        ...

    def verify(self, layout: VerifyLayout, prefix_lens: torch.Tensor) -> torch.Tensor:
        """One target forward over the ``[bs, W]`` window with the tree's ancestor mask,
        writing the window's KV; ``[bs, W, V]`` logits under the target's logit processors."""
        ...

    def keep(self, path_slots: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """Make the accepted path the requests' next cached tokens: window slot
        ``path_slots[b, j]`` (``[bs, P]``, -1 past the path) becomes position ``prefix + j``
        for ``j < commit_lens[b]``, in the target's KV and the drafter's context."""
        ...


@dataclass(frozen=True)
class Sampling:
    """The target's decoding rule for each row of the batch.

    Attributes:
        temperature, top_k, top_p, min_p: ``[bs]`` as SGLang's sampler reads them
            (temperature <= 0: greedy row).
        seeds: ``[bs]`` int64; a seeded row's coin for the token at position ``p`` is
            ``counter_uniforms(seed, p)``: the same token whatever the tree, budget or batch.
        seeded: ``[bs]`` bool; unseeded rows draw fresh coins from the step's generator (on
            the device where the generator is: the worker's is, so no coin is copied).
        all_greedy: every row greedy (no coins, no probabilities).
        all_seeded: every row seeded (host flag: no generator draw).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    seeded: torch.Tensor
    all_greedy: bool
    all_seeded: bool

    @classmethod
    def greedy(cls, batch_size: int, device: torch.device | str) -> Sampling:
        """The all-greedy rule of ``batch_size`` rows: one per size and device, shared (its
        tensors are never written), so a greedy step makes none."""
        return _greedy_sampling(batch_size, str(torch.device(device)))

    def coins(
        self, prefix_lens: torch.Tensor, depth_count: int, generator: torch.Generator | None
    ) -> torch.Tensor:
        """``[bs, depth_count]`` float64 uniforms: coin ``d`` draws the token at position
        ``prefix + d`` (the root's prediction is depth 0)."""
        depth = torch.arange(depth_count, device=prefix_lens.device)
        keyed = counter_uniforms(self.seeds, prefix_lens[:, None] + depth)
        if self.all_seeded:
            return keyed
        device = keyed.device if generator is None else generator.device  # (no host copy)
        fresh = torch.rand(keyed.shape, generator=generator, dtype=torch.float64, device=device)
        return torch.where(self.seeded[:, None], keyed, fresh.to(keyed.device))

    def accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        prefix_lens: torch.Tensor,
        generator: torch.Generator | None,
        graphs: TreeGraphs | None = None,
    ) -> AcceptResult:
        """The target's own rule on ``[bs, W, V]`` verify logits (greedy, or sampled); a greedy
        tree's acceptance replayed from ``graphs`` when given."""
        if self.all_greedy:
            if graphs is not None and tree.budget > 0:
                return graphs.greedy_accept_logits(tree, logits)
            return greedy_accept(tree, logits.argmax(dim=-1))
        return sample_accept(
            tree,
            logits,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            uniforms=self.coins(prefix_lens, tree.max_depth + 1, generator),
        )


@functools.lru_cache(maxsize=256)
def _greedy_sampling(batch_size: int, device: str) -> Sampling:
    zeros = torch.zeros(batch_size, device=device)
    long = torch.zeros(batch_size, dtype=torch.long, device=device)
    return Sampling(zeros, long, zeros + 1, zeros, long, long.bool(), True, True)


@dataclass(frozen=True)
class StepResult:
    """What one decode step committed.

    Attributes:
        tree: the ``[bs, B]`` verified trees.
        accept: the acceptance (``accept_len``, ``bonus``, paths and committed tokens).
        commit_lens: ``[bs]`` int64 tokens committed (accepted drafts + the bonus).
        committed_tokens: ``[bs, P]`` int64, -1 after ``commit_lens``.
        topk_logprobs: ``[bs, L, K]`` the drafter's top-K log-probs (None when not drafted).
        budget: the step's budget (0: a plain step).
        forecast: the budget was chosen by a forecast this step (auto, not held).
        logits: ``[bs, W, V]`` the verify logits the acceptance read (log-probs come from them).
        forwards: target forwards the step ran: 1 when drafted; a plain step's forwards, each
            committing one token a request (``accept`` then reports them as an accepted chain).
        calibrated: ``[2]`` the step's predicted and accepted draft tokens summed over its
            requests when the budget controller calibrated on it (a sampled drafted step; a
            grafted tree's forecast step), else None.
        reason: why the step has its budget (``BudgetController.reason``, one of
            ``control.REASONS``).
    """

    tree: DraftTree
    accept: AcceptResult
    commit_lens: torch.Tensor
    committed_tokens: torch.Tensor
    topk_logprobs: torch.Tensor | None
    budget: int
    forecast: bool
    logits: torch.Tensor
    forwards: int
    calibrated: torch.Tensor | None
    reason: str


def decode_step(
    backend: StepBackend,
    selector: TreeSelector | None,
    controller: BudgetController,
    sampling: Sampling,
    bonus: torch.Tensor,
    prefix_lens: torch.Tensor,
    rows: torch.Tensor,
    *,
    timer: PhaseTimer,
    generator: torch.Generator | None = None,
    time_step: bool = True,
    plain_forwards: int | None = None,
) -> StepResult:
    """Draft, choose the budget, select, verify, accept and keep one step for ``bs`` requests.

    Args:
        backend: the model-side operations.
        selector: the tree selector; ``None`` runs plain steps (the root alone is verified).
        controller: the step's budget, fixed or chosen for the whole batch from the predicted
            accepted tokens per second (every request of a step has the same budget, so a
            batch size and budget are one fixed shape); it learns from every step.
        sampling: the target's decoding rule per row.
        bonus: ``[bs]`` int64 the last committed token of each request (not yet cached).
        prefix_lens: ``[bs]`` int64 tokens in each request's KV cache.
        rows: ``[bs]`` int64 each request's slot in the controller's per-request history.
        timer: marks the phases (``step_times.PHASES``: draft, tree, verify, accept, commit,
            observe).
        generator: coins of unseeded sampled rows.
        time_step: record this step's wall time in the controller's latency model; False
            when the caller measures the step itself (the SGLang worker times the period from
            one decode step to the next: the scheduler's own per-step work included, and no
            device sync of its own).
        plain_forwards: target forwards of a step that does not draft (None:
            ``PLAIN_FORWARDS``; 1 when a later forward's logit processing would need the tokens
            of the earlier ones, e.g. penalties read from the host requests).
    """
    bs = bonus.shape[0]
    start = time.perf_counter()
    timer.start()
    plan = controller.plan(bs, drafts=selector is not None)
    topk_logprobs, forecast, budget, forwards = None, None, plan.budget, 1
    if plan.draft:
        topk_logprobs, topk_tokens = _draft(backend, selector, bonus, prefix_lens, plan, timer)
        drafted = (selector, topk_logprobs, topk_tokens, bonus)
        if plan.forecasts:  # one tree at the width; every candidate up to it nests in it
            largest = _largest_tree(*drafted, plan.width)
            forecast = controller.resolve(plan, rows, largest)  # the step's one host read
            budget, tree = forecast.budget, _tree_at(forecast, largest, *drafted)
        else:
            tree = selector.select(topk_logprobs, topk_tokens, bonus, budget)  # [bs, B]
        graphs = getattr(selector, "graphs", None)  # the tree's graphs (DDTree on CUDA)
        lay_out = build_verify_layout if graphs is None else graphs.verify_layout
        layout = lay_out(tree, bonus, prefix_lens)  # [bs, W] tokens and positions
        timer.mark("tree")
        accept, commit_lens, logits = _verify(
            backend, selector, sampling, tree, layout, prefix_lens, generator, timer, graphs
        )
    else:
        forwards = PLAIN_FORWARDS if plain_forwards is None else plain_forwards
        tree, accept, commit_lens, logits = _plain(
            backend, selector, sampling, bonus, prefix_lens, forwards, generator, timer
        )
    nested = selector is not None and selector.nested
    outcome = StepOutcome(plan, rows, budget, tree, accept.accept_len, forecast, forwards, nested)
    calibrated = controller.outcome(outcome, start if time_step else None)
    if plan.draft:
        timer.mark("observe")
    timer.end_step(bs)
    return _result(outcome, accept, commit_lens, topk_logprobs, logits, calibrated)


def _draft(backend, selector, bonus, prefix_lens, plan, timer):
    """The drafter's top-K ``[bs, D, K]`` log-probs and tokens for a tree of ``plan.width``
    nodes at most."""
    topk = _draft_topk(selector, plan.width)
    drafted = backend.draft_topk(bonus, prefix_lens, topk, plan.width)
    timer.mark("draft")
    return drafted


def _result(outcome: StepOutcome, accept, commit_lens, topk_logprobs, logits, calibrated):
    tree = outcome.tree
    path_width = min(tree.max_depth, tree.budget) + 1  # P
    return StepResult(
        tree,
        accept,
        commit_lens,
        accept.committed_tokens[:, :path_width],
        topk_logprobs,
        outcome.budget,
        outcome.forecast is not None,
        logits,
        outcome.forwards,
        calibrated,
        outcome.plan.reason,
    )


def _verify(backend, selector, sampling, tree, layout, prefix_lens, generator, timer, graphs):
    """Verify ``tree`` laid out as ``layout`` in one target forward, accept with the target's
    rule, let the selector learn and keep the accepted path: ``(AcceptResult, [bs] commit
    lengths, [bs, W, V] logits)``."""
    logits = backend.verify(layout, prefix_lens)  # [bs, W, V]
    timer.mark("verify")
    accept = sampling.accept(tree, logits, prefix_lens, generator, graphs)
    if selector is not None:  # a plain forward too: Graft's table learns the root's successors
        selector.learn(tree, layout.tokens, logits, accept.committed_tokens)
    timer.mark("accept")
    path_width = min(tree.max_depth, tree.budget) + 1  # P
    commit_lens = accept.accept_len + 1  # [bs] accepted drafts + the bonus
    backend.keep(accept.accepted_slots[:, :path_width], commit_lens)
    timer.mark("commit")
    return accept, commit_lens, logits


@dataclass(frozen=True)
class _PlainShape:
    """The tensors a plain step of ``bs`` requests and ``forwards`` forwards reuses: one per
    shape and device, shared and never written, so its forwards build no tree, mask or path.

    Attributes:
        root: the empty ``[bs, 0]`` tree (each forward verifies its root alone).
        root_mask: ``[bs, 1, 1]`` bool, the root sees itself.
        one: ``[bs]`` int64 ones, tokens each forward commits.
        commit_lens: ``[bs]`` int64 ``forwards``, tokens the step commits.
        chain: the ``[bs, forwards - 1]`` chain the forwards amount to, less its tokens.
        accept_len: ``[bs]`` int64 ``forwards - 1``: every chain node accepted.
        path: ``[bs, forwards]`` int64 the chain's window slots, root first.
    """

    root: DraftTree
    root_mask: torch.Tensor
    one: torch.Tensor
    commit_lens: torch.Tensor
    chain: DraftTree
    accept_len: torch.Tensor
    path: torch.Tensor


@functools.lru_cache(maxsize=256)
def _plain_shape(bs: int, forwards: int, device: str) -> _PlainShape:
    nodes = forwards - 1
    long = functools.partial(torch.zeros, dtype=torch.long, device=device)
    depth = torch.arange(1, nodes + 1, device=device).expand(bs, nodes)
    chain = DraftTree(
        tokens=long(bs, nodes),  # (each step's own tokens replace these)
        parents=depth - 2,
        depths=depth,
        logprobs=torch.zeros(bs, nodes, device=device),
        valid=torch.ones(bs, nodes, dtype=torch.bool, device=device),
        max_depth=nodes,
    )
    return _PlainShape(
        root=empty_tree(bs, device),
        root_mask=torch.ones(bs, 1, 1, dtype=torch.bool, device=device),
        one=long(bs) + 1,
        commit_lens=long(bs) + forwards,
        chain=chain,
        accept_len=long(bs) + nodes,
        path=torch.arange(forwards, device=device).repeat(bs, 1),
    )


def _plain(backend, selector, sampling, bonus, prefix_lens, forwards, generator, timer):
    """``forwards`` plain target forwards (the root alone, one token a request each), reported
    as the step that verified the chain of their tokens: ``(tree [bs, forwards - 1], accept,
    commit_lens [bs], logits [bs, forwards, V])`` with every node accepted. The same tokens
    as ``forwards`` one-forward steps: forward ``i`` reads position ``prefix + i``'s coin.
    Nothing but the forwards, their acceptance and the kept tokens runs
    (:class:`_PlainShape`)."""
    shape = _plain_shape(bonus.shape[0], forwards, str(bonus.device))
    tokens, logits = [bonus], []
    for i in range(forwards):
        prefix = prefix_lens + i if i else prefix_lens  # [bs] cached tokens before forward i
        root = tokens[-1][:, None]  # [bs, 1]
        layout = VerifyLayout(tokens=root, ancestor_mask=shape.root_mask, positions=prefix[:, None])
        forward_logits = backend.verify(layout, prefix)  # [bs, 1, V]
        timer.mark("verify")
        accept = sampling.accept(shape.root, forward_logits, prefix, generator)
        if selector is not None:  # Graft's table learns the root's successors
            selector.learn(shape.root, root, forward_logits, accept.committed_tokens)
        timer.mark("accept")
        backend.keep(accept.accepted_slots, shape.one)  # [bs, 1]: the root, in place
        timer.mark("commit")
        tokens.append(accept.bonus)
        # a replayed verify's logits live in its graph's static output, which the next forward
        # (the same shape) overwrites: the earlier forwards' are copied out for the log-probs
        last = i == forwards - 1
        logits.append(forward_logits if last else forward_logits.clone())
    if forwards == 1:
        return shape.root, accept, shape.commit_lens, logits[0]
    committed = torch.stack(tokens[1:], dim=1)  # [bs, forwards]
    chain = replace(shape.chain, tokens=committed[:, :-1])
    accept = AcceptResult(shape.accept_len, committed[:, -1], shape.path, committed)
    return chain, accept, shape.commit_lens, torch.cat(logits, dim=1)


def _draft_topk(selector: TreeSelector, width: int) -> int:
    """K, the tokens per drafted depth a step drafts when its tree has at most ``width``
    nodes. A nested selector (DDTree) reads the top ``width`` alone: a rank-r token is in the
    ``width`` best prefixes only if the r - 1 better siblings are (``build_ddtree`` cuts to
    them), so drafting more is wasted top-K work over the vocabulary. Auto's K is its largest
    candidate's: on its held steps at a smaller budget it drafted top-32 for a tree of 4-8
    nodes (the draft phase of a fixed B 8 server does top-8). Another selector's K stands (a
    grafted tree looks its grafted tokens up in the drafter's whole top-K)."""
    if not selector.nested:
        return selector.topk
    return max(1, min(selector.topk, width))


def _largest_tree(selector, topk_logprobs, topk_tokens, bonus, budget) -> DraftTree:
    """The tree the forecast reads: the selector's own at ``budget`` when its smaller trees
    nest in it (DDTree), else the DDTree (a grafted tree's log-probs are not acceptance
    estimates)."""
    if selector.nested:
        return selector.select(topk_logprobs, topk_tokens, bonus, budget)
    return build_ddtree(topk_logprobs, topk_tokens, budget, validate=False, prune=selector.prune)


def _tree_at(
    forecast: Forecast, largest: DraftTree, selector, topk_logprobs, topk_tokens, bonus
) -> DraftTree:
    """The step's ``[bs, budget]`` tree at the forecast's budget: the top nodes of ``largest``
    for DDTree (no second build, no second ranking), the selector's own otherwise."""
    budget = forecast.budget
    if budget == 0:
        return empty_tree(largest.batch_size, largest.device)
    if selector.nested:
        return top_nodes(largest, budget, forecast.slots)
    return selector.select(topk_logprobs, topk_tokens, bonus, budget)


def _flag(value: str) -> bool:
    """An on/off auto option: ``0`` or ``1``."""
    if value not in ("0", "1"):
        raise ValueError(f"DDTREE: an on/off auto option is 0 or 1, got {value!r}")
    return value == "1"


# Auto's settings a policy string overrides, ``auto:hold=8:hard=0`` (benchmarks only: the
# variants budget_sim.py compares on its simulated clock and serve_throughput.py pins in one
# auto server): key -> (ControlConfig field, parser of its value); a ``latency.`` field is its
# latency model's ``LatencyConfig`` field (one the model reads as it records, not at
# construction).
AUTO_OVERRIDES: dict[str, tuple[str, Callable[[str], object]]] = {
    "pair": ("latency.pair_rate", float),
    "clip": ("latency.pair_clip", float),
    "first": ("latency.first_steps", int),
    "hold": ("hold_steps", int),
    "holdmax": ("hold_max_steps", int),
    "hard": ("hard_plain_steps", int),
    "tie": ("tie_rtol", float),
    "obs": ("held_observe_every", int),
    "decay": ("choice_decay", float),
    "explore": ("explore_every", int),
    "margin": ("explore_margin", float),
    "stale": ("explore_stale_neighbours", _flag),
}


def auto_overrides(policy: str) -> dict[str, object]:
    """The ``ControlConfig`` fields of an ``auto[:key=value...]`` policy string (see
    :data:`AUTO_OVERRIDES`); ValueError for anything else."""
    name, *options = policy.split(":")
    if name != "auto":
        raise ValueError(f"DDTREE: {policy!r} is not auto[:key=value...]")
    fields: dict[str, object] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in AUTO_OVERRIDES:
            raise ValueError(f"DDTREE: unknown auto option {key!r} (one of {list(AUTO_OVERRIDES)})")
        field_name, kind = AUTO_OVERRIDES[key]
        if field_name.startswith("latency."):
            latency = fields.setdefault("latency", {})
            latency[field_name.removeprefix("latency.")] = kind(value)
        else:
            fields[field_name] = kind(value)
    return fields


def make_controller(
    config: TreeConfig,
    max_depth: int,
    max_slots: int,
    device: torch.device | str,
    latency: LatencyModel | None = None,
    overrides: dict[str, object] | None = None,
) -> BudgetController:
    """The budget controller of a :class:`TreeConfig`: fixed at ``config.budget``, or (auto)
    choosing among ``config.budgets`` with ``latency`` under the shipped auto values
    (``control.AUTO``, :class:`ControlConfig`'s defaults). ``overrides``: auto's fields a
    policy string sets instead (:func:`auto_overrides`; its ``latency`` fields set
    ``latency``'s config)."""
    if not config.auto:
        fixed = ControlConfig(budgets=(config.budget,), fixed_budget=config.budget)
        return BudgetController(fixed, None, max_slots, device)
    fields = dict(overrides or {})
    if "latency" in fields:
        latency.config = replace(latency.config, **fields.pop("latency"))
    auto = ControlConfig(budgets=config.budgets, max_depth=max_depth, **fields)
    return BudgetController(auto, latency, max_slots, device)


def make_selector(
    config: TreeConfig,
    vocab_size: int,
    device: torch.device | str,
    stage: object | None = None,
) -> TreeSelector | None:
    """The selector of a :class:`TreeConfig` (``None`` when it drafts nothing).

    ``stage`` is the stage rule (:class:`~sglang_tree_spec.graft.StageConfig`) of
    ``graft="stage"``. Host tensors take the pruned DDTree builder.
    """
    if not config.drafts:
        return None
    if config.chain:
        return ChainSelector()
    prune = torch.device(device).type == "cpu"
    if config.graft == "none":  # on CUDA the batched build is replayed from CUDA graphs
        cuda = torch.device(device).type == "cuda"
        return DDTreeSelector(config.k, prune=prune, graphs=TreeGraphs("cuda") if cuda else None)
    from sglang_tree_spec.graft import Grafter

    return Grafter(
        config.graft,
        vocab_size,
        config.table_k,
        device,
        stage,
        topk=config.k,
        prune=prune,
        partitions=config.table_partitions,
    )
