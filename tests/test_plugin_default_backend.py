"""DDTREE on SGLang's default attention backend: a launch line without ``--attention-backend``.

On Hopper SGLang picks fa3 for a dense model when no backend is given
(``ServerArgs._get_default_attn_backend`` on 0.5.17, ``get_default_attn_backend`` in
``arg_groups/model_override_base.py`` on 0.5.23). fa3's target verify reads no custom mask at
``--speculative-eagle-topk 1``, so DDTREE cannot serve on it; without a given backend DDTREE
gets triton (one log line), and an explicit fa3 stays refused with the one-line ``DDTREE:``
error.

Real SGLang resolution (``ServerArgs`` construction, its default-backend choice and the plugin's
validation) on a CUDA device whose facts are mocked: Hopper with CUDA >= 12.3 (0.5.17's
``server_args.is_hopper_with_cuda_12_3``, 0.5.23's ``override_platform``) and 141 GiB of memory.
Nothing touches a GPU. About 10 s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import test_plugin_registration
from test_plugin_registration import BLOCK_SIZE

from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.validation import (
    default_attention_backend,
    validate_server_args,
)

models = test_plugin_registration.models  # the module fixture: a tiny target and drafter
sglang_plugins = test_plugin_registration.sglang_plugins

H200_MIB = 141 * 1024  # SGLang reads device memory in MiB


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SGLang sees a Hopper GPU (sm90, CUDA >= 12.3) with 141 GiB for the test's duration."""
    if compat.is_release("0.5.17"):
        from sglang.srt import server_args as sa

        monkeypatch.setattr(sa, "is_hopper_with_cuda_12_3", lambda: True)
        monkeypatch.setattr(sa, "get_device_memory_capacity", lambda device=None: H200_MIB)
        yield
        return
    from sglang.srt.arg_groups import kv_shard_hook, memory_hook
    from sglang.srt.runtime_context import override_platform

    for module in (memory_hook, kv_shard_hook):
        monkeypatch.setattr(module, "get_device_memory_capacity", lambda device=None: H200_MIB)
    with override_platform(is_hopper_with_cuda_12_3=True):
        yield


def cuda_server_args(models: dict[str, str], ddtree: bool = True, **overrides: Any) -> Any:
    """A resolved ``ServerArgs`` for the tiny target on ``--device cuda``; with ``ddtree`` the
    DDTREE flags of a user's launch line (a drafter, nothing else)."""
    from sglang.srt import server_args as sa

    kwargs: dict[str, Any] = {"model_path": models["target"], "device": "cuda", **overrides}
    if ddtree:
        kwargs |= {
            "speculative_algorithm": "DDTREE",
            "speculative_draft_model_path": models["drafter"],
        }
    return compat.resolved(compat.resolve(sa.ServerArgs(**kwargs)))


def test_sglang_alone_picks_fa3_on_the_mocked_hopper(sglang_plugins, models, hopper):
    """The mock reaches SGLang's own choice: without speculation it is fa3."""
    assert cuda_server_args(models, ddtree=False).attention_backend == "fa3"


def test_a_launch_without_attention_backend_on_hopper_starts_ddtree(
    sglang_plugins, models, hopper, caplog
):
    with caplog.at_level(logging.INFO, logger="sglang_tree_spec.plugin.validation"):
        args = cuda_server_args(models)
    assert args.speculative_algorithm == "DDTREE"
    assert args.attention_backend == "triton"
    assert (args.prefill_attention_backend, args.decode_attention_backend) == (None, None)
    assert args.speculative_num_draft_tokens == BLOCK_SIZE  # DDTREE's defaults were applied
    validate_server_args(args)  # and the resolved arguments validate again
    lines = [r.getMessage() for r in caplog.records if "SGLang's default" in r.getMessage()]
    assert lines == [
        "DDTREE: --attention-backend not given; using triton instead of SGLang's default fa3 "
        "on cuda: its target verify reads no custom mask at --speculative-eagle-topk 1 "
        "(DDTREE's), so a tree would be verified as a causal chain"
    ]


@pytest.mark.parametrize(
    ("flag", "role"),
    [
        ("attention_backend", "prefill"),
        ("prefill_attention_backend", "prefill"),
        ("decode_attention_backend", "decode"),
    ],
)
def test_an_explicit_fa3_is_refused(sglang_plugins, models, hopper, flag, role):
    with pytest.raises(ValueError) as error:
        cuda_server_args(models, **{flag: "fa3"})
    message = str(error.value)
    assert message == (
        f"DDTREE: {role} attention backend 'fa3' is not supported on cuda (use "
        "--attention-backend triton or flashinfer)"
    )
    assert "\n" not in message


def test_an_explicit_triton_or_flashinfer_is_kept(sglang_plugins, models, hopper):
    for backend in ("triton", "flashinfer"):
        assert cuda_server_args(models, attention_backend=backend).attention_backend == backend


def test_the_default_rule():
    """Only DDTREE on CUDA, only a default DDTREE cannot verify on."""
    assert default_attention_backend("DDTREE", "cuda", "fa3") == "triton"
    assert default_attention_backend("ddtree", "cuda", "trtllm_mha") == "triton"
    assert default_attention_backend("DDTREE", "cuda", "flashinfer") == "flashinfer"
    assert default_attention_backend("DDTREE", "cuda", "triton") == "triton"
    assert default_attention_backend("DFLASH", "cuda", "fa3") == "fa3"
    assert default_attention_backend(None, "cuda", "fa3") == "fa3"
    assert default_attention_backend("DDTREE", "cpu", "intel_amx") == "intel_amx"
