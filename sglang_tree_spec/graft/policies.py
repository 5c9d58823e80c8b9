"""Grafting policies: fill a DDTree's slots with tokens retrieved from the successor table.

Both policies take the DDTree of ``B`` nodes, the drafter's top-K marginals, the root (bonus)
tokens and a :class:`~sglang_tree_spec.graft.table.SuccessorTable`, and return a
:class:`~sglang_tree_spec.tree.DraftTree` of the same shape, ``max_depth`` and invariants
(breadth-first, parents before children, prefix closed, distinct sibling tokens, valid prefix).
The output's ``logprobs`` keep their contract, the path log-probability under the drafter's
marginals, a token outside the drafter's top-K at its depth counting ``LOGPROB_FLOOR``.

* :func:`graft_stage` (Graft's rule) works on a pool, batched with fixed shapes (Python loops
  run over depths only):

  1. *Pool* -- the ``B`` draft nodes then a retrieval envelope of ``T = B`` rank-path nodes
     (:mod:`~sglang_tree_spec.graft.template`) rooted at the bonus token, tokens looked up in
     the table depth by depth. A retrieved node whose parent is the root or a merged node, and
     whose token equals a draft child of that parent, *merges* into that draft node: one pool
     entry carrying both the draft marginal and the retrieval rank, and the retrieved node's
     children hang under the draft node. A retrieved node with an UNKNOWN token (or under one)
     is never selectable: its slot stays with a draft node, or becomes padding.
  2. *Priority* -- the policy's order over pool entries, non-decreasing from parent to child so
     that any best-``B`` set is prefix closed.
  3. *Select* -- the ``B`` best entries, laid out breadth-first with parents re-indexed.

* :func:`graft_unified` (ours) runs DDTree's per-depth beam over a larger lattice, the
  drafter's top-K and the table's successors below every node, with edge probabilities
  learned online (:mod:`~sglang_tree_spec.graft.edges`), and shares step 3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from sglang_tree_spec.graft.edges import EdgeAcceptance, draft_marginals, extend_run
from sglang_tree_spec.graft.table import UNKNOWN, SuccessorTable
from sglang_tree_spec.graft.template import (
    RankTemplate,
    best_first_position,
    static_template,
)
from sglang_tree_spec.tree.ddtree import LOGPROB_FLOOR, DraftTree

_LAST = torch.iinfo(torch.int64).max  # selection key of an unselectable pool entry


@dataclass(frozen=True)
class _Pool:
    """Draft nodes (entries ``0 .. B-1``) then template nodes (``B .. B+T-1``). ``[bs, N]``.

    Attributes:
        tokens: int64 (0 where unknown).
        parents: int64 pool index of the parent, -1 under the root.
        depths: int64.
        logprobs: float32 path log-probability under the drafter's marginals (floored).
        valid: bool, selectable (real draft nodes, known unmerged retrieved nodes).
        rank: int64 retrieval rank of the entry (template nodes, merged draft nodes), else -1.
        retrieval_priority: int64 template priority of that retrieved node, else ``_LAST``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logprobs: torch.Tensor
    valid: torch.Tensor
    rank: torch.Tensor
    retrieval_priority: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def _build_pool(
    tree: DraftTree,
    template: RankTemplate,
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    root_tokens: torch.Tensor,
    table: SuccessorTable,
    partitions: torch.Tensor | None = None,
) -> _Pool:
    """Retrieve the envelope, merge it into the draft tree, and pool both."""
    bs, budget = tree.batch_size, tree.budget
    size = template.size
    device = tree.device
    t_rank = template.ranks.expand(bs, size)
    t_parent = template.parents.clamp_min(0).expand(bs, size)
    under_root = (template.parents < 0).expand(bs, size)
    t_depth = template.depths.expand(bs, size)
    root = root_tokens.to(torch.long).view(bs, 1)

    tokens = torch.full((bs, size), UNKNOWN, dtype=torch.long, device=device)
    merged = torch.full((bs, size), -1, dtype=torch.long, device=device)  # draft node or -1
    for depth in range(1, tree.max_depth + 1):  # parents are one depth up: done the round before
        at = (t_depth == depth) & template.valid
        parent_token = torch.where(under_root, root, tokens.gather(1, t_parent))
        identity = torch.where(under_root, -1, merged.gather(1, t_parent))  # draft parent id
        can_merge = under_root | (identity >= 0)
        token = table.lookup(parent_token, t_rank, partitions)  # [bs, T]
        match = (
            tree.valid.unsqueeze(1)
            & (tree.parents.unsqueeze(1) == identity.unsqueeze(2))
            & (tree.tokens.unsqueeze(1) == token.unsqueeze(2))
            & (can_merge & (token != UNKNOWN)).unsqueeze(2)
        )  # [bs, T, B]: at most one draft sibling carries the token
        merge_into = torch.where(match.any(dim=2), match.to(torch.long).argmax(dim=2), -1)
        tokens = torch.where(at, token, tokens)
        merged = torch.where(at, merge_into, merged)

    parent_merged = merged.gather(1, t_parent)
    edge = draft_marginals(topk_logprobs, topk_tokens, t_depth, tokens)  # [bs, T]
    logprobs = torch.zeros(bs, size, dtype=torch.float32, device=device)
    for depth in range(1, tree.max_depth + 1):
        parent_lp = torch.where(
            parent_merged >= 0,
            tree.logprobs.float().gather(1, parent_merged.clamp_min(0)),
            logprobs.gather(1, t_parent),
        )
        parent_lp = torch.where(under_root, 0.0, parent_lp)
        logprobs = torch.where(t_depth == depth, parent_lp + edge, logprobs)

    t_parents = torch.where(parent_merged >= 0, parent_merged, budget + t_parent)
    t_parents = torch.where(under_root, -1, t_parents)
    is_merged = merged >= 0
    # Merged retrieved nodes hand their rank and priority to their draft node (column B: sink).
    sink = torch.where(is_merged, merged, budget)
    t_priority = template.priority.expand(bs, size)
    draft_rank = torch.full((bs, budget + 1), -1, dtype=torch.long, device=device)
    draft_rank.scatter_(1, sink, t_rank)
    draft_priority = torch.full((bs, budget + 1), _LAST, dtype=torch.long, device=device)
    draft_priority.scatter_(1, sink, t_priority)
    retrievable = (tokens != UNKNOWN) & ~is_merged & template.valid
    return _Pool(
        tokens=torch.cat([tree.tokens, tokens.clamp_min(0)], dim=1),
        parents=torch.cat([tree.parents, t_parents], dim=1),
        depths=torch.cat([tree.depths, t_depth], dim=1),
        logprobs=torch.cat([tree.logprobs.float(), logprobs], dim=1),
        valid=torch.cat([tree.valid, retrievable], dim=1),
        rank=torch.cat([draft_rank[:, :budget], t_rank], dim=1),
        retrieval_priority=torch.cat([draft_priority[:, :budget], t_priority], dim=1),
    )


