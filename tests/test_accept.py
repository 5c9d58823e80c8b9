"""Acceptance: greedy against a naive walk; sampling exact by enumeration on tiny vocabularies."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch
from tree_helpers import node_paths, random_marginals

from sglang_tree_spec.tree import (
    build_ddtree,
    build_verify_layout,
    eagle_retrieve_arrays,
    greedy_accept,
    sample_accept,
    target_probs,
)

# ---------------------------------------------------------------------------- greedy


def naive_greedy_walk(tree, tokens, target_argmax, b: int) -> list[int]:
    """SGLang's verify walk over the EAGLE retrieve arrays; returns the accepted slots."""
    eagle = eagle_retrieve_arrays(tree)
    slots, cur = [0], 0
    while True:
        child = eagle.next_token[b, cur].item()
        while child != -1 and tokens[b, child].item() != target_argmax[b, cur].item():
            child = eagle.next_sibling[b, child].item()
        if child == -1:
            return slots
        slots.append(child)
        cur = child


def check_greedy(tree, target_argmax):
    bs = tree.batch_size
    layout = build_verify_layout(tree, torch.zeros(bs, dtype=torch.long), torch.zeros(bs))
    result = greedy_accept(tree, target_argmax)
    for b in range(bs):
        slots = naive_greedy_walk(tree, layout.tokens, target_argmax, b)
        n = len(slots) - 1
        assert result.accept_len[b].item() == n
        assert result.accepted_slots[b, : n + 1].tolist() == slots
        assert (result.accepted_slots[b, n + 1 :] == -1).all()
        bonus = target_argmax[b, slots[-1]].item()
        assert result.bonus[b].item() == bonus
        assert result.deepest_slot[b].item() == slots[-1]
        tokens = [layout.tokens[b, s].item() for s in slots[1:]] + [bonus]
        assert result.committed_tokens[b, : n + 1].tolist() == tokens
        assert (result.committed_tokens[b, n + 1 :] == -1).all()
    return result


@pytest.mark.parametrize("seed", range(6))
def test_greedy_matches_naive_walk_on_planted_paths(seed):
    """Targets that follow a random tree path for a random number of steps, then diverge."""
    bs, depth, budget = 4, 8, 48
    lp, tok = random_marginals(bs, depth, 4, vocab=12, seed=seed, sharpness=1.0)
    tree = build_ddtree(lp, tok, budget)
    gen = torch.Generator().manual_seed(seed)
    target_argmax = torch.randint(0, 12, (bs, budget + 1), generator=gen)
    for b in range(bs):
        # Plant a path: from the root, repeatedly pick a random child and make the target
        # predict its token at the parent.
        cur, steps = 0, int(torch.randint(0, depth + 1, (1,), generator=gen))
        for _ in range(steps):
            children = [i + 1 for i in range(budget) if tree.parents[b, i].item() + 1 == cur]
            if not children:
                break
            nxt = children[int(torch.randint(0, len(children), (1,), generator=gen))]
            target_argmax[b, cur] = tree.tokens[b, nxt - 1]
            cur = nxt
    result = check_greedy(tree, target_argmax)
    assert result.accept_len.max().item() > 0


def test_greedy_full_depth_and_no_acceptance():
    lp = torch.zeros(1, 3, 1)  # a single certain chain 5 -> 6 -> 7
    tok = torch.tensor([[[5], [6], [7]]])
    tree = build_ddtree(lp, tok, 3)
    full = check_greedy(tree, torch.tensor([[5, 6, 7, 9]]))
    assert full.accept_len.item() == 3 and full.bonus.item() == 9
    assert full.committed_tokens.tolist() == [[5, 6, 7, 9]]
    none = check_greedy(tree, torch.tensor([[4, 6, 7, 9]]))
    assert none.accept_len.item() == 0 and none.bonus.item() == 4
    assert none.committed_tokens.tolist() == [[4, -1, -1, -1]]


