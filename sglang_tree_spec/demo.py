"""Demo: plain decoding vs the DFlash chain vs DDTree on a target + drafter pair.

By default the pair is SmolLM2-135M-Instruct (``sglang-tree-spec models fetch
smollm2-135m-instruct``) with its DFlash drafter from ``<cache>/drafters/
smollm2-135m-instruct-dflash``, else the one shipped in ``assets/smollm2-135m-instruct-dflash``
(trained by ``launch/train-smollm2-drafter.sh``), prompted with held-out HumanEval problems in
its chat template, when the target is in the cache; otherwise the committed small pair (a small
Llama target trained on Python's standard library and its DFlash drafter, both by this
project's recipes, shipped with the package), prompted with held-out standard-library
functions never seen in training. Every method decodes the same batch greedily; the outputs
must be identical, and the table shows tokens per verify step (tau) and tokens per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target
from sglang_tree_spec.models import zoo

REAL_TARGET = "smollm2-135m-instruct"


@dataclass
class MethodRun:
    name: str
    tokens: list[list[int]]
    seconds: float
    tau: float

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


def run_method(engine: SpecEngine, name: str, prompts: list[list[int]], max_new: int) -> MethodRun:
    """Decode all prompts as one batch; tau is averaged over all decode steps. A short run
    first warms up the allocator and kernels, so the timing excludes first-call costs."""
    engine.generate(prompts[:1], 4, stop_token_ids=[])
    start = time.perf_counter()
    results = engine.generate(prompts, max_new, stop_token_ids=[])
    seconds = time.perf_counter() - start
    steps = sum(r.stats.steps for r in results)
    committed = sum(sum(r.stats.commit_lengths[1:]) for r in results)
    return MethodRun(name, [r.tokens for r in results], seconds, committed / max(steps, 1))


PACKAGED_DRAFTER_DIR = Path(__file__).resolve().parent / "assets" / f"{REAL_TARGET}-dflash"


def real_drafter_dir() -> Path:
    """Where a DFlash drafter of :data:`REAL_TARGET` is looked for first (the cache)."""
    return zoo.cache_root() / "drafters" / f"{REAL_TARGET}-dflash"


def find_real_drafter() -> Path | None:
    """The cache's SmolLM2 drafter, else the packaged one (:data:`PACKAGED_DRAFTER_DIR`),
    else None."""
    for directory in (real_drafter_dir(), PACKAGED_DRAFTER_DIR):
        if (directory / "config.json").is_file():
            return directory
    return None


def find_real_pair() -> tuple[Path, Path] | None:
    """``(target dir, drafter dir)`` of SmolLM2 when the target is in the cache and a drafter
    is found (:func:`find_real_drafter`), else None."""
    target_dir = zoo.model_dir(REAL_TARGET)
    drafter_dir = find_real_drafter()
    target_ok = zoo.is_complete(target_dir, zoo.get_spec(REAL_TARGET))
    if target_ok and drafter_dir is not None:
        return target_dir, drafter_dir
    return None


def real_pair_hint() -> str:
    """One line: what is missing for the SmolLM2 demo and how to get it."""
    if zoo.is_complete(zoo.model_dir(REAL_TARGET), zoo.get_spec(REAL_TARGET)):
        return (
            f"SmolLM2 demo: {REAL_TARGET} is fetched, but its DFlash drafter is not trained yet "
            f"(expected at {real_drafter_dir()}, or {PACKAGED_DRAFTER_DIR}; "
            "`bash launch/train-smollm2-drafter.sh` trains it); using the small pair"
        )
    return (
        f"SmolLM2 demo: fetch the target with `sglang-tree-spec models fetch {REAL_TARGET}` "
        "(and train its DFlash drafter with `bash launch/train-smollm2-drafter.sh` unless one is "
        "shipped); using the small pair"
    )


def chat_prompts(
    tokenizer: PreTrainedTokenizerBase, count: int
) -> tuple[list[str], list[list[int]]]:
    """The first ``count`` held-out code problems in the target's chat template: texts, ids."""
    from sglang_tree_spec.models.datasets import heldout, prompt_ids, render_prompt

    items = heldout("code", count)
    texts = [render_prompt(tokenizer, item) for item in items]
    return texts, [prompt_ids(tokenizer, item) for item in items]


def run(
    pair_dir: Path | None = None,
    budgets: tuple[int, ...] = (16, 64, 256),
    num_prompts: int = 8,
    max_new_tokens: int = 64,
) -> int:
    from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts

    real = find_real_pair() if pair_dir is None else None
    if real is None and pair_dir is None:
        print(real_pair_hint())
    pair_dir = Path(pair_dir or SMALL_PAIR_DIR)
    if real is None and not (pair_dir / "target" / "config.json").is_file():
        print(
            f"no model pair at {pair_dir}: build one with\n"
            f"  sglang-tree-spec models build-small-pair --out {pair_dir}"
        )
        return 1
    target_dir, drafter_dir = real or (pair_dir / "target", pair_dir / "drafter")
    device = torch.device("cpu")
    target, tokenizer = load_target(target_dir, device)
    drafter = load_drafter(drafter_dir, device, target.dtype)
    if real is None:
        texts = heldout_prompts(num_prompts)
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        try:
            texts, prompts = chat_prompts(tokenizer, num_prompts)
        except zoo.ZooError as error:
            print(f"no held-out prompts for {REAL_TARGET}: {error}")
            return 1
    print(
        f"pair: {pair_dir if real is None else f'{target_dir} + {drafter_dir}'}\n"
        f"{len(prompts)} held-out prompts, batch of {len(prompts)}, "
        f"{max_new_tokens} new tokens each, greedy, device={device}, "
        f"torch threads={torch.get_num_threads()}\n"
    )
    runs = [run_method(SpecEngine(target, method="ar"), "ar", prompts, max_new_tokens)]
    chain = SpecEngine(target, drafter, method="chain")
    runs.append(run_method(chain, f"chain (L={drafter.block_size - 1})", prompts, max_new_tokens))
    for budget in budgets:
        engine = SpecEngine(target, drafter, method="ddtree", budget=budget)
        runs.append(run_method(engine, f"ddtree B={budget}", prompts, max_new_tokens))

    baseline = runs[0]
    print(f"{'method':<16} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'same output':>12}")
    for r in runs:
        same = "yes" if r.tokens == baseline.tokens else "NO"
        speedup = r.tokens_per_second / baseline.tokens_per_second
        print(f"{r.name:<16} {r.tau:>6.2f} {r.tokens_per_second:>8.1f} {speedup:>7.2f}x {same:>12}")
    print("\nfirst prompt, DDTree continuation:")
    print(texts[0] + "\u2502" + tokenizer.decode(runs[-1].tokens[0]))
    return 0 if all(r.tokens == baseline.tokens for r in runs) else 1
