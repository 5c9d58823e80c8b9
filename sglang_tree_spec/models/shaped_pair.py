"""A target and a DFlash drafter of a real model's shape with random weights.

What a GPU's step times depend on -- the latency model's C(batch size, budget) -- is the
target's shape, not its weights. This writes a Llama-architecture target of a
:class:`~sglang_tree_spec.control.ModelShape` (``MODEL_SHAPES``: Llama-3.1-8B, Qwen3-8B's
dimensions, ...) and a DFlash drafter reading two of its layers, with seeded random weights, so
a machine with no network can serve an 8B-sized model through SGLang.

Nothing here is trained: a random drafter's tokens are almost never accepted, so a DDTREE
server on this pair commits about one token a step whatever its budget, and its tokens/s
against no speculation's is the step-time ratio of that shape on that device (the drafter's
forward and the tree work included). The tokenizer is the small pair's (2,048 ids); the
config's vocabulary is the shape's, so the LM head costs what the real one costs (ids past the
tokenizer's are never prompted).

    sglang-tree-spec models shaped-pair --shape llama-3.1-8b --out DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_tree_spec.control import MODEL_SHAPES, ModelShape
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
INIT_STD = 0.02
MAX_POSITIONS = 8192
ROPE_THETA = 500000.0
MASK_TOKEN_ID = 1  # the small pair tokenizer's mask token (its drafter's)


def _draw(shape: tuple[int, ...], generator: torch.Generator, device: str) -> torch.Tensor:
    """Normal(0, INIT_STD) in bfloat16; drawn on ``device`` (a GPU draws 8B numbers quickly)."""
    return (INIT_STD * torch.randn(shape, generator=generator, device=device)).to(torch.bfloat16)


def _layer(prefix: str, shape: ModelShape, generator, device, qk_norm: bool) -> dict:
    """One decoder layer's weights (Llama / Qwen3 names), norms at 1."""
    hidden, heads, kv, head = shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    weights = {
        f"{prefix}.input_layernorm.weight": ones,
        f"{prefix}.post_attention_layernorm.weight": ones.clone(),
        f"{prefix}.self_attn.q_proj.weight": _draw((heads * head, hidden), generator, device),
        f"{prefix}.self_attn.k_proj.weight": _draw((kv * head, hidden), generator, device),
        f"{prefix}.self_attn.v_proj.weight": _draw((kv * head, hidden), generator, device),
        f"{prefix}.self_attn.o_proj.weight": _draw((hidden, heads * head), generator, device),
        f"{prefix}.mlp.gate_proj.weight": _draw((shape.ffn, hidden), generator, device),
        f"{prefix}.mlp.up_proj.weight": _draw((shape.ffn, hidden), generator, device),
        f"{prefix}.mlp.down_proj.weight": _draw((hidden, shape.ffn), generator, device),
    }
    if qk_norm:
        weights[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(head, dtype=torch.bfloat16)
        weights[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(head, dtype=torch.bfloat16)
    return {name: t.cpu() for name, t in weights.items()}


def _dims(shape: ModelShape, layers: int) -> dict:
    """The config fields a target and its drafter share (the drafter's own layer count)."""
    return {
        "dtype": "bfloat16",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.q_heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_STD,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "attention_bias": False,
    }


def target_config(shape: ModelShape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_dims(shape, shape.layers),
        "rms_norm_eps": 1e-5,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tied_embeddings,
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "use_cache": True,
    }


def drafter_config(shape: ModelShape, layers: int, block: int, target_layers: list[int]) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_dims(shape, layers),
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
        "tie_word_embeddings": True,
        "block_size": block,
        "num_target_layers": shape.layers,
        "dflash_config": {"target_layer_ids": target_layers, "mask_token_id": MASK_TOKEN_ID},
    }


def write_shaped_pair(
    shape: ModelShape,
    out: str | Path,
    *,
    drafter_layers: int = 1,
    block: int = 16,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Path]:
    """Write ``out/target`` (one safetensors shard per layer, an index) and ``out/drafter``.

    The drafter reads target layers 1 and ``layers - 2`` (as the shipped SmolLM2 drafter reads
    1 and 27 of 30). Returns ``{"target": ..., "drafter": ...}``.
    """
    if shape.layers < 3:
        raise ValueError(f"shaped-pair: {shape.name} has {shape.layers} layers, 3 at least")
    out = Path(out)
    target_dir, drafter_dir = out / "target", out / "drafter"
    for folder in (target_dir, drafter_dir):
        folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    embed = _draw((shape.vocab, shape.hidden), generator, device)
    shards = [{"model.embed_tokens.weight": embed}]  # then one shard per layer, then the head
    for i in range(shape.layers):
        shards.append(_layer(f"model.layers.{i}", shape, generator, device, qk_norm=False))
    head = {"model.norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16)}
    if not shape.tied_embeddings:
        head["lm_head.weight"] = _draw((shape.vocab, shape.hidden), generator, device)
    shards.append(head)
    weight_map, total = {}, 0
    for n, tensors in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: t.cpu().contiguous() for k, t in tensors.items()}
        save_file(tensors, target_dir / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (target_dir / "config.json").write_text(json.dumps(target_config(shape), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(SMALL_PAIR_DIR / "target" / name, target_dir / name)

    target_layers = [1, shape.layers - 2]
    drafter = {
        "fc.weight": _draw((shape.hidden, shape.hidden * len(target_layers)), generator, device),
        "hidden_norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
        "norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
    }
    for j in range(drafter_layers):
        drafter |= _layer(f"layers.{j}", shape, generator, device, qk_norm=True)
    drafter = {k: t.cpu().contiguous() for k, t in drafter.items()}
    save_file(drafter, drafter_dir / "model.safetensors", metadata={"format": "pt"})
    config = drafter_config(shape, drafter_layers, block, target_layers)
    (drafter_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"target": target_dir, "drafter": drafter_dir}


def add_shaped_pair_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, choices=sorted(MODEL_SHAPES),
                        help="a model shape of control.MODEL_SHAPES")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="writes OUT/target, OUT/drafter")
    parser.add_argument("--drafter-layers", type=int, default=1)
    parser.add_argument("--block", type=int, default=16, help="the drafter's block size")
    parser.add_argument("--device", default="cpu", help="where the random numbers are drawn")
    parser.add_argument("--seed", type=int, default=0)


def run_shaped_pair(args: argparse.Namespace) -> int:
    shape = MODEL_SHAPES[args.shape]
    paths = write_shaped_pair(
        shape, args.out, drafter_layers=args.drafter_layers, block=args.block,
        device=args.device, seed=args.seed,
    )  # fmt: skip
    print(f"shaped-pair: {shape.name}-shaped target {paths['target']}, drafter {paths['drafter']}")
    return 0
