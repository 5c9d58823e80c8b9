"""DDTree: the optimal draft tree for a node budget, from per-position draft marginals.

A block-diffusion drafter gives, in one forward, independent marginals q_1..q_L over the next L
positions. Under the factorised surrogate Q = prod_i q_i, the expected accepted length of a
prefix-closed draft tree T is sum_{u in T} q(u) (DDTree, Prop. 1), so the optimal tree with B
nodes is the set of the B most probable prefixes (Prop. 2). Within the top-K lattice (K tokens per
depth) this module finds that set exactly.

Two builders with the same contract:

* :func:`build_ddtree` -- batched, on device, fixed shapes, no host synchronisation (the per-depth
  beam below), usable inside a CUDA graph.
* :func:`build_ddtree_reference` -- the paper's best-first heap (Algorithm 1), one request at a
  time on the host; the oracle for tests and the baseline for ``benchmarks/tree_build.py``.

Per-depth beam, exact: beam_1 = top-B of depth 1; beam_d = top-B of (beam_{d-1} x top-K at d).
A depth-d prefix whose parent is outside beam_{d-1} is beaten by the B rank-1 extensions of the
beam, so it can never be among the B best. The answer is the B best of the union of the beams,
ranked by (score descending, depth ascending). A child never scores above its parent and is
deeper, so the answer is prefix closed, and its first N nodes by that rank are the optimal
N-tree for every N <= B (nesting; the budget controller relies on it).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np
import torch

# Log-probabilities below this are floored for ranking, so that a zero-probability lattice node
# (log q = -inf) still orders before the padding of a lattice smaller than the budget (-inf).
LOGPROB_FLOOR = -1.0e30


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees with exactly ``budget`` node slots per request.

    Node ``i`` of request ``b`` (``0 <= i < budget``); the root (the bonus token, already
    committed) is implicit and is not a node here. All tensors are ``[bs, budget]``.

    Invariants: nodes are in breadth-first order (``depths`` non-decreasing along dim 1);
    ``parents[b, i] < i``; ``parents == -1`` exactly for depth-1 nodes; siblings carry distinct
    tokens; the valid nodes form a prefix of each row and invalid slots (only when the lattice
    has fewer than ``budget`` prefixes) have ``parents = -1``, ``depths = 1``, ``tokens = 0``,
    ``logprobs = -inf``.

    Attributes:
        tokens: int64 token ids.
        parents: int64 index of the parent node, or -1 for a child of the root.
        depths: int64 depth in 1..max_depth (the root has depth 0).
        logprobs: float path log-probability log q(u) under the drafter's marginals.
        valid: bool, false for padding slots.
        max_depth: L, the number of drafted positions the tree was built from.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logprobs: torch.Tensor
    valid: torch.Tensor
    max_depth: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def parent_slots(self) -> torch.Tensor:
        """Parent of each node as a verify-window slot (root = 0, node i = i + 1). ``[bs, B]``."""
        return self.parents + 1


def _check_topk_inputs(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int,
    vocab_size: int | None,
    check_values: bool,
) -> None:
    """Raise ``ValueError`` on malformed builder inputs.

    Shape and dtype checks are free; ``check_values`` adds the data checks (sorted, no NaN,
    distinct in-vocabulary tokens) which read the tensors on the host.
    """
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    if topk_logprobs.dim() != 3 or topk_tokens.dim() != 3:
        raise ValueError(
            "topk_logprobs and topk_tokens must be [bs, L, K]; got shapes "
            f"{tuple(topk_logprobs.shape)} and {tuple(topk_tokens.shape)}"
        )
    if topk_logprobs.shape != topk_tokens.shape:
        raise ValueError(
            f"topk_logprobs {tuple(topk_logprobs.shape)} and topk_tokens "
            f"{tuple(topk_tokens.shape)} must have the same shape"
        )
    if min(topk_logprobs.shape) < 1:
        raise ValueError(f"empty top-K input of shape {tuple(topk_logprobs.shape)}")
    if not topk_logprobs.is_floating_point():
        raise ValueError(f"topk_logprobs must be floating point, got {topk_logprobs.dtype}")
    if (
        topk_tokens.is_floating_point()
        or topk_tokens.is_complex()
        or topk_tokens.dtype is torch.bool
    ):
        raise ValueError(f"topk_tokens must be an integer tensor, got {topk_tokens.dtype}")
    k = topk_logprobs.shape[2]
    if vocab_size is not None and k > vocab_size:
        raise ValueError(f"K = {k} top tokens per position exceeds the vocabulary ({vocab_size})")
    if not check_values:
        return
    if torch.isnan(topk_logprobs).any():
        raise ValueError("topk_logprobs contains NaN")
    if (topk_logprobs > 0).any():
        raise ValueError("topk_logprobs must be log-probabilities (<= 0)")
    if k > 1 and (topk_logprobs[..., 1:] > topk_logprobs[..., :-1]).any():
        raise ValueError("topk_logprobs must be sorted in descending order along the last dim")
    if (topk_tokens < 0).any() or (vocab_size is not None and (topk_tokens >= vocab_size).any()):
        raise ValueError("topk_tokens has ids outside the vocabulary")
    if k > 1:
        sorted_tokens = topk_tokens.sort(dim=-1).values
        if (sorted_tokens[..., 1:] == sorted_tokens[..., :-1]).any():
            raise ValueError("topk_tokens repeats a token id within one position")


def topk_from_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-K log-probabilities of draft logits.

    Args:
        logits: ``[bs, L, V]`` draft logits.
        k: tokens kept per position, ``1 <= k <= V``.

    Returns:
        ``(topk_logprobs, topk_tokens)``, both ``[bs, L, k]``, sorted descending.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [bs, L, V], got {tuple(logits.shape)}")
    vocab_size = logits.shape[-1]
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-K of {k} is out of range for a vocabulary of {vocab_size}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, tokens = torch.topk(logprobs, k, dim=-1, sorted=True)
    return values, tokens


@functools.cache
def _candidate_pairs(
    budget: int, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(beam parent, token rank) pairs that can reach the top ``budget`` of the next depth.

    Beam entries and ranks are both sorted descending, so pair (p, r) (0-based) is beaten or
    tied by the (p + 1)(r + 1) - 1 pairs (p' <= p, r' <= r); it matters only if
    (p + 1)(r + 1) <= budget. That keeps M ~ B ln(min(B, k)) of the B*k pairs, a static set.

    Returns:
        ``(parent_index, rank)``, both int64 ``[M]`` on ``device``.
    """
    pairs = [(p, r) for r in range(k) for p in range(budget // (r + 1))]
    table = torch.tensor(pairs, dtype=torch.long).T.contiguous()
    return table[0].to(device), table[1].to(device)


def _depth_beams(
    lp: torch.Tensor, budget: int, stop_early: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The B best prefixes of every depth, each beam sorted descending.

    Args:
        lp: ``[bs, L, k]`` finite log-probs sorted descending, ``k <= budget``.
        stop_early: skip the remaining depths once no deeper prefix can enter the answer: in
            every row the best next-depth score is at most the last entry of some full beam
            (whose B shallower entries then win, ties included). Reading that condition is a host
            synchronisation, so only host tensors use it; without it the loop has fixed
            shapes and never synchronises.

    Returns:
        ``scores`` ``[bs, L'*B]``: depth-major beam scores of the L' <= L computed depths
        (L' = L unless stopped early), -inf where a depth has fewer than B prefixes;
        ``pair_index`` ``[bs, L'*B]``: for every beam entry, its index into the extended pair
        table of :func:`_pair_table` (depth 1: ``M + beam position``; deeper: the index of its
        (parent beam position, token rank) pair).
    """
    bs, depth_count, k = lp.shape
    first = lp.new_full((bs, budget), float("-inf"))
    first[:, :k] = lp[:, 0, :]
    pair_parent, pair_rank = _candidate_pairs(budget, k, lp.device)  # [M], [M]
    first_pairs = torch.arange(budget, device=lp.device).add_(pair_rank.numel())
    scores, pair_index = [first], [first_pairs.expand(bs, budget)]
    beam = first
    floor = first[:, -1]  # [bs] a B-th best score so far: the worst entry of a full beam
    for d in range(1, depth_count):
        if stop_early and bool((beam[:, 0] + lp[:, d, 0] <= floor).all()):
            break
        candidates = beam.index_select(1, pair_parent)  # [bs, M] parent scores
        candidates.add_(lp[:, d].index_select(1, pair_rank))  # + token log-probs
        beam, index = torch.topk(candidates, budget, dim=1, sorted=True)  # [bs, B]
        scores.append(beam)  # extensions of -inf padding stay -inf
        pair_index.append(index)
        floor = torch.maximum(floor, beam[:, -1])
    return torch.cat(scores, dim=1), torch.cat(pair_index, dim=1)


@functools.cache
def _pair_table(budget: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_candidate_pairs` extended by B depth-1 entries, for decoding any beam entry.

    Returns:
        ``(parent_position, rank)``, both int64 ``[M + B]``: entry ``M + j`` is depth-1 beam
        position ``j``, whose parent position is 0 (unused: the root) and whose rank is ``j``
        (clamped to ``k - 1``; positions ``>= k`` are -inf padding).
    """
    pair_parent, pair_rank = _candidate_pairs(budget, k, device)
    positions = torch.arange(budget, device=device)
    return (
        torch.cat([pair_parent, torch.zeros_like(positions)]),
        torch.cat([pair_rank, positions.clamp_max(k - 1)]),
    )


def _select_best_first(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the ``budget`` best entries in breadth-first order.

    Args:
        scores: ``[bs, N]`` depth-major beam scores, all ``<= 0`` (-inf = padding).

    Returns:
        ``[bs, budget]`` indices into ``scores``: the best by (score desc, index asc) -- the
        index breaks ties toward shallower nodes -- re-ordered by index (depth ascending, then
        beam order), with any padding after every real entry.
    """
    n = scores.shape[1]
    # Unique int64 keys, smallest first in (score desc, index asc) order: 0.0 - score is >= +0.0
    # (never -0.0, so equal scores tie) and the int32 bits of a non-negative float grow with its
    # value; the index fills the low 32 bits.
    negated_bits = (0.0 - scores).view(torch.int32).to(torch.int64)
    keys = (negated_bits << 32) | torch.arange(n, device=scores.device)
    best = torch.topk(keys, budget, dim=1, largest=False, sorted=False).indices  # [bs, budget]
    is_real = scores.gather(1, best) > float("-inf")
    bfs_key = torch.where(is_real, best, best + n)
    return bfs_key.sort(dim=1).values % n


def build_ddtree(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int,
    *,
    vocab_size: int | None = None,
    validate: bool = True,
) -> DraftTree:
    """The ``budget`` most probable prefixes of the top-K lattice, batched and on device.

    Args:
        topk_logprobs: ``[bs, L, K]`` float, each position's log-probs sorted descending.
        topk_tokens: ``[bs, L, K]`` integer token ids matching ``topk_logprobs``.
        budget: B, node slots per request (the root/bonus token is not counted).
        vocab_size: when given, K and the token ids are checked against it.
        validate: also check values (sorted, finite order, distinct tokens). This reads the
            inputs on the host; the decode hot path passes ``False``.

    Returns:
        A :class:`DraftTree` with ``[bs, budget]`` tensors. Exact within the lattice: with
        K = min(B, V) it is the optimal tree over the whole vocabulary.
    """
    _check_topk_inputs(topk_logprobs, topk_tokens, budget, vocab_size, validate)
    bs, depth_count, k_all = topk_logprobs.shape
    device = topk_logprobs.device
    # A rank r (0-based) token can only be in the B best if r < B: ranks 0..r-1 beat it.
    k = min(k_all, budget)
    lp = topk_logprobs[..., :k].float().clamp_min(LOGPROB_FLOOR)  # [bs, L, k] finite

    stop_early = lp.device.type == "cpu"  # host tensors: reading a flag costs nothing
    beam_scores, pair_index = _depth_beams(lp, budget, stop_early)  # both [bs, L'*B]
    chosen = _select_best_first(beam_scores, budget)  # [bs, B] flat beam indices, BFS order
    depth0 = chosen // budget  # 0-based depth
    depth_start = depth0 * budget  # flat index of the chosen entry's beam start

    # Decode each chosen beam entry: its token rank and its parent's beam position.
    parent_position, rank = _pair_table(budget, k, device)
    pair = pair_index.gather(1, chosen)
    ranks = rank.take(pair)
    tokens = topk_tokens[..., :k].to(torch.long).flatten(1).gather(1, depth0 * k + ranks)
    logprobs = beam_scores.gather(1, chosen)
    valid = logprobs > float("-inf")

    # Parent: the chosen beam entry one depth up, mapped from flat beam index to node index.
    # Column block 0 of ``node_of_flat`` stands for "depth 0": the root, node -1.
    node_of_flat = torch.full((bs, budget + beam_scores.shape[1]), -1, device=device)
    node_of_flat.scatter_(1, chosen + budget, torch.arange(budget, device=device).expand(bs, -1))
    parents = node_of_flat.gather(1, depth_start + parent_position.take(pair))

    return DraftTree(
        tokens=torch.where(valid, tokens, 0),
        parents=torch.where(valid, parents, -1),
        depths=torch.where(valid, depth0 + 1, 1),
        logprobs=logprobs,
        valid=valid,
        max_depth=depth_count,
    )


def build_chain(topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor) -> DraftTree:
    """The DFlash baseline as a tree: one path of the top-1 token at every position.

    Args:
        topk_logprobs: ``[bs, L, K]`` sorted descending (only rank 0 is used).
        topk_tokens: ``[bs, L, K]``.

    Returns:
        A :class:`DraftTree` of ``L`` nodes, node ``i`` at depth ``i + 1`` under node ``i - 1``.
    """
    if topk_logprobs.dim() != 3 or topk_tokens.shape != topk_logprobs.shape:
        raise ValueError("topk_logprobs and topk_tokens must both be [bs, L, K]")
    bs, depth, _ = topk_logprobs.shape
    nodes = torch.arange(depth, device=topk_tokens.device)
    return DraftTree(
        tokens=topk_tokens[:, :, 0].to(torch.long),
        parents=(nodes - 1).expand(bs, depth),
        depths=(nodes + 1).expand(bs, depth),
        logprobs=topk_logprobs[:, :, 0].float().cumsum(dim=1),
        valid=torch.ones(bs, depth, dtype=torch.bool, device=topk_tokens.device),
        max_depth=depth,
    )


def _heap_prefixes(lp: np.ndarray, budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """Algorithm 1 (DDTree): the ``budget`` best rank tuples of one request's lattice.

    Args:
        lp: ``[L, K]`` floored float32 log-probs, sorted descending per row.

    Returns:
        ``(score, ranks)`` pairs in pop order: score non-increasing, ties toward shallower.
    """
    depth_count, k = lp.shape
    zero = lp.dtype.type(0.0)
    # Entries: (-score, depth, counter, score, parent score, 0-based ranks). The depth breaks
    # score ties toward shallower prefixes. A score is always parent score + one log-prob in
    # float32, the same additions the batched beam performs, so both give identical floats.
    heap = [(-float(lp[0, 0]), 1, 0, zero + lp[0, 0], zero, (0,))]
    counter = 1
    popped: list[tuple[float, tuple[int, ...]]] = []
    while heap and len(popped) < budget:
        _, depth, _, score, parent_score, ranks = heapq.heappop(heap)
        popped.append((float(score), ranks))
        if ranks[-1] + 1 < k:  # next sibling: same parent, next rank at this depth
            s = parent_score + lp[depth - 1, ranks[-1] + 1]
            sibling = (*ranks[:-1], ranks[-1] + 1)
            heapq.heappush(heap, (-float(s), depth, counter, s, parent_score, sibling))
            counter += 1
        if depth < depth_count:  # first child: rank 0 at the next depth
            s = score + lp[depth, 0]
            heapq.heappush(heap, (-float(s), depth + 1, counter, s, score, (*ranks, 0)))
            counter += 1
    return popped


def build_ddtree_reference(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int,
    *,
    vocab_size: int | None = None,
    validate: bool = True,
) -> DraftTree:
    """The paper's best-first heap (Algorithm 1), per request on the host.

    Same contract and output layout as :func:`build_ddtree` (breadth-first; within a depth,
    nodes by score descending); used as the test oracle and the benchmark baseline.
    """
    _check_topk_inputs(topk_logprobs, topk_tokens, budget, vocab_size, validate)
    bs, depth_count, k_all = topk_logprobs.shape
    k = min(k_all, budget)
    lp_all = topk_logprobs[..., :k].float().clamp_min(LOGPROB_FLOOR).cpu().numpy()
    tok_all = topk_tokens[..., :k].tolist()
    names = ("tokens", "parents", "depths", "logprobs", "valid")
    rows: dict[str, list[list]] = {name: [] for name in names}
    for b in range(bs):
        popped = _heap_prefixes(lp_all[b], budget)
        # Breadth-first: by depth, then by pop order (score descending, stable).
        bfs = sorted(popped, key=lambda entry: len(entry[1]))
        index_of = {ranks: n for n, (_, ranks) in enumerate(bfs)}
        pad = budget - len(bfs)
        rows["tokens"].append([tok_all[b][len(r) - 1][r[-1]] for _, r in bfs] + [0] * pad)
        rows["parents"].append([index_of.get(r[:-1], -1) for _, r in bfs] + [-1] * pad)
        rows["depths"].append([len(r) for _, r in bfs] + [1] * pad)
        rows["logprobs"].append([score for score, _ in bfs] + [float("-inf")] * pad)
        rows["valid"].append([True] * len(bfs) + [False] * pad)
    dtypes = {"logprobs": torch.float32, "valid": torch.bool}
    device = topk_logprobs.device
    tensors = {
        name: torch.tensor(rows[name], dtype=dtypes.get(name, torch.long), device=device)
        for name in names
    }
    return DraftTree(**tensors, max_depth=depth_count)
