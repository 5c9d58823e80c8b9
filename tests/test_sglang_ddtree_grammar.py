"""Grammar-constrained requests through DDTREE, a real SGLang server on CPU: exact.

One no-speculation server (synchronous) and two DDTREE servers (budget 8 synchronous; budget
control up to 16 under SGLang's overlap scheduler, ``SGLANG_TREE_SPEC_CPU_OVERLAP=1``, whose
plain steps run one forward each) on the small fp32 pair of ``test_sglang_ddtree`` answer the
same greedy requests: a JSON schema, a regex, an EBNF grammar and a structural tag on
``/generate``, and an OpenAI ``response_format`` JSON schema on ``/v1/chat/completions``; one at
a time, then all at once with an unconstrained request in the same batch. Outputs equal token for
token, and the trees accepted more than one token per verify. A JSON-schema request with
``return_logprob`` gets the no-speculation log-probs. An invalid regex or schema gets SGLang's
own error and the server keeps serving.

Both releases; on 0.5.17 the plain server serves grammars on a CPU through the plugin's xgrammar
hooks (``plugin/cpu.py``, diffs 0024 and 0025). About 5 minutes on 2 quiet cores (12 on 2 busy
ones).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_sglang_ddtree
from hostile_requests import Hostile, refusal
from test_sglang_ddtree import running_server, server_command

from sglang_tree_spec.plugin.validation import CPU_OVERLAP_ENV
from sglang_tree_spec.server_process import free_port, http_json

pair = test_sglang_ddtree.pair  # the module fixtures: the small fp32 pair, held-out prompts
prompts = test_sglang_ddtree.prompts

NEW_TOKENS = 20
LOGPROB_TOLERANCE = 1e-4  # float32 logits: a tree verify and a one-token decode differ in ulps
TOP_LOGPROBS = 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}
CONSTRAINTS = {
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "regex": {"regex": r"(def|class) [a-z_]{1,12}\((self)?\):( [a-z]{1,8})*"},
    "ebnf": {"ebnf": 'root ::= "x = " num (" + " num)*\nnum ::= [1-9][0-9]{0,3}'},
    "structural_tag": {
        "structural_tag": json.dumps(
            {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": SCHEMA}}
        )
    },
}
CHAT = [{"role": "user", "content": "def parse_header(line):\n    name, _, value ="}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}


def generate(base_url: str, prompt: list[int], constraint: dict, **request: object) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, **constraint}
    body = {"input_ids": prompt, "sampling_params": params, **request}
    return http_json(f"{base_url}/generate", body, timeout=300)


def logprobs(base_url: str, prompts: list[list[int]]) -> dict:
    """The JSON-schema request with ``return_logprob`` and ``top_logprobs_num``."""
    return generate(
        base_url,
        prompts[0],
        CONSTRAINTS["json_schema"],
        return_logprob=True,
        top_logprobs_num=TOP_LOGPROBS,
    )


def chat(base_url: str) -> dict:
    body = {
        "model": "default",
        "messages": CHAT,
        "temperature": 0,
        "max_tokens": NEW_TOKENS,
        "response_format": RESPONSE_FORMAT,
    }
    return http_json(f"{base_url}/v1/chat/completions", body, timeout=300)


def requests(prompts: list[list[int]]) -> list[tuple[str, list[int], dict]]:
    """``(label, prompt, constraint)``: each grammar kind, then unconstrained, on one prompt."""
    kinds = [(kind, prompts[0], constraint) for kind, constraint in CONSTRAINTS.items()]
    return [*kinds, ("free", prompts[0], {})]


def ask(base_url: str, prompts: list[list[int]]) -> dict:
    """Every request one at a time (``alone``), then all at once with the chat request
    (``mixed``): each reply's output ids (the chat's text) and metadata."""
    cases = requests(prompts)
    alone = {label: generate(base_url, p, c) for label, p, c in cases}
    alone["chat"] = chat(base_url)
    with ThreadPoolExecutor(len(cases) + 1) as pool:
        futures = {label: pool.submit(generate, base_url, p, c) for label, p, c in cases}
        futures["chat"] = pool.submit(chat, base_url)
        mixed = {label: future.result() for label, future in futures.items()}
    return {"alone": alone, "mixed": mixed}


def outputs(replies: dict) -> dict:
    return {
        label: reply["choices"][0]["message"]["content"] if label == "chat" else reply["output_ids"]
        for label, reply in replies.items()
    }


SERVERS = {
    "ddtree-8": (8, None, False),
    "ddtree-auto-overlap": (16, "auto", True),
}


@pytest.fixture(scope="module")
def served(pair, prompts, tmp_path_factory) -> Iterator[dict]:
    import sglang  # noqa: F401  (fail, not skip, without SGLang)

    root = tmp_path_factory.mktemp("grammar")
    replies: dict = {}
    plain = [*server_command(pair, free_port(), None), "--disable-overlap-schedule"]
    for server in running_server(plain, root / "plain.log"):
        replies["plain"] = ask(server.base_url, prompts)
        replies["plain/logprobs"] = logprobs(server.base_url, prompts)
    for name, (budget, mode, overlap) in SERVERS.items():
        with pytest.MonkeyPatch.context() as env:
            if overlap:
                env.setenv(CPU_OVERLAP_ENV, "1")
            command = server_command(pair, free_port(), budget, mode)
            for server in running_server(command, root / f"{name}.log"):
                replies[name] = ask(server.base_url, prompts)
                replies[f"{name}/logprobs"] = logprobs(server.base_url, prompts)
                invalid_grammars_are_refused(server, prompts, replies["plain"])
                replies[f"{name}/log"] = server.log.read_text()
    yield replies


def invalid_grammars_are_refused(server, prompts, plain: dict) -> None:
    """An invalid regex or JSON schema: SGLang's own 400, and the server keeps serving
    (a constrained request between and after them gets the no-speculation output)."""
    bad = [
        Hostile(
            "invalid regex",
            "/generate",
            {"input_ids": prompts[0], "sampling_params": {"regex": "(unclosed"}},
            "Failed to compile regex grammar",
        ),
        Hostile(
            "invalid json_schema",
            "/generate",
            {"input_ids": prompts[0], "sampling_params": {"json_schema": "{not json"}},
            "Failed to compile json grammar",
        ),
    ]
    expected = plain["alone"]["json_schema"]["output_ids"]

    def reference() -> list[int]:
        output = generate(server.base_url, prompts[0], CONSTRAINTS["json_schema"])["output_ids"]
        assert output == expected
        return output

    reference()
    for request in bad:
        status, message = refusal(server.base_url, request)
        assert status == 400 and request.reason in message, (request.name, status, message)
        reference()


@pytest.mark.parametrize("name", sorted(SERVERS))
@pytest.mark.parametrize("when", ["alone", "mixed"])
def test_constrained_greedy_equals_no_speculation(served, name, when):
    assert outputs(served[name][when]) == outputs(served["plain"]["alone"])
    assert outputs(served["plain"][when]) == outputs(served["plain"]["alone"])


def assert_close_logprobs(plain: list, ddtree: list) -> None:
    """``[[logprob, token id, text], ...]`` lists: same ids, log-probs within tolerance (a
    token the grammar forbids: -inf, or None where the reply's JSON cannot hold it, in both)."""
    assert [entry[1] for entry in ddtree] == [entry[1] for entry in plain]
    for (want, _, _), (got, _, _) in zip(plain, ddtree, strict=True):
        if want is None or got is None or math.isinf(want):
            assert got == want
        else:
            assert math.isclose(got, want, rel_tol=0, abs_tol=LOGPROB_TOLERANCE), (got, want)


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_constrained_logprobs_equal_no_speculation(served, name):
    """``return_logprob`` on a JSON-schema request: the same tokens, and every committed
    token's log-prob and top log-probs (of the grammar-masked distribution, as SGLang's own
    decoding reports them) within tolerance of the no-speculation server's."""
    plain, ddtree = served["plain/logprobs"], served[f"{name}/logprobs"]
    expected = served["plain"]["alone"]["json_schema"]["output_ids"]
    assert ddtree["output_ids"] == plain["output_ids"] == expected
    want, got = plain["meta_info"], ddtree["meta_info"]
    assert len(got["output_token_logprobs"]) == len(ddtree["output_ids"])
    assert_close_logprobs(want["output_token_logprobs"], got["output_token_logprobs"])
    assert len(got["output_top_logprobs"]) == len(want["output_top_logprobs"])
    for plain_top, ddtree_top in zip(
        want["output_top_logprobs"], got["output_top_logprobs"], strict=True
    ):
        assert_close_logprobs(plain_top, ddtree_top)


def test_constraints_shape_the_output(served):
    """Not vacuous: every constrained output differs from the same prompt's unconstrained one,
    the regex's starts as the regex says, and a finished JSON one parses to the schema's keys."""
    plain = served["plain"]["alone"]
    for kind in CONSTRAINTS:
        assert plain[kind]["output_ids"] != plain["free"]["output_ids"], kind
    for label in ("json_schema", "structural_tag"):
        if plain[label]["meta_info"]["finish_reason"]["type"] == "stop":
            assert set(json.loads(plain[label]["text"])) == {"name", "count"}
    assert plain["regex"]["text"].split(" ")[0] in ("def", "class")
    assert plain["ebnf"]["text"].startswith("x = ")


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_constrained_trees_accept_more_than_one_token(served, name):
    """The trees were verified under the grammar: more tokens than verifies (budget control's
    server runs mostly plain steps on these short requests, its trees while it profiles)."""
    replies = [reply for label, reply in served[name]["alone"].items() if label in CONSTRAINTS]
    tokens = sum(reply["meta_info"]["completion_tokens"] - 1 for reply in replies)
    verifies = sum(reply["meta_info"]["spec_verify_ct"] for reply in replies)
    assert tokens / verifies > (1.2 if SERVERS[name][1] is None else 1.0)
    log = served[f"{name}/log"]
    assert ("overlap scheduling on" in log) == SERVERS[name][2]
