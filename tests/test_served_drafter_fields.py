"""A DDTREE server refuses at start-up a drafter whose output fields (input_embedding_scale,
output_multiplier, final_logit_softcapping) its SGLang release would ignore, in one ``DDTREE:``
line naming the field and the release (plugin/validation.py ``SERVED_DRAFTER_FIELDS``: neither
0.5.17 nor 0.5.23 applies any of them to a DFlash v1 drafter on the DDTREE path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import Qwen3Config

from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.plugin.compat import RELEASES
from sglang_tree_spec.plugin.validation import (
    DDTreeConfigError,
    check_served_drafter_fields,
    load_drafter,
)

FIELDS = {"input_embedding_scale": 2.0, "output_multiplier": 0.5, "final_logit_softcapping": 30.0}
NEUTRAL = [
    {},
    {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None},
    {"final_logit_softcapping": 0},
]


def target_config() -> Qwen3Config:
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=512,
    )


def saved_drafter(path: Path, nested: dict) -> str:
    """A tiny drafter's checkpoint at ``path`` with ``nested`` merged into its dflash_config."""
    drafter = DFlashDrafter.random_init(target_config(), 1, block_size=4, target_layer_ids=[0])
    drafter.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["dflash_config"].update(nested)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("field", FIELDS)
def test_ignored_field_is_refused_naming_field_and_release(field, release, tmp_path):
    drafter = load_drafter(saved_drafter(tmp_path, {field: FIELDS[field]}))
    with pytest.raises(DDTreeConfigError) as error:
        check_served_drafter_fields(drafter, release)
    message = str(error.value)
    assert message.startswith("DDTREE: ") and "\n" not in message
    assert f"dflash_config.{field}={FIELDS[field]}" in message
    assert f"SGLang {release}" in message


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("nested", NEUTRAL, ids=["unset", "neutral", "cap-0"])
def test_neutral_fields_are_served(nested, release, tmp_path):
    check_served_drafter_fields(load_drafter(saved_drafter(tmp_path, nested)), release)


@pytest.mark.parametrize("release", RELEASES)
def test_activation_sglang_lacks_is_refused(release, tmp_path):
    """The engine's drafter runs any transformers activation (as the reference does); SGLang's
    DFlash drafter raises on all but silu."""
    drafter = DFlashDrafter.random_init(target_config(), 1, block_size=4, target_layer_ids=[0])
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(DDTreeConfigError) as error:
        check_served_drafter_fields(load_drafter(str(tmp_path)), release)
    assert str(error.value) == (
        f"DDTREE: the drafter's hidden_act='gelu' is not supported by SGLang {release}'s DFlash "
        "drafter (silu only)"
    )


def test_unsupported_field_is_refused_at_start_up_in_one_line(tmp_path):
    path = saved_drafter(tmp_path, {"conv_kernel_size": 4})
    with pytest.raises(DDTreeConfigError) as error:
        load_drafter(path)
    assert str(error.value) == (
        f"DDTREE: --speculative-draft-model-path {path}: DFlash drafter "
        "dflash_config.conv_kernel_size is not supported (a DFlash2 field in a DFlashDraftModel "
        "config)"
    )


def test_validate_server_args_refuses_an_ignored_field(tmp_path, monkeypatch):
    """Through SGLang's own resolved ServerArgs (no server): validate_server_args runs the
    check with the installed release."""
    pytest.importorskip("sglang")
    from sglang.srt import server_args as sa
    from sglang.srt.plugins import load_plugins

    from sglang_tree_spec.plugin import compat
    from sglang_tree_spec.plugin.validation import validate_server_args

    load_plugins()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    target_config().save_pretrained(tmp_path / "target")

    def args(drafter: str):
        return compat.resolve(
            sa.ServerArgs(
                model_path=str(tmp_path / "target"),
                device="cpu",
                attention_backend="torch_native",
                speculative_draft_model_path=drafter,
            )
        )

    validate_server_args(args(saved_drafter(tmp_path / "plain", {})))
    refused = saved_drafter(tmp_path / "capped", {"final_logit_softcapping": 30.0})
    with pytest.raises(DDTreeConfigError, match=rf"SGLang {compat.release()} ignores"):
        validate_server_args(args(refused))
