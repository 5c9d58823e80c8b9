"""Top-K of a vocabulary-parallel LM head equals the dense top-K, across real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_tree_spec.tree import topk_from_logits, vocab_parallel_topk

BS, DEPTH = 3, 5


def dense_logits(vocab_size: int) -> torch.Tensor:
    """``[bs, L, V]`` logits with distinct values (no ties to order)."""
    generator = torch.Generator().manual_seed(vocab_size)
    return torch.randn(BS, DEPTH, vocab_size, generator=generator) * 3.0


def shard_of(logits: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """SGLang's layout: equal shards of the vocabulary padded to ``world`` * shard; the padding
    rows at the end of the last shard carry garbage that must never win."""
    vocab_size = logits.shape[-1]
    shard = -(-vocab_size // world)
    padded = torch.cat([logits, torch.full((BS, DEPTH, shard * world - vocab_size), 50.0)], -1)
    return padded[..., rank * shard : (rank + 1) * shard], rank * shard


def _rank_main(rank: int, world: int, port: int, vocab_size: int, k: int, queue) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        shard, start = shard_of(dense_logits(vocab_size), rank, world)
        logprobs, tokens = vocab_parallel_topk(shard, k, start, vocab_size)
        # Plain lists: a tensor would travel as a shared-memory fd that dies with this process.
        queue.put((rank, logprobs.tolist(), tokens.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "vocab_size", "k"),
    [(2, 41, 41), (3, 10, 9), (3, 40, 8)],  # padding rows; k = V; k > a shard
)
def test_vocab_parallel_topk_equals_the_dense_topk(world, vocab_size, k):
    from sglang_tree_spec.server_process import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world, port, vocab_size, k, queue))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in range(world)]  # a crashed rank fails here
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    want_logprobs, want_tokens = topk_from_logits(dense_logits(vocab_size), k)
    for _, logprobs, tokens in results:
        assert torch.equal(torch.tensor(tokens), want_tokens)
        torch.testing.assert_close(torch.tensor(logprobs), want_logprobs, rtol=0, atol=1e-5)


def test_vocab_parallel_topk_rejects_bad_inputs():
    with pytest.raises(ValueError, match="out of range"):
        vocab_parallel_topk(torch.zeros(1, 2, 4), 9, 0, 8)
    with pytest.raises(ValueError, match=r"\[bs, L, V_shard\]"):
        vocab_parallel_topk(torch.zeros(2, 4), 2, 0, 8)
