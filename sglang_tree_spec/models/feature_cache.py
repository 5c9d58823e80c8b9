"""On-disk cache of the frozen target's outputs per training record, for DFlash training.

The target is frozen, so its hidden states at the drafter's ``target_layer_ids`` (and, for the
shortlist loss, its top-k next-token ids) are the same in every epoch. :func:`build_feature_cache`
runs the target once per record and appends them to flat files; training then reads a batch's
features from a memory map and spends the CPU on the drafter only.

Layout of a cache directory:

- ``features.bin``: ``[total_tokens, F]`` bfloat16 (stored as raw 2-byte words), ``F =
  len(target_layer_ids) * hidden``; record ``i`` is rows ``offsets[i] .. offsets[i + 1]``;
- ``topk.bin``: ``[total_tokens, topk]`` int32, the target's ``topk`` most likely next tokens
  at every position inside the loss mask (0 elsewhere: no label is predicted there; absent
  when ``topk == 0``);
- ``meta.json``: the fingerprint (target, layer ids, top-k, records) and the offsets;
- ``progress.json``: records and tokens written so far. Building is resumable: an interrupted
  build truncates both files to the last committed record and continues; a finished cache
  whose fingerprint matches is reused as it is, one built for a prefix of the records (data
  appended since, e.g. by a resumed ``models regen-data``) is extended with the new records,
  and any other cache in the directory is rebuilt.

Size: ``2 * F + 4 * topk`` bytes per token (SmolLM2-135M, 2 draft layers: F = 1152, topk 8 ->
2,336 bytes per token).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

META_NAME = "meta.json"
PROGRESS_NAME = "progress.json"
FEATURES_NAME = "features.bin"
TOPK_NAME = "topk.bin"
FORMAT_VERSION = 1

Record = tuple[torch.Tensor, torch.Tensor]  # (input_ids [L] long, loss_mask [L] bool)


def window_records(records: Sequence[Record], seq_len: int, min_len: int) -> list[Record]:
    """Split records longer than ``seq_len`` into consecutive windows of ``seq_len`` tokens
    (the last one shorter; windows of ``min_len`` tokens or fewer are dropped). A cached record
    is one window: training crops nothing further."""
    windows = []
    for ids, mask in records:
        for start in range(0, len(ids), seq_len):
            if len(ids[start : start + seq_len]) > min_len:
                windows.append((ids[start : start + seq_len], mask[start : start + seq_len]))
    return windows


def _fingerprint(
    records: Sequence[Record], target_dir: str, layer_ids: Sequence[int], topk: int
) -> str:
    digest = hashlib.sha256()
    config = Path(target_dir) / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for weights in sorted(Path(target_dir).glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    digest.update(json.dumps([FORMAT_VERSION, list(layer_ids), topk]).encode())
    for ids, mask in records:
        digest.update(ids.numpy().astype(np.int64).tobytes())
        digest.update(mask.numpy().astype(np.uint8).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value) + "\n")
    os.replace(tmp, path)


@dataclass
class FeatureCache:
    """Read side of a finished cache: per-record features and top-k ids."""

    path: Path
    offsets: list[int]
    feature_dim: int
    topk: int
    layer_ids: list[int]

    def __post_init__(self) -> None:
        tokens = self.offsets[-1]
        self._features = np.memmap(
            self.path / FEATURES_NAME, dtype=np.int16, mode="r", shape=(tokens, self.feature_dim)
        )
        self._topk = None
        if self.topk:
            self._topk = np.memmap(
                self.path / TOPK_NAME, dtype=np.int32, mode="r", shape=(tokens, self.topk)
            )

    @property
    def num_records(self) -> int:
        return len(self.offsets) - 1

    def features(self, index: int) -> torch.Tensor:
        """``[L, F]`` bfloat16 features of record ``index``."""
        rows = self._features[self.offsets[index] : self.offsets[index + 1]]
        return torch.from_numpy(np.array(rows)).view(torch.bfloat16)

    def topk_ids(self, index: int) -> torch.Tensor | None:
        """``[L, topk]`` long: the target's top-k next tokens of record ``index`` (or None)."""
        if self._topk is None:
            return None
        rows = self._topk[self.offsets[index] : self.offsets[index + 1]]
        return torch.from_numpy(np.array(rows)).long()

    @property
    def bytes_on_disk(self) -> int:
        return sum(
            (self.path / name).stat().st_size
            for name in (FEATURES_NAME, TOPK_NAME)
            if (self.path / name).exists()
        )


