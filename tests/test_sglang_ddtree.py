"""DDTREE served by a real SGLang 0.5.17 on CPU equals SGLang without speculation.

The unmodified ``python -m sglang.launch_server`` (and ``sglang.Engine``) with
``--speculative-algorithm DDTREE`` and the project's small DFlash pair (committed weights,
served in float32): greedy output equals the no-speculation server token for token on 24
held-out prompts, one request at a time and 8 at once, at tree budgets 8 and 32. Also:
``/v1/chat/completions``, seeded sampling, the accept length in the metadata and the log, a
stream aborted mid-way, the same equality with grafting on, and (SGLang 0.5.23) a DFlash2
drafter. Penalties, ``min_new_tokens``
and ``return_logprob`` are tests/test_sglang_ddtree_params.py's. The CPU pieces (tree-verify
attention, KV moves, slot writes) come from this package's hooks; nothing else is patched.
"""

from __future__ import annotations

import ast
import csv
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch
from benchmark_helpers import load_benchmark
from hostile_requests import assert_refused_and_still_serving
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from sglang_tree_spec.control import AUTO, REASONS
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts
from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.step_clock import SKEW_ENV
from sglang_tree_spec.plugin.worker import PIN_ENV_FLAG, PIN_PARAM
from sglang_tree_spec.server_process import (
    ServerStartError,
    ddtree_metrics,
    free_port,
    http_json,
    launch,
    stop,
    wait_until_healthy,
)
from sglang_tree_spec.step_times import LOG_ENV_FLAG
from sglang_tree_spec.tree import counter_uniforms, target_probs

PROMPT_COUNT = 24
PROMPT_TOKENS = 96
NEW_TOKENS = 32
BUDGETS = (8, 32)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHAT = [{"role": "user", "content": "def parse_header(line):\n    name, _, value ="}]


def float32_copy(src: Path, dst: Path, chat_template: str | None = None) -> Path:
    """``src`` checkpoint with float32 weights and config (SGLang serves it in float32)."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    save_file({k: v.float().contiguous() for k, v in load_file(weights).items()}, weights)
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if chat_template is not None:
        tokenizer_config = dst / "tokenizer_config.json"
        settings = json.loads(tokenizer_config.read_text())
        settings["chat_template"] = chat_template
        tokenizer_config.write_text(json.dumps(settings, indent=2))
    return dst


def server_command(
    pair: dict[str, Path], port: int, budget: int | None, mode: str | None = None
) -> list[str]:
    """The unmodified CPU launch command, plus the DDTREE flags when ``budget`` is given: that
    budget every step, or (``mode="auto"``) budget control up to it."""
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(pair["target"]),
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--dtype", "float32",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-total-tokens", "8192",
        "--max-running-requests", "8",
        "--random-seed", "0",
        "--decode-log-interval", "5",
        "--log-level", "info",
        "--sleep-on-idle",  # an idle CPU scheduler otherwise spins a core the other tests need
    ]  # fmt: skip
    if budget is not None:
        command += [
            "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", str(pair["drafter"]),
            "--speculative-num-draft-tokens", str(budget + 1),
            "--speculative-ddtree-budget", mode or str(budget),
        ]  # fmt: skip
    return command


class Server:
    """A running server: base URL and log; greedy generation at a given concurrency."""

    def __init__(self, base_url: str, log: Path) -> None:
        self.base_url, self.log = base_url, log

    def generate(self, prompt: list[int], **sampling: object) -> dict:
        params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, **sampling}
        return http_json(
            f"{self.base_url}/generate",
            {"input_ids": prompt, "sampling_params": params},
            timeout=300,
        )

    def greedy(self, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
        return [reply["output_ids"] for reply in self.greedy_replies(prompts, concurrency)]

    def greedy_replies(self, prompts: list[list[int]], concurrency: int) -> list[dict]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(self.generate, prompts))

    def fill_context(self, requests: list[tuple[list[int], int]]) -> list[list[int]]:
        """Greedy outputs of ``(prompt, new tokens)`` requests, EOS ignored, all at once."""
        with ThreadPoolExecutor(len(requests)) as pool:
            replies = pool.map(
                lambda item: self.generate(item[0], max_new_tokens=item[1], ignore_eos=True),
                requests,
            )
            return [reply["output_ids"] for reply in replies]

    def chat(self) -> str:
        reply = http_json(
            f"{self.base_url}/v1/chat/completions",
            {"model": "default", "messages": CHAT, "temperature": 0, "max_tokens": NEW_TOKENS},
            timeout=300,
        )
        return reply["choices"][0]["message"]["content"]


def running_server(command: list[str], log: Path) -> Iterator[Server]:
    process = launch(command, log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        wait_until_healthy(base_url, process, log)
        yield Server(base_url, log)
    finally:
        stop(process)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pair-fp32")
    return {
        "target": float32_copy(SMALL_PAIR_DIR / "target", root / "target", CHAT_TEMPLATE),
        "drafter": float32_copy(SMALL_PAIR_DIR / "drafter", root / "drafter"),
    }


@pytest.fixture(scope="module")
def prompts(pair: dict[str, Path]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    texts = heldout_prompts(PROMPT_COUNT)
    return [tokenizer.encode(text, add_special_tokens=False)[-PROMPT_TOKENS:] for text in texts]


@pytest.fixture(scope="module")
def context_filling(pair: dict[str, Path]) -> list[tuple[list[int], int]]:
    """``(prompt, new tokens)`` pairs of context - 1 tokens in all: with EOS ignored they run
    to SGLang's length limit, so their last decode steps reserve KV slots up to the end of
    the request's ``req_to_token`` row."""
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    context = json.loads((pair["target"] / "config.json").read_text())["max_position_embeddings"]
    text = "\n\n".join(heldout_prompts(PROMPT_COUNT))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) >= context
    return [(tokens[-(context - 1 - new) :], new) for new in (6, 13, 23)]


