"""Training recipe for DFlash drafters (public DFlash recipe, pure PyTorch + transformers).

The target (with its embedding and LM head) is frozen. Each training sequence gets several
random anchors ``a`` (in the response region when a loss mask is given). Block ``n`` is
``[x_a, MASK x (B - 1)]`` at positions ``a .. a + B - 1``; it sees the target context features
strictly before ``a``, attends bidirectionally inside itself and never sees other blocks. All
blocks of a batch run in one drafter forward with one explicit boolean attention mask, through
the same :class:`~sglang_tree_spec.drafters.dflash.DFlashDrafter` code as inference. The label
of slot ``k`` is ``x_{a + k}``; slot ``k >= 1`` has cross-entropy weight
``exp(-(k - 1) / gamma)`` (slot 0, the anchor, has none).

Two speed-ups spend the CPU on the drafter only (both opt-in):

- ``feature_cache``: the frozen target's features (and top-k next tokens) are computed once per
  record and read back from disk every epoch (:mod:`sglang_tree_spec.models.feature_cache`);
- ``shortlist_negatives``: the cross-entropy runs over a shortlist of the vocabulary (the
  batch's labels, the target's cached top-k at every labelled position, and uniformly sampled
  negatives whose logits get the ``log(rest / sampled)`` correction), not all of it
  (:func:`shortlist_block_loss`; with every other token as a negative it is the full loss).
  It is least faithful at random init (huge logits on tokens outside the shortlist), so the
  first ``full_loss_steps`` steps can use the full loss.

Long runs: held-out slot-1 acceptance (``heldout_records``) is logged as it goes, and a run
stops at a step (``stop_at``), after ``max_minutes`` or once the held-out slot-1 acceptance
reaches ``stop_heldout_acc``, saving a checkpoint it resumes from.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from sglang_tree_spec.drafters.dflash import CONFIG_NAME, DFlashDrafter
from sglang_tree_spec.models.feature_cache import FeatureCache, build_feature_cache, window_records

TRAINER_STATE_NAME = "trainer_state.pt"
LOG_NAME = "train_log.jsonl"
_TEXT_CHUNK_CHARS = 100_000


@dataclass
class TrainConfig:
    """Settings of one drafter training run.

    ``data`` is a plain-text file (tokenised with the target's tokenizer), a ``.jsonl`` file of
    ``{"input_ids": [...], "loss_mask": [...]}`` records (``loss_mask`` optional, 1 = response
    token), or an in-memory list of token-id sequences (``loss_masks`` optional, same shapes).
    """

    target: str
    out_dir: str
    data: str | list[list[int]]
    loss_masks: list[list[int]] | None = None
    block_size: int = 16
    num_layers: int = 1
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = 7.0
    anchors_per_seq: int = 16
    mask_token_id: int | None = None
    seed: int = 0
    device: str = "auto"
    save_every: int = 500
    log_every: int = 10
    stop_at: int | None = None  # stop (and save) at this step; the schedule still spans steps
    feature_cache: str | None = None  # directory caching the target's features per record
    cache_topk: int = 8  # target top-k next tokens cached per position (shortlist candidates)
    cache_batch_size: int = 4  # records per target forward while building the cache
    shortlist_negatives: int | None = None  # None: full-vocabulary loss; else shortlist loss
    full_loss_steps: int = 0  # the shortlist loss starts after this many full-loss steps
    heldout_records: int = 0  # the last N records are held out (slot-1 acceptance)
    eval_every: int = 0  # held-out evaluation period in steps; 0: at every save and the end
    eval_anchors: int = 8  # anchors per held-out record
    max_minutes: float | None = None  # stop (and save) after this much training time
    stop_heldout_acc: float | None = None  # stop (and save) once held-out slot-1 acc >= this
    init_from: str | None = None  # a fresh run starts from this drafter's weights (not random)
    init_from_target: bool = False  # a fresh run's layers start as the target's (not random)
    teacher_labels: bool = False  # label = the cached target's greedy choice (block_labels)


# ---------------------------------------------------------------------------------------------
# Blocks (run through the same drafter code as inference)
# ---------------------------------------------------------------------------------------------


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Training mask ``[bs, N * B, context_len + N * B]`` (True = attend) for anchors ``[bs, N]``.

    Query row ``n * B + k`` (slot ``k`` of block ``n``) sees context columns ``j < anchors[n]``
    and exactly the ``B`` columns of its own block.
    """
    bs, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)
    context = torch.arange(context_len, device=device)[None, None, :] < query_anchor[:, :, None]
    block_id = torch.arange(q_len, device=device) // block_size
    same_block = (block_id[:, None] == block_id[None, :]).expand(bs, -1, -1)
    return torch.cat([context, same_block], dim=2)


