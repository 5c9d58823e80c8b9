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

Per-depth beam, exact: beam_1 = the top-B of depth 1; beam_d = the best of the pairs (parent in
beam_{d-1}, token rank at d) that can still be among the B best (see :func:`_candidate_pairs`:
only the best B // 2 parents and ~B ln K pairs qualify). A depth-d prefix outside those pairs is
beaten by at least B shallower or better prefixes, so it can never be in the answer. The answer
is the B best of the union of the beams, ranked by (score descending, depth ascending). A child
never scores above its parent and is deeper, so the answer is prefix closed, and its first N
nodes by that rank are the optimal N-tree for every N <= B (nesting; the budget controller
relies on it). With ``prune=True`` (host tensors) the loop also keeps the B-th best score found
so far and skips every parent, token rank and depth whose best extension cannot beat it (shapes
then follow the values; the answer does not).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# Log-probabilities below this are floored for ranking, so that a zero-probability lattice node
# (log q = -inf) still orders before the padding of a lattice smaller than the budget (-inf).
LOGPROB_FLOOR = -1.0e30

# Node keys pack (depth, negated score bits, flat index) into one int64: the low 56 bits rank
# the selection (score descending, then shallower), all 63 the breadth-first order.
_INDEX_BITS = 25  # flat beam index in bits 0-24: budget * depth < 2**25
_INDEX_MASK = (1 << _INDEX_BITS) - 1
_DEPTH_SHIFT = 56  # 0-based depth in bits 56-62 (the score's 31 bits sit in 25-55)
_MAX_DEPTHS = 127  # the depth field of padding: after every node
_PADDING_KEY = 0x7F800000 << _INDEX_BITS  # selection keys from here up score -inf


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
    depth_count, k = topk_logprobs.shape[1:]
    if depth_count >= _MAX_DEPTHS or budget * depth_count >= 1 << _INDEX_BITS:
        raise ValueError(
            f"a {depth_count}-deep lattice with budget {budget} is too large: need depth < "
            f"{_MAX_DEPTHS} and budget * depth < {1 << _INDEX_BITS}"
        )
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


def topk_from_logits(
    logits: torch.Tensor,
    k: int,
    token_ids: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-K log-probabilities of draft logits.

    Args:
        logits: ``[bs, L, V]`` draft logits.
        k: tokens kept per position, ``1 <= k <= V``.
        token_ids: ``[V]`` int64 the token id of each logit column when the drafter scores a
            vocabulary shortlist (SGLang's ``--speculative-token-map``; log-probs are then
            normalised over the shortlist); None: column ``j`` is token ``j``.
        out: ``[bs, L, k]`` float32 and int64 tensors to write the result into (a tree
            graph's static inputs: then the build copies none).

    Returns:
        ``(topk_logprobs, topk_tokens)``, both ``[bs, L, k]``, sorted descending (``out``
        when given).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [bs, L, V], got {tuple(logits.shape)}")
    vocab_size = logits.shape[-1]
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-K of {k} is out of range for a vocabulary of {vocab_size}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if out is not None and token_ids is None:
        torch.topk(logprobs, k, dim=-1, sorted=True, out=out)
        return out
    values, tokens = torch.topk(logprobs, k, dim=-1, sorted=True)
    if token_ids is not None:
        tokens = token_ids[tokens]
    if out is not None:
        out[0].copy_(values)
        out[1].copy_(tokens)
        return out
    return values, tokens


@functools.cache
def _candidate_pairs(
    budget: int, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent, token rank) pairs that can reach the answer at any depth d >= 2.

    Parents are the previous depth's beam sorted descending and ranks are sorted descending,
    so a depth-d child from parent p with rank r (0-based) is beaten or tied by the
    (p + 1)(r + 1) depth-d pairs (p' <= p, r' <= r), and strictly beaten by their p + 1 parents
    and the d - 2 ancestors above the best parent. It can be among the B best only if
    (p + 1)(r + 1) + (p + 1) + (d - 2) <= B, so (p + 1)(r + 2) <= B at every depth: only the
    best B // 2 parents ever matter, and M ~ B (ln(k + 1) - 1/2) of the pairs do.

    Returns:
        ``(parent_index, rank)``, both int64 ``[M]`` on ``device``; every parent index is
        below ``B // 2``. Empty when ``budget < 2`` (no node deeper than 1 fits).
    """
    pairs = [(p, r) for r in range(k) for p in range(budget // (r + 2))]
    table = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T.contiguous()
    return table[0].to(device), table[1].to(device)


class _FlatLayout(NamedTuple):
    """Constant ``[N]`` int64 tables of the flat beam index ``f`` (cached per block shape).

    Attributes:
        index: ``f`` itself.
        depths: 0-based depth of entry ``f``.
        depth_keys: ``depths << 56``, the depth field of a breadth-first key.
        parent_slot_starts: where the parent block's slots start in ``parent_slots`` (0 at
            depth 1).
        parent_block_starts: flat index of the parent block's first entry; ``N`` at depth 1,
            a column that maps to node -1 (the root).
    """

    index: torch.Tensor
    depths: torch.Tensor
    depth_keys: torch.Tensor
    parent_slot_starts: torch.Tensor
    parent_block_starts: torch.Tensor


class _Beams(NamedTuple):
    """Per-depth beams, concatenated depth-major into one flat index ``f`` per request.

    Block 0 (depth 1) holds ``B`` entries sorted descending; the block of each depth d >= 2
    holds at most ``B - 1`` of that depth's candidate pairs, the best of them, in no
    particular order (a node of depth >= 2 needs an ancestor, so at most B - 1 of them fit).
    ``L' <= L`` blocks, ``N`` entries in all.

    Attributes:
        scores: ``[bs, N]`` path log-probs; -inf where a depth has fewer prefixes than its
            block.
        pair_index: ``[bs, N]`` index into :func:`_pair_table`: ``M + j`` for depth-1 entry j,
            else the entry's (parent, rank) pair.
        parent_slots: ``[bs, S]``: per block, the block positions of its best entries in
            descending order: the next depth's parent positions 0, 1, ... of its pairs.
        layout: the constant tables of the blocks' shape.
    """

    scores: torch.Tensor
    pair_index: torch.Tensor
    parent_slots: torch.Tensor
    layout: _FlatLayout


def _first_block(
    lp: torch.Tensor, budget: int, pair_count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth 1: scores ``[bs, B]`` (lp padded with -inf, descending) and their pair indices."""
    bs, _, k = lp.shape
    first = lp.new_full((bs, budget), float("-inf"))
    first[:, :k] = lp[:, 0, :]
    return first, _arange(pair_count, pair_count + budget, lp.device).expand(bs, budget)


@functools.lru_cache(maxsize=256)
def _arange(start: int, end: int, device: torch.device) -> torch.Tensor:
    """A cached ``arange(start, end)`` (int64; never written to)."""
    return torch.arange(start, end, device=device)


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D ``table`` and a contiguous ``index`` of any shape (one
    ``index_select``: cheaper on CPU than ``take`` or advanced indexing)."""
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def _fixed_beams(lp: torch.Tensor, budget: int) -> _Beams:
    """Every depth, fixed shapes, no host synchronisation (CUDA-graph safe).

    Each block of depth >= 2 is ``width = min(B - 1, M)`` wide and gives its best
    ``half = max(B // 2, 1)`` entries, sorted, as the next depth's parents.
    """
    bs, depth_count, k = lp.shape
    pair_parent, pair_rank = _candidate_pairs(budget, k, lp.device)  # [M], [M]
    width = min(budget - 1, pair_rank.numel())
    half = max(budget // 2, 1)
    first, first_pairs = _first_block(lp, budget, pair_rank.numel())
    scores, pair_index = [first], [first_pairs]
    parent_slots = [_arange(0, half, lp.device).expand(bs, half)]
    parents = first[:, :half]  # [bs, half] the next depth's parents, descending
    lp_by_depth = lp.transpose(0, 1).contiguous()  # [L, bs, k]
    for d in range(1, depth_count if width > 0 else 1):
        candidates = parents.index_select(1, pair_parent)  # [bs, M] parent scores
        candidates.add_(lp_by_depth[d].index_select(1, pair_rank))  # + token log-probs
        beam, index = torch.topk(candidates, width, dim=1, sorted=False)  # [bs, width]
        scores.append(beam)  # extensions of -inf padding stay -inf
        pair_index.append(index)
        # Sorting only the half that can be parents is much cheaper than a sorted top-width.
        parents, slots = torch.topk(beam, half, dim=1, sorted=True)
        parent_slots.append(slots)
    blocks = len(scores)
    widths = (budget,) + (width,) * (blocks - 1)
    return _Beams(
        torch.cat(scores, dim=1),
        torch.cat(pair_index, dim=1),
        torch.cat(parent_slots, dim=1),
        _layout(widths, (half,) * blocks, lp.device),
    )


class _RunningFloor:
    """The B best scores of every prefix found so far, per request, on the host.

    ``value[b]``, the B-th best, is a score that B distinct prefixes of request b reach, all
    shallower than any depth still to come. A deeper prefix scoring ``<= value[b]`` can never
    enter the answer: those B prefixes win, ties included (ties go to shallower nodes).
    """

    def __init__(self, first: torch.Tensor) -> None:
        self.best = first.numpy()  # [bs, B] the depth-1 block (distinct prefixes, -inf pads)
        self.value = self.best.min(axis=1)  # [bs]

    def add(self, beam: torch.Tensor) -> None:
        """Merge one depth's beam ``[bs, w]`` (distinct new prefixes) into the B best."""
        merged = np.concatenate([self.best, beam.numpy()], axis=1)  # [bs, B + w]
        budget = self.best.shape[1]
        self.best = np.partition(merged, merged.shape[1] - budget, axis=1)[:, -budget:]
        self.value = self.best[:, 0]  # the partition's pivot: the B-th best

    def count_above(self, scores: np.ndarray) -> int:
        """Max over requests of how many of ``scores`` ``[bs, n]`` beat the floor.

        Callers pass float32 sums formed as the torch loop forms them (parent + log-prob), and
        the survivors are always the best entries of a row (a sum grows with each term).
        """
        return int((scores > self.value[:, None]).sum(axis=1).max())


def _host_beams(lp: torch.Tensor, budget: int) -> _Beams:
    """The beams of :func:`_fixed_beams` for host tensors, pruned by a :class:`_RunningFloor`.

    At each depth only the parents and token ranks whose best extension beats the floor take
    part (both are sorted, so they are prefixes: the first ``n`` parents, the first ``r``
    ranks), the block keeps at most ``B - 1`` of their candidate pairs, and the loop ends at
    the first depth where nothing can beat the floor. Shapes depend on the values; the
    answer does not: only prefixes that can never be chosen are skipped.
    """
    bs, depth_count, k = lp.shape
    pair_count = _candidate_pairs(budget, k, lp.device)[0].numel()
    half = max(budget // 2, 1)
    first, first_pairs = _first_block(lp, budget, pair_count)
    lp_host = lp.numpy()  # [bs, L, k] a view
    lp_by_depth = lp.transpose(0, 1).contiguous()  # [L, bs, k]
    floor = _RunningFloor(first)

    def parent_count(beam_host: np.ndarray, depth: int) -> int:
        """How many of a block's best entries (sorted) can have a child at ``depth``."""
        if depth >= depth_count or pair_count == 0:
            return 0
        return min(half, floor.count_above(beam_host + lp_host[:, depth, :1]))

    parent_total = parent_count(first.numpy(), 1)
    parents = first[:, :parent_total]  # [bs, n] descending
    scores, pair_index = [first], [first_pairs]
    parent_slots = [_arange(0, max(parent_total, 1), lp.device).expand(bs, -1)]
    widths, halves = [budget], [max(parent_total, 1)]
    for d in range(1, depth_count):
        if parent_total == 0:
            break
        rank_total = floor.count_above(parents[:, :1].numpy() + lp_host[:, d, :])
        if rank_total == 0:
            break
        pairs, pair_parent, pair_rank = _pair_subset(budget, k, parent_total, rank_total, lp.device)
        candidates = parents.index_select(1, pair_parent)  # [bs, M'] parent scores
        candidates.add_(lp_by_depth[d].index_select(1, pair_rank))  # + token log-probs
        if candidates.shape[1] > budget - 1:
            beam, index = torch.topk(candidates, budget - 1, dim=1, sorted=False)
            scores.append(beam)
            pair_index.append(_lookup(pairs, index))
        else:
            scores.append(candidates)
            pair_index.append(pairs.expand(bs, -1))
        beam = scores[-1]
        widths.append(beam.shape[1])
        floor.add(beam)
        # The next parents: the best entries of the beam, as many as any row can use.
        parent_total = min(beam.shape[1], parent_count(beam.numpy(), d + 1))
        if parent_total > 0:
            parents, slots = torch.topk(beam, parent_total, dim=1, sorted=True)
            parent_slots.append(slots)
            halves.append(parent_total)
    return _Beams(
        torch.cat(scores, dim=1),
        torch.cat(pair_index, dim=1),
        torch.cat(parent_slots, dim=1),
        _layout(tuple(widths), tuple(halves), lp.device),
    )


@functools.lru_cache(maxsize=4096)
def _pair_subset(
    budget: int, k: int, parent_total: int, rank_total: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidate pairs with parent ``< parent_total`` and rank ``< rank_total``.

    Returns:
        ``(pair_index, parent, rank)``, int64 ``[M']``: the pairs' indices in
        :func:`_candidate_pairs` and their parent positions and token ranks.
    """
    pair_parent, pair_rank = _candidate_pairs(budget, k, device)
    index = torch.nonzero((pair_parent < parent_total) & (pair_rank < rank_total)).flatten()
    return index, pair_parent[index], pair_rank[index]


@functools.lru_cache(maxsize=4096)
def _layout(widths: tuple[int, ...], halves: tuple[int, ...], device: torch.device) -> _FlatLayout:
    """The :class:`_FlatLayout` of blocks of ``widths[e]`` entries and ``halves[e]`` parent
    slots (blocks past ``halves`` have no children)."""
    total = sum(widths)
    block_starts = [sum(widths[:e]) for e in range(len(widths))]
    slot_starts = [sum(halves[:e]) for e in range(len(halves))]
    depths = [e for e, w in enumerate(widths) for _ in range(w)]
    table = torch.tensor(
        [
            [f, e, e << _DEPTH_SHIFT]
            + ([slot_starts[e - 1], block_starts[e - 1]] if e > 0 else [0, total])
            for f, e in enumerate(depths)
        ],
        dtype=torch.long,
    )
    return _FlatLayout(*table.T.contiguous().to(device))


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


def _negated_bits(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys that grow as ``scores`` (all ``<= 0``) fall: the bits of ``0.0 - score``.

    ``0.0 - score`` is ``>= +0.0`` (never -0.0, so equal scores tie) and the int32 bits of a
    non-negative float grow with its value; they fit in 31 bits.
    """
    return (0.0 - scores).view(torch.int32).to(torch.int64)


def _chosen_in_breadth_first_order(beams: _Beams, budget: int) -> torch.Tensor:
    """``[bs, B]`` flat indices of the answer, breadth-first, padding last.

    The answer is the B best entries by (score descending, flat index ascending): the index
    grows with depth, so ties go to shallower nodes. One top-k of the unique selection keys
    ``score bits << 25 | f`` picks them; adding the depth field above makes the same key
    sort them by (depth, score descending, f), and a -inf score (padding) takes the depth
    field of :data:`_MAX_DEPTHS` to sort last.
    """
    keys = (_negated_bits(beams.scores) << _INDEX_BITS) | beams.layout.index  # [bs, N]
    chosen = torch.topk(keys, budget, dim=1, largest=False, sorted=False).values  # [bs, B]
    depth_keys = _lookup(beams.layout.depth_keys, chosen & _INDEX_MASK)
    depth_keys = torch.where(chosen >= _PADDING_KEY, _MAX_DEPTHS << _DEPTH_SHIFT, depth_keys)
    return (chosen | depth_keys).sort(dim=1).values & _INDEX_MASK


def build_ddtree(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int,
    *,
    vocab_size: int | None = None,
    validate: bool = True,
    prune: bool = False,
) -> DraftTree:
    """The ``budget`` most probable prefixes of the top-K lattice, batched and on device.

    Args:
        topk_logprobs: ``[bs, L, K]`` float, each position's log-probs sorted descending.
        topk_tokens: ``[bs, L, K]`` integer token ids matching ``topk_logprobs``.
        budget: B, node slots per request (the root/bonus token is not counted).
        vocab_size: when given, K and the token ids are checked against it.
        validate: also check values (sorted, finite order, distinct tokens). This reads the
            inputs on the host; the decode hot path passes ``False``.
        prune: skip every parent, token rank and depth that cannot beat the B-th best score
            found so far. Reads a score back per depth, so shapes follow the values: the fast
            loop for host tensors, never for a CUDA graph. The tree is the same either way.

    Returns:
        A :class:`DraftTree` with ``[bs, budget]`` tensors; within a depth, nodes by score
        descending. Exact within the lattice: with K = min(B, V) it is the optimal tree over
        the whole vocabulary.
    """
    _check_topk_inputs(topk_logprobs, topk_tokens, budget, vocab_size, validate)
    bs, depth_count, k_all = topk_logprobs.shape
    device = topk_logprobs.device
    # A rank r (0-based) token can only be in the B best if r < B: ranks 0..r-1 beat it.
    k = min(k_all, budget)
    lp = topk_logprobs[..., :k].float().clamp_min(LOGPROB_FLOOR)  # [bs, L, k] finite

    beams = _host_beams(lp, budget) if prune else _fixed_beams(lp, budget)
    layout = beams.layout
    chosen = _chosen_in_breadth_first_order(beams, budget)  # [bs, B] flat indices
    depth0 = _lookup(layout.depths, chosen)  # [bs, B] 0-based depth

    # Decode each chosen entry: its token rank, and its parent's sorted slot one depth up.
    parent_rank, rank = _pair_table(budget, k, device)
    pair = beams.pair_index.gather(1, chosen)
    tokens = topk_tokens[..., :k].to(torch.long).flatten(1)
    tokens = tokens.gather(1, depth0 * k + _lookup(rank, pair))
    logprobs = beams.scores.gather(1, chosen)
    valid = logprobs > float("-inf")

    # The parent's flat index, then its node index (depth-1 nodes land on the -1 column).
    slot = beams.parent_slots.gather(
        1, _lookup(layout.parent_slot_starts, chosen) + _lookup(parent_rank, pair)
    )
    node_of_flat = beams.scores.new_full((bs, beams.scores.shape[1] + 1), -1, dtype=torch.long)
    node_of_flat.scatter_(1, chosen, _arange(0, budget, device).expand(bs, budget))
    parents = node_of_flat.gather(1, _lookup(layout.parent_block_starts, chosen) + slot)

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
