"""Issue 19's sampling parameters through a real SGLang server: DDTREE against no speculation.

One no-speculation server and one DDTREE server (budget 8, the small fp32 pair of
``test_sglang_ddtree``) answer the same requests: ``return_logprob`` with
``top_logprobs_num`` and ``token_ids_logprob`` (the committed tokens' log-probs equal the
target's within float tolerance, the tokens equal), one at a time and four at once; greedy
requests with each penalty and ``min_new_tokens`` (equal token for token), and seeded sampling
with penalties (equal to the target alone with DDTREE's coins).

The no-speculation server runs without overlap scheduling, as DDTREE does. Under SGLang's
overlap scheduler a plain decode step penalises by the output known when the step was
scheduled: one token behind, with the prompt's last token counted at the first decode step
(seen on 0.5.17: a repetition-penalised greedy output then differs from the synchronous one).
DDTREE penalises each token by every output token before it, as the synchronous scheduler does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import test_sglang_ddtree
import torch
from test_sglang_ddtree import NEW_TOKENS, Server, running_server, server_command

from sglang_tree_spec.server_process import free_port, http_json
from sglang_tree_spec.tree import counter_uniforms, target_probs

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


def generate(server: Server, prompt: list[int], params: dict) -> dict:
    return server.generate(prompt, **params)


def penalised_requests() -> dict[str, dict]:
    """Greedy requests with each penalty (and all three together)."""
    return {
        "frequency": {"frequency_penalty": 0.8},
        "presence": {"presence_penalty": 0.9},
        "repetition": {"repetition_penalty": 1.6},
        "frequency+presence+repetition": {
            "frequency_penalty": 0.3,
            "presence_penalty": 0.4,
            "repetition_penalty": 1.3,
        },
    }


def stop_requests(stop: int) -> dict[str, dict]:
    """A stop token the greedy output emits early (its third token): without a minimum the
    output ends there; with ``min_new_tokens`` it is masked for the first 20 tokens."""
    return {
        "stop-early": {"stop_token_ids": [stop]},
        "min-new-tokens": {"stop_token_ids": [stop], "min_new_tokens": 20},
    }


# Four requests at once, three penalised differently and one plain (per-row state).
MIXED = [
    {"repetition_penalty": 1.4},
    {},
    {"frequency_penalty": 0.6, "min_new_tokens": 12},
    {"presence_penalty": 1.1},
]


# Seeded sampling with every filter and two penalties (DDTREE's coins are keyed by position).
SAMPLED = {
    "temperature": 0.8,
    "top_k": 6,
    "top_p": 0.9,
    "sampling_seed": 5,
    "repetition_penalty": 1.3,
    "frequency_penalty": 0.4,
}


def both_servers(pair, prompts, tmp_path: Path) -> Iterator[dict[str, list]]:
    """Every request of this module, asked of each server once (two server starts)."""
    replies: dict[str, list] = {}
    for name, budget in (("plain", None), ("ddtree", BUDGET)):
        log = tmp_path / f"{name}.log"
        command = server_command(pair, free_port(), budget)
        if budget is None:  # synchronous, as DDTREE runs (see the module docstring)
            command.append("--disable-overlap-schedule")
        for server in running_server(command, log):
            replies[f"{name}/logprobs-1"] = logprob_replies(server, prompts[:4], 1)
            replies[f"{name}/logprobs-4"] = logprob_replies(server, prompts[4:8], 4)
            for label, params in penalised_requests().items():
                replies[f"{name}/{label}"] = [generate(server, p, params) for p in prompts[:3]]
            # The stop tokens come from the plain server's greedy outputs (it runs first).
            stops = [reply["output_ids"][2] for reply in replies["plain/logprobs-1"][:3]]
            for label in ("stop-early", "min-new-tokens"):
                replies[f"{name}/{label}"] = [
                    generate(server, prompt, stop_requests(stop)[label])
                    for prompt, stop in zip(prompts[:3], stops, strict=True)
                ]
            # Minimums a few tokens past the stop token: a step then straddles the minimum.
            replies[f"{name}/min-new-near"] = [
                generate(server, prompt, {"stop_token_ids": [stop], "min_new_tokens": minimum})
                for prompt, stop in zip(prompts[:3], stops, strict=True)
                for minimum in (4, 6, 9)
            ]
            if budget is not None:  # seeded sampling with penalties, against the target alone
                replies["ddtree/sampled"] = [generate(server, p, SAMPLED) for p in prompts[:2]]
            with ThreadPoolExecutor(len(MIXED)) as pool:
                mixed = pool.map(partial(generate, server), prompts[8:12], MIXED)
                replies[f"{name}/mixed"] = list(mixed)
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


PENALTY_LABELS = [
    "frequency",
    "presence",
    "repetition",
    "frequency+presence+repetition",
    "min-new-tokens",
    "min-new-near",
    "mixed",
]


@pytest.mark.parametrize("label", PENALTY_LABELS)
def test_ddtree_penalties_equal_no_speculation(served, label):
    """Greedy with each penalty (and all three together, and four differently penalised
    requests at once): DDTREE's output equals no speculation's token for token, with more than
    one token per verify."""
    plain, ddtree = served[f"plain/{label}"], served[f"ddtree/{label}"]
    assert [r["output_ids"] for r in ddtree] == [r["output_ids"] for r in plain]
    assert sum(r["meta_info"]["spec_verify_ct"] for r in ddtree) < sum(
        r["meta_info"]["completion_tokens"] for r in ddtree
    )


def test_penalties_change_the_output(served):
    """The requests above are not vacuous: each penalty changes the plain server's greedy
    output, and the stop token ends the unconstrained output before ``min_new_tokens``."""
    plain = {label: [r["output_ids"] for r in served[f"plain/{label}"]] for label in PENALTY_LABELS}
    greedy = [r["output_ids"] for r in served["plain/logprobs-1"][:3]]
    for label in PENALTY_LABELS[:4]:
        assert plain[label] != greedy, label
    stopped = [len(r["output_ids"]) for r in served["plain/stop-early"]]
    assert max(stopped) < 20
    assert all(len(out) >= 20 for out in plain["min-new-tokens"])


@torch.no_grad()
def offline_penalised_sample(target, prompt: list[int], first: int, count: int) -> list[int]:
    """The target alone, penalised as SGLang's penalizers do (output counts cumulated one
    token at a time, ``(0 - frequency) - presence`` added, then the repetition scaling), then
    SGLang's sampling rule with DDTREE's coin for each position. Token 0 is the prefill's."""
    tokens = [first]
    seed = torch.tensor([SAMPLED["sampling_seed"]])
    for i in range(1, count):
        logits = target(torch.tensor([prompt + tokens])).logits[0, -1].float()
        frequency = torch.zeros_like(logits)
        repetition = torch.ones_like(logits)
        for token in tokens:
            frequency[token] += torch.tensor(SAMPLED["frequency_penalty"])
            repetition[token] = SAMPLED["repetition_penalty"]
        penalised = logits + (0.0 - frequency)
        penalised = torch.where(penalised < 0, penalised * repetition, penalised / repetition)
        probs = target_probs(
            penalised[None], SAMPLED["temperature"], SAMPLED["top_k"], SAMPLED["top_p"]
        )[0]
        coin = counter_uniforms(seed, torch.tensor([[len(prompt) + i - 1]]))[0, 0]
        cdf = probs.double().cumsum(0)
        tokens.append(int(torch.searchsorted(cdf, coin * cdf[-1], right=True)))
    return tokens


def test_ddtree_sampling_with_penalties_is_the_target_alone(served, prompts, pair):
    """Seeded sampling with repetition and frequency penalties through the tree equals an
    offline computation of the target's own penalised draws with the same coins."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()
    for prompt, reply in zip(prompts[:2], served["ddtree/sampled"], strict=True):
        served_ids = reply["output_ids"]
        assert len(served_ids) > 1
        assert served_ids == offline_penalised_sample(
            target, prompt, served_ids[0], len(served_ids)
        )