def block_hidden(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    embed: nn.Module,
) -> torch.Tensor:
    """Drafter hidden states ``[bs, N, B, H]`` of all blocks in one forward.

    ``features [bs, S, F]``: target features of every position; ``input_ids [bs, S]``;
    ``anchors [bs, N]`` with ``1 <= a`` and ``a + B <= S``. Block ``n`` is
    ``[x_a, MASK, ...]`` at positions ``a .. a + B - 1``.
    """
    bs, seq_len = input_ids.shape
    block_size = drafter.block_size
    num_blocks = anchors.shape[1]
    device = input_ids.device
    context_positions = torch.arange(seq_len, device=device).expand(bs, -1)
    context_kv = drafter.context_kv(features, context_positions)
    block_ids = drafter.block_token_ids(input_ids.gather(1, anchors).reshape(-1))
    block_ids = block_ids.view(bs, num_blocks * block_size)
    offsets = torch.arange(block_size, device=device)
    positions = (anchors[:, :, None] + offsets).view(bs, -1)
    mask = block_attention_mask(anchors, seq_len, block_size)
    hidden = drafter(embed(block_ids), positions, context_kv, mask)
    return hidden.view(bs, num_blocks, block_size, -1)


def sample_anchors(
    valid_anchor: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to ``num_anchors`` distinct anchors per row of ``valid_anchor [bs, S]`` (bool).

    Returns ``(anchors [bs, N], keep [bs, N])`` with ``N = min(num_anchors, S)``; rows with
    fewer valid positions are padded with ``keep = False`` (their anchor is an arbitrary valid
    index 1, never used in the loss).
    """
    scores = torch.rand(valid_anchor.shape, generator=generator)
    scores = scores.masked_fill(~valid_anchor.cpu(), -1.0)
    num = min(num_anchors, valid_anchor.shape[1])
    top, anchors = scores.topk(num, dim=1)
    keep = top >= 0
    return anchors.masked_fill(~keep, 1).to(valid_anchor.device), keep.to(valid_anchor.device)


def valid_anchor_positions(
    lengths: torch.Tensor, loss_mask: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``[bs, S]`` bool: ``1 <= a <= len - B`` (non-empty context, full block of labels) and
    ``a`` inside the loss mask (the response region)."""
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)[None, :]
    in_range = (positions >= 1) & (positions <= lengths[:, None] - block_size)
    return in_range & loss_mask


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    gamma: float,
    target_top1: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and loss weights, both ``[bs, N, B]``.

    The label of slot ``k`` is the data's ``x_{a + k}``; its weight is ``exp(-(k - 1) /
    gamma)`` where the block is kept and the label is inside the loss mask; slot 0 weighs 0.

    With ``target_top1 [bs, S]`` (position ``t``: the target's greedy next token after
    ``x_{<= t}``, set inside the loss mask) the labels are the target's own choices instead
    (teacher labels, for data the target did not write): slot ``k`` is labelled
    ``target_top1[a + k - 1]`` and weighed only where that position is in the loss mask and the
    data agrees with the target's greedy choice at every earlier slot (``x_{a + j} =
    target_top1[a + j - 1]`` for ``1 <= j < k``). So every weighted label is exactly the token
    greedy decoding writes after the anchor and the block's earlier labels.
    """
    bs, num_blocks = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    index = (anchors[:, :, None] + offsets).view(bs, -1)
    labels = input_ids.gather(1, index).view(bs, num_blocks, block_size)
    in_mask = loss_mask.gather(1, index).view(bs, num_blocks, block_size)
    decay = torch.exp(-(offsets - 1).clamp(min=0).float() / gamma) * (offsets >= 1)
    if target_top1 is not None:
        before = (index - 1).clamp(min=0)  # the position predicting each slot
        teacher = target_top1.gather(1, before).view(bs, num_blocks, block_size)
        in_mask = loss_mask.gather(1, before).view(bs, num_blocks, block_size)
        agree = (labels == teacher) | (offsets == 0)  # slot 0 (the anchor) is given
        on_path = torch.cat([agree[:, :, :1], agree[:, :, :-1].long().cumprod(2).bool()], dim=2)
        labels = torch.where(offsets >= 1, teacher, labels)
        in_mask = in_mask & on_path
    weights = decay * (in_mask & keep[:, :, None])
    return labels, weights


def block_loss(
    hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, lm_head: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy over weighted slots only (saves the full-vocab logits).

    ``hidden [bs, N, B, H]``, ``labels``/``weights [bs, N, B]``. Returns ``(loss, correct
    [B], counted [B])``: per-slot argmax hits and number of weighted labels.
    """
    used = weights > 0
    logits = lm_head(hidden[used].to(next(lm_head.parameters()).dtype)).float()
    targets = labels[used]
    w = weights[used]
    loss = (F.cross_entropy(logits, targets, reduction="none") * w).sum() / w.sum().clamp(min=1e-6)
    slot = used.nonzero()[:, 2]
    block_size = labels.shape[2]
    hits = (logits.argmax(-1) == targets).float()
    correct = torch.zeros(block_size, device=hidden.device).index_add_(0, slot, hits)
    counted = torch.bincount(slot, minlength=block_size).float()
    return loss, correct.detach(), counted