@pytest.mark.parametrize("depth", range(1, 17))
def test_greedy_stops_at_the_first_wrong_token_at_every_depth(depth):
    """A two-branch tree of every depth 1-16, the spine broken at each position in turn: the
    path ends right before the break however deep the tree (every ancestor checked)."""
    spine = torch.arange(10, 10 + depth)
    lp = torch.log(torch.tensor([0.9, 0.1])).expand(1, depth, 2).contiguous()
    tok = torch.stack([spine, spine + 100], dim=1).unsqueeze(0)  # [1, L, 2]: spine, then a twin
    tree = build_ddtree(lp, tok, 2 * depth)
    slot_of = {0: 0}  # spine depth -> window slot of the spine node at that depth
    parent_slots = [p + 1 for p in tree.parents[0].tolist()]
    for i, token in enumerate(tree.tokens[0].tolist()):
        d = len(slot_of)
        if token == 10 + d - 1 and parent_slots[i] == slot_of[d - 1]:
            slot_of[d] = i + 1
    assert sorted(slot_of) == list(range(depth + 1))
    for broken in [*range(1, depth + 1), None]:
        argmax = torch.full((1, 2 * depth + 1), 7)
        argmax[0, 0] = 10  # the root predicts the first spine token
        for d in range(1, depth):
            argmax[0, slot_of[d]] = 10 + d  # each spine node predicts the next one
        argmax[0, slot_of[depth]] = 99
        if broken is not None:  # the spine node at `broken` is mispredicted by its parent
            argmax[0, slot_of[broken - 1]] = 5
        result = check_greedy(tree, argmax)
        want = depth if broken is None else broken - 1
        assert result.accept_len.item() == want, (depth, broken)


def test_greedy_never_accepts_padding():
    lp, tok = random_marginals(2, 2, 2, vocab=6, seed=3)
    tok = tok + 1  # no real node carries token 0, the padding token
    tree = build_ddtree(lp, tok, 9)  # 6 real nodes, 3 padding slots with token 0
    result = check_greedy(tree, torch.zeros(2, 10, dtype=torch.long))
    assert result.accept_len.tolist() == [0, 0]


def test_greedy_rejects_bad_shape():
    tree = build_ddtree(*random_marginals(2, 3, 2, vocab=6, seed=0), 4)
    with pytest.raises(ValueError, match="budget"):
        greedy_accept(tree, torch.zeros(2, 4, dtype=torch.long))


# ---------------------------------------------------------------------------- sampling


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Independent target distribution: SGLang's sampler rules on one logit vector."""
    if temperature <= 0:
        out = np.zeros_like(logits, dtype=np.float64)
        out[int(np.argmax(logits))] = 1.0
        return out
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = np.zeros(len(p), dtype=bool)
    mass = 0.0
    for rank, i in enumerate(order):
        if (top_k <= 0 or rank < top_k) and mass <= top_p:
            keep[i] = True
        mass += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


# (temperature, top_k, top_p)
SAMPLING = [
    (1.0, 0, 1.0),
    (0.7, 0, 0.9),
    (1.3, 3, 1.0),
    (0.5, 2, 0.8),
    (1.0, 0, 0.5),
    (0.0, 0, 1.0),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SAMPLING)
def test_target_probs_matches_reference(temperature, top_k, top_p):
    logits = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1)) * 2
    probs = target_probs(logits, temperature, top_k, top_p)
    for b, s in itertools.product(range(3), range(4)):
        expected = reference_probs(logits[b, s].numpy(), temperature, top_k, top_p)
        np.testing.assert_allclose(probs[b, s].numpy(), expected, atol=1e-6)


def ideal_step_distribution(tree, slot_probs: np.ndarray, b: int) -> dict[tuple, float]:
    """Exact law of the tokens one step commits if the target sampled alone.

    From the root: draw x ~ p(node); if x is a child of the node, move there and go on; else
    x is the bonus and the step ends. (Sampling from the target token by token, cut at the
    first token that leaves the tree.)
    """
    children: dict[int, dict[int, int]] = defaultdict(dict)
    for i in range(tree.budget):
        if tree.valid[b, i]:
            children[tree.parents[b, i].item() + 1][tree.tokens[b, i].item()] = i + 1
    out: dict[tuple, float] = defaultdict(float)

    def walk(slot: int, prefix: tuple, weight: float) -> None:
        for token, p in enumerate(slot_probs[slot]):
            if p == 0:
                continue
            if token in children[slot]:
                walk(children[slot][token], (*prefix, token), weight * p)
            else:
                out[(*prefix, token)] += weight * p

    walk(0, (), 1.0)
    return out


