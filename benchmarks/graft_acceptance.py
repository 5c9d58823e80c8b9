"""Benchmark: acceptance (tau) and step time of DDTree against both Graft policies, per domain.

Domains, all built from the pair's HELD-OUT stdlib files only (never from training files):

* ``code`` -- function prompts cut after the signature and docstring
  (:func:`~sglang_tree_spec.models.small_pair.heldout_prompts`);
* ``copy-edit`` -- quoted context: a whole held-out function, then the same function again
  under a new name (``name`` -> ``name_v2``), cut a third of the way into its body, so that the
  continuation can repeat (or edit) code that is in the prompt.

For each budget the stage thresholds are calibrated on DDTree steps over TRAINING prompts
(function prompts of the pair's training split), once for all domains. Then, per domain,
``ddtree``, ``ddtree-graft-stage`` (calibrated) and ``ddtree-graft-unified`` decode the same
prompts greedily, each with a fresh engine: its successor table starts empty, is warmed by each
prompt's bigrams and learns online over the prompts in order (batches of ``--batch-size``), as
a server would; unified's edge probabilities start from their prior and learn online too. The
three outputs are checked to be token-for-token equal.

Reported per (budget, domain, method): tau = tokens committed per target forward (bonus
included), pooled over every step of every request; ``step_ms`` = mean wall time of one batched
decode step (draft, tree, graft, verify, accept), ``draft_ms`` = its draft + tree + graft part,
and the same in process CPU time (``*_cpu_ms``, all threads; steadier on a shared machine);
and a paired bootstrap over prompts (95% interval) of each policy's tau relative to ddtree and
of unified's relative to stage -- decoding is deterministic, so the noise that matters is the
choice of prompts. ``prompt_bigram_coverage`` says how much each domain's continuation reuses
the prompt (fraction of generated token bigrams already in the prompt).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/graft_acceptance.py   # writes the CPU results
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target
from sglang_tree_spec.graft import StageConfig, calibrate_stage
from sglang_tree_spec.models.small_pair import (
    SMALL_PAIR_DIR,
    corpus_files,
    function_prompts,
    heldout_prompts,
)

METHODS = ("ddtree", "ddtree-graft-stage", "ddtree-graft-unified")
SHORT = {"ddtree": "ddtree", "ddtree-graft-stage": "stage", "ddtree-graft-unified": "unified"}
RESULTS = Path(__file__).parent / "results"
DEFAULT_OUT = RESULTS / "graft_acceptance_cpu.json"


# ------------------------------------------------------------------------------------ prompts


def training_prompts(count: int) -> list[str]:
    """``count`` function prompts spread evenly over the training split (calibration only)."""
    prompts = [p for f in corpus_files("train") for p in function_prompts(f.text)]
    return [prompts[i * len(prompts) // count] for i in range(count)]


def copy_edit_prompts(count: int, max_function_chars: int = 900, min_body_lines: int = 4):
    """``count`` quoted-context prompts from held-out files: function ``f`` in full, a blank
    line, then ``f`` again renamed ``f_v2`` (signature, docstring and the first third of the
    body lines), without the final newline.

    Only undecorated functions with at least ``min_body_lines`` body lines after the docstring
    and at most ``max_function_chars`` characters, spread evenly over all held-out files.
    """
    prompts = []
    for file in corpus_files("heldout"):
        try:
            tree = ast.parse(file.text)
        except (SyntaxError, ValueError):
            continue
        lines = file.text.splitlines(keepends=True)
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        for node in sorted(functions, key=lambda n: n.lineno):
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            docstring = docstring and isinstance(first.value.value, str)
            body_start = first.end_lineno if docstring else first.lineno - 1
            source = "".join(lines[node.lineno - 1 : node.end_lineno])
            body_lines = node.end_lineno - body_start
            if node.decorator_list or body_lines < min_body_lines:
                continue
            if len(source) > max_function_chars:
                continue
            cut = body_start + body_lines // 3
            again = "".join(lines[node.lineno - 1 : cut]).rstrip("\n")
            again = again.replace(f"def {node.name}(", f"def {node.name}_v2(", 1)
            prompts.append(source.rstrip("\n") + "\n\n" + again)
    return [prompts[i * len(prompts) // count] for i in range(min(count, len(prompts)))]


DOMAINS: dict[str, Callable[[int], list[str]]] = {
    "code": heldout_prompts,
    "copy-edit": copy_edit_prompts,
}


# ------------------------------------------------------------------------------------ running


def run(engine: SpecEngine, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:
    """Greedy decoding of ``prompts`` in batches: pooled tau, per-prompt counts, step times."""
    step_s: list[tuple[float, float]] = []  # (wall, process CPU) seconds per batched step
    draft_s: list[tuple[float, float]] = []
    for name, log in (("_step", step_s), ("_draft_tree", draft_s)):
        inner = getattr(engine, name)

        def timed(*args, _inner=inner, _log=log, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            out = _inner(*args, **kwargs)
            _log.append((time.perf_counter() - wall, time.process_time() - cpu))
            return out

        setattr(engine, name, timed)  # instance attribute: this engine only
    steps, committed, outputs = [], [], []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for result in engine.generate(prompts[i : i + batch], new_tokens, stop_token_ids=[]):
            stats = result.stats
            steps.append(stats.steps)
            committed.append(sum((n + 1) * c for n, c in enumerate(stats.accept_hist)))
            outputs.append(result.tokens)
    wall = time.perf_counter() - start
    return {
        "tau": round(sum(committed) / sum(steps), 4),
        "steps": sum(steps),
        "batch_steps": len(step_s),
        "step_ms": round(1e3 * sum(w for w, _ in step_s) / len(step_s), 2),
        "draft_ms": round(1e3 * sum(w for w, _ in draft_s) / len(draft_s), 2),
        "step_cpu_ms": round(1e3 * sum(c for _, c in step_s) / len(step_s), 2),
        "draft_cpu_ms": round(1e3 * sum(c for _, c in draft_s) / len(draft_s), 2),
        "wall_s": round(wall, 2),
        "per_prompt_steps": steps,
        "per_prompt_committed": committed,
        "_outputs": outputs,
    }


def calibrate(engine: SpecEngine, prompts: list[list[int]], new_tokens: int, batch: int):
    """Stage thresholds from the engine's DDTree steps on ``prompts``."""
    engine.confidence_log = []
    run(engine, prompts, new_tokens, batch)
    confidence = torch.cat([c for c, _ in engine.confidence_log])
    accept_len = torch.cat([a for _, a in engine.confidence_log])
    engine.confidence_log = None
    return calibrate_stage(confidence, accept_len, engine.stage), int(accept_len.shape[0])


