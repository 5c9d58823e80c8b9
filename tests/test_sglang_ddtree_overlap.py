"""DDTREE under SGLang's overlap scheduler, a real server on CPU: exact as without it.

With overlap SGLang runs decode step ``N + 1`` before it processes step ``N``'s result: the
worker's next bonus tokens and sequence lengths come through SGLang's ``FutureMap``, and the
requests' host ``output_ids`` lag one step. On CPU DDTREE runs synchronously, as SGLang's own
speculative algorithms do; ``SGLANG_TREE_SPEC_CPU_OVERLAP=1`` (this module's servers) keeps the
overlap scheduler, whose event loop then runs every step in that order (a CPU device does not
run ahead of the host, so this checks the data flow, not the speed-up).

One no-speculation server (synchronous: under overlap SGLang's own plain decoding penalises one
token late) and one DDTREE server under overlap (budget control up to 16, the small fp32 pair
of ``test_sglang_ddtree``) answer the same requests: greedy one at a time and eight at once,
penalties and ``min_new_tokens`` (one at a time and four differently penalised at once),
``return_logprob`` four at once: equal token for token. Seeded sampling (alone, at once with
others, and again) is the target's own draw with DDTREE's coins.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import test_sglang_ddtree
import test_sglang_ddtree_params as params
from test_sglang_ddtree import FILTERED, offline_sample, running_server, server_command

from sglang_tree_spec.plugin.validation import CPU_OVERLAP_ENV
from sglang_tree_spec.server_process import free_port

pair = test_sglang_ddtree.pair  # the module fixtures: the small fp32 pair, held-out prompts
prompts = test_sglang_ddtree.prompts
offline_target = test_sglang_ddtree.offline_target

BUDGET = 16  # the window (17) covers the drafter's block (8): overlap stays on
GREEDY_PROMPTS = 16
PENALTY_LABELS = ("frequency", "presence", "repetition", "frequency+presence+repetition")


def ask(server, prompts: list[list[int]], replies: dict, name: str) -> None:
    """Every request of this module, asked of ``server``; replies under ``name/...``."""
    greedy = prompts[:GREEDY_PROMPTS]
    replies[f"{name}/greedy-1"] = server.greedy_replies(greedy, 1)
    replies[f"{name}/greedy-8"] = server.greedy_replies(greedy, 8)
    for label, sampling in params.penalised_requests().items():
        replies[f"{name}/{label}"] = [params.generate(server, p, sampling) for p in prompts[:3]]
    stops = [reply["output_ids"][2] for reply in replies["plain/greedy-1"][:3]]  # plain first
    replies[f"{name}/min-new-tokens"] = [
        params.generate(server, prompt, {"stop_token_ids": [stop], "min_new_tokens": minimum})
        for prompt, stop in zip(prompts[:3], stops, strict=True)
        for minimum in (4, 9, 20)
    ]
    with ThreadPoolExecutor(len(params.MIXED)) as pool:
        mixed = pool.map(partial(params.generate, server), prompts[8:12], params.MIXED)
        replies[f"{name}/mixed"] = list(mixed)
    replies[f"{name}/logprobs-4"] = params.logprob_replies(server, prompts[4:8], 4)


def seeded_output(server, prompt: list[int]) -> list[int]:
    return server.generate(prompt, **FILTERED)["output_ids"]


@pytest.fixture(scope="module")
def served(pair, prompts, tmp_path_factory) -> Iterator[dict]:
    import sglang  # noqa: F401  (fail, not skip, without SGLang)

    root = tmp_path_factory.mktemp("overlap")
    replies: dict = {}
    plain = [*server_command(pair, free_port(), None), "--disable-overlap-schedule"]
    for server in running_server(plain, root / "plain.log"):
        ask(server, prompts, replies, "plain")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CPU_OVERLAP_ENV, "1")
        ddtree = server_command(pair, free_port(), BUDGET)
        for server in running_server(ddtree, root / "ddtree.log"):
            ask(server, prompts, replies, "ddtree")
            seeded_request = partial(seeded_output, server)
            seeded = [seeded_request(p) for p in prompts[:3]]
            with ThreadPoolExecutor(4) as pool:  # the same requests among others, at once
                together = list(pool.map(seeded_request, prompts[:4]))
            replies["ddtree/seeded"] = seeded
            replies["ddtree/seeded-together"] = together[:3]
            replies["ddtree/seeded-again"] = seeded_request(prompts[0])
            replies["ddtree/log"] = server.log.read_text()
    yield replies


def output_ids(replies: list[dict]) -> list[list[int]]:
    return [reply["output_ids"] for reply in replies]


def test_ddtree_ran_under_the_overlap_scheduler(served):
    """The worker says overlap is on, SGLang did not force it off (no deprecation warning for
    ``supports_overlap=False``), and the trees accepted more than one token per verify."""
    log = served["ddtree/log"]
    assert "overlap scheduling on" in log
    assert "supports_overlap=False" not in log and "overlap scheduling disabled" not in log
    replies = served["ddtree/greedy-8"]
    tokens = sum(reply["meta_info"]["completion_tokens"] - 1 for reply in replies)
    verifies = sum(reply["meta_info"]["spec_verify_ct"] for reply in replies)
    assert tokens / verifies > 2.0


@pytest.mark.parametrize("batch", ["greedy-1", "greedy-8"])
def test_overlapped_ddtree_greedy_equals_no_speculation(served, batch):
    """Greedy, one request at a time and eight at once: token for token."""
    assert output_ids(served[f"ddtree/{batch}"]) == output_ids(served["plain/greedy-1"])
    assert output_ids(served[f"plain/{batch}"]) == output_ids(served["plain/greedy-1"])


@pytest.mark.parametrize("label", [*PENALTY_LABELS, "min-new-tokens", "mixed"])
def test_overlapped_ddtree_penalties_equal_synchronous_no_speculation(served, label):
    """Penalties and ``min_new_tokens`` count every output token before the one drawn, though
    the host's lists lag a step under overlap (``plugin/pending.py``)."""
    assert output_ids(served[f"ddtree/{label}"]) == output_ids(served[f"plain/{label}"])