def _select(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    logprobs: torch.Tensor,
    valid: torch.Tensor,
    key: torch.Tensor,
    budget: int,
    max_depth: int,
) -> DraftTree:
    """The ``budget`` candidates of lowest ``key`` (unique, ``_LAST`` for unselectable ones),
    breadth-first (by depth, then candidate index), as a :class:`DraftTree`.

    Args:
        tokens, parents, depths, logprobs, valid, key: ``[bs, N]`` candidates; ``parents`` is
            a candidate index (-1 under the root). The chosen set must be prefix closed.
    """
    bs, n = tokens.shape
    device = tokens.device
    chosen = torch.topk(key, budget, dim=1, largest=False, sorted=False).indices  # [bs, B]
    real = valid.gather(1, chosen)
    bfs = torch.where(real, depths.gather(1, chosen) * n, (max_depth + 1) * n) + chosen
    chosen = chosen.gather(1, bfs.argsort(dim=1))
    real = valid.gather(1, chosen)
    node_of = torch.full((bs, n), -1, dtype=torch.long, device=device)
    node_of.scatter_(1, chosen, torch.arange(budget, device=device).expand(bs, budget))
    parent = parents.gather(1, chosen)
    parent = torch.where(parent >= 0, node_of.gather(1, parent.clamp_min(0)), -1)
    return DraftTree(
        tokens=torch.where(real, tokens.gather(1, chosen), 0),
        parents=torch.where(real, parent, -1),
        depths=torch.where(real, depths.gather(1, chosen), 1),
        logprobs=torch.where(real, logprobs.gather(1, chosen), float("-inf")),
        valid=real,
        max_depth=max_depth,
    )


