"""The per-slot grammar masks of a tree verify (plugin/grammar.py), against xgrammar itself.

A real SGLang xgrammar grammar (regex, JSON schema, EBNF) on the shipped small target's
tokenizer, random trees whose nodes mostly follow the grammar: every slot the walk reaches gets
the bitmask of a fresh matcher advanced along that slot's path from the root, the request's
grammar ends where it started, and the masking of the logits equals xgrammar's own CPU kernel.
Runs in a few seconds.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR
from sglang_tree_spec.plugin.grammar import (
    apply_token_bitmask,
    bitmask_words,
    slot_parents,
    tree_token_bitmask,
)
from sglang_tree_spec.tree import build_verify_layout
from sglang_tree_spec.tree.ddtree import DraftTree

xgrammar = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}
GRAMMARS = {
    "regex": ("regex", r"(def|class) [a-z_]{1,12}\((self)?\):"),
    "json": ("json", json.dumps(SCHEMA)),
    "ebnf": ("ebnf", 'root ::= "x = " num ("+" num)*\nnum ::= [0-9]+'),
}


@pytest.fixture(scope="module")
def backend():
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    target = SMALL_PAIR_DIR / "target"
    tokenizer = AutoTokenizer.from_pretrained(target)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return XGrammarGrammarBackend(tokenizer, vocab_size=vocab), vocab


def make_grammar(backend, kind: str):
    grammar_backend, _ = backend
    dispatch, key = GRAMMARS[kind]
    return getattr(grammar_backend, f"dispatch_{dispatch}")(key)


def oracle_row(grammar, path: list[int], vocab: int) -> torch.Tensor | None:
    """The bitmask row of a fresh matcher advanced over ``path`` (None: the path leaves the
    grammar or terminates it)."""
    matcher = xgrammar.GrammarMatcher(grammar.ctx)
    for token in grammar.accepted_tokens:
        assert matcher.accept_token(token)
    for token in path:
        if not matcher.accept_token(token):
            return None
    if matcher.is_terminated():
        return None
    row = torch.full((1, bitmask_words(vocab)), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(row, 0)
    return row[0]


def allowed_tokens(row: torch.Tensor, vocab: int) -> list[int]:
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().view(-1).tolist()


def random_tree(grammar, vocab: int, budget: int, depth: int, seed: int) -> DraftTree:
    """One request's tree of ``budget`` nodes in breadth-first order: a node's parent is on the
    grammar nine times in ten (when one is) and its token one the parent's grammar state allows
    three times in four (when it has one), any token otherwise; siblings distinct."""
    rng = random.Random(seed)
    paths: list[list[int]] = [[]]  # per slot (0: root)
    valid_path = [True]
    tokens, parents, depths = [], [], []
    level = [0]
    for d in range(1, depth + 1):
        next_level = []
        for _ in range(len(level) * 3):
            if len(tokens) == budget:
                break
            on_grammar = [slot for slot in level if valid_path[slot]]
            parent = rng.choice(on_grammar if on_grammar and rng.random() < 0.9 else level)
            row = oracle_row(grammar, paths[parent], vocab) if valid_path[parent] else None
            used = {t for t, p in zip(tokens, parents, strict=True) if p == parent - 1}
            choices = (
                [] if row is None else [t for t in allowed_tokens(row, vocab) if t not in used]
            )
            if choices and rng.random() < 0.75:
                token = rng.choice(choices)
            else:
                token = rng.choice([t for t in range(vocab) if t not in used])
            tokens.append(token)
            parents.append(parent - 1)
            depths.append(d)
            paths.append([*paths[parent], token])
            on_path = oracle_row(grammar, paths[-1], vocab) is not None
            valid_path.append(valid_path[parent] and on_path)
            next_level.append(len(tokens))
        level = next_level or level
    while len(tokens) < budget:  # padding slots, as DraftTree has them
        tokens.append(0), parents.append(-1), depths.append(1)
    n = len(tokens)
    valid = torch.tensor([[i < len(paths) - 1 for i in range(n)]])
    return DraftTree(
        tokens=torch.tensor([tokens]),
        parents=torch.tensor([parents]),
        depths=torch.tensor([depths]),
        logprobs=torch.zeros(1, n),
        valid=valid,
        max_depth=depth,
    )


def window_paths(tree: DraftTree) -> list[list[int]]:
    """The token path (root excluded) of every window slot of request 0."""
    paths = [[]]
    for token, parent in zip(tree.tokens[0].tolist(), tree.parents[0].tolist(), strict=True):
        paths.append([*paths[parent + 1], token])
    return paths


@pytest.mark.parametrize("kind", sorted(GRAMMARS))
@pytest.mark.parametrize("seed", range(3))
def test_every_reachable_slot_has_its_paths_mask(backend, kind, seed):
    _, vocab = backend
    grammar = make_grammar(backend, kind)
    first = oracle_row(grammar, [], vocab)
    firsts = allowed_tokens(first, vocab)
    grammar.accept_token(firsts[seed % len(firsts)])  # a request a token into its grammar
    tree = random_tree(grammar, vocab, budget=24, depth=6, seed=seed)
    layout = build_verify_layout(tree, torch.tensor([7]), torch.tensor([40]))
    depths = layout.positions - 40
    parents = slot_parents(layout.ancestor_mask, depths)
    assert parents.tolist() == [[-1, *(tree.parents[0] + 1).tolist()]]
    before = list(grammar.accepted_tokens)
    # request 0 unconstrained, request 1 the grammar's: rows of request 0 allow everything
    mask = tree_token_bitmask(
        [None, grammar], layout.tokens.repeat(2, 1), parents.repeat(2, 1), vocab
    )
    window = layout.tokens.shape[1]
    assert mask.shape == (2 * window, bitmask_words(vocab))
    assert bool((mask[:window] == -1).all())
    assert grammar.accepted_tokens == before  # rolled back to where it started
    assert torch.equal(oracle_row(grammar, [], vocab), mask[window])
    checked = 0
    for slot, path in enumerate(window_paths(tree)):
        expected = oracle_row(grammar, path, vocab)
        reached = all(oracle_row(grammar, path[:i], vocab) is not None for i in range(len(path)))
        if expected is not None and reached:
            assert torch.equal(mask[window + slot], expected), (kind, slot, path)
            checked += 1
    assert checked >= 6  # the walk went several levels down


def test_no_grammar_no_mask(backend):
    tokens = torch.zeros(2, 3, dtype=torch.long)
    assert tree_token_bitmask([None, None], tokens, tokens - 1, backend[1]) is None


def test_masked_logits_equal_xgrammars_kernel(backend):
    _, vocab = backend
    grammar = make_grammar(backend, "json")
    mask = torch.full((3, bitmask_words(vocab)), -1, dtype=torch.int32)
    grammar.fill_vocab_mask(mask, 0)
    grammar.accept_token(allowed_tokens(mask[0], vocab)[0])
    grammar.fill_vocab_mask(mask, 2)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, mask)
    apply_token_bitmask(logits, mask)
    assert torch.equal(logits, expected)
    assert bool(torch.isinf(logits[0]).any()) and not bool(torch.isinf(logits[1]).any())


def refuse(*args, **kwargs):
    raise AssertionError("the original (GPU) path must not run on a CPU")


def test_cpu_bitmask_is_allocated_unpinned_all_allowed(backend):
    """The 0.5.17 allocation hook on a CPU: xgrammar's layout, every token allowed, host
    memory that needs no CUDA driver (the original pins it)."""
    from sglang_tree_spec.plugin.cpu import xgrammar_bitmask_on_cpu

    _, vocab = backend
    mask = xgrammar_bitmask_on_cpu(refuse, vocab, 3)
    assert mask.shape == (3, bitmask_words(vocab)) and mask.dtype == torch.int32
    assert mask.device.type == "cpu" and not mask.is_pinned()
    assert bool((mask == -1).all())


def test_cpu_logits_are_masked_by_xgrammars_cpu_kernel(backend):
    """The 0.5.17 apply hook on a real grammar's filled bitmask and CPU logits: the forbidden
    tokens of each row to -inf, the rest unchanged (the plugin's own masking as the oracle),
    without the original's GPU kernels."""
    from sglang_tree_spec.plugin.cpu import xgrammar_bitmask_on_cpu, xgrammar_mask_applied_on_cpu

    _, vocab = backend
    grammar = make_grammar(backend, "regex")
    mask = xgrammar_bitmask_on_cpu(refuse, vocab, 2)
    grammar.fill_vocab_mask(mask, 1)  # row 0 stays all-allowed
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    expected = logits.clone()
    apply_token_bitmask(expected, mask)
    xgrammar_mask_applied_on_cpu(refuse, grammar, logits=logits, vocab_mask=mask)
    assert torch.equal(logits, expected)
    assert not bool(torch.isinf(logits[0]).any())
    allowed = allowed_tokens(mask[1], vocab)
    assert 0 < len(allowed) < vocab and bool(torch.isinf(logits[1]).sum() == vocab - len(allowed))
