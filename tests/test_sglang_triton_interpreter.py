"""DDTREE through SGLang's Triton attention backend, on CPU, under Triton's interpreter.

The GPU path without a GPU: ``python -m sglang.launch_server --device cpu --attention-backend
triton --disable-cuda-graph`` with ``TRITON_INTERPRET=1`` runs SGLang's own Triton kernels on
CPU tensors -- the tree-masked extend attention of the target's verify, the drafter's
non-causal block attention, the KV copy that moves accepted nodes to their final slots and the
req_to_token slot assignment -- where the torch_native tests run the plugin's CPU stand-ins.
Greedy output equals the target's own (transformers, full recomputation) for a batch of prompts
of different lengths, at budgets 8 and 16, without and with grafting.

The interpreter is slow (seconds per decode step with the 4-layer small pair), so this module
keeps to two servers, three short prompts and 16 new tokens each.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import test_sglang_ddtree
import torch
from test_sglang_ddtree import server_command
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_tree_spec.models.small_pair import heldout_prompts
from sglang_tree_spec.server_process import free_port, http_json, launch, stop, wait_until_healthy

pair = test_sglang_ddtree.pair  # the module fixture: the small pair in float32

pytestmark = pytest.mark.slow

PROMPT_TOKENS = (24, 40, 56)  # one batch, three prefix lengths (all under one 64-wide KV tile)
NEW_TOKENS = 16
SERVERS = {"budget8": (8, "none"), "budget16-graft": (16, "unified")}
INTERPRETED_KERNELS = ("KV copy", "req_to_token slot assignment")


@pytest.fixture(scope="module")
def prompts(pair: dict[str, Path]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    texts = heldout_prompts(len(PROMPT_TOKENS))
    return [
        tokenizer.encode(text, add_special_tokens=False)[-length:]
        for text, length in zip(texts, PROMPT_TOKENS, strict=True)
    ]


@pytest.fixture(scope="module")
def reference(pair: dict[str, Path], prompts: list[list[int]]) -> list[list[int]]:
    """The target's greedy continuations by full recomputation in transformers (float32),
    refused if any step is a near-tie that float rounding between kernels could flip."""
    model = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(NEW_TOKENS):
                logits = model(ids).logits[0, -1]
                top = logits.topk(2).values
                assert float(top[0] - top[1]) > 1e-3, "near-tie: pick other prompts"
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def interpreted_server_command(pair: dict[str, Path], budget: int, graft: str) -> list[str]:
    """The DDTREE launch command of the CPU tests, on SGLang's triton backend."""
    command = server_command(pair, free_port(), budget)
    command[command.index("--attention-backend") + 1] = "triton"
    return [
        *command,
        "--disable-cuda-graph",
        "--speculative-ddtree-graft",
        graft,
        "--skip-server-warmup",  # the warm-up request alone costs tens of interpreted seconds
    ]


@pytest.fixture(scope="module", params=list(SERVERS), ids=list(SERVERS))
def served(request, pair, prompts, tmp_path_factory) -> dict:
    """One interpreted DDTREE server's replies to all prompts at once, its log and timings."""
    budget, graft = SERVERS[request.param]
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    command = interpreted_server_command(pair, budget, graft)
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # the server's environment only
        process = launch(command, log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        wait_until_healthy(base_url, process, log)
        healthy = time.monotonic() - started
        params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        replies = http_json(
            f"{base_url}/generate", {"input_ids": prompts, "sampling_params": params}, 600
        )
        generated = time.monotonic() - started - healthy
    finally:
        stop(process)
    print(f"\n{request.param}: healthy after {healthy:.0f} s, {generated:.0f} s to generate")
    return {"replies": replies, "log": log.read_text(), "budget": budget, "graft": graft}


def test_ddtree_on_triton_backend_equals_target_greedy(served, reference):
    assert [reply["output_ids"] for reply in served["replies"]] == reference


def test_the_tree_accepts_more_than_one_token_per_step(served):
    """Several draft tokens accepted per verify: the tree mask decided what the target saw."""
    steps = sum(reply["meta_info"]["spec_verify_ct"] for reply in served["replies"])
    assert steps < 0.75 * NEW_TOKENS * len(PROMPT_TOKENS)


def test_sglang_triton_kernels_ran_not_the_cpu_stand_ins(served):
    log = served["log"]
    assert "attention_backend='triton'" in log  # the target's server args
    assert "Initialized DFLASH draft runner. attention_backend=triton" in log  # the drafter's
    for kernel in INTERPRETED_KERNELS:  # the plugin's CPU hooks stepped aside
        assert f"{kernel} runs SGLang's Triton kernel under Triton's interpreter" in log
    assert f"budget {served['budget']}, drafter block" in log  # the worker's start-up line
    assert f"graft {served['graft']}" in log
