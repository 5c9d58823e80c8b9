"""The SmolLM2-135M-Instruct DFlash drafter: where the demo finds it (cache first, then the
packaged copy) and, when it is packaged, that the shipped files are what BUILD.json records."""

from __future__ import annotations

import hashlib
import json

import pytest

from sglang_tree_spec import demo
from sglang_tree_spec.models import zoo

PACKAGED = demo.PACKAGED_DRAFTER_DIR


def make_target(cache) -> None:
    target = zoo.model_dir(demo.REAL_TARGET)
    target.mkdir(parents=True)
    zoo._write_marker(target, zoo.get_spec(demo.REAL_TARGET))


def test_cache_drafter_first_then_packaged_one(tmp_path, monkeypatch):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "cache"))
    packaged = tmp_path / "assets" / "smollm2-135m-instruct-dflash"
    monkeypatch.setattr(demo, "PACKAGED_DRAFTER_DIR", packaged)
    assert demo.find_real_drafter() is None
    make_target(tmp_path / "cache")
    assert demo.find_real_pair() is None  # no drafter anywhere
    packaged.mkdir(parents=True)
    (packaged / "config.json").write_text("{}")
    target = zoo.model_dir(demo.REAL_TARGET)
    assert demo.find_real_pair() == (target, packaged)
    cached = demo.real_drafter_dir()
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert demo.find_real_pair() == (target, cached)  # a drafter in the cache wins


def test_packaged_drafter_needs_the_target(tmp_path, monkeypatch):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "cache"))
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    (packaged / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "PACKAGED_DRAFTER_DIR", packaged)
    assert demo.find_real_drafter() == packaged
    assert demo.find_real_pair() is None
    assert f"models fetch {demo.REAL_TARGET}" in demo.real_pair_hint()


@pytest.mark.skipif(not (PACKAGED / "config.json").is_file(), reason="no packaged drafter")
def test_packaged_drafter_matches_its_build_record():
    build = json.loads((PACKAGED / "BUILD.json").read_text())
    config = json.loads((PACKAGED / "config.json").read_text())
    weights = PACKAGED / "model.safetensors"
    assert weights.stat().st_size < 25 * 2**20
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == build["sha256"]["model.safetensors"]
    assert config["block_size"] == 16
    assert config["num_hidden_layers"] == build["drafter"]["num_layers"]
    assert config["dflash_config"]["target_layer_ids"] == build["drafter"]["target_layer_ids"]
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152  # SmolLM2-135M


@pytest.mark.skipif(not (PACKAGED / "config.json").is_file(), reason="no packaged drafter")
def test_packaged_token_map_matches_its_build_record():
    """The shipped draft vocabulary (``--speculative-token-map``): what BUILD.json records, a
    valid map of 8,192 distinct SmolLM2 ids, loadable the way SGLang loads it."""
    import torch

    from sglang_tree_spec.tree.draft_vocab import check_token_map

    record = json.loads((PACKAGED / "BUILD.json").read_text())["token_map"]
    path = PACKAGED / record["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256"]
    ids = check_token_map(torch.tensor(torch.load(path, weights_only=True)), 49152, 8, "map")
    assert ids.numel() == record["ids"] == 8192
