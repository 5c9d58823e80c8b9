"""DFlash block-diffusion drafter, checkpoint-compatible with public z-lab DFlash drafters.

A DFlash drafter predicts a whole block of future tokens in one non-causal forward pass.

* Context: the target's hidden states at ``target_layer_ids`` (layer id ``i`` is the output of
  target decoder layer ``i``, i.e. transformers' ``hidden_states[i + 1]``) are concatenated,
  projected by ``fc`` (no bias) and normalised by ``hidden_norm``. Each draft layer turns these
  context features into keys/values with its own ``k_proj``/``v_proj``/``k_norm`` and RoPE at
  the tokens' absolute positions (no ``input_layernorm`` on the context).
* Block: ``[anchor, MASK x (B - 1)]`` embedded with the target's (frozen) embedding, at positions
  ``T .. T + B - 1`` where ``T`` is the number of context tokens (the anchor is the bonus token,
  whose target hidden state does not exist yet). Queries come from the block only; keys/values
  are ``[context; block]``; attention is bidirectional over all valid context and the block.
* Output: final ``norm`` then the target's (frozen) LM head. Block slot ``k`` predicts the token
  at position ``T + k`` ("same-position" prediction); slot 0 (the anchor) is discarded, so slots
  ``1 .. B - 1`` are the marginals ``q_1 .. q_{B-1}`` (as in z-lab's ``spec_generate``, which
  keeps ``[:, -B + 1:]``, and SGLang's DFlash worker, which sends block positions ``1:`` to the
  LM head).

Checkpoint layout (``config.json`` + ``model.safetensors``): a Qwen3 config with
``architectures = ["DFlashDraftModel"]``, ``num_hidden_layers`` = draft layers, top-level
``block_size`` and ``num_target_layers``, and ``dflash_config = {"target_layer_ids": [...],
"mask_token_id": int}``; weights ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*``
(Qwen3 decoder layer names) and ``norm.weight``; no embedding and no LM head.

Optional ``dflash_config`` fields, with the semantics of the DFlash authors' reference
(``dflash`` 0.1.0, ``DFlashDraftModel``; each read from ``dflash_config`` first, then the
config's top level, as the reference does):

* ``input_embedding_scale`` (default 1.0): the block's embeddings are the target embedding
  matrix's rows (a plain lookup of its weight, never a scaling embedding module's forward) times
  this factor.
* ``output_multiplier`` (default 1.0): the draft logits ``lm_head(hidden)`` are multiplied by it.
* ``final_logit_softcapping`` (default none): when set and positive, the (multiplied) logits
  become ``tanh(logits / cap) * cap``.

DFlash2 (``architectures = ["DFlash2DraftModel"]``, ``dflash_config`` fields
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``), as the
reference's ``DFlash2DraftModel`` computes it: every draft layer wraps its attention and its MLP
in a grouped dynamic causal convolution over the block positions (:class:`GroupedDynamicConv`:
before the sub-layer, a per-position kernel predicted from the normalised input plus a learned
base kernel mixes each channel group with the ``kernel_size - 1`` block positions before it;
after the sub-layer, a second base kernel plus the second half of the predicted kernel does the
same to its output). The convolution never reaches past the block's first slot (the anchor),
so the context path is DFlash v1's. The candidate selector's weights are loaded
(:class:`CandidateSelector`) but its scores are not used to build trees: the tree is built from
the per-position marginals (the LM-head distribution of each block slot), which the selector's
unary term is (its top-``selector_top_k`` candidates are the marginal's top-K); its pairwise
term scores a candidate given its predecessor token, so using it means per-parent child lists,
which the depth-wise top-K tree builder does not take. The reference's own chain follows the
selector's path, so its drafts may differ from the marginal chain's; verification is exact
either way.

Anything else that would change the drafter's computation and that it does not implement
(other architectures, sliding-window or causal draft layers, partial rotary,
length-dependent RoPE, unknown ``dflash_config`` keys) is refused when the drafter is built, with
a one-line :class:`DrafterConfigError` (``DDTREE: ...``) naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from sglang_tree_spec.tree import topk_from_logits

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_V2 = "DFlash2DraftModel"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_BLOCK_SIZE = 16

# transformers bookkeeping that public DFlash configs do not carry.
_CONFIG_NOISE_KEYS = (
    "_name_or_path",
    "chunk_size_feed_forward",
    "id2label",
    "is_encoder_decoder",
    "label2id",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
)
# dflash_config fields this drafter reads for its layout.
LAYOUT_FIELDS = ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers")
# dflash_config fields of the reference's DFlashDraftModel that change the drafter's output, with
# their neutral values (the computation without them). final_logit_softcapping is neutral when
# unset or not positive.
COMPUTE_FIELDS: dict[str, float | None] = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}
# dflash_config fields that change nothing here: SGLang's mask token string (it adds the token
# to the tokenizer only when mask_token_id is absent, which the drafter refuses).
METADATA_FIELDS = ("mask_token",)
# dflash_config fields of DFlash2 (grouped dynamic causal convolutions, candidate selector).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Accepted only at these values: other DFlash implementations' switches.
NEUTRAL_ONLY_FIELDS: dict[str, Any] = {"causal": False, "projector_type": "dflash"}

KVPair = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------------------------


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers for ``num_draft_layers`` draft layers over a target's layers.

    ``[N // 2]`` for one draft layer, else ``round(1 + i * (N - 4) / (L - 1))`` for
    ``i = 0 .. L - 1`` (spread over layers ``1 .. N - 3``), as in the public DFlash code.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"need positive layer counts, got num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"more than one draft layer needs a target with >= 4 layers, got {num_target_layers}"
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _dflash_value(config: PretrainedConfig, name: str, default: Any = None) -> Any:
    """A DFlash field, read from ``dflash_config`` first and the top level second."""
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested:
        return nested[name]
    return getattr(config, name, default)


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder config of a (possibly multimodal) transformers config."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _head_dim(config: PretrainedConfig) -> int:
    """``head_dim`` of a config, derived as hidden_size // heads when absent (Llama)."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def _full_attention_rope(config: PretrainedConfig) -> dict[str, Any]:
    """A target's RoPE parameters (those of its full-attention layers when keyed by type)."""
    rope = dict(config.rope_parameters)
    return dict(rope["full_attention"]) if "full_attention" in rope else rope


