"""Benchmark: a real SGLang server at concurrency 1-16: no speculation, the chain, DDTREE.

Every configuration's server is started with SGLang's own launcher (``--enable-metrics``,
``--sleep-on-idle``) and kept up (on a GPU one configuration at a time); at each concurrency
each gets an unmeasured warm-up wave of ``concurrency`` requests (:func:`warm_up`) and has its
garbage collector frozen (:func:`freeze_gc`), then ``--repeats`` waves of the same held-out
prompts (greedy, fixed output length, streamed), interleaved across configurations in
balanced orders, group by group (``concurrency`` requests at once; :func:`run_round`).
Per round: output tokens/s (generated tokens over the round's wall time), SGLang's accept length
tau (tokens per decode step, bonus included; a DDTREE plain step commits two), time to first
token and the gaps between streamed chunks (p50 / p99, as ``sglang.bench_serving`` measures
them), and for DDTREE
the round's window of the server's ``sglang:ddtree_*`` metrics: the budgets chosen, the
calibrated predicted vs observed accept length, and the latency model's step-time error.
Ratios are against ``none`` measured in the same run; every configuration's greedy outputs are
compared with ``none``'s (the ``mismatch`` column must be 0).

Configurations: ``none``; ``none-no-overlap`` (no speculation with
``--disable-overlap-schedule``: DDTREE turns SGLang's overlap scheduler off on CPU, so this is
the plain decoding it is compared with step for step); ``chain`` (DDTREE at top-1 per depth
and the drafter's whole block: the DFlash chain through the same worker); ``ddtree:B`` (fixed
budget B); ``ddtree:auto``
(budget control up to ``--auto-max-budget``); ``ddtree-graft:B|auto`` (with the unified graft);
on a GPU ``dflash``, SGLang's built-in DFlash chain with the same drafter. ``CONFIG@N`` is
another server of ``CONFIG`` (a replica, e.g. ``ddtree:auto@2``): on this CPU two identical
servers measured in the same interleaved waves differ by up to ~3% for the whole run (small
pair, B 8 twice, 8 waves: 11.36 vs 11.04 ms a step at batch size 1), more than a run's waves
resolve, so a replica measures that spread in the run itself (:func:`replica_spread`).
``SERVER/N`` runs budget N inside the auto server ``SERVER`` (e.g. ``ddtree:auto/8``): its
requests pin the step's budget (``custom_params``, under the plugin's
``SGLANG_TREE_SPEC_PIN_BUDGET``), so the server measures its auto against its own fixed budgets
with no server offset between them (:func:`auto_vs_own_fixed`); ``SERVER/auto:key=value...``
(e.g. ``ddtree:auto/auto:hard=0``) runs a second auto controller with those settings
(``step.AUTO_OVERRIDES``) in the same server, compared like its auto.

    python benchmarks/serve_throughput.py                    # CPU, the shipped small pair
    python benchmarks/serve_throughput.py --quick            # none / chain / auto, minutes
    python benchmarks/serve_throughput.py --configs none chain ddtree:auto --prompts 8
    python benchmarks/serve_throughput.py --configs none ddtree:auto ddtree:auto/4 \\
        ddtree:auto/8 ddtree:auto/16 ddtree:auto/32 --repeats 12   # one auto server
    python benchmarks/serve_throughput.py --device cuda --target DIR --drafter DIR \\
        --configs none dflash ddtree:16 ddtree:auto --attention-backend triton \\
        --dtype bfloat16 --out benchmarks/results/serve_throughput_h100.json

Writes the JSON record, a markdown table (``.md``) and a plot (``.png``) next to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import command_line, environment, portable, portable_record
from tqdm import tqdm

from sglang_tree_spec import step
from sglang_tree_spec.config import candidate_budgets
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts
from sglang_tree_spec.plugin.worker import PIN_ENV_FLAG, PIN_PARAM
from sglang_tree_spec.server_process import (
    ddtree_metrics,
    exit_on_sigterm,
    free_port,
    launch,
    stop,
    wait_until_healthy,
)

DEFAULT_OUT = Path(__file__).parent / "results" / "serve_throughput_cpu.json"
DEFAULT_CONFIGS = ["none", "chain", "ddtree:4", "ddtree:8", "ddtree:16", "ddtree:32", "ddtree:auto"]
DEFAULT_CONCURRENCY = [1, 2, 4, 8, 16]
QUICK = {  # --quick: the README's run command, a few minutes on 2 CPU cores
    "configs": ["none", "chain", "ddtree:auto"],
    "prompts": 16,
    "new_tokens": 32,
    "repeats": 1,
    "out": DEFAULT_OUT.with_name("serve_throughput_cpu_quick.json"),
}


def drafter_block(drafter: Path) -> int:
    """The DFlash drafter's block size (its ``config.json``)."""
    return int(json.loads((drafter / "config.json").read_text())["block_size"])


