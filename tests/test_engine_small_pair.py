"""The engine on the committed small pair: real prompts, deep acceptance, stops inside paths."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts


@pytest.fixture(scope="module")
def pair():
    """The committed pair in float64, so that no near-tie can flip a greedy token between a
    one-token forward and a tree forward: these tests check the engine's wiring."""
    cpu = torch.device("cpu")
    target, tokenizer = load_target(SMALL_PAIR_DIR / "target", cpu, torch.float64)
    drafter = load_drafter(SMALL_PAIR_DIR / "drafter", cpu, torch.float64)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in heldout_prompts(6)]
    return target, drafter, prompts


@pytest.fixture(scope="module")
def plain(pair):
    target, _, prompts = pair
    return SpecEngine(target, method="ar").generate(prompts, 48, stop_token_ids=[])


def test_trees_beat_the_chain_and_stay_exact(pair, plain):
    target, drafter, prompts = pair
    chain = SpecEngine(target, drafter, method="chain").generate(prompts, 48, stop_token_ids=[])
    tree = SpecEngine(target, drafter, method="ddtree", budget=64).generate(
        prompts, 48, stop_token_ids=[]
    )
    assert [r.tokens for r in chain] == [r.tokens for r in plain]
    assert [r.tokens for r in tree] == [r.tokens for r in plain]

    def tau(results):
        return sum(sum(r.stats.commit_lengths[1:]) for r in results) / sum(
            r.stats.steps for r in results
        )

    assert tau(chain) > 1.5  # the drafter predicts the target on held-out code
    assert tau(tree) > tau(chain)


def inner_position(result) -> int:
    """An output index strictly inside a step that committed >= 3 tokens (an accepted draft
    token followed by more of the same step)."""
    start = result.stats.commit_lengths[0]
    for length in result.stats.commit_lengths[1:]:
        if length >= 3:
            return start + 1
        start += length
    raise AssertionError(f"no step committed 3 tokens: {result.stats.commit_lengths}")


def test_stop_token_inside_an_accepted_path(pair, plain):
    target, drafter, prompts = pair
    engine = SpecEngine(target, drafter, method="ddtree", budget=32)
    free = engine.generate(prompts, 48, stop_token_ids=[])
    for prompt, result, reference in zip(prompts, free, plain, strict=True):
        assert result.tokens == reference.tokens
        stop = result.tokens[inner_position(result)]
        first = result.tokens.index(stop)
        got = engine.generate([prompt], 48, stop_token_ids=[stop])[0]
        assert got.tokens == reference.tokens[: first + 1]
        assert got.finish_reason == "stop"


def test_length_limit_inside_an_accepted_path(pair, plain):
    target, drafter, prompts = pair
    engine = SpecEngine(target, drafter, method="ddtree", budget=32)
    free = engine.generate(prompts, 48, stop_token_ids=[])
    for prompt, result, reference in zip(prompts, free, plain, strict=True):
        limit = inner_position(result) + 1
        got = engine.generate([prompt], limit, stop_token_ids=[])[0]
        assert got.tokens == reference.tokens[:limit]
        assert got.finish_reason == "length"


def test_demo_runs_and_all_methods_agree():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_tree_spec.cli",
            "demo",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "24",
            "--budgets",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [
        line.split()
        for line in out.stdout.splitlines()
        if line.startswith(("ar", "chain", "ddtree"))
    ]
    assert len(rows) == 3
    assert all(row[-1] == "yes" for row in rows)


def test_a_token_map_limits_the_drafts_to_its_ids(pair, plain):
    """The engine's ``token_map`` (the server's ``--speculative-token-map``): with the ids the
    outputs use, trees still get tokens accepted; with none of them nothing is accepted; the
    tokens are plain decoding's either way."""
    from sglang_tree_spec.models.token_map import frequency_token_map

    target, drafter, prompts = pair
    outputs = [r.tokens for r in plain]
    used = frequency_token_map(prompts + outputs, 512, 2048)
    produced = {t for tokens in outputs for t in tokens}
    unused = [t for t in range(2048) if t not in produced]
    accepted = {}
    for name, token_map in (("used", used), ("unused", unused)):
        engine = SpecEngine(target, drafter, method="ddtree", budget=16, token_map=token_map)
        results = engine.generate(prompts, 48, stop_token_ids=[])
        assert [r.tokens for r in results] == outputs
        accepted[name] = sum(sum(r.stats.commit_lengths[1:]) - r.stats.steps for r in results)
    assert accepted["used"] > 0 and accepted["unused"] == 0
    with pytest.raises(ValueError, match="DDTREE: token_map has ids outside"):
        SpecEngine(target, drafter, method="ddtree", token_map=[1, 4096])
