"""DDTREE with paged KV (``--page-size 16``) served by a real SGLang on CPU equals SGLang
without speculation at the same page size.

At page size > 1 SGLang's allocator hands a request whole pages, and a request's
``req_to_token`` row maps each position to a slot inside its own pages. DDTREE's verify window,
the drafter's block and the accepted path's KV moves all address slots through that row, so
the accepted nodes' KV lands at the committed positions inside the request's pages. Checked
here: greedy outputs one at a time and eight at once (pages of different requests
interleaved), at budget 32 (a window of 33 slots: every step crosses a page boundary); a
request continuing a finished one, whose decoded tokens' pages come back from the prefix
cache; requests to the end of the context. SGLang 0.5.17 allocates pages with a Triton kernel
only, so on 0.5.17 every server here (the baseline too) runs under Triton's interpreter, which
runs that kernel and SGLang's KV-copy and slot-assignment kernels on CPU tensors (attention
stays torch_native); 0.5.23 allocates pages in torch on CPU and runs without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_sglang_ddtree
from test_sglang_ddtree import Server, server_command
from transformers import AutoTokenizer

from sglang_tree_spec.models.small_pair import heldout_prompts
from sglang_tree_spec.server_process import free_port, launch, stop, wait_until_healthy

pair = test_sglang_ddtree.pair  # the module fixture: the small pair in float32

pytestmark = pytest.mark.slow

PAGE_SIZE = 16
PROMPT_COUNT = 12
PROMPT_TOKENS = 90  # not a multiple of the page size: decoding starts inside a page
BUDGETS = (32,)  # a window of 33 slots spans 3 pages; 9 slots would cross one only sometimes
CONTINUED = 3  # requests that continue a finished one's prompt and output


def paged_command(pair: dict[str, Path], budget: int | None) -> list[str]:
    return [*server_command(pair, free_port(), budget), "--page-size", str(PAGE_SIZE)]


def page_allocation_needs_the_interpreter() -> bool:
    from sglang_tree_spec.plugin import compat

    return compat.is_release("0.5.17")


def paged_server(command: list[str], log: Path) -> Iterator[Server]:
    env = {"TRITON_INTERPRET": "1"} if page_allocation_needs_the_interpreter() else {}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)  # the server's environment only
        process = launch(command, log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        wait_until_healthy(base_url, process, log)
        yield Server(base_url, log)
    finally:
        stop(process)


@pytest.fixture(scope="module")
def prompts(pair: dict[str, Path]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    texts = heldout_prompts(PROMPT_COUNT)
    return [tokenizer.encode(text, add_special_tokens=False)[-PROMPT_TOKENS:] for text in texts]


@pytest.fixture(scope="module")
def context_filling(pair: dict[str, Path]) -> list[tuple[list[int], int]]:
    """``(prompt, new tokens)`` pairs of context - 1 tokens in all (EOS ignored): their last
    steps reserve KV slots up to the end of the request's ``req_to_token`` row."""
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    context = json.loads((pair["target"] / "config.json").read_text())["max_position_embeddings"]
    tokens = tokenizer.encode("\n\n".join(heldout_prompts(24)), add_special_tokens=False)
    assert len(tokens) >= context
    return [(tokens[-(context - 1 - new) :], new) for new in (6, 23)]


def serve(server: Server, prompts, context_filling) -> dict[str, object]:
    """Everything the tests compare, from one server: outputs one at a time, eight at once
    (with their metadata), continuations of finished requests, outputs to the context end."""
    sequential = server.greedy(prompts, 1)
    concurrent = server.greedy_replies(prompts, 8)
    continued = [
        server.generate(prompt + output)
        for prompt, output in zip(prompts[:CONTINUED], sequential[:CONTINUED], strict=True)
    ]
    return {
        "sequential": sequential,
        "concurrent": concurrent,
        "continued": continued,
        "to_context": server.fill_context(context_filling),
        "log": server.log.read_text(),
    }


@pytest.fixture(scope="module")
def baseline(pair, prompts, context_filling, tmp_path_factory) -> dict[str, object]:
    """No speculation at page size 16."""
    import sglang  # noqa: F401  (fail, not skip, without SGLang)

    log = tmp_path_factory.mktemp("baseline-paged") / "server.log"
    for server in paged_server(paged_command(pair, None), log):
        return serve(server, prompts, context_filling)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module", params=BUDGETS, ids=lambda b: f"budget{b}")
def ddtree(request, pair, prompts, context_filling, baseline, tmp_path_factory) -> dict:
    log = tmp_path_factory.mktemp(f"ddtree{request.param}-paged") / "server.log"
    for server in paged_server(paged_command(pair, request.param), log):
        return serve(server, prompts, context_filling)
    raise AssertionError("unreachable")


def test_servers_run_with_paged_kv(baseline, ddtree):
    for served in (baseline, ddtree):
        assert f"'page_size': {PAGE_SIZE}" in served["log"] or (
            f"page_size={PAGE_SIZE}," in served["log"]
        )
    assert "DDTREE worker:" in ddtree["log"]
    if page_allocation_needs_the_interpreter():
        assert "runs SGLang's Triton kernel under Triton's interpreter" in ddtree["log"]


def test_ddtree_greedy_equals_no_speculation_one_at_a_time(ddtree, baseline):
    assert ddtree["sequential"] == baseline["sequential"]


def test_ddtree_greedy_equals_no_speculation_eight_at_once(ddtree, baseline):
    assert [r["output_ids"] for r in ddtree["concurrent"]] == baseline["sequential"]
    assert [r["output_ids"] for r in baseline["concurrent"]] == baseline["sequential"]
    # The tree accepted deep paths (the first token of each request comes from the prefill).
    tokens = sum(r["meta_info"]["completion_tokens"] - 1 for r in ddtree["concurrent"])
    verifies = sum(r["meta_info"]["spec_verify_ct"] for r in ddtree["concurrent"])
    assert tokens / verifies > 2.0


def test_continuation_from_cached_decoded_pages_equals_no_speculation(ddtree, baseline):
    """A finished request's prompt and output go into the prefix cache in whole pages; a
    request continuing it reads the decoded tokens' KV (moved there from tree slots) back
    from those pages."""
    outputs = [reply["output_ids"] for reply in ddtree["continued"]]
    assert outputs == [reply["output_ids"] for reply in baseline["continued"]]
    for reply in ddtree["continued"]:  # the decoded tokens' pages were reused
        assert reply["meta_info"]["cached_tokens"] > PROMPT_TOKENS


def test_ddtree_serves_requests_to_the_end_of_the_context(ddtree, baseline, context_filling):
    assert ddtree["to_context"] == baseline["to_context"]
    assert [len(out) for out in baseline["to_context"]] == [n - 1 for _, n in context_filling]