def random_drafter(drafter: Path, out: Path, seed: int = 0) -> Path:
    """A copy of ``drafter`` with random weights (same config, names and shapes, std 0.02;
    norms at 1): a drafter that is no use, for the fallback check."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(drafter / "config.json", out / "config.json")
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: (
            torch.ones_like(t)
            if "norm" in name
            else (0.02 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        )
        for name, t in load_file(drafter / "model.safetensors").items()
    }
    save_file(weights, out / "model.safetensors")
    return out


REPLICA = "@"  # CONFIG@N: another server of CONFIG
PIN = "/"  # SERVER/N: budget N pinned in SERVER's (auto) server


def base_config(config: str) -> str:
    """``CONFIG@N`` -> ``CONFIG`` (a replica runs its configuration's command), pin kept:
    ``ddtree:auto@2/8`` -> ``ddtree:auto/8``."""
    server, pin, budget = config.partition(PIN)
    return server.split(REPLICA, 1)[0] + pin + budget


def server_of(config: str) -> str:
    """The server a configuration's waves go to: ``SERVER/N`` -> ``SERVER``, else itself."""
    return config.split(PIN, 1)[0]


def pin_of(config: str, candidates: tuple[int, ...] | None = None) -> int | str | None:
    """``SERVER/N`` -> N (its requests pin budget N in SERVER's server; N must be one of
    ``candidates``, auto's budgets, when given: the server ignores any other pin);
    ``SERVER/auto:key=value...`` -> that string (a second auto controller with those settings
    in SERVER's server, ``step.auto_overrides``); else None."""
    if PIN not in config:
        return None
    server, pin = config.split(PIN, 1)
    if not base_config(server).endswith(":auto"):
        raise SystemExit(f"{config!r}: a pin is AUTO_SERVER/N or AUTO_SERVER/auto:key=value")
    if pin.startswith("auto"):
        try:
            step.auto_overrides(pin)
        except ValueError as error:
            raise SystemExit(f"{config!r}: {error}") from None
        return pin
    if not pin.isdigit():
        raise SystemExit(f"{config!r}: a pin is AUTO_SERVER/N or AUTO_SERVER/auto:key=value")
    if candidates is not None and int(pin) not in candidates:
        raise SystemExit(f"{config!r}: {pin} is not one of auto's budgets {candidates}")
    return int(pin)


def auto_budgets(args: argparse.Namespace) -> tuple[int, ...]:
    """The budgets an auto server of this run chooses from (a pin must be one of them)."""
    if args.auto_candidates:
        return tuple(int(b) for b in args.auto_candidates.split(","))
    return candidate_budgets(args.auto_max_budget)


def server_command(args: argparse.Namespace, config: str, port: int) -> list[str]:
    """SGLang's launcher for one configuration (see the module docstring)."""
    config = base_config(config)
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(args.target), "--device", args.device,
        "--attention-backend", args.attention_backend, "--dtype", args.dtype,
        "--host", "127.0.0.1", "--port", str(port), "--random-seed", "0",
        "--max-running-requests", str(max(args.concurrency)),
        "--max-total-tokens", str(args.max_total_tokens), "--enable-metrics",
        "--sleep-on-idle",  # every configuration's server is up at once; idle ones sleep
    ]  # fmt: skip
    drafter = ["--speculative-draft-model-path", str(args.drafter)]
    if args.token_map is not None and config != "dflash":  # (DFLASH ignores the flag)
        drafter += ["--speculative-token-map", str(args.token_map)]
    if config == "dflash":
        return [*command, "--speculative-algorithm", "DFLASH", *drafter]
    if config == "chain":
        depth = drafter_block(args.drafter) - 1
        return [*command, "--speculative-algorithm", "DDTREE", *drafter,
                "--speculative-num-draft-tokens", str(depth + 1),
                "--speculative-ddtree-budget", str(depth),
                "--speculative-ddtree-topk", "1"]  # fmt: skip
    if config.startswith(("ddtree:", "ddtree-graft:")):
        budget = config.split(":", 1)[1]
        largest = args.auto_max_budget if budget == "auto" else int(budget)
        # SGLang reserves 2 x num-draft-tokens KV slots a step; the drafter's block must fit.
        window = max(largest + 1, -(-drafter_block(args.drafter) // 2))
        command += ["--speculative-algorithm", "DDTREE", *drafter,
                    "--speculative-num-draft-tokens", str(window),
                    "--speculative-ddtree-budget", budget]  # fmt: skip
        if config.startswith("ddtree-graft:"):
            command += ["--speculative-ddtree-graft", "unified"]
        if budget == "auto" and args.auto_candidates:
            command += ["--speculative-ddtree-candidates", args.auto_candidates]
        return command
    if config == "none":
        return command
    if config == "none-no-overlap":
        return [*command, "--disable-overlap-schedule"]
    raise SystemExit(
        f"unknown configuration {config!r} (none, none-no-overlap, chain, dflash, "
        "ddtree:<B|auto>, ddtree-graft:<B|auto>)"
    )


def stream_one(
    base_url: str, prompt: list[int], new_tokens: int, pin: int | str | None = None
) -> dict:
    """One streamed greedy request: its output ids, TTFT, chunk gaps and SGLang's meta.
    ``pin``: the budget its decode steps run at (a pinned configuration's request)."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    if pin is not None:
        params["custom_params"] = {PIN_PARAM: pin}
    body = json.dumps({"input_ids": prompt, "sampling_params": params, "stream": True}).encode()
    request = urllib.request.Request(
        f"{base_url}/generate", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    arrivals, output_ids, meta = [], [], {}
    with urllib.request.urlopen(request, timeout=1800) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            arrivals.append(time.perf_counter() - start)
            output_ids = _cumulative(output_ids, chunk.get("output_ids", []), chunk)
            meta = chunk.get("meta_info", meta)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"output_ids": output_ids, "ttft": arrivals[0], "gaps": gaps, "meta": meta}


def _cumulative(so_far: list[int], ids: list[int], chunk: dict) -> list[int]:
    """The output so far: SGLang streams cumulative ids unless incremental streaming is on
    (then each chunk carries only its new ids)."""
    done = chunk.get("meta_info", {}).get("completion_tokens")
    return ids if done is None or len(ids) == done else so_far + ids


def control_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """A round's DDTREE metrics: steps per budget and, under auto, the mean predicted vs
    observed accept length, the latency model's mean |error| / measured step time and its
    predicted over measured time of the same steps (its bias)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    budgets = {
        int(k.split("=")[1].rstrip("}")): int(v)
        for k, v in delta.items()
        if k.startswith("steps_total{") and v > 0
    }

    def mean(total: str, count: str) -> float | None:
        # a counter never incremented (no accepted token: a useless drafter) is not exported
        return round(delta.get(total, 0.0) / delta[count], 3) if delta.get(count) else None

    return {
        "budget_steps": dict(sorted(budgets.items())),
        # predicted vs observed on the same (calibrated) request-steps
        "predicted_accept": mean("predicted_accept_tokens_total", "calibrated_requests_total"),
        "observed_accept": mean("calibrated_accepted_tokens_total", "calibrated_requests_total"),
        # the gap's standard error: sqrt(sum of squared weighted errors) / calibrated steps
        "accept_gap_stderr": (
            round(delta.get("calibrated_squared_error_total", 0.0) ** 0.5 / calibrated, 3)
            if (calibrated := delta.get("calibrated_requests_total"))
            else None
        ),
        "verified_requests": int(delta.get("verified_requests_total", 0)),
        "step_time_error": mean("step_time_abs_rel_error_total", "timed_steps_total"),
        "step_time_predicted_over_measured": mean(
            "step_time_predicted_seconds_total", "step_time_measured_seconds_total"
        ),
    }


def run_wave(
    base_url: str,
    prompts: list[list[int]],
    concurrency: int,
    new_tokens: int,
    pin: int | str | None = None,
) -> dict:
    """All prompts at ``concurrency`` requests in flight: the replies and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda p: stream_one(base_url, p, new_tokens, pin), prompts))
    return {"replies": replies, "wall": time.perf_counter() - start}


def run_round(
    runs: list[tuple[str, int | str | None]],
    prompts: list[list[int]],
    concurrency: int,
    new_tokens: int,
    bar: tqdm,
) -> list[dict]:
    """One round: a wave of all ``prompts`` for each (server URL, pin) of ``runs``, in order,
    as :func:`run_wave` returns them, interleaved group by group: the prompts in groups of
    ``concurrency``, each group run at once (a batch of ``concurrency`` requests) on every
    configuration before the next group runs on any; each configuration's wave is summed from
    its groups (replies, wall time). At concurrency 1 that is request by request. This compares
    the configurations within seconds instead of a round's minute: this machine's speed drifts
    by 10-30% over tens of seconds, and one group of each takes a few seconds (small pair,
    session 49: at concurrency 1 the 95% interval of auto over the best pinned budget shrank from
    +-6 points with whole waves to +-1.3). A group's requests start together and generate
    the same number of tokens, so its batch is ``concurrency`` until the first of them
    ends, as in a whole wave's continuous batching; what groups add is each one's tail at a
    smaller batch once the first ends (none for plain decoding, whose requests end together;
    a speculative configuration's end at different steps), where a whole wave's next request
    would have taken the slot."""
    waves = [{"replies": [], "wall": 0.0} for _ in runs]
    for start in range(0, len(prompts), concurrency):
        group = prompts[start : start + concurrency]
        for wave, (url, pin) in zip(waves, runs, strict=True):
            one = run_wave(url, group, concurrency, new_tokens, pin)
            wave["replies"] += one["replies"]
            wave["wall"] += one["wall"]
    bar.update(len(runs))
    return waves


def summarise(concurrency: int, waves: list[dict], control: dict) -> dict:
    """One table row's figures from the repeated waves of a configuration at a concurrency:
    output tokens/s over all of them (total tokens / total wall time), the pooled latencies,
    and the first wave's outputs (every repeat must give the same)."""
    replies = [reply for wave in waves for reply in wave["replies"]]
    wall = sum(wave["wall"] for wave in waves)
    generated = sum(len(reply["output_ids"]) for reply in replies)
    taus = [r["meta"].get("spec_accept_length") for r in replies]
    taus = [t for t in taus if t is not None]
    gaps = sorted(g for r in replies for g in r["gaps"])
    outputs = [[r["output_ids"] for r in wave["replies"]] for wave in waves]
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": round(generated / wall, 2),
        "wall_s": round(wall, 3),
        "repeats_tokens_per_s": [
            round(sum(len(r["output_ids"]) for r in w["replies"]) / w["wall"], 2) for w in waves
        ],
        "tau": round(statistics.mean(taus), 3) if taus else 1.0,
        "ttft_p50_ms": round(1000 * statistics.median(r["ttft"] for r in replies), 1),
        "itl_p50_ms": round(1000 * _quantile(gaps, 0.5), 2) if gaps else None,
        "itl_p99_ms": round(1000 * _quantile(gaps, 0.99), 2) if gaps else None,
        "control": control,
        "outputs": outputs[0],
        "repeats_agree": all(o == outputs[0] for o in outputs),
    }


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def warm_up(
    base_url: str, prompts: list[list[int]], new_tokens: int, pin: int | str | None = None
) -> None:
    """One unmeasured wave at the round's concurrency (``len(prompts)`` requests at once), for
    every configuration alike: a server's first steps at a batch size are not its steady
    state (under ``ddtree:auto`` they are the in-line profile of that batch-size bucket, a
    once-per-server cost that would otherwise land in a short round; an auto variant pinned in
    a server, ``SERVER/auto:...``, profiles too)."""
    run_wave(base_url, prompts, len(prompts), new_tokens, pin)


def freeze_gc(base_url: str) -> None:
    """SGLang's ``/freeze_gc`` (what its own warning advises after warm-up requests): the
    server's processes move every object alive now out of the garbage collector's scans. Without
    it a full collection of the scheduler's ~670k objects took 0.52 s every ~1.5 min of the
    benchmark (``--gc-warning-threshold-secs``, small pair on this CPU), landing on whichever
    wave ran then: twice on the same auto wave at concurrency 8, at ~0.62x its other waves."""
    request = urllib.request.Request(f"{base_url}/freeze_gc", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60):
        pass


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` configurations for successive rounds, balanced for the one before
    (a Williams design): each order runs every configuration once, and over the orders every
    configuration runs right after every other one equally often (once for even ``n``, twice
    for odd ``n``, whose orders come with their reverses: ``2 n`` of them). A rotated fixed
    order puts each configuration after the same one in nearly every round (an auto server's
    wave after the chain's, another process, where its pinned budgets follow its own), so a
    cost of following another server would fall on one configuration alone."""
    first = [(k + 1) // 2 if k % 2 else (n - k // 2) % n for k in range(n)]  # 0, 1, n-1, 2, ...
    orders = [[(c + shift) % n for c in first] for shift in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders


def measure(
    args: argparse.Namespace, configs: list[str], prompts: list[list[int]], logs: Path
) -> dict[str, list]:
    """The ``configs``' servers up at once (idle ones asleep; a pinned ``SERVER/N`` runs in
    SERVER's), then per concurrency: a warm-up wave on each server (its garbage collector
    frozen after it), and ``--repeats``
    measured waves per configuration, interleaved (each round in the next of
    :func:`balanced_orders`, group by group, :func:`run_round`) so that
    drifts of this machine's speed, and the wave before each, fall on every configuration
    alike. Returns each
    configuration's rows, one per concurrency."""
    pins = {config: pin_of(config, auto_budgets(args)) for config in configs}
    servers: dict[str, tuple[Any, str]] = {}
    try:
        for server in dict.fromkeys(map(server_of, configs)):
            port = free_port()
            log = logs / f"{server.replace(':', '_')}.log"
            pinned = any(server_of(c) == server and pins[c] is not None for c in configs)
            env = {PIN_ENV_FLAG: "1"} if pinned else None
            process = launch(server_command(args, server, port), log, plugins="ddtree", env=env)
            servers[server] = (process, f"http://127.0.0.1:{port}")
            wait_until_healthy(servers[server][1], process, log)
        results: dict[str, list] = {config: [] for config in configs}
        total = len(configs) * len(args.concurrency) * args.repeats
        with tqdm(total=total, desc="rounds", unit="round", file=sys.stdout) as bar:
            for c in args.concurrency:
                before = {}
                for server, (_, url) in servers.items():
                    warm_up(url, prompts[:c], args.new_tokens)
                    for config in configs:  # its auto variants: their own profiles
                        if server_of(config) == server and isinstance(pins[config], str):
                            warm_up(url, prompts[:c], args.new_tokens, pins[config])
                    freeze_gc(url)
                    before[server] = ddtree_metrics(url)
                waves: dict[str, list] = {config: [] for config in configs}
                orders = balanced_orders(len(configs))
                for repeat in range(args.repeats):
                    order = [configs[i] for i in orders[repeat % len(orders)]]
                    runs = [(servers[server_of(config)][1], pins[config]) for config in order]
                    bar.set_postfix_str(f"conc {c} round {repeat + 1}")
                    for config, wave in zip(
                        order, run_round(runs, prompts, c, args.new_tokens, bar), strict=True
                    ):
                        waves[config].append(wave)
                for config in configs:  # a server's metrics are its own controller's steps
                    server = server_of(config)
                    after = ddtree_metrics(servers[server][1]) if pins[config] is None else {}
                    control = control_summary(before[server] if after else {}, after)
                    results[config].append(summarise(c, waves[config], control))
        return results
    finally:
        stop(*(process for process, _ in servers.values()))


def table_rows(results: dict[str, list]) -> list[dict]:
    """One row per (configuration, concurrency), with the ratio and mismatches against none."""
    reference = results.get("none")
    rows = []
    for config, rounds in results.items():
        for i, r in enumerate(rounds):
            base = reference[i] if reference else None
            rows.append(
                {k: v for k, v in r.items() if k != "outputs"}
                | {
                    "config": config,
                    "speedup_vs_none": (
                        round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
                        if base
                        else None
                    ),
                    "mismatched_outputs": (
                        sum(a != b for a, b in zip(r["outputs"], base["outputs"], strict=True))
                        if base
                        else None
                    ),
                }
            )
    return rows


def paired_ratio(a: dict, b: dict) -> dict:
    """Row ``a``'s tok/s over row ``b``'s (the same concurrency of one run), with the per-wave
    ratios (wave i of every configuration ran in the same interleaved round): their spread is
    what one run can resolve, and the 95% interval of the ratio is read from it (the ratio
    times exp(+-1.96 sd / sqrt(waves)) of the per-wave log ratios; None with one wave). A
    server's own persistent offset is not in that interval (:func:`replica_spread`)."""
    waves = [
        x / y for x, y in zip(a["repeats_tokens_per_s"], b["repeats_tokens_per_s"], strict=True)
    ]
    ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"]
    interval = None
    if len(waves) > 1:
        half = 1.96 * statistics.stdev(map(math.log, waves)) / math.sqrt(len(waves))
        interval = [ratio * math.exp(-half), ratio * math.exp(half)]
    return {
        "ratio": ratio,
        "ratio_interval": interval,
        "wave_median": statistics.median(waves),
        "wave_min": min(waves),
        "wave_max": max(waves),
    }


def auto_vs_best_fixed(rows: list[dict]) -> list[dict]:
    """Per concurrency that ran ``ddtree:auto`` (and each replica ``ddtree:auto@N``) and fixed
    ``ddtree:N`` budgets (not their replicas): the best fixed budget (by tok/s) and auto's
    tok/s over it (:func:`paired_ratio`). The best of several fixed figures is itself the
    luckiest of them, so a ratio to it reads low by about one wave-spread over sqrt(waves)
    when the budgets are close, and by the servers' own offsets (:func:`replica_spread`)."""
    summary = []
    for conc in sorted({r["concurrency"] for r in rows}):
        at = {r["config"]: r for r in rows if r["concurrency"] == conc}
        fixed = [c for c in at if c.startswith("ddtree:") and c.removeprefix("ddtree:").isdigit()]
        autos = [c for c in at if base_config(c) == "ddtree:auto"]
        if not autos or not fixed:
            continue
        best = max(fixed, key=lambda c: at[c]["output_tokens_per_s"])
        for auto in autos:
            summary.append(
                {"concurrency": conc, "auto": auto, "best_fixed": best}
                | paired_ratio(at[auto], at[best])
            )
    return summary


def auto_vs_own_fixed(rows: list[dict]) -> list[dict]:
    """Per concurrency and auto server ``SERVER`` whose budgets ran pinned (``SERVER/N``): the
    best of them (by tok/s) and SERVER's auto, and each auto variant pinned in it
    (``SERVER/auto:...``), over it (:func:`paired_ratio`): one server process, so no server
    offset between them; what is left of the best-of-several bias is the waves' noise."""
    summary = []
    for conc in sorted({r["concurrency"] for r in rows}):
        at = {r["config"]: r for r in rows if r["concurrency"] == conc}
        for server in at:
            pinned = [c for c in at if c != server and server_of(c) == server]
            own = [c for c in pinned if c.split(PIN, 1)[1].isdigit()]
            if not own:
                continue
            best = max(own, key=lambda c: at[c]["output_tokens_per_s"])
            for auto in [server, *(c for c in pinned if c not in own)]:
                summary.append(
                    {"concurrency": conc, "auto": auto, "best_fixed": best}
                    | paired_ratio(at[auto], at[best])
                )
    return summary


def replica_spread(rows: list[dict]) -> list[dict]:
    """Per concurrency and replica ``CONFIG@N``: its tok/s over ``CONFIG``'s
    (:func:`paired_ratio`), a control: the two run the same command, so what sets them apart
    is the server processes themselves (on this CPU up to ~3% for a whole run) and the waves'
    noise. A ratio between configurations within that spread of 1 is not resolved by the run."""
    summary = []
    for conc in sorted({r["concurrency"] for r in rows}):
        at = {r["config"]: r for r in rows if r["concurrency"] == conc}
        for replica in at:
            original = base_config(replica)
            if replica != original and original in at:
                summary.append(
                    {"concurrency": conc, "replica": replica, "original": original}
                    | paired_ratio(at[replica], at[original])
                )
    return summary


def markdown(rows: list[dict], env: dict) -> str:
    """The table people read: one line per configuration and concurrency."""
    lines = [
        f"Output tokens/s through a real SGLang {env.get('sglang', '')} server on "
        f"{env['device']} ({env['target']}); greedy, {env['prompts']} prompts of "
        f"{env['prompt_tokens']} tokens, {env['new_tokens']} new tokens each, "
        f"{env.get('repeats', 1)} measured wave(s) per configuration and concurrency, "
        "interleaved across configurations (balanced orders, group by group: "
        "`concurrency` requests at once on each), tok/s over all of them. `x none`: ratio "
        "to no speculation in the same run; `mismatch`: outputs differing from no "
        "speculation's; budgets: decode steps per budget (DDTREE metrics); pred/obs: mean "
        "predicted vs observed accept length over the calibrated request-steps, +- the 95% "
        "interval of their gap (n: verified request-steps); C err: latency "
        "model's mean |step-time error| per step (and its predicted / measured total time "
        "over the round).",
        "",
        f"Command: `{env['command']}` (code {env.get('code', 'unknown')})",
        "",
        "| config | conc | tok/s | x none | tau | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
        "| mismatch | budgets | pred/obs | C err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in rows:
        c = r["control"]
        ratio = f"{r['speedup_vs_none']:.2f}x" if r["speedup_vs_none"] else "-"
        pred_obs = (
            f"{c['predicted_accept']:.2f}/{c['observed_accept']:.2f}"
            + (f" +-{1.96 * se:.2f}" if (se := c.get("accept_gap_stderr")) is not None else "")
            + f" (n {c['verified_requests']})"  # (results before v25: no interval)
            if c["predicted_accept"] is not None
            else "-"
        )
        err = f"{100 * c['step_time_error']:.0f}%" if c["step_time_error"] is not None else "-"
        if c.get("step_time_predicted_over_measured") is not None:  # (results before v17: none)
            err += f" ({c['step_time_predicted_over_measured']:.2f})"
        budgets = " ".join(f"{b}:{n}" for b, n in c["budget_steps"].items()) or "-"
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | {ratio} "
            f"| {r['tau']:.2f} | {r['ttft_p50_ms']:.0f} | {r['itl_p50_ms']} | {r['itl_p99_ms']} "
            f"| {r['mismatched_outputs'] if r['mismatched_outputs'] is not None else '-'} "
            f"| {budgets} | {pred_obs} | {err} |"
        )
    versus = auto_vs_best_fixed(rows)
    if versus:
        lines += [
            "",
            "Auto against the best fixed budget of each concurrency (per wave: auto's wave over "
            "the best fixed budget's wave of the same round):",
            "",
            "| conc | auto | best fixed | auto / best | 95% interval | per-wave median "
            "| per-wave range |",
            "|---:|---|---|---:|---|---:|---|",
        ]
        lines += [
            f"| {v['concurrency']} | {v['auto']} | {v['best_fixed']} | {_ratio_cells(v)}"
            for v in versus
        ]
    own = auto_vs_own_fixed(rows)
    if own:
        lines += [
            "",
            "Auto against the best of its own server's budgets (`SERVER/N`: budget N pinned in "
            "the auto server's steps; one server process, so no server offset between them):",
            "",
            "| conc | auto | best own fixed | auto / best | 95% interval | per-wave median "
            "| per-wave range |",
            "|---:|---|---|---:|---|---:|---|",
        ]
        lines += [
            f"| {v['concurrency']} | {v['auto']} | {v['best_fixed']} | {_ratio_cells(v)}"
            for v in own
        ]
    spread = replica_spread(rows)
    if spread:
        lines += [
            "",
            "Identical servers (a replica `CONFIG@N` runs CONFIG's command in a server of its "
            "own): their ratio is what the servers themselves move a ratio by in this run; a "
            "ratio between configurations within this spread of 1 is not resolved by it.",
            "",
            "| conc | replica | replica / original | 95% interval | per-wave median "
            "| per-wave range |",
            "|---:|---|---:|---|---:|---|",
        ]
        lines += [f"| {v['concurrency']} | {v['replica']} | {_ratio_cells(v)}" for v in spread]
    return "\n".join(lines) + "\n"


def _ratio_cells(v: dict) -> str:
    """A :func:`paired_ratio`'s table cells: ratio, interval, per-wave median and range."""
    low_high = v["ratio_interval"]
    interval = f"{low_high[0]:.3f}-{low_high[1]:.3f}" if low_high else "-"
    return (
        f"{v['ratio']:.3f} | {interval} | {v['wave_median']:.3f} | "
        f"{v['wave_min']:.2f}-{v['wave_max']:.2f} |"
    )


def plot(rows: list[dict], path: Path) -> None:
    """Throughput against concurrency per configuration, and auto's chosen budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        left.plot(
            [r["concurrency"] for r in mine],
            [r["output_tokens_per_s"] for r in mine],
            marker="o",
            label=config,
            linewidth=2.5 if "auto" in config else 1.2,
        )
    left.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    levels = sorted({r["concurrency"] for r in rows})
    left.set_xticks(levels, [str(c) for c in levels])
    left.legend()
    auto = [r for r in rows if r["config"] == next((c for c in configs if "auto" in c), None)]
    budgets = sorted({b for r in auto for b in r["control"]["budget_steps"]})
    bottom = [0.0] * len(auto)
    for budget in budgets:
        shares = [
            r["control"]["budget_steps"].get(budget, 0)
            / max(sum(r["control"]["budget_steps"].values()), 1)
            for r in auto
        ]
        right.bar(range(len(auto)), shares, bottom=bottom, label=f"budget {budget}")
        bottom = [a + b for a, b in zip(bottom, shares, strict=True)]
    right.set_xticks(range(len(auto)), [str(r["concurrency"]) for r in auto])
    right.set(
        xlabel="concurrency", ylabel="share of decode steps",
        title=f"budgets chosen by {auto[0]['config'] if auto else 'auto (not run)'}",
    )  # fmt: skip
    if auto:
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=SMALL_PAIR_DIR / "target")
    parser.add_argument("--drafter", type=Path, default=SMALL_PAIR_DIR / "drafter")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--auto-max-budget", type=int, default=32, help="ddtree:auto's largest")
    parser.add_argument(
        "--auto-candidates",
        default=None,
        help="ddtree:auto's candidate budgets, e.g. 0,1,2,4,8 (default: the server's)",
    )
    parser.add_argument(
        "--token-map",
        type=Path,
        default=None,
        help="the DDTREE servers' --speculative-token-map (the draft vocabulary)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=DEFAULT_CONCURRENCY)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="torch_native")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured waves per configuration and concurrency"
    )
    parser.add_argument(
        "--logs", type=Path, default=None, help="the servers' logs here (default: a temp folder)"
    )
    parser.add_argument(
        "--random-drafter",
        action="store_true",
        help="replace the drafter's weights by random ones (a drafter that is no use)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="none / chain / ddtree:auto, 16 prompts, 32 tokens"
    )
    argv = sys.argv[1:] if argv is None else argv
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = heldout_prompts(args.prompts)
    prompts = [tokenizer.encode(t, add_special_tokens=False)[-args.prompt_tokens :] for t in texts]
    if args.logs is None:
        logs = Path(tempfile.mkdtemp(prefix="serve-throughput-"))
    else:
        logs = args.logs.resolve()
        logs.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {logs}", flush=True)
    env = environment(args.device, args.dtype)  # the commit and the load as the run starts
    if args.random_drafter:
        args.drafter = random_drafter(args.drafter, logs / "random-drafter")
    if args.device == "cpu":
        results = measure(args, args.configs, prompts, logs)
    else:  # a GPU holds one server's weights and KV pool at a time (its pins with it)
        results = {}
        for server in dict.fromkeys(map(server_of, args.configs)):
            mine = [c for c in args.configs if server_of(c) == server]
            try:
                results |= measure(args, mine, prompts, logs)
            except Exception as error:  # one broken server must not lose the rest
                print(f"{server}: FAILED, left out of the table: {error}", flush=True)
                continue
            for config in mine:  # as it goes: a run cut short still shows these
                for row in results[config]:
                    print(f"{config} c{row['concurrency']}: {row['output_tokens_per_s']} tok/s",
                          flush=True)  # fmt: skip
    rows = table_rows(results)
    env |= {
        "target": str(args.target),
        "drafter": "random weights" if args.random_drafter else str(args.drafter),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "attention_backend": args.attention_backend,
        "command": command_line("benchmarks/serve_throughput.py", argv),
    }
    try:
        import sglang

        env["sglang"] = sglang.__version__
    except ImportError:
        pass
    record = {"env": env, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = portable_record(record)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    table = markdown(rows, env)
    args.out.with_suffix(".md").write_text(portable(table))
    plot(rows, args.out.with_suffix(".png"))
    print(table)
    print(f"wrote {args.out} (+ .md, .png)")
    return record


if __name__ == "__main__":
    exit_on_sigterm()  # a killed run stops its servers too
    main()
