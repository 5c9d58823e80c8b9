"""DDTREE on a CUDA GPU equals SGLang without speculation (greedy), on triton and flashinfer.

Skipped without CUDA; ``bash launch/gpu-validate.sh`` runs it on a GPU host. Each server is the
unmodified ``python -m sglang.launch_server`` with CUDA graphs left as the plugin allows them
(no ``--disable-cuda-graph``): the no-speculation server captures its decode graphs, and DDTREE
captures its verify graphs once the plugin says it can (``validation.TREE_MASK_CUDA_GRAPHS``);
until then it must say in its log that it turned them off.

DDTREE runs under SGLang's overlap scheduler (its default on a GPU) at both budgets, and once
more without it (``--disable-overlap-schedule``); the log says which.

Models: ``GPU_EXACTNESS_TARGET`` / ``GPU_EXACTNESS_DRAFTER`` (a target and its DFlash drafter),
else the committed small pair. Budgets: the drafter's block and four times it, without and
with ``--speculative-ddtree-graft unified``. Both backends serve in bfloat16: SGLang 0.5.17 on
CUDA cannot serve float32 (sgl_kernel's rmsnorm has no float32 kernel: "failed to dispatch data
type Float", seen on an H100), so token-for-token exactness is checked on CPU (float32, the
torch backend and SGLang's triton kernels under Triton's interpreter) and here a verify batch and
a decode batch may round differently: an output may differ from the no-speculation one only from
a position where the target's two best logits (float32, transformers) are within
``BF16_TIE_LOGITS``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts
from sglang_tree_spec.server_process import free_port, http_json, launch, stop, wait_until_healthy

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (bash launch/gpu-validate.sh)"
    ),
    pytest.mark.slow,
]

TARGET = Path(os.environ.get("GPU_EXACTNESS_TARGET", SMALL_PAIR_DIR / "target"))
DRAFTER = Path(os.environ.get("GPU_EXACTNESS_DRAFTER", SMALL_PAIR_DIR / "drafter"))
BACKENDS = ("triton", "flashinfer")
DTYPE = "bfloat16"
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # head sizes flashinfer's attention kernels are built for
PROMPT_COUNT = 16
PROMPT_TOKENS = 128
NEW_TOKENS = 48
CONCURRENCY = (1, 8)  # two captured batch sizes when graphs are on
BF16_TIE_LOGITS = 0.5
GRAPHS_OFF_LINE = "DDTREE: CUDA graphs disabled (no tree-mask capture yet)"
VARIANTS = ("small-none-overlap", "large-none-overlap", "large-unified-overlap", "large-none-sync")
# Backend-major: each backend's cases run together (pytest alternated them when the backend was
# its own fixture, and restarted the no-speculation server at every switch).
CASES = [f"{variant}-{backend}" for backend in BACKENDS for variant in VARIANTS]
TREE_GRAPHS_LINE = "DDTREE tree builds: one graph per (batch size, budget) (CUDA graphs)"
GRAPH_CAPTURED = re.compile(r"Capture [a-z ]*CUDA graph end")  # "Capture target decode ..."


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def block_size() -> int:
    return int(_config(DRAFTER)["block_size"])


def budgets() -> tuple[int, int]:
    return block_size(), 4 * block_size()


def head_dim() -> int:
    config = _config(TARGET)
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def server_command(
    backend: str, port: int, budget: int | None, graft: str, overlap: bool = True
) -> list[str]:
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(TARGET),
        "--device", "cuda",
        "--attention-backend", backend,
        "--dtype", DTYPE,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--random-seed", "0",
        "--max-running-requests", str(max(CONCURRENCY)),
        "--cuda-graph-max-bs", str(max(CONCURRENCY)),
        "--mem-fraction-static", "0.5",
        "--max-total-tokens", "65536",
        "--log-level", "info",
    ]  # fmt: skip
    if budget is not None:
        command += [
            "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", str(DRAFTER),
            "--speculative-num-draft-tokens", str(budget + 1),
            "--speculative-ddtree-graft", graft,
        ]  # fmt: skip
    if not overlap:
        command.append("--disable-overlap-schedule")
    return command


def serve(command: list[str], log: Path, prompts: list[list[int]]) -> dict:
    """Start a server, send every prompt at each concurrency (greedy), stop it."""
    process = launch(command, log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        wait_until_healthy(base_url, process, log)

        def one(prompt: list[int]) -> dict:
            params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
            return http_json(
                f"{base_url}/generate", {"input_ids": prompt, "sampling_params": params}, 600
            )

        replies = {}
        for concurrency in CONCURRENCY:
            with ThreadPoolExecutor(concurrency) as pool:
                replies[concurrency] = list(pool.map(one, prompts))
    finally:
        stop(process)
    return {"replies": replies, "log": log.read_text()}


def outputs(served: dict, concurrency: int) -> list[list[int]]:
    return [reply["output_ids"] for reply in served["replies"][concurrency]]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    texts = heldout_prompts(PROMPT_COUNT)
    return [tokenizer.encode(t, add_special_tokens=False)[-PROMPT_TOKENS:] for t in texts]


def skip_unusable(backend: str) -> None:
    if backend == "flashinfer" and head_dim() not in FLASHINFER_HEAD_DIMS:
        pytest.skip(f"flashinfer has no kernels for head_dim {head_dim()} (target {TARGET})")


@pytest.fixture(scope="module")
def baselines(prompts, tmp_path_factory) -> Callable[[str], dict]:
    """No speculation on a backend, served once per backend however pytest orders the cases."""
    served: dict[str, dict] = {}

    def baseline(backend: str) -> dict:
        if backend not in served:
            log = tmp_path_factory.mktemp(f"none-{backend}") / "server.log"
            served[backend] = serve(server_command(backend, free_port(), None, "none"), log,
                                    prompts)  # fmt: skip
        return served[backend]

    return baseline


@pytest.fixture(scope="module", params=CASES)
def ddtree(request, baselines, prompts, tmp_path_factory) -> dict:
    size, graft, schedule, backend = request.param.split("-")
    skip_unusable(backend)
    baselines(backend)  # first: the first server on a GPU also pays its kernels' JIT builds
    budget = budgets()[0 if size == "small" else 1]
    overlap = schedule == "overlap"  # SGLang's default on a GPU; sync: --disable-overlap-schedule
    log = tmp_path_factory.mktemp(f"ddtree{budget}-{graft}-{schedule}-{backend}") / "server.log"
    command = server_command(backend, free_port(), budget, graft, overlap)
    served = serve(command, log, prompts)
    return served | {"budget": budget, "graft": graft, "backend": backend, "overlap": overlap}


@pytest.fixture(scope="module")
def reference_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).cuda().eval()


def top2_gap(model, tokens: list[int]) -> float:
    """The target's float32 gap between its two best next-token logits after ``tokens``."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device="cuda")).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_greedy(got, want, prompts, reference_model_factory) -> None:
    model = None
    for prompt, a, b in zip(prompts, got, want, strict=True):
        if a == b:
            continue
        model = model or reference_model_factory()
        first = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        gap = top2_gap(model, prompt + b[:first])
        assert gap < BF16_TIE_LOGITS, (
            f"output differs at token {first} where the target's top-2 gap is {gap:.3f}"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_baseline_captured_cuda_graphs(backend, baselines):
    skip_unusable(backend)
    log = baselines(backend)["log"]
    assert GRAPH_CAPTURED.search(log), "no CUDA graph captured without speculation"


def test_ddtree_greedy_equals_no_speculation(ddtree, baselines, prompts, request):
    baseline = baselines(ddtree["backend"])
    for concurrency in CONCURRENCY:
        assert_same_greedy(
            outputs(ddtree, concurrency),
            outputs(baseline, 1),
            prompts,
            lambda: request.getfixturevalue("reference_model"),
        )


def test_ddtree_accepts_more_than_one_token_per_step(ddtree):
    replies = ddtree["replies"][1]
    steps = sum(reply["meta_info"]["spec_verify_ct"] for reply in replies)
    tokens = sum(len(reply["output_ids"]) for reply in replies)
    assert steps < tokens


def test_ddtree_cuda_graphs_are_what_the_plugin_says(ddtree):
    from sglang_tree_spec.plugin.validation import TREE_MASK_CUDA_GRAPHS

    if TREE_MASK_CUDA_GRAPHS:
        assert GRAPHS_OFF_LINE not in ddtree["log"]
        assert GRAPH_CAPTURED.search(ddtree["log"]), "DDTREE captured no CUDA graph"
        # The DDTREE runner (plugin/graphs.py) captured the tree-mask verify and replayed it.
        assert "DDTREE verify graphs (CUDA graphs)" in ddtree["log"]
        assert "DDTREE verify graph replayed" in ddtree["log"]
        # Every batch size and budget these servers run is captured: no verify runs eagerly.
        assert "DDTREE verify ran eagerly" not in ddtree["log"]
    else:
        assert GRAPHS_OFF_LINE in ddtree["log"]
    if ddtree["graft"] == "none":  # DDTree's own batched build is graphed on CUDA
        assert TREE_GRAPHS_LINE in ddtree["log"]
        assert "shapes captured at start-up" in ddtree["log"]  # tree graphs, not while serving
    assert "DDTREE drafter block: SGLang's draft graphs" in ddtree["log"]


def test_ddtree_runs_under_the_scheduler_asked_for(ddtree):
    """SGLang's overlap scheduler (its default) keeps running DDTREE (``supports_overlap=True``,
    a window at least the drafter's block), unless ``--disable-overlap-schedule`` is given."""
    state = "on" if ddtree["overlap"] else "off"
    assert f"overlap scheduling {state}" in ddtree["log"]
    assert "supports_overlap=False" not in ddtree["log"]
    assert "DDTREE: overlap scheduling disabled" not in ddtree["log"]
