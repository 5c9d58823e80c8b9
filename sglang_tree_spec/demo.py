"""Demo: plain decoding vs the DFlash chain vs DDTree on the committed small pair.

The pair (a small Llama target trained on Python's standard library and its DFlash drafter,
both by this project's recipes) ships with the package. Prompts are held-out standard-library
functions, never seen in training. Every method decodes the same batch greedily; the outputs
must be identical, and the table shows tokens per verify step (tau) and tokens per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target


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


def run(
    pair_dir: Path | None = None,
    budgets: tuple[int, ...] = (16, 64, 256),
    num_prompts: int = 8,
    max_new_tokens: int = 64,
) -> int:
    from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts

    pair_dir = Path(pair_dir or SMALL_PAIR_DIR)
    if not (pair_dir / "target" / "config.json").is_file():
        print(
            f"no model pair at {pair_dir}: build one with\n"
            f"  sglang-tree-spec models build-small-pair --out {pair_dir}"
        )
        return 1
    device = torch.device("cpu")
    target, tokenizer = load_target(pair_dir / "target", device)
    drafter = load_drafter(pair_dir / "drafter", device, target.dtype)
    texts = heldout_prompts(num_prompts)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    print(
        f"pair: {pair_dir}\n{len(prompts)} held-out prompts, batch of {len(prompts)}, "
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
