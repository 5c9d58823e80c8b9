"""Penalties and ``min_new_tokens`` inside a tree, and the committed tokens' log-probs.

The reference is written independently of :mod:`sglang_tree_spec.tree.penalties`: for every
slot its context is walked up the tree, and the penalty is computed as SGLang's penalizers do
in a plain decode step (the state cumulated one output token at a time, the additive penalty
accumulated into zeros, added, then the repetition scaling). Tiny vocabularies, enumerated.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_tree_spec.tree import build_ddtree, build_verify_layout, greedy_accept, sample_accept
from sglang_tree_spec.tree.accept import slot_depths, target_probs
from sglang_tree_spec.tree.logprobs import path_logprobs, token_logprobs
from sglang_tree_spec.tree.penalties import TreePenalties, penalize_tree_logits

VOCAB = 5


def plain_penalised(
    logits: torch.Tensor, output: list[int], params: dict, stops: list[int]
) -> torch.Tensor:
    """``[V]`` logits of a plain decode step after ``output``, SGLang's penalizer arithmetic."""
    freq = torch.zeros(VOCAB)
    pres = torch.zeros(VOCAB)
    rep = torch.ones(VOCAB)
    f32 = torch.float32
    for token in output:  # cumulate_output_tokens, one step at a time
        freq[token] = freq[token] + torch.tensor(params["frequency"], dtype=f32)
        pres[token] = torch.tensor(params["presence"], dtype=f32)
        rep[token] = torch.tensor(params["repetition"], dtype=f32)
    additive = torch.zeros(VOCAB)
    additive = additive - freq
    if len(output) < params["min_new"]:
        stop = torch.zeros(VOCAB)
        stop[stops] = float("-inf")
        additive = additive + stop
    additive = additive - pres
    out = logits + additive
    return torch.where(out < 0, out * rep, out / rep)


def slot_paths(tree) -> list[list[list[int]]]:
    """Per request, per window slot: the node tokens from depth 1 down to the slot."""
    paths = []
    for b in range(tree.batch_size):
        rows = [[]]
        for i in range(tree.budget):
            parent = int(tree.parents[b, i])
            prefix = [] if parent < 0 else rows[parent + 1]
            rows.append([*prefix, int(tree.tokens[b, i])])
        paths.append(rows)
    return paths


def random_case(seed: int, bs: int = 3, depth: int = 3, budget: int = 12):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(bs, depth, VOCAB, generator=generator)
    lp, tok = draft.log_softmax(-1).sort(-1, descending=True)
    tree = build_ddtree(lp, tok, budget)
    outputs = [
        torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
        for n in torch.randint(1, 7, (bs,), generator=generator)
    ]
    roots = torch.tensor([out[-1] for out in outputs])  # the root is the last committed token
    layout = build_verify_layout(tree, roots, torch.full((bs,), 20))
    logits = torch.randn(bs, budget + 1, VOCAB, generator=generator) * 3
    params = [
        {
            "frequency": float(torch.rand(1, generator=generator)) * (b != 0),
            "presence": float(torch.rand(1, generator=generator)) * (b != 1),
            "repetition": 1.0 + float(torch.rand(1, generator=generator)) * (b != 2),
            "min_new": int(torch.randint(0, 9, (1,), generator=generator)),
        }
        for b in range(bs)
    ]
    stops = [[1], [0, 3], [4]]
    return tree, layout, logits, outputs, params, stops[:bs]


def tree_penalties(outputs, params, stops) -> TreePenalties:
    return TreePenalties.from_outputs(
        outputs,
        [p["frequency"] for p in params],
        [p["presence"] for p in params],
        [p["repetition"] for p in params],
        [p["min_new"] for p in params],
        stops,
        VOCAB,
        "cpu",
    )


@pytest.mark.parametrize("seed", range(40))
def test_each_slot_is_penalised_by_its_own_path_bit_for_bit(seed):
    tree, layout, logits, outputs, params, stops = random_case(seed)
    penalised = penalize_tree_logits(
        logits.clone(),
        layout.tokens,
        layout.ancestor_mask,
        slot_depths(tree),
        tree_penalties(outputs, params, stops),
        tree.max_depth,
    )
    for b, rows in enumerate(slot_paths(tree)):
        for slot, path in enumerate(rows):
            if slot > 0 and not tree.valid[b, slot - 1]:
                continue
            want = plain_penalised(logits[b, slot], outputs[b] + path, params[b], stops[b])
            assert torch.equal(penalised[b, slot], want), (b, slot, path)