def _resolve_target_layer_ids(config: PretrainedConfig) -> list[int]:
    ids = _dflash_value(config, "target_layer_ids")
    if ids is None:
        num_target_layers = _dflash_value(config, "num_target_layers")
        if num_target_layers is None:
            raise DrafterConfigError(
                "DFlash drafter config needs dflash_config.target_layer_ids or num_target_layers"
            )
        return build_target_layer_ids(int(num_target_layers), config.num_hidden_layers)
    ids = [int(i) for i in ids]
    if not ids:
        raise DrafterConfigError("DFlash drafter dflash_config.target_layer_ids must not be empty")
    return ids


class DrafterConfigError(ValueError):
    """A drafter config this implementation refuses: one line ``DDTREE: <detail>`` that names
    the field (``detail`` without the prefix)."""

    def __init__(self, detail: str) -> None:
        self.detail = " ".join(str(detail).split())  # one line
        super().__init__(f"DDTREE: {self.detail}")


def _number(name: str, value: Any) -> float:
    """``value`` of field ``name`` as a finite float (bools and strings refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise DrafterConfigError(f"DFlash drafter field {name}={value!r} must be a finite number")
    if abs(float(value)) == float("inf"):
        raise DrafterConfigError(f"DFlash drafter field {name}={value!r} must be a finite number")
    return float(value)


def compute_fields(config: PretrainedConfig) -> dict[str, float | None]:
    """The drafter's ``input_embedding_scale``, ``output_multiplier`` and
    ``final_logit_softcapping`` (None when unset or not positive: no capping), read as the
    reference reads them (``dflash_config`` first, then the top level)."""
    scale = _number("input_embedding_scale", _dflash_value(config, "input_embedding_scale", 1.0))
    multiplier = _number("output_multiplier", _dflash_value(config, "output_multiplier", 1.0))
    cap = _dflash_value(config, "final_logit_softcapping")
    cap = None if cap is None else _number("final_logit_softcapping", cap)
    return {
        "input_embedding_scale": scale,
        "output_multiplier": multiplier,
        "final_logit_softcapping": cap if cap is not None and cap > 0 else None,
    }


def non_neutral_fields(config: PretrainedConfig) -> dict[str, float]:
    """The :data:`COMPUTE_FIELDS` a config sets to a value that changes the drafter's output."""
    return {
        name: value
        for name, value in compute_fields(config).items()
        if value != COMPUTE_FIELDS[name]
    }