def _check_inputs(tree: DraftTree, topk_tokens: torch.Tensor, root_tokens: torch.Tensor) -> None:
    bs, depth = tree.batch_size, tree.max_depth
    if topk_tokens.dim() != 3 or topk_tokens.shape[:2] != (bs, depth):
        raise ValueError(
            f"top-K inputs must be [bs, L, K] with bs={bs}, L={depth}; "
            f"got {tuple(topk_tokens.shape)}"
        )
    _check_roots(topk_tokens, root_tokens)


def _check_roots(topk_tokens: torch.Tensor, root_tokens: torch.Tensor) -> None:
    bs = topk_tokens.shape[0]
    if topk_tokens.dim() != 3:
        raise ValueError(f"top-K inputs must be [bs, L, K], got {tuple(topk_tokens.shape)}")
    if root_tokens.shape != (bs,):
        raise ValueError(f"root_tokens must be [bs] = [{bs}], got {tuple(root_tokens.shape)}")


# ------------------------------------------------------------------------------------ stage


@dataclass(frozen=True)
class StageConfig:
    """Graft's stage rule: checkpoint depths, their thresholds, and the draft share kept.

    At checkpoint ``d`` the confidence is ``c_d``, the probability of the best draft path of
    depth ``d`` (the rank-0 chain: ``prod_{i <= d} max q_i``). The first checkpoint with
    ``c_d <= threshold`` prunes: the tree keeps ``round(keep_fraction * B)`` draft nodes.
    Checkpoints deeper than the drafted block are skipped. Defaults: the paper's checkpoints
    d0, d1, d5 (depths 1, 2, 6), its Qwen3-8B thresholds and its 8 / 24 / 40 of 60 nodes; run
    :func:`calibrate_stage` on training prompts for a given pair.
    """

    depths: tuple[int, ...] = (1, 2, 6)
    thresholds: tuple[float, ...] = (0.15, 0.13, 0.51)
    keep_fractions: tuple[float, ...] = (8 / 60, 24 / 60, 40 / 60)

    def __post_init__(self) -> None:
        if not len(self.depths) == len(self.thresholds) == len(self.keep_fractions):
            raise ValueError("depths, thresholds and keep_fractions must have the same length")
        if any(d < 1 for d in self.depths) or list(self.depths) != sorted(set(self.depths)):
            raise ValueError(f"checkpoint depths must be increasing and >= 1, got {self.depths}")
        if any(not 0.0 <= f <= 1.0 for f in self.keep_fractions):
            raise ValueError(f"keep_fractions must lie in [0, 1], got {self.keep_fractions}")

    def keep_counts(self, budget: int) -> list[int]:
        """Draft nodes kept when each checkpoint prunes."""
        return [round(f * budget) for f in self.keep_fractions]


def stage_confidences(topk_logprobs: torch.Tensor, depths: Sequence[int]) -> torch.Tensor:
    """``[bs, C]`` float32 ``c_d`` at each checkpoint depth (clamped to the block's ``L``)."""
    best_path = topk_logprobs[:, :, 0].float().cumsum(dim=1).exp()  # [bs, L]
    index = torch.tensor(depths, device=best_path.device).clamp_max(best_path.shape[1]) - 1
    return best_path.index_select(1, index)


def stage_keep(topk_logprobs: torch.Tensor, config: StageConfig, budget: int) -> torch.Tensor:
    """``[bs]`` int64 draft nodes each request keeps: ``budget`` when every checkpoint passes,
    else the keep count of the first failing one."""
    depth_count = topk_logprobs.shape[1]
    device = topk_logprobs.device
    confidence = stage_confidences(topk_logprobs, config.depths)  # [bs, C]
    thresholds = torch.tensor(config.thresholds, device=device)
    active = torch.tensor(config.depths, device=device) <= depth_count
    fails = (confidence <= thresholds) & active  # [bs, C]
    counts = torch.tensor(config.keep_counts(budget), device=device)
    first = fails.to(torch.long).argmax(dim=1)
    return torch.where(fails.any(dim=1), counts[first], budget)


