"""A real SGLang server (0.5.17 or 0.5.23) on CPU serves a tiny random Qwen3 model made here.

No speculation: this checks the CPU serving path every DDTREE test builds on. The server is the
unmodified ``python -m sglang.launch_server``; the rotary fix it needs on CPU comes from this
package's ``sglang.srt.plugins`` entry point, which SGLang runs in each of its processes. Greedy
``/generate`` output must equal transformers' token for token. If SGLang is not installed the
tests fail (``bash launch/setup-dev.sh`` installs it).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hostile_requests import GREEDY, Hostile, assert_refused_and_still_serving
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from sglang_tree_spec.plugin import compat
from sglang_tree_spec.server_process import (
    START_TIMEOUT_S,
    free_port,
    http_json,
    launch,
    stop,
    wait_until_healthy,
)

VOCAB = 128
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
MAX_NEW_TOKENS = 12
PROMPTS = [[5, 17, 33, 42, 90, 41, 7], [11, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


# ---------------------------------------------------------------------------------------------
# Tiny model
# ---------------------------------------------------------------------------------------------


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: the specials, then ``w4 .. w{vocab-1}``, split on spaces."""
    words = list(SPECIALS) + [f"w{i}" for i in range(len(SPECIALS), vocab)]
    model = WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def tiny_qwen3_config(vocab: int = VOCAB) -> Qwen3Config:
    """Two layers, hidden 64, GQA 4/2 heads of 16: seconds to load and run on CPU."""
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )


def save_tiny_qwen3(path: Path, seed: int = 0) -> Qwen3ForCausalLM:
    """Save a random tiny Qwen3 (weights, config, tokenizer) to ``path``; return the model.

    The LM head is scaled up so greedy choices are not near-ties that float rounding between
    two implementations could flip.
    """
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model


@torch.no_grad()
def greedy_reference(model: Qwen3ForCausalLM, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy continuation by full recomputation, and the smallest top-1/top-2 logit gap."""
    ids = torch.tensor([prompt])
    out, gap = [], float("inf")
    for _ in range(n):
        logits = model(ids).logits[0, -1]
        top = logits.topk(2).values
        gap = min(gap, float(top[0] - top[1]))
        token = int(logits.argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out, gap


# ---------------------------------------------------------------------------------------------
# Server process
# ---------------------------------------------------------------------------------------------


def cpu_server_command(model_path: Path, port: int) -> list[str]:
    """The unmodified launch command for a CPU server without speculation."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-total-tokens",
        "2048",
        "--max-running-requests",
        "8",
        "--random-seed",
        "0",
        "--log-level",
        "info",
        "--sleep-on-idle",  # an idle CPU scheduler otherwise spins a core the other tests need
    ]


def greedy_generate(base_url: str, prompts: list[list[int]]) -> list[dict]:
    """One batched greedy ``/generate`` call of ``MAX_NEW_TOKENS`` per prompt, EOS ignored."""
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    return http_json(
        f"{base_url}/generate", {"input_ids": prompts, "sampling_params": params}, timeout=300
    )


# ---------------------------------------------------------------------------------------------
# Fixtures and tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3ForCausalLM]:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    return path, save_tiny_qwen3(path)


