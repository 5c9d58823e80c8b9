"""Cached target features, the shortlist loss, held-out acceptance and stop rules of the DFlash
training recipe (tiny models, a few steps each)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.models import feature_cache as cache_module
from sglang_tree_spec.models import train_dflash as train_module
from sglang_tree_spec.models.feature_cache import build_feature_cache, window_records
from sglang_tree_spec.models.train_dflash import (
    TRAINER_STATE_NAME,
    Batch,
    HeldOut,
    TrainConfig,
    add_train_drafter_args,
    block_candidates,
    block_hidden,
    block_labels,
    block_loss,
    heldout_acceptance,
    run_train_drafter,
    sample_anchors,
    shortlist_block_loss,
    train_dflash,
    valid_anchor_positions,
)

VOCAB = 512
PERIOD = 16


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    model.requires_grad_(False)
    return model


def records(count: int, length: int, seed: int, prompt: int = 6):
    """Rotations of a fixed cycle (x_{t+1} is a function of x_t), loss mask after ``prompt``."""
    generator = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(123))[:PERIOD]
    starts = torch.randint(PERIOD, (count,), generator=generator)
    out = []
    for s in starts.tolist():
        ids = cycle[(s + torch.arange(length)) % PERIOD]
        out.append((ids, torch.arange(length) >= prompt))
    return out


def config(target_dir, out, **overrides) -> TrainConfig:
    data = records(24, 32, seed=0)
    settings = dict(
        target=str(target_dir), out_dir=str(out), data=[ids.tolist() for ids, _ in data],
        loss_masks=[m.int().tolist() for _, m in data], block_size=4, num_layers=1, steps=6,
        batch_size=4, seq_len=32, lr=3e-3, anchors_per_seq=8, log_every=1, save_every=100,
        feature_cache=str(out / "cache"), shortlist_negatives=64, cache_topk=4,
    )  # fmt: skip
    settings.update(overrides)
    return TrainConfig(**settings)


def read_log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def test_window_records_splits_long_records():
    ids = torch.arange(25)
    windows = window_records([(ids, ids > 2)], seq_len=10, min_len=4)
    assert [w.tolist() for w, _ in windows] == [
        list(range(10)),
        list(range(10, 20)),
        [20, 21, 22, 23, 24],
    ]
    assert window_records([(ids, ids > 2)], seq_len=10, min_len=5)[-1][0][0] == 10  # 5 dropped


def test_cache_holds_target_features_and_topk(target, target_dir, tmp_path):
    data = records(5, 30, seed=1) + records(2, 17, seed=2)
    cache = build_feature_cache(
        tmp_path, data, target, str(target_dir), [0, 1], topk=3, batch_size=3
    )
    assert cache.num_records == 7
    assert cache.bytes_on_disk == cache.offsets[-1] * (2 * 64 + 4 * 3)
    for index, (ids, mask) in enumerate(data):
        with torch.no_grad():
            out = target(ids[None], output_hidden_states=True)
        expected = torch.cat([out.hidden_states[1], out.hidden_states[2]], dim=-1)[0]
        features = cache.features(index)
        assert features.dtype == torch.bfloat16
        torch.testing.assert_close(features.float(), expected.to(torch.bfloat16).float())
        topk = cache.topk_ids(index)
        assert torch.equal(topk[mask], out.logits[0][mask].topk(3, dim=-1).indices)
        assert (topk[~mask] == 0).all()


class CountingTarget(torch.nn.Module):
    def __init__(self, target, fail_after: int | None = None):
        super().__init__()
        self.target, self.calls, self.fail_after = target, 0, fail_after
        self.config = target.config

    def forward(self, **kwargs):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt
        self.calls += 1
        return self.target(**kwargs)

    def get_output_embeddings(self):
        return self.target.get_output_embeddings()


def test_cache_build_resumes_after_interruption_and_is_reused(target, target_dir, tmp_path):
    data = records(7, 20, seed=3)
    straight = build_feature_cache(
        tmp_path / "a", data, target, str(target_dir), [1], topk=2, batch_size=2
    )

    interrupted = CountingTarget(target, fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(
            tmp_path / "b", data, interrupted, str(target_dir), [1], topk=2, batch_size=2
        )
    with (tmp_path / "b" / cache_module.FEATURES_NAME).open("ab") as handle:
        handle.write(b"\x01" * 1000)  # a half-written record after the last commit
    resumed_target = CountingTarget(target)
    resumed = build_feature_cache(
        tmp_path / "b", data, resumed_target, str(target_dir), [1], topk=2, batch_size=2
    )
    assert resumed_target.calls == 2  # records 4..6 only, in batches of 2
    for name in (cache_module.FEATURES_NAME, cache_module.TOPK_NAME):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert resumed.offsets == straight.offsets

    again = CountingTarget(target)
    build_feature_cache(tmp_path / "b", data, again, str(target_dir), [1], topk=2, batch_size=2)
    assert again.calls == 0  # finished and matching: reused
    other = CountingTarget(target)
    build_feature_cache(tmp_path / "b", data[:3], other, str(target_dir), [1], topk=2, batch_size=2)
    assert other.calls == 2  # other records: rebuilt


def test_cache_of_a_prefix_is_extended_with_appended_records(target, target_dir, tmp_path):
    data = records(7, 20, seed=3)
    straight = build_feature_cache(
        tmp_path / "a", data, target, str(target_dir), [1], topk=2, batch_size=2
    )
    build_feature_cache(tmp_path / "b", data[:4], target, str(target_dir), [1], topk=2)
    extending = CountingTarget(target)
    extended = build_feature_cache(
        tmp_path / "b", data, extending, str(target_dir), [1], topk=2, batch_size=2
    )
    assert extending.calls == 2  # records 4..6 only
    for name in (cache_module.FEATURES_NAME, cache_module.TOPK_NAME):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert extended.offsets == straight.offsets
    again = CountingTarget(target)
    build_feature_cache(tmp_path / "b", data, again, str(target_dir), [1], topk=2, batch_size=2)
    assert again.calls == 0  # the extended cache is the whole data's

    changed = [data[1], data[0], *data[2:]]  # same records, another order: not a prefix
    build_feature_cache(tmp_path / "c", data[:4], target, str(target_dir), [1], topk=2)
    rebuilt = CountingTarget(target)
    build_feature_cache(tmp_path / "c", changed, rebuilt, str(target_dir), [1], 2, batch_size=2)
    assert rebuilt.calls == 4  # all 7 records


# ---------------------------------------------------------------------------------------------
# Shortlist loss
# ---------------------------------------------------------------------------------------------


def loss_setup(target, seed: int):
    drafter = DFlashDrafter.random_init(target.config, num_layers=1, block_size=4, seed=seed)
    data = records(4, 30, seed=seed)
    input_ids = torch.stack([ids for ids, _ in data])
    loss_mask = torch.stack([m for _, m in data])
    lengths = torch.full((4,), 30)
    generator = torch.Generator().manual_seed(seed)
    valid = valid_anchor_positions(lengths, loss_mask, 4)
    anchors, keep = sample_anchors(valid, 6, generator)
    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
    features = drafter.target_hidden_features(out.hidden_states)
    topk = out.logits.topk(8, dim=-1).indices
    labels, weights = block_labels(input_ids, loss_mask, anchors, keep, 4, gamma=7.0)

    def hidden():
        return block_hidden(drafter, features, input_ids, anchors, target.get_input_embeddings())

    return drafter, hidden, labels, weights, block_candidates(topk, anchors, 4)[keep]


def grads(drafter, loss) -> torch.Tensor:
    drafter.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in drafter.parameters()])


def test_shortlist_of_the_whole_vocabulary_is_the_full_loss(target):
    drafter, hidden, labels, weights, candidates = loss_setup(target, seed=4)
    full, full_correct, full_counted = block_loss(hidden(), labels, weights, target.lm_head)
    full_grad = grads(drafter, full)
    short, correct, counted = shortlist_block_loss(
        hidden(), labels, weights, target.lm_head, VOCAB, torch.Generator(), candidates
    )
    torch.testing.assert_close(short, full)
    torch.testing.assert_close(grads(drafter, short), full_grad)
    assert torch.equal(correct, full_correct) and torch.equal(counted, full_counted)


def test_shortlist_gradient_follows_the_full_gradient(target):
    """A quarter of the vocabulary (labels + target top-8 + sampled negatives) gives a gradient
    close to the full one: cosine above 0.95 on every batch."""
    for seed in range(3):
        drafter, hidden, labels, weights, candidates = loss_setup(target, seed=seed)
        full = grads(drafter, block_loss(hidden(), labels, weights, target.lm_head)[0])
        generator = torch.Generator().manual_seed(seed)
        loss = shortlist_block_loss(
            hidden(), labels, weights, target.lm_head, 96, generator, candidates
        )[0]
        cosine = torch.nn.functional.cosine_similarity(full, grads(drafter, loss), dim=0)
        assert cosine > 0.95, (seed, cosine)


def test_corrected_negatives_estimate_the_full_loss(target):
    """The sampled negatives' ``log(rest / drawn)`` correction makes the shortlist loss an
    estimate of the full loss (without it, the loss misses the unsampled tokens' mass)."""
    _, hidden, labels, weights, _ = loss_setup(target, seed=5)
    with torch.no_grad():
        states = hidden()
        full = block_loss(states, labels, weights, target.lm_head)[0]
        draws = [
            shortlist_block_loss(
                states, labels, weights, target.lm_head, 64, torch.Generator().manual_seed(i)
            )[0]
            for i in range(20)
        ]
    assert abs(torch.stack(draws).mean() - full) < 0.02 * full, (full, draws[:3])


def test_block_candidates_are_the_predictions_of_each_label():
    topk = torch.arange(10)[None, :, None] * 10 + torch.arange(2)  # position t: [10t, 10t + 1]
    picked = block_candidates(topk, torch.tensor([[3, 5]]), block_size=3)
    assert picked[0, 0].tolist() == [[30, 31], [40, 41]]  # slot 1 of anchor 3 <- position 3
    assert picked[0, 1].tolist() == [[50, 51], [60, 61]]


# ---------------------------------------------------------------------------------------------
# Training with the cache
# ---------------------------------------------------------------------------------------------


def test_cached_shortlist_training_learns_and_reports_heldout_acceptance(target_dir, tmp_path):
    out = tmp_path / "run"
    train_dflash(
        config(target_dir, out, steps=60, lr=1e-2, log_every=10, heldout_records=4, eval_every=30)
    )
    log = read_log(out)
    train = [r for r in log if "loss" in r]
    heldout = [r for r in log if "heldout_acc_slot1" in r]
    assert train[-1]["loss"] < train[0]["loss"] - 0.3, train
    assert [r["step"] for r in heldout] == [0, 30, 60]  # 0: before training
    assert heldout[-1]["heldout_acc_slot1"] > 0.5, heldout  # chance is 1 / 512
    assert heldout[-1]["heldout_blocks"] == 4 * 8
    assert (out / "cache" / cache_module.FEATURES_NAME).stat().st_size > 0


def test_heldout_acceptance_counts_leading_matches(target, monkeypatch):
    """Block 0 drafts [hit, miss, hit] (1 accepted), block 1 [miss, hit, hit] (0): slot-1
    acceptance 1/2, chain tau 1 + 1/2."""
    vocab = 32
    drafted = torch.tensor([[[0, 3, 0, 5], [0, 0, 10, 11]]])  # slot 0 (the anchor) is unused

    def one_hot_hidden(*args):
        return torch.nn.functional.one_hot(drafted, vocab).float()

    monkeypatch.setattr(train_module, "block_hidden", one_hot_hidden)
    head = torch.nn.Linear(vocab, vocab, bias=False)
    head.weight.data = torch.eye(vocab)
    fake_target = type("T", (), {"get_input_embeddings": lambda self: None})()
    fake_target.get_output_embeddings = lambda: head
    drafter = DFlashDrafter.random_init(target.config, num_layers=1, block_size=4, seed=0)
    ids = torch.arange(20)[None]
    batch = Batch(
        ids, torch.tensor([20]), torch.ones(1, 20, dtype=torch.bool), torch.zeros(1, 20, 64)
    )
    heldout = HeldOut([(batch, torch.tensor([[2, 8]]), torch.tensor([[True, True]]))])
    result = heldout_acceptance(drafter, fake_target, heldout)
    assert result == {"heldout_acc_slot1": 0.5, "heldout_tau": 1.5, "heldout_blocks": 2}


def test_cached_run_stopped_and_resumed_equals_a_straight_run(target_dir, tmp_path):
    straight = train_dflash(config(target_dir, tmp_path / "straight"))
    staged = tmp_path / "staged"
    train_dflash(config(target_dir, staged, stop_at=3))
    train_dflash(config(target_dir, staged))
    assert [r["step"] for r in read_log(staged)] == [1, 2, 3, 4, 5, 6]
    a, b = load_file(straight / "model.safetensors"), load_file(staged / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stop_when_heldout_acceptance_is_reached(target_dir, tmp_path):
    out = tmp_path / "run"
    cfg = config(target_dir, out, steps=200, heldout_records=4, eval_every=5, stop_heldout_acc=0.6)
    train_dflash(cfg)
    log = read_log(out)
    stop = [r for r in log if "stopped" in r]
    assert len(stop) == 1 and stop[0]["step"] < 200, log[-3:]
    last_eval = [r for r in log if "heldout_acc_slot1" in r][-1]
    assert last_eval["heldout_acc_slot1"] >= 0.6 and last_eval["step"] == stop[0]["step"]
    state = torch.load(out / TRAINER_STATE_NAME, weights_only=True)
    assert state["step"] == stop[0]["step"]
    assert [r["heldout_acc_slot1"] for r in log if "heldout_acc_slot1" in r][-2] < 0.6


def test_full_loss_steps_then_shortlist(target_dir, tmp_path, monkeypatch):
    calls = []
    original = train_module.shortlist_block_loss

    def spy(*args, **kwargs):
        calls.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(train_module, "shortlist_block_loss", spy)
    train_dflash(config(target_dir, tmp_path / "run", steps=5, full_loss_steps=3))
    assert len(calls) == 2  # steps 4 and 5


def test_stop_after_minutes(target_dir, tmp_path):
    out = tmp_path / "run"
    train_dflash(config(target_dir, out, steps=50, max_minutes=0.0))
    assert torch.load(out / TRAINER_STATE_NAME, weights_only=True)["step"] == 1
    assert read_log(out)[-1] == {"step": 1, "stopped": "0.0 minutes of training"}


def test_cli_passes_the_new_options(target_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    lines = [
        json.dumps({"input_ids": ids.tolist(), "loss_mask": m.int().tolist()})
        for ids, m in records(6, 30, seed=7)
    ]
    data.write_text("\n".join(lines) + "\n")
    parser = argparse.ArgumentParser()
    add_train_drafter_args(parser)
    out = tmp_path / "drafter"
    args = parser.parse_args(
        [
            *("--target", str(target_dir), "--out", str(out), "--data", str(data)),
            *("--block-size", "4", "--steps", "2", "--batch-size", "2", "--seq-len", "24"),
            *("--feature-cache", str(tmp_path / "cache"), "--cache-topk", "3"),
            *("--shortlist-negatives", "32", "--heldout-records", "2", "--eval-every", "1"),
            *("--max-minutes", "60", "--stop-heldout-acc", "1.01", "--log-every", "1"),
            *("--full-loss-steps", "1", "--teacher-labels"),
        ]
    )
    assert run_train_drafter(args) == 0
    log = read_log(out)
    assert sum("heldout_tau" in r for r in log) == 3  # before step 1, after steps 1 and 2
    settings = torch.load(out / TRAINER_STATE_NAME, weights_only=True)["config"]
    expected = dict(
        feature_cache=str(tmp_path / "cache"), cache_topk=3, shortlist_negatives=32,
        heldout_records=2, eval_every=1, max_minutes=60.0, stop_heldout_acc=1.01,
        full_loss_steps=1, teacher_labels=True,
    )  # fmt: skip
    assert {k: settings[k] for k in expected} == expected
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["topk"] == 3 and meta["records"] == 12  # windows of 24 + 6 tokens


# ---------------------------------------------------------------------------------------------
# Teacher labels (data the target did not write) and the cache's exact top-k
# ---------------------------------------------------------------------------------------------


def test_teacher_labels_follow_the_targets_greedy_path_only():
    """Data x = 10..17; the target's greedy choice after position t is top1[t]. Anchor 2: slot 1
    is top1[2] = 13 (= x_3: on the greedy path), slot 2 top1[3] = 99 (x_4 = 14 is not what
    the target writes), slot 3 is off the greedy path (it follows 99, not 14): weight 0.
    Anchor 4: slot 2 is predicted at position 5, outside the loss mask (no top-k cached
    there): weight 0, and so is slot 3 behind it."""
    ids = torch.arange(10, 18)[None]
    loss_mask = torch.ones(1, 8, dtype=torch.bool)
    loss_mask[0, 5] = False
    top1 = torch.tensor([[11, 12, 13, 99, 15, 0, 17, 0]])
    anchors, keep = torch.tensor([[2, 4]]), torch.tensor([[True, True]])
    labels, weights = block_labels(ids, loss_mask, anchors, keep, 4, gamma=2.0, target_top1=top1)
    decay = math.exp(-1 / 2.0)
    assert labels.tolist() == [[[12, 13, 99, 15], [14, 15, 0, 17]]]
    assert torch.allclose(weights, torch.tensor([[[0, 1, decay, 0], [0, 1, 0, 0]]]))
    data_labels, _ = block_labels(ids, loss_mask, anchors, keep, 4, gamma=2.0)
    assert data_labels.tolist() == [[[12, 13, 14, 15], [14, 15, 16, 17]]]


def test_teacher_labels_teach_the_targets_choices_on_data_it_did_not_write(target_dir, tmp_path):
    """Uniform random tokens of 16 ids: their next token cannot be learnt, the target's greedy
    choice after them can. Trained on the data's tokens slot 1 stays near chance (1 / 16);
    trained on the target's cached top-1 it learns the target's choice."""
    generator = torch.Generator().manual_seed(5)
    alphabet = torch.randperm(VOCAB, generator=generator)[:16]
    data = alphabet[torch.randint(16, (24, 32), generator=generator)].tolist()
    accuracy = {}
    for teacher in (False, True):
        out = tmp_path / f"teacher_{teacher}"
        cfg = config(
            target_dir, out, data=data, loss_masks=None, steps=150, lr=1e-2, log_every=30,
            teacher_labels=teacher,
        )  # fmt: skip
        train_dflash(cfg)
        accuracy[teacher] = read_log(out)[-1]["acc_slot1"]
    assert accuracy[False] < 0.2 and accuracy[True] > 0.45, accuracy


def test_teacher_labels_need_a_cached_top1(target_dir, tmp_path):
    with pytest.raises(ValueError, match="teacher_labels needs a feature_cache"):
        train_dflash(config(target_dir, tmp_path, feature_cache=None, teacher_labels=True))


def test_a_bfloat16_cache_ranks_top_k_by_float32_logits():
    """Logits 16.0625 and 16 round to the same bfloat16 (its step there is 0.125), and a
    bfloat16 top-k puts id 1 first; the cache re-scores in float32: id 0 first."""
    head = torch.nn.Linear(2, 6, bias=False).to(torch.bfloat16)
    head.weight.data = torch.tensor(
        [[16, 0.0625], [16, 0], [1, 0], [2, 0], [3, 0], [4, 0]], dtype=torch.bfloat16
    )
    final = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    assert head(final).topk(2).indices.tolist() == [[1, 0]]  # tied in bfloat16
    assert cache_module._exact_topk(final, head, 2).tolist() == [[0, 1]]
    assert cache_module._exact_topk(final.float(), head, 3).tolist() == [[0, 1, 5]]
