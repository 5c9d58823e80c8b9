"""DFlash training recipe: block masks, train/inference parity, learning and resuming."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.drafters.dflash import _apply_rope
from sglang_tree_spec.models import train_dflash as train_module
from sglang_tree_spec.models.train_dflash import (
    TRAINER_STATE_NAME,
    TrainConfig,
    add_train_drafter_args,
    block_attention_mask,
    block_hidden,
    block_labels,
    run_train_drafter,
    train_dflash,
    valid_anchor_positions,
)

VOCAB = 128
BLOCK = 4
PERIOD = 16
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    config = Qwen3Config(num_hidden_layers=2, **TINY)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir).eval()


def periodic_sequences(count: int, length: int, seed: int) -> list[list[int]]:
    """Rotations of one fixed cycle of ``PERIOD`` distinct tokens: x_{t+1} is a function of x_t."""
    generator = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(123))[:PERIOD].tolist()
    starts = torch.randint(PERIOD, (count,), generator=generator).tolist()
    return [[cycle[(s + j) % PERIOD] for j in range(length)] for s in starts]


def train_config(target_dir, out_dir, **overrides) -> TrainConfig:
    kwargs = dict(
        target=str(target_dir),
        out_dir=str(out_dir),
        data=periodic_sequences(32, 48, seed=0),
        block_size=BLOCK,
        num_layers=1,
        steps=80,
        batch_size=8,
        seq_len=40,
        lr=3e-3,
        anchors_per_seq=8,
        log_every=10,
        save_every=1000,
    )
    kwargs.update(overrides)
    return TrainConfig(**kwargs)


def read_log(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "train_log.jsonl").read_text().splitlines()]


def test_block_attention_mask_layout():
    mask = block_attention_mask(torch.tensor([[2, 4]]), context_len=5, block_size=2)
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0], expected)


def test_anchors_and_labels_respect_loss_mask():
    lengths = torch.tensor([8])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    valid = valid_anchor_positions(lengths, loss_mask, block_size=3)
    assert valid[0].nonzero().flatten().tolist() == [3, 4, 5]
    input_ids = torch.arange(10, 18)[None]
    labels, weights = block_labels(
        input_ids, loss_mask, torch.tensor([[2, 4]]), torch.tensor([[True, False]]), 3, gamma=7.0
    )
    assert labels.tolist() == [[[12, 13, 14], [14, 15, 16]]]
    decay = torch.exp(torch.tensor(-1 / 7.0))
    torch.testing.assert_close(weights[0, 0], torch.tensor([0.0, 1.0, decay.item()]))
    assert weights[0, 1].sum() == 0  # dropped block


def parity_setup(target, seed: int = 0):
    drafter = DFlashDrafter.random_init(
        target.config, num_layers=2, block_size=BLOCK, seed=seed, target_layer_ids=[0, 1]
    )
    input_ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        features = drafter.target_hidden_features(
            target(input_ids, output_hidden_states=True).hidden_states
        )
    return drafter.eval(), input_ids, features


def training_logits(target, drafter, features, input_ids, anchors) -> torch.Tensor:
    with torch.no_grad():
        hidden = block_hidden(drafter, features, input_ids, anchors, target.get_input_embeddings())
        return target.lm_head(hidden)


def test_training_forward_matches_inference(target):
    drafter, input_ids, features = parity_setup(target)
    anchors = torch.tensor([[11, 3, 7]])
    logits = training_logits(target, drafter, features, input_ids, anchors)
    for n, anchor in enumerate(anchors[0].tolist()):
        cache = drafter.new_cache(1)
        cache.append(features[:, :anchor])
        block = drafter.block_token_ids(input_ids[:, anchor])
        inference = cache.draft_logits(block, target.get_input_embeddings(), target.lm_head)
        torch.testing.assert_close(logits[:, n, 1:], inference)


def test_blocks_are_isolated(target):
    drafter, input_ids, features = parity_setup(target, seed=1)
    anchors = torch.tensor([[5, 12]])
    base = training_logits(target, drafter, features, input_ids, anchors)
    changed_ids = input_ids.clone()
    changed_ids[0, 12] = (changed_ids[0, 12] + 1) % VOCAB  # block 1's anchor token
    changed = training_logits(target, drafter, features, changed_ids, anchors)
    torch.testing.assert_close(changed[:, 0], base[:, 0])
    assert not torch.allclose(changed[:, 1], base[:, 1])


def test_blocks_see_only_context_before_anchor(target):
    drafter, input_ids, features = parity_setup(target, seed=2)
    anchors = torch.tensor([[8, 15]])
    base = training_logits(target, drafter, features, input_ids, anchors)
    later = features.clone()
    later[:, 8:] = 1e3 * torch.randn_like(later[:, 8:])  # the anchor's own feature and after
    torch.testing.assert_close(
        training_logits(target, drafter, later, input_ids, anchors)[:, 0], base[:, 0]
    )
    earlier = features.clone()
    earlier[:, 7] += 1.0
    assert not torch.allclose(
        training_logits(target, drafter, earlier, input_ids, anchors)[:, 0], base[:, 0]
    )


def test_training_reduces_loss_and_learns_slot1(target, target_dir, tmp_path):
    out = train_dflash(train_config(target_dir, tmp_path))
    log = read_log(out)
    assert log[-1]["step"] == 80
    assert log[-1]["loss"] < log[0]["loss"] - 0.5, log
    assert log[-1]["acc_slot1"] > 0.5, log  # chance is 1 / 128

    drafter = DFlashDrafter.from_pretrained(out)  # inference path on held-out sequences
    input_ids = torch.tensor(periodic_sequences(4, 24, seed=99))
    with torch.no_grad():
        out_states = target(input_ids, output_hidden_states=True).hidden_states
    cache = drafter.new_cache(4)
    cache.append(drafter.target_hidden_features(out_states)[:, :20])
    block = drafter.block_token_ids(input_ids[:, 20])
    _, token_ids = cache.draft_topk(block, target.get_input_embeddings(), target.lm_head, 1)
    slot1_acc = (token_ids[:, 0, 0] == input_ids[:, 21]).float().mean().item()
    assert slot1_acc >= 0.75


class Interrupted(Exception):
    pass


def test_resume_continues_from_saved_step(target_dir, tmp_path, monkeypatch):
    """A run stopped right after its step-3 checkpoint resumes at step 4 and ends with the same
    weights as an uninterrupted run (same batches, optimizer state and LR schedule)."""
    straight = tmp_path / "straight"
    train_dflash(train_config(target_dir, straight, steps=6, log_every=1))

    resumed = tmp_path / "resumed"
    cfg = train_config(target_dir, resumed, steps=6, log_every=1, save_every=3)
    original_save = train_module.save_checkpoint

    def save_then_crash(drafter, optimizer, step, config):
        original_save(drafter, optimizer, step, config)
        raise Interrupted

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_crash)
    with pytest.raises(Interrupted):
        train_dflash(cfg)
    monkeypatch.undo()
    assert torch.load(resumed / TRAINER_STATE_NAME, weights_only=True)["step"] == 3
    train_dflash(cfg)

    assert [r["step"] for r in read_log(resumed)] == [1, 2, 3, 4, 5, 6]
    assert torch.load(resumed / TRAINER_STATE_NAME, weights_only=True)["step"] == 6
    expected = load_file(str(straight / "model.safetensors"))
    actual = load_file(str(resumed / "model.safetensors"))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value)


def test_cli_trains_from_jsonl(target_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    records = [
        {"input_ids": ids, "loss_mask": [0] * 8 + [1] * (len(ids) - 8)}
        for ids in periodic_sequences(4, 32, seed=5)
    ]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    parser = argparse.ArgumentParser()
    add_train_drafter_args(parser)
    out = tmp_path / "drafter"
    args = parser.parse_args(
        [
            *("--target", str(target_dir), "--out", str(out), "--data", str(data)),
            *("--block-size", "4", "--steps", "3", "--batch-size", "2", "--seq-len", "24"),
            *("--log-every", "1", "--device", "cpu", "--gamma", "3"),
        ]
    )
    assert run_train_drafter(args) == 0
    assert len(read_log(out)) == 3
    assert DFlashDrafter.from_pretrained(out).block_size == 4


def test_init_from_starts_a_fresh_run_from_a_drafters_weights(target_dir, tmp_path):
    """``init_from`` loads a trained drafter's weights at step 0 (fresh optimizer, schedule from
    the start): with lr 0 the run ends on exactly those weights, and it starts where that drafter
    left off (a lower first loss than a random init); a drafter of another shape is refused."""
    trained = tmp_path / "trained"
    train_dflash(train_config(target_dir, trained, steps=60))
    frozen = tmp_path / "frozen"
    train_dflash(train_config(target_dir, frozen, steps=2, lr=0.0, init_from=str(trained)))
    expected = load_file(str(trained / "model.safetensors"))
    actual = load_file(str(frozen / "model.safetensors"))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value)

    warm, cold = tmp_path / "warm", tmp_path / "cold"
    train_dflash(train_config(target_dir, warm, steps=5, log_every=5, init_from=str(trained)))
    train_dflash(train_config(target_dir, cold, steps=5, log_every=5))
    assert read_log(warm)[0]["step"] == 5  # counted from 0, not from the source's 60
    assert read_log(warm)[0]["loss"] < 0.9 * read_log(cold)[0]["loss"]

    with pytest.raises(ValueError, match="num_layers=1"):
        train_dflash(train_config(target_dir, tmp_path / "x", num_layers=2, init_from=str(trained)))


def deep_target(kind: str):
    """A 4-layer random target: Qwen3 (per-head query/key norms) or Llama (none)."""
    config = (Qwen3Config if kind == "qwen3" else LlamaConfig)(num_hidden_layers=4, **TINY)
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_init_from_target_copies_the_layer_after_the_last_feature_layer(kind):
    """The drafter's one layer starts as target layer 3 (its feature layer is 2): its context
    keys and values are that layer's own on the target's hidden states, its weights and final
    norm the target's; a Llama target's missing per-head norms keep its keys' scale."""
    target = deep_target(kind)
    drafter = DFlashDrafter.random_init(target.config, num_layers=1)
    assert drafter.target_layer_ids == [2]
    ids = torch.tensor(periodic_sequences(1, 24, seed=3)[0])
    assert train_module.init_from_target_layers(drafter, target, ids) == [3]

    with torch.no_grad():
        states = target(ids[None], output_hidden_states=True).hidden_states
        layer = target.model.layers[3]
        x = layer.input_layernorm(states[3])  # the output of layer 2 = the input of layer 3
        key, value = drafter.context_kv(
            drafter.target_hidden_features(states), torch.arange(len(ids))[None]
        )[0]
        attn = layer.self_attn
        expected_v = attn.v_proj(x).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
        torch.testing.assert_close(value, expected_v)
        raw_k = attn.k_proj(x).view(1, len(ids), -1, attn.head_dim)
        if kind == "qwen3":
            cos, sin = drafter.rope(torch.arange(len(ids))[None])
            expected_k = _apply_rope(attn.k_norm(raw_k).transpose(1, 2), cos, sin)
            torch.testing.assert_close(key, expected_k)
        else:  # RoPE keeps norms: the keys' mean per-head RMS is the target's
            rms = key.pow(2).mean(-1).sqrt().mean()
            torch.testing.assert_close(rms, raw_k.pow(2).mean(-1).sqrt().mean())
    draft = drafter.layers[0]
    torch.testing.assert_close(draft.mlp.down_proj.weight, layer.mlp.down_proj.weight)
    torch.testing.assert_close(draft.self_attn.o_proj.weight, attn.o_proj.weight)
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight)


