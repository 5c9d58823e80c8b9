"""Benchmark: acceptance (tau) and speed of DDTree against both Graft policies, per domain.

Two kinds of pair. The committed small pair (the default, ``--pair-dir``) has no chat template;
its domains are built from its HELD-OUT stdlib files only (never from training files):

* ``code`` -- function prompts cut after the signature and docstring
  (:func:`~sglang_tree_spec.models.small_pair.heldout_prompts`);
* ``copy-edit`` -- quoted context: a whole held-out function, then the same function again
  under a new name (``name`` -> ``name_v2``), cut a third of the way into its body, so that the
  continuation can repeat (or edit) code that is in the prompt.

A chat target (``--target`` with ``--drafter``, e.g. SmolLM2-135M-Instruct and its DFlash
drafter) takes the held-out sets of :mod:`sglang_tree_spec.models.datasets` in its chat
template, and stops at its EOS as a server does:

* ``code`` (HumanEval), ``math`` (gsm_symbolic eval templates), ``chat`` (MT-Bench turn 1);
* ``chat-2turn`` -- multi-turn chat: MT-Bench's second user turn, after the target's own
  greedy answer to the first (``--first-turn-tokens``), so the context holds text the
  answer may come back to.

For each budget the stage thresholds are calibrated on DDTree steps over TRAINING prompts
(the small pair's training functions; for a chat target, training items of code, math and
chat in equal parts), once for all domains. Then, per domain, ``chain`` (the DFlash
drafter's single chain, the baseline), ``ddtree``, ``ddtree-graft-stage`` (calibrated) and
``ddtree-graft-unified`` decode the same prompts greedily, each with a fresh engine: its
successor table starts empty, is warmed by each prompt's bigrams and learns online over the
prompts in order (batches of ``--batch-size``), as a server would; unified's edge
probabilities start from a warm-up on the same TRAINING prompts (a unified engine decodes them
once and hands its counts over, as the stage rule gets its thresholds; the successor table is
not carried) and learn online from there. The outputs are checked to be token-for-token equal.

Reported per (budget, domain, method): tau = tokens committed per target forward (bonus
included), pooled over every step of every request; ``tok_s`` = generated tokens per second
of the method's ``generate`` calls and ``speedup_vs_chain`` its ratio to the chain's (the
methods take turns batch by batch, so that a change of machine load hits all alike);
``step_ms`` = mean wall time of one batched decode step (draft, tree, graft, verify,
accept, commit), ``draft_ms`` = its draft + tree + graft part (the decode step's own phase
timer); and a paired bootstrap over
prompts (95% interval) of each policy's tau relative to ddtree and to the chain, and of
unified's relative to stage -- decoding is deterministic, so the noise that matters is the
choice of prompts. ``prompt_bigram_coverage`` says how much each domain's continuation reuses
the prompt (fraction of generated token bigrams already in the prompt).

The record is written after every domain (``complete: false`` until the end); ``--resume``
with the same settings and weights keeps the cells already there and measures the rest (its
command goes to ``resumed_by``; a budget's calibration must come out as it did before).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/graft_acceptance.py   # the small pair
    python benchmarks/graft_acceptance.py \
        --target ~/.cache/sglang-tree-spec/models/smollm2-135m-instruct \
        --drafter ~/.cache/sglang-tree-spec/drafters/smollm2-135m-instruct-dflash
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    RESULTS,
    Tally,
    bootstrap_interval,
    command_line,
    decode_prompts,
    portable_record,
)

from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.loading import load_drafter, load_target
from sglang_tree_spec.graft import StageConfig, calibrate_stage
from sglang_tree_spec.models.small_pair import (
    SMALL_PAIR_DIR,
    corpus_files,
    function_prompts,
    heldout_prompts,
)

METHODS = ("chain", "ddtree", "ddtree-graft-stage", "ddtree-graft-unified")
SHORT = {
    "chain": "chain",
    "ddtree": "ddtree",
    "ddtree-graft-stage": "stage",
    "ddtree-graft-unified": "unified",
}
CHAT_DOMAINS = ("code", "math", "chat", "chat-2turn")
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


def chat_domain_prompts(
    domain: str,
    tokenizer,
    count: int,
    first_answers: Callable[[list[list[int]]], list[str]],
) -> list[list[int]]:
    """``count`` held-out prompts of a chat ``domain`` in the target's chat template.

    ``chat-2turn`` asks MT-Bench's second question after ``first_answers`` (the target's own
    replies to the first questions, given their prompts).
    """
    from sglang_tree_spec.models.datasets import heldout, prompt_ids

    if domain != "chat-2turn":
        return [prompt_ids(tokenizer, item) for item in heldout(domain, count)]
    items = heldout("chat", count)
    replies = first_answers([prompt_ids(tokenizer, item) for item in items])
    return [
        prompt_ids(tokenizer, item, turn=1, replies=[reply])
        for item, reply in zip(items, replies, strict=True)
    ]


def chat_training_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` training prompts of a chat target: code, math and chat items in turn."""
    from sglang_tree_spec.models.datasets import prompt_ids, training_items

    per_domain = -(-count // 3)
    items = [training_items(d, per_domain) for d in ("code", "math", "chat")]
    interleaved = [group[i] for i in range(per_domain) for group in items]
    return [prompt_ids(tokenizer, item) for item in interleaved[:count]]


# ------------------------------------------------------------------------------------ running


def run(
    engines: dict[str, SpecEngine],
    prompts: list[list[int]],
    new_tokens: int,
    batch: int,
    stops: list[int] | None,
    desc: str = "",
) -> dict[str, Tally]:
    """Greedy decoding of ``prompts`` by every engine (:func:`common.decode_prompts`)."""
    return decode_prompts(engines, prompts, new_tokens, batch, stops, desc)


def cell_of(tally: Tally) -> dict:
    """One method's record: pooled tau, tokens per second, per-prompt counts, step times
    (from the engine's phase timer: ``draft_ms`` is the draft + tree part)."""
    return {
        "tau": round(tally.tau, 4),
        "steps": sum(tally.steps),
        "batch_steps": tally.batch_steps,
        "tokens": tally.tokens,
        "tok_s": round(tally.tok_s, 2),
        "step_ms": round(tally.step_ms(), 2),
        "draft_ms": round(tally.step_ms("draft", "tree"), 2),
        "wall_s": round(tally.wall_s, 2),
        "cpu_s": round(tally.cpu_s, 2),
        "per_prompt_steps": tally.steps,
        "per_prompt_committed": tally.committed,
    }


def calibrate(
    engine: SpecEngine,
    prompts: list[list[int]],
    new_tokens: int,
    batch: int,
    stops: list[int] | None,
    desc: str = "",
):
    """Stage thresholds from the engine's DDTree steps on ``prompts``."""
    engine.confidence_log = []
    run({"ddtree": engine}, prompts, new_tokens, batch, stops, desc)
    confidence = torch.cat([c for c, _ in engine.confidence_log])
    accept_len = torch.cat([a for _, a in engine.confidence_log])
    engine.confidence_log = None
    return calibrate_stage(confidence, accept_len, engine.stage), int(accept_len.shape[0])


def warm_edges(
    engine: SpecEngine,
    prompts: list[list[int]],
    new_tokens: int,
    batch: int,
    stops: list[int] | None,
    desc: str = "",
) -> tuple[dict[str, torch.Tensor], int]:
    """Edge acceptance counts of a ``ddtree-graft-unified`` engine after decoding ``prompts``,
    and the batched steps it counted."""
    unified = run({"unified": engine}, prompts, new_tokens, batch, stops, desc)["unified"]
    return engine.edge_acceptance.state_dict(), unified.batch_steps


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
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(METHODS))  # below, off the bars
    fig.suptitle(f"Graft on DDTree, {record['pair']} ({record['device']}, greedy)")
    fig.tight_layout(rect=(0.0, 0.08, 1.0, 1.0))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resumable_record(out: Path, build_sha256: str, settings: dict) -> dict | None:
    """The record at ``out`` if an earlier run with these settings and weights wrote it."""
    if not out.exists():
        return None
    record = json.loads(out.read_text())
    sha = record.get("drafter_sha256", record.get("pair_build_sha256"))
    differing = [k for k, v in settings.items() if record.get(k) != v]
    if sha != build_sha256 or differing:
        raise ValueError(
            f"cannot resume {out}: it was written with other "
            f"{'weights' if sha != build_sha256 else ', '.join(differing)}"
        )
    return record