def test_paths_with_repeated_tokens_count_every_occurrence():
    """A chain of one token repeated: depth d's slot has d more occurrences of it."""
    tokens = torch.tensor([[2, 2, 2, 2]])  # root + 3 nodes, a chain
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None]
    depths = torch.arange(4)[None]
    logits = torch.full((1, 4, VOCAB), 1.5)
    params = {"frequency": 0.3, "presence": 0.25, "repetition": 1.7, "min_new": 0}
    state = tree_penalties([[4, 2]], [params], [[0]])
    out = penalize_tree_logits(logits.clone(), tokens, mask, depths, state, 3)
    for depth in range(4):
        want = plain_penalised(logits[0, depth], [4, 2] + [2] * depth, params, [0])
        assert torch.equal(out[0, depth], want)


def test_min_new_tokens_masks_stop_tokens_below_the_minimum_only():
    tokens = torch.tensor([[1, 3, 3]])
    mask = torch.tril(torch.ones(3, 3, dtype=torch.bool))[None]
    depths = torch.arange(3)[None]
    params = {"frequency": 0.0, "presence": 0.0, "repetition": 1.0, "min_new": 4}
    state = tree_penalties([[0, 2, 1]], [params], [[4]])  # 3 outputs: depth 0 has 3 < 4
    out = penalize_tree_logits(torch.zeros(1, 3, VOCAB), tokens, mask, depths, state, 2)
    assert out[0, 0, 4] == float("-inf")
    assert torch.isfinite(out[0, 1:]).all()


def context_logits(context: tuple[int, ...]) -> torch.Tensor:
    """A toy target: fixed random logits per context."""
    seed = hash(context) % (2**31)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


SAMPLING = {"temperature": 0.9, "top_k": 4, "top_p": 0.95, "min_p": 0.0}


@pytest.mark.parametrize("greedy", [True, False])
def test_tree_with_penalties_commits_what_the_target_alone_draws(greedy):
    """Enumerate coin cells: a full depth-2 tree over V tokens with penalties commits, for
    every pair of coins, exactly the tokens the target alone draws with those coins and the
    penalties cumulated one token at a time (greedy: the penalised argmax path)."""
    params = {"frequency": 0.4, "presence": 0.3, "repetition": 1.3, "min_new": 4}
    stops = [2]
    output = [1, 3, 3]  # committed so far; the root is 3
    lp = torch.zeros(1, 2, VOCAB)
    tok = torch.arange(VOCAB).expand(1, 2, VOCAB)
    tree = build_ddtree(lp, tok, VOCAB + VOCAB * VOCAB)  # every depth-1 and depth-2 node
    layout = build_verify_layout(tree, torch.tensor([3]), torch.tensor([10]))
    rows = slot_paths(tree)[0]
    logits = torch.stack([context_logits(tuple(output + path)) for path in rows])[None]
    state = tree_penalties([output], [params], [stops])
    penalised = penalize_tree_logits(
        logits.clone(), layout.tokens, layout.ancestor_mask, slot_depths(tree), state, 2
    )
    grid = [(i + 0.5) / 23 for i in range(23)]
    for coins in itertools.product(grid, grid) if not greedy else [(0.0, 0.0)]:
        if greedy:
            result = greedy_accept(tree, penalised.argmax(-1))
        else:
            result = sample_accept(
                tree, penalised, **SAMPLING, uniforms=torch.tensor([[*coins, 0.5]])
            )
        committed = result.committed_tokens[0, : int(result.accept_len[0]) + 1].tolist()
        context = list(output)
        for coin, token in zip(coins, committed, strict=False):
            logit = plain_penalised(context_logits(tuple(context)), context, params, stops)
            if greedy:
                expected = int(logit.argmax())
            else:
                probs = target_probs(logit[None], **SAMPLING)[0].double()
                cdf = probs.cumsum(0)
                expected = int(torch.searchsorted(cdf, coin * cdf[-1], right=True))
            assert token == expected, (coins, committed)
            context.append(token)
        assert len(committed) >= 2  # the full tree always reaches depth 2


def test_path_logprobs_are_the_committed_tokens_distributions():
    tree, _, logits, *_ = random_case(3)
    result = greedy_accept(tree, logits.argmax(-1))
    width = tree.max_depth + 1
    slots = result.accepted_slots[:, :width]
    greedy = path_logprobs(logits, slots)
    tokens = result.committed_tokens[:, :width]
    temperature = torch.tensor([0.5, 1.0, 2.0])
    sampled = path_logprobs(logits, slots, temperature)
    for b in range(tree.batch_size):
        for j in range(int(result.accept_len[b]) + 1):
            slot = int(slots[b, j])
            assert torch.allclose(greedy[b, j], logits[b, slot].log_softmax(-1))
            scaled = torch.log(torch.softmax(logits[b, slot] / temperature[b], -1))
            assert torch.allclose(sampled[b, j], scaled)
            token = int(tokens[b, j])
            assert token_logprobs(greedy, tokens)[b, j] == greedy[b, j, token]
            assert token == int(logits[b, slot].argmax())