def graft_stage(
    tree: DraftTree,
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    root_tokens: torch.Tensor,
    table: SuccessorTable,
    config: StageConfig,
    partitions: torch.Tensor | None = None,
) -> DraftTree:
    """Graft's prune-then-graft rule on a DDTree.

    A request whose checkpoints all pass keeps its draft tree (retrieved nodes only take
    padding slots). One that fails at a checkpoint keeps its ``B_draft`` best draft nodes (the
    first ``B_draft`` by score, an optimal ``B_draft``-tree by DDTree's nesting), then fills
    the other slots with the static rank template rooted at the bonus token, in its
    best-first order, skipping retrieved nodes that are unknown or merged into a kept draft
    node; slots the retrieval cannot fill go back to the next draft nodes by score.

    Args:
        tree: ``[bs, B]`` DDTree (best-first nested: children never score above parents).
        topk_logprobs, topk_tokens: ``[bs, L, K]`` the drafter's top-K the tree was built from.
        root_tokens: ``[bs]`` bonus tokens.
        table: the successor table.
        config: checkpoints, thresholds, keep fractions.
        partitions: optional ``[bs]`` table partition of each request (see
            :class:`~sglang_tree_spec.graft.table.SuccessorTable`).
    """
    _check_inputs(tree, topk_tokens, root_tokens)
    budget = tree.budget
    template = static_template(budget, tree.max_depth, table.k, tree.device)
    pool = _build_pool(tree, template, topk_logprobs, topk_tokens, root_tokens, table, partitions)
    keep = stage_keep(topk_logprobs, config, budget).unsqueeze(1)  # [bs, 1]
    # Tiers: kept draft nodes, then the template in its order, then the other draft nodes.
    draft_position = best_first_position(tree.logprobs.float())  # [bs, B]
    draft_priority = torch.where(
        draft_position < keep, draft_position, keep + budget + draft_position
    )
    retrieved = torch.where(
        pool.retrieval_priority < _LAST, keep + pool.retrieval_priority, _LAST
    )  # [bs, N]
    priority = torch.minimum(retrieved[:, :budget], draft_priority)
    priority = torch.cat([priority, retrieved[:, budget:]], dim=1)
    n = pool.size
    index = torch.arange(n, device=tree.device)
    key = torch.where(pool.valid, priority * n + index, _LAST)
    return _select(
        pool.tokens,
        pool.parents,
        pool.depths,
        pool.logprobs,
        pool.valid,
        key,
        budget,
        tree.max_depth,
    )


def calibrate_stage(
    confidences: torch.Tensor,
    accept_lens: torch.Tensor,
    config: StageConfig | None = None,
    max_miss: float = 0.25,
    min_steps: int = 8,
) -> StageConfig:
    """Thresholds from recorded DDTree steps on TRAINING prompts (never evaluation ones).

    Checkpoint ``d``'s threshold is the largest ``tau`` such that, among the steps pruned there
    (``c_d <= tau``, among those that passed the earlier checkpoints), at most ``max_miss`` had
    actually accepted ``d`` or more draft tokens -- a bound on the misjudgment rate -- and at
    least ``min_steps`` are pruned. With no such ``tau`` the threshold is 0 (never prunes).

    Args:
        confidences: ``[N, C]`` :func:`stage_confidences` of ``N`` recorded steps.
        accept_lens: ``[N]`` draft tokens each step accepted.
        config: checkpoints and keep fractions (default :class:`StageConfig`).
    """
    config = config or StageConfig()
    confidences = torch.as_tensor(confidences, dtype=torch.float64).cpu()
    accept_lens = torch.as_tensor(accept_lens).cpu()
    if confidences.dim() != 2 or confidences.shape != (accept_lens.shape[0], len(config.depths)):
        raise ValueError(
            f"confidences must be [N, {len(config.depths)}] and accept_lens [N]; got "
            f"{tuple(confidences.shape)} and {tuple(accept_lens.shape)}"
        )
    alive = torch.ones(accept_lens.shape[0], dtype=torch.bool)
    thresholds = []
    for column, depth in enumerate(config.depths):
        tau = _largest_safe_threshold(
            confidences[alive, column], accept_lens[alive] >= depth, max_miss, min_steps
        )
        thresholds.append(tau)
        alive &= confidences[:, column] > tau
    return replace(config, thresholds=tuple(thresholds))