def _validate_draft_config(config: PretrainedConfig) -> None:
    """Refuse what this implementation does not reproduce, one field per line
    (:class:`DrafterConfigError`)."""
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and architectures not in ([ARCHITECTURE], [ARCHITECTURE_V2]):
        raise DrafterConfigError(
            f"DFlash drafter architectures={architectures} is not supported (only "
            f"{ARCHITECTURE} and {ARCHITECTURE_V2})"
        )
    is_v2 = architectures == [ARCHITECTURE_V2]
    layer_types = list(getattr(config, "layer_types", None) or [])
    bad_types = sorted({t for t in layer_types if t != "full_attention"})
    if bad_types:
        raise DrafterConfigError(
            f"DFlash drafter layer_types {bad_types} are not supported (full_attention layers "
            "only; sliding-window draft layers are not implemented)"
        )
    if getattr(config, "is_causal", None):
        raise DrafterConfigError(
            "DFlash drafter is_causal=true is not supported (causal draft layers are not "
            "implemented)"
        )
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act not in ACT2FN:
        raise DrafterConfigError(
            f"DFlash drafter hidden_act={hidden_act!r} is not supported (not a transformers "
            "activation)"
        )
    rope = dict(getattr(config, "rope_parameters", None) or {})
    for where, factor in (
        ("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)),
        ("rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor")),
    ):
        if factor is not None and float(factor) != 1.0:
            raise DrafterConfigError(
                f"DFlash drafter {where}={factor} is not supported (partial rotary embeddings)"
            )
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise DrafterConfigError(
            f"DFlash drafter rope_parameters.rope_type={rope_type!r} is not supported "
            "(length-dependent RoPE)"
        )
    nested = getattr(config, "dflash_config", None) or {}
    if not isinstance(nested, Mapping):
        raise DrafterConfigError(f"DFlash drafter dflash_config must be a mapping, got {nested!r}")
    for key, value in nested.items():
        if key in LAYOUT_FIELDS or key in COMPUTE_FIELDS or key in METADATA_FIELDS:
            continue
        if key in DFLASH2_FIELDS:
            if not is_v2:
                raise DrafterConfigError(
                    f"DFlash drafter dflash_config.{key} is not supported (a DFlash2 field in a "
                    f"{ARCHITECTURE} config)"
                )
            continue
        if key in NEUTRAL_ONLY_FIELDS and value == NEUTRAL_ONLY_FIELDS[key]:
            continue
        raise DrafterConfigError(
            f"DFlash drafter dflash_config.{key}={value!r} is not supported (a field this DFlash "
            "implementation does not read)"
        )
    compute_fields(config)  # refuses non-numeric values
    if is_v2:
        for key in DFLASH2_FIELDS:
            value = _dflash_value(config, key)
            if value is None or int(value) < 1:
                raise DrafterConfigError(
                    f"DFlash2 drafter dflash_config.{key} must be a positive integer, got {value!r}"
                )
        group = int(_dflash_value(config, "conv_group_size"))
        if config.hidden_size % group:
            raise DrafterConfigError(
                f"DFlash2 drafter dflash_config.conv_group_size={group} does not divide "
                f"hidden_size={config.hidden_size}"
            )
    block_size = int(_dflash_value(config, "block_size", DEFAULT_BLOCK_SIZE))
    if block_size < 2:
        raise DrafterConfigError(f"DFlash drafter block_size must be >= 2, got {block_size}")


# ---------------------------------------------------------------------------------------------
# Target features
# ---------------------------------------------------------------------------------------------


