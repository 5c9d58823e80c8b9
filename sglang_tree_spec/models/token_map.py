"""A frequency-ranked draft vocabulary (FR-Spec) for ``--speculative-token-map``.

The ids the drafter's training data uses, most frequent first, then the unseen ids in id order
(a BPE vocabulary numbers its tokens in merge order, the frequent ones first) up to ``size``.
Saved as SGLang's EAGLE token maps are: a ``torch.save``'d list of ids.

    python -m sglang_tree_spec.models.token_map --data data.jsonl --vocab-size 49152 \\
        --size 8192 --out token_map.pt
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch


def frequency_token_map(records: Iterable[list[int]], size: int, vocab_size: int) -> list[int]:
    """``size`` distinct ids: every id of ``records`` by falling count (ties: smaller id
    first), then the smallest unseen ids."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a token map of {size} ids is out of range for {vocab_size} tokens")
    counts: Counter[int] = Counter()
    for ids in records:
        counts.update(ids)
    seen = sorted((i for i in counts if 0 <= i < vocab_size), key=lambda i: (-counts[i], i))
    chosen = seen[:size]
    taken = set(chosen)
    fill = (i for i in range(vocab_size) if i not in taken)
    chosen += [next(fill) for _ in range(size - len(chosen))]
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="train_dflash JSONL")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = (
        json.loads(line)["input_ids"]
        for path in args.data
        for line in path.read_text().splitlines()
        if line.strip()
    )
    ids = frequency_token_map(records, args.size, args.vocab_size)
    torch.save(ids, args.out)
    print(f"wrote {args.out}: {len(ids)} token ids")


if __name__ == "__main__":
    main()