def _largest_safe_threshold(
    confidence: torch.Tensor, reached: torch.Tensor, max_miss: float, min_steps: int
) -> float:
    """Largest ``tau`` whose pruned set ``confidence <= tau`` has a ``reached`` rate of at
    most ``max_miss`` and at least ``min_steps`` members; 0.0 when there is none."""
    order = confidence.argsort()
    values = confidence[order]
    pruned = torch.arange(1, values.shape[0] + 1)
    miss_rate = reached[order].double().cumsum(dim=0) / pruned
    closes_ties = torch.ones_like(values, dtype=torch.bool)  # tau = values[i] prunes 0..i only
    closes_ties[:-1] = values[1:] > values[:-1]
    ok = (miss_rate <= max_miss) & (pruned >= min_steps) & closes_ties
    if not bool(ok.any()):
        return 0.0
    return float(values[ok.nonzero()[-1, 0]])


# ---------------------------------------------------------------------------------- unified


def graft_unified(
    budget: int,
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    root_tokens: torch.Tensor,
    table: SuccessorTable,
    edges: EdgeAcceptance,
    partitions: torch.Tensor | None = None,
) -> DraftTree:
    """One best-first selection over drafted and retrieved candidates under DDTree's surrogate.

    The candidate lattice: every node (the root included) has as children the drafter's
    top-K tokens at the next depth *and* the known successors of its own token in the table,
    a token that is both counted once. So retrieved candidates hang below any node, drafted
    or retrieved, not only below the root. A child's edge probability is
    ``p = edges.probs(depth, evidence, q, run)``, the online chance that it matches given an
    accepted parent, where ``q`` is the drafter's marginal of the token at that depth (0 outside
    the top-K), ``evidence`` its rank in the parent token's row (or absent from a full row,
    or unseen) and ``run`` how many edges in a row ending at the parent were in their parent's
    rows -- see :mod:`~sglang_tree_spec.graft.edges`. A node's score is the product of the
    edge probabilities on its path, as DDTree's ``q(u)``, and the tree is the ``B`` best
    nodes. With an empty table every token is UNSEEN and a fresh ``edges`` gives ``p = q``:
    the DDTree itself (up to ties).

    Selection is DDTree's per-depth beam: beam_1 = the ``B`` best children of the root,
    beam_{d+1} = the ``B`` best children of beam_d, then the ``B`` best of all beams by (score
    descending, depth ascending). ``0 < p < 1`` keeps a child strictly below its parent, so the
    answer is prefix closed; a child in some beam always has its parent in the previous one. It
    is exact for DDTree's lattice (edges shared by all parents) and an approximation here
    (edges depend on the parent's row): a node outside its depth's beam is never chosen.
    Cost per depth: ``B * (K + k)`` candidates, a sorted search of the ``B * k`` row tokens among
    the ``K`` drafted ones, one top-B; fixed shapes, no host synchronisation.

    No DDTree is built first (the DDTree is contained in this lattice). Output ``logprobs``
    keep the DraftTree contract (path log-prob under the drafter's marginals,
    ``LOGPROB_FLOOR`` per retrieved-only edge); the selection score is not stored.

    Args:
        budget: B, node slots per request.
        topk_logprobs, topk_tokens: ``[bs, L, K]`` the drafter's top-K (sorted descending).
        root_tokens: ``[bs]`` bonus tokens.
        table: the successor table.
        edges: the edge acceptance estimate (:class:`~sglang_tree_spec.graft.edges.
            EdgeAcceptance`, same ``k`` as the table).
        partitions: optional ``[bs]`` partition of each request in the table and the edge
            estimate (each request reads its own partition only).
    """
    _check_roots(topk_tokens, root_tokens)
    if edges.k != table.k:
        raise ValueError(f"edges.k = {edges.k} does not match the table's k = {table.k}")
    bs, depth_count, _ = topk_tokens.shape
    device = topk_tokens.device
    lp_all = topk_logprobs.float().clamp_min(LOGPROB_FLOOR)
    drafted_all = topk_tokens.to(torch.long)
    # Per depth, the drafted tokens sorted (contiguous rows, for the search of row tokens).
    sorted_all, order_all = (x.transpose(0, 1).contiguous() for x in drafted_all.sort(dim=2))
    log_p_all, retrieved_log_p_all = edges.log_probs_by_evidence(
        topk_logprobs.float().exp(), partitions
    )  # [bs, L, K, S * (k + 2)], [bs, L, S, k]
    ranks = torch.arange(table.k, device=device)
    # The parents of the current depth: the root (run 0), then the previous beam.
    parents = _Beam(
        tokens=root_tokens.to(torch.long).view(bs, 1),
        run=torch.zeros(bs, 1, dtype=torch.long, device=device),
        score=torch.zeros(bs, 1, device=device),
        logprobs=torch.zeros(bs, 1, device=device),
    )
    beams: list[tuple[torch.Tensor, ...]] = []  # (score, token, parent, logprob) [bs, B]
    for d in range(depth_count):
        rows = table.rows(parents.tokens, partitions)  # [bs, P, k]; parents are real tokens
        children = _row_evidence(rows, sorted_all[d], order_all[d], ranks)
        score = _child_scores(parents, children, log_p_all[:, d], retrieved_log_p_all[:, d])
        beam_score, chosen = _best_children(score, budget)
        beam_parent, beam = _beam_nodes(
            chosen, beam_score, parents, children, drafted_all[:, d], lp_all[:, d]
        )
        parent_index = beam_parent + (d - 1) * budget if d > 0 else torch.full_like(chosen, -1)
        beams.append((beam.score, beam.tokens, parent_index, beam.logprobs))
        parents = beam
    return _best_of_beams(beams, budget, depth_count)


