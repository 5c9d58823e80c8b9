"""FORECAST (not a measurement): DDTREE decode throughput on H100 / H200 at batch sizes 1-64.

Takes acceptance profiles (tau against tree budget N: measured ones from an acceptance JSON of
``benchmarks/acceptance.py``, and one built-in profile labelled as assumed), target shapes, and
the roofline latency model of :mod:`sglang_tree_spec.control.latency` with H100 and H200 figures,
and prints for every batch size: none (plain decoding) / the DFlash chain / fixed DDTree budgets
/ auto (the budget controller's choice, :func:`best_budget`), as output tokens/s and the ratio to
none. Every assumption is printed with the table. It is how the GPU defaults (candidate set,
batch buckets) are chosen until a GPU measures them.

    python benchmarks/forecast_gpu.py [--profile JSON[:DOMAIN] ...] [--out MD]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

from sglang_tree_spec.control import (
    DEVICES,
    MODEL_SHAPES,
    ModelShape,
    best_budget,
    candidate_budgets,
    dflash_drafter,
    roofline_step_seconds,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = "benchmarks/results/acceptance_cpu_smollm2-135m-instruct_3domains.json:code"
DEFAULT_OUT = ROOT / "benchmarks/results/forecast_gpu.md"
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # up to the tree graphs captured at start-up
FIXED_BUDGETS = (4, 8, 16, 32, 64)
CONTEXT = 1024
DRAFTER_LAYERS = {"qwen3-8b": 5, "llama-3.1-8b": 5, "smollm2-135m": 2}


class Profile(NamedTuple):  # not a dataclass: tests load this script without sys.modules
    """tau (committed tokens per step) of the chain and of DDTree at measured budgets."""

    name: str
    source: str
    chain_depth: int  # L: drafted positions (block - 1); the chain verifies L nodes
    chain_tau: float
    tree_tau: dict[int, float]  # budget -> tau

    def tau(self, budget: int) -> float:
        """tau at any budget: piecewise linear in log(1 + N) through (0, 1) and the measured
        points, flat beyond the largest, never above N + 1 (N nodes + the bonus)."""
        points = [(0, 1.0), *sorted(self.tree_tau.items())]
        if budget >= points[-1][0]:
            value = points[-1][1]
        else:
            for (n0, t0), (n1, t1) in itertools.pairwise(points):
                if n0 <= budget <= n1:
                    x0, x1, x = math.log1p(n0), math.log1p(n1), math.log1p(budget)
                    value = t0 + (t1 - t0) * (x - x0) / (x1 - x0)
                    break
        return min(value, budget + 1.0)


# Assumed, not measured here: a strong DFlash drafter for an 8B target at temperature 0. The
# chain's tau is DFlash on Qwen3-8B averaged over 8 benchmarks (BASTION Table 1, A100, block
# 16); tau 8.48 is BASTION's own average there (adaptive budgets, taken as N = 256); the tree at
# 15 nodes is assumed equal to the chain (the optimal 15-tree is at least the chain in surrogate).
ASSUMED_STRONG = Profile(
    name="assumed strong drafter (DFlash/BASTION published averages, Qwen3-8B, T=0)",
    source="built-in, ASSUMED (BASTION seed Table 1: DFlash chain tau 6.24, BASTION tau 8.48)",
    chain_depth=15,
    chain_tau=6.24,
    tree_tau={15: 6.24, 256: 8.48},
)


def load_profile(spec: str) -> Profile:
    """``PATH[:DOMAIN]`` of an ``acceptance.py`` JSON: its chain and ddtree-N rows."""
    path, _, domain = spec.partition(":")
    record = json.loads((ROOT / path).read_text())
    rows = record["rows"]
    domain = domain or rows[0]["domain"]
    rows = [r for r in rows if r["domain"] == domain]
    chain = [r["tau"] for r in rows if r["method"] == "chain"]
    tree = {r["budget"]: r["tau"] for r in rows if r["method"] == "ddtree"}
    if not chain or not tree:
        raise ValueError(f"{spec}: no chain and ddtree rows for domain {domain!r}")
    return Profile(
        name=f"measured: {record.get('pair', Path(path).stem)}, {domain}",
        source=f"{path} (domain {domain}, {record['settings']['prompts_per_domain']} prompts, "
        f"greedy, measured tau on CPU; acceptance does not depend on the device)",
        chain_depth=record["settings"]["chain_depth"],
        chain_tau=chain[0],
        tree_tau=tree,
    )


def forecast_table(target: ModelShape, drafter: ModelShape, device, profile: Profile) -> dict:
    """tokens/s per batch size for none / chain / fixed budgets / auto."""
    block = profile.chain_depth + 1
    budgets = candidate_budgets(max(FIXED_BUDGETS))

    def step_s(bs: int, n: int) -> float:
        return roofline_step_seconds(target, device, bs, n, CONTEXT, drafter, block)

    rows = []
    for bs in BATCH_SIZES:
        none = bs / step_s(bs, 0)
        cells = {"none": none, "chain": bs * profile.chain_tau / step_s(bs, profile.chain_depth)}
        for n in FIXED_BUDGETS:
            cells[f"B{n}"] = bs * profile.tau(n) / step_s(bs, n)
        committed = [bs * profile.tau(n) for n in budgets]
        auto = best_budget(committed, [step_s(bs, n) for n in budgets], budgets)
        cells["auto"] = bs * profile.tau(auto) / step_s(bs, auto)
        rows.append({"bs": bs, "tok_s": cells, "auto_budget": auto})
    return {"rows": rows}


def candidate_lines(results: list[dict]) -> list[str]:
    """Per candidate budget: the batch sizes where auto chose it (over every table below), or
    its best rate against auto's where it never was."""
    lines = []
    for n in candidate_budgets(max(FIXED_BUDGETS)):
        key = "none" if n == 0 else f"B{n}"
        rows = [row for res in results for row in res["rows"]]
        chosen = sorted({row["bs"] for row in rows if row["auto_budget"] == n})
        best = max(row["tok_s"][key] / row["tok_s"]["auto"] for row in rows)
        lines.append(
            f"- N={n}: auto's choice at bs {', '.join(map(str, chosen))}"
            if chosen
            else f"- N={n}: never auto's choice; at best {best:.3f} of auto's rate"
        )
    return lines


