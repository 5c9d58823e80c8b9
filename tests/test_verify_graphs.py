"""DDTREE's target-verify graph runner (``plugin/graphs.py``) on a real CPU server.

With ``SGLANG_TREE_SPEC_CPU_VERIFY_GRAPHS=1`` the DDTREE worker builds the runner SGLang builds
on CUDA (its decode graph runner hook) and every tree verify of a captured shape is served by
replaying the captured closure over the runner's static buffers: the step's inputs (ids,
positions, sequence lengths, request rows, KV slots, the tree mask) are copied into them and
nothing else reaches the closure. Captured: batch sizes 1 and 2 times budgets 4 and 8 (budget
control picks among them every step). Greedy output must equal SGLang without speculation, one
request at a time and two at once, and every one of the four shapes must have been replayed.

A mask or position left in a fresh tensor instead of the static buffer makes the replay read the
previous step's (or the capture's) values: the outputs then differ (see the runner's note).

Once more as on a GPU: SGLang's triton attention backend (its kernels under Triton's interpreter)
under SGLang's overlap scheduler. That backend declares that it needs no host sequence lengths,
so SGLang's overlap relay stops publishing them unless DDTREE asks for them; without them the
runner cannot pad and plan a replay, and every verify ran eagerly on an H200
(benchmarks/results/gpu_h200.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_sglang_ddtree
from test_sglang_ddtree import (
    NEW_TOKENS,
    PROMPT_TOKENS,
    running_server,
    server_command,
)
from transformers import AutoTokenizer

from sglang_tree_spec.models.small_pair import heldout_prompts
from sglang_tree_spec.plugin.graphs import CPU_GRAPHS_ENV, SPECULATION_CAP_ENV
from sglang_tree_spec.plugin.validation import CPU_OVERLAP_ENV
from sglang_tree_spec.server_process import free_port
from sglang_tree_spec.step_times import LOG_ENV_FLAG

pair = test_sglang_ddtree.pair  # the module fixture: the small pair in float32

PROMPTS = 6
BUDGETS = (4, 8)
BATCH_SIZES = (1, 2)


@pytest.fixture(scope="module")
def prompts(pair: dict[str, Path]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(pair["target"])
    texts = heldout_prompts(PROMPTS)
    return [tokenizer.encode(text, add_special_tokens=False)[-PROMPT_TOKENS:] for text in texts]


def command(pair: dict[str, Path], budget: int | None, backend: str = "torch_native") -> list[str]:
    cmd = server_command(pair, free_port(), budget, "auto" if budget else None)
    cmd[cmd.index("--attention-backend") + 1] = backend
    cmd[cmd.index("--max-running-requests") + 1] = str(max(BATCH_SIZES))
    if budget:
        cmd += ["--speculative-ddtree-candidates", ",".join(map(str, BUDGETS))]
    return cmd


@pytest.fixture(scope="module")
def no_speculation(pair, prompts, tmp_path_factory) -> dict[str, list]:
    """One no-speculation server: greedy outputs one at a time, and the log-prob replies of two
    prompts at once (:func:`plain_logprobs`'s reference)."""
    from test_sglang_ddtree_params import logprob_replies

    log = tmp_path_factory.mktemp("baseline") / "server.log"
    for server in running_server(command(pair, None), log):
        return {
            "greedy": server.greedy(prompts, 1),
            "logprobs": logprob_replies(server, prompts[:2], 2),
        }
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def baseline(no_speculation) -> list[list[int]]:
    return no_speculation["greedy"]


@pytest.fixture(scope="module")
def replayed(pair, prompts, baseline, tmp_path_factory) -> Iterator[dict]:
    """The DDTREE server's greedy outputs (one at a time, two at once) and its log."""
    log = tmp_path_factory.mktemp("graphs") / "server.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CPU_GRAPHS_ENV, "1")
        for server in running_server(command(pair, max(BUDGETS)), log):
            yield {
                "sequential": server.greedy(prompts, 1),
                "concurrent": server.greedy(prompts, 2),
                "log": log.read_text(),
            }


def test_replayed_verify_equals_no_speculation(replayed, baseline):
    assert replayed["sequential"] == baseline
    assert replayed["concurrent"] == baseline


def test_every_batch_size_and_budget_was_captured_and_replayed(replayed):
    log = replayed["log"]
    captured = re.search(r"DDTREE verify graphs \(closure replay\): batch sizes (\[[^]]*\])", log)
    assert captured, "the worker built no verify graph runner"
    assert all(str(bs) in captured.group(1) for bs in BATCH_SIZES)
    shapes = set(re.findall(r"DDTREE verify graph replayed: batch size (\d+), budget (\d+)", log))
    assert shapes == {(str(bs), str(b)) for bs in BATCH_SIZES for b in BUDGETS}, shapes
    assert "DDTREE verify ran eagerly" not in log  # every step was a replay
    assert "DDTREE tree builds: one graph per (batch size, budget) (closure replay)" in log
    plan = re.search(
        r"DDTREE capture plan: (\d+) shapes \(\d+ batch sizes .*\), [\d.]+ GiB: logits .* "
        r"speculates up to batch size (\d+)",
        log,
    )
    assert plan, "no capture plan at start-up"
    assert int(plan.group(1)) == len(BATCH_SIZES) * len(BUDGETS)
    assert int(plan.group(2)) >= max(BATCH_SIZES)  # the tiny pair fits any host
    assert NEW_TOKENS > 1


@pytest.fixture(scope="module")
def capped(pair, prompts, tmp_path_factory) -> dict:
    """A DDTREE server whose speculation is capped at batch size 1
    (``SGLANG_TREE_SPEC_SPECULATION_CAP``): its greedy outputs two at a time, its step log and
    its server log."""
    work = tmp_path_factory.mktemp("capped")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CPU_GRAPHS_ENV, "1")
        patch.setenv(SPECULATION_CAP_ENV, "1")
        patch.setenv(LOG_ENV_FLAG, str(work))
        for server in running_server(command(pair, max(BUDGETS)), work / "server.log"):
            outputs = server.greedy(prompts, 2)
            alone = server.greedy(prompts[:1], 1)
    # (the variables are unset again: the module's later servers are not capped)
    (steps,) = work.glob("steps_*.csv")
    return {
        "concurrent": outputs,
        "alone": alone,
        "steps": [line.split(",") for line in steps.read_text().splitlines()[1:]],
        "log": (work / "server.log").read_text(),
    }


