"""``Sampling.coins``: where each row's acceptance coins come from."""

from __future__ import annotations

import torch

from sglang_tree_spec.step import Sampling
from sglang_tree_spec.tree import counter_uniforms

DEPTHS = 5


def sampling(seeds: list[int], seeded: list[bool]) -> Sampling:
    """A sampled batch (temperature 1) with the given seeds and seeded flags."""
    bs = len(seeds)
    ones = torch.ones(bs)
    return Sampling(
        temperature=ones,
        top_k=torch.full((bs,), -1, dtype=torch.long),
        top_p=ones,
        min_p=torch.zeros(bs),
        seeds=torch.tensor(seeds, dtype=torch.long),
        seeded=torch.tensor(seeded),
        all_greedy=False,
        all_seeded=all(seeded),
    )


def keyed(seed: int, position: int) -> float:
    """The coin of the token at ``position`` of a request seeded with ``seed``, on its own."""
    return counter_uniforms(torch.tensor([seed]), torch.tensor([[position]])).item()


def test_seeded_coin_d_is_the_counter_uniform_of_position_prefix_plus_d():
    """Guards the seeded coin's position: coin ``d`` of a seeded row draws the token at
    ``prefix + d`` (the root predicts depth 0), so a seeded request samples the same tokens
    whatever its tree, budget or batch. An offset (``prefix + d + 1``) or a missing depth
    term changes every seeded sample."""
    seeds, prefixes = [11, 12, 11, 7], [0, 3, 9, 40]
    rule = sampling(seeds, [True] * 4)
    coins = rule.coins(torch.tensor(prefixes), DEPTHS, None)
    assert coins.shape == (4, DEPTHS) and coins.dtype == torch.float64
    for b, (seed, prefix) in enumerate(zip(seeds, prefixes, strict=True)):
        for d in range(DEPTHS):
            assert coins[b, d].item() == keyed(seed, prefix + d), (b, d)


def test_unseeded_rows_draw_from_the_generator_and_seeded_rows_ignore_it():
    """Guards the mix of seeded and unseeded rows: unseeded rows take the step generator's
    ``[bs, depths]`` float64 draw at their own row, seeded rows keep their keyed coins, and
    an all-seeded batch leaves the generator untouched."""
    seeded = [False, True, False, True]
    rule = sampling([5, 6, 7, 8], seeded)
    prefixes = torch.tensor([4, 4, 2, 0])
    generator = torch.Generator().manual_seed(123)
    coins = rule.coins(prefixes, DEPTHS, generator)
    fresh = torch.rand(
        (4, DEPTHS), generator=torch.Generator().manual_seed(123), dtype=torch.float64
    )
    for b in range(4):
        if seeded[b]:
            expected = [keyed(5 + b, int(prefixes[b]) + d) for d in range(DEPTHS)]
            assert coins[b].tolist() == expected, b
        else:
            assert torch.equal(coins[b], fresh[b]), b
    state = generator.get_state()
    sampling([1, 2], [True, True]).coins(torch.tensor([0, 1]), DEPTHS, generator)
    assert torch.equal(generator.get_state(), state)


def test_a_seeded_rows_coins_do_not_depend_on_the_other_rows():
    """Guards batch independence: a seeded row's coins are the same alone, in any batch
    position, and next to rows with other seeds, prefixes or no seed at all."""
    alone = sampling([42], [True]).coins(torch.tensor([17]), DEPTHS, None)
    batches = [
        (sampling([42, 3], [True, True]), torch.tensor([17, 5]), 0),
        (sampling([9, 9, 42], [False, True, True]), torch.tensor([0, 17, 17]), 2),
        (sampling([1, 42, 2], [False, True, False]), torch.tensor([100, 17, 1]), 1),
    ]
    for rule, prefixes, row in batches:
        coins = rule.coins(prefixes, DEPTHS, torch.Generator().manual_seed(0))
        assert torch.equal(coins[row], alone[0]), row