def stop_cases(
    tokenizer: AutoTokenizer, prompts: list[list[int]], outputs: list[list[int]]
) -> list[tuple[list[int], dict]]:
    """Greedy requests that stop inside the output: a stop string completed a few tokens
    before ``max_new_tokens`` (one accepted run can cross both), and a stop token followed by
    a stop string (one run can hold both), taken from the no-speculation outputs."""
    cases = []
    for prompt, output in zip(prompts[:8], outputs[:8], strict=True):
        for k in (6, 13, 20, 27):
            text = tokenizer.decode(output[k - 1 : k + 1])
            if text.strip() and "\ufffd" not in text:
                cases.append((prompt, {"stop": [text], "max_new_tokens": k + 3}))
            after = tokenizer.decode(output[k + 1 : k + 3])
            if after.strip() and "\ufffd" not in after:
                cases.append((prompt, {"stop_token_ids": [output[k]], "stop": [after]}))
    return cases


def stop_replies(server: Server, cases: list[tuple[list[int], dict]]) -> list[tuple]:
    """Each case's output and finish reason, 8 at once."""
    with ThreadPoolExecutor(8) as pool:
        replies = pool.map(lambda case: server.generate(case[0], **case[1]), cases)
        return [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in replies]


@pytest.fixture(scope="module")
def baseline(pair, prompts, context_filling, tmp_path_factory) -> dict[str, object]:
    """No speculation: greedy outputs one at a time and 8 at once, the chat reply, the
    outputs that fill the context, and the stop cases made from the first outputs."""
    import sglang  # noqa: F401  (fail, not skip, without SGLang)

    log = tmp_path_factory.mktemp("baseline") / "server.log"
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    for server in running_server(server_command(pair, free_port(), None), log):
        sequential = server.greedy(prompts, 1)
        cases = stop_cases(tokenizer, prompts, sequential)
        return {
            "sequential": sequential,
            "concurrent": server.greedy(prompts, 8),
            "chat": server.chat(),
            "to_context": server.fill_context(context_filling),
            "stop_cases": cases,
            "stops": stop_replies(server, cases),
        }
    raise AssertionError("unreachable")


# budget 32 runs on the first release only (``one_release``): budget 8 covers the hooks
SERVED_BUDGETS = [
    BUDGETS[0],
    *(pytest.param(b, marks=pytest.mark.one_release) for b in BUDGETS[1:]),
]