@dataclass(frozen=True)
class _Beam:
    """One depth's nodes of :func:`graft_unified` (the root alone before depth 1). ``[bs, P]``.

    Attributes:
        tokens: int64 the nodes' tokens.
        run: int64 edges in a row ending at the node that were in their parent's rows.
        score: float32 the product of edge probabilities on the path, as a log (-inf: none).
        logprobs: float32 the path log-probability under the drafter's marginals (floored).
    """

    tokens: torch.Tensor
    run: torch.Tensor
    score: torch.Tensor
    logprobs: torch.Tensor


@dataclass(frozen=True)
class _RowEvidence:
    """Where each parent's table row meets the drafter's tokens at the next depth.

    Attributes:
        known: ``[bs, P, k]`` bool, a row entry is a known token.
        flat_rows: ``[bs, P * k]`` int64 the parents' rows, parent-major.
        in_draft: ``[bs, P, k]`` bool, a known row token the drafter also proposes.
        evidence: ``[bs, P, K]`` int64 each drafted child's rank in its parent's row, else
            ``k`` (absent from a full row) or ``k + 1`` (unseen).
    """

    known: torch.Tensor
    flat_rows: torch.Tensor
    in_draft: torch.Tensor
    evidence: torch.Tensor


def _row_evidence(
    rows: torch.Tensor,
    sorted_drafted: torch.Tensor,
    drafted_order: torch.Tensor,
    ranks: torch.Tensor,
) -> _RowEvidence:
    """The evidence of the children of parents with table ``rows [bs, P, k]``, from one depth's
    drafted tokens sorted ``sorted_drafted [bs, K]``, their columns ``drafted_order [bs, K]``
    and ``ranks = arange(k)`` (a sorted search, not a ``[P, K, k]`` comparison)."""
    bs, n_parents, k = rows.shape
    top = sorted_drafted.shape[1]
    known = rows != UNKNOWN
    flat_rows = rows.view(bs, n_parents * k)
    at = torch.searchsorted(sorted_drafted, flat_rows).clamp_max_(top - 1)
    in_draft = (sorted_drafted.gather(1, at) == flat_rows).view(bs, n_parents, k) & known
    column = torch.where(in_draft, drafted_order.gather(1, at).view(bs, n_parents, k), top)
    # Evidence of the drafted children: their rank in the parent's row, else absent or
    # unseen (column ``top`` absorbs the row tokens the drafter does not propose).
    evidence = (k + known.all(dim=2, keepdim=True).logical_not()).expand(-1, -1, top + 1)
    evidence = evidence.scatter(2, column, ranks.expand(bs, n_parents, k))[:, :, :top]
    return _RowEvidence(known, flat_rows, in_draft, evidence)