def test_penalised_requests_are_not_vacuous(served):
    greedy = output_ids(served["plain/greedy-1"][:3])
    for label in PENALTY_LABELS:
        assert output_ids(served[f"plain/{label}"]) != greedy, label


def test_overlapped_ddtree_logprobs_equal_no_speculation(served):
    for plain, ddtree in zip(served["plain/logprobs-4"], served["ddtree/logprobs-4"], strict=True):
        assert ddtree["output_ids"] == plain["output_ids"]
        params.assert_close_logprobs(
            plain["meta_info"]["output_token_logprobs"],
            ddtree["meta_info"]["output_token_logprobs"],
        )


def test_overlapped_ddtree_seeded_sampling_reproduces_and_is_the_target_alone(
    served, prompts, offline_target
):
    """Seeded sampling (every filter of SGLang's sampler on), alone, among others and again:
    after its first token (the prefill's, drawn by SGLang's own sampler, which ignores the seed
    and depends on the batch) every output is the target's own draw with DDTREE's coins, so
    outputs with the same first token are the same."""
    seeded = served["ddtree/seeded"]
    together = served["ddtree/seeded-together"]
    runs = [*zip(prompts[:3], seeded, strict=True), *zip(prompts[:3], together, strict=True)]
    runs.append((prompts[0], served["ddtree/seeded-again"]))
    for prompt, output in runs:
        assert len(output) > 1
        assert output == offline_sample(offline_target, prompt, output[0], len(output), FILTERED)
    by_first = {}
    for prompt, output in runs:
        assert by_first.setdefault((tuple(prompt), output[0]), output) == output
