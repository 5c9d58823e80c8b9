"""Issue 19: ``n = 2`` with a ``sampling_seed`` under DDTREE on a real SGLang server (CPU, the
shipped small pair in float32): two different samples, each the target's own draw.

Each served sample equals an independent offline computation of the target's draws (SGLang's
temperature / top-k / top-p) with DDTREE's coins: ``counter_uniforms(seed, position)`` for
sample 0 and ``counter_uniforms(sample_seed(seed, 1), position)`` for sample 1 (the first token
is the prefill's, SGLang's own sampler, taken as served). Plain SGLang without
``--enable-deterministic-inference`` ignores the seed and returns two independent samples
(see the note of issue 19); before this, DDTREE returned the same sample twice.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import test_sglang_ddtree
import torch
from test_sglang_ddtree import (
    offline_sample,
    running_server,
    server_command,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_tree_spec.models.small_pair import heldout_prompts
from sglang_tree_spec.plugin.samples import sample_seed
from sglang_tree_spec.server_process import free_port, http_json

pair = test_sglang_ddtree.pair  # the module fixture: the small pair in float32

NEW_TOKENS = 24
PARAMS = {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.0, "sampling_seed": 1234}


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory) -> Iterator:
    log = tmp_path_factory.mktemp("parallel") / "server.log"
    yield from running_server(server_command(pair, free_port(), 8), log)


def test_n2_with_a_seed_gives_two_samples_each_the_targets_own(pair, server):
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    target = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)[-96:] for text in heldout_prompts(2)
    ]
    seeds = [PARAMS["sampling_seed"], sample_seed(PARAMS["sampling_seed"], 1)]
    for prompt in prompts:
        params = {**PARAMS, "n": 2, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        replies = http_json(
            f"{server.base_url}/generate", {"input_ids": prompt, "sampling_params": params}, 300
        )
        samples = [reply["output_ids"] for reply in replies]
        assert len(samples) == 2 and all(len(s) == NEW_TOKENS for s in samples)
        assert samples[0] != samples[1]
        # Each sample is the target's draw under one of the two coin streams, one each.
        matched = []
        for sample in samples:
            matches = [
                index
                for index, seed in enumerate(seeds)
                if sample
                == offline_sample(
                    target, prompt, sample[0], NEW_TOKENS, {**PARAMS, "sampling_seed": seed}
                )
            ]
            assert len(matches) == 1, (sample, matches)
            matched += matches
        assert sorted(matched) == [0, 1]
