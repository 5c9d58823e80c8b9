"""The SGLang plugin against the real installed SGLang (0.5.17 or 0.5.23; no mocks).

Entry-point discovery, DDTREE registration after ``load_plugins()``, the hooks and their
upstream diffs, the ``--speculative-ddtree-*`` flags, and start-up validation: directly, through
``ServerArgs`` and through a real ``python -m sglang.launch_server`` that must exit with the
one-line error. If SGLang is not installed these tests fail (``bash launch/setup-dev.sh``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import Qwen3Config

from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.plugin import compat, register
from sglang_tree_spec.plugin.compat import RELEASES, check_release
from sglang_tree_spec.plugin.entry import installed_hooks

SGLANG_VERSION = check_release()  # the installed release (a tested one; else this fails)
HOOKS = installed_hooks()

ROOT = Path(__file__).resolve().parents[1]
PATCH_DIR = ROOT / "patches" / f"sglang-{SGLANG_VERSION}"
BLOCK_SIZE = 4


def qwen3_config(hidden: int = 64) -> Qwen3Config:
    """A tiny Qwen3 target config (only its config is needed to validate arguments)."""
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths: a target config, a DFlash drafter for it, one for another target, a missing dir."""
    root = tmp_path_factory.mktemp("ddtree-models")
    target = qwen3_config()
    target.save_pretrained(root / "target")
    DFlashDrafter.random_init(
        target, num_layers=1, block_size=BLOCK_SIZE, target_layer_ids=[0]
    ).save_pretrained(root / "drafter")
    DFlashDrafter.random_init(target, num_layers=1, block_size=BLOCK_SIZE).save_pretrained(
        root / "last-layer-drafter"
    )  # reads layer 1 of 2
    DFlashDrafter.random_init(
        target, num_layers=1, block_size=4 * BLOCK_SIZE, target_layer_ids=[0]
    ).save_pretrained(root / "wide-block-drafter")
    other = qwen3_config(hidden=32)
    DFlashDrafter.random_init(
        other, num_layers=1, block_size=BLOCK_SIZE, target_layer_ids=[0]
    ).save_pretrained(root / "other-drafter")
    return {
        "target": str(root / "target"),
        "drafter": str(root / "drafter"),
        "other_drafter": str(root / "other-drafter"),
        "last_layer_drafter": str(root / "last-layer-drafter"),
        "wide_block_drafter": str(root / "wide-block-drafter"),
        "missing": str(root / "missing"),
    }