def build_feature_cache(
    path: str | Path,
    records: Sequence[Record],
    target: nn.Module,
    target_dir: str,
    layer_ids: Sequence[int],
    topk: int = 0,
    batch_size: int = 4,
) -> FeatureCache:
    """Run ``target`` once over every record (not yet cached) and return the cache.

    ``target`` is a transformers causal LM (``output_hidden_states``); the features of a record
    are ``concat(hidden_states[i + 1] for i in layer_ids)`` stored in bfloat16.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    offsets = [0]
    for ids, _ in records:
        offsets.append(offsets[-1] + len(ids))
    hidden = int(target.config.hidden_size)
    feature_dim = len(layer_ids) * hidden
    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": _fingerprint(records, target_dir, layer_ids, topk),
        "target": str(target_dir),
        "layer_ids": list(layer_ids),
        "feature_dim": feature_dim,
        "feature_dtype": "bfloat16",
        "topk": topk,
        "records": len(records),
        "tokens": offsets[-1],
        "bytes_per_token": 2 * feature_dim + 4 * topk,
        "offsets": offsets,
    }
    done_records = 0
    meta_path, progress_path = path / META_NAME, path / PROGRESS_NAME
    if meta_path.exists() and progress_path.exists():
        old = json.loads(meta_path.read_text())
        if _holds_prefix(old, records, meta, target_dir, layer_ids, topk):
            done_records = int(json.loads(progress_path.read_text())["records"])
    if done_records == 0:
        for name in (PROGRESS_NAME, FEATURES_NAME, TOPK_NAME):
            (path / name).unlink(missing_ok=True)
    _write_json(meta_path, meta)
    _write_json(progress_path, {"records": done_records, "tokens": offsets[done_records]})
    files = [(FEATURES_NAME, 2 * feature_dim)] + ([(TOPK_NAME, 4 * topk)] if topk else [])
    for name, row_bytes in files:  # drop rows written after the last committed record
        with (path / name).open("ab") as handle:
            handle.truncate(offsets[done_records] * row_bytes)
    if done_records < len(records):
        _append_records(path, records, offsets, done_records, target, layer_ids, topk, batch_size)
    return FeatureCache(path, offsets, feature_dim, topk, list(layer_ids))


def _holds_prefix(
    old: dict,
    records: Sequence[Record],
    meta: dict,
    target_dir: str,
    layer_ids: Sequence[int],
    topk: int,
) -> bool:
    """Whether the cache described by ``old`` (its meta) was built for ``records`` or for a
    prefix of them (records appended to the data since: the cached rows stay, the new records
    are computed). Same target, layers and top-k are part of both fingerprints."""
    if old.get("fingerprint") == meta["fingerprint"]:
        return True
    count = old.get("records")
    if old.get("format") != meta["format"] or not isinstance(count, int):
        return False
    if not 0 < count < len(records):
        return False
    return old.get("fingerprint") == _fingerprint(records[:count], target_dir, layer_ids, topk)


def _exact_topk(final: torch.Tensor, head: nn.Module, topk: int) -> torch.Tensor:
    """``[n, topk]`` ids of the largest float32 logits of ``final [n, H]`` under the LM
    ``head``. A low-precision head only shortlists ``2 * topk`` candidates (its rounding ties
    tokens near the top); their logits are then recomputed in float32 and ranked."""
    bias = getattr(head, "bias", None)
    if final.dtype == torch.float32:
        return F.linear(final, head.weight.float(), bias).topk(topk, dim=-1).indices
    candidates = head(final).topk(min(2 * topk, head.weight.shape[0]), dim=-1).indices
    exact = torch.einsum("nh,nch->nc", final.float(), head.weight[candidates].float())
    if bias is not None:
        exact = exact + bias.float()[candidates]
    return candidates.gather(1, exact.topk(topk, dim=-1).indices)


@torch.no_grad()
def _append_records(
    path: Path,
    records: Sequence[Record],
    offsets: list[int],
    start: int,
    target: nn.Module,
    layer_ids: Sequence[int],
    topk: int,
    batch_size: int,
) -> None:
    device = next(target.parameters()).device
    head = target.get_output_embeddings()
    progress = tqdm(
        total=len(records), initial=start, desc="feature-cache", unit="rec", mininterval=5
    )
    for first in range(start, len(records), batch_size):
        chunk = records[first : first + batch_size]
        lengths = torch.tensor([len(ids) for ids, _ in chunk])
        input_ids = nn.utils.rnn.pad_sequence([ids for ids, _ in chunk], batch_first=True)
        attention = torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]
        out = target(
            input_ids=input_ids.to(device),
            attention_mask=attention.long().to(device),
            output_hidden_states=True,
            logits_to_keep=1,
        )
        features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        features = features.to(torch.bfloat16).cpu()
        ids_topk = None
        if topk:  # LM head only where the loss mask is set (the only positions a label uses)
            loss_mask = nn.utils.rnn.pad_sequence([m for _, m in chunk], batch_first=True)
            ids_topk = torch.zeros(*input_ids.shape, topk, dtype=torch.int32)
            final = out.hidden_states[-1][loss_mask.to(device)]  # after the final norm
            ids_topk[loss_mask] = _exact_topk(final, head, topk).int().cpu()
        with (path / FEATURES_NAME).open("ab") as feature_file:
            for row, length in enumerate(lengths.tolist()):
                feature_file.write(features[row, :length].view(torch.int16).numpy().tobytes())
        if ids_topk is not None:
            with (path / TOPK_NAME).open("ab") as topk_file:
                for row, length in enumerate(lengths.tolist()):
                    topk_file.write(ids_topk[row, :length].numpy().tobytes())
        done = first + len(chunk)
        _write_json(path / PROGRESS_NAME, {"records": done, "tokens": offsets[done]})
        progress.update(len(chunk))
    progress.close()
