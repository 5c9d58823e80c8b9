"""Issue 19's sampling parameters through a real SGLang server: DDTREE against no speculation.

One no-speculation server and one DDTREE server (budget 8, the small fp32 pair of
``test_sglang_ddtree``) answer the same requests: ``return_logprob`` with
``top_logprobs_num`` and ``token_ids_logprob`` (the committed tokens' log-probs equal the
target's within float tolerance, the tokens equal), one at a time and four at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_sglang_ddtree
from test_sglang_ddtree import NEW_TOKENS, Server, running_server, server_command

from sglang_tree_spec.server_process import free_port, http_json

pair = test_sglang_ddtree.pair  # the module fixtures: the small fp32 pair, held-out prompts
prompts = test_sglang_ddtree.prompts

BUDGET = 8
LOGPROB_TOLERANCE = 1e-4  # float32 logits: a tree verify and a one-token decode differ in ulps
TOP_LOGPROBS = 3
TOKEN_IDS = [0, 1, 2, 17]


def logprob_request(server: Server, prompt: list[int], **sampling: object) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, **sampling}
    return http_json(
        f"{server.base_url}/generate",
        {
            "input_ids": prompt,
            "sampling_params": params,
            "return_logprob": True,
            "top_logprobs_num": TOP_LOGPROBS,
            "token_ids_logprob": TOKEN_IDS,
        },
        timeout=300,
    )


def logprob_replies(server: Server, prompts: list[list[int]], concurrency: int) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: logprob_request(server, p), prompts))


def both_servers(pair, prompts, tmp_path: Path) -> Iterator[dict[str, list]]:
    """Every request of this module, asked of each server once (two server starts)."""
    replies: dict[str, list] = {}
    for name, budget in (("plain", None), ("ddtree", BUDGET)):
        log = tmp_path / f"{name}.log"
        for server in running_server(server_command(pair, free_port(), budget), log):
            replies[f"{name}/logprobs-1"] = logprob_replies(server, prompts[:4], 1)
            replies[f"{name}/logprobs-4"] = logprob_replies(server, prompts[4:8], 4)
    yield replies


@pytest.fixture(scope="module")
def served(pair, prompts, tmp_path_factory) -> Iterator[dict[str, list]]:
    import sglang  # noqa: F401  (fail, not skip, without SGLang)

    yield from both_servers(pair, prompts, tmp_path_factory.mktemp("params"))


def assert_close_logprobs(plain: list, ddtree: list) -> None:
    """``[[logprob, token id, text], ...]`` lists: same ids, log-probs within tolerance."""
    assert [entry[1] for entry in ddtree] == [entry[1] for entry in plain]
    for (want, _, _), (got, _, _) in zip(plain, ddtree, strict=True):
        assert math.isclose(got, want, rel_tol=0, abs_tol=LOGPROB_TOLERANCE), (got, want)


@pytest.mark.parametrize("batch", ["logprobs-1", "logprobs-4"])
def test_ddtree_logprobs_equal_no_speculation(served, batch):
    """Greedy with ``return_logprob``, ``top_logprobs_num`` and ``token_ids_logprob``: same
    tokens, every committed token's log-prob, top log-probs and asked-for ids' log-probs
    within tolerance of the no-speculation server's, and more than one token per verify."""
    for plain, ddtree in zip(served[f"plain/{batch}"], served[f"ddtree/{batch}"], strict=True):
        assert ddtree["output_ids"] == plain["output_ids"]
        want, got = plain["meta_info"], ddtree["meta_info"]
        assert len(got["output_token_logprobs"]) == len(ddtree["output_ids"])
        assert_close_logprobs(want["output_token_logprobs"], got["output_token_logprobs"])
        for key in ("output_top_logprobs", "output_token_ids_logprobs"):
            assert len(got[key]) == len(want[key]) == len(ddtree["output_ids"])
            for plain_top, ddtree_top in zip(want[key], got[key], strict=True):
                assert_close_logprobs(plain_top, ddtree_top)
        assert got["spec_verify_ct"] < got["completion_tokens"]  # the tree ran
