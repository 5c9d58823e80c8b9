"""``models shaped-pair``: a target and DFlash drafter of a model's shape, random weights.

The files must be what their configs say (transformers loads the target with no missing or
unexpected weight, the parameter count is the shape's, the drafter loads and reads the layers
its config names) and SGLang must serve them as it serves a real pair: a DDTREE server on a
tiny shaped pair gives the same greedy tokens as no speculation, on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_sglang_ddtree import running_server, server_command
from transformers import AutoModelForCausalLM

from sglang_tree_spec.cli import main as cli
from sglang_tree_spec.control import MODEL_SHAPES, ModelShape
from sglang_tree_spec.engine.loading import load_drafter
from sglang_tree_spec.models.shaped_pair import write_shaped_pair
from sglang_tree_spec.server_process import free_port

TINY = ModelShape("tiny", 0.0, layers=4, hidden=64, q_heads=4, kv_heads=2, head_dim=16, ffn=128,
                  vocab=4096, tied_embeddings=False)  # fmt: skip
BLOCK = 8


def expected_params(shape: ModelShape) -> int:
    attention = shape.hidden * shape.head_dim * (2 * shape.q_heads + 2 * shape.kv_heads)
    layer = attention + 3 * shape.hidden * shape.ffn + 2 * shape.hidden
    heads = 1 if shape.tied_embeddings else 2
    return shape.layers * layer + heads * shape.vocab * shape.hidden + shape.hidden


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return write_shaped_pair(TINY, tmp_path_factory.mktemp("shaped"), block=BLOCK)


def test_the_files_are_the_shape(tiny_pair):
    target, info = AutoModelForCausalLM.from_pretrained(
        tiny_pair["target"], output_loading_info=True
    )
    assert not any(info.values()), info
    assert sum(p.numel() for p in target.parameters()) == expected_params(TINY)
    assert target.config.vocab_size == TINY.vocab and target.config.num_key_value_heads == 2
    index = json.loads((tiny_pair["target"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == TINY.layers + 2  # embed, layers, head
    config = json.loads((tiny_pair["drafter"] / "config.json").read_text())
    assert config["block_size"] == BLOCK
    assert config["dflash_config"]["target_layer_ids"] == [1, TINY.layers - 2]
    drafter = load_drafter(tiny_pair["drafter"], torch.device("cpu"), torch.float32)
    assert drafter is not None


def test_the_shipped_shapes_have_their_parameter_count(tmp_path):
    """The 135M shape written through the CLI: its parameters are the shape's own figure."""
    assert cli(["models", "shaped-pair", "--shape", "smollm2-135m", "--out", str(tmp_path)]) == 0
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    shape = MODEL_SHAPES["smollm2-135m"]
    assert sum(p.numel() for p in target.parameters()) == expected_params(shape)
    assert abs(expected_params(shape) - shape.params) < 0.01 * shape.params


def test_sglang_serves_a_shaped_pair_greedy_exact(tiny_pair, tmp_path):
    prompts = [[5, 17, 300, 42, 7, 1000, 3, 9] * 4, [11, 12, 13, 14] * 6]
    outputs = {}
    for name, budget in (("none", None), ("ddtree", 8)):
        command = server_command(tiny_pair, free_port(), budget)
        for server in running_server(command, tmp_path / f"{name}.log"):
            outputs[name] = server.greedy(prompts, 2)
    assert outputs["ddtree"] == outputs["none"]
    assert all(len(tokens) > 1 for tokens in outputs["none"])