def block_candidates(
    topk_ids: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The target's top-k next tokens at the positions that predict each block's labels.

    ``topk_ids [bs, S, k]`` (position ``t``: the target's guesses for ``x_{t + 1}``),
    ``anchors [bs, N]``; returns ``[bs, N, B - 1, k]`` (slot ``k`` of anchor ``a`` is predicted
    at position ``a + k - 1``).
    """
    bs, num_blocks = anchors.shape
    index = (anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)).view(bs, -1)
    picked = topk_ids.gather(1, index[:, :, None].expand(-1, -1, topk_ids.shape[2]))
    return picked.view(bs, num_blocks, block_size - 1, -1)


def shortlist(
    must: torch.Tensor, vocab_size: int, num_negatives: int, generator: torch.Generator
) -> tuple[torch.Tensor, int, float]:
    """Token ids of a loss shortlist: the distinct ``must`` ids, then ``num_negatives`` ids
    drawn uniformly without replacement from the rest of the vocabulary.

    Returns ``(ids [K], num_must, correction)``; ``correction = log(rest / drawn)`` is added to
    the negatives' logits so that their exp-sum estimates the rest's share of the softmax
    normaliser without bias (0 when every other token is drawn).
    """
    must = torch.unique(must)
    rest = vocab_size - must.numel()
    drawn = max(0, min(num_negatives, rest))
    if drawn == 0:
        return must, must.numel(), 0.0
    scores = torch.rand(vocab_size, generator=generator).to(must.device)
    scores[must] = -1.0
    negatives = scores.topk(drawn).indices
    return torch.cat([must, negatives]), must.numel(), math.log(rest / drawn)


def shortlist_block_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    lm_head: nn.Module,
    num_negatives: int,
    generator: torch.Generator,
    candidates: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_loss` over a shortlist of the vocabulary shared by the batch.

    The shortlist is the weighted labels, ``candidates`` (any shape; e.g. the target's top-k
    from :func:`block_candidates`) and ``num_negatives`` sampled negatives (see
    :func:`shortlist`). With ``num_negatives >= vocab`` it is :func:`block_loss` exactly. The
    per-slot hits are argmax hits *within the shortlist* (an over-estimate of full-vocabulary
    accuracy; the held-out evaluation uses the full LM head).
    """
    used = weights > 0
    weight = lm_head.weight
    vocab_size = weight.shape[0]
    targets = labels[used]
    w = weights[used]
    must = targets if candidates is None else torch.cat([targets, candidates.reshape(-1)])
    ids, num_must, correction = shortlist(must, vocab_size, num_negatives, generator)
    column = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    column[ids] = torch.arange(ids.numel(), device=ids.device)
    bias = getattr(lm_head, "bias", None)
    logits = F.linear(
        hidden[used].to(weight.dtype), weight[ids], None if bias is None else bias[ids]
    ).float()
    corrected = logits
    if correction:
        offset = torch.zeros(ids.numel(), device=logits.device)
        offset[num_must:] = correction
        corrected = logits + offset
    target_columns = column[targets]
    ce = F.cross_entropy(corrected, target_columns, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    slot = used.nonzero()[:, 2]
    block_size = labels.shape[2]
    hits = (logits.argmax(-1) == target_columns).float()
    correct = torch.zeros(block_size, device=hidden.device).index_add_(0, slot, hits)
    counted = torch.bincount(slot, minlength=block_size).float()
    return loss, correct.detach(), counted


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_sequences(cfg: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids [L], loss_mask [L] bool)`` pairs with ``L > block_size`` from ``cfg.data``."""
    if isinstance(cfg.data, str):
        path = Path(cfg.data)
        pairs = _read_jsonl(path) if path.suffix == ".jsonl" else _read_text(path, cfg.target)
    else:
        masks = cfg.loss_masks or [[1] * len(ids) for ids in cfg.data]
        if len(masks) != len(cfg.data):
            raise ValueError("loss_masks must have one mask per sequence")
        pairs = [(list(ids), list(m)) for ids, m in zip(cfg.data, masks, strict=True)]
    sequences = []
    for ids, mask in pairs:
        if len(ids) != len(mask):
            raise ValueError("every loss mask must have the length of its sequence")
        if len(ids) > cfg.block_size:
            sequences.append(
                (torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))
            )
    if not sequences:
        raise ValueError(f"no training sequence longer than block_size={cfg.block_size}")
    return sequences


def _read_jsonl(path: Path) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            ids = record["input_ids"]
            pairs.append((ids, record.get("loss_mask", [1] * len(ids))))
    return pairs


def _read_text(path: Path, target: str) -> list[tuple[list[int], list[int]]]:
    """Tokenise a plain-text file in chunks into one long sequence."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    text = path.read_text(errors="replace")
    ids: list[int] = []
    for start in range(0, len(text), _TEXT_CHUNK_CHARS):
        chunk = text[start : start + _TEXT_CHUNK_CHARS]
        ids.extend(tokenizer(chunk, add_special_tokens=False)["input_ids"])
    return [(ids, [1] * len(ids))]


class Batch(NamedTuple):
    """``input_ids [bs, S]`` (right-padded with 0), ``lengths [bs]``, ``loss_mask [bs, S]`` bool
    (padding masked) and, from a feature cache, ``features [bs, S, F]`` bf16 and ``topk
    [bs, S, k]``."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor | None = None
    topk: torch.Tensor | None = None


def sample_batch(
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    cache: FeatureCache | None = None,
) -> Batch:
    """Random crops of at most ``seq_len`` tokens, right-padded with 0 (with a ``cache``, whose
    record ``i`` is ``sequences[i]``, their cached features and top-k too)."""
    picks = torch.randint(len(sequences), (batch_size,), generator=generator).tolist()
    crops = []
    for index in picks:
        ids, _ = sequences[index]
        start = 0
        if len(ids) > seq_len:
            start = int(torch.randint(len(ids) - seq_len + 1, (1,), generator=generator))
        crops.append((index, start))
    return make_batch(sequences, crops, seq_len, cache)


def make_batch(
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    crops: list[tuple[int, int]],
    seq_len: int,
    cache: FeatureCache | None = None,
) -> Batch:
    """The :class:`Batch` of ``(record index, crop start)`` pairs."""

    def pad(tensors: list[torch.Tensor]) -> torch.Tensor:
        return nn.utils.rnn.pad_sequence(tensors, batch_first=True)

    window = [slice(start, start + seq_len) for _, start in crops]
    ids = [sequences[i][0][w] for (i, _), w in zip(crops, window, strict=True)]
    masks = [sequences[i][1][w] for (i, _), w in zip(crops, window, strict=True)]
    lengths = torch.tensor([len(x) for x in ids])
    features = topk = None
    if cache is not None:
        features = pad([cache.features(i)[w] for (i, _), w in zip(crops, window, strict=True)])
        if cache.topk:
            topk = pad([cache.topk_ids(i)[w] for (i, _), w in zip(crops, window, strict=True)])
    return Batch(pad(ids), lengths, pad(masks), features, topk)


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available else cpu; an explicit ``cuda`` must be available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return device


def bf16_matmuls(device: torch.device) -> bool:
    """Whether training autocasts to bfloat16 (weights, gradients and optimizer stay float32):
    on CUDA, and on CPUs whose oneDNN runs bfloat16 matmuls (a SmolLM2 drafter step, batch 4 x
    64 anchors, on 2 avx512_bf16 cores: 1.33 s against 2.3 s in float32)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_ratio * steps`` then cosine decay to 0."""
    warmup = max(1, int(cfg.warmup_ratio * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _step_generator(seed: int, step: int) -> torch.Generator:
    """Per-step RNG so that a resumed run draws the same batches as an uninterrupted one."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def load_target(path: str, device: torch.device) -> PreTrainedModel:
    """The frozen target in eval mode (bf16 on CUDA, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    target.requires_grad_(False)
    return target


def _load_or_init(
    cfg: TrainConfig, target: PreTrainedModel, device: torch.device
) -> tuple[DFlashDrafter, torch.optim.Optimizer, int]:
    """Resume drafter, optimizer and step from ``out_dir`` if a trainer state is there; else
    start at step 0 from ``init_from``'s weights (fresh optimizer) or a random init."""
    out = Path(cfg.out_dir)
    state_path = out / TRAINER_STATE_NAME
    resume = state_path.exists() and (out / CONFIG_NAME).exists()
    state, step = None, 0
    if resume or cfg.init_from:
        source = out if resume else Path(cfg.init_from)
        drafter = DFlashDrafter.from_pretrained(source, device=device, dtype=torch.float32)
        if drafter.block_size != cfg.block_size or len(drafter.layers) != cfg.num_layers:
            raise ValueError(
                f"drafter in {source} has block_size={drafter.block_size}, "
                f"num_layers={len(drafter.layers)}; the config asks for {cfg.block_size}, "
                f"{cfg.num_layers}"
            )
        if resume:
            state = torch.load(state_path, map_location=device, weights_only=True)
            step = int(state["step"])
    else:
        drafter = DFlashDrafter.random_init(
            target.config,
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            seed=cfg.seed,
            mask_token_id=cfg.mask_token_id,
        ).to(device)
    drafter.check_compatible(target.config)
    drafter.train()
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
    )
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    return drafter, optimizer, step


@torch.no_grad()
def init_from_target_layers(
    drafter: DFlashDrafter, target: PreTrainedModel, sample_ids: torch.Tensor
) -> list[int]:
    """Start ``drafter``'s layers as copies of the target's decoder layers right after its last
    feature layer (whose output they read as their input); returns the copied layers' indices.

    Draft layer ``i`` takes target layer ``last + 1 + i``'s projections, MLP and norms; ``fc``
    passes the last feature layer through (identity on its slice, zero elsewhere) and
    ``hidden_norm`` is the first copied layer's input norm, so that layer's context keys and
    values are the target's own; the final norm is the target's. A target without per-head
    query/key norms (Llama) gets them filled with the per-head RMS of its queries and keys on
    ``sample_ids [T]`` (a training record), so the attention logits keep their scale. Biases
    (Qwen2's q/k/v) are not copied: the drafter has none. The block's queries still start from
    token embeddings, not the target's hidden states, so this is a start, not the target's
    function: on SmolLM2 it doubled held-out slot-1 acceptance after 300 steps on 303 records
    (0.168 against 0.076 from a random init).
    """
    layers = target.get_decoder().layers
    last = drafter.target_layer_ids[-1]
    sources = list(range(last + 1, last + 1 + len(drafter.layers)))
    if sources[-1] >= len(layers):
        raise ValueError(
            f"init_from_target copies target layers {sources} after the last feature layer "
            f"{last}; the target has {len(layers)}"
        )
    hidden = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    slice_start = (len(drafter.target_layer_ids) - 1) * hidden
    drafter.fc.weight[:, slice_start : slice_start + hidden] = torch.eye(hidden)
    drafter.hidden_norm.weight.copy_(layers[sources[0]].input_layernorm.weight)
    drafter.norm.weight.copy_(target.get_decoder().norm.weight)
    device = next(target.parameters()).device
    states = target(sample_ids[None].to(device), output_hidden_states=True).hidden_states
    for draft, index in zip(drafter.layers, sources, strict=True):
        source = layers[index]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(draft.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(draft.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
        draft.input_layernorm.weight.copy_(source.input_layernorm.weight)
        draft.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        x = source.input_layernorm(states[index][0].to(source.input_layernorm.weight.dtype))
        for norm, proj in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
            if hasattr(source.self_attn, norm):
                getattr(draft.self_attn, norm).weight.copy_(getattr(source.self_attn, norm).weight)
            else:
                heads = getattr(source.self_attn, proj)(x).view(-1, draft.self_attn.head_dim)
                rms = heads.float().pow(2).mean(-1).sqrt().mean()
                getattr(draft.self_attn, norm).weight.fill_(float(rms))
    return sources


def save_checkpoint(
    drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig
) -> None:
    """Drafter in the public layout plus ``trainer_state.pt`` (optimizer, step, settings)."""
    out = drafter.save_pretrained(cfg.out_dir)
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("data", "loss_masks")}
    state = {"step": step, "optimizer": optimizer.state_dict(), "config": settings}
    torch.save(state, out / TRAINER_STATE_NAME)


@torch.no_grad()
def target_features(
    target: PreTrainedModel, drafter: DFlashDrafter, input_ids: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The drafter's context features ``[bs, S, F]`` from one target forward (no cache)."""
    attention_mask = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
    attention_mask = attention_mask < lengths[:, None]
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        output_hidden_states=True,
        logits_to_keep=1,
    )
    return drafter.target_hidden_features(out.hidden_states)


def train_step(
    drafter: DFlashDrafter,
    target: PreTrainedModel,
    batch: Batch,
    cfg: TrainConfig,
    generator: torch.Generator,
    full_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss (with graph) and per-slot ``(correct [B], counted [B])`` of one batch (the full
    vocabulary's when ``full_loss`` or no ``shortlist_negatives``)."""
    device = next(drafter.parameters()).device
    input_ids, lengths, loss_mask = (t.to(device) for t in batch[:3])
    valid = valid_anchor_positions(lengths, loss_mask, cfg.block_size)
    anchors, keep = sample_anchors(valid, cfg.anchors_per_seq, generator)
    if batch.features is None:
        features = target_features(target, drafter, input_ids, lengths)
    else:
        features = batch.features.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_matmuls(device)):
        hidden = block_hidden(drafter, features, input_ids, anchors, target.get_input_embeddings())
        top1 = None
        if cfg.teacher_labels:
            top1 = batch.topk[:, :, 0].to(device)
        labels, weights = block_labels(
            input_ids, loss_mask, anchors, keep, cfg.block_size, cfg.gamma, top1
        )
        lm_head = target.get_output_embeddings()
        if cfg.shortlist_negatives is None or full_loss:
            return block_loss(hidden, labels, weights, lm_head)
        candidates = None
        if batch.topk is not None:
            candidates = block_candidates(batch.topk.to(device), anchors, cfg.block_size)[keep]
        return shortlist_block_loss(
            hidden, labels, weights, lm_head, cfg.shortlist_negatives, generator, candidates
        )


# ---------------------------------------------------------------------------------------------
# Held-out acceptance
# ---------------------------------------------------------------------------------------------


@dataclass
class HeldOut:
    """Held-out batches with their features and fixed anchors."""

    batches: list[tuple[Batch, torch.Tensor, torch.Tensor]]  # (batch, anchors, keep)


def prepare_heldout(
    records: list[tuple[torch.Tensor, torch.Tensor]],
    cfg: TrainConfig,
    drafter: DFlashDrafter,
    target: PreTrainedModel,
    cache: FeatureCache | None,
    first_index: int,
) -> HeldOut:
    """Batches of ``records`` (cache records ``first_index ..`` when cached), features computed
    once, anchors drawn once with a fixed seed."""
    generator = torch.Generator().manual_seed(cfg.seed + 7919)
    device = next(drafter.parameters()).device
    batches = []
    for first in range(0, len(records), cfg.batch_size):
        count = min(cfg.batch_size, len(records) - first)
        if cache is not None:
            crops = [(first_index + first + j, 0) for j in range(count)]
            batch = make_batch([None] * first_index + records, crops, cfg.seq_len, cache)
        else:
            crops = [(first + j, 0) for j in range(count)]
            batch = make_batch(records, crops, cfg.seq_len)
            features = target_features(
                target, drafter, batch.input_ids.to(device), batch.lengths.to(device)
            )
            batch = batch._replace(features=features)
        valid = valid_anchor_positions(batch.lengths, batch.loss_mask, cfg.block_size)
        anchors, keep = sample_anchors(valid, cfg.eval_anchors, generator)
        batches.append((batch, anchors, keep))
    return HeldOut(batches)


@torch.no_grad()
def heldout_acceptance(
    drafter: DFlashDrafter, target: PreTrainedModel, heldout: HeldOut
) -> dict[str, float]:
    """Greedy acceptance on held-out blocks with the full LM head: ``heldout_acc_slot1`` (the
    first drafted token equals the data's next token) and ``heldout_tau`` (1 + the mean number
    of leading drafted tokens that match, the chain's tokens per step on this block)."""
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    slot1_hits = slot1_count = 0.0
    accepted_sum = blocks = 0.0
    for batch, anchors, keep in heldout.batches:
        input_ids, loss_mask = batch.input_ids.to(device), batch.loss_mask.to(device)
        anchors, keep = anchors.to(device), keep.to(device)
        hidden = block_hidden(drafter, batch.features.to(device), input_ids, anchors, embed)
        block_size = drafter.block_size
        labels, weights = block_labels(input_ids, loss_mask, anchors, keep, block_size, 1.0)
        hidden, labels, weights = hidden[keep][:, 1:], labels[keep][:, 1:], weights[keep][:, 1:]
        predicted = lm_head(hidden.to(lm_head.weight.dtype)).argmax(-1)
        match = (predicted == labels) & (weights > 0)
        slot1_hits += float(match[:, 0].sum())
        slot1_count += float((weights[:, 0] > 0).sum())
        accepted_sum += float(match.long().cumprod(dim=1).sum())
        blocks += match.shape[0]
    drafter.train(was_training)
    return {
        "heldout_acc_slot1": slot1_hits / max(slot1_count, 1.0),
        "heldout_tau": 1.0 + accepted_sum / max(blocks, 1.0),
        "heldout_blocks": int(blocks),
    }


# ---------------------------------------------------------------------------------------------
# Loop
# ---------------------------------------------------------------------------------------------


def _prepare_data(
    cfg: TrainConfig, drafter: DFlashDrafter, target: PreTrainedModel
) -> tuple[list, list, FeatureCache | None]:
    """``(training records, held-out records, cache)``; records are cache windows when a
    feature cache is used, and the held-out records are the last ``heldout_records``."""
    sequences = load_sequences(cfg)
    cache = None
    if cfg.feature_cache:
        sequences = window_records(sequences, cfg.seq_len, cfg.block_size)
    if not 0 <= cfg.heldout_records < len(sequences):
        raise ValueError(
            f"heldout_records={cfg.heldout_records} leaves no training record of {len(sequences)}"
        )
    if cfg.feature_cache:
        wants_topk = cfg.shortlist_negatives is not None or cfg.teacher_labels
        topk = cfg.cache_topk if wants_topk else 0
        # The target serves in bfloat16: its cache is computed in bfloat16 too (features are
        # stored in bfloat16 anyway; ~1.7x faster than float32 on a 2-core avx512_bf16 CPU).
        cache_target = target
        if target.dtype != torch.bfloat16:
            cache_target = copy.deepcopy(target).to(torch.bfloat16)
        cache = build_feature_cache(
            cfg.feature_cache,
            sequences,
            cache_target,
            cfg.target,
            drafter.target_layer_ids,
            topk=topk,
            batch_size=cfg.cache_batch_size,
        )
        tqdm.write(
            f"feature cache {cfg.feature_cache}: {cache.num_records} records, "
            f"{cache.offsets[-1]} tokens, {cache.bytes_on_disk / 2**20:.1f} MiB"
        )
    split = len(sequences) - cfg.heldout_records
    return sequences[:split], sequences[split:], cache


def train_dflash(cfg: TrainConfig) -> Path:
    """Train (or resume) a DFlash drafter for ``cfg.target``; returns the checkpoint directory.

    Writes ``config.json`` + ``model.safetensors`` (public DFlash layout), ``trainer_state.pt``
    every ``save_every`` steps and at the end (also when a stop rule fires), and
    ``train_log.jsonl`` every ``log_every`` steps (loss, mean and slot-1 accuracy, lr) plus a
    held-out record per evaluation and a ``stopped`` record when a stop rule ends the run.
    """
    _check_config(cfg)
    device = resolve_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target, device)
    drafter, optimizer, start = _load_or_init(cfg, target, device)
    sequences, heldout_records, cache = _prepare_data(cfg, drafter, target)
    if cfg.init_from_target and start == 0:
        copied = init_from_target_layers(drafter, target, sequences[0][0][: cfg.seq_len])
        tqdm.write(f"drafter layers initialised from target layers {copied}")
    heldout = None
    if heldout_records:
        heldout = prepare_heldout(
            heldout_records, cfg, drafter, target, cache, first_index=len(sequences)
        )
    eval_every = cfg.eval_every or cfg.save_every
    correct = torch.zeros(cfg.block_size, device=device)
    counted = torch.zeros(cfg.block_size, device=device)
    loss_sum, loss_steps = 0.0, 0
    end = cfg.steps if cfg.stop_at is None else max(start, min(cfg.stop_at, cfg.steps))
    if heldout is not None and start == 0:  # the starting point (e.g. an init_from drafter)
        _append_log(out, {"step": 0, **heldout_acceptance(drafter, target, heldout)})
    progress = tqdm(range(start, end), initial=start, total=end, desc="train-drafter")
    began = time.monotonic()
    done, stopped = start, None
    for step in progress:
        generator = _step_generator(cfg.seed, step)
        batch = sample_batch(sequences, cfg.batch_size, cfg.seq_len, generator, cache)
        full_loss = step < cfg.full_loss_steps
        loss, step_correct, step_counted = train_step(
            drafter, target, batch, cfg, generator, full_loss
        )
        _optimize(drafter, optimizer, loss, lr_at(step, cfg), cfg.grad_clip)
        correct += step_correct
        counted += step_counted
        loss_sum, loss_steps = loss_sum + loss.item(), loss_steps + 1
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            record = _log_record(done, loss_sum / loss_steps, correct, counted, lr_at(step, cfg))
            progress.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['acc_slot1']:.3f}")
            _append_log(out, record)
            correct.zero_()
            counted.zero_()
            loss_sum, loss_steps = 0.0, 0
        if heldout is not None and (done % eval_every == 0 or done == end):
            stopped = _evaluate(drafter, target, heldout, done, cfg, out, progress)
        if stopped is None and cfg.max_minutes is not None and done != end:
            if time.monotonic() - began >= 60.0 * cfg.max_minutes:
                stopped = f"{cfg.max_minutes} minutes of training"
        if stopped is not None:
            _append_log(out, {"step": done, "stopped": stopped})
            progress.write(f"stopped at step {done}: {stopped}")
            break
        if done % cfg.save_every == 0 and done != end:
            save_checkpoint(drafter, optimizer, done, cfg)
    progress.close()
    save_checkpoint(drafter, optimizer, max(start, done), cfg)
    return out


def _check_config(cfg: TrainConfig) -> None:
    """Refuse a configuration :func:`train_dflash` cannot run, before loading anything."""
    if not 2 <= cfg.block_size < cfg.seq_len:
        raise ValueError(f"need 2 <= block_size < seq_len, got {cfg.block_size}, {cfg.seq_len}")
    if not (Path(cfg.target) / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"no transformers model at {cfg.target} (missing {CONFIG_NAME})")
    if isinstance(cfg.data, str) and not Path(cfg.data).is_file():
        raise FileNotFoundError(f"training data {cfg.data} does not exist")
    if cfg.stop_heldout_acc is not None and cfg.heldout_records == 0:
        raise ValueError("stop_heldout_acc needs heldout_records > 0")
    if cfg.init_from and cfg.init_from_target:
        raise ValueError("init_from and init_from_target are two starting points: pick one")
    if cfg.teacher_labels and not (cfg.feature_cache and cfg.cache_topk >= 1):
        raise ValueError("teacher_labels needs a feature_cache with cache_topk >= 1")


def _optimize(
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    lr: float,
    grad_clip: float,
) -> None:
    """One optimizer step on ``loss`` at learning rate ``lr``, gradients clipped."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    optimizer.step()


def _evaluate(
    drafter: DFlashDrafter,
    target: PreTrainedModel,
    heldout: HeldOut,
    done: int,
    cfg: TrainConfig,
    out: Path,
    progress: tqdm,
) -> str | None:
    """Log the held-out acceptance after ``done`` steps; the stop rule's reason when
    ``stop_heldout_acc`` is reached, else None."""
    result = {"step": done, **heldout_acceptance(drafter, target, heldout)}
    _append_log(out, result)
    progress.write(
        f"step {done}: held-out slot-1 acceptance {result['heldout_acc_slot1']:.3f}, "
        f"chain tau {result['heldout_tau']:.3f} ({result['heldout_blocks']} blocks)"
    )
    if cfg.stop_heldout_acc is not None and result["heldout_acc_slot1"] >= cfg.stop_heldout_acc:
        return f"held-out slot-1 acceptance >= {cfg.stop_heldout_acc}"
    return None


def _append_log(out: Path, record: dict) -> None:
    with (out / LOG_NAME).open("a") as log:
        log.write(json.dumps(record) + "\n")


def _log_record(
    step: int, loss: float, correct: torch.Tensor, counted: torch.Tensor, lr: float
) -> dict[str, float | int | list[float]]:
    per_slot = (correct / counted.clamp(min=1)).tolist()
    return {
        "step": step,
        "loss": loss,
        "acc_slot1": per_slot[1],
        "acc_mean": float(correct[1:].sum() / counted[1:].sum().clamp(min=1)),
        "acc_per_slot": per_slot[1:],
        "lr": lr,
    }


# ---------------------------------------------------------------------------------------------
# CLI glue
# ---------------------------------------------------------------------------------------------


def add_train_drafter_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sglang-tree-spec models train-drafter``."""
    _add_run_args(parser)
    _add_feature_args(parser)
    _add_heldout_args(parser)
    _add_start_args(parser)


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    """The target, data and output; the drafter's shape, the optimisation and the checkpoints."""
    d = TrainConfig.__dataclass_fields__
    parser.add_argument("--target", required=True, help="target model directory (transformers)")
    parser.add_argument("--out", required=True, help="output directory of the drafter")
    parser.add_argument(
        "--data", required=True, help="plain-text file, or .jsonl with input_ids[/loss_mask]"
    )
    parser.add_argument("--block-size", type=int, default=d["block_size"].default)
    parser.add_argument("--num-layers", type=int, default=d["num_layers"].default)
    parser.add_argument("--steps", type=int, default=d["steps"].default)
    parser.add_argument("--batch-size", type=int, default=d["batch_size"].default)
    parser.add_argument("--seq-len", type=int, default=d["seq_len"].default)
    parser.add_argument("--lr", type=float, default=d["lr"].default)
    parser.add_argument(
        "--gamma", type=float, default=d["gamma"].default, help="loss decay over block slots"
    )
    parser.add_argument("--anchors-per-seq", type=int, default=d["anchors_per_seq"].default)
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=d["seed"].default)
    parser.add_argument("--device", default=d["device"].default, help="auto, cpu or cuda[:i]")
    parser.add_argument("--save-every", type=int, default=d["save_every"].default)
    parser.add_argument("--log-every", type=int, default=d["log_every"].default)
    parser.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="stop and save at this step (resume later, e.g. with other batch settings)",
    )


