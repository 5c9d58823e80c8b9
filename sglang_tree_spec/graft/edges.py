"""Online edge acceptance for the unified policy: P(a node matches | its parent was accepted).

DDTree's surrogate scores a tree by ``sum_u prod_{e on path(u)} p(e)`` with the edge
probability ``p(e)`` the drafter's marginal ``q_d(token)``. The unified policy keeps that
surrogate and replaces ``p(e)`` by an estimate that also reads the successor table: the *evidence*
of a node is where its token stands in its parent token's row,

* ``r`` in ``0 .. k-1``: the token is rank ``r`` of the row (the target put it there in an
  earlier context);
* ``k`` (ABSENT): the row is full (target-written) and the token is not in it -- evidence
  against it;
* ``k + 1`` (UNSEEN): the row is not full (never or only bigram-filled) and the token is not in
  it -- no evidence;

and ``p(e) = P(match | depth class, parent run, evidence, q)``, counted online from every
verify step. The *parent run* is how many consecutive edges ending at the parent were found
in their own parent's row (0 for the root and for a parent outside its parent's row; capped at
``PARENT_RUNS - 1``): retrieval hits come in runs (a span the target already wrote elsewhere
is being repeated), so a node deep in a run matches far more often than an independent edge
would; priced as independent edges, a retrieved chain of length ``n`` costs ``p^n`` and loses
to shallow drafted nodes. On
the committed small pair (online estimates after 48 held-out code prompts at B = 64) a drafted
node absent from a full row matches less than half as often as its ``q`` says, one at rank 0
several times as often (``q = 0.035``: 0.26 to 0.54 by depth), and a retrieved token outside
the drafter's top-K 10% (rank 0) or 3% (rank 1) of the time.

Estimator: hits / trials per cell ``(depth class, parent run, evidence, q knot)``,
soft-binned in ``q`` (an observation at ``q`` counts ``1 - w`` at the knot below and ``w`` at
the knot above, and :meth:`EdgeAcceptance.probs` interpolates the same way), with a prior of
``strength`` pseudo-trials per cell, and each run's rate shrunk toward the rate pooled over all
runs (a run seen rarely borrows from the others). Everything is counted on the device, fixed
shapes, no host sync.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sglang_tree_spec.graft.table import UNKNOWN, SuccessorTable
from sglang_tree_spec.graft.template import static_template_prior
from sglang_tree_spec.tree.ddtree import LOGPROB_FLOOR, DraftTree

# Knots of the drafter marginal q at which acceptance is estimated (log-spaced-ish, 0 = the
# token is outside the drafter's top-K at its depth, i.e. retrieved only).
Q_KNOTS = (0.0, 0.005, 0.015, 0.035, 0.07, 0.14, 0.27, 0.45, 0.65, 0.85, 1.0)
P_MIN, P_MAX = 1e-6, 1.0 - 1e-6  # edge probabilities are clamped inside (0, 1): scores finite,
# children strictly below parents up to rounding (ties go to the shallower node)
PARENT_RUNS = 4  # parent runs told apart: 0, 1, 2, 3 or more retrieval hits in a row


def draft_marginals(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    depths: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """``[bs, N]`` float32 floored log q_d(token) of each node at its depth, ``LOGPROB_FLOOR``
    when the token is outside the drafter's top-K there.

    Args:
        topk_logprobs, topk_tokens: ``[bs, L, K]``.
        depths, tokens: ``[bs, N]`` int64, depths in 1..L.
    """
    k = topk_tokens.shape[2]
    row = (depths - 1).unsqueeze(2).expand(-1, -1, k)  # [bs, N, K]
    candidates = topk_tokens.to(torch.long).gather(1, row)
    lp = topk_logprobs.float().clamp_min(LOGPROB_FLOOR).gather(1, row)
    hit = candidates == tokens.unsqueeze(2)
    return torch.where(hit, lp, LOGPROB_FLOOR).max(dim=2).values


def evidence_classes(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[...]`` int64 evidence of ``tokens [...]`` in their parents' rows ``[..., k]``:
    the rank, or ``ABSENT = k`` (full row), or ``UNSEEN = k + 1`` (row not full)."""
    k = rows.shape[-1]
    hit = rows == tokens.unsqueeze(-1)
    full = (rows != UNKNOWN).all(dim=-1)
    return torch.where(hit.any(dim=-1), hit.to(torch.long).argmax(dim=-1), k + full.logical_not())


def extend_run(parent_run: torch.Tensor, in_row: torch.Tensor) -> torch.Tensor:
    """A child's run from its parent's run and whether the child is in the parent's row."""
    return torch.where(in_row, (parent_run + 1).clamp_max(PARENT_RUNS - 1), 0)


