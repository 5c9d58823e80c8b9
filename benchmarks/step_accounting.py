"""Step accounting: what one decode step launches outside graphs, replays and waits for.

Each configuration is a real CPU SGLang server with ``SGLANG_TREE_SPEC_ACCOUNTING`` set
(``plugin/accounting.py``) and DDTREE's verify and tree-build graphs in their closure replay
(``SGLANG_TREE_SPEC_CPU_VERIFY_GRAPHS=1``). It serves the held-out prompts at each batch size
(one request of ``bs`` prompts: prefilled and decoded together, greedy, the same lengths) and
the table is the mean per decode step at exactly that batch size, after the first ``--skip``
steps of each size:

* ``ops``: device ops launched outside graphs (each a kernel on a GPU; a launch of the plugin's
  own kernels, ``plugin/kernels.py``, is one op, its CPU stand-in's ops none);
* ``replays``: graph replays (SGLang's decode and DFLASH graphs as SGLang replays them on CUDA,
  DDTREE's verify, tree-build and acceptance graphs);
* ``reads``: blocking host reads of device data, the FutureMap host-length wait included;
* ``uploads``: host-to-device copies (pinned, non-blocking);
* ``stand-in ops``: ops of CPU code standing in for one GPU kernel each (KV moves, the drafter
  context write's non-CUDA branch, the plugin's tree mask);
* ``host ms``: the step's time outside model forwards and replays (instrumented);
* ``tok/step``: tokens committed per request and step.

Configurations: ``none`` (no speculation), ``dflash`` (SGLang's DFLASH chain with the same
drafter), ``ddtree:B`` (a fixed budget; 0: plain steps), ``ddtree:auto``, ``ddtree-graft:B``
(unified grafting). Every server runs with ``--disable-overlap-schedule``; with ``--overlap`` a
DDTREE server keeps SGLang's overlap scheduler instead (SGLang 0.5.23; none and DFLASH run
synchronously on a CPU whatever the flag: SGLang turns overlap off there).

    python benchmarks/step_accounting.py                 # the committed table, then
    .venv-0.5.23/bin/python benchmarks/step_accounting.py --overlap --merge \
        --configs none ddtree:8 ddtree:32 ddtree:auto    # DDTREE under the overlap scheduler
    python benchmarks/step_accounting.py --quick         # two configurations, batch size 1
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import code_version, command_line, portable, portable_record  # noqa: E402

from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts  # noqa: E402
from sglang_tree_spec.plugin.accounting import ACCOUNTING_ENV  # noqa: E402
from sglang_tree_spec.plugin.validation import CPU_OVERLAP_ENV  # noqa: E402
from sglang_tree_spec.server_process import (  # noqa: E402
    free_port,
    http_json,
    launch,
    stop,
    wait_until_healthy,
)

CONFIGS = ("none", "dflash", "ddtree:0", "ddtree:8", "ddtree:32", "ddtree:auto", "ddtree-graft:8")
COUNTS = ("ops", "replays", "reads", "uploads", "cpu_only_ops", "host_ms")


def server_command(args: argparse.Namespace, config: str, port: int) -> list[str]:
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(args.target), "--device", "cpu",
        "--attention-backend", "torch_native", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--random-seed", "0",
        "--max-running-requests", str(max(args.batch_sizes)),
        "--max-total-tokens", "16384", "--skip-server-warmup", "--sleep-on-idle",
    ]  # fmt: skip
    if not args.overlap:
        command.append("--disable-overlap-schedule")
    if config == "none":
        return command
    command += ["--speculative-draft-model-path", str(args.drafter)]
    if config == "dflash":
        return [*command, "--speculative-algorithm", "DFLASH"]
    kind, budget = config.split(":")
    largest = 32 if budget == "auto" else max(int(budget), 8)  # (budget 0: plain steps)
    command += ["--speculative-algorithm", "DDTREE",
                "--speculative-num-draft-tokens", str(largest + 1),
                "--speculative-ddtree-budget", budget]  # fmt: skip
    if kind == "ddtree-graft":
        command += ["--speculative-ddtree-graft", "unified"]
    return command


def measure(args: argparse.Namespace, config: str, prompts: list[list[int]], work: Path) -> dict:
    """One server: the per-step records of each batch size."""
    steps_dir = work / config.replace(":", "_")
    steps_dir.mkdir(parents=True)
    port = free_port()
    env = {ACCOUNTING_ENV: str(steps_dir), "SGLANG_TREE_SPEC_CPU_VERIFY_GRAPHS": "1"}
    if args.overlap:  # DDTREE keeps the overlap scheduler on CPU (SGLang 0.5.23)
        env[CPU_OVERLAP_ENV] = "1"
    log = work / f"{config.replace(':', '_')}.log"
    process = launch(server_command(args, config, port), log, plugins="ddtree", env=env)
    url = f"http://127.0.0.1:{port}"
    params = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    outputs: dict[int, list] = {}
    try:
        wait_until_healthy(url, process, log)
        for bs in args.batch_sizes:
            for path in steps_dir.glob("*.jsonl"):
                path.unlink()
            # one request of bs prompts: prefilled together, decoded together to the end
            payload = {"input_ids": prompts[:bs], "sampling_params": params}
            replies = http_json(f"{url}/generate", payload, 900)
            outputs[bs] = [r["output_ids"] for r in replies]
            records = [
                json.loads(line)
                for path in sorted(steps_dir.glob("*.jsonl"))
                for line in path.read_text().splitlines()
            ]
            outputs[f"steps{bs}"] = [r for r in records if r["bs"] == bs][args.skip :]
    finally:
        stop(process)
    return outputs


def row(config: str, bs: int, steps: list[dict]) -> dict:
    n = len(steps)
    mean = {key: sum(s[key] for s in steps) / n if n else float("nan") for key in COUNTS}
    sites: collections.Counter = collections.Counter()
    for step in steps:
        sites.update(step["read_sites"])
    return {
        "config": config,
        "bs": bs,
        "steps": n,
        **{key: round(value, 3) for key, value in mean.items()},
        "tokens_per_step": round(sum(s["tokens"] for s in steps) / n / bs, 2) if n else None,
        "read_sites": {site: round(count / max(n, 1), 2) for site, count in sites.items()},
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| config | bs | steps | ops | replays | reads | uploads | stand-in ops | host ms "
        "| tok/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['bs']} | {r['steps']} | {r['ops']:.1f} | {r['replays']:.2f} "
            f"| {r['reads']:.2f} | {r['uploads']:.2f} | {r['cpu_only_ops']:.1f} "
            f"| {r['host_ms']:.2f} "
            f"| {r['tokens_per_step'] or 0:.2f} |"
        )
    lines += ["", "Blocking reads by site (per step):", ""]
    for r in rows:
        if r["read_sites"]:
            sites = ", ".join(f"{k} {v}" for k, v in sorted(r["read_sites"].items()))
            lines.append(f"- {r['config']} bs {r['bs']}: {sites}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=SMALL_PAIR_DIR / "target")
    parser.add_argument("--drafter", type=Path, default=SMALL_PAIR_DIR / "drafter")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--skip", type=int, default=2, help="first steps of a size not counted")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs and steps here")
    parser.add_argument(
        "--merge", action="store_true", help="keep --out's run of the other scheduling beside"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/step_accounting_cpu")
    args = parser.parse_args(argv)
    if args.quick:
        args.configs, args.batch_sizes, args.new_tokens = ["none", "ddtree:8"], [1], 24
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = heldout_prompts(max(args.batch_sizes))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids = [tokenizer.encode(p, add_special_tokens=False)[-48:] for p in prompts]
    rows, mismatches = [], {}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.logs or Path(tmp)  # the servers' logs and step records
        results = {c: measure(args, c, ids, work) for c in args.configs}
    reference = results.get("none")
    for config, result in results.items():
        for bs in args.batch_sizes:
            rows.append(row(config, bs, result[f"steps{bs}"]))
            if reference is not None:
                mismatches[f"{config}@{bs}"] = sum(
                    a != b for a, b in zip(result[bs], reference[bs], strict=True)
                )
    import sglang

    run = {
        "command": portable(command_line("benchmarks/step_accounting.py", argv)),
        "code": code_version(),
        "sglang": sglang.__version__,
        "overlap": args.overlap,
        "seconds": round(time.time() - started),
        "rows": rows,
        "mismatches": mismatches,
    }
    runs = [run]
    if args.merge and args.out.with_suffix(".json").exists():  # the other scheduling's run
        earlier = json.loads(args.out.with_suffix(".json").read_text())["runs"]
        runs = [r for r in earlier if r["overlap"] != args.overlap] + runs
    text = "# Step accounting (CPU, small pair, float32)\n"
    for each in runs:
        scheduling = (
            "overlap scheduler for DDTREE (none and DFLASH run synchronously on a CPU)"
            if each["overlap"]
            else "--disable-overlap-schedule"
        )
        text += (
            f"\n## SGLang {each['sglang']}, {scheduling}\n\n`{each['command']}`\n\n"
            f"code {each['code']}, {each['seconds']} s\n\n{table(each['rows'])}\n\n"
            f"Outputs differing from none's (greedy): {each['mismatches']}\n"
        )
    record = {"runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = portable_record(record)
    args.out.with_suffix(".md").write_text(portable(text))
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(text)
    return record


if __name__ == "__main__":
    main()