def _add_feature_args(parser: argparse.ArgumentParser) -> None:
    """The target's cached features and the shortlist loss over them."""
    d = TrainConfig.__dataclass_fields__
    parser.add_argument(
        "--feature-cache",
        default=None,
        help="directory caching the target's features per record (built once, resumable)",
    )
    parser.add_argument(
        "--cache-topk",
        type=int,
        default=d["cache_topk"].default,
        help="target top-k next tokens cached per position (shortlist loss candidates)",
    )
    parser.add_argument("--cache-batch-size", type=int, default=d["cache_batch_size"].default)
    parser.add_argument(
        "--shortlist-negatives",
        type=int,
        default=None,
        help="loss over labels + cached target top-k + this many sampled negatives "
        "(default: full vocabulary)",
    )
    parser.add_argument(
        "--full-loss-steps",
        type=int,
        default=0,
        help="full-vocabulary loss for the first N steps, then the shortlist (least faithful "
        "at random init)",
    )


def _add_heldout_args(parser: argparse.ArgumentParser) -> None:
    """The held-out records, their evaluation and the stop rules."""
    d = TrainConfig.__dataclass_fields__
    parser.add_argument(
        "--heldout-records",
        type=int,
        default=0,
        help="hold out the last N records; log their slot-1 acceptance as training goes",
    )
    parser.add_argument(
        "--eval-every", type=int, default=0, help="held-out period (default: at every save)"
    )
    parser.add_argument("--eval-anchors", type=int, default=d["eval_anchors"].default)
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="stop and save after this training time"
    )
    parser.add_argument(
        "--stop-heldout-acc",
        type=float,
        default=None,
        help="stop and save once the held-out slot-1 acceptance reaches this",
    )