def parent_runs(tree: DraftTree, evidence: torch.Tensor, k: int) -> torch.Tensor:
    """``[bs, B]`` int64 run of every node's parent (0 for the root's children): how many
    consecutive edges ending at the parent have ``evidence`` a rank (``< k``), capped."""
    in_row = evidence < k
    parent_slots = tree.parents.clamp_min(0)
    has_parent = tree.parents >= 0
    runs = torch.zeros_like(tree.parents)
    for depth in range(1, tree.max_depth + 1):  # parents are one depth up: done before
        above = torch.where(has_parent, runs.gather(1, parent_slots), 0)
        runs = torch.where(tree.depths == depth, extend_run(above, in_row), runs)
    return torch.where(has_parent, runs.gather(1, parent_slots), 0)


def edge_evidence(
    tree: DraftTree,
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    root_tokens: torch.Tensor,
    table: SuccessorTable,
    partitions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Evidence and drafter marginal of every node of ``tree``, read before the table changes
    (in each request's table partition, ``[bs]``, when given).

    Returns:
        ``(evidence [bs, B] int64, q [bs, B] float32)``: see :func:`evidence_classes`; ``q`` is
        ``q_d(token)`` at the node's depth, 0 outside the drafter's top-K.
    """
    parent_tokens = torch.where(
        tree.parents >= 0,
        tree.tokens.gather(1, tree.parents.clamp_min(0)),
        root_tokens.to(torch.long).view(-1, 1),
    )
    evidence = evidence_classes(table.rows(parent_tokens, partitions), tree.tokens)
    q = draft_marginals(topk_logprobs, topk_tokens, tree.depths, tree.tokens).exp()
    return evidence, q


class EdgeAcceptance:
    """Online ``P(match | parent accepted)`` per ``(depth class, parent run, evidence, q)``.

    Depth classes: depth ``1, 2, ..., depth_classes`` (the last one pools every deeper depth).
    Parent runs: ``0 .. PARENT_RUNS - 1`` (see the module docstring); all start from the same
    prior.
    Prior (``strength`` pseudo-trials per cell), the table's evidence as a likelihood ratio on
    the drafter's odds: ``odds(p) = odds(q) * LR``, with ``LR = 1`` for UNSEEN (so a fresh
    estimate on an empty table is DDTree's own surrogate, ``p = q``), ``1/2`` for ABSENT and
    ``1 + 20 a_r`` for rank ``r`` (``a_r`` the static rank prior: 16 for rank 0, 3.4 for rank 1,
    ...); a retrieved token outside the drafter's top-K (``q = 0``) is taken at the first
    knot, ``q = 0.005``. These ratios were set after looking at online estimates like the ones
    above; a few dozen observations per cell outweigh them (an earlier prior, independent
    evidence ``1 - (1 - q)(1 - a_r)``, gave the same tau within noise).

    Partitions (tenant isolation, as the successor table's): ``P`` independent sets of counts;
    every read and count takes an optional per-request partition, NO_PARTITION (-1) reads the
    prior and counts nothing.

    Memory: ``2 * (P + 1) * depth_classes * PARENT_RUNS * (k + 2) * len(Q_KNOTS)`` float64.

    Args:
        k: ranks per successor row.
        depth_classes: how many depth classes are told apart.
        strength: prior pseudo-trials per cell.
        device: where the counts live.
        partitions: P, independent sets of counts.
    """

    def __init__(
        self,
        k: int,
        depth_classes: int = 3,
        strength: float = 4.0,
        device: torch.device | str = "cpu",
        partitions: int = 1,
    ) -> None:
        if k < 1 or depth_classes < 1 or strength <= 0 or partitions < 1:
            raise ValueError(
                f"need k >= 1, depth_classes >= 1, strength > 0, partitions >= 1; got {k}, "
                f"{depth_classes}, {strength}, {partitions}"
            )
        self.k = k
        self.depth_classes = depth_classes
        self.partitions = partitions
        self.knots = torch.tensor(Q_KNOTS, dtype=torch.float32, device=device)
        q = self.knots.double().clamp(P_MIN, P_MAX)
        a = static_template_prior(k).to(device).double()
        ratio = torch.cat([1.0 + 20.0 * a, a.new_tensor([0.5, 1.0])]).unsqueeze(1)  # [k + 2, 1]
        q_in_row = q.clone()
        q_in_row[0] = Q_KNOTS[1]  # retrieved only: below the drafter's top-K, not impossible
        q = torch.cat([q_in_row.expand(k, -1), q.expand(2, -1)])  # [k + 2, C]
        odds = q / (1.0 - q) * ratio
        prior = (odds / (1.0 + odds)).clamp(P_MIN, P_MAX)
        prior[k + 1] = self.knots.double().clamp(P_MIN, P_MAX)  # UNSEEN: exactly q
        self.strength = float(strength)
        self._prior_hits = prior * self.strength  # [k + 2, C]
        # One more partition than asked: the last one keeps the prior, for NO_PARTITION entries.
        self._trials = torch.empty(
            (partitions + 1, depth_classes, PARENT_RUNS, k + 2, len(Q_KNOTS)),
            dtype=torch.float64,
            device=device,
        )
        self._hits = torch.empty_like(self._trials)
        self.reset()

    @property
    def device(self) -> torch.device:
        return self._trials.device

    @property
    def trials(self) -> torch.Tensor:
        """``[depth_classes, PARENT_RUNS, k + 2, C]`` tried counts (prior included) of
        partition 0 (a view)."""
        return self._trials[0]

    @trials.setter
    def trials(self, value: torch.Tensor) -> None:
        self._trials[0] = value

    @property
    def hits(self) -> torch.Tensor:
        """Hit counts of partition 0 (a view), as :attr:`trials`."""
        return self._hits[0]

    @hits.setter
    def hits(self, value: torch.Tensor) -> None:
        self._hits[0] = value

    def reset(self, partition: int | None = None) -> None:
        """Back to the prior (one partition only, when given)."""
        parts = slice(None) if partition is None else partition
        if partition is not None and not 0 <= partition < self.partitions:
            raise ValueError(f"partition {partition} is not in [0, {self.partitions})")
        self._trials[parts] = self.strength
        self._hits[parts] = self._prior_hits

    def _partition_index(self, partitions: torch.Tensor | None) -> torch.Tensor:
        """Storage index of each partition (int64): NO_PARTITION reads the prior-only one."""
        if partitions is None:
            return torch.zeros((), dtype=torch.long, device=self.device)
        parts = torch.as_tensor(partitions, device=self.device).to(torch.long)
        return torch.where(parts >= 0, parts, self.partitions)

    def _all_rates(self) -> torch.Tensor:
        """``[P + 1, depth_classes, PARENT_RUNS, k + 2, C]`` float32 match rates. A parent
        run's rate is shrunk toward the rate pooled over all runs by ``strength`` pseudo-trials,
        so a run seen rarely borrows from the others instead of from the prior alone."""
        pooled = self._hits.sum(2, keepdim=True) / self._trials.sum(2, keepdim=True)
        return ((self._hits + self.strength * pooled) / (self._trials + self.strength)).float()

    def rates(self, partition: int = 0) -> torch.Tensor:
        """``[depth_classes, PARENT_RUNS, k + 2, C]`` float32 match rates of one partition
        (see :meth:`_all_rates`)."""
        return self._all_rates()[partition]

    def _knots(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Knot below ``q`` (int64) and the weight ``w`` of the knot above, same shape."""
        knots = self.knots
        q = q.float().clamp(0.0, 1.0).contiguous()
        below = torch.bucketize(q, knots, right=True).clamp(1, knots.shape[0] - 1) - 1
        w = (q - knots[below]) / (knots[below + 1] - knots[below])
        return below, w.clamp(0.0, 1.0)

    def _cells(
        self, depths: torch.Tensor, runs: torch.Tensor, evidence: torch.Tensor
    ) -> torch.Tensor:
        depth_class = depths.clamp(1, self.depth_classes) - 1
        return ((depth_class * PARENT_RUNS + runs) * (self.k + 2) + evidence) * len(Q_KNOTS)

    @property
    def _partition_cells(self) -> int:
        return self.depth_classes * PARENT_RUNS * (self.k + 2) * len(Q_KNOTS)

    def probs(
        self,
        depths: torch.Tensor | int,
        evidence: torch.Tensor,
        q: torch.Tensor,
        runs: torch.Tensor | int = 0,
        partitions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``P(match | parent accepted)``, broadcast over the inputs, float32 in
        ``[P_MIN, P_MAX]``.

        Args:
            depths: node depths (>= 1), an int or an int64 tensor.
            evidence: int64 :func:`evidence_classes`.
            q: drafter marginals in ``[0, 1]``.
            runs: parent runs (``0 .. PARENT_RUNS - 1``), an int or an int64 tensor.
            partitions: the partition whose counts each entry reads (None: partition 0;
                NO_PARTITION: the prior alone), broadcast like the others.
        """
        depths = torch.as_tensor(depths, device=self.device)
        runs = torch.as_tensor(runs, device=self.device)
        below, w = self._knots(q)
        offset = self._partition_index(partitions) * self._partition_cells
        cell = self._cells(depths, runs, evidence) + below + offset
        rate = self._all_rates().flatten()
        p = (1.0 - w) * rate[cell] + w * rate[cell + 1]
        return p.clamp(P_MIN, P_MAX)

    def log_probs_by_evidence(
        self, q: torch.Tensor, partitions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log P(match)`` under every parent run and evidence class, for a whole drafted
        block at once (the unified policy gathers from it).

        Args:
            q: ``[bs, L, K]`` the drafter's top-K marginals at depths ``1 .. L``.
            partitions: optional ``[bs]`` partition of each request (None: partition 0).

        Returns:
            ``(drafted [bs, L, K, S * (k + 2)], retrieved [bs, L, S, k])`` float32 with
            ``S = PARENT_RUNS``: a drafted token of marginal ``q`` in each (parent run,
            evidence class) cell, run-major, and a retrieved token the drafter does not
            propose (``q = 0``) at each rank.
        """
        bs, depth_count, top = q.shape
        knot_count = len(Q_KNOTS)
        cells = PARENT_RUNS * (self.k + 2)
        depths = torch.arange(1, depth_count + 1, device=self.device)
        depth_class = depths.clamp_max(self.depth_classes) - 1
        parts = self._partition_index(partitions).expand(bs)
        rate = self._all_rates()[parts][:, depth_class]  # [bs, L, S, k + 2, C]
        by_knot = rate.permute(0, 1, 4, 2, 3).reshape(bs, depth_count * knot_count, cells)
        below, w = self._knots(q)
        below = below + (depths - 1).view(1, -1, 1) * knot_count  # row of (depth, knot)
        below = below.view(bs, depth_count * top, 1).expand(-1, -1, cells)
        low = by_knot.gather(1, below).view(bs, depth_count, top, cells)
        high = by_knot.gather(1, below + 1).view(bs, depth_count, top, cells)
        w = w.unsqueeze(-1)
        p = (1.0 - w) * low + w * high
        retrieved = rate[..., : self.k, 0]  # q = 0: the first knot, exactly
        return p.clamp(P_MIN, P_MAX).log(), retrieved.clamp(P_MIN, P_MAX).log()

    def observe(
        self,
        tree: DraftTree,
        evidence: torch.Tensor,
        q: torch.Tensor,
        committed: torch.Tensor,
        partitions: torch.Tensor | None = None,
    ) -> None:
        """Count one verify step: node ``u`` is *tried* when its parent was accepted (or is the
        root) and *hits* when its token is the one the target committed at its depth.

        Args:
            tree: ``[bs, B]`` the verified trees.
            evidence, q: ``[bs, B]`` :func:`edge_evidence` of ``tree`` at drafting time.
            committed: ``[bs, L + 1]`` committed tokens (accepted drafts, then the bonus; -1
                after).
            partitions: optional ``[bs]`` partition each request counts into (None: 0;
                NO_PARTITION: nothing is counted).
        """
        bs, budget = tree.tokens.shape
        accepted = torch.zeros(bs, budget + 1, dtype=torch.bool, device=tree.device)
        accepted[:, 0] = True  # the root
        tried = torch.zeros_like(tree.valid)
        slots = tree.parent_slots()
        for depth in range(1, tree.max_depth + 1):  # parents are one depth up: done before
            at = tree.valid & (tree.depths == depth)
            reached = at & accepted.gather(1, slots)
            hit = reached & (tree.tokens == committed[:, depth - 1 : depth])
            accepted[:, 1:] |= hit
            tried |= reached
        if partitions is not None:
            tried &= (torch.as_tensor(partitions, device=self.device) >= 0).view(bs, 1)
        hits = tried & accepted[:, 1:]
        below, w = self._knots(q)
        runs = parent_runs(tree, evidence, self.k)
        offset = self._partition_index(partitions).view(-1, 1) * self._partition_cells
        cell = (self._cells(tree.depths, runs, evidence) + below + offset).flatten()
        w = w.double().flatten()
        for index, weight in ((cell, 1.0 - w), (cell + 1, w)):
            self._trials.view(-1).index_add_(0, index, tried.flatten() * weight)
            self._hits.view(-1).index_add_(0, index, hits.flatten() * weight)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"trials", "hits"}`` copies (``[P, ...]``), for a warm-up carried to another
        engine."""
        counts = slice(0, self.partitions)
        return {"trials": self._trials[counts].clone(), "hits": self._hits[counts].clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        shape = self._trials[: self.partitions].shape
        if tuple(state["trials"].shape) != tuple(shape):
            raise ValueError(
                f"counts of shape {tuple(state['trials'].shape)} do not fit {tuple(shape)}"
            )
        self._trials[: self.partitions].copy_(state["trials"])
        self._hits[: self.partitions].copy_(state["hits"])
