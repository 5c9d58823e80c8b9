"""Benchmark: acceptance (tau) and tokens/s of ar / chain / ddtree per domain, greedy.

Every method decodes the same held-out prompts through the reference engine
(:class:`~sglang_tree_spec.engine.SpecEngine`): ``ar`` (plain decoding, tau = 1), ``chain``
(the DFlash drafter's single chain of ``block_size - 1`` tokens) and ``ddtree`` at each budget
(top-K = the budget). Decoding is greedy, so every method must produce exactly the tokens of
``ar``; each prompt whose output differs is counted and printed (a near-tie of the target's
logits between a one-token forward and a tree forward can flip a float32 argmax; ``--dtype
float64`` rules that out).

Domains:

* ``code-stdlib`` -- function prompts cut after the signature and docstring, from the HELD-OUT
  files of the running interpreter's stdlib
  (:func:`~sglang_tree_spec.models.small_pair.heldout_prompts`), as raw text: the domain of the
  committed small pair (its own 2048-token BPE vocabulary, no chat template), and its default.
* ``code`` / ``math`` / ``chat`` -- the held-out sets of :mod:`sglang_tree_spec.models.datasets`
  (HumanEval, gsm_symbolic eval templates, MT-Bench first turns) in the target's chat template:
  only for a target whose tokenizer has one, e.g. SmolLM2-135M-Instruct
  (``sglang-tree-spec models fetch smollm2-135m-instruct``) with its DFlash drafter; they are
  the default there.

Reported per (domain, method, budget): ``tau`` = accepted draft tokens + 1 (the bonus) per
target forward, pooled over every decode step of every prompt (the prefill's token is not
counted), with a bootstrap 95% interval over prompts; the pooled acceptance histogram; and
``tok_s`` = generated tokens / wall time of the ``generate`` calls (after one warm-up call per
engine), plus the same per process CPU second (all threads; steadier on a shared machine) and
the speed-up over ``ar``. The prompts go in batches of ``--batch-size`` (default 1: latency), and
the methods take turns batch by batch, so that a change of machine load hits all alike.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/acceptance.py --prompts 16 --new-tokens 64

writes ``benchmarks/results/acceptance_cpu_small_pair.json`` and the plot next to it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import (
    RESULTS,
    bootstrap_interval,
    command_line,
    decode_prompts,
    environment,
    first_difference,
    portable_record,
    sha256_file,
)

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target, resolve_device
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts

STDLIB_DOMAIN = "code-stdlib"
CHAT_DOMAINS = ("code", "math", "chat")
ALL_DOMAINS = (STDLIB_DOMAIN, *CHAT_DOMAINS)
DEFAULT_BUDGETS = (16, 64, 256)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
DOMAIN_SOURCES = {
    STDLIB_DOMAIN: "held-out stdlib function prompts, raw text (small_pair.heldout_prompts)",
    "code": "HumanEval (datasets.heldout('code')), chat template",
    "math": "gsm_symbolic eval split (datasets.heldout('math')), chat template",
    "chat": "MT-Bench first turns (datasets.heldout('chat')), chat template",
}


# ------------------------------------------------------------------------------------ prompts


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def domain_prompts(domain: str, tokenizer, count: int) -> list[list[int]]:
    """``count`` held-out prompts of ``domain`` as token ids of ``tokenizer``."""
    if domain == STDLIB_DOMAIN:
        return [tokenizer.encode(t, add_special_tokens=False) for t in heldout_prompts(count)]
    if not has_chat_template(tokenizer):
        raise SystemExit(
            f"domain {domain!r} needs a target with a chat template (e.g. "
            f"`sglang-tree-spec models fetch smollm2-135m-instruct`); this target has none: "
            f"use --domains {STDLIB_DOMAIN}"
        )
    from sglang_tree_spec.models.datasets import heldout, prompt_ids
    from sglang_tree_spec.models.zoo import ZooError

    try:
        items = heldout(domain, count)
    except (ZooError, ValueError) as error:
        raise SystemExit(f"no held-out {domain} prompts: {error}") from None
    return [prompt_ids(tokenizer, item) for item in items]


# ------------------------------------------------------------------------------------ running


def configs(budgets: Sequence[int]) -> list[tuple[str, str, int | None]]:
    """``(label, method, budget)`` of every run: ar, chain, then ddtree per budget."""
    return [
        ("ar", "ar", None),
        ("chain", "chain", None),
        *((f"ddtree-{b}", "ddtree", b) for b in budgets),
    ]


# ------------------------------------------------------------------------------------- output


def plot(record: dict, path: Path) -> None:
    """tau (top) and tok/s (bottom) vs budget, one column per domain: ddtree as a line over
    the budgets, chain and ar as horizontal reference lines."""
    import matplotlib  # the dev extra: imported only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(record["domains"])
    budgets = record["settings"]["budgets"]
    fig, axes = plt.subplots(
        2, len(domains), figsize=(max(6.5, 5 * len(domains)), 7.5), squeeze=False, sharex=True
    )
    for col, domain in enumerate(domains):
        rows = {r["label"]: r for r in record["rows"] if r["domain"] == domain}
        for row_index, (key, ylabel) in enumerate(
            (("tau", "tau (tokens per target forward)"), ("tok_s", "tokens / s"))
        ):
            ax = axes[row_index][col]
            values = [rows[f"ddtree-{b}"][key] for b in budgets]
            ax.plot(budgets, values, "o-", color="C0", label="ddtree")
            for b, v in zip(budgets, values, strict=True):
                ax.annotate(
                    f"{v:.2f}" if key == "tau" else f"{v:.0f}",
                    (b, v),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
            for method, color, style in (("chain", "C1", "--"), ("ar", "C2", ":")):
                value = rows[method][key]
                shown = f"{value:.2f}" if key == "tau" else f"{value:.0f}"
                ax.axhline(value, color=color, ls=style, label=f"{method} ({shown})")
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_ylabel(ylabel)
            if key == "tau":
                ax.set_ylim(0.0, max([*values, rows["chain"]["tau"]]) * 1.2)
                prompts = record["domains"][domain]["prompts"]
                ax.set_title(f"{domain} ({prompts} held-out prompts)")
            else:
                ax.set_ylim(0.0, max([*values, rows["chain"][key], rows["ar"][key]]) * 1.2)
                ax.set_xlabel("DDTree budget B (tree nodes)")
            ax.legend(loc="lower right", fontsize=8)
    env = record["env"]
    fig.suptitle(
        f"{record['pair']}: tau and tokens/s, greedy\n"
        f"{record['settings']['new_tokens']} new tokens, batch {record['settings']['batch_size']}, "
        f"{env['device']} {env['dtype']}, {env['torch_threads']} threads",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_out(target_dir: Path, device: torch.device) -> Path:
    if target_dir.resolve() == (SMALL_PAIR_DIR / "target").resolve():
        return RESULTS / f"acceptance_{device.type}_small_pair.json"
    return RESULTS / f"acceptance_{device.type}_{target_dir.name}.json"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target",
        type=Path,
        default=SMALL_PAIR_DIR / "target",
        help="transformers target directory (default: the committed small pair)",
    )
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="DFlash drafter directory (default: the small pair's drafter)",
    )
    parser.add_argument(
        "--domains",
        nargs="+",
        choices=ALL_DOMAINS,
        default=None,
        help=f"default: {' '.join(CHAT_DOMAINS)} when the target has a chat "
        f"template, else {STDLIB_DOMAIN}",
    )
    parser.add_argument(
        "--token-map",
        type=Path,
        default=None,
        help="draft from these token ids only (a torch.save'd list: --speculative-token-map)",
    )
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts per domain")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="decode exactly --new-tokens (default: stop at the target's EOS)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: benchmarks/results/acceptance_<device>_"
        "<small_pair | target dir name>.json); the plot goes next to it (.png)",
    )
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1 or args.batch_size < 1:
        parser.error("--prompts, --new-tokens and --batch-size must be >= 1")
    if min(args.budgets) < 1:
        parser.error("--budgets must be >= 1")
    args.budgets = sorted(set(args.budgets))
    if args.drafter is None:
        args.drafter = SMALL_PAIR_DIR / "drafter"
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; write the JSON and the plot; return the record."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    target, tokenizer = load_target(args.target, device, dtype)
    drafter = load_drafter(args.drafter, device, dtype)
    domains = args.domains or (
        list(CHAT_DOMAINS) if has_chat_template(tokenizer) else [STDLIB_DOMAIN]
    )
    prompts = {d: domain_prompts(d, tokenizer, args.prompts) for d in domains}
    limit = target.config.max_position_embeddings - args.new_tokens - drafter.block_size
    for domain, ids in prompts.items():
        longest = max(len(p) for p in ids)
        if longest > limit:
            raise SystemExit(
                f"a {domain} prompt has {longest} tokens: more than the {limit} that leave room "
                f"for {args.new_tokens} new tokens in {target.config.max_position_embeddings} "
                "positions (lower --new-tokens)"
            )
    stops = [] if args.ignore_eos else None
    token_map = None if args.token_map is None else torch.load(args.token_map)
    engines = {
        label: SpecEngine(
            target,
            None if method == "ar" else drafter,
            method,
            budget=budget or 1,
            token_map=None if method == "ar" else token_map,
        )
        for label, method, budget in configs(args.budgets)
    }
    for engine in engines.values():  # warm-up: first-call costs stay out of the timings
        engine.generate(prompts[domains[0]][:1], 4, stop_token_ids=[])

    env = environment(device, args.dtype)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    for domain in domains:
        tallies = decode_prompts(
            engines, prompts[domain], args.new_tokens, args.batch_size, stops, desc=domain
        )
        reference = tallies["ar"]
        for label, method, budget in configs(args.budgets):
            tally = tallies[label]
            differing = []
            for index, (ref, out) in enumerate(zip(reference.outputs, tally.outputs, strict=True)):
                if ref != out:
                    at = first_difference(ref, out)
                    differing.append(index)
                    mismatches.append(
                        {
                            "domain": domain,
                            "method": label,
                            "prompt": index,
                            "position": at,
                            "ar_token": ref[at] if at < len(ref) else None,
                            "token": out[at] if at < len(out) else None,
                        }
                    )
                    print(
                        f"MISMATCH {domain} {label} prompt {index}: first difference at "
                        f"token {at} ({mismatches[-1]['ar_token']} vs "
                        f"{mismatches[-1]['token']})",
                        flush=True,
                    )
            row = {
                "domain": domain,
                "label": label,
                "method": method,
                "budget": budget,
                "topk": engines[label].topk if method == "ddtree" else None,
                "tau": round(tally.tau, 4),
                "tau_95ci": bootstrap_interval(tally),
                "steps": sum(tally.steps),
                "accept_hist": tally.hist,
                "tokens": tally.tokens,
                "wall_s": round(tally.wall_s, 3),
                "cpu_s": round(tally.cpu_s, 3),
                "tok_s": round(tally.tokens / tally.wall_s, 2),
                "tok_per_cpu_s": round(tally.tokens / max(tally.cpu_s, 1e-9), 2),
                "speedup_vs_ar": round(
                    (tally.tokens / tally.wall_s) / (reference.tokens / reference.wall_s), 3
                ),
                "mismatches": len(differing),
                "mismatch_prompts": differing,
            }
            rows.append(row)
            print(
                f"{domain:12s} {label:12s} tau={row['tau']:.3f} {row['tau_95ci']} "
                f"tok/s={row['tok_s']:8.1f} ({row['speedup_vs_ar']:.2f}x ar) "
                f"mismatches={row['mismatches']}",
                flush=True,
            )
    elapsed = time.perf_counter() - start

    small_pair = args.target.resolve() == (SMALL_PAIR_DIR / "target").resolve()
    record: dict[str, Any] = {
        "command": command_line("benchmarks/acceptance.py", argv),
        "pair": "small pair" if small_pair else args.target.name,
        "target": str(args.target),
        "drafter": str(args.drafter),
        "target_weights_sha256": sha256_file(args.target / "model.safetensors"),
        "drafter_weights_sha256": sha256_file(args.drafter / "model.safetensors"),
        "env": {
            **env,
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "benchmark_wall_s": round(elapsed, 1),
        },
        "settings": {
            "prompts_per_domain": args.prompts,
            "new_tokens": args.new_tokens,
            "budgets": args.budgets,
            "batch_size": args.batch_size,
            "greedy": True,
            "stop_at_eos": not args.ignore_eos,
            "chain_depth": drafter.block_size - 1,
            "ddtree_topk": "budget",
        },
        "domains": {
            d: {
                "source": DOMAIN_SOURCES[d],
                "prompts": len(prompts[d]),
                "prompt_tokens_mean": round(sum(map(len, prompts[d])) / len(prompts[d]), 1),
            }
            for d in domains
        },
        "mismatches": {"total": len(mismatches), "details": mismatches},
        "rows": rows,
    }
    out = args.out or default_out(args.target, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = portable_record(record)
    out.write_text(json.dumps(record, indent=2) + "\n")
    plot_path = out.with_suffix(".png")
    plot(record, plot_path)
    print(f"mismatches with ar: {len(mismatches)}")
    print(f"wrote {out} and {plot_path}")
    return record


if __name__ == "__main__":
    sys.exit(1 if main()["mismatches"]["total"] else 0)
