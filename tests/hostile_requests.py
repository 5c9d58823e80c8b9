"""Hostile requests through the HTTP API (issue 19), sent to a real server by the server tests.

Each must be answered with a 4xx that gives the reason, and the server must keep serving: after
every one, a reference request still gets the output it got before. Input ids outside
``[0, vocab_size)`` are refused by the plugin's admission hook (diff 0014); before it, one such
request killed the scheduler. A prompt of no tokens is refused by its other admission hook (diff
0016): on SGLang 0.5.23 an empty ``text`` (which 0.5.17 refuses itself) killed the scheduler, and
on both releases an empty text or ``input_ids`` inside a batch killed it or was answered from
another prompt's hidden state. The rest are SGLang's own refusals.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

GREEDY = {"temperature": 0.0, "max_new_tokens": 4}
NON_UTF8_CHAT = b'{"model": "default", "messages": [{"role": "user", "content": "\xff\xfe"}]}'


@dataclass(frozen=True)
class Hostile:
    name: str
    path: str
    body: dict | bytes  # bytes are sent as they are
    reason: str  # a piece of the reply's message


def hostile_requests(vocab_size: int) -> list[Hostile]:
    """The requests of issue 19 for a model of ``vocab_size`` token ids."""

    def bad_id(token: int, position: int) -> str:
        return (
            f"input id {token} at position {position} is not in the vocabulary: "
            f"valid token ids are [0, {vocab_size})"
        )

    def ids(*input_ids: object, **sampling: object) -> dict:
        return {"input_ids": list(input_ids), "sampling_params": {**GREEDY, **sampling}}

    def completion(prompt: object) -> dict:
        return {"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0}

    def chat(role: str) -> dict:
        return {"model": "default", "messages": [{"role": role, "content": "hi"}]}

    return [
        Hostile("out of vocabulary", "/generate", ids(5, 999999, 3), bad_id(999999, 1)),
        Hostile("negative id", "/generate", ids(5, -1, 3), bad_id(-1, 1)),
        Hostile("id = vocab size", "/generate", ids(vocab_size, 5), bad_id(vocab_size, 0)),
        Hostile("batch with a bad id", "/generate", ids([5, 6], [5, 6, -3]), bad_id(-3, 2)),
        Hostile("completion ids", "/v1/completions", completion([5, 999999, 3]), bad_id(999999, 1)),
        Hostile(
            "completion batch", "/v1/completions", completion([[5, 6], [-2, 5]]), bad_id(-2, 0)
        ),
        Hostile(
            "empty text", "/generate", {"text": "", "sampling_params": GREEDY}, "cannot be empty"
        ),
        Hostile("empty ids", "/generate", ids(), "cannot be empty"),
        Hostile("batch with empty ids", "/generate", ids([5, 6], []), "cannot be empty"),
        Hostile(
            "batch with an empty text",
            "/generate",
            {"text": ["a b", ""], "sampling_params": GREEDY},
            "cannot be empty",
        ),
        Hostile("empty completion", "/v1/completions", completion(""), "cannot be empty"),
        Hostile(
            "completion batch with empty ids",
            "/v1/completions",
            completion([[5, 6], []]),
            "cannot be empty",
        ),
        Hostile(
            "completion batch with an empty text",
            "/v1/completions",
            completion(["a b", ""]),
            "cannot be empty",
        ),
        Hostile("past the context", "/generate", ids(5, 6, max_new_tokens=10**6), "context length"),
        Hostile("malformed JSON", "/generate", b'{"input_ids": [5, 6], "sam', "JSON decode error"),
        Hostile("non-UTF-8 text", "/generate", b'{"text": "a \xff\xfe b"}', "not valid UTF-8"),
        Hostile("non-UTF-8 chat", "/v1/chat/completions", NON_UTF8_CHAT, "not valid UTF-8"),
        Hostile("bad chat role", "/v1/chat/completions", chat("wizard"), "'role' must be"),
    ]


def refusal(base_url: str, request: Hostile, timeout: float = 120.0) -> tuple[int, str]:
    """POST ``request``; its HTTP error status and reply (a success fails the test)."""
    data = request.body if isinstance(request.body, bytes) else json.dumps(request.body).encode()
    post = urllib.request.Request(
        f"{base_url}{request.path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(post, timeout=timeout) as reply:
            raise AssertionError(f"{request.name}: accepted ({reply.status}): {reply.read()!r}")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except OSError as error:  # refused, reset or timed out: the server is gone
        raise AssertionError(f"{request.name}: no reply, the server is gone") from error


def assert_refused_and_still_serving(
    base_url: str,
    vocab_size: int,
    reference: Callable[[], object],
    extra: tuple[Hostile, ...] = (),
) -> None:
    """Every hostile request (and every one of ``extra``) gets a 4xx naming its reason; after
    each, ``reference()`` returns what it returned before them all."""
    expected = reference()
    for request in [*hostile_requests(vocab_size), *extra]:
        status, message = refusal(base_url, request)
        assert 400 <= status < 500, (request.name, status, message)
        assert request.reason in message, (request.name, message)
        try:
            after = reference()
        except OSError as error:  # refused, reset or timed out: the server is gone
            raise AssertionError(f"the server stopped serving after: {request.name}") from error
        assert after == expected, request.name
