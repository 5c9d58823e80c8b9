"""The drafter's vocabulary shortlist (``--speculative-token-map``, ``tree/draft_vocab.py``):
the draft top-K over the map's ids, on one rank and merged across real gloo ranks, equals the
top-K of the dense head restricted to those ids; bad maps are refused in one line; the
frequency-ranked builder (``models/token_map.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_tree_spec.models.token_map import frequency_token_map
from sglang_tree_spec.tree import topk_from_logits, vocab_parallel_topk
from sglang_tree_spec.tree.draft_vocab import TokenMapError, check_token_map, draft_vocab

BS, DEPTH, HIDDEN = 2, 3, 8


def head_and_states(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(vocab_size)
    weight = torch.randn(vocab_size, HIDDEN, generator=generator)
    hidden = torch.randn(BS, DEPTH, HIDDEN, generator=generator) * 2.0
    return weight, hidden


def shortlist_topk(weight, hidden, ids, k):
    """What the drafter must propose: the top-K of the dense head over ``ids`` only, its
    log-probs normalised over them."""
    logits = hidden @ weight[ids].T
    values, index = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
    return values, ids[index]


def test_one_rank_drafts_the_top_k_of_the_maps_ids_only():
    weight, hidden = head_and_states(50)
    ids = check_token_map(torch.tensor([7, 3, 41, 12, 0, 29, 33]), 50, 4, "map")
    vocab = draft_vocab(ids, weight, 0, 50)
    assert vocab.token_ids.tolist() == ids.tolist() and vocab.weight.is_contiguous()
    got = topk_from_logits(hidden @ vocab.weight.T, 4, vocab.token_ids)
    want = shortlist_topk(weight, hidden, ids, 4)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
    assert set(got[1].flatten().tolist()) <= set(ids.tolist())


def _rank_main(rank: int, world: int, port: int, vocab_size: int, ids, k: int, queue) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        weight, hidden = head_and_states(vocab_size)
        shard = -(-vocab_size // world)  # SGLang's equal shards, padded at the end
        padded = torch.cat([weight, torch.full((shard * world - vocab_size, HIDDEN), 9.0)])
        start = rank * shard
        vocab = draft_vocab(
            torch.tensor(ids), padded[start : start + shard], start, vocab_size, world
        )
        logits = hidden @ vocab.weight.T  # [bs, L, S_rank]: padding columns included
        logprobs, tokens = vocab_parallel_topk(
            logits, k, start, vocab_size, token_ids=vocab.token_ids
        )
        queue.put((rank, vocab.token_ids.numel(), logprobs.tolist(), tokens.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "ids", "k"),
    [
        (2, [1, 2, 3, 4, 5, 40], 5),  # one rank holds almost every id: padding on the other
        (3, [44, 0, 17, 30, 16, 15, 2, 33], 8),  # k = the whole map
    ],
)
def test_ranks_merge_to_the_top_k_of_the_maps_ids(world, ids, k):
    from sglang_tree_spec.server_process import free_port

    vocab_size = 45
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(r, world, port, vocab_size, ids, k, queue))
        for r in range(world)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in range(world)]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    weight, hidden = head_and_states(vocab_size)
    want_logprobs, want_tokens = shortlist_topk(weight, hidden, torch.tensor(ids), k)
    widths = {width for _, width, _, _ in results}
    assert len(widths) == 1  # every rank multiplies the same number of rows
    for _, _, logprobs, tokens in results:
        assert torch.equal(torch.tensor(tokens), want_tokens)
        torch.testing.assert_close(torch.tensor(logprobs), want_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "holds no token ids"),
        ([3, 50], r"outside the target's vocabulary \[0, 50\)"),
        ([-1, 3], "outside"),
        ([3, 4, 3], "repeats token ids"),
        ([1, 2], r"2 ids, fewer than the draft top-K \(4"),
    ],
)
def test_a_bad_token_map_is_refused_in_one_line(ids, message):
    with pytest.raises(TokenMapError, match=rf"^DDTREE: --speculative-token-map m\.pt .*{message}"):
        check_token_map(torch.tensor(ids, dtype=torch.int64), 50, 4, "--speculative-token-map m.pt")


def test_the_frequency_map_ranks_seen_ids_then_fills_in_id_order():
    records = [[5, 5, 9, 2], [9, 5, 11, 60]]  # 60 is outside a vocabulary of 20
    assert frequency_token_map(records, 3, 20) == [5, 9, 2]
    assert frequency_token_map(records, 6, 20) == [5, 9, 2, 11, 0, 1]
    with pytest.raises(ValueError, match="out of range"):
        frequency_token_map(records, 21, 20)
