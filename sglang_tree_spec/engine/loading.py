"""Load a target (transformers) and a DFlash drafter for the reference engine."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from sglang_tree_spec.drafters import DFlashDrafter


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(
    path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A transformers causal LM and its tokenizer from a local directory (no hub access)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no transformers model at {path} (missing config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device).eval(), tokenizer


def load_drafter(path: str | Path, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    """A DFlash drafter checkpoint (config.json + model.safetensors)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no DFlash drafter at {path} (missing config.json)")
    return DFlashDrafter.from_pretrained(path, device=device, dtype=dtype)
