"""``n > 1`` with a seed: each live sibling of a seeded request gets its own sample index and
coin seed (``sglang_tree_spec.plugin.samples``), on duck-typed requests and on SGLang's Req."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_tree_spec.plugin.samples import SampleNumbers, sample_index, sample_seed
from sglang_tree_spec.tree import counter_uniforms


def request(seed: int | None, prompt=(1, 2, 3), max_new_tokens: int = 8) -> SimpleNamespace:
    params = SimpleNamespace(sampling_seed=seed, max_new_tokens=max_new_tokens)
    req = SimpleNamespace(sampling_params=params, origin_input_ids=list(prompt), done=False)
    req.finished = lambda: req.done
    return req


def test_siblings_alive_at_once_are_numbered_and_a_later_request_is_sample_zero():
    numbers = SampleNumbers()
    prefix = request(7, max_new_tokens=0)  # SGLang's prefix-caching request of n > 1
    a, b, other_prompt, unseeded = request(7), request(7), request(7, (4, 5)), request(None)
    numbers.number([prefix, a, unseeded])
    numbers.number([b, other_prompt])
    assert [sample_index(r) for r in (prefix, a, b, other_prompt, unseeded)] == [0, 0, 1, 0, 0]
    a.done = True
    c = request(7)
    numbers.number([c])
    assert sample_index(c) == 0  # the lowest index no live sibling holds
    b.done = c.done = True
    again = request(7)
    numbers.number([again])
    assert sample_index(again) == 0  # sent again after its siblings finished: reproduces
    numbers.number([again])
    assert sample_index(again) == 0  # numbered once (a retracted request keeps its index)


def test_sample_seeds_are_distinct_int64_and_sample_zero_keeps_the_seed():
    seeds = [0, 1, 1234, -5, 2**63 - 1]
    derived = {sample_seed(seed, index) for seed in seeds for index in range(1, 5)}
    assert len(derived) == 20 and not derived & set(seeds)
    assert all(-(2**63) <= seed < 2**63 for seed in derived)
    assert [sample_seed(seed, 0) for seed in seeds] == seeds
    # Usable as coin keys: the two streams of a seed do not coincide.
    positions = torch.arange(64).view(1, -1)
    first = counter_uniforms(torch.tensor([1234]), positions)
    second = counter_uniforms(torch.tensor([sample_seed(1234, 1)]), positions)
    assert not torch.equal(first, second)


def test_sglang_req_is_numbered():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=8, sampling_seed=3)
    reqs = [Req(f"r{i}", "", [1, 2, 3], params) for i in range(2)]
    SampleNumbers().number(reqs)
    assert [sample_index(req) for req in reqs] == [0, 1]