def coin_cells(slot_probs: np.ndarray) -> list[tuple[float, float]]:
    """The cells of [0, 1) within which no slot's inverse-CDF draw changes: cut at every
    cumulative probability of every slot. (The law is then compared with the ideal one,
    computed from the independent ``reference_probs``.)"""
    cuts = {0.0, 1.0} | {float(c) for row in slot_probs for c in np.cumsum(row)[:-1]}
    edges = sorted(c for c in cuts if 0.0 <= c <= 1.0)
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi - lo > 1e-9]


def enumerated_step_distribution(tree, logits, temperature, top_k, top_p, b: int):
    """Exact law of sample_accept's output, enumerating every coin cell depth by depth.

    Coin d decides the token committed at depth d. For each cell of coin d (its length is its
    probability) run the implementation with that coin; if the walk stopped at depth d, the
    output is final, else recurse into coin d + 1. Wrong probabilities, a coin used at the
    wrong depth or a wrong walk all change the law.
    """
    row = slice(b, b + 1)
    sub = type(tree)(
        tree.tokens[row],
        tree.parents[row],
        tree.depths[row],
        tree.logprobs[row],
        tree.valid[row],
        tree.max_depth,
    )
    params = [x[row] if torch.is_tensor(x) else x for x in (temperature, top_k, top_p)]
    slot_probs = target_probs(logits[row], *params)[0].double().numpy()
    cells = coin_cells(slot_probs)
    depth_count = tree.max_depth + 1
    out: dict[tuple, float] = defaultdict(float)

    def explore(coins: list[float], weight: float) -> None:
        depth = len(coins)
        for lo, hi in cells:
            tried = [*coins, (lo + hi) / 2]
            uniforms = torch.tensor(
                [tried + [0.5] * (depth_count - depth - 1)], dtype=torch.float64
            )
            res = sample_accept(sub, logits[row], *params, uniforms=uniforms)
            n = res.accept_len.item()
            if n > depth:  # coin `depth` picked a child: the later coins decide the rest
                explore(tried, weight * (hi - lo))
            else:
                out[tuple(res.committed_tokens[0, : n + 1].tolist())] += weight * (hi - lo)

    explore([], 1.0)
    return out


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SAMPLING)
@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_is_exact_by_enumeration(temperature, top_k, top_p, seed):
    vocab, budget = 5, 6
    lp, tok = random_marginals(2, 3, 3, vocab=vocab, seed=seed, sharpness=1.0)
    tree = build_ddtree(lp, tok, budget)
    gen = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(2, budget + 1, vocab, generator=gen) * 1.5
    # Make the target agree with the draft sometimes so deep paths carry mass.
    logits[:, 0].scatter_add_(1, tree.tokens[:, :1], torch.full((2, 1), 5.0))
    for b in range(2):
        slot_probs = np.stack(
            [
                reference_probs(logits[b, s].numpy(), temperature, top_k, top_p)
                for s in range(budget + 1)
            ]
        )
        ideal = ideal_step_distribution(tree, slot_probs, b)
        got = enumerated_step_distribution(tree, logits, temperature, top_k, top_p, b)
        assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)
        for key in set(ideal) | set(got):
            assert got.get(key, 0.0) == pytest.approx(ideal.get(key, 0.0), abs=1e-6), key
        # The first committed token follows the target's distribution at the root.
        first = np.zeros(vocab)
        for key, p in got.items():
            first[key[0]] += p
        np.testing.assert_allclose(first, slot_probs[0], atol=1e-6)
        if temperature > 0:
            assert max(len(k) for k, p in got.items() if p > 1e-9) >= 2  # trees were used


