"""A small real target + DFlash drafter pair, built from scratch on CPU by the project's code.

Recipe (one call of :func:`build_small_pair`, seeded):

1. Corpus: the ``.py`` files of the running interpreter's standard library (no test
   directories, no site-packages, no huge or generated files), split train / held-out by a hash
   of each file's relative path, so the split of a path never depends on the Python version.
2. Tokenizer: byte-level BPE trained on the training split, with ``<|endoftext|>`` (eos, pad)
   and ``<|mask|>`` (the drafter's mask token); exact round trip of source code.
3. Target: a small Llama causal LM trained by next-token prediction on the training split.
4. Drafter: a DFlash drafter trained with :func:`~sglang_tree_spec.models.train_dflash.
   train_dflash` on the target's own short greedy continuations of many training prompts
   (short, because a small target's long continuations soon fall into easy loops).
5. ``out_dir/target`` (transformers model + tokenizer), ``out_dir/drafter`` (DFlash layout) and
   ``out_dir/BUILD.json`` (versions, settings, losses, measurements, wall times, SHA256s).

The committed pair (:data:`SMALL_PAIR_DIR`) was built by
``OMP_WAIT_POLICY=PASSIVE python -m sglang_tree_spec.models.small_pair --out DIR`` (about half
an hour on two CPU cores). ``OMP_WAIT_POLICY=PASSIVE`` matters on a shared machine: spinning
OpenMP threads otherwise slow training several-fold when other processes compete for the cores.
"""

from __future__ import annotations

import argparse
import ast
import functools
import gzip
import hashlib
import json
import math
import platform
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from sglang_tree_spec.drafters.dflash import DFlashDrafter
from sglang_tree_spec.models.train_dflash import LOG_NAME, TrainConfig, train_dflash

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
BUILD_NAME = "BUILD.json"
SMALL_PAIR_DIR = Path(__file__).resolve().parents[1] / "assets" / "small-pair"
HELDOUT_PROMPTS_FILE = "heldout_prompts.json.gz"

# Directories never read (tests, third-party code, caches) and file-name prefixes of
# machine-specific modules.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
SKIP_FILE_PREFIXES = ("_sysconfigdata",)
# Markers of generated data modules (the charmap tables of ``encodings/``).
GENERATED_MARKERS = ("gencodec.py",)

Split = Literal["train", "heldout"]


