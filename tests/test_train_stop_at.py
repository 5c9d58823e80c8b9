"""``TrainConfig.stop_at`` / ``--stop-at``: a run stopped at a step and resumed (even with other
batch settings in between) follows the schedule of ``steps``; a stop and resume with the same
settings ends with the weights of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from sglang_tree_spec.models.train_dflash import TRAINER_STATE_NAME, TrainConfig, train_dflash


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def config(target_dir, out, **overrides) -> TrainConfig:
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(64, (8, 40), generator=generator).tolist()
    settings = dict(
        target=str(target_dir), out_dir=str(out), data=data, block_size=4, num_layers=1,
        steps=6, batch_size=2, seq_len=32, anchors_per_seq=4, log_every=1, save_every=100,
    )  # fmt: skip
    settings.update(overrides)
    return TrainConfig(**settings)


def test_stop_at_then_resume_equals_a_straight_run(target_dir, tmp_path):
    straight = train_dflash(config(target_dir, tmp_path / "straight"))
    staged = tmp_path / "staged"
    train_dflash(config(target_dir, staged, stop_at=4))
    assert torch.load(staged / TRAINER_STATE_NAME, weights_only=True)["step"] == 4
    log = [json.loads(line) for line in (staged / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert log[-1]["lr"] > 0  # the schedule spans `steps`, not `stop_at`
    train_dflash(config(target_dir, staged))
    assert torch.load(staged / TRAINER_STATE_NAME, weights_only=True)["step"] == 6
    a, b = load_file(straight / "model.safetensors"), load_file(staged / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stop_at_with_other_batch_settings_and_past_the_end(target_dir, tmp_path):
    out = tmp_path / "out"
    train_dflash(config(target_dir, out, stop_at=2))
    train_dflash(config(target_dir, out, batch_size=1, anchors_per_seq=2, stop_at=99))
    assert torch.load(out / TRAINER_STATE_NAME, weights_only=True)["step"] == 6
    train_dflash(config(target_dir, out, stop_at=3))  # already past: nothing is trained
    assert torch.load(out / TRAINER_STATE_NAME, weights_only=True)["step"] == 6