def bootstrap_ratio(num: dict, den: dict, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of ``tau(num) / tau(den)`` under a paired bootstrap over prompts."""
    rng = random.Random(seed)
    n = len(num["per_prompt_steps"])
    ratios = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        tau = [
            sum(r["per_prompt_committed"][i] for i in pick)
            / sum(r["per_prompt_steps"][i] for i in pick)
            for r in (num, den)
        ]
        ratios.append(tau[0] / tau[1])
    ratios.sort()
    return [round(ratios[int(0.025 * resamples)], 4), round(ratios[int(0.975 * resamples)], 4)]


def prompt_bigram_coverage(prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Fraction of generated token bigrams (the prompt's last token first) found in the prompt."""
    hits = total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        seen = set(itertools.pairwise(prompt))
        pairs = list(itertools.pairwise([prompt[-1], *out]))
        hits += sum(p in seen for p in pairs)
        total += len(pairs)
    return round(hits / max(total, 1), 4)


# ------------------------------------------------------------------------------------- output


def plot(record: dict, path: Path) -> None:
    """Grouped bars: tau per method, per budget, one panel per domain."""
    import matplotlib  # the dev extra: imported only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(record["domains"])
    budgets = [row["budget"] for row in record["results"]]
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 4), sharey=True)
    axes = [axes] if len(domains) == 1 else list(axes)
    width = 0.8 / len(METHODS)
    for ax, domain in zip(axes, domains, strict=True):
        for m, method in enumerate(METHODS):
            xs = [b + (m - (len(METHODS) - 1) / 2) * width for b in range(len(budgets))]
            taus = [row["domains"][domain][method]["tau"] for row in record["results"]]
            bars = ax.bar(xs, taus, width, label=SHORT[method])
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(len(budgets)), [f"B = {b}" for b in budgets])
        ax.set_title(f"{domain} ({record['prompts_per_domain']} held-out prompts)")
        ax.set_ylabel("tau (tokens per target forward)")
    top = max(
        row["domains"][d][m]["tau"] for row in record["results"] for d in domains for m in METHODS
    )
    for ax in axes:
        ax.set_ylim(1.0, 1.0 + (top - 1.0) * 1.25)
    axes[0].legend(loc="upper left", ncol=len(METHODS))
    fig.suptitle("Graft on DDTree, committed small pair (CPU, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair-dir", type=Path, default=SMALL_PAIR_DIR)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=list(DOMAINS))
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts per domain")
    parser.add_argument("--train-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    args = parser.parse_args()

    device = torch.device(args.device)
    target, tokenizer = load_target(args.pair_dir / "target", device)
    drafter = load_drafter(args.pair_dir / "drafter", device, torch.float32)
    encode = lambda texts: [tokenizer(t)["input_ids"] for t in texts]  # noqa: E731
    domains = {name: encode(DOMAINS[name](args.prompts)) for name in args.domains}
    limit = target.config.max_position_embeddings - args.new_tokens - drafter.config.block_size
    for name, prompts in domains.items():
        if max(len(p) for p in prompts) > limit:
            raise ValueError(f"a {name} prompt does not fit the target's {limit} positions")
    train = encode(training_prompts(args.train_prompts))
    build = (args.pair_dir / "BUILD.json").read_bytes()
    load_before = os.getloadavg()

    results = []
    coverage: dict[str, float] = {}
    for budget in args.budgets:
        calibrator = SpecEngine(target, drafter, "ddtree", budget=budget, stage=StageConfig())
        stage, calibration_steps = calibrate(calibrator, train, args.new_tokens, args.batch_size)
        row: dict = {
            "budget": budget,
            "stage": {
                "depths": stage.depths,
                "thresholds": [round(t, 5) for t in stage.thresholds],
                "keep_fractions": [round(f, 4) for f in stage.keep_fractions],
                "calibration_steps": calibration_steps,
            },
            "domains": {},
        }
        for name, prompts in domains.items():
            cell = {}
            for method in METHODS:
                engine = SpecEngine(target, drafter, method, budget=budget, stage=stage)
                cell[method] = run(engine, prompts, args.new_tokens, args.batch_size)
                r = cell[method]
                print(
                    f"B={budget:3d} {name:10s} {method:22s} tau={r['tau']:.3f} "
                    f"step={r['step_ms']:.1f} ms (draft+tree+graft {r['draft_ms']:.1f}), "
                    f"CPU {r['step_cpu_ms']:.1f} ms ({r['draft_cpu_ms']:.1f})",
                    flush=True,
                )
            outputs = [cell[m].pop("_outputs") for m in METHODS]
            if any(o != outputs[0] for o in outputs):
                raise AssertionError(f"greedy outputs differ between methods on {name}")
            coverage[name] = prompt_bigram_coverage(prompts, outputs[0])
            ddtree, stage_r, unified = (cell[m] for m in METHODS)
            cell["tau_ratio_95ci"] = {
                "stage/ddtree": bootstrap_ratio(stage_r, ddtree),
                "unified/ddtree": bootstrap_ratio(unified, ddtree),
                "unified/stage": bootstrap_ratio(unified, stage_r),
            }
            row["domains"][name] = cell
        results.append(row)

    omp = os.environ.get("OMP_WAIT_POLICY")
    env = [f"OMP_WAIT_POLICY={omp}"] if omp else []
    record = {
        "command": " ".join([*env, os.path.relpath(sys.executable), *sys.argv]),
        "pair": str(args.pair_dir),
        "pair_build_sha256": hashlib.sha256(build).hexdigest(),
        "device": str(device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": omp,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "prompts_per_domain": args.prompts,
        "train_prompts": len(train),
        "new_tokens": args.new_tokens,
        "batch_size": args.batch_size,
        "greedy": True,
        "domains": {
            name: {"prompts": len(domains[name]), "prompt_bigram_coverage": coverage[name]}
            for name in domains
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    plot_path = args.plot or args.out.with_suffix(".png")
    plot(record, plot_path)
    print(f"wrote {args.out} and {plot_path}")


if __name__ == "__main__":
    main()
