"""A speculative step's accepted run finishes a request exactly where one-token decoding would.

SGLang's ``Req.update_finish_state(new_accepted_len)`` checks a run at once: on 0.5.17 the
length first (a run crossing ``max_new_tokens`` runs past a stop string), on both releases stop
strings before stop tokens (EOS before a stop string in the run is missed). The plugin's hook
(``plugin/finish.py``, diff 0015) checks the run token by token. Here a real ``Req`` of the
installed SGLang, with a real tokenizer, is fed the same tokens one at a time and in runs.
"""

from __future__ import annotations

import inspect
import random

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR
from sglang_tree_spec.plugin.finish import update_finish_state_token_by_token

EOS = 0


def sglang_check(req: Req, length: int) -> None:
    """SGLang's own ``Req.update_finish_state``, unwrapped: a test in the same process may
    have registered the plugin's hooks, which wrap it (SGLang keeps ``__wrapped__``)."""
    inspect.unwrap(Req.update_finish_state)(req, length)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(str(SMALL_PAIR_DIR / "target"))  # as the scheduler loads it


def new_req(tokenizer, **params) -> Req:
    sampling = SamplingParams(**params)
    sampling.normalize(tokenizer)
    req = Req("rid", "", [1, 2, 3], sampling, eos_token_ids={EOS}, vocab_size=len(tokenizer))
    req.tokenizer = tokenizer
    return req


def finish(req: Req) -> tuple:
    reason = req.finished_reason
    kept = req.output_ids[: req.finished_len] if req.finished_len is not None else req.output_ids
    return type(reason).__name__ if reason else None, getattr(reason, "matched", None), list(kept)


def decode(tokenizer, params: dict, tokens: list[int], runs: list[int], check) -> tuple:
    """Feed ``tokens`` in runs of the given lengths (until the request finishes), each run
    appended then checked with ``check(req, run_length)``; returns the finish."""
    req = new_req(tokenizer, **params)
    position = 0
    for length in runs:
        req.output_ids.extend(tokens[position : position + length])
        position += length
        check(req, length)
        if req.finished():
            break
    return finish(req)


def one_at_a_time(tokenizer, params, tokens):
    return decode(tokenizer, params, tokens, [1] * len(tokens), sglang_check)


def hooked(req, length):
    update_finish_state_token_by_token(inspect.unwrap(Req.update_finish_state), req, length)


def stop_string_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_run_crossing_max_new_tokens_stops_at_the_stop_string_inside_it(tokenizer):
    stop = stop_string_tokens(tokenizer, "xyz")
    tokens = [40, 41, *stop, 42, 43, 44, 45]
    params = {"max_new_tokens": len(stop) + 4, "stop": ["xyz"]}
    expected = one_at_a_time(tokenizer, params, tokens)
    assert expected[0] == "FINISH_MATCHED_STR" and expected[2] == tokens[: 2 + len(stop)]
    assert decode(tokenizer, params, tokens, [1, len(tokens) - 1], hooked) == expected


def test_eos_before_a_stop_string_in_one_run_stops_at_the_eos(tokenizer):
    stop = stop_string_tokens(tokenizer, "xyz")
    tokens = [40, EOS, *stop, 42]
    params = {"max_new_tokens": 32, "stop": ["xyz"]}
    expected = one_at_a_time(tokenizer, params, tokens)
    assert expected == ("FINISH_MATCHED_TOKEN", EOS, [40, EOS])
    assert decode(tokenizer, params, tokens, [1, len(tokens) - 1], hooked) == expected
    # SGLang's own whole-run check (both releases) ends at the stop string instead.
    whole = decode(tokenizer, params, tokens, [1, len(tokens) - 1], sglang_check)
    assert whole != expected


def test_runs_of_random_lengths_finish_as_one_token_decoding(tokenizer):
    """Random outputs over a few tokens (stop strings, stop ids and EOS among them), random
    max_new_tokens, cut into random runs: the hooked run-wise finish equals the one-token one."""
    rng = random.Random(0)
    pieces = [stop_string_tokens(tokenizer, s) for s in ("ab", "c", "xyz")]
    alphabet = [40, 41, 42, EOS, 7] + [t for piece in pieces for t in piece]
    differing = 0
    for case in range(300):
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 24))]
        params = {
            "max_new_tokens": rng.randint(1, 24),
            "stop": rng.sample(["ab", "c", "xyz"], rng.randint(0, 2)),
            "stop_token_ids": rng.sample([7, 41], rng.randint(0, 1)),
            "ignore_eos": rng.random() < 0.1,
        }
        runs = []
        while sum(runs) < len(tokens):
            runs.append(min(rng.randint(1, 6), len(tokens) - sum(runs)))
        expected = one_at_a_time(tokenizer, params, tokens)
        assert decode(tokenizer, params, tokens, runs, hooked) == expected, (case, params, tokens)
        differing += decode(tokenizer, params, tokens, runs, sglang_check) != expected
    assert differing > 0  # the cases reach what SGLang's whole-run check gets wrong


def test_single_tokens_and_grammar_runs_go_to_sglang_unchanged(tokenizer):
    calls = []

    def original(req, length):
        calls.append(length)

    req = new_req(tokenizer, max_new_tokens=8)
    req.output_ids.extend([40, 41, 42])
    update_finish_state_token_by_token(original, req, 1)
    req.grammar = object()
    update_finish_state_token_by_token(original, req, 3)
    assert calls == [1, 3]