def test_per_request_sampling_parameters():
    """One batch mixing greedy and sampled requests: each row follows its own rule."""
    vocab, budget = 4, 5
    lp, tok = random_marginals(2, 2, 3, vocab=vocab, seed=7, sharpness=1.0)
    tree = build_ddtree(lp, tok, budget)
    logits = torch.randn(2, budget + 1, vocab, generator=torch.Generator().manual_seed(3))
    temps, top_ks, top_ps = torch.tensor([0.0, 0.8]), torch.tensor([0, 2]), torch.tensor([1, 0.9])
    for b in range(2):
        params = (temps[b].item(), int(top_ks[b]), top_ps[b].item())
        slot_probs = np.stack(
            [reference_probs(logits[b, s].numpy(), *params) for s in range(budget + 1)]
        )
        ideal = ideal_step_distribution(tree, slot_probs, b)
        got = enumerated_step_distribution(tree, logits, temps, top_ks, top_ps, b)
        for key in set(ideal) | set(got):
            assert got.get(key, 0.0) == pytest.approx(ideal.get(key, 0.0), abs=1e-6)


def test_zero_temperature_sampling_is_greedy():
    lp, tok = random_marginals(3, 6, 4, vocab=10, seed=2)
    tree = build_ddtree(lp, tok, 30)
    logits = torch.randn(3, 31, 10, generator=torch.Generator().manual_seed(0))
    # Plant agreement at the root so acceptance is non-trivial.
    logits[:, 0].scatter_(1, tree.tokens[:, :1], 10.0)
    greedy = greedy_accept(tree, logits.argmax(-1))
    for seed in range(3):
        sampled = sample_accept(tree, logits, 0.0, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(sampled.committed_tokens, greedy.committed_tokens)
        assert torch.equal(sampled.accepted_slots, greedy.accepted_slots)
    assert greedy.accept_len.min().item() >= 1


def plain_sampling(next_logits, context: tuple, coins: list[float], temperature: float):
    """The target alone: token d is the inverse-CDF draw of coin d after the tokens before it."""
    tokens: list[int] = []
    for coin in coins:
        probs = target_probs(next_logits(context + tuple(tokens)).view(1, -1), temperature)
        cdf = probs[0].double().cumsum(0)
        tokens.append(
            int(torch.searchsorted(cdf, coin * cdf[-1], right=True).clamp_max(len(cdf) - 1))
        )
    return tokens


@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_sampled_tokens_are_the_target_alone_for_any_tree(budget):
    """With the same coins, every tree commits a prefix of what the target samples alone:
    the sampled output does not depend on the tree (nor on the budget or a graft)."""
    vocab, depth, temperature = 6, 4, 0.9
    table = torch.randn(vocab**3, vocab, generator=torch.Generator().manual_seed(5)) * 1.5

    def next_logits(context: tuple) -> torch.Tensor:  # a toy target: logits from the last 3
        key = 0
        for token in context[-3:]:
            key = key * vocab + token
        return table[key % table.shape[0]]

    context = (2, 5)
    for seed in range(5):
        lp, tok = random_marginals(1, depth, 3, vocab=vocab, seed=seed, sharpness=1.5)
        tree = build_ddtree(lp, tok, budget)
        paths = node_paths(
            tree.parents[0].tolist(), tree.tokens[0].tolist(), tree.valid[0].tolist()
        )
        slot_contexts = [context] + [context + path for path in paths]
        logits = torch.stack([next_logits(c) for c in slot_contexts]).unsqueeze(0)
        coins = torch.rand(
            1, depth + 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        )
        res = sample_accept(tree, logits, temperature, uniforms=coins)
        n = res.accept_len.item()
        alone = plain_sampling(next_logits, context, coins[0].tolist(), temperature)
        assert res.committed_tokens[0, : n + 1].tolist() == alone[: n + 1]


def test_sampling_rejects_bad_shapes():
    tree = build_ddtree(*random_marginals(2, 3, 2, vocab=6, seed=0), 4)
    with pytest.raises(ValueError, match="target_logits"):
        sample_accept(tree, torch.zeros(2, 4, 6), 1.0)
    with pytest.raises(ValueError, match="uniforms"):
        sample_accept(tree, torch.zeros(2, 5, 6), 1.0, uniforms=torch.rand(2, 5))


def test_counter_uniforms_are_reproducible_uniform_and_batch_independent():
    from sglang_tree_spec.tree import counter_uniforms

    counters = torch.arange(200_000).view(1, -1)
    u = counter_uniforms(torch.tensor([12345]), counters)[0]
    assert u.dtype == torch.float64 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    # Kolmogorov-Smirnov distance to U(0, 1): ~0.003 for a good generator at n = 200k.
    ks = (u.sort().values - torch.arange(1, u.numel() + 1) / u.numel()).abs().max()
    assert float(ks) < 0.01
    # The same (seed, counter) gives the same coin wherever it sits in a batch.
    seeds = torch.tensor([7, 12345, 7])
    grid = torch.tensor([[5, 6, 7], [0, 1, 2], [7, 6, 5]])
    batched = counter_uniforms(seeds, grid)
    assert torch.equal(batched[1], u[:3])
    assert torch.equal(batched[0], batched[2].flip(0))
    # Different seeds give different streams; consecutive counters are not correlated.
    other = counter_uniforms(torch.tensor([12346]), counters)[0]
    assert not torch.equal(other[:100], u[:100])
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


def test_target_probs_min_p_drops_tokens_below_a_fraction_of_the_best():
    """min-p as SGLang's torch sampler applies it: after top-k / top-p, zero every token whose
    probability is below min_p times the most probable one, then renormalise."""
    logits = torch.tensor([[[2.0, 1.5, 0.0, -1.0, 1.9, -3.0]], [[0.0, 0.1, 0.2, 0.3, 0.4, 0.5]]])
    min_p = torch.tensor([0.5, 0.9])
    top_k = torch.tensor([0, 4])
    probs = target_probs(logits, temperature=1.0, top_k=top_k, top_p=0.95, min_p=min_p)
    for b in range(2):
        base = torch.softmax(logits[b, 0], dim=-1)
        ranked, order = base.sort(descending=True)
        keep = (torch.arange(6) < (top_k[b] if top_k[b] > 0 else 6)) & (
            ranked.cumsum(0) - ranked <= 0.95
        )
        keep &= ranked >= min_p[b] * ranked[0]
        expected = torch.zeros(6).scatter(0, order, torch.where(keep, ranked, 0.0))
        torch.testing.assert_close(probs[b, 0], expected / expected.sum())
        assert int((probs[b, 0] > 0).sum()) < 6  # the cut removed something
    plain = target_probs(logits, temperature=1.0, top_k=top_k, top_p=0.95)
    assert not torch.allclose(plain, probs)


def test_an_empty_tree_commits_the_targets_token_at_the_root():
    """A plain step (budget 0): nothing accepted, the root's argmax (greedy) or its draw with
    coin 0 (sampling) committed, the root its path; the layout is the root at the prefix."""
    from sglang_tree_spec.tree.select import empty_tree

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 1, 11, generator=generator)
    tree = empty_tree(3, "cpu")
    greedy = greedy_accept(tree, logits.argmax(-1))
    assert greedy.accept_len.tolist() == [0, 0, 0]
    assert greedy.bonus.tolist() == logits[:, 0].argmax(-1).tolist()
    assert greedy.accepted_slots.tolist() == [[0]] * 3
    assert greedy.committed_tokens.tolist() == [[t] for t in greedy.bonus.tolist()]
    coins = torch.tensor([[0.1], [0.5], [0.97]], dtype=torch.float64)
    sampled = sample_accept(tree, logits, 1.0, uniforms=coins)
    cdf = logits[:, 0].softmax(-1).double().cumsum(-1)
    assert sampled.bonus.tolist() == (cdf <= coins).sum(-1).tolist()
    assert sampled.committed_tokens.tolist() == [[t] for t in sampled.bonus.tolist()]
    layout = build_verify_layout(tree, torch.tensor([4, 5, 6]), torch.tensor([7, 0, 2]))
    assert layout.tokens.tolist() == [[4], [5], [6]]
    assert layout.positions.tolist() == [[7], [0], [2]]
    assert layout.ancestor_mask.tolist() == [[[True]]] * 3
