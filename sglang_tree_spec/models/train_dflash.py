"""Training recipe for DFlash drafters (public DFlash recipe, pure PyTorch + transformers).

The target (with its embedding and LM head) is frozen. Each training sequence gets several
random anchors ``a`` (in the response region when a loss mask is given). Block ``n`` is
``[x_a, MASK x (B - 1)]`` at positions ``a .. a + B - 1``; it sees the target context features
strictly before ``a``, attends bidirectionally inside itself and never sees other blocks. All
blocks of a batch run in one drafter forward with one explicit boolean attention mask, through
the same :class:`~sglang_tree_spec.drafters.dflash.DFlashDrafter` code as inference. The label
of slot ``k`` is ``x_{a + k}``; slot ``k >= 1`` has cross-entropy weight
``exp(-(k - 1) / gamma)`` (slot 0, the anchor, has none).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from sglang_tree_spec.drafters.dflash import CONFIG_NAME, DFlashDrafter

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``x_{a + k}`` and loss weights, both ``[bs, N, B]``.

    Weight of slot ``k >= 1`` is ``exp(-(k - 1) / gamma)`` where the block is kept and the
    label is inside the loss mask; slot 0 weighs 0.
    """
    bs, num_blocks = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    index = (anchors[:, :, None] + offsets).view(bs, -1)
    labels = input_ids.gather(1, index).view(bs, num_blocks, block_size)
    in_mask = loss_mask.gather(1, index).view(bs, num_blocks, block_size)
    decay = torch.exp(-(offsets - 1).clamp(min=0).float() / gamma) * (offsets >= 1)
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


def sample_batch(
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random crops of at most ``seq_len`` tokens, right-padded with 0.

    Returns ``(input_ids [bs, S], lengths [bs], loss_mask [bs, S] bool)`` (padding masked).
    """
    picks = torch.randint(len(sequences), (batch_size,), generator=generator).tolist()
    crops = []
    for index in picks:
        ids, mask = sequences[index]
        start = 0
        if len(ids) > seq_len:
            start = int(torch.randint(len(ids) - seq_len + 1, (1,), generator=generator))
        crops.append((ids[start : start + seq_len], mask[start : start + seq_len]))
    lengths = torch.tensor([len(ids) for ids, _ in crops])
    input_ids = nn.utils.rnn.pad_sequence([ids for ids, _ in crops], batch_first=True)
    loss_mask = nn.utils.rnn.pad_sequence([m for _, m in crops], batch_first=True)
    return input_ids, lengths, loss_mask


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
    """Resume drafter, optimizer and step from ``out_dir`` if a trainer state is there."""
    out = Path(cfg.out_dir)
    state_path = out / TRAINER_STATE_NAME
    if state_path.exists() and (out / CONFIG_NAME).exists():
        drafter = DFlashDrafter.from_pretrained(out, device=device, dtype=torch.float32)
        if drafter.block_size != cfg.block_size or len(drafter.layers) != cfg.num_layers:
            raise ValueError(
                f"checkpoint in {out} has block_size={drafter.block_size}, "
                f"num_layers={len(drafter.layers)}; the config asks for {cfg.block_size}, "
                f"{cfg.num_layers}"
            )
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
        state, step = None, 0
    drafter.check_compatible(target.config)
    drafter.train()
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
    )
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    return drafter, optimizer, step


def save_checkpoint(
    drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig
) -> None:
    """Drafter in the public layout plus ``trainer_state.pt`` (optimizer, step, settings)."""
    out = drafter.save_pretrained(cfg.out_dir)
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("data", "loss_masks")}
    state = {"step": step, "optimizer": optimizer.state_dict(), "config": settings}
    torch.save(state, out / TRAINER_STATE_NAME)


def train_step(
    drafter: DFlashDrafter,
    target: PreTrainedModel,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: TrainConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss (with graph) and per-slot ``(correct [B], counted [B])`` of one batch."""
    device = next(drafter.parameters()).device
    input_ids, lengths, loss_mask = (t.to(device) for t in batch)
    valid = valid_anchor_positions(lengths, loss_mask, cfg.block_size)
    anchors, keep = sample_anchors(valid, cfg.anchors_per_seq, generator)
    attention_mask = torch.arange(input_ids.shape[1], device=device)[None, :] < lengths[:, None]
    with torch.no_grad():
        out = target(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            output_hidden_states=True,
            logits_to_keep=1,
        )
        features = drafter.target_hidden_features(out.hidden_states)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = block_hidden(drafter, features, input_ids, anchors, target.get_input_embeddings())
        labels, weights = block_labels(
            input_ids, loss_mask, anchors, keep, cfg.block_size, cfg.gamma
        )
        return block_loss(hidden, labels, weights, target.get_output_embeddings())


def train_dflash(cfg: TrainConfig) -> Path:
    """Train (or resume) a DFlash drafter for ``cfg.target``; returns the checkpoint directory.

    Writes ``config.json`` + ``model.safetensors`` (public DFlash layout), ``trainer_state.pt``
    every ``save_every`` steps and at the end, and ``train_log.jsonl`` every ``log_every`` steps
    (loss, mean and slot-1 accuracy, lr).
    """
    if not 2 <= cfg.block_size < cfg.seq_len:
        raise ValueError(f"need 2 <= block_size < seq_len, got {cfg.block_size}, {cfg.seq_len}")
    if not (Path(cfg.target) / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"no transformers model at {cfg.target} (missing {CONFIG_NAME})")
    if isinstance(cfg.data, str) and not Path(cfg.data).is_file():
        raise FileNotFoundError(f"training data {cfg.data} does not exist")
    device = resolve_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target, device)
    drafter, optimizer, start = _load_or_init(cfg, target, device)
    sequences = load_sequences(cfg)
    correct = torch.zeros(cfg.block_size, device=device)
    counted = torch.zeros(cfg.block_size, device=device)
    loss_sum, loss_steps = 0.0, 0
    end = cfg.steps if cfg.stop_at is None else max(start, min(cfg.stop_at, cfg.steps))
    progress = tqdm(range(start, end), initial=start, total=cfg.steps, desc="train-drafter")
    for step in progress:
        generator = _step_generator(cfg.seed, step)
        batch = sample_batch(sequences, cfg.batch_size, cfg.seq_len, generator)
        loss, step_correct, step_counted = train_step(drafter, target, batch, cfg, generator)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        optimizer.step()
        correct += step_correct
        counted += step_counted
        loss_sum, loss_steps = loss_sum + loss.item(), loss_steps + 1
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            record = _log_record(done, loss_sum / loss_steps, correct, counted, lr_at(step, cfg))
            progress.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['acc_slot1']:.3f}")
            with (out / LOG_NAME).open("a") as log:
                log.write(json.dumps(record) + "\n")
            correct.zero_()
            counted.zero_()
            loss_sum, loss_steps = 0.0, 0
        if done % cfg.save_every == 0 and done != end:
            save_checkpoint(drafter, optimizer, done, cfg)
    save_checkpoint(drafter, optimizer, max(start, end), cfg)
    return out


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
    )
    print(train_dflash(cfg))
    return 0