def _child_scores(
    parents: _Beam, children: _RowEvidence, log_p: torch.Tensor, retrieved_log_p: torch.Tensor
) -> torch.Tensor:
    """``[bs, P * (K + k)]`` the children's scores, each parent's drafted children then its
    retrieved ones (-inf where there is none), from one depth's edge log-probabilities
    ``log_p [bs, K, S * (k + 2)]`` by (run, evidence) and ``retrieved_log_p [bs, S, k]``."""
    n_parents, k = children.known.shape[1:]
    cell = parents.run.unsqueeze(2) * (k + 2) + children.evidence  # [bs, P, K]
    drafted_log_p = log_p.unsqueeze(1).expand(-1, n_parents, -1, -1)
    drafted_log_p = drafted_log_p.gather(3, cell.unsqueeze(3)).squeeze(3)  # [bs, P, K]
    by_run = retrieved_log_p.gather(1, parents.run.unsqueeze(2).expand(-1, -1, k))
    retrieved = children.known & ~children.in_draft
    retrieved_log_p = torch.where(retrieved, by_run, float("-inf"))  # [bs, P, k]
    # [bs, P * (K + k)]: drafted children, then retrieved ones; -inf under invalid parents
    score = parents.score.unsqueeze(2) + torch.cat([drafted_log_p, retrieved_log_p], 2)
    return score.flatten(1)


def _best_children(score: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``budget`` best of the children ``score [bs, C]``: ``[bs, B]`` scores (sorted
    descending, -inf past the lattice's width) and child indices."""
    best = torch.topk(score, min(budget, score.shape[1]), dim=1, sorted=True)
    beam_score, chosen = best.values, best.indices
    if beam_score.shape[1] < budget:  # a lattice narrower than the budget (depth 1)
        beam_score = F.pad(beam_score, (0, budget - beam_score.shape[1]), value=-math.inf)
        chosen = F.pad(chosen, (0, budget - chosen.shape[1]))
    return beam_score, chosen


def _beam_nodes(
    chosen: torch.Tensor,
    beam_score: torch.Tensor,
    parents: _Beam,
    children: _RowEvidence,
    drafted: torch.Tensor,
    lp: torch.Tensor,
) -> tuple[torch.Tensor, _Beam]:
    """The chosen children ``chosen [bs, B]`` (indices into each parent's ``K + k``) as the
    next beam, with their parents' positions ``[bs, B]`` in ``parents``; ``drafted`` and
    ``lp`` are the depth's drafted tokens and floored log-probs ``[bs, K]``."""
    top = drafted.shape[1]
    k = children.known.shape[2]
    width = top + k  # children per parent: drafted, then retrieved
    beam_parent, child = chosen // width, chosen % width
    is_drafted = child < top
    drafted_child = child.clamp_max(top - 1)
    retrieved_at = beam_parent * k + (child - top).clamp_min_(0)
    beam_token = torch.where(
        is_drafted,
        drafted.gather(1, drafted_child),
        children.flat_rows.gather(1, retrieved_at).clamp_min_(0),
    )
    edge_lp = torch.where(is_drafted, lp.gather(1, drafted_child), LOGPROB_FLOOR)
    beam_lp = parents.logprobs.gather(1, beam_parent) + edge_lp
    drafted_in_row = children.evidence.flatten(1).gather(1, beam_parent * top + drafted_child) < k
    in_row = ~is_drafted | drafted_in_row  # a retrieved child is in its parent's row
    beam_run = extend_run(parents.run.gather(1, beam_parent), in_row)
    return beam_parent, _Beam(beam_token, beam_run, beam_score, beam_lp)


def _best_of_beams(
    beams: list[tuple[torch.Tensor, ...]], budget: int, depth_count: int
) -> DraftTree:
    """The tree of the ``budget`` best nodes of all beams (``(score, token, parent, logprob)``
    ``[bs, B]`` per depth), by score descending then depth ascending."""
    score, tokens, parents, logprobs = (torch.cat(x, dim=1) for x in zip(*beams, strict=True))
    bs = score.shape[0]
    depths = torch.arange(1, depth_count + 1, device=score.device).repeat_interleave(budget)
    valid = score > float("-inf")
    # Unique key: position in (score desc, depth asc, beam position asc) order; the beams are
    # laid out depth-major and sorted, so a stable sort of the scores gives it.
    key = best_first_position(score)
    return _select(
        tokens,
        parents,
        depths.expand(bs, -1),
        logprobs,
        valid,
        torch.where(valid, key, _LAST),
        budget,
        depth_count,
    )