def select_target_features(
    hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]
) -> torch.Tensor:
    """Concatenate target hidden states of ``target_layer_ids``: ``[bs, T, len(ids) * H]``.

    ``hidden_states`` is transformers' ``output_hidden_states=True`` tuple: index 0 is the
    embedding output and index ``i + 1`` the output of decoder layer ``i``. (transformers
    returns the last entry after the final norm; the default layer ids never pick it.)
    """
    num_layers = len(hidden_states) - 1
    bad = [i for i in target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for {num_layers} target layers")
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


def _rope_inv_freq(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[D / 2]`` (float32) and output scaling of a config.

    Position-independent RoPE types only (default, linear, llama3, yarn, ...); kept out of the
    module's buffers so that casting the drafter to bf16 never degrades them.
    """
    rope_type = config.rope_parameters.get("rope_type", "default")  # not dynamic / longrope
    if rope_type == "default":
        init = Qwen3RotaryEmbedding.compute_default_rope_parameters
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(config)  # config only: transformers 5.19 takes no device
    return inv_freq.float(), float(scaling)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [bs, heads, n, D]`` with ``cos``/``sin`` ``[bs, n, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Qwen3-style attention: queries from the block, keys/values from [context; block]."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KVPair:
        """Keys (k_norm + RoPE) and values of ``x [bs, n, H]``: each ``[bs, kv_heads, n, D]``."""
        bs, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bs, n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(bs, n, self.num_kv_heads, self.head_dim)
        return _apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: KVPair,
        attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Attend from the block ``x [bs, Q, H]`` to ``[context; block]``.

        ``cos``/``sin`` ``[bs, Q, D]`` are the block's RoPE tables, ``context_kv`` the context
        keys/values ``[bs, kv_heads, T, D]`` and ``attn_mask [bs, Q, T + Q]`` (True = attend).
        Returns ``[bs, Q, H]``.
        """
        bs, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bs, q_len, self.num_heads, self.head_dim))
        q = _apply_rope(q.transpose(1, 2), cos, sin)
        k_block, v_block = self.key_value(x, cos, sin)
        k = torch.cat([context_kv[0], k_block], dim=2)
        v = torch.cat([context_kv[1], v_block], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask.unsqueeze(1), scale=self.head_dim**-0.5
        )
        return self.o_proj(out.transpose(1, 2).reshape(bs, q_len, -1))