@dataclass
class SmallPairConfig:
    """Every setting of a build; the defaults reproduce the committed pair."""

    # corpus
    heldout_percent: int = 5
    max_file_bytes: int = 200_000
    train_files_limit: int = 0  # 0 = every training file (smoke tests use a few)
    # tokenizer
    vocab_size: int = 2048
    # target
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_positions: int = 1024
    target_steps: int = 1400
    target_batch_size: int = 8
    target_seq_len: int = 256
    target_lr: float = 2e-3
    target_warmup_ratio: float = 0.05
    target_weight_decay: float = 0.1
    eval_chunks: int = 48
    # drafter data: greedy target continuations of training prompts
    gen_sequences: int = 6144
    gen_prompt_len: int = 96
    gen_new_tokens: int = 48
    gen_batch_size: int = 128
    # drafter
    drafter_layers: int = 1
    block_size: int = 8
    drafter_steps: int = 1800
    drafter_batch_size: int = 16
    drafter_lr: float = 1.5e-3
    drafter_anchors_per_seq: int = 16
    # measurements
    eval_prompts: int = 96
    eval_decoded: int = 32
    seed: int = 0
    save_dtype: str = "bfloat16"


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusFile:
    """One source file: POSIX path relative to the stdlib root, and its text."""

    rel: str
    text: str


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str, heldout_percent: int) -> bool:
    """Whether a relative path is held out: ``sha256(rel) mod 100 < heldout_percent``."""
    digest = hashlib.sha256(rel.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < heldout_percent


def _keep_path(rel: Path, size: int, max_file_bytes: int) -> bool:
    skipped_dir = any(part in SKIP_DIRS for part in rel.parts[:-1])
    return (
        not skipped_dir and not rel.name.startswith(SKIP_FILE_PREFIXES) and size <= max_file_bytes
    )


@functools.lru_cache(maxsize=4)
def stdlib_files(root: Path | None = None, max_file_bytes: int = 200_000) -> tuple[CorpusFile, ...]:
    """Readable, non-generated ``.py`` files under ``root`` (default: the stdlib), sorted by
    relative path (cached: the stdlib does not change while a process runs)."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if not path.is_file() or not _keep_path(rel, path.stat().st_size, max_file_bytes):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and not any(marker in text for marker in GENERATED_MARKERS):
            files.append(CorpusFile(rel.as_posix(), text))
    return tuple(files)


def split_corpus(
    files: Sequence[CorpusFile], heldout_percent: int
) -> dict[Split, list[CorpusFile]]:
    """Train / held-out split by path hash; training also drops any file whose text equals a
    held-out file's (copies under another path)."""
    heldout = [f for f in files if is_heldout(f.rel, heldout_percent)]
    heldout_texts = {f.text for f in heldout}
    train = [
        f for f in files if not is_heldout(f.rel, heldout_percent) and f.text not in heldout_texts
    ]
    return {"train": train, "heldout": heldout}


def corpus_files(
    split: Split, heldout_percent: int = 5, max_file_bytes: int = 200_000
) -> list[CorpusFile]:
    """The ``split`` files of the running interpreter's stdlib corpus, sorted by path."""
    return split_corpus(stdlib_files(max_file_bytes=max_file_bytes), heldout_percent)[split]


def _evenly_spaced(items: Sequence[Any], count: int) -> list[Any]:
    """``count`` items spread evenly over ``items`` (all of them when ``count <= 0`` or
    ``count >= len(items)``)."""
    if count <= 0 or count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def function_prompts(text: str, context_lines: int = 24, max_chars: int = 1200) -> list[str]:
    """Prompts cut after each function's signature and docstring (the body is left to write).

    Each prompt is up to ``context_lines`` preceding lines plus the ``def`` through its
    docstring (or its signature when there is none), at most ``max_chars`` characters, without
    the final newline (so the model's first token is the newline + indentation it learned).
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    prompts = []
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for node in sorted(functions, key=lambda n: n.lineno):
        first = node.body[0]
        has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        has_docstring = has_docstring and isinstance(first.value.value, str)
        cut = first.end_lineno if has_docstring else first.lineno - 1
        if cut is None or cut < node.lineno or cut >= len(lines):
            continue  # one-line function, or nothing left to write
        start = max(0, cut - context_lines)
        while start < node.lineno - 1 and len("".join(lines[start:cut])) > max_chars:
            start += 1
        prompt = "".join(lines[start:cut]).rstrip("\n")
        if len(prompt) <= max_chars:
            prompts.append(prompt)
    return prompts


def heldout_prompts(count: int = 64, heldout_percent: int = 5, max_chars: int = 1200) -> list[str]:
    """``count`` function prompts (see :func:`function_prompts`) spread over the held-out files
    of the stdlib: text never seen in training.

    With the default split and length, the prompts are the ones shipped with the package
    (``assets/small-pair/heldout_prompts.json.gz``, cut from CPython 3.11.7's stdlib), so the
    demo, tests and benchmarks see the same text on every machine; other settings read the
    running interpreter's stdlib."""
    if (heldout_percent, max_chars) == (5, 1200):
        prompts = shipped_heldout_prompts()
    else:
        prompts = [
            prompt
            for file in corpus_files("heldout", heldout_percent)
            for prompt in function_prompts(file.text, max_chars=max_chars)
        ]
    return _evenly_spaced(prompts, count)


@functools.cache
def shipped_heldout_prompts() -> list[str]:
    """Every held-out function prompt shipped with the package (see :func:`heldout_prompts`)."""
    with gzip.open(SMALL_PAIR_DIR / HELDOUT_PROMPTS_FILE, "rt", encoding="utf-8") as stream:
        return json.load(stream)["prompts"]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(
    texts: Sequence[str], vocab_size: int, max_length: int
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over ``texts`` with special tokens ``<|endoftext|>`` (id 0: eos and pad)
    and ``<|mask|>`` (id 1); decoding reproduces the input exactly."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> torch.Tensor:
    """One token stream ``[N]`` (int64): each document followed by ``<|endoftext|>``."""
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(list(texts)):
        ids.extend(encoding.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


def target_config(cfg: SmallPairConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The target's Llama config (tied embeddings, MHA, SiLU MLP)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def cosine_lr(step: int, steps: int, peak: float, warmup_ratio: float) -> float:
    """Linear warm-up over ``warmup_ratio * steps`` then cosine decay to 0."""
    warmup = max(1, int(warmup_ratio * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def sample_windows(
    stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """``[batch_size, length]`` random windows of a token stream ``[N]``."""
    starts = torch.randint(len(stream) - length + 1, (batch_size, 1), generator=generator)
    return stream[starts + torch.arange(length)]


def _adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def train_target(
    model: PreTrainedModel, stream: torch.Tensor, cfg: SmallPairConfig, log_every: int = 50
) -> list[dict[str, float]]:
    """Next-token training on random windows of ``stream [N]``; returns the loss curve (mean
    loss over each ``log_every`` steps)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = _adamw(model, cfg.target_lr, cfg.target_weight_decay)
    model.train()
    curve, window = [], []
    progress = tqdm(range(cfg.target_steps), desc="train-target")
    for step in progress:
        batch = sample_windows(stream, cfg.target_batch_size, cfg.target_seq_len, generator)
        lr = cosine_lr(step, cfg.target_steps, cfg.target_lr, cfg.target_warmup_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        window.append(loss.item())
        if len(window) == log_every or step + 1 == cfg.target_steps:
            curve.append({"step": step + 1, "loss": sum(window) / len(window), "lr": lr})
            progress.set_postfix(loss=f"{curve[-1]['loss']:.3f}")
            window = []
    model.eval()
    return curve


@torch.no_grad()
def heldout_loss(model: PreTrainedModel, stream: torch.Tensor, seq_len: int, chunks: int) -> float:
    """Mean next-token cross-entropy (nats) over up to ``chunks`` consecutive ``seq_len``
    windows of a held-out token stream ``[N]``."""
    count = min(chunks, len(stream) // seq_len)
    batch = stream[: count * seq_len].view(count, seq_len)
    losses = [model(input_ids=row[None], labels=row[None]).loss.item() for row in batch]
    return sum(losses) / len(losses)


# ---------------------------------------------------------------------------------------------
# Drafter data and measurements
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_continuations(
    model: PreTrainedModel, stream: torch.Tensor, cfg: SmallPairConfig
) -> tuple[list[list[int]], list[list[int]]]:
    """``(input_ids, loss_masks)``: random training prompts of ``gen_prompt_len`` tokens plus
    the target's greedy continuation (up to ``gen_new_tokens``, cut after an eos); the loss mask
    is 1 on the continuation only."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    eos = model.config.eos_token_id
    sequences, masks = [], []
    for start in tqdm(range(0, cfg.gen_sequences, cfg.gen_batch_size), desc="greedy-data"):
        size = min(cfg.gen_batch_size, cfg.gen_sequences - start)
        prompts = sample_windows(stream, size, cfg.gen_prompt_len, generator)
        output = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=cfg.gen_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        for row in output.tolist():
            response = row[cfg.gen_prompt_len :]
            if eos in response:
                response = response[: response.index(eos) + 1]
            sequences.append(row[: cfg.gen_prompt_len] + response)
            masks.append([0] * cfg.gen_prompt_len + [1] * len(response))
    return sequences, masks


@torch.no_grad()
def greedy_continuation(
    target: PreTrainedModel, prompt_ids: Sequence[int], count: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The prompt's hidden states (transformers tuple, each ``[1, T, H]``) and the target's
    next ``count`` greedy tokens ``[count]`` (eos is not special here)."""
    out = target(input_ids=torch.tensor([list(prompt_ids)]), output_hidden_states=True)
    hidden_states = out.hidden_states
    tokens = [out.logits[0, -1].argmax()]
    for _ in range(count - 1):
        out = target(input_ids=tokens[-1].view(1, 1), past_key_values=out.past_key_values)
        tokens.append(out.logits[0, -1].argmax())
    return hidden_states, torch.stack(tokens)


@torch.no_grad()
def draft_hits(
    target: PreTrainedModel, drafter: DFlashDrafter, prompt_ids: Sequence[int]
) -> torch.Tensor:
    """``[B - 1]`` bool: does drafter slot ``k`` (argmax) equal the ``k``-th token after the
    bonus token of the target's greedy continuation of ``prompt_ids``?

    The drafter sees the prompt's target features and the block ``[g_0, MASK, ...]``, where
    ``g_0`` is the target's greedy next token, exactly as in the engine's first draft step.
    """
    hidden_states, greedy = greedy_continuation(target, prompt_ids, drafter.block_size)
    cache = drafter.new_cache(1)
    cache.append(drafter.target_hidden_features(hidden_states))
    block = drafter.block_token_ids(greedy[:1])
    logits = cache.draft_logits(
        block, target.get_input_embeddings(), target.get_output_embeddings()
    )
    return logits[0].argmax(-1) == greedy[1:]


def acceptance_stats(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    decoded: int = 0,
) -> dict[str, Any]:
    """Drafter vs target greedy over ``prompts`` (token ids), each first extended by
    ``decoded`` greedy target tokens (0: draft right after the prompt; > 0: mid-generation):
    per-slot top-1 agreement (slots 1 .. B - 1) and chain tau = 1 + mean number of leading
    agreeing slots (the tokens a greedy DFlash chain step commits, bonus included)."""
    if decoded:
        prompts = [
            list(ids) + greedy_continuation(target, ids, decoded)[1].tolist() for ids in prompts
        ]
    hits = torch.stack([draft_hits(target, drafter, ids) for ids in prompts]).float()
    leading = hits.cumprod(dim=1).sum(dim=1)
    return {
        "prompts": len(prompts),
        "decoded": decoded,
        "slot_accuracy": [round(v, 4) for v in hits.mean(dim=0).tolist()],
        "chain_tau": round(1.0 + leading.mean().item(), 4),
    }


def heldout_windows(stream: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """``count`` evenly spaced ``length``-token windows of a held-out stream ``[N]``."""
    starts = _evenly_spaced(range(len(stream) - length + 1), count)
    return [stream[s : s + length].tolist() for s in starts]


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "python_full": sys.version,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }


def _prepare_corpus(cfg: SmallPairConfig) -> tuple[dict[Split, list[CorpusFile]], dict[str, Any]]:
    """The split (training optionally thinned to ``train_files_limit`` files) and its record."""
    split = split_corpus(stdlib_files(max_file_bytes=cfg.max_file_bytes), cfg.heldout_percent)
    if cfg.train_files_limit:
        split["train"] = _evenly_spaced(split["train"], cfg.train_files_limit)
    record = {
        "root": str(stdlib_root()),
        "train_files": len(split["train"]),
        "train_chars": sum(len(f.text) for f in split["train"]),
        "heldout_files": [f.rel for f in split["heldout"]],
        "heldout_chars": sum(len(f.text) for f in split["heldout"]),
    }
    return split, record


def _build_target(
    cfg: SmallPairConfig,
    tokenizer: PreTrainedTokenizerFast,
    train_stream: torch.Tensor,
    heldout_stream: torch.Tensor,
    target_dir: Path,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Train, save (``save_dtype``) and reload the target; returns it (float32, eval) and its
    record."""
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(target_config(cfg, tokenizer))
    started = time.perf_counter()
    curve = train_target(model, train_stream, cfg)
    wall = time.perf_counter() - started
    loss_fp32 = heldout_loss(model, heldout_stream, cfg.target_seq_len, cfg.eval_chunks)
    model.to(getattr(torch, cfg.save_dtype)).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    loss = heldout_loss(model, heldout_stream, cfg.target_seq_len, cfg.eval_chunks)
    record = {
        "parameters": _param_count(model),
        "tokens_seen": cfg.target_steps * cfg.target_batch_size * cfg.target_seq_len,
        "final_train_loss": curve[-1]["loss"],
        "heldout_loss_fp32": loss_fp32,
        "heldout_loss": loss,
        "heldout_perplexity": math.exp(loss),
        "wall_s": round(wall, 1),
        "loss_curve": curve,
    }
    return model, record


def _build_drafter(
    cfg: SmallPairConfig,
    target: PreTrainedModel,
    train_stream: torch.Tensor,
    mask_token_id: int,
    target_dir: Path,
    drafter_dir: Path,
) -> tuple[DFlashDrafter, dict[str, Any]]:
    """Generate greedy data, train with :func:`train_dflash`, save (``save_dtype``); returns
    the saved drafter (float32, eval) and its record."""
    started = time.perf_counter()
    sequences, masks = greedy_continuations(target, train_stream, cfg)
    data_wall = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as work:
        train_cfg = TrainConfig(
            target=str(target_dir),
            out_dir=work,
            data=sequences,
            loss_masks=masks,
            block_size=cfg.block_size,
            num_layers=cfg.drafter_layers,
            steps=cfg.drafter_steps,
            batch_size=cfg.drafter_batch_size,
            seq_len=cfg.gen_prompt_len + cfg.gen_new_tokens,
            lr=cfg.drafter_lr,
            anchors_per_seq=cfg.drafter_anchors_per_seq,
            mask_token_id=mask_token_id,
            seed=cfg.seed,
            device="cpu",
            save_every=cfg.drafter_steps,
            log_every=max(1, min(50, cfg.drafter_steps)),
        )
        started = time.perf_counter()
        train_dflash(train_cfg)
        train_wall = time.perf_counter() - started
        log = [json.loads(line) for line in (Path(work) / LOG_NAME).read_text().splitlines()]
        trained = DFlashDrafter.from_pretrained(work, dtype=getattr(torch, cfg.save_dtype))
    trained.save_pretrained(drafter_dir)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=torch.float32)
    drafter.check_compatible(target.config)
    record = {
        "parameters": _param_count(drafter),
        "target_layer_ids": drafter.target_layer_ids,
        "mask_token_id": drafter.mask_token_id,
        "data_sequences": len(sequences),
        "data_response_tokens": sum(sum(m) for m in masks),
        "data_wall_s": round(data_wall, 1),
        "final_train_loss": log[-1]["loss"],
        "final_train_acc_slot1": log[-1]["acc_slot1"],
        "final_train_acc_per_slot": log[-1]["acc_per_slot"],
        "wall_s": round(train_wall, 1),
        "loss_curve": [{k: r[k] for k in ("step", "loss", "acc_slot1")} for r in log],
    }
    return drafter, record


def _measure(
    cfg: SmallPairConfig,
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    tokenizer: PreTrainedTokenizerFast,
    heldout_stream: torch.Tensor,
) -> dict[str, Any]:
    """Drafter/target agreement on held-out function prompts (right after the prompt and
    ``eval_decoded`` greedy tokens later) and on held-out text windows."""
    max_len = cfg.max_positions - drafter.block_size - cfg.eval_decoded
    prompts = heldout_prompts(cfg.eval_prompts, cfg.heldout_percent)
    prompt_ids = [tokenizer(p)["input_ids"][-max_len:] for p in prompts]
    windows = heldout_windows(heldout_stream, cfg.eval_prompts, cfg.target_seq_len)
    return {
        "heldout_function_prompts": acceptance_stats(target, drafter, prompt_ids),
        "heldout_function_prompts_mid_generation": acceptance_stats(
            target, drafter, prompt_ids, decoded=cfg.eval_decoded
        ),
        "heldout_text_windows": acceptance_stats(target, drafter, windows),
    }


def build_small_pair(out_dir: str | Path, cfg: SmallPairConfig | None = None) -> dict:
    """Build tokenizer, target and drafter into ``out_dir``; returns the BUILD.json record."""
    cfg = cfg or SmallPairConfig()
    out = Path(out_dir)
    target_dir, drafter_dir = out / "target", out / "drafter"
    started = time.perf_counter()
    split, corpus_record = _prepare_corpus(cfg)
    tokenizer = train_tokenizer(
        [f.text for f in split["train"]], cfg.vocab_size, max_length=cfg.max_positions
    )
    train_stream = encode_documents(tokenizer, [f.text for f in split["train"]])
    heldout_stream = encode_documents(tokenizer, [f.text for f in split["heldout"]])
    corpus_record.update(
        train_tokens=len(train_stream),
        heldout_tokens=len(heldout_stream),
        chars_per_token=round(corpus_record["train_chars"] / len(train_stream), 3),
        tokenizer_wall_s=round(time.perf_counter() - started, 1),
    )
    target, target_record = _build_target(cfg, tokenizer, train_stream, heldout_stream, target_dir)
    drafter, drafter_record = _build_drafter(
        cfg, target, train_stream, tokenizer.mask_token_id, target_dir, drafter_dir
    )
    started_eval = time.perf_counter()
    measurements = _measure(cfg, target, drafter, tokenizer, heldout_stream)
    measurements["wall_s"] = round(time.perf_counter() - started_eval, 1)
    record = {
        "versions": _versions(),
        "config": asdict(cfg),
        "corpus": corpus_record,
        "target": target_record,
        "drafter": drafter_record,
        "measurements": measurements,
        "total_wall_s": round(time.perf_counter() - started, 1),
        "files": {
            path.relative_to(out).as_posix(): _file_record(path)
            for directory in (target_dir, drafter_dir)
            for path in sorted(directory.rglob("*"))
            if path.is_file()
        },
    }
    (out / BUILD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return record


# ---------------------------------------------------------------------------------------------
# CLI glue
# ---------------------------------------------------------------------------------------------


def add_build_small_pair_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sglang-tree-spec models build-small-pair``: ``--out`` plus one option per
    :class:`SmallPairConfig` field (``--target-steps``, ``--block-size``, ...)."""
    parser.add_argument(
        "--out", required=True, help=f"output directory (the committed pair: {SMALL_PAIR_DIR})"
    )
    for field in fields(SmallPairConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default)


def run_build_small_pair(args: argparse.Namespace) -> int:
    """Run :func:`build_small_pair` from parsed ``add_build_small_pair_args`` arguments."""
    cfg = SmallPairConfig(**{f.name: getattr(args, f.name) for f in fields(SmallPairConfig)})
    record = build_small_pair(args.out, cfg)
    summary = {
        "out": str(args.out),
        "target_heldout_loss": record["target"]["heldout_loss"],
        "measurements": record["measurements"],
        "total_wall_s": record["total_wall_s"],
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=build_small_pair.__doc__)
    add_build_small_pair_args(_parser)
    raise SystemExit(run_build_small_pair(_parser.parse_args()))