@pytest.fixture(scope="module")
def cpu_server(
    tiny_model: tuple[Path, Qwen3ForCausalLM], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, float]]:
    """A running CPU server: (base URL, its log file, seconds it took to become healthy)."""
    import sglang  # noqa: F401  (fail, not skip, without SGLang)

    path, _ = tiny_model
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    started = time.monotonic()
    process = launch(cpu_server_command(path, port), log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_healthy(base_url, process, log)
        yield base_url, log, time.monotonic() - started
    finally:
        stop(process)


def test_reference_has_no_near_ties(tiny_model):
    _, model = tiny_model
    for prompt in PROMPTS:
        _, gap = greedy_reference(model, prompt, MAX_NEW_TOKENS)
        assert gap > 1e-2, (prompt, gap)


def test_cpu_server_fails_without_the_plugin(tiny_model, tmp_path):
    """Control: with the plugin filtered out, SGLang 0.5.17 cannot build the model on CPU.

    Runs before the module's server starts (test order), so the two never share the 2 cores.
    """
    path, _ = tiny_model
    log = tmp_path / "server.log"
    process = launch(cpu_server_command(path, free_port()), log, plugins="none")
    needle = "from vllm._custom_ops import rotary_embedding"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if needle in log.read_text():
                break
            time.sleep(0.5)
    finally:
        stop(process)
    assert needle in log.read_text(), log.read_text()[-4000:]


def test_cpu_server_greedy_generate_equals_transformers(tiny_model, cpu_server):
    _, model = tiny_model
    base_url, _, _ = cpu_server
    reply = greedy_generate(base_url, PROMPTS)
    assert isinstance(reply, list) and len(reply) == len(PROMPTS)
    for prompt, item in zip(PROMPTS, reply, strict=True):
        expected, _ = greedy_reference(model, prompt, MAX_NEW_TOKENS)
        assert item["output_ids"] == expected, prompt


def test_cpu_server_text_prompt_uses_the_saved_tokenizer(tiny_model, cpu_server):
    _, model = tiny_model
    base_url, _, _ = cpu_server
    tokenizer = tiny_tokenizer()
    prompt = PROMPTS[0]
    reply = http_json(
        f"{base_url}/generate",
        {
            "text": tokenizer.decode(prompt),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
        },
    )
    expected, _ = greedy_reference(model, prompt, 6)
    assert reply["output_ids"] == expected
    assert reply["text"].split() == tokenizer.decode(expected).split()


def test_cpu_server_ran_the_plugin_in_every_process(cpu_server):
    base_url, log, seconds = cpu_server
    # The launcher parsed its arguments with the plugin's ServerArgs (the REPLACE hook); the
    # scheduler built the model only because the plugin's rotary hook ran there too (see the
    # control below).
    # (0.5.17 logs the record's repr, 0.5.23 a dict of its fields: both show a DDTREE field.)
    text = log.read_text()
    assert "server_args=DDTreeServerArgs(" in text or "'speculative_ddtree_graft': 'none'" in text
    assert seconds < START_TIMEOUT_S
    info = http_json(f"{base_url}/get_server_info")
    assert info["device"] == "cpu"
    assert info["speculative_algorithm"] is None
    assert info["speculative_ddtree_topk"] is None


# The tiny tokenizer splits on whitespace: a text of spaces has no tokens (on both releases it
# killed the scheduler before diff 0016).
BLANK_TEXT = Hostile(
    "text of spaces", "/generate", {"text": "   ", "sampling_params": GREEDY}, "cannot be empty"
)


def test_cpu_server_refuses_hostile_requests_and_keeps_serving(cpu_server):
    """Issue 19 without speculation: one ``input_ids`` entry outside ``[0, 128)`` killed the
    scheduler, and (issue 66) so did a prompt of no tokens; now every hostile request gets a
    4xx and the outputs stay the same."""
    base_url, _, _ = cpu_server

    def reference() -> list[list[int]]:
        return [item["output_ids"] for item in greedy_generate(base_url, PROMPTS)]

    assert_refused_and_still_serving(base_url, VOCAB, reference, extra=(BLANK_TEXT,))
    # The edges of the vocabulary are still valid ids.
    assert len(greedy_generate(base_url, [[0, VOCAB - 1]])[0]["output_ids"]) == MAX_NEW_TOKENS


PREFILL_GRAPH_OFF = "sglang-tree-spec: prefill CUDA graph (tc_piecewise) turned off on --device cpu"


def device_cpu_alone(command: list[str]) -> list[str]:
    """``command`` without ``--attention-backend``: only ``--device cpu`` says CPU."""
    index = command.index("--attention-backend")
    return command[:index] + command[index + 2 :]


def test_device_cpu_alone_serves_without_speculation(tiny_model, tmp_path):
    """``--device cpu`` without ``--attention-backend``: SGLang 0.5.17 captured its piecewise
    prefill CUDA graph at start-up and died (no CPU kernel for its attention op); the plugin
    turns it off with one log line (0.5.23 turns it off itself). Greedy output equals
    transformers'."""
    path, model = tiny_model
    command = device_cpu_alone(cpu_server_command(path, free_port()))
    log = tmp_path / "server.log"
    process = launch(command, log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        wait_until_healthy(base_url, process, log)
        reply = greedy_generate(base_url, PROMPTS)
    finally:
        stop(process)
    for prompt, item in zip(PROMPTS, reply, strict=True):
        assert item["output_ids"] == greedy_reference(model, prompt, MAX_NEW_TOKENS)[0], prompt
    text = log.read_text()
    assert "Capture target prefill CUDA graph begin" not in text
    if compat.check_release() == "0.5.17":
        assert text.count(PREFILL_GRAPH_OFF) >= 1, text[-4000:]


def test_ddtree_on_a_qwen3_target_equals_transformers(tiny_model, tmp_path):
    """A second architecture (Qwen3: q/k norms, GQA) under DDTREE, with a random DFlash drafter
    of block 4 and a tree budget of 8: greedy output equals transformers' token for token.
    The launch command says ``--device cpu`` alone (no ``--attention-backend``), so this is also
    the prefill-graph-off case with speculation."""
    from sglang_tree_spec.drafters.dflash import DFlashDrafter

    path, model = tiny_model
    drafter = tmp_path / "drafter"
    torch.manual_seed(1)
    DFlashDrafter.random_init(
        model.config, num_layers=1, block_size=4, target_layer_ids=[0]
    ).save_pretrained(drafter)
    command = [
        *device_cpu_alone(cpu_server_command(path, free_port())),
        "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", str(drafter),
        "--speculative-num-draft-tokens", "9",
    ]  # fmt: skip
    log = tmp_path / "server.log"
    process = launch(command, log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        wait_until_healthy(base_url, process, log)
        reply = greedy_generate(base_url, PROMPTS)
    finally:
        stop(process)
    for prompt, item in zip(PROMPTS, reply, strict=True):
        expected, _ = greedy_reference(model, prompt, MAX_NEW_TOKENS)
        assert item["output_ids"] == expected, prompt
        assert item["meta_info"]["spec_verify_ct"] >= 1  # DDTREE decoded it