def test_batches_above_a_forced_speculation_cap_decode_plainly_and_exactly(capped, baseline):
    """Two requests at a time, then one alone: the steps of two take plain steps (budget 0),
    those of one speculate; only batch size 1 is captured; greedy equals no speculation."""
    assert capped["concurrent"] == baseline
    assert capped["alone"] == baseline[:1]
    budgets = {}
    for step in capped["steps"]:  # (bs, budget, ...)
        budgets.setdefault(int(step[0]), set()).add(int(step[1]))
    assert budgets.get(2) == {0}, budgets
    assert budgets.get(1) and max(budgets[1]) > 0, budgets
    log = capped["log"]
    assert "speculates up to batch size 1 " in log
    assert "DDTREE verify graphs (closure replay): batch sizes [1] x budgets" in log
    assert "DDTREE verify ran eagerly" not in log


@pytest.fixture(scope="module")
def plain_logprobs(pair, prompts, no_speculation, tmp_path_factory) -> dict[str, list[dict]]:
    """Log-prob replies of no speculation and of DDTREE at budget 0 (plain steps: two target
    forwards a step, both replays of one captured shape), two prompts at once."""
    from test_sglang_ddtree_params import logprob_replies

    replies = {"plain": no_speculation["logprobs"]}
    ddtree = server_command(pair, free_port(), max(BUDGETS), "0")  # budget 0 every step
    log = tmp_path_factory.mktemp("logprobs-ddtree") / "server.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CPU_GRAPHS_ENV, "1")
        for server in running_server(ddtree, log):
            replies["ddtree"] = logprob_replies(server, prompts[:2], 2)
            replies["ddtree-log"] = log.read_text()
    return replies


def test_replayed_plain_steps_report_each_forwards_own_logprobs(plain_logprobs):
    """A plain step's first forward's logits are copied out of the graph's static output
    before the second forward replays the same shape; else its token's log-probs would be the
    second's (the closure replay writes static outputs, as a CUDA graph does)."""
    from test_sglang_ddtree_params import assert_close_logprobs

    assert "DDTREE verify graph replayed: batch size 2, budget 0" in plain_logprobs["ddtree-log"]
    for want, got in zip(plain_logprobs["plain"], plain_logprobs["ddtree"], strict=True):
        assert got["output_ids"] == want["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert len(got["meta_info"][key]) == len(want["meta_info"][key])
        assert_close_logprobs(
            want["meta_info"]["output_token_logprobs"], got["meta_info"]["output_token_logprobs"]
        )
        for plain_top, ddtree_top in zip(
            want["meta_info"]["output_top_logprobs"],
            got["meta_info"]["output_top_logprobs"],
            strict=True,
        ):
            assert_close_logprobs(plain_top, ddtree_top)


@pytest.fixture(scope="module")
def replayed_triton_overlap(pair, prompts, tmp_path_factory) -> Iterator[dict]:
    """The same DDTREE server on SGLang's triton backend, under the overlap scheduler."""
    log = tmp_path_factory.mktemp("graphs-triton-overlap") / "server.log"
    env = {CPU_GRAPHS_ENV: "1", CPU_OVERLAP_ENV: "1", "TRITON_INTERPRET": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        for server in running_server(command(pair, max(BUDGETS), "triton"), log):
            yield {"concurrent": server.greedy(prompts[:4], 2), "log": log.read_text()}


def test_triton_under_overlap_replays_every_verify(replayed_triton_overlap, baseline):
    log = replayed_triton_overlap["log"]
    assert "overlap scheduling on" in log
    assert "DDTREE verify ran eagerly" not in log
    assert "DDTREE verify graph replayed" in log
    assert "DDTREE tree builds: one graph per (batch size, budget) (closure replay)" in log
    assert replayed_triton_overlap["concurrent"] == baseline[:4]
