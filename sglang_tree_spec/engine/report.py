"""Human-readable summaries of generation statistics."""

from __future__ import annotations

from collections import Counter

from sglang_tree_spec.engine.spec_engine import PHASES, GenerationResult


def format_stats(result: GenerationResult) -> str:
    """A few lines: tokens, steps, tau, accept-length histogram, acceptance by depth, time."""
    stats = result.stats
    seconds = sum(stats.seconds.values())
    split = ", ".join(f"{p} {stats.seconds[p] * 1e3:.0f} ms" for p in PHASES)
    depth = " ".join(f"{a:.2f}" for a in stats.acceptance_by_depth)
    tokens_per_s = len(result.tokens) / seconds if seconds > 0 else float("nan")
    return "\n".join(
        [
            f"[{len(result.tokens)} tokens, finish={result.finish_reason}, {stats.steps} steps, "
            f"tau={stats.tau:.2f}, {tokens_per_s:.1f} tok/s]",
            f"  accept-length histogram: {stats.accept_hist}",
            f"  acceptance by depth: {depth or '-'}",
            f"  budgets: {dict(sorted(Counter(stats.budgets).items()))}",
            f"  time: {split}",
        ]
    )