@pytest.fixture(scope="module", params=SERVED_BUDGETS, ids=lambda b: f"budget{b}")
def ddtree_server(request, pair, baseline, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp(f"ddtree{request.param}") / "server.log"
    yield from running_server(server_command(pair, free_port(), request.param), log)


def test_baseline_outputs_do_not_depend_on_concurrency(baseline):
    assert baseline["concurrent"] == baseline["sequential"]


def test_ddtree_greedy_equals_no_speculation_one_at_a_time(ddtree_server, prompts, baseline):
    assert ddtree_server.greedy(prompts, 1) == baseline["sequential"]


# Mean tokens committed per verify (accepted drafts + the bonus) on the 24 equality prompts:
# 2.66 at budget 8 with the small pair (744 decoded tokens in 280 verifies); depth-1
# acceptance is at most 2, the DFlash chain about 2.2 (the demo's chain tau).
MIN_MEAN_ACCEPT_LENGTH = 2.4


def test_ddtree_greedy_equals_no_speculation_eight_at_once(ddtree_server, prompts, baseline):
    replies = ddtree_server.greedy_replies(prompts, 8)
    assert [reply["output_ids"] for reply in replies] == baseline["sequential"]
    # The first token of each request comes from the prefill, not from a verify.
    tokens = sum(reply["meta_info"]["completion_tokens"] - 1 for reply in replies)
    verifies = sum(reply["meta_info"]["spec_verify_ct"] for reply in replies)
    assert tokens / verifies > MIN_MEAN_ACCEPT_LENGTH  # deep trees, not depth-1 acceptance


def test_ddtree_stops_where_no_speculation_stops(ddtree_server, baseline):
    """Stop strings and stop tokens inside one accepted run finish as one-token decoding does
    (hook 0015): same output and finish reason as no speculation."""
    assert len(baseline["stop_cases"]) >= 40
    near_the_end = [  # stopped by a string two tokens before max_new_tokens
        output
        for (_, params), (output, reason) in zip(
            baseline["stop_cases"], baseline["stops"], strict=True
        )
        if reason["type"] == "stop" and len(output) == params.get("max_new_tokens", 0) - 2
    ]
    assert len(near_the_end) >= 8
    assert stop_replies(ddtree_server, baseline["stop_cases"]) == baseline["stops"]


def test_ddtree_serves_requests_to_the_end_of_the_context(ddtree_server, context_filling, baseline):
    """A step reserves 2 x (budget + 1) KV slots past the committed tokens (18 at budget 8,
    66 at 32), more than SGLang's default row headroom of 4 + budget + 1: the row holds them
    (hook 0012), the server stays up and the outputs are the target's."""
    assert ddtree_server.fill_context(context_filling) == baseline["to_context"]
    # EOS ignored, each request runs until SGLang's length limit (one token short of the
    # context here): the last steps start within a window of the row's end.
    assert [len(out) for out in baseline["to_context"]] == [n - 1 for _, n in context_filling]
    http_json(f"{ddtree_server.base_url}/health", timeout=30)


def test_ddtree_refuses_hostile_requests_and_keeps_serving(ddtree_server, pair, prompts, baseline):
    """Issue 19 under DDTREE: an input id outside the vocabulary (or negative) killed the
    server, and (issue 66) so did a prompt of no tokens
    (an empty text on 0.5.23); now every hostile request gets a 4xx, and a greedy request
    before, between and after them gets the no-speculation output."""
    vocab = json.loads((pair["target"] / "config.json").read_text())["vocab_size"]
    expected = baseline["sequential"][0][:8]

    def reference() -> list[int]:
        output = ddtree_server.generate(prompts[0], max_new_tokens=8)["output_ids"]
        assert output == expected
        return output

    assert_refused_and_still_serving(ddtree_server.base_url, vocab, reference)


def test_ddtree_accepts_more_than_one_token_per_step(ddtree_server, prompts):
    meta = ddtree_server.generate(prompts[0])["meta_info"]
    assert meta["spec_verify_ct"] < meta["completion_tokens"]  # > 1 token per verify
    assert meta["spec_accept_length"] > 1.0
    assert "accept len:" in ddtree_server.log.read_text()  # the decode log line


def test_sglang_bench_serving_runs_against_ddtree(ddtree_server, pair, request, tmp_path):
    """SGLang's own client, ``python -m sglang.bench_serving``, from this environment (its
    ``datasets`` import included) against a DDTREE server: every request completes and the
    server's accept length comes back in its record."""
    if request.node.callspec.params["ddtree_server"] != BUDGETS[0]:
        pytest.skip("one budget is enough for the client")
    out = tmp_path / "bench.jsonl"
    subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
         "--base-url", ddtree_server.base_url, "--dataset-name", "random-ids",
         "--num-prompts", "8", "--random-input-len", "48", "--random-output-len", "16",
         "--tokenizer", str(pair["target"]), "--max-concurrency", "4",
         "--output-file", str(out), "--disable-tqdm"],
        check=True, timeout=600, capture_output=True,
    )  # fmt: skip
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["completed"] == 8 and record["total_output_tokens"] > 0
    assert record["accept_length"] > 1.0 and record["median_itl_ms"] > 0


def test_ddtree_chat_completion_equals_no_speculation(ddtree_server, baseline):
    assert ddtree_server.chat() == baseline["chat"]


SEEDED = {"temperature": 0.7, "top_p": 0.9, "sampling_seed": 1234}


@pytest.fixture(scope="module")
def seeded_outputs() -> dict[str, list[int]]:
    """Seeded sampled output of ``prompts[1]`` by server, filled as the servers run."""
    return {}


def test_ddtree_seeded_sampling_completes_and_reproduces(ddtree_server, prompts, seeded_outputs):
    """A seed pins the output, and the output does not depend on the tree budget: the coin
    of a token is keyed by its position, and the target samples, the tree only matches."""
    sampling = SEEDED
    first = ddtree_server.generate(prompts[1], **sampling)
    again = ddtree_server.generate(prompts[1], **sampling)
    other = ddtree_server.generate(prompts[1], **{**sampling, "sampling_seed": 99})
    greedy = ddtree_server.generate(prompts[1])
    assert len(first["output_ids"]) == NEW_TOKENS
    assert first["output_ids"] == again["output_ids"]
    assert other["output_ids"] != first["output_ids"] or first["output_ids"] != greedy["output_ids"]
    for earlier in seeded_outputs.values():  # the other budget's server, when it ran first
        assert first["output_ids"] == earlier
    seeded_outputs[ddtree_server.base_url] = first["output_ids"]


# Every filter of SGLang's sampler at once: the worker must read each per-request vector.
FILTERED = {"temperature": 0.8, "top_k": 6, "top_p": 0.85, "min_p": 0.05, "sampling_seed": 77}