def render(results: list[dict], profiles: list[Profile]) -> str:
    lines = [
        "# FORECAST: DDTREE on H100 / H200, batch sizes 1-64 (roofline model, NOT measured)",
        "",
        "Generated by `python benchmarks/forecast_gpu.py`. Every number below is a prediction of",
        "the latency model in `sglang_tree_spec/control/latency.py` combined with acceptance",
        "profiles; no GPU ran. Cells: output tokens/s (ratio to none).",
        "",
        "## Assumptions",
        "",
    ]
    for key in ("h100", "h200"):
        d = DEVICES[key]
        lines.append(
            f"- {d.name}: {d.mem_bandwidth / 1e12:.2f} TB/s x {d.bw_efficiency:.0%} achieved, "
            f"{d.peak_flops / 1e12:.0f} TFLOP/s bf16 dense x {d.flops_efficiency:.0%} achieved; "
            f"fixed {d.step_overhead_s * 1e3:.1f} ms per step (scheduler, launches, sampling: "
            f"assumes CUDA graphs, which DDTREE keeps on) + "
            f"{d.draft_overhead_s * 1e3:.1f} ms per drafted step (tree build, layout, accept)."
        )
    d = DEVICES["h100"]
    lines += [
        "- Step time = overhead + max(bytes / bandwidth + verify, FLOPs / peak) of the target "
        "over bs * (N + 1) tokens (N = 0: plain decode, bs tokens, no drafter) + for N > 0 the "
        "drafter's roofline over bs * block tokens. Bytes: bf16 weights once per step + each "
        "request's KV (context + new tokens); FLOPs: 2 * matmul params * tokens + attention "
        f"4 * layers * q_heads * head_dim * tokens * context. Context {CONTEXT} tokens for "
        "every request.",
        "- verify (the target's verify, w = N + 1 tokens a request) = t1 * max("
        f"{d.verify_width} * sqrt(w - 1), {d.verify_token} * bs * (w - 1)), t1 one request's "
        "one-token step: fitted to a measured verify of another target on another device "
        "(eagle-harness 0.1.3's shipped profile mi355x-qwen3.8-27b-tp1, a hybrid 27B with 3 "
        "of 4 layers linear attention: x 1.20 / 1.29 / 1.42 at 8 / 16 / 32 tokens at bs 1, "
        "x 1.26 / 1.62 / 2.26 at bs 8; tree verification), ASSUMED to hold as ratios on H100 "
        "/ H200.",
        "- Targets (bf16): "
        + "; ".join(
            f"{s.name} {s.params / 1e9:.2f}B params, {s.layers} layers, hidden {s.hidden}, "
            f"{s.q_heads}/{s.kv_heads} q/kv heads x {s.head_dim}"
            for s in (MODEL_SHAPES[k] for k in ("qwen3-8b", "llama-3.1-8b", "smollm2-135m"))
        )
        + ".",
        "- Drafters: DFlash of the target's widths sharing its LM head, "
        + ", ".join(f"{k}: {v} layers" for k, v in DRAFTER_LAYERS.items())
        + " (SmolLM2: the shipped drafter; 8B: assumed 5 layers), block = chain depth + 1.",
        "- Acceptance is the profile's mean tau for every request (no per-request spread); tau at "
        "unmeasured budgets is piecewise linear in log(1 + N) through (0, 1) and the measured "
        "points, flat past the largest, capped at N + 1.",
        "- chain = the DFlash chain (L = chain depth nodes, the profile's chain tau). Fixed BN = "
        "DDTree at budget N. auto = the controller's choice (`best_budget`) over candidates "
        f"{candidate_budgets(max(FIXED_BUDGETS))} with EXACT predictions and latencies: an "
        "upper bound for the real controller, which also pays prediction error.",
        "- SmolLM2-135M reads 0.27 GB of weights per step: its steps are overhead-bound and its "
        "numbers mostly reflect the assumed fixed overheads, not the roofline.",
        "",
        "## Profiles",
        "",
    ]
    for p in profiles:
        taus = ", ".join(f"N={n}: {p.tau(n):.2f}" for n in (1, *FIXED_BUDGETS))
        lines.append(
            f"- **{p.name}**: {p.source}. chain (L={p.chain_depth}) tau {p.chain_tau:.2f}; "
            f"DDTree tau {taus}."
        )
    lines += ["", "## Candidates", "", *candidate_lines(results)]
    for res in results:
        lines += ["", f"## {res['device']} / {res['target']} / {res['profile']}", ""]
        cols = ["none", "chain", *(f"B{n}" for n in FIXED_BUDGETS), "auto"]
        lines.append("| bs | " + " | ".join(cols) + " | auto N |")
        lines.append("|---" * (len(cols) + 2) + "|")
        for row in res["rows"]:
            none = row["tok_s"]["none"]
            cells = [f"{row['tok_s'][c]:.0f} ({row['tok_s'][c] / none:.2f}x)" for c in cols]
            lines.append(f"| {row['bs']} | " + " | ".join(cells) + f" | {row['auto_budget']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile",
        action="append",
        help=f"acceptance JSON[:domain], repeatable (default {DEFAULT_PROFILE})",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown output")
    args = parser.parse_args(argv)
    measured = [load_profile(s) for s in (args.profile or [DEFAULT_PROFILE])]
    profiles = [ASSUMED_STRONG, *measured]
    # The assumed strong profile and the measured ones on the 8B targets; SmolLM2 only with
    # the measured profiles (its own drafter's).
    plan = [(t, p) for t in ("qwen3-8b", "llama-3.1-8b") for p in profiles]
    plan += [("smollm2-135m", p) for p in measured]
    results = []
    for device_key in ("h100", "h200"):
        device = DEVICES[device_key]
        for target_key, profile in plan:
            target = MODEL_SHAPES[target_key]
            drafter = dflash_drafter(target, DRAFTER_LAYERS[target_key])
            table = forecast_table(target, drafter, device, profile)
            results.append(
                {"device": device.name, "target": target.name, "profile": profile.name, **table}
            )
    text = render(results, profiles)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
