"""Tenant isolation of Graft's state: partitions of the successor table and the edge estimate.

A request of partition ``p`` reads only what requests of partition ``p`` wrote (table rows,
edge counts); partition 0 alone is the shared table of old, bit for bit; the partition
assigner never lets two keys hold one partition and clears a partition before its new owner.
"""

from __future__ import annotations

import pytest
import torch
from tree_helpers import random_marginals

from sglang_tree_spec.graft import (
    NO_PARTITION,
    UNKNOWN,
    EdgeAcceptance,
    Grafter,
    SuccessorTable,
    TablePartitions,
    edge_evidence,
)
from sglang_tree_spec.tree import build_ddtree

VOCAB, K = 16, 3


def test_partitions_never_read_each_others_rows():
    table = SuccessorTable(VOCAB, K, partitions=3)
    tokens = torch.tensor([4, 5, 4])
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    table.update(tokens, logits, partitions=torch.tensor([0, 1, NO_PARTITION]))
    table.observe(torch.tensor([[7, 8, 9], [7, 2, 3]]), partitions=torch.tensor([2, 1]))
    written = logits.topk(K).indices
    assert table.rows(torch.tensor([4]), torch.tensor([0]))[0].tolist() == written[0].tolist()
    assert table.rows(torch.tensor([5]), torch.tensor([1]))[0].tolist() == written[1].tolist()
    # What partition 0 wrote, partitions 1 and 2 do not see, and the reverse.
    for token, part in ((4, 1), (4, 2), (5, 0), (5, 2), (7, 0)):
        row = table.rows(torch.tensor([token]), torch.tensor([part]))[0]
        assert (row == UNKNOWN).all(), (token, part)
    assert table.lookup(torch.tensor([7]), torch.tensor([0]), torch.tensor([2])).item() == 8
    assert table.lookup(torch.tensor([7]), torch.tensor([0]), torch.tensor([1])).item() == 2
    # NO_PARTITION wrote nothing (its update of token 4 is nowhere) and reads nothing.
    assert (table.partition(2)[4] == UNKNOWN).all()
    assert (table.rows(torch.tensor([4, 5, 7]), torch.tensor([NO_PARTITION])) == UNKNOWN).all()
    table.reset(1)
    assert (table.partition(1) == UNKNOWN).all() and (table.partition(0)[4] != UNKNOWN).all()


@pytest.mark.parametrize("seed", range(3))
def test_partition_zero_alone_is_the_shared_table(seed):
    """The unpartitioned calls and partition 0 of a partitioned table write the same rows."""
    g = torch.Generator().manual_seed(seed)
    shared, parted = SuccessorTable(VOCAB, K), SuccessorTable(VOCAB, K, partitions=4)
    for _ in range(3):
        ids = torch.randint(-1, VOCAB, (3, 9), generator=g)
        shared.observe(ids)
        parted.observe(ids, partitions=torch.zeros(3, dtype=torch.long))
        tokens = torch.randint(0, VOCAB, (12,), generator=g)
        logits = torch.randn(12, VOCAB, generator=g)
        valid = torch.rand(12, generator=g) > 0.3
        shared.update(tokens, logits, valid)
        parted.update(tokens, logits, valid, partitions=torch.zeros(12, dtype=torch.long))
    assert torch.equal(shared.table, parted.partition(0))
    assert (parted._rows[VOCAB : 4 * VOCAB] == UNKNOWN).all()


def test_edge_counts_are_kept_per_partition():
    lp, tok = random_marginals(2, 3, 3, VOCAB, seed=1, sharpness=1.0)
    tree = build_ddtree(lp, tok, 6)
    roots = torch.tensor([1, 2])
    table = SuccessorTable(VOCAB, K, partitions=2)
    edges = EdgeAcceptance(K, partitions=2)
    evidence, q = edge_evidence(tree, lp, tok, roots, table, torch.tensor([0, 1]))
    committed = torch.cat([tree.tokens[:, :1], torch.full((2, 3), -1)], dim=1)  # first node hit
    fresh = edges.rates(1).clone()
    edges.observe(tree, evidence, q, committed, partitions=torch.tensor([0, NO_PARTITION]))
    assert not torch.equal(edges.rates(0), fresh)  # partition 0 counted its request
    assert torch.equal(edges.rates(1), fresh)  # partition 1 saw nothing
    assert torch.equal(edges._all_rates()[2], fresh)  # NO_PARTITION counted nothing
    edges.reset(0)
    assert torch.equal(edges.rates(0), fresh)