def causal_conv(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """``y[:, t] = sum_o kernel[:, t, o] * x[:, t - o]`` per channel, zeros before slot 0.

    ``x [bs, Q, H]``; ``kernel [bs, Q, K, H]`` (a per-position kernel over offsets ``o = 0 ..
    K - 1``, already expanded to channels). Returns ``[bs, Q, H]``.
    """
    q_len, width = x.shape[1], kernel.shape[2]
    padded = F.pad(x, (0, 0, width - 1, 0))  # [bs, K - 1 + Q, H]
    out = torch.zeros_like(x)
    for offset in range(width):
        start = width - 1 - offset
        out = out + kernel[:, :, offset] * padded[:, start : start + q_len]
    return out


class GroupedDynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution around one sub-layer.

    ``base_kernel [2, K, H]`` (before / after the sub-layer) and ``kernel_projection``:
    ``H -> 2 * K * G`` per position (``G = H / group_size`` channel groups; a group's channels
    share the predicted coefficient, each channel has its own base coefficient).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _kernel(self, dynamic: torch.Tensor, which: int) -> torch.Tensor:
        """``dynamic [bs, Q, K, G]`` -> per-channel kernel ``[bs, Q, K, H]``."""
        per_channel = dynamic.repeat_interleave(self.group_size, dim=-1)
        return per_channel + self.base_kernel[which].to(dynamic.dtype)

    def before(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve the sub-layer input ``x [bs, Q, H]``; also return the after-kernel's
        predicted part ``[bs, Q, K, G]`` (predicted from this same input)."""
        bs, q_len, _ = x.shape
        dynamic = self.kernel_projection(x).view(bs, q_len, 2, self.kernel_size, self.groups)
        y = causal_conv(x, self._kernel(dynamic[:, :, 0], 0))
        return y, dynamic[:, :, 1]

    def after(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """Convolve the sub-layer output ``x [bs, Q, H]`` with :meth:`before`'s kernel."""
        return causal_conv(x, self._kernel(dynamic, 1))


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector weights (loaded, not used: see the module docstring)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        rank = int(_dflash_value(config, "selector_rank"))
        self.top_k = int(_dflash_value(config, "selector_top_k"))
        self.predecessor_codebook = nn.Embedding(config.vocab_size, rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, rank)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer whose attention also reads context keys/values; DFlash2
    wraps attention and MLP in :class:`GroupedDynamicConv` (``attention_conv``/``mlp_conv``)."""

    def __init__(self, config: Qwen3Config, dflash2: bool = False) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.attention_conv = self.mlp_conv = None
        if dflash2:
            kernel = int(_dflash_value(config, "conv_kernel_size"))
            group = int(_dflash_value(config, "conv_group_size"))
            self.attention_conv = GroupedDynamicConv(config.hidden_size, kernel, group)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel, group)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: KVPair,
        attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``x [bs, Q, H] -> [bs, Q, H]`` (see :meth:`DFlashAttention.forward`); ``Q`` is one
        whole block, slot 0 first (the DFlash2 convolutions run over it)."""
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + self.self_attn(h, cos, sin, context_kv, attn_mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, dynamic = self.attention_conv.before(h)
        x = x + self.attention_conv.after(
            self.self_attn(h, cos, sin, context_kv, attn_mask), dynamic
        )
        h, dynamic = self.mlp_conv.before(self.post_attention_layernorm(x))
        return x + self.mlp_conv.after(self.mlp(h), dynamic)


class DFlashDrafter(nn.Module):
    """The DFlash draft network (no embedding, no LM head: both come from the target).

    Invariants: ``fc`` maps ``len(target_layer_ids) * H -> H``; every draft forward sees the
    context only through keys/values from :meth:`context_kv`, so training
    (:func:`sglang_tree_spec.models.train_dflash.block_hidden`) and inference
    (:class:`DFlashContextCache`) run the same attention code.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        _validate_draft_config(config)
        self.config = config
        self.target_layer_ids = _resolve_target_layer_ids(config)
        self.block_size = int(_dflash_value(config, "block_size", DEFAULT_BLOCK_SIZE))
        mask_token_id = _dflash_value(config, "mask_token_id")
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.dflash2 = list(getattr(config, "architectures", None) or []) == [ARCHITECTURE_V2]
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, self.dflash2) for _ in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        if self.dflash2:
            self.candidate_selector = CandidateSelector(config)
        self._inv_freq, self._rope_attention_scaling = _rope_inv_freq(config)
        fields = compute_fields(config)
        self.input_embedding_scale = float(fields["input_embedding_scale"])
        self.output_multiplier = float(fields["output_multiplier"])
        self.final_logit_softcapping = fields["final_logit_softcapping"]

    # -- construction / persistence --------------------------------------------------------

    @classmethod
    def random_init(
        cls,
        target_config: PretrainedConfig,
        num_layers: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int = 0,
        mask_token_id: int | None = None,
        target_layer_ids: Sequence[int] | None = None,
    ) -> DFlashDrafter:
        """A freshly initialised drafter for a transformers target config (Qwen3, Llama, ...).

        Sizes (hidden, heads, KV heads, head_dim, MLP width, RoPE, vocab) follow the target.
        ``mask_token_id`` defaults to the last vocabulary row (only ever used at block slots
        ``1..B-1``, so it may coincide with a real token); ``target_layer_ids`` defaults to
        :func:`build_target_layer_ids`. Linear weights ~ N(0, 0.02) from ``seed``; norms = 1.
        """
        text = _text_config(target_config)
        num_target_layers = int(text.num_hidden_layers)
        ids = (
            list(target_layer_ids)
            if target_layer_ids is not None
            else build_target_layer_ids(num_target_layers, num_layers)
        )
        mask_id = text.vocab_size - 1 if mask_token_id is None else int(mask_token_id)
        config = Qwen3Config(
            architectures=[ARCHITECTURE],
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None)
            or text.num_attention_heads,
            head_dim=_head_dim(text),
            hidden_act="silu",  # the only activation SGLang's DFlash drafter implements
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters=_full_attention_rope(text),
            max_position_embeddings=text.max_position_embeddings,
            vocab_size=text.vocab_size,
            attention_bias=False,
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            block_size=block_size,
            num_target_layers=num_target_layers,
            dflash_config={"target_layer_ids": ids, "mask_token_id": mask_id},
        )
        drafter = cls(config)
        drafter.check_compatible(target_config)
        drafter._init_weights(seed, std=config.initializer_range)
        return drafter

    def _init_weights(self, seed: int, std: float) -> None:
        """Linear weights ~ N(0, std) from a private generator, biases 0, norm weights 1."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    weight = torch.randn(module.weight.shape, generator=generator) * std
                    module.weight.copy_(weight)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, Qwen3RMSNorm):
                    module.weight.fill_(1.0)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """Load ``config.json`` + ``model.safetensors`` (or a sharded index) from ``path``.

        ``dtype`` defaults to the checkpoint's dtype. Keys may carry a ``model.`` prefix;
        missing or unexpected weights raise ``ValueError``.
        """
        path = Path(path)
        raw = json.loads((path / CONFIG_NAME).read_text())
        config = Qwen3Config.from_dict(raw)
        state = _normalize_state_keys(_load_safetensors(path))
        drafter = cls(config)
        expected = set(drafter.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(
                f"DFlash checkpoint {path} does not match its config: "
                f"missing={sorted(missing)[:8]} unexpected={sorted(unexpected)[:8]}"
            )
        drafter.to(dtype=dtype or state["fc.weight"].dtype)
        drafter.load_state_dict(state)
        return drafter.to(device=device).eval()

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the public DFlash layout."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return path

    def config_dict(self) -> dict[str, Any]:
        """The published config layout: Qwen3 fields + block_size, num_target_layers,
        dflash_config; legacy ``rope_theta``/``rope_scaling`` for transformers 4.x readers."""
        out = self.config.to_dict()
        for key in _CONFIG_NOISE_KEYS:
            out.pop(key, None)
        rope = dict(out.get("rope_parameters") or {})
        out["architectures"] = [ARCHITECTURE_V2 if self.dflash2 else ARCHITECTURE]
        out["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        out["rope_theta"] = rope.get("rope_theta")
        out["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        out["block_size"] = self.block_size
        dflash = dict(out.get("dflash_config") or {})
        dflash.pop("block_size", None)
        dflash["target_layer_ids"] = list(self.target_layer_ids)
        dflash["mask_token_id"] = self.mask_token_id
        out["dflash_config"] = dflash
        return out

    # -- validation ------------------------------------------------------------------------

    def check_compatible(self, target_config: PretrainedConfig) -> None:
        """Raise ``ValueError`` listing every mismatch between this drafter and a target."""
        text = _text_config(target_config)
        num_layers = int(text.num_hidden_layers)
        errors = []
        if self.config.hidden_size != text.hidden_size:
            errors.append(
                f"hidden size mismatch: drafter {self.config.hidden_size}, "
                f"target {text.hidden_size}"
            )
        if self.config.vocab_size != text.vocab_size:
            errors.append(
                f"vocab size mismatch: drafter {self.config.vocab_size}, target {text.vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            errors.append(f"target_layer_ids {bad} out of range for {num_layers} target layers")
        configured = _dflash_value(self.config, "num_target_layers")
        if configured is not None and int(configured) != num_layers:
            errors.append(
                f"num_target_layers mismatch: drafter expects {configured}, target has {num_layers}"
            )
        if self.mask_token_id is None:
            errors.append("mask_token_id is not set in dflash_config")
        elif not 0 <= self.mask_token_id < text.vocab_size:
            errors.append(
                f"mask_token_id {self.mask_token_id} outside the target vocabulary "
                f"[0, {text.vocab_size})"
            )
        if errors:
            raise ValueError("DFlash drafter incompatible with target: " + "; ".join(errors))

    # -- compute ---------------------------------------------------------------------------

    def target_hidden_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """This drafter's context input from a transformers hidden-states tuple:
        ``[bs, T, len(target_layer_ids) * H]`` (see :func:`select_target_features`)."""
        return select_target_features(hidden_states, self.target_layer_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables ``(cos, sin)``, each ``[bs, n, D]`` in the drafter dtype, for integer
        ``positions [bs, n]`` (computed in float32, as transformers does)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self._inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        dtype = self.fc.weight.dtype
        cos = (emb.cos() * self._rope_attention_scaling).to(dtype)
        sin = (emb.sin() * self._rope_attention_scaling).to(dtype)
        return cos, sin

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[KVPair]:
        """Per-layer context keys/values of target ``features [bs, T, F]`` at ``positions
        [bs, T]``: ``fc -> hidden_norm -> k/v_proj, k_norm, RoPE``; each ``[bs, kv, T, D]``."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rope(positions)
        return [layer.self_attn.key_value(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        context_kv: Sequence[KVPair],
        attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Draft hidden states (after the final norm) ``[bs, Q, H]``.

        ``block_embeds [bs, Q, H]``: target embeddings of the block tokens (rows of the
        embedding matrix; this forward multiplies them by ``input_embedding_scale``); ``positions
        [bs, Q]``: their absolute positions; ``context_kv``: one ``[bs, kv, T, D]`` pair per
        layer; ``attn_mask [bs, Q, T + Q]`` bool, True where a query may attend.
        """
        cos, sin = self.rope(positions)
        x = block_embeds
        if self.input_embedding_scale != 1.0:  # in the embeddings' dtype, as the reference
            x = x * self.input_embedding_scale
        x = x.to(self.fc.weight.dtype)
        for layer, kv in zip(self.layers, context_kv, strict=True):
            x = layer(x, cos, sin, kv, attn_mask)
        return self.norm(x)

    def output_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits from the LM head's ``logits`` (any shape, any vocabulary subset: the
        map is elementwise): times ``output_multiplier``, then ``tanh(x / cap) * cap`` when
        ``final_logit_softcapping`` is set, in the logits' dtype (the reference's order)."""
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed_block(self, block_token_ids: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """The block's embeddings: rows of the target embedding module's ``weight`` (a plain
        lookup, as the reference does; a module that scales its output, e.g. Gemma's, is not
        called). :meth:`forward` applies ``input_embedding_scale``."""
        weight = embed.weight
        return F.embedding(block_token_ids.to(weight.device), weight)

    def new_cache(self, batch_size: int) -> DFlashContextCache:
        """An empty context cache for ``batch_size`` requests."""
        return DFlashContextCache(self, batch_size)

    def block_token_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """``[bs, block_size]`` blocks ``[anchor, MASK, ..., MASK]`` for ``anchor_ids [bs]``."""
        if self.mask_token_id is None:
            raise ValueError("drafter has no mask_token_id")
        blocks = torch.full(
            (anchor_ids.shape[0], self.block_size),
            self.mask_token_id,
            dtype=torch.long,
            device=anchor_ids.device,
        )
        blocks[:, 0] = anchor_ids
        return blocks


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / WEIGHTS_INDEX_NAME
    if not index.exists():
        return load_file(str(path / WEIGHTS_NAME))
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(path / shard)))
    return state


# DFlash2 checkpoints may store the selector's codebooks without the ``.weight`` suffix.
_BARE_CODEBOOKS = (
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
)


def _normalize_state_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip an optional ``model.`` prefix, name bare DFlash2 codebooks ``*.weight`` and drop
    RoPE caches (``*.inv_freq``)."""
    out = {}
    for key, value in state.items():
        if key.endswith("inv_freq"):
            continue
        key = key.removeprefix("model.")
        out[f"{key}.weight" if key in _BARE_CODEBOOKS else key] = value
    return out


# ---------------------------------------------------------------------------------------------
# Batched inference cache
# ---------------------------------------------------------------------------------------------


def pad_features(features: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad per-request features ``[n_i, F]`` to ``([bs, max n_i, F], counts [bs])``."""
    counts = torch.tensor([f.shape[0] for f in features], dtype=torch.long)
    padded = nn.utils.rnn.pad_sequence(list(features), batch_first=True)
    return padded, counts.to(padded.device)


class DFlashContextCache:
    """Per-layer post-RoPE context keys/values for a batch of requests of different lengths.

    Holds only committed context (tokens whose target hidden states are known); draft blocks
    are never written. ``keys[l]``/``values[l]`` are ``[bs, kv_heads, capacity, D]``; request
    ``i`` owns positions ``0 .. lengths[i] - 1``, the rest is padding that attention masks out.
    """

    def __init__(self, drafter: DFlashDrafter, batch_size: int) -> None:
        self.drafter = drafter
        attn = drafter.layers[0].self_attn
        weight = drafter.fc.weight
        shape = (batch_size, attn.num_kv_heads, 0, attn.head_dim)
        self.keys = [weight.new_zeros(shape) for _ in drafter.layers]
        self.values = [weight.new_zeros(shape) for _ in drafter.layers]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=weight.device)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _reserve(self, needed: int) -> None:
        """Grow the position axis to at least ``needed`` (amortised doubling)."""
        if needed <= self.capacity:
            return
        old_capacity = self.capacity
        new_capacity = max(needed, 2 * old_capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_zeros(*old.shape[:2], new_capacity, old.shape[3])
                grown[:, :, :old_capacity] = old
                store[i] = grown

    @torch.no_grad()
    def append(
        self, features: torch.Tensor, counts: torch.Tensor | Sequence[int] | None = None
    ) -> None:
        """Commit new target features ``[bs, n, F]``; request ``i`` takes its first
        ``counts[i]`` rows (default: all ``n``) at positions ``lengths[i] ..``."""
        bs, n, _ = features.shape
        if bs != self.batch_size:
            raise ValueError(f"features batch {bs} != cache batch {self.batch_size}")
        device = self.lengths.device
        counts = (
            torch.full((bs,), n, dtype=torch.long, device=device)
            if counts is None
            else torch.as_tensor(counts, dtype=torch.long, device=device)
        )
        if bool((counts < 0).any()) or bool((counts > n).any()):
            raise ValueError(f"counts must lie in [0, {n}], got {counts.tolist()}")
        offsets = torch.arange(n, device=device)
        positions = self.lengths[:, None] + offsets[None, :]
        kv = self.drafter.context_kv(features.to(device), positions)
        self._reserve(int((self.lengths + counts).max()))
        rows, cols = (offsets[None, :] < counts[:, None]).nonzero(as_tuple=True)
        slots = positions[rows, cols]
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][rows, :, slots] = k[rows, :, cols]
            self.values[layer][rows, :, slots] = v[rows, :, cols]
        self.lengths += counts

    def keep(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep only the requests at ``indices`` (in that order), e.g. after some finish."""
        index = torch.as_tensor(indices, dtype=torch.long, device=self.lengths.device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.lengths = self.lengths.index_select(0, index)

    def attention_mask(self, block_len: int) -> torch.Tensor:
        """``[bs, block_len, capacity + block_len]`` bool: each block query sees its request's
        valid context and the whole block (non-causal)."""
        device = self.lengths.device
        context = torch.arange(self.capacity, device=device)[None, :] < self.lengths[:, None]
        block = torch.ones(self.batch_size, block_len, dtype=torch.bool, device=device)
        return torch.cat([context, block], dim=1)[:, None, :].expand(-1, block_len, -1)

    @torch.no_grad()
    def draft_hidden(self, block_token_ids: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """Draft hidden states ``[bs, Q, H]`` for blocks ``[bs, Q]`` (anchor + masks) placed
        at positions ``lengths[i] .. lengths[i] + Q - 1``."""
        q_len = block_token_ids.shape[1]
        positions = self.lengths[:, None] + torch.arange(q_len, device=self.lengths.device)
        context_kv = list(zip(self.keys, self.values, strict=True))
        block_embeds = self.drafter.embed_block(block_token_ids.to(self.lengths.device), embed)
        return self.drafter(block_embeds, positions, context_kv, self.attention_mask(q_len))

    @torch.no_grad()
    def draft_logits(
        self,
        block_token_ids: torch.Tensor,
        embed: nn.Module,
        lm_head: nn.Module,
        depths: int | None = None,
    ) -> torch.Tensor:
        """Marginal logits ``[bs, D, V]`` of block slots ``1 .. D`` (``D = Q - 1``, or at most
        ``depths``: the whole block runs, the LM head skips the later slots): row ``j`` scores
        the token at absolute position ``lengths[i] + j + 1`` (slot 0, the anchor, dropped),
        after the drafter's :meth:`DFlashDrafter.output_logits`."""
        end = None if depths is None else depths + 1
        hidden = self.draft_hidden(block_token_ids, embed)[:, 1:end]
        return self.drafter.output_logits(lm_head(hidden.to(_module_dtype(lm_head))))

    def draft_topk(
        self, block_token_ids: torch.Tensor, embed: nn.Module, lm_head: nn.Module, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot top-``k`` ``(log_probs, token_ids)``, each ``[bs, Q - 1, k]``, sorted
        descending (what the tree builder consumes)."""
        return topk_from_logits(self.draft_logits(block_token_ids, embed, lm_head), k)


def _module_dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
