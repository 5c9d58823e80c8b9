"""DFlash drafter: checkpoint layout, block attention semantics and the batched context cache."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from sglang_tree_spec.drafters import (
    DFlashDrafter,
    build_target_layer_ids,
    pad_features,
    select_target_features,
)

VOCAB = 128
BLOCK = 4


def qwen3_config(**overrides) -> Qwen3Config:
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(qwen3_config()).eval()


@pytest.fixture(scope="module")
def drafter(target) -> DFlashDrafter:
    return DFlashDrafter.random_init(target.config, num_layers=2, block_size=BLOCK, seed=1).eval()


def features_of(target, drafter: DFlashDrafter, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return drafter.target_hidden_features(out.hidden_states)


def draft_logits(target, drafter, features, counts, anchors) -> torch.Tensor:
    cache = drafter.new_cache(features.shape[0])
    cache.append(features, counts)
    blocks = drafter.block_token_ids(anchors)
    return cache.draft_logits(blocks, target.get_input_embeddings(), target.lm_head)


def test_build_target_layer_ids_follows_public_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-4B/8B DFlash configs
    assert build_target_layer_ids(40, 4) == [1, 13, 25, 37]
    assert build_target_layer_ids(40, 1) == [20]
    with pytest.raises(ValueError, match=">= 4 layers"):
        build_target_layer_ids(3, 2)


def test_select_target_features_uses_layer_output_index():
    hidden = tuple(torch.full((1, 2, 3), float(i)) for i in range(5))  # embeddings + 4 layers
    feats = select_target_features(hidden, [0, 2])
    assert feats.shape == (1, 2, 6)
    assert feats[0, 0].tolist() == [1.0] * 3 + [3.0] * 3
    with pytest.raises(ValueError, match="out of range"):
        select_target_features(hidden, [4])


def test_save_load_round_trip_gives_identical_logits(target, drafter, tmp_path):
    ids = torch.randint(0, VOCAB, (2, 9))
    feats = features_of(target, drafter, ids)
    anchors = torch.tensor([5, 6])
    before = draft_logits(target, drafter, feats, [9, 6], anchors)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    after = draft_logits(target, loaded, feats, [9, 6], anchors)
    assert torch.equal(before, after)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == BLOCK and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"target_layer_ids": [1, 1], "mask_token_id": VOCAB - 1}


def test_public_checkpoint_layout_loads_unchanged(tmp_path):
    """config.json in the published z-lab layout (Qwen3-4B-DFlash-b16, tiny sizes) and a
    state dict with the published key names, in bf16."""
    hidden, heads, kv_heads, head_dim, inter, layers = 64, 4, 2, 16, 96, 2
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": 1,
        "dflash_config": {"mask_token_id": 120, "target_layer_ids": [1, 5]},
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_target_layers": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    shapes = {"fc.weight": (hidden, 2 * hidden), "hidden_norm.weight": (hidden,)}
    shapes["norm.weight"] = (hidden,)
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    state = {k: (torch.randn(s) * 0.05).to(torch.bfloat16) for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))

    drafter = DFlashDrafter.from_pretrained(tmp_path)
    assert drafter.block_size == 16
    assert drafter.target_layer_ids == [1, 5] and drafter.mask_token_id == 120
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert torch.equal(
        drafter.layers[1].self_attn.k_norm.weight, state["layers.1.self_attn.k_norm.weight"]
    )
    assert drafter.config.rope_parameters["rope_theta"] == 1000000
    target = qwen3_config(num_hidden_layers=8, intermediate_size=inter)
    drafter.check_compatible(target)
    cache = drafter.new_cache(1)
    cache.append(torch.randn(1, 5, 2 * hidden))
    logits = cache.draft_logits(
        drafter.block_token_ids(torch.tensor([3])),
        torch.nn.Embedding(VOCAB, hidden).to(torch.bfloat16),
        torch.nn.Linear(hidden, VOCAB, bias=False).to(torch.bfloat16),
    )
    assert logits.shape == (1, 15, VOCAB) and torch.isfinite(logits).all()


def test_block_size_may_live_in_dflash_config(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["block_size"] = config.pop("block_size") + 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert DFlashDrafter.from_pretrained(tmp_path).block_size == BLOCK + 4


def test_from_pretrained_rejects_mismatched_weights(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if k != "norm.weight"}
    state["candidate_selector.hidden_projection.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing=\['norm.weight'\].*candidate_selector"):
        DFlashDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"dflash_config": {"target_layer_ids": [1], "conv_kernel_size": 2}}, "conv_kernel"),
        ({"dflash_config": {"target_layer_ids": [1], "projector_type": "domino"}}, "domino"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"block_size": 1}, "block_size"),
    ],
)
def test_unsupported_variants_are_refused(drafter, change, message):
    config = Qwen3Config.from_dict({**drafter.config_dict(), **change})
    with pytest.raises(ValueError, match=message):
        DFlashDrafter(config)


def reference_block_hidden(
    drafter: DFlashDrafter, context: torch.Tensor, block_embeds: torch.Tensor
) -> torch.Tensor:
    """Independent single-request forward built on transformers' Qwen3 RoPE helpers:
    context ``[T, F]``, block embeddings ``[Q, H]`` -> ``[Q, H]``."""
    t, q_len = context.shape[0], block_embeds.shape[0]
    rotary = Qwen3RotaryEmbedding(drafter.config)
    cos, sin = rotary(block_embeds, torch.arange(t + q_len)[None])
    ctx = drafter.hidden_norm(drafter.fc(context))
    x = block_embeds
    for layer in drafter.layers:
        attn = layer.self_attn
        d, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
        h = layer.input_layernorm(x)
        kv_in = torch.cat([ctx, h])
        q = attn.q_norm(attn.q_proj(h).view(q_len, heads, d)).transpose(0, 1)[None]
        k = attn.k_norm(attn.k_proj(kv_in).view(t + q_len, kv_heads, d)).transpose(0, 1)[None]
        v = attn.v_proj(kv_in).view(t + q_len, kv_heads, d).transpose(0, 1)
        q = apply_rotary_pos_emb(q, q, cos[:, t:], sin[:, t:])[0][0]
        k = apply_rotary_pos_emb(k, k, cos, sin)[0][0]
        k, v = (z.repeat_interleave(heads // kv_heads, dim=0) for z in (k, v))
        probs = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1)
        x = x + attn.o_proj((probs @ v).transpose(0, 1).reshape(q_len, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def test_matches_independent_reference_forward(target, drafter):
    ids = torch.randint(0, VOCAB, (1, 7))
    feats = features_of(target, drafter, ids)
    block = drafter.block_token_ids(torch.tensor([9]))
    cache = drafter.new_cache(1)
    cache.append(feats)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        expected = reference_block_hidden(drafter, feats[0], embed(block[0]))
    torch.testing.assert_close(cache.draft_hidden(block, embed)[0], expected)


def test_block_attention_is_non_causal(target, drafter):
    feats = features_of(target, drafter, torch.randint(0, VOCAB, (1, 6)))
    block = drafter.block_token_ids(torch.tensor([4]))
    changed = block.clone()
    changed[0, 3] = 17  # a later slot's input
    cache = drafter.new_cache(1)
    cache.append(feats)
    embed, head = target.get_input_embeddings(), target.lm_head
    base, other = cache.draft_logits(block, embed, head), cache.draft_logits(changed, embed, head)
    assert not torch.allclose(base[0, 0], other[0, 0])  # slot 1 sees slot 3


def test_block_sees_only_appended_context(target, drafter):
    feats = features_of(target, drafter, torch.randint(0, VOCAB, (1, 8)))
    garbage = feats.clone()
    garbage[:, 5:] = 1e3 * torch.randn_like(garbage[:, 5:])
    anchor = torch.tensor([3])
    only_five = draft_logits(target, drafter, feats[:, :5], None, anchor)
    torch.testing.assert_close(draft_logits(target, drafter, garbage, [5], anchor), only_five)
    changed = feats[:, :5].clone()
    changed[:, 0] += 1.0
    assert not torch.allclose(draft_logits(target, drafter, changed, None, anchor), only_five)


def test_append_in_chunks_equals_one_chunk(target, drafter):
    feats = features_of(target, drafter, torch.randint(0, VOCAB, (2, 10)))
    anchors = torch.tensor([7, 8])
    one = draft_logits(target, drafter, feats, [10, 7], anchors)
    cache = drafter.new_cache(2)
    cache.append(feats[:, :4], [4, 2])  # request 1 commits 2, then 5 more tokens
    second = torch.stack([feats[0, 4:10], torch.cat([feats[1, 2:7], feats[1, :1]])])
    cache.append(second, [6, 5])
    assert cache.lengths.tolist() == [10, 7]
    blocks = drafter.block_token_ids(anchors)
    chunks = cache.draft_logits(blocks, target.get_input_embeddings(), target.lm_head)
    torch.testing.assert_close(chunks, one)


def test_padded_batch_matches_single_requests(target, drafter):
    lengths = [5, 11, 2]
    per_request = [
        features_of(target, drafter, torch.randint(0, VOCAB, (1, n)))[0] for n in lengths
    ]
    padded, counts = pad_features(per_request)
    anchors = torch.tensor([3, 50, 7])
    batch = draft_logits(target, drafter, padded, counts, anchors)
    for i, feats in enumerate(per_request):
        alone = draft_logits(target, drafter, feats[None], None, anchors[i : i + 1])
        torch.testing.assert_close(batch[i : i + 1], alone)


def test_keep_selects_requests(target, drafter):
    per_request = [features_of(target, drafter, torch.randint(0, VOCAB, (1, n)))[0] for n in (3, 6)]
    padded, counts = pad_features(per_request)
    cache = drafter.new_cache(2)
    cache.append(padded, counts)
    cache.keep([1])
    blocks = drafter.block_token_ids(torch.tensor([5]))
    kept = cache.draft_logits(blocks, target.get_input_embeddings(), target.lm_head)
    alone = draft_logits(target, drafter, per_request[1][None], None, torch.tensor([5]))
    torch.testing.assert_close(kept, alone)


def test_topk_is_sorted_and_consistent(target, drafter):
    feats = features_of(target, drafter, torch.randint(0, VOCAB, (2, 5)))
    cache = drafter.new_cache(2)
    cache.append(feats)
    blocks = drafter.block_token_ids(torch.tensor([1, 2]))
    embed, head = target.get_input_embeddings(), target.lm_head
    log_probs, token_ids = cache.draft_topk(blocks, embed, head, k=6)
    assert log_probs.shape == token_ids.shape == (2, BLOCK - 1, 6)
    assert (log_probs[..., :-1] >= log_probs[..., 1:]).all()
    full = torch.log_softmax(cache.draft_logits(blocks, embed, head), dim=-1)
    torch.testing.assert_close(full.gather(-1, token_ids), log_probs)
    assert torch.equal(token_ids[..., 0], full.argmax(-1))


def test_check_compatible_reports_mismatches(drafter):
    with pytest.raises(ValueError, match="hidden size mismatch"):
        drafter.check_compatible(qwen3_config(hidden_size=32, num_attention_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="vocab size mismatch"):
        drafter.check_compatible(qwen3_config(vocab_size=256))
    with pytest.raises(ValueError, match="num_target_layers mismatch"):
        drafter.check_compatible(qwen3_config(num_hidden_layers=6))
    config = qwen3_config()
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\] out of range"):
        DFlashDrafter.random_init(config, num_layers=1, block_size=BLOCK, target_layer_ids=[4])
    with pytest.raises(ValueError, match="mask_token_id 128 outside the target vocabulary"):
        DFlashDrafter.random_init(config, num_layers=1, block_size=BLOCK, mask_token_id=VOCAB)


def test_random_init_is_seeded(target):
    a = DFlashDrafter.random_init(target.config, num_layers=1, block_size=BLOCK, seed=3)
    b = DFlashDrafter.random_init(target.config, num_layers=1, block_size=BLOCK, seed=3)
    c = DFlashDrafter.random_init(target.config, num_layers=1, block_size=BLOCK, seed=4)
    assert torch.equal(a.fc.weight, b.fc.weight) and not torch.equal(a.fc.weight, c.fc.weight)
    assert a.target_layer_ids == [2]


def test_llama_target_without_head_dim(tmp_path):
    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=16384,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(config).eval()
    config.head_dim = None  # older Llama configs carry none: derived as 48 // 4
    drafter = DFlashDrafter.random_init(config, num_layers=2, block_size=BLOCK, seed=0)
    assert drafter.layers[0].self_attn.head_dim == 12
    assert drafter.target_layer_ids == [1, 2]
    assert drafter.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(0, VOCAB, (1, 6))
    feats = features_of(llama, drafter, ids)
    cache = drafter.new_cache(1)
    cache.append(feats)
    block = drafter.block_token_ids(ids[:, -1])
    embed = llama.get_input_embeddings()
    with torch.no_grad():
        expected = reference_block_hidden(drafter, feats[0], embed(block[0]))
    torch.testing.assert_close(cache.draft_hidden(block, embed)[0], expected)
    log_probs, _ = cache.draft_topk(block, embed, llama.lm_head, k=3)
    assert log_probs.shape == (1, BLOCK - 1, 3)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.rope_parameters == drafter.config.rope_parameters
    reloaded = loaded.new_cache(1)
    reloaded.append(feats)
    torch.testing.assert_close(
        reloaded.draft_hidden(block, embed), cache.draft_hidden(block, embed)
    )
