"""Graft: successor table semantics, rank templates, grafting policies, engine exactness."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from test_engine import (
    PROMPTS,
    chi_square_p_small,
    exact_two_token_law,
    random_drafter,
    tiny_target,
)
from tree_helpers import assert_well_formed, node_paths, random_marginals

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.graft import (
    UNKNOWN,
    EdgeAcceptance,
    Grafter,
    StageConfig,
    SuccessorTable,
    calibrate_stage,
    edge_evidence,
    evidence_classes,
    graft_stage,
    graft_unified,
    rank_template,
    stage_confidences,
)
from sglang_tree_spec.graft.edges import PARENT_RUNS, Q_KNOTS
from sglang_tree_spec.graft.template import best_first_position, static_template
from sglang_tree_spec.tree import build_ddtree
from sglang_tree_spec.tree.ddtree import LOGPROB_FLOOR

FIELDS = ("tokens", "parents", "depths", "logprobs", "valid")

# ------------------------------------------------------------------------ successor table


def sequential_update(table: torch.Tensor, tokens, logits, valid) -> torch.Tensor:
    """Reference: one row write per valid entry, in order (so the last writer wins)."""
    out = table.clone()
    for token, row, ok in zip(tokens.tolist(), logits, valid.tolist(), strict=True):
        if ok:
            out[token] = row.topk(table.shape[1]).indices.to(torch.int32)
    return out


def sequential_observe(table: torch.Tensor, sequences: list[list[int]]) -> torch.Tensor:
    """Reference: each bigram in row-major order takes the first free rank if new to the row."""
    out = table.clone()
    for seq in sequences:
        for a, b in itertools.pairwise(seq):
            if a < 0 or b < 0:
                continue
            row = out[a].tolist()
            if b not in row and UNKNOWN in row:
                out[a, row.index(UNKNOWN)] = b
    return out


@pytest.mark.parametrize("seed", range(4))
def test_batched_update_equals_sequential_reference(seed):
    vocab, k, m = 40, 4, 64
    g = torch.Generator().manual_seed(seed)
    table = SuccessorTable(vocab, k)
    table.observe(torch.randint(0, vocab, (2, 30), generator=g))
    tokens = torch.randint(0, 12, (m,), generator=g)  # many duplicate rows
    logits = torch.randn(m, vocab, generator=g)
    valid = torch.rand(m, generator=g) < 0.7
    expected = sequential_update(table.table, tokens, logits, valid)
    table.update(tokens, logits, valid)
    assert torch.equal(table.table, expected)
    table.update(tokens, logits)  # no mask: every entry writes
    assert torch.equal(table.table, sequential_update(expected, tokens, logits, torch.ones(m) > 0))


def test_update_last_writer_wins_and_padding_never_writes():
    table = SuccessorTable(8, k=2)
    logits = torch.zeros(4, 8)
    logits[0, [1, 2]] = torch.tensor([2.0, 1.0])
    logits[1, [3, 4]] = torch.tensor([2.0, 1.0])
    logits[2, [5, 6]] = torch.tensor([2.0, 1.0])
    logits[3, [7, 0]] = torch.tensor([2.0, 1.0])
    table.update(torch.tensor([3, 5, 3, 3]), logits, torch.tensor([True, True, True, False]))
    assert table.table[3].tolist() == [5, 6]  # entry 2: the last valid writer of row 3
    assert table.table[5].tolist() == [3, 4]
    assert (table.table[[0, 1, 2, 4, 6, 7]] == UNKNOWN).all()


def test_observe_fills_free_ranks_in_first_occurrence_order():
    table = SuccessorTable(10, k=2)
    table.observe(torch.tensor([[1, 2, 1, 3, 1, 2, 1, 4], [5, 6, -1, -1, -1, -1, -1, -1]]))
    assert table.table[1].tolist() == [2, 3]  # 4 is surplus, the repeated 2 counted once
    assert table.table[2].tolist() == [1, UNKNOWN]
    assert table.table[5].tolist() == [6, UNKNOWN]
    assert table.table[6].tolist() == [UNKNOWN, UNKNOWN]  # (6, -1) is padding
    table.observe(torch.tensor([2, 7, 2, 1, 1, 9]))
    assert table.table[2].tolist() == [1, 7]
    assert table.table[1].tolist() == [2, 3]  # a full row is left alone
    logits = torch.zeros(1, 10)
    logits[0, 8], logits[0, 9] = 2.0, 1.0
    table.update(torch.tensor([5]), logits)
    table.observe(torch.tensor([5, 0]))
    assert table.table[5].tolist() == [8, 9]  # target-written rows never change


@pytest.mark.parametrize("seed", range(3))
def test_observe_equals_sequential_reference(seed):
    g = torch.Generator().manual_seed(seed)
    table = SuccessorTable(9, k=3)
    table.observe(torch.randint(0, 9, (1, 6), generator=g))
    sequences = torch.randint(-1, 9, (3, 20), generator=g)
    expected = sequential_observe(table.table, sequences.tolist())
    table.observe(sequences)
    assert torch.equal(table.table, expected)


def test_lookup_rows_and_state_dict_round_trip():
    table = SuccessorTable(10, k=3)
    table.observe(torch.tensor([4, 7, 4, 8, 7, 1]))
    parents = torch.tensor([4, 4, 7, 7, 7, UNKNOWN])
    ranks = torch.tensor([0, 1, 0, 1, 2, 0])
    assert table.lookup(parents, ranks).tolist() == [7, 8, 4, 1, UNKNOWN, UNKNOWN]
    assert table.lookup(torch.tensor([[4], [7]]), torch.arange(3)).shape == (2, 3)  # broadcasts
    assert table.lookup(torch.tensor(4), torch.tensor(2)).item() == UNKNOWN
    assert table.rows(torch.tensor([4, UNKNOWN])).tolist() == [[7, 8, UNKNOWN], [UNKNOWN] * 3]
    other = SuccessorTable(10, k=3)
    other.load_state_dict(table.state_dict())
    assert torch.equal(other.table, table.table)
    state = table.state_dict()
    table.reset()
    assert not torch.equal(state["table"], table.table)  # state_dict is a copy
    with pytest.raises(ValueError, match="does not fit"):
        SuccessorTable(10, k=4).load_state_dict(state)
    with pytest.raises(ValueError, match="logits"):
        table.update(torch.tensor([1, 2]), torch.zeros(2, 9))


# ------------------------------------------------------------------- templates, statistics


def test_rank_template_is_nested_prefix_closed_and_rank0_deepest():
    probs = torch.tensor([0.7, 0.15, 0.08, 0.04])
    full = rank_template(probs, 30, 6)
    paths = node_paths(full.parents.tolist(), full.ranks.tolist(), full.valid.tolist())
    for i, parent in enumerate(full.parents.tolist()):
        if parent >= 0:
            assert full.priority[parent] < full.priority[i]
    deepest = int(full.depths.argmax())
    assert paths[deepest] == (0,) * int(full.depths.max())
    for n in (1, 5, 12):
        small = rank_template(probs, n, 6)
        small_paths = node_paths(small.parents.tolist(), small.ranks.tolist(), [True] * n)
        best = [paths[i] for i in range(30) if full.priority[i] < n]
        # Equal up to ties: paths with the same ranks in another order score the same.
        assert sorted(sorted(p) for p in small_paths) == sorted(sorted(p) for p in best)
    # A rank lattice smaller than the template pads.
    tiny = rank_template(probs[:2], 10, 2)
    assert tiny.valid.sum() == 6 and not tiny.valid[6:].any()


def test_evidence_classes_rank_absent_unseen():
    rows = torch.tensor([[4, 7, 9], [4, 7, 9], [4, UNKNOWN, UNKNOWN], [UNKNOWN] * 3])
    tokens = torch.tensor([9, 5, 5, 4])
    # rank 2; absent from a full row (k); not in a partial / unknown row (k + 1)
    assert evidence_classes(rows, tokens).tolist() == [2, 3, 4, 4]


def test_edge_acceptance_prior_interpolation_and_state():
    edges = EdgeAcceptance(3, depth_classes=2, strength=2.0)
    q = torch.tensor([0.0, 0.01, 0.3, 0.9, 1.0])
    unseen = edges.probs(1, torch.full((5,), 4), q)
    assert unseen.tolist() == pytest.approx([1e-6, 0.01, 0.3, 0.9, 1 - 1e-6], abs=1e-6)
    # Depths past the classes pool. At the knots, the prior halves the odds of ABSENT tokens.
    knots = torch.tensor([0.015, 0.27, 0.85])
    absent = edges.probs(5, torch.full((3,), 3), knots)
    assert absent.tolist() == pytest.approx((knots / (2 - knots)).tolist(), rel=1e-5)
    ranked = edges.probs(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([0.3, 0.3]))
    assert (ranked > 0.3).all()  # in the row: more likely than the drafter alone says
    other = EdgeAcceptance(3, depth_classes=2, strength=2.0)
    other.hits += 1.0
    edges.load_state_dict(other.state_dict())
    assert torch.equal(edges.probs(1, torch.tensor(4), q), other.probs(1, torch.tensor(4), q))
    with pytest.raises(ValueError, match="do not fit"):
        EdgeAcceptance(4).load_state_dict(other.state_dict())


def reference_edge_counts(tree, evidence, q, committed, edges):
    """Python reference of :meth:`EdgeAcceptance.observe`: tried / hit per cell and knot."""
    trials = torch.zeros_like(edges.trials)
    hits = torch.zeros_like(edges.hits)
    knots = list(Q_KNOTS)
    for b in range(tree.batch_size):
        accepted = {-1}
        run = {-1: 0}  # node -> consecutive in-row edges ending at it, capped
        for i in range(tree.budget):
            parent = int(tree.parents[b, i])
            in_row = int(evidence[b, i]) < edges.k
            run[i] = min(run[parent] + 1, PARENT_RUNS - 1) if in_row else 0
            if not tree.valid[b, i] or parent not in accepted:
                continue
            depth = int(tree.depths[b, i])
            hit = int(tree.tokens[b, i]) == int(committed[b, depth - 1])
            if hit:
                accepted.add(i)
            value = float(q[b, i])
            j = max(j for j in range(len(knots) - 1) if knots[j] <= value)
            w = (value - knots[j]) / (knots[j + 1] - knots[j])
            cell = (min(depth, edges.depth_classes) - 1, run[parent], int(evidence[b, i]))
            for knot, weight in ((j, 1 - w), (j + 1, w)):
                trials[(*cell, knot)] += weight
                hits[(*cell, knot)] += weight * hit
    return trials, hits


@pytest.mark.parametrize("seed", range(3))
def test_edge_acceptance_counts_tried_and_hit_nodes(seed):
    vocab, bs = 12, 3
    lp, tok = random_marginals(bs, 4, 3, vocab, seed=seed, sharpness=1.0)
    tree = build_ddtree(lp, tok, 10)
    table = random_table(vocab, 3, seed)
    roots = torch.tensor([1, 2, 3])
    evidence, q = edge_evidence(tree, lp, tok, roots, table)
    # Commit the path of each request's first deepest-by-index draft node, then a bonus.
    g = torch.Generator().manual_seed(seed)
    committed = torch.full((bs, 5), -1)
    for b in range(bs):
        paths = node_paths(tree.parents[b].tolist(), tree.tokens[b].tolist(), [True] * 10)
        path = list(paths[int(torch.randint(0, 10, (1,), generator=g))])
        path = path[: int(torch.randint(0, len(path) + 1, (1,), generator=g))]
        committed[b, : len(path) + 1] = torch.tensor([*path, 11])
    edges = EdgeAcceptance(3, depth_classes=2, strength=1.0)
    before_t, before_h = edges.trials.clone(), edges.hits.clone()
    edges.observe(tree, evidence, q, committed)
    trials, hits = reference_edge_counts(tree, evidence, q, committed, edges)
    assert torch.allclose(edges.trials - before_t, trials, atol=1e-9)
    assert torch.allclose(edges.hits - before_h, hits, atol=1e-9)
    assert trials.sum() > 0


def test_calibration_bounds_the_misjudgment_rate():
    g = torch.Generator().manual_seed(0)
    n = 2000
    conf = torch.rand(n, generator=g, dtype=torch.float64)
    reached = (conf > 0.5) ^ (torch.rand(n, generator=g) < 0.1)  # 10% label noise
    accept = torch.where(reached, 8, 0)
    config = calibrate_stage(conf.unsqueeze(1), accept, StageConfig((3,), (0.0,), (0.5,)))
    tau = config.thresholds[0]
    assert 0.55 < tau < 0.68  # the analytic bound is 0.615
    assert (reached[conf <= tau].double().mean()) <= 0.25
    confident = calibrate_stage(conf.unsqueeze(1), torch.full((n,), 8), config)
    assert confident.thresholds == (0.0,)
    # Later checkpoints are calibrated on the steps that pass the earlier ones.
    two = StageConfig((1, 3), (0.0, 0.0), (0.2, 0.5))
    calibrated = calibrate_stage(torch.stack([conf, conf], 1), accept, two)
    assert calibrated.thresholds[1] == 0.0
    with pytest.raises(ValueError, match="increasing"):
        StageConfig((2, 1), (0.1, 0.1), (0.1, 0.2))


def test_stage_confidences_are_best_path_probabilities():
    lp, _ = random_marginals(2, 4, 3, 20, seed=1)
    conf = stage_confidences(lp, (1, 3, 9))
    best = lp[:, :, 0].double().cumsum(1).exp()
    assert conf[:, 0].tolist() == pytest.approx(best[:, 0].tolist(), rel=1e-5)
    assert conf[:, 1].tolist() == pytest.approx(best[:, 2].tolist(), rel=1e-5)
    assert conf[:, 2].tolist() == pytest.approx(best[:, 3].tolist(), rel=1e-5)


# --------------------------------------------------------------------------------- policies


def random_table(vocab: int, k: int, seed: int, known_rows: float = 0.6) -> SuccessorTable:
    """A table with target-written rows, bigram-filled partial rows and unknown rows."""
    g = torch.Generator().manual_seed(seed)
    table = SuccessorTable(vocab, k)
    rows = torch.nonzero(torch.rand(vocab, generator=g) < known_rows).flatten()
    table.update(rows, torch.randn(rows.shape[0], vocab, generator=g))
    table.observe(torch.randint(0, vocab, (1, vocab), generator=g))
    return table


def assert_grafted_from(out, tree, table, roots, topk_tokens=None) -> None:
    """Every node is a draft path or a retrieved token: a known entry of its parent's row.

    With ``topk_tokens`` (the unified policy's lattice) a draft node is any node whose token is
    in the drafter's top-K at its depth, not only a node of ``tree``.
    """
    for b in range(out.batch_size):
        valid = out.valid[b].tolist()
        draft = set(
            node_paths(tree.parents[b].tolist(), tree.tokens[b].tolist(), tree.valid[b].tolist())
        )
        paths = node_paths(out.parents[b].tolist(), out.tokens[b].tolist(), valid)
        for path in paths[: sum(valid)]:
            if path in draft:
                continue
            if topk_tokens is not None and path[-1] in topk_tokens[b, len(path) - 1].tolist():
                continue
            parent_token = path[-2] if len(path) > 1 else int(roots[b])
            row = table.table[parent_token].tolist()
            assert path[-1] in row and path[-1] != UNKNOWN


POLICY_CASES = [  # (depth L, top-K, budget, table k)
    (1, 3, 5, 2),
    (3, 2, 6, 3),
    (4, 4, 16, 4),
    (6, 8, 40, 8),
    (8, 3, 1, 4),
]


@pytest.mark.parametrize(("depth", "k", "budget", "table_k"), POLICY_CASES)
@pytest.mark.parametrize("seed", range(3))
def test_policies_keep_the_tree_contract(depth, k, budget, table_k, seed):
    vocab, bs = 24, 3
    lp, tok = random_marginals(bs, depth, k, vocab, seed=seed, sharpness=2.0)
    tree = build_ddtree(lp, tok, budget)
    table = random_table(vocab, table_k, seed)
    roots = torch.randint(0, vocab, (bs,), generator=torch.Generator().manual_seed(seed))
    thresholds = tuple(
        float(x) for x in torch.rand(3, generator=torch.Generator().manual_seed(seed))
    )
    outputs = [
        (graft_stage(tree, lp, tok, roots, table, StageConfig(thresholds=thresholds)), None),
        (graft_stage(tree, lp, tok, roots, table, StageConfig(thresholds=(1.0, 1.0, 1.0))), None),
        (graft_unified(tree.budget, lp, tok, roots, table, EdgeAcceptance(table_k)), tok),
        (graft_unified(tree.budget, lp, tok, roots, table, random_edges(table_k, seed)), tok),
    ]
    for out, lattice in outputs:
        assert out.tokens.shape == tree.tokens.shape and out.max_depth == tree.max_depth
        assert all(getattr(out, f).dtype == getattr(tree, f).dtype for f in FIELDS)
        assert_well_formed(out, lp, tok)
        assert_grafted_from(out, tree, table, roots, lattice)
        assert (out.valid.sum(1) >= tree.valid.sum(1)).all()  # retrieval never empties a slot


def random_edges(k: int, seed: int, depth_classes: int = 3) -> EdgeAcceptance:
    """An edge estimate with random (but valid) rates in every cell."""
    edges = EdgeAcceptance(k, depth_classes=depth_classes, strength=1.0)
    g = torch.Generator().manual_seed(seed)
    edges.hits.copy_(torch.rand(edges.hits.shape, generator=g, dtype=torch.float64))
    return edges


def reference_unified(lp, tok, root, table, edges, budget):
    """Plain-Python unified selection for one request: enumerate the whole lattice (drafted
    top-K children and row successors of every node, a token counted once), score paths by
    the product of edge probabilities, keep the ``budget`` best per depth among the children
    of the previous depth's kept nodes, then the ``budget`` best overall by (score desc, depth
    asc). Returns the set of token paths."""
    depth_count = tok.shape[0]
    kept = [((), 0.0, root, 0)]  # (path, log score, last token, its run)
    chosen = []
    for d in range(depth_count):
        candidates = []
        for path, score, last, run in kept:
            row = [t for t in table.table[last].tolist() if t != UNKNOWN]
            drafted = tok[d].tolist()
            children = [(t, float(lp[d, j].exp())) for j, t in enumerate(drafted)]
            children += [(t, 0.0) for t in row if t not in drafted]
            for token, q in children:
                evidence = evidence_classes(
                    torch.tensor(table.table[last].tolist()), torch.tensor(token)
                )
                p = float(edges.probs(d + 1, evidence, torch.tensor(q), run))
                child_run = min(run + 1, PARENT_RUNS - 1) if evidence < table.k else 0
                candidates.append(((*path, token), score + math.log(p), token, child_run))
        candidates.sort(key=lambda c: -c[1])  # stable: ties keep lattice order
        kept = candidates[:budget]
        chosen += [(c[1], d, c[0]) for c in kept]
    chosen.sort(key=lambda c: (-c[0], c[1]))
    return {c[2] for c in chosen[:budget]}


@pytest.mark.parametrize(("depth", "k", "budget", "table_k"), [(3, 2, 5, 2), (4, 3, 9, 2)])
@pytest.mark.parametrize("seed", range(4))
def test_unified_equals_the_plain_reference(depth, k, budget, table_k, seed):
    vocab, bs = 10, 2
    lp, tok = random_marginals(bs, depth, k, vocab, seed=seed, sharpness=1.0)
    tree = build_ddtree(lp, tok, budget)
    table = random_table(vocab, table_k, seed, known_rows=0.8)
    roots = torch.tensor([3, 7])
    edges = random_edges(table_k, seed + 10)
    out = graft_unified(tree.budget, lp, tok, roots, table, edges)
    for b in range(bs):
        paths = node_paths(out.parents[b].tolist(), out.tokens[b].tolist(), out.valid[b].tolist())
        expected = reference_unified(lp[b], tok[b], int(roots[b]), table, edges, budget)
        assert set(paths[: int(out.valid[b].sum())]) == expected


def reference_stage(tree, b, lp, tok, root, table, config):
    """Plain-Python stage grafting for request ``b``: the set of token paths it keeps, and how
    many retrieved nodes met a cousin (a draft node of the same depth and token under another
    parent).

    ``keep`` draft nodes by score (score desc, slot asc) come first; then the static template
    in its priority order, each rank path retrieved token by token from the bonus token (a
    path through an UNKNOWN entry is dropped); a retrieved path that is a draft path is that
    draft node (it takes the template's priority when earlier); then the other draft nodes by
    score. The tree is the ``budget`` first entries."""
    budget, depth_count = tree.budget, tree.max_depth
    keep = budget
    best = 0.0
    for d in range(depth_count):
        best += float(lp[b, d, 0])
        if d + 1 in config.depths:
            c = config.depths.index(d + 1)
            if math.exp(best) <= config.thresholds[c]:
                keep = config.keep_counts(budget)[c]
                break
    valid = tree.valid[b].tolist()
    draft = node_paths(tree.parents[b].tolist(), tree.tokens[b].tolist(), valid)
    scores = tree.logprobs[b].tolist()
    order = sorted((i for i in range(budget) if valid[i]), key=lambda i: (-scores[i], i))
    draft_paths = {draft[i] for i in order}
    priority = {}
    for position, i in enumerate(order):
        priority[draft[i]] = position if position < keep else keep + budget + position
    draft_at = {}  # (depth, token) -> draft parent paths
    for i in order:
        draft_at.setdefault((len(draft[i]), draft[i][-1]), set()).add(draft[i][:-1])
    template = static_template(budget, depth_count, table.k, tree.device)
    retrieved: dict[int, tuple[int, ...] | None] = {}  # template node -> token path
    cousins = 0
    for t in range(template.size):
        if not template.valid[t]:
            continue
        parent = int(template.parents[t])
        prefix = () if parent < 0 else retrieved[parent]
        if prefix is None:  # under an UNKNOWN entry
            retrieved[t] = None
            continue
        last = prefix[-1] if prefix else root
        token = int(table.table[last, int(template.ranks[t])])
        path = retrieved[t] = None if token == UNKNOWN else (*prefix, token)
        if path is None:
            continue
        rank_priority = keep + int(template.priority[t])
        if path in draft_paths:  # the draft node itself
            priority[path] = min(priority[path], rank_priority)
        else:
            priority[path] = rank_priority
        if prefix in draft_paths and any(p != prefix for p in draft_at.get((len(path), token), ())):
            cousins += 1
    chosen = sorted(priority, key=priority.get)[:budget]
    return set(chosen), cousins


def stage_paths(out, b):
    """The token paths of request ``b``'s valid nodes."""
    valid = out.valid[b].tolist()
    return set(node_paths(out.parents[b].tolist(), out.tokens[b].tolist(), valid)[: sum(valid)])


def test_stage_grafts_under_the_merged_node_not_its_cousin():
    """A retrieved node merges only into a draft child of its own (merged) parent: here the
    retrieved path b -> t is the draft node (b, t), and (a, t), a same-depth draft node with
    the same token under the other parent, must not take it, or the grafted branch
    (b, t, z) ends up under a and is lost."""
    root, a, b, t, u, v, w, x, y, z = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
    lp = torch.tensor([[[0.55, 0.4], [0.6, 0.3], [0.5, 0.2]]]).log()
    tok = torch.tensor([[[a, b], [t, u], [v, w]]])
    tree = build_ddtree(lp, tok, 8)
    table = SuccessorTable(12, k=2)
    table.observe(torch.tensor([[root, b, t, z], [root, x, -1, -1]]))  # rows: root [b, x]
    table.observe(torch.tensor([b, y]))  # row b: [t, y]; row t: [z]
    config = StageConfig(depths=(1,), thresholds=(1.0,), keep_fractions=(2 / 8,))
    out = graft_stage(tree, lp, tok, torch.tensor([root]), table, config)
    assert_well_formed(out, lp, tok)
    expected, cousins = reference_stage(tree, 0, lp, tok, root, table, config)
    assert cousins == 1
    assert (b, t, z) in expected and (a, t, z) not in expected
    assert stage_paths(out, 0) == expected


@pytest.mark.parametrize(("depth", "k", "budget", "table_k"), [(3, 3, 10, 2), (4, 3, 16, 3)])
@pytest.mark.parametrize("seed", range(4))
def test_stage_equals_the_plain_reference(depth, k, budget, table_k, seed):
    """Guards the stage policy's pool (merging, retrieval through the table, the three
    priority tiers) against :func:`reference_stage`, on a small vocabulary where retrieved
    tokens often meet draft nodes of the same depth and token under other parents."""
    vocab, bs = 6, 3
    lp, tok = random_marginals(bs, depth, k, vocab, seed=seed, sharpness=1.0)
    tree = build_ddtree(lp, tok, budget)
    table = random_table(vocab, table_k, seed, known_rows=0.9)
    roots = torch.tensor([0, 3, 5])
    configs = [
        StageConfig(thresholds=(1.0, 1.0, 1.0)),  # prune at depth 1
        StageConfig(thresholds=(0.0, 1.0, 1.0), keep_fractions=(0.1, 0.5, 0.6)),  # depth 2
        StageConfig(thresholds=(0.0, 0.0, 0.0)),  # keep the draft tree
    ]
    collisions = 0
    for config in configs:
        out = graft_stage(tree, lp, tok, roots, table, config)
        assert_well_formed(out, lp, tok)
        for b in range(bs):
            expected, cousins = reference_stage(tree, b, lp, tok, int(roots[b]), table, config)
            assert stage_paths(out, b) == expected, (config, b)
            collisions += cousins
    assert collisions > 0  # the case meets a cousin


def test_stage_keeps_the_draft_tree_when_confident():
    lp, tok = random_marginals(3, 5, 4, 30, seed=3)
    tree = build_ddtree(lp, tok, 12)
    out = graft_stage(
        tree,
        lp,
        tok,
        torch.tensor([1, 2, 3]),
        random_table(30, 4, 0),
        StageConfig(thresholds=(0.0, 0.0, 0.0)),
    )
    for field in FIELDS:
        assert torch.equal(getattr(out, field), getattr(tree, field)), field


def test_stage_keeps_the_best_draft_nodes_when_pruning():
    lp, tok = random_marginals(3, 5, 4, 30, seed=4, sharpness=1.0)
    budget = 24
    tree = build_ddtree(lp, tok, budget)
    roots = torch.tensor([5, 6, 7])
    table = random_table(30, 4, 1, known_rows=1.0)
    config = StageConfig(thresholds=(1.0, 1.0, 1.0))  # the first checkpoint always prunes
    out = graft_stage(tree, lp, tok, roots, table, config)
    keep = config.keep_counts(budget)[0]
    position = best_first_position(tree.logprobs)
    for b in range(3):
        draft = node_paths(
            tree.parents[b].tolist(), tree.tokens[b].tolist(), tree.valid[b].tolist()
        )
        kept = {draft[i] for i in range(budget) if position[b, i] < keep}
        paths = set(
            node_paths(out.parents[b].tolist(), out.tokens[b].tolist(), out.valid[b].tolist())
        )
        assert kept <= paths
        assert len(paths - set(draft)) >= budget - keep - 4  # the rest is mostly retrieved
    assert out.valid.all()


def test_unknown_successors_are_never_grafted():
    lp, tok = random_marginals(2, 4, 4, 30, seed=5)
    tree = build_ddtree(lp, tok, 10)
    empty = SuccessorTable(30, 4)
    roots = torch.tensor([1, 2])
    for out in (
        graft_stage(tree, lp, tok, roots, empty, StageConfig(thresholds=(1.0, 1.0, 1.0))),
        graft_unified(
            tree.budget, lp, tok, roots, empty, EdgeAcceptance(4)
        ),  # fresh: p = q, DDTree
    ):
        for field in ("tokens", "parents", "depths", "valid"):
            assert torch.equal(getattr(out, field), getattr(tree, field)), field


def fixed_edges(k: int, rates: dict[int, float], depth_classes: int = 3) -> EdgeAcceptance:
    """An edge estimate whose rate depends on the evidence class only (``rates[class]``)."""
    edges = EdgeAcceptance(k, depth_classes=depth_classes)
    for evidence, rate in rates.items():
        edges.hits[:, :, evidence] = edges.trials[:, :, evidence] * rate
    return edges


def test_unified_merges_a_retrieved_token_with_its_draft_twin():
    a, b, c, root = 4, 5, 6, 1
    lp = torch.tensor([[[math.log(0.5), math.log(0.3)]]])
    tok = torch.tensor([[[a, b]]])
    tree = build_ddtree(lp, tok, 2)
    table = SuccessorTable(10, k=2)
    logits = torch.zeros(1, 10)
    logits[0, c], logits[0, a] = 2.0, 1.0
    table.update(torch.tensor([root]), logits)  # row root: [c, a]
    roots = torch.tensor([root])
    # a: drafted and rank 1 (one node), c: rank 0 only, b: absent from the full row
    out = graft_unified(
        tree.budget, lp, tok, roots, table, fixed_edges(2, {0: 0.4, 1: 0.7, 2: 0.15})
    )
    assert out.tokens[0].tolist() == [a, c] and out.valid.all()
    assert out.logprobs[0].tolist() == pytest.approx([math.log(0.5), LOGPROB_FLOOR])
    out = graft_unified(
        tree.budget, lp, tok, roots, table, fixed_edges(2, {0: 0.1, 1: 0.7, 2: 0.15})
    )
    assert out.tokens[0].tolist() == [a, b]  # c: 0.1 < b: 0.15


def test_grafter_learns_from_verify_logits_and_grafts_what_it_learnt():
    """A step of learning writes the verified nodes' top-k rows (padding slots write nothing)
    and counts the tried edges; the next tree then fills the slot the drafter's lattice left
    empty with the target's successor of the root, which the drafter never proposed."""
    root, drafted, learnt = 1, 4, 7
    lp = torch.tensor([[[math.log(0.6), math.log(0.3)]]])
    tok = torch.tensor([[[drafted, 5]]])
    grafter = Grafter("unified", vocab_size=10, k=2, topk=2)
    tree = build_ddtree(lp, tok, 3)  # a 2-prefix lattice: the third slot is padding
    grafted = grafter.select(lp, tok, torch.tensor([root]), 3)  # empty table: the DDTree
    for field in FIELDS:
        assert torch.equal(getattr(grafted, field), getattr(tree, field)), field
    window = torch.tensor([[root, drafted, 5, 0]])  # [bs, W]: the root, then the slots
    logits = torch.zeros(1, 4, 10)
    logits[0, 0, learnt], logits[0, 0, 2] = 5.0, 4.0  # after the root: learnt, then 2
    logits[0, 1, 3] = 5.0
    logits[0, 3, 9] = 5.0  # the padding slot's logits must not reach row 0
    committed = torch.tensor([[learnt]])  # no draft accepted, the bonus is `learnt`
    grafter.learn(grafted, window, logits, committed)
    assert grafter.successors.table[root].tolist() == [learnt, 2]
    assert grafter.successors.table[drafted, 0].item() == 3
    assert (grafter.successors.table[0] == UNKNOWN).all()
    assert grafter.edge_acceptance.trials.sum() > EdgeAcceptance(2).trials.sum()
    with pytest.raises(RuntimeError, match="needs the tree of the last"):
        grafter.learn(grafted, window, logits, committed)  # evidence is used once
    again = grafter.select(lp, tok, torch.tensor([root]), 3)
    assert again.valid.all() and learnt in again.tokens[0].tolist()
    with pytest.raises(ValueError, match="graft method must be one of"):
        Grafter("retrieval", vocab_size=10)


def test_a_plain_step_teaches_the_table_its_roots_successors():
    """A plain step (budget 0: no draft, no select) still verifies the root: its logits
    refresh the root token's row (so auto's probes graft from a warm table); the edge
    acceptance, which counts grafted edges, is left alone."""
    from sglang_tree_spec.tree.select import empty_tree

    grafter = Grafter("unified", vocab_size=10, k=2, topk=2)
    trials = grafter.edge_acceptance.trials.clone()
    logits = torch.zeros(2, 1, 10)
    logits[0, 0, 6], logits[0, 0, 8] = 5.0, 4.0
    logits[1, 0, 2], logits[1, 0, 3] = 5.0, 4.0
    roots = torch.tensor([[1], [4]])  # [bs, W = 1]
    grafter.learn(empty_tree(2, "cpu"), roots, logits, torch.tensor([[6], [2]]))
    assert grafter.successors.table[1].tolist() == [6, 8]
    assert grafter.successors.table[4].tolist() == [2, 3]
    assert torch.equal(grafter.edge_acceptance.trials, trials)


def test_unified_retrieves_below_draft_nodes_by_depth():
    a, x, y, z, root = 2, 3, 4, 5, 1
    lp = torch.tensor([[[math.log(0.9), math.log(0.05)], [math.log(0.3), math.log(0.2)]]])
    tok = torch.tensor([[[a, 9], [x, y]]])
    tree = build_ddtree(lp, tok, 3)
    table = SuccessorTable(10, k=2)
    table.observe(torch.tensor([a, z]))  # row a: [z, ?] (a partial row: x, y are UNSEEN)
    roots = torch.tensor([root])
    edges = EdgeAcceptance(2, depth_classes=2)
    rank_0 = edges.trials[:, :, 0]  # [depth class, parent state, knot]
    edges.hits[:, :, 0] = rank_0 * torch.tensor([0.01, 0.5]).view(2, 1, 1)  # depth 1, 2
    out = graft_unified(tree.budget, lp, tok, roots, table, edges)
    paths = node_paths(out.parents[0].tolist(), out.tokens[0].tolist(), out.valid[0].tolist())
    # z (0.9 * 0.5) under the drafted a beats x (0.9 * 0.3); y (0.9 * 0.2) is left out
    assert paths == [(a,), (a, z), (a, x)]
    edges.hits[1, :, 0] = edges.trials[1, :, 0] * 0.25  # rank 0 at depth 2 now below x
    out = graft_unified(tree.budget, lp, tok, roots, table, edges)
    paths = node_paths(out.parents[0].tolist(), out.tokens[0].tolist(), out.valid[0].tolist())
    assert paths == [(a,), (a, x), (a, z)]


def test_unified_prices_a_retrieved_run_by_its_length():
    """A retrieved child of a retrieved parent is priced at its parent's run (here 1): when
    repeats come in runs (run-1 rank-0 rate high) the run z0 -> z1 takes the third slot; when
    they do not (every run at the same rate: independent edges), the drafted a -> x does."""
    a, b, x, y, z0, z1, root = 2, 3, 4, 5, 6, 7, 1
    lp = torch.tensor([[[math.log(0.6), math.log(0.25)], [math.log(0.5), math.log(0.2)]]])
    tok = torch.tensor([[[a, b], [x, y]]])
    tree = build_ddtree(lp, tok, 3)
    table = SuccessorTable(10, k=2)
    table.observe(torch.tensor([root, z0, z1]))  # partial rows: drafted tokens are UNSEEN (q)
    roots = torch.tensor([root])

    def paths_with(run_1_rate: float) -> set[tuple[int, ...]]:
        edges = EdgeAcceptance(2, depth_classes=2)
        edges.trials[:, :, 0] = 1e4  # well observed: shrinkage toward the pooled rate is nil
        rates = torch.full((2, PARENT_RUNS), 0.1)  # [depth class, parent run]
        rates[0, 0], rates[1, 1] = 0.4, run_1_rate
        edges.hits[:, :, 0] = edges.trials[:, :, 0] * rates.unsqueeze(2)
        out = graft_unified(tree.budget, lp, tok, roots, table, edges)
        return set(node_paths(out.parents[0].tolist(), out.tokens[0].tolist(), [True] * 3))

    assert paths_with(0.9) == {(a,), (z0,), (z0, z1)}  # 0.6, 0.4, 0.4 * 0.9 = 0.36
    assert paths_with(0.1) == {(a,), (z0,), (a, x)}  # z0 -> z1: 0.04 < a -> x: 0.3


def test_edge_rates_shrink_a_rare_run_toward_the_pooled_rate():
    edges = EdgeAcceptance(2, depth_classes=1, strength=4.0)
    cell = (0, slice(None), 0, 3)  # depth class 0, every run, rank 0, one knot
    edges.trials[cell] = torch.tensor([1000.0, 4.0, 4.0, 4.0])
    edges.hits[cell] = torch.tensor([500.0, 4.0, 4.0, 4.0])  # run 0: 0.5 over 1000 trials
    rates = edges.rates()[cell]
    pooled = 512.0 / 1012.0
    assert rates[0] == pytest.approx((500 + 4 * pooled) / 1004, rel=1e-6)
    assert rates[1] == pytest.approx((4 + 4 * pooled) / 8, rel=1e-6)  # half way to the pool


# --------------------------------------------------------------------------------- engine

NEW_TOKENS = 16
ALWAYS_RETRIEVE = StageConfig(thresholds=(1.0, 1.0, 1.0), keep_fractions=(0.0, 0.0, 0.0))


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target_and_ar(request):
    target = tiny_target(request.param)
    ar = SpecEngine(target, method="ar").generate(PROMPTS, NEW_TOKENS, stop_token_ids=[])
    return request.param, target, [r.tokens for r in ar]


@pytest.mark.parametrize("method", ["ddtree-graft-stage", "ddtree-graft-unified"])
def test_greedy_grafting_equals_plain_decoding(target_and_ar, method):
    arch, target, ar_tokens = target_and_ar
    # Qwen3 prunes at the default thresholds; Llama verifies pure retrieval trees.
    stage = ALWAYS_RETRIEVE if arch == "llama" else None
    engine = SpecEngine(target, random_drafter(target, 8, seed=3), method, budget=12, stage=stage)
    engine.confidence_log = []
    results = engine.generate(PROMPTS, NEW_TOKENS, stop_token_ids=[])
    assert [r.tokens for r in results] == ar_tokens
    assert all(r.finish_reason == "length" for r in results)
    assert (engine.successors.table != UNKNOWN).any(dim=1).sum() > len(
        {t for p in PROMPTS for t in p}
    )
    # The target's own successors are accepted: more than one token per step on average.
    assert sum(r.stats.tau for r in results) / len(results) > 1.0
    confidence, accept_len = engine.confidence_log[0]
    assert confidence.shape == (len(PROMPTS), 3) and accept_len.shape == (len(PROMPTS),)
    if method == "ddtree-graft-unified":  # every step tries at least one child of the root
        tried = engine.edge_acceptance.trials - EdgeAcceptance(engine.successors.k).trials
        assert tried.sum() >= sum(r.stats.steps for r in results)
        assert tried[:, :, : engine.successors.k].sum() > 0  # nodes found in the table were tried


@pytest.mark.parametrize(
    ("method", "stage"), [("ddtree-graft-stage", ALWAYS_RETRIEVE), ("ddtree-graft-unified", None)]
)
def test_sampling_with_grafting_follows_the_target_distribution(method, stage):
    vocab, n = 12, 2000
    target = tiny_target("llama", seed=4, vocab=vocab)
    with torch.no_grad():  # sharpen the target so that retrieved successors are accepted often
        target.lm_head.weight.mul_(6.0)
    engine = SpecEngine(target, random_drafter(target, 4, seed=2), method, budget=8, stage=stage)
    prompt = [3, 7, 1]
    engine.generate([prompt, [5, 2, 9, 9]], 12, stop_token_ids=[])  # warm the table
    results = engine.generate([prompt] * n, 2, temperature=1.0, stop_token_ids=[], seed=99)
    counts = Counter(tuple(r.tokens[:2]) for r in results)
    stat, critical = chi_square_p_small(counts, exact_two_token_law(target, prompt, 1.0, 1.0), n)
    assert stat < critical, (stat, critical)
    assert sum(r.stats.commit_lengths[1] > 1 for r in results) > n // 20  # grafts accepted
