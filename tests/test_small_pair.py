"""The committed small target + DFlash drafter pair and its build recipe."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.models.small_pair import (
    BUILD_NAME,
    MASK_TOKEN,
    SMALL_PAIR_DIR,
    SmallPairConfig,
    acceptance_stats,
    add_build_small_pair_args,
    build_small_pair,
    corpus_files,
    function_prompts,
    heldout_prompts,
    is_heldout,
)

TARGET_DIR = SMALL_PAIR_DIR / "target"
DRAFTER_DIR = SMALL_PAIR_DIR / "drafter"
SNIPPET = (
    "class Spam(Base):\n"
    '    """Docstring with \'quotes\' and unicode: é ü ∑."""\n'
    "\n"
    "    def eggs(self, x: int = 3) -> list[int]:\n"
    "\tif x  >  1 :  # odd   spacing\n"
    "            return [x ** 2 for _ in range(x)]\r\n"
    "        return []  \n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET_DIR)


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def drafter():
    return DFlashDrafter.from_pretrained(DRAFTER_DIR, dtype=torch.float32)


def test_committed_pair_is_small_and_recorded():
    record = json.loads((SMALL_PAIR_DIR / BUILD_NAME).read_text())
    sizes = {path: entry["bytes"] for path, entry in record["files"].items()}
    assert sum(sizes.values()) < 10 * 2**20
    for path, size in sizes.items():
        assert (SMALL_PAIR_DIR / path).stat().st_size == size, path


def test_drafter_matches_target(target, drafter, tokenizer):
    drafter.check_compatible(target.config)
    assert drafter.mask_token_id == tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    assert tokenizer.eos_token_id == target.config.eos_token_id


def test_tokenizer_round_trips_code(tokenizer):
    ids = tokenizer(SNIPPET)["input_ids"]
    assert tokenizer.decode(ids) == SNIPPET


def test_heldout_split_is_disjoint_from_training():
    train = corpus_files("train")
    heldout = corpus_files("heldout")
    assert heldout and len(train) > 10 * len(heldout)
    assert not {f.rel for f in train} & {f.rel for f in heldout}
    assert not {f.text for f in train} & {f.text for f in heldout}
    assert all(is_heldout(f.rel, 5) for f in heldout)
    # The committed pair's held-out files (recorded at build time, maybe under another Python
    # version) are held out here too.
    built = json.loads((SMALL_PAIR_DIR / BUILD_NAME).read_text())["corpus"]["heldout_files"]
    assert built and all(is_heldout(rel, 5) for rel in built)
    assert not set(built) & {f.rel for f in train}


def test_function_prompts_cut_after_signature_and_docstring():
    text = 'x = 1\n\n\ndef f(a):\n    """Doc."""\n    return a\n\n\ndef g(): return 2\n'
    assert function_prompts(text) == ['x = 1\n\n\ndef f(a):\n    """Doc."""']


def test_drafter_agrees_with_target_greedy_on_heldout_prompts(target, drafter, tokenizer):
    prompts = heldout_prompts(12)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    stats = acceptance_stats(target, drafter, ids)
    # Chance is 1 / 2048; the build measured slot 1 = 0.65, chain tau = 2.17 over 96 prompts.
    assert stats["slot_accuracy"][0] > 0.4, stats
    assert stats["chain_tau"] > 1.5, stats


def test_build_small_pair_smoke(tmp_path):
    cfg = SmallPairConfig(
        train_files_limit=6,
        vocab_size=300,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        target_steps=3,
        target_batch_size=2,
        target_seq_len=64,
        eval_chunks=2,
        gen_sequences=4,
        gen_prompt_len=16,
        gen_new_tokens=24,
        gen_batch_size=4,
        block_size=4,
        drafter_steps=2,
        drafter_batch_size=2,
        drafter_anchors_per_seq=4,
        eval_prompts=2,
    )
    record = build_small_pair(tmp_path, cfg)
    assert record["config"]["block_size"] == 4
    for path in record["files"]:
        assert (tmp_path / path).is_file()
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    drafter = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    drafter.check_compatible(target.config)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "target")) == 300
    assert json.loads((tmp_path / BUILD_NAME).read_text())["drafter"]["parameters"] > 0


def test_cli_options_cover_the_config():
    parser = argparse.ArgumentParser()
    add_build_small_pair_args(parser)
    args = parser.parse_args(["--out", "x", "--block-size", "16", "--target-lr", "1e-3"])
    assert (args.block_size, args.target_lr, args.seed) == (16, 1e-3, 0)


def test_heldout_prompts_are_shipped_not_read_from_this_python(monkeypatch):
    """The demo's and tests' held-out prompts come from the package, so every machine gets the
    same text (a fresh Debian Python 3.11.2 once printed another tau)."""
    from sglang_tree_spec.models import small_pair

    def no_stdlib(*args, **kwargs):
        raise AssertionError("read the local stdlib")

    monkeypatch.setattr(small_pair, "corpus_files", no_stdlib)
    prompts = small_pair.heldout_prompts(24)
    assert len(prompts) == 24 and len(set(prompts)) == 24
    with pytest.raises(AssertionError, match="local stdlib"):
        small_pair.heldout_prompts(24, heldout_percent=10)  # another split: the live stdlib
