"""DFlash drafter config fields: ``input_embedding_scale``, ``output_multiplier`` and
``final_logit_softcapping`` drafted with the DFlash reference's semantics (``dflash`` 0.1.0,
``DFlashDraftModel``: the block's embeddings are embedding-matrix rows times the scale; the draft
logits are ``lm_head(hidden) * multiplier``, then ``tanh(x / cap) * cap`` for a positive cap), and
every field the drafter does not implement refused at load in one ``DDTREE:`` line naming it.
tests/test_dflash_reference.py checks the same against the reference package itself."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config

from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.drafters.dflash import DrafterConfigError
from sglang_tree_spec.engine.backend import TransformersBackend
from sglang_tree_spec.tree.draft_vocab import draft_vocab

VOCAB = 96
BLOCK = 5
FIELDS = {"input_embedding_scale": 2.5, "output_multiplier": 3.0, "final_logit_softcapping": 0.3}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def base(target) -> DFlashDrafter:
    return DFlashDrafter.random_init(target.config, num_layers=2, block_size=BLOCK, seed=3).eval()


@pytest.fixture(scope="module")
def features(target, base) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return base.target_hidden_features(out.hidden_states)


def saved_with(drafter: DFlashDrafter, path, nested=None, top=None) -> DFlashDrafter:
    """``drafter`` saved, its config given ``nested`` dflash_config and ``top`` top-level
    fields, and loaded back."""
    drafter.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["dflash_config"].update(nested or {})
    config.update(top or {})
    (path / "config.json").write_text(json.dumps(config))
    return DFlashDrafter.from_pretrained(path)


def logits_of(drafter, target, features, embed=None) -> torch.Tensor:
    cache = drafter.new_cache(features.shape[0])
    cache.append(features, [7, 5])
    blocks = drafter.block_token_ids(torch.tensor([11, 40]))
    embed = target.get_input_embeddings() if embed is None else embed
    return cache.draft_logits(blocks, embed, target.get_output_embeddings())


def reference_math(base, target, features, fields) -> torch.Tensor:
    """The fields' semantics on the field-free drafter: the embedding matrix scaled, then the
    logits multiplied and soft-capped."""
    weight = target.get_input_embeddings().weight.detach()
    scaled = nn.Embedding.from_pretrained(weight * fields.get("input_embedding_scale", 1.0))
    logits = logits_of(base, target, features, scaled) * fields.get("output_multiplier", 1.0)
    cap = fields.get("final_logit_softcapping")
    return logits if cap is None else torch.tanh(logits / cap) * cap


CASES = [{name: value} for name, value in FIELDS.items()] + [FIELDS]


@pytest.mark.parametrize("fields", CASES, ids=["+".join(c) for c in CASES])
def test_field_drafts_the_reference_math(target, base, features, fields, tmp_path):
    drafter = saved_with(base, tmp_path, nested=fields)
    got = logits_of(drafter, target, features)
    torch.testing.assert_close(got, reference_math(base, target, features, fields))
    unset = logits_of(base, target, features)
    assert (got - unset).abs().max() > 1e-2  # the field changes the draft
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"].items() >= (
        fields.items()
    )
    resaved = tmp_path / "again"
    drafter.save_pretrained(resaved)  # the fields survive a round trip
    torch.testing.assert_close(
        logits_of(DFlashDrafter.from_pretrained(resaved), target, features), got
    )


def test_fields_are_read_from_the_top_level_as_the_reference_does(target, base, features, tmp_path):
    drafter = saved_with(base, tmp_path, top=FIELDS)
    torch.testing.assert_close(
        logits_of(drafter, target, features), reference_math(base, target, features, FIELDS)
    )
    nested_wins = saved_with(
        base, tmp_path / "both", nested={"output_multiplier": 2.0}, top={"output_multiplier": 9.0}
    )
    assert nested_wins.output_multiplier == 2.0


@pytest.mark.parametrize(
    "fields",
    [
        {"input_embedding_scale": 1.0, "output_multiplier": 1},
        {"final_logit_softcapping": None},
        {"final_logit_softcapping": 0.0},
        {"final_logit_softcapping": -30.0},  # the reference caps only when positive
    ],
)
def test_neutral_values_change_nothing(target, base, features, fields, tmp_path):
    drafter = saved_with(base, tmp_path, nested=fields)
    assert torch.equal(logits_of(drafter, target, features), logits_of(base, target, features))


def test_block_embeddings_are_rows_of_the_embedding_matrix(target, base, features):
    """The reference embeds the block with ``F.embedding(ids, embedding.weight)``: an embedding
    module that scales its output (Gemma's) is not called."""

    class Scaling(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 7.0

    weight = target.get_input_embeddings().weight.detach()
    scaling = Scaling(VOCAB, weight.shape[1])
    scaling.weight.data.copy_(weight)
    assert torch.equal(
        logits_of(base, target, features, scaling), logits_of(base, target, features)
    )


def test_shortlist_top_k_applies_the_fields(target, base, features, tmp_path):
    """The reference engine's draft top-K through a vocabulary shortlist (the whole vocabulary
    here) equals the one over the full LM head, fields included."""
    drafter = saved_with(base, tmp_path, nested=FIELDS)
    head = target.get_output_embeddings().weight.detach()
    shortlist = draft_vocab(torch.arange(VOCAB), head, 0, VOCAB)
    results = []
    for vocab in (None, shortlist):
        cache = drafter.new_cache(2)
        cache.append(features, [7, 5])
        backend = TransformersBackend(target, drafter, None, cache, cache.lengths, vocab)
        results.append(backend.draft_topk(torch.tensor([11, 40]), cache.lengths, 6, BLOCK - 1))
    (full_lp, full_ids), (short_lp, short_ids) = results
    torch.testing.assert_close(short_lp, full_lp)
    assert torch.equal(short_ids, full_ids)


REFUSED = [
    ({"architectures": ["DFlash2DraftModel"]}, None, "conv_kernel_size"),
    ({"architectures": ["MiniMaxDFlash2DraftModel"]}, None, "architectures"),
    (
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
        None,
        "layer_types",
    ),
    ({"is_causal": True}, None, "is_causal"),
    ({"hidden_act": "swigluoai"}, None, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, None, "partial_rotary_factor"),
    (
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        None,
        "rope_type",
    ),
    (
        {
            "rope_parameters": {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.25,
            }
        },
        None,
        "rope_parameters.partial_rotary_factor",
    ),
    (None, {"conv_kernel_size": 4}, "dflash_config.conv_kernel_size"),
    (None, {"selector_top_k": 8}, "dflash_config.selector_top_k"),
    (None, {"causal": True}, "dflash_config.causal"),
    (None, {"projector_type": "domino"}, "dflash_config.projector_type"),
    (None, {"attention_sink_bias": True}, "dflash_config.attention_sink_bias"),
    (None, {"some_new_switch": 1}, "dflash_config.some_new_switch"),
    (None, {"output_multiplier": "2"}, "output_multiplier"),
    (None, {"input_embedding_scale": None}, "input_embedding_scale"),
    (None, {"final_logit_softcapping": float("inf")}, "final_logit_softcapping"),
]


@pytest.mark.parametrize(("top", "nested", "field"), REFUSED, ids=[r[2] for r in REFUSED])
def test_unsupported_fields_are_refused_in_one_line(base, top, nested, field, tmp_path):
    with pytest.raises(DrafterConfigError) as error:
        saved_with(base, tmp_path, nested=nested, top=top)
    message = str(error.value)
    assert message.startswith("DDTREE: ") and "\n" not in message
    assert field in message


@pytest.mark.parametrize(
    "nested", [{"causal": False}, {"projector_type": "dflash"}, {"mask_token": "<|MASK|>"}]
)
def test_neutral_switches_load(target, base, features, nested, tmp_path):
    drafter = saved_with(base, tmp_path, nested=nested)
    assert torch.equal(logits_of(drafter, target, features), logits_of(base, target, features))