def test_init_from_target_needs_layers_after_the_feature_layer_and_one_starting_point(
    target_dir, tmp_path
):
    """Training from the target's layers starts there (lr 0 keeps them); a drafter whose layers
    would run past the target's last layer, or a run asking for two starting points, fails."""
    deep_dir = tmp_path / "deep"
    deep = deep_target("llama")
    deep.save_pretrained(deep_dir)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(json.dumps({"input_ids": ids}) for ids in periodic_sequences(4, 32, 5))
    )
    parser = argparse.ArgumentParser()
    add_train_drafter_args(parser)
    out = tmp_path / "from-target"
    args = parser.parse_args(
        [
            *("--target", str(deep_dir), "--out", str(out), "--data", str(data)),
            *("--block-size", "4", "--steps", "2", "--batch-size", "2", "--seq-len", "24"),
            *("--lr", "0", "--device", "cpu", "--init-from-target"),
        ]
    )
    assert run_train_drafter(args) == 0
    saved = load_file(str(out / "model.safetensors"))
    torch.testing.assert_close(
        saved["layers.0.mlp.up_proj.weight"], deep.model.layers[3].mlp.up_proj.weight
    )
    with pytest.raises(ValueError, match="init_from_target copies target layers"):
        train_dflash(train_config(target_dir, tmp_path / "a", steps=1, init_from_target=True))
    with pytest.raises(ValueError, match="pick one"):
        train_dflash(
            train_config(
                target_dir, tmp_path / "b", steps=1, init_from=str(tmp_path), init_from_target=True
            )
        )