def load_pair(args: argparse.Namespace, device: torch.device):
    """``(target, tokenizer, drafter, label, build_sha256)`` of the small pair or a chat pair."""
    if args.target is None:
        target, tokenizer = load_target(args.pair_dir / "target", device)
        drafter = load_drafter(args.pair_dir / "drafter", device, torch.float32)
        build = hashlib.sha256((args.pair_dir / "BUILD.json").read_bytes()).hexdigest()
        return target, tokenizer, drafter, "committed small pair", build
    if args.drafter is None:
        raise SystemExit("--target needs --drafter (its DFlash drafter directory)")
    target, tokenizer = load_target(args.target, device)
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"{args.target} has no chat template: use the small pair's domains")
    drafter = load_drafter(args.drafter, device, torch.float32)
    weights = args.drafter / "model.safetensors"
    return (
        target,
        tokenizer,
        drafter,
        args.target.name,
        hashlib.sha256(weights.read_bytes()).hexdigest(),
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair-dir", type=Path, default=SMALL_PAIR_DIR)
    parser.add_argument("--target", type=Path, help="a chat target (instead of the small pair)")
    parser.add_argument("--drafter", type=Path, help="the chat target's DFlash drafter")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--domains", nargs="+", choices=sorted({*DOMAINS, *CHAT_DOMAINS}))
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts per domain")
    parser.add_argument("--train-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--first-turn-tokens", type=int, default=128, help="chat-2turn only")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="default: results/graft_...")
    parser.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the (budget, domain) cells that an interrupted run with the same settings "
        "wrote to --out, and measure only the others",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    target, tokenizer, drafter, pair, build_sha256 = load_pair(args, device)
    chat = args.target is not None
    names = args.domains or list(CHAT_DOMAINS if chat else DOMAINS)
    allowed = CHAT_DOMAINS if chat else tuple(DOMAINS)
    if unknown := [n for n in names if n not in allowed]:
        parser.error(f"domains {unknown} are not for this pair; choose from {list(allowed)}")
    stops = None if chat else []  # a chat target stops at its EOS, as a server does
    out = args.out or (
        RESULTS / f"graft_acceptance_cpu_{args.target.name}.json" if chat else DEFAULT_OUT
    )
    load_before = os.getloadavg()

    def first_answers(prompts: list[list[int]]) -> list[str]:
        engine = SpecEngine(target, drafter, "ddtree", budget=16)
        results = engine.generate(prompts, args.first_turn_tokens, stop_token_ids=None)
        return [tokenizer.decode(r.tokens, skip_special_tokens=True) for r in results]

    if chat:
        domains = {n: chat_domain_prompts(n, tokenizer, args.prompts, first_answers) for n in names}
        train = chat_training_prompts(tokenizer, args.train_prompts)
    else:
        encode = lambda texts: [tokenizer(t)["input_ids"] for t in texts]  # noqa: E731
        domains = {n: encode(DOMAINS[n](args.prompts)) for n in names}
        train = encode(training_prompts(args.train_prompts))
    limit = target.config.max_position_embeddings - args.new_tokens - drafter.config.block_size
    for name, prompts in domains.items():
        if max(len(p) for p in prompts) > limit:
            raise ValueError(f"a {name} prompt does not fit the target's {limit} positions")

    omp = os.environ.get("OMP_WAIT_POLICY")
    command = command_line("benchmarks/graft_acceptance.py", argv)
    settings = {
        "prompts_per_domain": args.prompts,
        "train_prompts": len(train),
        "new_tokens": args.new_tokens,
        "first_turn_tokens": args.first_turn_tokens if "chat-2turn" in domains else None,
        "batch_size": args.batch_size,
    }
    earlier = resumable_record(out, build_sha256, settings) if args.resume else None
    results: list[dict] = earlier["results"] if earlier else []
    coverage: dict[str, float] = {
        name: value["prompt_bigram_coverage"]
        for name, value in (earlier["domains"] if earlier else {}).items()
    }

    def save(complete: bool) -> dict:
        """Write the record so far (after every domain: a long run keeps what it measured)."""
        record = {
            "command": earlier["command"] if earlier else command,
            "resumed_by": [*(earlier or {}).get("resumed_by", []), command] if earlier else [],
            "complete": complete,
            "pair": pair,
            "drafter_sha256" if chat else "pair_build_sha256": build_sha256,
            "device": str(device),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": omp,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
            **settings,
            "stops_at_eos": chat,
            "greedy": True,
            "domains": {
                name: {"prompts": len(domains[name]), "prompt_bigram_coverage": coverage[name]}
                for name in coverage
            },
            "results": results,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        record = portable_record(record)
        out.write_text(json.dumps(record, indent=2) + "\n")
        return record

    for budget in args.budgets:
        kept = next((row for row in results if row["budget"] == budget), None)
        if kept and all(name in kept["domains"] for name in domains):
            print(f"B={budget:3d} kept from {out}: {', '.join(domains)}", flush=True)
            continue
        calibrator = SpecEngine(target, drafter, "ddtree", budget=budget, stage=StageConfig())
        stage, calibration_steps = calibrate(
            calibrator,
            train,
            args.new_tokens,
            args.batch_size,
            stops,
            f"B={budget} stage thresholds",
        )
        warm_engine = SpecEngine(target, drafter, "ddtree-graft-unified", budget=budget)
        edges_state, warm_steps = warm_edges(
            warm_engine,
            train,
            args.new_tokens,
            args.batch_size,
            stops,
            f"B={budget} unified warm-up",
        )
        row: dict = {
            "budget": budget,
            "unified_warm_up_batch_steps": warm_steps,
            "stage": {
                "depths": list(stage.depths),
                "thresholds": [round(t, 5) for t in stage.thresholds],
                "keep_fractions": [round(f, 4) for f in stage.keep_fractions],
                "calibration_steps": calibration_steps,
            },
            "domains": kept["domains"] if kept else {},
        }
        if kept and {k: v for k, v in kept.items() if k != "domains"} != {
            k: v for k, v in row.items() if k != "domains"
        }:
            raise ValueError(
                f"B={budget}: the calibration differs from the one kept in {out} "
                "(code or settings changed since); rerun without --resume"
            )
        if kept:
            results[results.index(kept)] = row
        for name, prompts in domains.items():
            if name in row["domains"]:
                print(f"B={budget:3d} {name:10s} kept from {out}", flush=True)
                continue
            engines = {
                method: SpecEngine(target, drafter, method, budget=budget, stage=stage)
                for method in METHODS
            }
            engines["ddtree-graft-unified"].edge_acceptance.load_state_dict(edges_state)
            tallies = run(
                engines, prompts, args.new_tokens, args.batch_size, stops, f"B={budget} {name}"
            )
            cell = {method: cell_of(tallies[method]) for method in METHODS}
            for method in METHODS:
                r = cell[method]
                r["speedup_vs_chain"] = round(r["tok_s"] / cell["chain"]["tok_s"], 3)
                print(
                    f"B={budget:3d} {name:10s} {method:22s} tau={r['tau']:.3f} "
                    f"{r['tok_s']:.1f} tok/s ({r['speedup_vs_chain']:.2f}x chain) "
                    f"step={r['step_ms']:.1f} ms (draft+tree+graft {r['draft_ms']:.1f})",
                    flush=True,
                )
            outputs = [tallies[m].outputs for m in METHODS]
            if any(o != outputs[0] for o in outputs):
                raise AssertionError(f"greedy outputs differ between methods on {name}")
            coverage[name] = prompt_bigram_coverage(prompts, outputs[0])
            chain, ddtree, stage_r, unified = (tallies[m] for m in METHODS)
            cell["tau_ratio_95ci"] = {
                "ddtree/chain": bootstrap_interval(ddtree, chain),
                "stage/ddtree": bootstrap_interval(stage_r, ddtree),
                "unified/ddtree": bootstrap_interval(unified, ddtree),
                "unified/stage": bootstrap_interval(unified, stage_r),
                "unified/chain": bootstrap_interval(unified, chain),
            }
            row["domains"][name] = cell
            if not any(r is row for r in results):
                results.append(row)
            save(complete=False)

    record = save(complete=True)
    plot_path = args.plot or out.with_suffix(".png")
    plot(record, plot_path)
    print(f"wrote {out} and {plot_path}")
    return record


if __name__ == "__main__":
    main()