@pytest.fixture(scope="module")
def offline_target(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()


@torch.no_grad()
def offline_sample(target, prompt: list[int], first: int, count: int, params: dict) -> list[int]:
    """The target alone under SGLang's sampling rule with DDTREE's coins: token ``i > 0`` is
    the inverse-CDF draw (token-id order) from :func:`target_probs` with coin
    ``counter_uniforms(seed, position of token i - 1)``. Token 0 is the prefill's (SGLang's
    own sampler), taken as served."""
    tokens = [first]
    seed = torch.tensor([params["sampling_seed"]])
    for i in range(1, count):
        logits = target(torch.tensor([prompt + tokens])).logits[:, -1]  # [1, V]
        probs = target_probs(
            logits, params["temperature"], params["top_k"], params["top_p"], params["min_p"]
        )[0]
        coin = counter_uniforms(seed, torch.tensor([[len(prompt) + i - 1]]))[0, 0]
        cdf = probs.double().cumsum(0)
        tokens.append(int(torch.searchsorted(cdf, coin * cdf[-1], right=True)))
    return tokens


def test_ddtree_seeded_sampling_is_the_target_alone(ddtree_server, prompts, offline_target):
    """Seeded sampling with temperature, top-k, top-p and min-p served through the tree equals
    an independent offline computation of the target's own draws with the same coins."""
    for prompt in prompts[:3]:
        served = ddtree_server.generate(prompt, **FILTERED)["output_ids"]
        assert len(served) > 1
        expected = offline_sample(offline_target, prompt, served[0], len(served), FILTERED)
        assert served == expected


def test_ddtree_server_survives_an_aborted_stream(ddtree_server, prompts, baseline):
    request = urllib.request.Request(
        f"{ddtree_server.base_url}/generate",
        data=json.dumps(
            {
                "input_ids": prompts[2],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 400},
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as stream:
        chunks = [stream.readline() for _ in range(6)]  # a few streamed events, then hang up
    assert any(chunk.startswith(b"data:") for chunk in chunks)
    http_json(f"{ddtree_server.base_url}/health", timeout=30)
    assert ddtree_server.greedy(prompts[:4], 4) == baseline["sequential"][:4]


def test_ddtree_under_kv_pressure_equals_no_speculation(pair, prompts, baseline, tmp_path_factory):
    """A KV pool too small for 8 running requests of budget 32 (each step reserves 66 slots
    per request): the scheduler retracts requests and re-prefills them later; every output is
    still the target's."""
    log = tmp_path_factory.mktemp("pressure") / "server.log"
    command = server_command(pair, free_port(), 32)
    command[command.index("--max-total-tokens") + 1] = "900"
    for server in running_server(command, log):
        assert server.greedy(prompts[:16], 8) == baseline["sequential"][:16]
    assert "Retract requests" in log.read_text()


def assert_metrics_count_one_request(server: Server, prompt: list[int], nested: bool) -> None:
    """``--enable-metrics``: the DDTREE series count exactly one lone request's decode steps
    (SGLang's own ``spec_verify_ct``), its drafted steps' accepted draft tokens, the predicted
    ones of the steps that calibrate (forecast steps, and with a ``nested`` DDTree one held step
    in ``ControlConfig.held_observe_every``; a grafted tree's held steps do not) and its timed step
    periods."""
    before = ddtree_metrics(server.base_url)
    reply = server.generate(prompt, max_new_tokens=40, ignore_eos=True)
    after = ddtree_metrics(server.base_url)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    steps = sum(v for k, v in delta.items() if k.startswith("steps_total{"))
    verify_ct = reply["meta_info"]["spec_verify_ct"]
    assert steps == verify_ct > 0
    # every decode step commits its accepted drafts plus one; the last may overshoot the cap
    drafted = reply["meta_info"]["completion_tokens"] - 1 - verify_ct
    assert delta["accepted_tokens_total"] <= drafted + 7  # the block's depth
    # (a plain run's probes may all fall outside one short request: then no forecast at all)
    assert 0 <= delta["verified_requests_total"] <= steps
    if delta["predicted_accept_tokens_total"] > 0:
        assert 0 < delta["calibrated_requests_total"] and delta["verified_requests_total"] > 0
        # a prediction is never exact on every step (its gap's interval: the squared errors)
        assert delta["calibrated_squared_error_total"] > 0
    if nested and delta["verified_requests_total"] >= AUTO["held_observe_every"]:
        assert delta["predicted_accept_tokens_total"] > 0
    # step times are periods from one decode step's start to the next: the last step's period
    # ends at the next prefill and is not one
    assert 0 < delta["timed_steps_total"] <= verify_ct - 1
    mean_period = delta["step_time_measured_seconds_total"] / delta["timed_steps_total"]
    assert 1e-4 < mean_period < 5.0  # a CPU step, in seconds
    assert delta["step_time_predicted_seconds_total"] > 0
    assert after["budget"] in (0, 4, 8, 16, 32)


@pytest.mark.one_release
def test_plain_steps_of_two_forwards_equal_no_speculation(
    pair, prompts, baseline, offline_target, tmp_path_factory
):
    """``--speculative-ddtree-budget 0``: every decode step is plain, ``control.PLAIN_FORWARDS``
    (2) target forwards, the second at the batch's lengths + 1 in the KV slot after the
    first's. Greedy equals no speculation one at a time and eight at once (31 tokens after
    the prefill's: the last step's second token is cut at the length limit), stop tokens and
    strings finish as one-token decoding does, and seeded sampling is the target alone."""
    log = tmp_path_factory.mktemp("plain") / "server.log"
    for server in running_server(server_command(pair, free_port(), 8, "0"), log):
        assert server.greedy(prompts, 1) == baseline["sequential"]
        assert server.greedy(prompts, 8) == baseline["sequential"]
        assert stop_replies(server, baseline["stop_cases"]) == baseline["stops"]
        for prompt in prompts[:2]:
            served = server.generate(prompt, **FILTERED)["output_ids"]
            expected = offline_sample(offline_target, prompt, served[0], len(served), FILTERED)
            assert served == expected


@pytest.mark.parametrize("graft", ["none", pytest.param("unified", marks=pytest.mark.one_release)])
def test_auto_budget_equals_no_speculation_and_every_fixed_budget(
    graft, pair, prompts, baseline, seeded_outputs, offline_target, tmp_path_factory, monkeypatch
):
    """``--speculative-ddtree-budget auto`` (the default): the batch's budget changes between
    steps (profiled, then chosen), and no token changes: greedy equals no speculation, and a
    seeded sample equals the fixed budgets' and the target alone's. ``SGLANG_TREE_SPEC_STEP_LOG``
    writes a line per decode step: held, forecast and plain steps at the candidates, with their
    phases under ``SGLANG_TREE_SPEC_STEP_TIMES``, the calibrated steps (one drafted step in
    ``ControlConfig.held_observe_every``; a grafted tree's forecast steps, every one) with their
    predicted and accepted draft tokens, and why each step has its budget. Under
    ``SGLANG_TREE_SPEC_PIN_BUDGET`` a request pins its batch's budget to one of the candidates
    (the benchmark's ``ddtree:auto/N``): those steps run that budget alone, logged apart, and
    no token changes; a pin outside the candidates is ignored with one warning."""
    log = tmp_path_factory.mktemp("auto") / "server.log"
    step_log = log.parent / "steps"
    monkeypatch.setenv("SGLANG_TREE_SPEC_STEP_LOG", str(step_log))
    monkeypatch.setenv("SGLANG_TREE_SPEC_STEP_TIMES", "1000000")  # phases in the log, no report
    monkeypatch.setenv(PIN_ENV_FLAG, "1")
    command = [*server_command(pair, free_port(), 32, "auto"), "--speculative-ddtree-graft", graft]
    command.append("--enable-metrics")
    for server in running_server(command, log):
        assert server.greedy(prompts, 8) == baseline["sequential"]
        assert_metrics_count_one_request(server, prompts[2], nested=graft == "none")
        assert server.greedy(prompts[:8], 1) == baseline["sequential"][:8]
        sampled = server.generate(prompts[1], **SEEDED)["output_ids"]
        for earlier in seeded_outputs.values():  # the fixed-budget servers of this module
            assert sampled == earlier
        served = server.generate(prompts[0], **FILTERED)["output_ids"]
        assert served == offline_sample(
            offline_target, prompts[0], served[0], len(served), FILTERED
        )
        with ThreadPoolExecutor(4) as pool:
            pinned = pool.map(partial(server.generate, custom_params={PIN_PARAM: 8}), prompts[:4])
            pinned = [reply["output_ids"] for reply in pinned]
            assert pinned == baseline["sequential"][:4]
            variant = pool.map(
                partial(server.generate, custom_params={PIN_PARAM: "auto:hard=0:hold=2"}),
                prompts[:4],
            )
            assert [reply["output_ids"] for reply in variant] == baseline["sequential"][:4]
        for bad in (5, "8", [8], "auto:nope=1", 5):
            reply = server.generate(prompts[1], custom_params={PIN_PARAM: bad})
            assert reply["output_ids"] == baseline["sequential"][1]
    text = log.read_text()
    assert text.count("is neither one of the server's budgets") == 4  # once each bad pin
    (pin_log,) = step_log.glob("steps_auto-pin8_*.csv")
    pin_steps = pin_log.read_text().splitlines()[1:]
    assert len(pin_steps) >= NEW_TOKENS // 8  # (bs, budget, drafted, forecast, ...)
    assert {tuple(line.split(",")[1:4]) for line in pin_steps} == {("8", "1", "0")}
    assert {line.split(",")[-1] for line in pin_steps} == {"fixed"}  # why: a fixed budget
    (variant_log,) = step_log.glob("steps_auto-pinauto_hard0_hold2_*.csv")
    variant_steps = [line.split(",") for line in variant_log.read_text().splitlines()[1:]]
    assert len({line[1] for line in variant_steps}) >= 3  # an auto of its own: its profile
    assert "auto over (0, 4, 8, 16, 32)" in text
    counts = re.findall(r"DDTREE budgets over \d+ steps: (\{[^}]*\})", text)
    assert counts and len(ast.literal_eval(counts[-1])) >= 3  # profiled, then chosen
    (path,) = step_log.glob("steps_auto_*.csv")
    table = load_benchmark("step_log_report").report(path)
    header, rows = table.splitlines()[1], table.splitlines()[3:]
    assert header.endswith("observe ms | predicted / accepted (request-steps) |"), table
    forecasts = [row for row in rows if row.startswith("| forecast |")]
    assert forecasts, table
    if graft == "none":  # a DDTree's calibration samples its drafted steps, forecast or held
        drafted = [row for row in rows if not row.startswith("| plain |")]
        assert any(not row.endswith("| - |") for row in drafted), table
    else:  # a grafted tree's: every forecast step
        assert not any(row.endswith("| - |") for row in forecasts), table
    kinds = {(row.split(" | ")[0][2:], int(row.split(" | ")[1])) for row in rows}
    assert {budget for _, budget in kinds} <= {0, 4, 8, 16, 32}
    assert {kind for kind, _ in kinds} == {"forecast", "held", "plain"}, table
    assert ("plain", 0) in kinds and all(b > 0 for k, b in kinds if k != "plain"), table
    with path.open() as f:  # why each step has its budget: profiled first, then forecasts
        reasons = [row["reason"] for row in csv.DictReader(f)]
    assert reasons[0] == "profile" and set(reasons) <= set(REASONS), set(reasons)
    assert {"arrivals", "expired"} & set(reasons), set(reasons)


@pytest.mark.parametrize("graft", ["unified", pytest.param("stage", marks=pytest.mark.one_release)])
def test_grafted_ddtree_greedy_equals_no_speculation(
    graft, pair, prompts, baseline, seeded_outputs, tmp_path_factory
):
    """``--speculative-ddtree-graft unified`` / ``stage``: a successor table shared by all
    requests, refreshed from every verify step, rewrites each tree; greedy output stays the
    target's, 8 requests at once, and a seeded sampled output is the same as without
    grafting."""
    log = tmp_path_factory.mktemp("graft") / "server.log"
    command = [*server_command(pair, free_port(), 16), "--speculative-ddtree-graft", graft]
    for server in running_server(command, log):
        assert server.greedy(prompts, 8) == baseline["sequential"]
        sampled = server.generate(prompts[1], **SEEDED)
        assert server.generate(prompts[1], **SEEDED)["output_ids"] == sampled["output_ids"]
        assert sampled["meta_info"]["spec_verify_ct"] < NEW_TOKENS
        for earlier in seeded_outputs.values():  # the ungrafted servers of this module
            assert sampled["output_ids"] == earlier
    assert f"graft {graft}" in log.read_text()


@pytest.mark.one_release
def test_a_token_map_drafts_from_its_ids_and_changes_no_token(
    pair, prompts, baseline, tmp_path_factory
):
    """``--speculative-token-map`` (SGLang's draft vocabulary flag): the draft top-K is taken
    over the map's ids only: with the ids the outputs use the drafter still gets tokens
    accepted, with none of them no draft token is; greedy output stays the target's. A map with
    ids outside the vocabulary stops the server at start-up with one ``DDTREE:`` line."""
    from sglang_tree_spec.models.token_map import frequency_token_map

    root = tmp_path_factory.mktemp("token-map")
    token_map = root / "map.pt"
    torch.save(frequency_token_map(prompts + baseline["sequential"], 512, 2048), token_map)
    command = [*server_command(pair, free_port(), 8), "--speculative-token-map", str(token_map)]
    for server in running_server(command, root / "server.log"):
        assert server.greedy(prompts[:8], 8) == baseline["sequential"][:8]
        meta = server.generate(prompts[0])["meta_info"]
        assert meta["spec_verify_ct"] < NEW_TOKENS - 1  # (the prefill makes the first token)
    assert f"drafts from {token_map} (512 ids a shard)" in (root / "server.log").read_text()
    produced = {token for output in baseline["sequential"] for token in output}
    torch.save([t for t in range(2048) if t not in produced], root / "never.pt")
    command = [
        *server_command(pair, free_port(), 8),
        "--speculative-token-map",
        str(root / "never.pt"),
    ]
    for server in running_server(command, root / "never.log"):  # no draft can be accepted
        outputs = [server.generate(prompt) for prompt in prompts[:2]]
        assert [out["output_ids"] for out in outputs] == baseline["sequential"][:2]
        assert [out["meta_info"]["spec_verify_ct"] for out in outputs] == [NEW_TOKENS - 1] * 2
    torch.save([3, 2048], root / "bad.pt")  # 2048 is past the small pair's vocabulary
    command = [
        *server_command(pair, free_port(), 8),
        "--speculative-token-map",
        str(root / "bad.pt"),
    ]
    with pytest.raises(ServerStartError, match=r"DDTREE: --speculative-token-map .* outside"):
        for _ in running_server(command, root / "bad.log"):
            pass


def _tp_replies(pair, prompts, log, budget, tp, extra=(), mode=None) -> list[dict]:
    """12 prompts, 4 at once, on a CPU server at ``--tp-size tp`` (one core per rank)."""
    cores = "|".join(str(rank) for rank in range(tp))  # SGLang's CPU core binding per rank
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_CPU_OMP_THREADS_BIND", cores)
        command = [*server_command(pair, free_port(), budget, mode), "--tp-size", str(tp)]
        for server in running_server([*command, *extra], log):
            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(server.generate, prompts[:12]))
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def none_tp2(pair, prompts, tmp_path_factory) -> list[list[int]]:
    """No speculation at TP 2 (TP changes the float reduction order, so TP 1 is not the
    reference for a TP 2 server)."""
    log = tmp_path_factory.mktemp("none-tp2") / "server.log"
    return [r["output_ids"] for r in _tp_replies(pair, prompts, log, None, 2)]


@pytest.mark.one_release
def test_ddtree_at_tp2_equals_no_speculation_at_tp2(pair, prompts, none_tp2, tmp_path_factory):
    """``--tp-size 2`` on CPU (gloo groups, one core per rank): the drafter's top-K is merged
    from the two vocabulary shards of the target's LM head. Grafted DDTREE output equals the
    no-speculation TP 2 server's, 4 requests at once; and it needs about as few verify steps
    as the same DDTREE at TP 1 (a top-K that missed a shard would draft worse, not
    differently)."""
    graft = ["--speculative-ddtree-graft", "unified"]
    replies, logs = {}, {}
    for name, tp in (("ddtree-tp2", 2), ("ddtree-tp1", 1)):
        logs[name] = tmp_path_factory.mktemp(name) / "server.log"
        replies[name] = _tp_replies(pair, prompts, logs[name], 8, tp, graft)
    assert [r["output_ids"] for r in replies["ddtree-tp2"]] == none_tp2
    steps = {name: sum(r["meta_info"]["spec_verify_ct"] for r in replies[name]) for name in logs}
    assert steps["ddtree-tp2"] < 0.6 * 12 * NEW_TOKENS
    assert steps["ddtree-tp2"] <= 1.1 * steps["ddtree-tp1"]
    log = logs["ddtree-tp2"].read_text()
    for rank in ("TP0", "TP1"):
        assert re.search(rf"{rank}\] DDTREE worker: .* over 2 vocabulary shard\(s\)", log)


def test_auto_at_tp2_chooses_one_budget_on_every_rank(
    pair, prompts, none_tp2, tmp_path_factory, monkeypatch
):
    """Budget control at TP 2 with rank 1's step clock skewed (20 ms slow a tree node, the
    test switch ``step_clock.SKEW_ENV``): both ranks learn from rank 0's step times, so they
    choose the same budget every step (different budgets are mismatched collectives, a hang
    on NCCL), auto does choose among budgets, and the output equals no speculation at TP 2."""
    steps = tmp_path_factory.mktemp("auto-tp2-steps")
    monkeypatch.setenv(SKEW_ENV, "1:0.02")
    monkeypatch.setenv(LOG_ENV_FLAG, str(steps))
    log = tmp_path_factory.mktemp("auto-tp2") / "server.log"
    replies = _tp_replies(pair, prompts, log, 32, 2, mode="auto")
    assert [r["output_ids"] for r in replies] == none_tp2
    logs = sorted(steps.glob("steps_auto_*.csv"))
    assert len(logs) == 2  # one per rank
    budgets = [[row["budget"] for row in csv.DictReader(path.open())] for path in logs]
    assert budgets[0] == budgets[1]
    assert len(set(budgets[0])) > 1


@pytest.mark.one_release
def test_ddtree_at_dp2_equals_no_speculation_on_both_replicas(
    pair, prompts, baseline, tmp_path_factory, monkeypatch
):
    """``--dp-size 2`` through SGLang's data-parallel controller: two scheduler processes, each
    with its own DDTREE worker (its own successor table and budget controller). 8 requests at
    once (round robin: 4 a replica) equal no speculation, and both replicas' workers drafted:
    one step log a worker process, each with verify steps committing over 1.5 tokens a
    request, and each replica's log names its worker."""
    steps = tmp_path_factory.mktemp("dp2-steps")
    monkeypatch.setenv(LOG_ENV_FLAG, str(steps))
    # SGLang's CPU core binding: 0.5.17 wants one entry a TP rank of a replica (unset: one
    # NUMA node), 0.5.23 one entry a rank of all replicas (unset: one NUMA node a rank)
    if compat.is_release("0.5.17"):
        monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    log = tmp_path_factory.mktemp("ddtree-dp2") / "server.log"
    command = [
        *server_command(pair, free_port(), 8), "--speculative-ddtree-graft", "unified",
        "--dp-size", "2",
    ]  # fmt: skip
    for server in running_server(command, log):
        outputs = server.greedy(prompts[:8], 8)
    assert outputs == baseline["concurrent"][:8]
    logs = sorted(steps.glob("steps_8_*.csv"))
    assert len(logs) == 2  # one a replica's worker process
    for path in logs:
        drafted = [row for row in csv.DictReader(path.open()) if row["drafted"] == "1"]
        assert drafted, path.name
        assert sum(int(r["tokens"]) for r in drafted) > 1.5 * sum(int(r["bs"]) for r in drafted)
    text = log.read_text()
    for replica in ("DP0", "DP1"):
        assert re.search(rf"{replica}\] DDTREE worker: ddtree-graft-unified, budget 8, ", text)


def test_engine_in_process_serves_ddtree(pair, prompts, baseline):
    """``sglang.Engine`` (the plugin loads through the entry point in every process), at a
    budget whose verify window is shorter than the drafter's block."""
    import sglang

    engine = sglang.Engine(
        model_path=str(pair["target"]),
        device="cpu",
        attention_backend="torch_native",
        dtype="float32",
        max_total_tokens=8192,
        max_running_requests=8,
        random_seed=0,
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=str(pair["drafter"]),
        speculative_num_draft_tokens=5,  # budget 4: the window is shorter than the block (8)
    )
    try:
        outputs = engine.generate(
            input_ids=prompts[:8],
            sampling_params={"temperature": 0.0, "max_new_tokens": NEW_TOKENS},
        )
    finally:
        engine.shutdown()
    assert [out["output_ids"] for out in outputs] == baseline["sequential"][:8]
    assert all(out["meta_info"]["spec_verify_ct"] < NEW_TOKENS for out in outputs)


DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 8}
# Verify steps the DFlash2 server may differ from the engine by, summed over its 8 requests (a
# near-tie may rank two drafts apart under SGLang's attention): 0 measured; drafting over
# blocks of the verify window's length instead of the drafter's block differed by 7.
DFLASH2_STEP_SLACK = 2


def dflash2_checkpoint(drafter: Path, out: Path) -> Path:
    """``drafter`` (a DFlash v1 checkpoint) as a DFlash2 one at ``out``: its weights, plus
    grouped dynamic convolutions around each layer's attention and MLP (base kernels that pass
    each block slot through, noise on every tap, a random kernel projection) and random
    candidate-selector weights, in the parameter names the DFlash authors' reference saves."""
    config = json.loads((drafter / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] = {**config["dflash_config"], **DFLASH2}
    hidden, vocab, taps = config["hidden_size"], config["vocab_size"], DFLASH2["conv_kernel_size"]
    groups, rank = hidden // DFLASH2["conv_group_size"], DFLASH2["selector_rank"]
    state = load_file(drafter / "model.safetensors")
    generator = torch.Generator().manual_seed(5)

    def noise(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    for layer in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = noise(2, taps, hidden, scale=0.2)
            base[:, 0] += 1.0  # tap 0 passes the slot itself through
            state[f"layers.{layer}.{conv}.base_kernel"] = base
            projection = noise(2 * taps * groups, hidden, scale=0.05)
            state[f"layers.{layer}.{conv}.kernel_projection.weight"] = projection
    state["candidate_selector.predecessor_codebook"] = noise(vocab, rank, scale=0.1)
    state["candidate_selector.successor_codebook"] = noise(vocab, rank, scale=0.1)
    state["candidate_selector.hidden_projection.weight"] = noise(rank, hidden, scale=0.1)
    out.mkdir(parents=True)
    save_file(
        {name: t.float().contiguous() for name, t in state.items()}, out / "model.safetensors"
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.mark.skipif(
    not compat.SERVES_DFLASH2[compat.release()], reason="this SGLang has no DFlash2 model"
)
def test_a_dflash2_drafter_drafts_what_the_engine_drafts(
    pair, prompts, baseline, offline_target, tmp_path_factory
):
    """A DFlash2 drafter (``DFlash2DraftModel``, SGLang 0.5.23; 0.5.17 refuses it at start-up,
    ``test_dflash_reference``): the small pair's trained drafter made a DFlash2 one
    (:func:`dflash2_checkpoint`), which drafts unlike the drafter it came from, and still well.
    At budget 8, 8 requests at once: greedy output equals no speculation's, a seeded sample is
    the target's own draw, and every request needs the verify steps the engine needs
    (``drafters/dflash.py``, equal to the reference on DFlash2 checkpoints) within
    ``DFLASH2_STEP_SLACK`` in all: the server drafts what the engine drafts."""
    from sglang_tree_spec.drafters import DFlashDrafter
    from sglang_tree_spec.engine import SpecEngine

    root = tmp_path_factory.mktemp("dflash2")
    dflash2 = {**pair, "drafter": dflash2_checkpoint(pair["drafter"], root / "drafter")}
    for server in running_server(server_command(dflash2, free_port(), 8), root / "server.log"):
        replies = server.greedy_replies(prompts[:8], 8)
        sampled = [server.generate(prompt, **FILTERED) for prompt in prompts[:2]]
    assert "type=DFlash2DraftModel" in (root / "server.log").read_text()
    assert [reply["output_ids"] for reply in replies] == baseline["sequential"][:8]
    for prompt, reply in zip(prompts[:2], sampled, strict=True):
        ids = reply["output_ids"]
        assert ids == offline_sample(offline_target, prompt, ids[0], len(ids), FILTERED)
    drafter = DFlashDrafter.from_pretrained(dflash2["drafter"])
    assert drafter.dflash2
    results = SpecEngine(offline_target, drafter, method="ddtree", budget=8).generate(
        prompts[:8], NEW_TOKENS, stop_token_ids=[]
    )
    assert [result.tokens for result in results] == baseline["sequential"][:8]
    engine = [result.stats.steps for result in results]
    served = [reply["meta_info"]["spec_verify_ct"] for reply in replies]
    assert sum(engine) < 0.6 * 8 * NEW_TOKENS  # a useful drafter: most steps accept drafts
    assert sum(abs(a - b) for a, b in zip(served, engine, strict=True)) <= DFLASH2_STEP_SLACK, (
        served,
        engine,
    )


def test_float32_copy_keeps_the_weights(pair):
    """The served copy is the committed pair, only widened to float32."""
    original = load_file(SMALL_PAIR_DIR / "drafter" / "model.safetensors")
    widened = load_file(pair["drafter"] / "model.safetensors")
    assert original.keys() == widened.keys()
    for name, tensor in original.items():
        assert widened[name].dtype == torch.float32
        assert torch.equal(widened[name], tensor.float()), name