@pytest.fixture(scope="module")
def sglang_plugins() -> None:
    """SGLang's own plugin loading (entry points, then ``HookRegistry.apply_hooks``)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def server_args(models: dict[str, str], **overrides: Any) -> Any:
    """A real (hooked), resolved ``ServerArgs`` for the tiny target on CPU (0.5.17 resolves in
    ``__post_init__``, 0.5.23 in ``resolve_once``)."""
    from sglang.srt import server_args as sa

    kwargs = {
        "model_path": models["target"],
        "device": "cpu",
        "attention_backend": "torch_native",
        **overrides,
    }
    return compat.resolve(sa.ServerArgs(**kwargs))


# ---------------------------------------------------------------------------------------------
# Discovery and registration
# ---------------------------------------------------------------------------------------------


def test_sglang_is_installed_at_the_supported_version():
    import sglang  # noqa: F401  (an ImportError fails the test: CI installs SGLang)

    assert importlib.metadata.version("sglang") == SGLANG_VERSION
    assert SGLANG_VERSION in RELEASES


def test_entry_point_is_discoverable():
    entry_points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in entry_points if ep.value == "sglang_tree_spec.plugin:register"]
    assert [ep.name for ep in ours] == ["ddtree"]
    assert ours[0].load() is register


def test_ddtree_resolves_after_plugins_load(sglang_plugins):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_tree_spec.plugin import validation
    from sglang_tree_spec.plugin.algorithm import DDTreeSpecAlgo

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    assert isinstance(algo, DDTreeSpecAlgo)
    assert SpeculativeAlgorithm.from_string("ddtree") is algo  # the CLI upper-cases
    assert algo.is_speculative() and algo.is_some() and algo.is_dflash_family()
    assert not (algo.is_dflash() or algo.is_eagle() or algo.is_ngram() or algo.is_standalone())
    assert algo.supports_target_verify_for_draft()
    assert not (algo.supports_ragged_verify() or algo.supports_grammar_overlap())
    assert algo.supports_overlap is True
    assert algo.validate_server_args is validation.validate_server_args
    assert algo.get_num_tokens_per_req_for_target_verify(33, is_draft_worker=False) == 33
    register()  # idempotent: a second call neither re-registers nor raises
    assert SpeculativeAlgorithm.from_string("DDTREE") is algo


def test_ddtree_supplies_the_methods_custom_spec_algo_lacks(sglang_plugins):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    for name in ("create_future_map", "carries_draft_hidden_states", "need_topk"):
        assert hasattr(SpeculativeAlgorithm.EAGLE, name)
        assert not hasattr(CustomSpecAlgo, name)  # 0.5.17's gap (patch 0003)
        assert callable(getattr(algo, name))
    assert algo.carries_draft_hidden_states() is False
    assert algo.need_topk() is False


def test_ddtree_overlap_relay_publishes_host_lengths_only_where_a_backend_needs_them(
    sglang_plugins,
):
    """SGLang asks each backend whether the overlap relay must publish host sequence lengths
    (triton, flashinfer and the CPU tree-verify backend say no): DDTREE relays them only then,
    so no step waits on the previous one's lengths; its step sizes what it must from the KV
    reservation instead (:func:`host_lengths`)."""
    import torch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class Pool:
        req_to_token = torch.zeros(4, 16, dtype=torch.int32)

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    for needed in (False, True):
        relay = algo.create_future_map(torch.device("cpu"), Pool(), needs_cpu_seq_lens=needed)
        assert relay.needs_cpu_seq_lens is needed


def test_a_step_without_host_lengths_sizes_from_the_kv_reservation(sglang_plugins):
    from types import SimpleNamespace

    import torch

    from sglang_tree_spec.plugin import compat
    from sglang_tree_spec.plugin.backend import host_lengths

    device_lens = torch.tensor([5, 9])
    reserved = SimpleNamespace(**{compat.RESERVED_LENS[compat.release()]: torch.tensor([40, 44])})
    exact = SimpleNamespace(seq_lens_cpu=torch.tensor([5, 9]), seq_lens=device_lens, spec_info=None)
    bound = SimpleNamespace(seq_lens_cpu=None, seq_lens=device_lens, spec_info=reserved)
    read = SimpleNamespace(seq_lens_cpu=None, seq_lens=device_lens, spec_info=SimpleNamespace())
    assert [(t.tolist(), e) for t, e in map(host_lengths, (exact, bound, read))] == [
        ([5, 9], True), ([40, 44], False), ([5, 9], True)
    ]  # fmt: skip


def test_hooks_are_applied(sglang_plugins):
    from sglang.srt import server_args as sa
    from sglang.srt.entrypoints import engine
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    from sglang_tree_spec.plugin.server_args import DDTreeServerArgs

    assert sa.ServerArgs is DDTreeServerArgs
    assert engine.ServerArgs is DDTreeServerArgs  # what sglang.Engine(**kwargs) constructs
    assert RotaryEmbedding.__init__.__wrapped__ is not None


# ---------------------------------------------------------------------------------------------
# Hooks and their upstream diffs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.target)
def test_hook_target_exists_in_installed_sglang(hook):
    module_path, _, attribute = hook.target.rpartition(".")
    owner = pkgutil.resolve_name(module_path)
    assert attribute in vars(owner), hook.target
    assert (PATCH_DIR / hook.patch).is_file(), hook.patch


@pytest.mark.parametrize("diff", sorted(PATCH_DIR.glob("*.diff")), ids=lambda p: p.name)
def test_patch_applies_cleanly_to_installed_sglang(diff):
    import sglang

    patch = shutil.which("patch")
    assert patch, "the `patch` tool is required (apt-get install patch)"
    site_packages = Path(sglang.__file__).resolve().parents[1]
    result = subprocess.run(
        [patch, "--dry-run", "--batch", "-p2", "-d", str(site_packages), "-i", str(diff)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not re.search(r"fuzz|offset|FAILED", result.stdout), result.stdout


def test_every_hook_and_diff_is_explained_in_the_readme():
    readme = (ROOT / "patches" / "README.md").read_text()
    diffs = {p.name for p in PATCH_DIR.glob("*.diff")}
    assert {hook.patch for hook in HOOKS} <= diffs
    for name in diffs:
        assert f"`{name}`" in readme, name
    for hook in HOOKS:
        assert f"`{hook.target}`" in readme, hook.target
    assert len({hook.patch for hook in HOOKS}) == len(HOOKS)  # one hook per reason


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def test_ddtree_flag_is_parsed_and_documented(sglang_plugins, models):
    from sglang.srt import server_args as sa

    parser = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(parser)
    assert "--speculative-ddtree-topk" in parser.format_help()
    assert "--speculative-ddtree-graft" in parser.format_help()
    argv = [
        "--model-path", models["target"],
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--speculative-algorithm", "ddtree",
        "--speculative-draft-model-path", models["drafter"],
        "--speculative-ddtree-topk", "8",
    ]  # fmt: skip
    args = compat.resolved(compat.resolve(sa.ServerArgs.from_cli_args(parser.parse_args(argv))))
    assert args.speculative_algorithm == "DDTREE"
    assert args.speculative_ddtree_topk == 8
    assert args.speculative_ddtree_graft == "none"
    grafted = sa.ServerArgs.from_cli_args(
        parser.parse_args([*argv, "--speculative-ddtree-graft", "unified"])
    )
    assert grafted.speculative_ddtree_graft == "unified"
    with pytest.raises(SystemExit):  # argparse refuses a method the worker does not serve
        parser.parse_args([*argv, "--speculative-ddtree-graft", "retrieval"])
    assert "--speculative-ddtree-table" in parser.format_help()
    assert args.speculative_ddtree_table == "shared"
    isolated = sa.ServerArgs.from_cli_args(
        parser.parse_args([*argv, "--speculative-ddtree-table", "per-key"])
    )
    assert isolated.speculative_ddtree_table == "per-key"
    assert isolated.speculative_ddtree_table_partitions is None  # the validator's default: 8


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

BAD_CONFIGS = [
    ("no-drafter", {}, r"--speculative-draft-model-path is required"),
    (
        "budget-0",
        {"speculative_num_draft_tokens": 1},
        r"tree budget 0 \(--speculative-num-draft-tokens 1 minus the root\) is out of range "
        r"\[1, 1024\]",
    ),
    ("budget-1025", {"speculative_num_draft_tokens": 1026}, r"tree budget 1025 .* out of range"),
    ("topk-0", {"speculative_ddtree_topk": 0}, r"--speculative-ddtree-topk must be >= 1, got 0"),
    (
        "graft-unknown",
        {"speculative_ddtree_graft": "retrieval"},
        r"--speculative-ddtree-graft must be one of none, stage, unified, got 'retrieval'",
    ),
    (
        "table-unknown",
        {"speculative_ddtree_table": "per-tenant"},
        r"--speculative-ddtree-table must be one of shared, per-key, off, got 'per-tenant'",
    ),
    (
        "table-partitions-0",
        {"speculative_ddtree_table": "per-key", "speculative_ddtree_table_partitions": 0},
        r"--speculative-ddtree-table-partitions must be in \[1, 4096\], got 0",
    ),
    (
        "budget-above-largest",
        {"speculative_num_draft_tokens": 9, "speculative_ddtree_budget": "16"},
        r"--speculative-ddtree-budget must be 'auto' or a number in \[0, 8\] .* got '16'",
    ),
    (
        "budget-word",
        {"speculative_ddtree_budget": "most"},
        r"--speculative-ddtree-budget must be 'auto' or a number",
    ),
    (
        "candidates-unsorted",
        {"speculative_num_draft_tokens": 17, "speculative_ddtree_candidates": "8,4"},
        r"--speculative-ddtree-candidates: candidates must be sorted, distinct, in "
        r"\[0, budget=16\]",
    ),
    ("not-dflash", {"draft": "target"}, r"is not a DFlash drafter \(architectures="),
    (
        "incompatible-drafter",
        {"draft": "other_drafter"},
        r"DFlash drafter incompatible with target: hidden size mismatch: drafter 32, target 64",
    ),
    (
        "backend",
        {"attention_backend": "flashinfer"},
        r"prefill attention backend 'flashinfer' is not supported on cpu "
        r"\(use --attention-backend torch_native or triton\)",
    ),
    (
        "triton-without-interpreter",  # (TRITON_INTERPRET is unset in the test environment)
        {"attention_backend": "triton"},
        r"prefill attention backend 'triton' runs on cpu only under Triton's interpreter "
        r"\(set TRITON_INTERPRET=1, or use --attention-backend torch_native\)",
    ),
    ("pp-2", {"pp_size": 2}, r"--pp-size 2 is not supported \(use --pp-size 1\)"),
    (
        "last-layer",
        {"draft": "last_layer_drafter"},
        r"the drafter reads the target's last layer \(1\); SGLang captures hidden states before",
    ),
    (
        "block-size",
        {"speculative_dflash_block_size": 8},
        r"--speculative-dflash-block-size 8 differs from the drafter's block_size 4",
    ),
    (
        "budget-below-half-block",
        {"draft": "wide_block_drafter", "speculative_num_draft_tokens": 7},
        r"tree budget 6 is too small for the drafter's block of 16 .* "
        r"use --speculative-num-draft-tokens 8 or more",
    ),
]


def _bad_kwargs(models: dict[str, str], overrides: dict[str, Any]) -> dict[str, Any]:
    """ServerArgs keywords of a bad case: its overrides, with a valid drafter unless given."""
    kwargs = dict(overrides)
    draft = kwargs.pop("draft", "drafter" if overrides else None)
    if draft is not None:
        kwargs["speculative_draft_model_path"] = models[draft]
    return kwargs


@pytest.mark.parametrize(
    ("case", "overrides", "message"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS]
)
def test_validation_rejects_bad_configuration(
    sglang_plugins, models, case, overrides, message, monkeypatch
):
    from sglang_tree_spec.plugin.validation import DDTreeConfigError, validate_server_args

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = server_args(models, **_bad_kwargs(models, overrides))  # resolved without DDTREE
    with pytest.raises(DDTreeConfigError, match=message) as error:
        validate_server_args(args)
    assert str(error.value).startswith("DDTREE: ")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("case", "overrides", "message"), BAD_CONFIGS[:5], ids=[c[0] for c in BAD_CONFIGS[:5]]
)
def test_server_args_with_ddtree_rejects_bad_configuration(
    sglang_plugins, models, case, overrides, message
):
    kwargs = _bad_kwargs(models, overrides)
    with pytest.raises(ValueError, match=message):
        server_args(models, speculative_algorithm="DDTREE", **kwargs)


def test_validation_accepts_triton_on_cpu_under_the_interpreter(
    sglang_plugins, models, monkeypatch
):
    """``TRITON_INTERPRET=1`` runs SGLang's Triton kernels on CPU tensors: the triton backend
    is served there (tests/test_sglang_triton_interpreter.py serves it)."""
    from sglang_tree_spec.plugin.validation import validate_server_args

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = server_args(
        models, attention_backend="triton", speculative_draft_model_path=models["drafter"]
    )
    validate_server_args(args)


def test_validation_page_size_16_on_cpu(sglang_plugins, models, monkeypatch):
    """Paged KV (tests/test_sglang_ddtree_pages.py serves it). On CPU, SGLang 0.5.17 allocates
    pages with a Triton kernel only, so without Triton's interpreter the server is refused at
    start-up with that reason (SGLang alone would fail on the first request); 0.5.23 allocates
    pages in torch there."""
    from sglang_tree_spec.plugin import compat
    from sglang_tree_spec.plugin.validation import DDTreeConfigError, validate_server_args

    kwargs = {"page_size": 16, "speculative_draft_model_path": models["drafter"]}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if compat.is_release("0.5.17"):
        with pytest.raises(DDTreeConfigError) as error:
            validate_server_args(server_args(models, **kwargs))
        assert str(error.value) == (
            f"DDTREE: --page-size 16 on cpu needs Triton's interpreter: SGLang "
            f"{compat.installed_version()} allocates KV pages with a Triton kernel only (set "
            "TRITON_INTERPRET=1, or use --page-size 1)"
        )
    else:
        validate_server_args(server_args(models, **kwargs))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate_server_args(server_args(models, **kwargs))


def test_validation_accepts_any_page_size_on_cuda():
    from sglang_tree_spec.plugin.validation import check_page_size

    for page_size in (None, 1, 16, 64):
        check_page_size(page_size, "cuda")


def test_validation_reports_an_unreadable_drafter(models):
    """(SGLang itself reads any --speculative-draft-model-path first, so only a direct call
    reaches this check with a missing directory.)"""
    from sglang_tree_spec.plugin.validation import DDTreeConfigError, load_drafter

    with pytest.raises(DDTreeConfigError, match=r"cannot read the drafter config of .*missing"):
        load_drafter(models["missing"])


def test_validation_refuses_unsupported_devices():
    from sglang_tree_spec.plugin.validation import DDTreeConfigError, check_device

    check_device("cuda")
    check_device("cpu")
    with pytest.raises(DDTreeConfigError, match=r"device 'npu' is not supported"):
        check_device("npu")


def test_server_args_with_ddtree_get_defaults(sglang_plugins, models):
    args = compat.resolved(
        server_args(
            models,
            speculative_algorithm="DDTREE",
            speculative_draft_model_path=models["drafter"],
            enable_mixed_chunk=True,
        )
    )
    assert args.speculative_algorithm == "DDTREE"
    assert args.disable_overlap_schedule is True  # on CPU DDTREE runs synchronously
    assert args.speculative_num_draft_tokens == BLOCK_SIZE  # budget defaults to block size - 1
    assert args.speculative_dflash_block_size == BLOCK_SIZE
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    assert args.enable_mixed_chunk is False
    assert args.speculative_ddtree_topk is None


def test_ddtree_keeps_overlap_scheduling_where_it_can_run(sglang_plugins, models, monkeypatch):
    """Overlap stays on (SGLang's default) unless DDTREE must run synchronously: on CPU (as
    SGLang's own speculative algorithms; the test switch keeps it), or when the verify window
    is shorter than the drafter's block (its writes could pass the overlap reservation)."""
    from sglang_tree_spec.plugin.validation import CPU_OVERLAP_ENV, no_overlap_reason

    def overlap(**kwargs: Any) -> bool:
        args = server_args(
            models,
            speculative_algorithm="DDTREE",
            speculative_draft_model_path=models["drafter"],
            **kwargs,
        )
        return not compat.resolved(args).disable_overlap_schedule

    assert not overlap()
    monkeypatch.setenv(CPU_OVERLAP_ENV, "1")
    assert overlap()
    assert overlap(speculative_num_draft_tokens=BLOCK_SIZE)
    assert not overlap(speculative_num_draft_tokens=BLOCK_SIZE - 1)
    assert not overlap(disable_overlap_schedule=True)
    assert no_overlap_reason("cuda", 33, 16) is None
    assert no_overlap_reason("cuda", 9, 16) == (
        "--speculative-num-draft-tokens 9 is shorter than the drafter's block (16): a step's "
        "KV writes could pass SGLang's overlap reservation (give at least 16 for overlap "
        "scheduling)"
    )
    monkeypatch.delenv(CPU_OVERLAP_ENV)
    assert "on CPU" in no_overlap_reason("cpu", 33, 16)


def test_server_args_with_ddtree_keep_an_explicit_budget(sglang_plugins, models):
    args = compat.resolved(
        server_args(
            models,
            speculative_algorithm="DDTREE",
            speculative_draft_model_path=models["drafter"],
            speculative_num_draft_tokens=65,
            speculative_ddtree_topk=16,
        )
    )
    assert args.speculative_num_draft_tokens == 65
    assert args.speculative_ddtree_topk == 16


def test_req_to_token_rows_hold_the_decode_reservation(sglang_plugins, models):
    """A DDTREE row holds context + 4 + the whole 2x reservation (hook 0012); without
    speculation the row is SGLang's own."""
    ddtree = server_args(
        models,
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=models["drafter"],
        speculative_num_draft_tokens=33,
    )
    assert extra_context_len(ddtree) == 4 + 2 * 33
    assert extra_context_len(server_args(models)) == 4


def extra_context_len(args: Any) -> int:
    """``get_req_to_token_extra_context_len`` for ``args``: 0.5.17 takes them, 0.5.23 reads
    the published bags (published here as the scheduler does)."""
    from sglang.srt.mem_cache import allocation_sizing

    if SGLANG_VERSION == "0.5.17":
        return allocation_sizing.get_req_to_token_extra_context_len(args)
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(args)
    return allocation_sizing.get_req_to_token_extra_context_len()


@pytest.mark.parametrize(
    ("params", "penalised"),
    [
        ({}, False),
        ({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.1}, False),
        ({"frequency_penalty": 0.5}, True),
        ({"presence_penalty": -0.3}, True),
        ({"repetition_penalty": 1.2}, True),
        ({"min_new_tokens": 4}, True),
    ],
)
def test_penalised_requests_are_recognised(params, penalised):
    """Each penalty and ``min_new_tokens`` switches the worker's per-node penalties on (none
    is refused any more: tests/test_sglang_ddtree_params.py serves them exactly)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_tree_spec.plugin.penalties import penalised as is_penalised

    assert is_penalised(SamplingParams(**params)) == penalised


def test_a_prompt_of_no_tokens_is_refused_at_admission():
    """Hook 0016 on SGLang's own request objects (what ``_validate_one_request`` receives for
    one request: the object and its tokens); the servers' refusal is the hostile tests'."""
    from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput

    from sglang_tree_spec.plugin.admission import EMPTY_PROMPT, refuse_empty_prompts

    for request in (GenerateReqInput(text=""), EmbeddingReqInput(text="")):
        with pytest.raises(ValueError, match=f"^{re.escape(EMPTY_PROMPT)}$"):
            refuse_empty_prompts(None, request, [])
    assert EMPTY_PROMPT == "Prompt cannot be empty: it has no tokens."
    refuse_empty_prompts(None, GenerateReqInput(input_ids=[5]), [5])
    refuse_empty_prompts(None, GenerateReqInput(text="a"), None)  # no ids yet: left to SGLang
    # The prompt is not the ids: embeddings, or a multimodal processor's expansion.
    refuse_empty_prompts(None, GenerateReqInput(input_embeds=[[0.0, 1.0]]), [])
    refuse_empty_prompts(None, GenerateReqInput(text="", image_data="img.png"), [])


def test_launch_server_exits_with_the_one_line_error(models):
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", models["target"],
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", models["target"],
        "--speculative-num-draft-tokens", "17",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode != 0
    expected = (
        f"DDTREE: --speculative-draft-model-path {models['target']} is not a DFlash drafter "
        "(architectures=['Qwen3ForCausalLM'], expected DFlashDraftModel)"
    )
    lines = result.stderr.splitlines()
    assert any(line.endswith(expected) for line in lines), result.stderr[-4000:]
