"""Benchmark: output throughput of a real SGLang server, no speculation vs DDTREE.

For each configuration (``none``, ``ddtree:B`` for each budget, ``ddtree-graft:B`` with the
unified graft, and on a GPU ``dflash``, SGLang's built-in DFlash chain with the same drafter)
one server is started with SGLang's own launcher,
warmed up, then sent the same held-out prompts at each concurrency (greedy, fixed output
length). Output tokens/s is the total of generated tokens over the wall time of that round;
tau is SGLang's per-request accept length (tokens per verify step, bonus included). Ratios are
against ``none`` measured in the same run. Every configuration's greedy outputs are compared to
``none``'s and the mismatches counted.

    python benchmarks/serve_throughput.py                        # CPU, the committed small pair
    python benchmarks/serve_throughput.py --device cuda --target DIR --drafter DIR \\
        --configs none dflash ddtree:16 ddtree:64 --attention-backend triton \\
        --out benchmarks/results/serve_throughput_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts
from sglang_tree_spec.server_process import (
    free_port,
    http_json,
    launch,
    stop,
    wait_until_healthy,
)

DEFAULT_OUT = Path(__file__).parent / "results" / "serve_throughput_cpu.json"


def server_command(args: argparse.Namespace, config: str, port: int) -> list[str]:
    """SGLang's launcher for one configuration: ``none``, ``dflash``, ``ddtree:<budget>`` or
    ``ddtree-graft:<budget>``, where the budget is a number (fixed) or ``auto`` (budget
    control up to ``--auto-max-budget``)."""
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(args.target), "--device", args.device,
        "--attention-backend", args.attention_backend, "--dtype", args.dtype,
        "--host", "127.0.0.1", "--port", str(port), "--random-seed", "0",
        "--max-running-requests", str(max(args.concurrency)),
        "--max-total-tokens", str(args.max_total_tokens),
    ]  # fmt: skip
    if config == "dflash":
        command += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                    str(args.drafter)]  # fmt: skip
    elif config.startswith(("ddtree:", "ddtree-graft:")):
        budget = config.split(":", 1)[1]
        largest = args.auto_max_budget if budget == "auto" else int(budget)
        command += ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path",
                    str(args.drafter),
                    "--speculative-num-draft-tokens", str(largest + 1),
                    "--speculative-ddtree-budget", budget]  # fmt: skip
        if config.startswith("ddtree-graft:"):
            command += ["--speculative-ddtree-graft", "unified"]
    elif config != "none":
        raise SystemExit(
            f"unknown configuration {config!r} (none, dflash, ddtree:<B>, ddtree-graft:<B>)"
        )
    return command


def run_round(base_url: str, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    """All prompts at ``concurrency`` requests in flight; throughput, tau and the outputs."""

    def one(prompt: list[int]) -> dict:
        params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        payload = {"input_ids": prompt, "sampling_params": params}
        return http_json(f"{base_url}/generate", payload, timeout=1800)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    generated = sum(len(reply["output_ids"]) for reply in replies)
    taus = [reply["meta_info"].get("spec_accept_length") for reply in replies]
    taus = [t for t in taus if t is not None]
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": round(generated / wall, 2),
        "wall_s": round(wall, 3),
        "tau": round(statistics.mean(taus), 3) if taus else 1.0,
        "outputs": [reply["output_ids"] for reply in replies],
    }


def measure(args: argparse.Namespace, config: str, prompts: list[list[int]], log: Path) -> list:
    port = free_port()
    process = launch(server_command(args, config, port), log, plugins="ddtree")
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_healthy(base_url, process, log)
        run_round(base_url, prompts[:2], 2, 8)  # warm-up
        return [run_round(base_url, prompts, c, args.new_tokens) for c in args.concurrency]
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=SMALL_PAIR_DIR / "target")
    parser.add_argument("--drafter", type=Path, default=SMALL_PAIR_DIR / "drafter")
    parser.add_argument(
        "--configs", nargs="+", default=["none", "ddtree:8", "ddtree:32", "ddtree:auto"]
    )
    parser.add_argument("--auto-max-budget", type=int, default=32, help="ddtree:auto's largest")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="torch_native")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = heldout_prompts(args.prompts)
    prompts = [tokenizer.encode(t, add_special_tokens=False)[-args.prompt_tokens :] for t in texts]
    logs = Path(tempfile.mkdtemp(prefix="serve-throughput-"))
    results: dict[str, list] = {}
    for config in args.configs:
        log = logs / f"{config.replace(':', '_')}.log"
        print(f"[{config}] starting server (log: {log})", flush=True)
        results[config] = measure(args, config, prompts, log)

    reference = results.get("none")
    rows = []
    print(f"{'config':>12} {'conc':>4} {'tok/s':>9} {'x none':>7} {'tau':>6} {'mismatch':>8}")
    for config, rounds in results.items():
        for i, r in enumerate(rounds):
            base = reference[i] if reference else None
            ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None
            mismatched = (
                sum(a != b for a, b in zip(r["outputs"], base["outputs"], strict=True))
                if base
                else None
            )
            ratio_text = f"{ratio:.2f}x" if ratio else "-"
            print(
                f"{config:>12} {r['concurrency']:>4} {r['output_tokens_per_s']:>9.1f} "
                f"{ratio_text:>7} {r['tau']:>6.2f} {mismatched if base else '-':>8}"
            )
            rows.append(
                {k: v for k, v in r.items() if k != "outputs"}
                | {"config": config, "speedup_vs_none": ratio, "mismatched_outputs": mismatched}
            )
    env = {
        "device": args.device,
        "machine": platform.processor() or platform.machine(),
        "target": str(args.target),
        "drafter": str(args.drafter),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "attention_backend": args.attention_backend,
        "dtype": args.dtype,
        "command": " ".join(sys.argv),
        "load_average_1_5_15min": os.getloadavg(),  # other work sharing the machine
    }
    try:
        import sglang
        import torch

        env |= {"sglang": sglang.__version__, "torch": torch.__version__}
    except ImportError:
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