def _add_start_args(parser: argparse.ArgumentParser) -> None:
    """The labels and the starting point of a fresh run."""
    parser.add_argument(
        "--teacher-labels",
        action="store_true",
        help="labels = the target's greedy next tokens (cached top-1), for data the target did "
        "not write (regen-data --reference); needs --feature-cache",
    )
    parser.add_argument(
        "--init-from",
        default=None,
        help="start a fresh run from this drafter's weights (e.g. the shipped one) instead of "
        "a random init; the optimizer and schedule start anew",
    )
    parser.add_argument(
        "--init-from-target",
        action="store_true",
        help="start a fresh run's layers as copies of the target's layers after its last "
        "feature layer (fc passes that layer through) instead of a random init",
    )


def run_train_drafter(args: argparse.Namespace) -> int:
    """Run :func:`train_dflash` from parsed ``add_train_drafter_args`` arguments."""
    cfg = TrainConfig(
        target=args.target,
        out_dir=args.out,
        data=args.data,
        block_size=args.block_size,
        num_layers=args.num_layers,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        gamma=args.gamma,
        anchors_per_seq=args.anchors_per_seq,
        mask_token_id=args.mask_token_id,
        seed=args.seed,
        device=args.device,
        save_every=args.save_every,
        log_every=args.log_every,
        stop_at=args.stop_at,
        feature_cache=args.feature_cache,
        cache_topk=args.cache_topk,
        cache_batch_size=args.cache_batch_size,
        shortlist_negatives=args.shortlist_negatives,
        full_loss_steps=args.full_loss_steps,
        heldout_records=args.heldout_records,
        eval_every=args.eval_every,
        eval_anchors=args.eval_anchors,
        max_minutes=args.max_minutes,
        stop_heldout_acc=args.stop_heldout_acc,
        init_from=args.init_from,
        init_from_target=args.init_from_target,
        teacher_labels=args.teacher_labels,
    )
    print(train_dflash(cfg))
    return 0
