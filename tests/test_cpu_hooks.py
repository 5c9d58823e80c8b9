"""The CPU hook that writes speculative decode slots, against a per-request loop."""

from __future__ import annotations

import torch

from sglang_tree_spec.plugin.cpu import assign_req_to_token_on_cpu


def refuse(*args, **kwargs):
    raise AssertionError("the original (GPU) function must not run for CPU tensors")


def test_assign_req_to_token_writes_each_requests_segment():
    gen = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(6, 40, dtype=torch.int32)
    req_pool_indices = torch.tensor([4, 1, 3])
    start = torch.tensor([3, 0, 17])
    end = torch.tensor([8, 2, 26])  # segments of 5, 2 and 9 slots, laid end to end below
    out_cache_loc = torch.randperm(100, generator=gen)[:16]
    expected = req_to_token.clone()
    offset = 0
    for b in range(3):
        n = int(end[b] - start[b])
        expected[req_pool_indices[b], start[b] : end[b]] = out_cache_loc[offset : offset + n].int()
        offset += n

    assign_req_to_token_on_cpu(
        refuse, req_pool_indices, req_to_token, start, end, out_cache_loc, batch_size=3
    )
    assert torch.equal(req_to_token, expected)