def grafted_tokens(grafter: Grafter, lp, tok, roots, budget: int) -> torch.Tensor:
    tree = grafter.select(lp, tok, roots, budget)
    return torch.where(tree.valid, tree.tokens, -1)


@pytest.mark.parametrize("method", ["unified", "stage"])
def test_a_tenants_trees_do_not_depend_on_another_tenants_requests(method):
    """Tenant B's grafted tree is the same whether or not tenant A's requests taught the table
    a continuation of B's root; with one shared partition it is not."""
    lp, tok = random_marginals(1, 3, 2, VOCAB, seed=3, sharpness=0.5)
    root = torch.tensor([9])
    taught = torch.tensor([[9, 13, 14, 15, 11, 12]])  # A's text: 9 -> 13 -> 14 -> 15 ...

    def b_tree(partitions: int, a_partition: int) -> torch.Tensor:
        grafter = Grafter(method, VOCAB, K, topk=2, partitions=partitions)
        grafter.bind(torch.tensor([a_partition]))
        grafter.observe_prompts(taught)  # tenant A's prompt
        grafter.bind(torch.tensor([0]))  # tenant B
        return grafted_tokens(grafter, lp, tok, root, 6)

    alone = b_tree(2, NO_PARTITION)  # nothing written anywhere
    assert torch.equal(b_tree(2, 1), alone)  # A in its own partition: B's tree unchanged
    shared = b_tree(1, 0)  # A and B share partition 0
    assert not torch.equal(shared, alone)
    assert 13 in shared.tolist()[0]  # B's tree took A's successor of 9


def test_assigner_gives_one_owner_per_partition_and_clears_on_hand_over():
    parts = TablePartitions(2)
    assert parts.assign(["a", "b", "a"]) == ([0, 1, 0], (0, 1))
    assert parts.assign(["a"]) == ([0], ())
    # "c" arrives: "b" is the least recently used key not in this batch; its partition is
    # cleared and handed to "c"; "b" no longer owns anything.
    assert parts.assign(["c", "a"]) == ([1, 0], (1,))
    assert parts.owner(1) == "c"
    # Both partitions in use by this batch's other keys: "d" gets none.
    assert parts.assign(["a", "c", "d"]) == ([0, 1, NO_PARTITION], ())
    assert parts.assign(["b"]) == ([0], (0,))  # "a" (last used with "c", lower index) loses
    assert parts.owner(0) == "b"
    with pytest.raises(ValueError):
        TablePartitions(0)


@pytest.mark.parametrize("method", ["unified", "stage"])
def test_a_batch_of_partitions_grafts_each_request_as_its_own_table_alone(method):
    """Two requests of two partitions in one batch (after a few learnt steps each) get the
    trees each gets alone from a one-partition grafter that saw only its own requests."""
    lp, tok = random_marginals(2, 3, 3, VOCAB, seed=5, sharpness=0.7)
    roots = torch.tensor([4, 9])
    prompts = torch.tensor([[4, 6, 7, 8, 4, 6], [9, 1, 2, 3, 9, 5]])
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 2, 7, VOCAB, generator=g)  # 4 steps, [bs, W, V]
    batched = Grafter(method, VOCAB, K, topk=3, partitions=2)
    alone = [Grafter(method, VOCAB, K, topk=3) for _ in range(2)]
    batched.bind(torch.tensor([1, 0]))
    batched.observe_prompts(prompts)
    for b in range(2):
        alone[b].observe_prompts(prompts[b : b + 1])
    for step in range(4):
        tree = batched.select(lp, tok, roots, 6)
        window = torch.cat([roots.view(2, 1), tree.tokens], dim=1)
        committed = torch.cat([tree.tokens[:, :2], torch.full((2, 2), -1)], dim=1)
        for b in range(2):
            own = alone[b].select(lp[b : b + 1], tok[b : b + 1], roots[b : b + 1], 6)
            for field in ("tokens", "parents", "valid"):
                assert torch.equal(getattr(own, field)[0], getattr(tree, field)[b]), (step, b)
            alone[b].learn(own, window[b : b + 1], logits[step, b : b + 1], committed[b : b + 1])
        batched.learn(tree, window, logits[step], committed)
