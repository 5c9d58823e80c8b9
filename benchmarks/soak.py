"""Soak benchmark (issue 19): a DDTREE server under sustained mixed load with aborts.

One DDTREE server (SGLang's own launcher, ``--enable-metrics``) is sent ``--requests``
streamed requests at ``--concurrency`` in flight, drawn from a seeded plan:

* kinds: greedy (some with ``return_logprob``), greedy with a stop string, greedy with
  penalties (frequency / presence / repetition, ``min_new_tokens``), seeded sampling
  (``sampling_seed``, temperature, top-k / top-p, some with penalties);
* prompt lengths and ``max_new_tokens`` drawn per request (held-out prompts of the small pair);
* ``--abort-fraction`` of the requests aborted at a random streamed chunk: half by closing the
  connection, half by SGLang's ``/abort_request`` with the request's ``rid``.

Checks, all counted in the record:

* lost: a request that is not aborted must end with ``finish_reason`` length or stop and
  ``completion_tokens`` equal to its streamed ids; an ``/abort_request`` one must end (aborted
  or finished); no client error or time-out;
* mismatches: every greedy request (aborted ones included) is replayed on a no-speculation
  server (``--disable-overlap-schedule``: SGLang's overlap scheduler lags penalties by one
  token, see tests/test_sglang_ddtree_params.py); a completed output must equal the replay's
  token for token (finish reason too), an aborted one must be a prefix of it. Every seeded
  request is replayed on the same DDTREE server after the soak, in reverse order (other batch
  mates, other budgets): DDTREE's seeded sampling reproduces itself;
* KV pool: ``num_used_tokens`` of SGLang's load snapshot (``/v1/loads``: pool size minus free
  minus the radix cache's evictable; the scheduler republishes it whenever it goes idle, where
  the ``/metrics`` gauge may keep a busy value for up to 30 s) once idle, before and after the
  soak, and its peak during the soak; ``num_running_reqs`` / ``num_waiting_reqs`` back to 0;
* resident memory of each server process (psutil) before and after the soak;
* the server log: no ``Traceback``, ``ERROR``, or SGLang's idle ``memory leak detected`` /
  ``double free`` warnings.

    python benchmarks/soak.py                              # 1000 requests, concurrency 16
    python benchmarks/soak.py --requests 60 --concurrency 8 --out /tmp/soak.json

Writes the JSON record and a markdown summary (``.md``) next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import command_line, environment, portable, portable_record
from serve_throughput import _cumulative
from serve_throughput import server_command as throughput_server_command
from tqdm import tqdm

from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts
from sglang_tree_spec.server_process import (
    exit_on_sigterm,
    free_port,
    http_json,
    launch,
    stop,
    wait_until_healthy,
)

DEFAULT_OUT = Path(__file__).parent / "results" / "soak_cpu.json"
KINDS = {"greedy": 0.35, "stop": 0.15, "penalty": 0.25, "seeded": 0.25}
STOP_STRINGS = [")\n", "return", ":\n", "self.", "\n\n", " = "]
LOG_PROBLEMS = re.compile(r"Traceback|\bERROR\b|leak detected|double free|use-after-free")
REQUEST_TIMEOUT_S = 900


def plan(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    """The seeded list of requests (see the module docstring)."""
    rng = random.Random(args.seed)
    aborted = set(rng.sample(range(args.requests), round(args.abort_fraction * args.requests)))
    items: list[dict] = []
    abort_count = 0
    for i in range(args.requests):
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        prompt = prompts[i % len(prompts)]
        length = rng.randint(args.min_prompt_tokens, args.max_prompt_tokens)
        params: dict[str, Any] = {
            "temperature": 0.0,
            "max_new_tokens": rng.randint(args.min_new_tokens, args.max_new_tokens),
        }
        extra: dict[str, Any] = {}
        if kind == "greedy" and rng.random() < 0.2:
            extra = {"return_logprob": True, "top_logprobs_num": 2}
        if kind == "stop":
            params["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
        if kind in ("penalty", "seeded"):
            penalties = {
                "frequency_penalty": round(rng.uniform(0.1, 1.0), 2),
                "presence_penalty": round(rng.uniform(0.1, 1.0), 2),
                "repetition_penalty": round(rng.uniform(1.05, 1.6), 2),
            }
            chosen = rng.sample(list(penalties), rng.randint(1 if kind == "penalty" else 0, 3))
            params |= {k: penalties[k] for k in chosen}
            if kind == "penalty" and rng.random() < 0.3:
                params["min_new_tokens"] = rng.randint(1, params["max_new_tokens"])
        if kind == "seeded":
            params |= {
                "temperature": round(rng.uniform(0.5, 1.2), 2),
                "top_k": rng.choice([-1, 5, 20]),
                "top_p": rng.choice([1.0, 0.9, 0.7]),
                "sampling_seed": rng.randint(0, 2**31 - 1),
            }
        abort = None
        if i in aborted:
            abort_count += 1
            abort = {
                "after_chunks": rng.randint(1, max(1, params["max_new_tokens"] // 2)),
                "how": "close" if abort_count % 2 else "abort_request",
            }
        items.append(
            {
                "index": i,
                # fixed width: SGLang's /abort_request aborts every rid that it prefixes
                "rid": f"soak-{args.seed}-{i:07d}",
                "kind": kind,
                "payload": {"input_ids": prompt[-length:], "sampling_params": params, **extra},
                "abort": abort,
            }
        )
    return items


def stream_request(base_url: str, item: dict) -> dict:
    """Stream one planned request; abort it after its chunk count if planned so."""
    body = {**item["payload"], "stream": True, "rid": item["rid"]}
    request = urllib.request.Request(
        f"{base_url}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    abort = item["abort"]
    output_ids: list[int] = []
    meta: dict = {}
    chunks = 0
    result: dict[str, Any] = {"index": item["index"], "error": None, "closed": False}
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                if "error" in chunk:
                    result["error"] = str(chunk["error"])
                    break
                chunks += 1
                output_ids = _cumulative(output_ids, chunk.get("output_ids", []), chunk)
                meta = chunk.get("meta_info", meta)
                if abort and chunks == abort["after_chunks"] and not meta.get("finish_reason"):
                    if abort["how"] == "close":
                        result["closed"] = True
                        break  # leaving the ``with`` closes the connection mid-stream
                    http_json(f"{base_url}/abort_request", {"rid": item["rid"]}, timeout=60)
    except Exception as error:  # every failure is a lost request, recorded
        result["error"] = f"{type(error).__name__}: {error}"
    finish = meta.get("finish_reason") or {}
    return result | {
        "output_ids": output_ids,
        "chunks": chunks,
        "finish": finish.get("type"),
        "completion_tokens": meta.get("completion_tokens"),
    }


def is_lost(item: dict, result: dict) -> bool:
    """A request the server did not see through (see the module docstring)."""
    if result["error"] is not None:
        return True
    if result["closed"]:
        return False
    if item["abort"] is None and result["finish"] not in ("length", "stop"):
        return True
    if result["finish"] is None:
        return True
    return result["finish"] != "abort" and result["completion_tokens"] != len(result["output_ids"])


def replay(base_url: str, items: list[dict], concurrency: int, bar: tqdm) -> dict[int, dict]:
    """``items`` again, not streamed, not aborted: index -> output ids and finish reason."""

    def one(item: dict) -> tuple[int, dict]:
        reply = http_json(f"{base_url}/generate", item["payload"], timeout=REQUEST_TIMEOUT_S)
        bar.update(1)
        return item["index"], {
            "output_ids": reply["output_ids"],
            "finish": reply["meta_info"]["finish_reason"]["type"],
        }

    with ThreadPoolExecutor(concurrency) as pool:
        return dict(pool.map(one, items))


def compare(
    results: list[dict], reference: dict[int, dict], keep_stop_at_length: bool = True
) -> list[dict]:
    """Completed outputs equal to the reference's, aborted ones a prefix of it. With
    ``keep_stop_at_length`` False, an output that finished ``length`` where the reference
    stopped on its stop string, the reference its prefix, is left out (see ``stop_at_length``
    in :func:`summarise`)."""
    mismatches = []
    for result in results:
        want = reference.get(result["index"])
        if want is None or result["error"] is not None:
            continue
        got = result["output_ids"]
        partial = result["closed"] or result["finish"] == "abort"
        # An aborted request ends with its last step's whole accepted run: SGLang's
        # ``update_finish_state`` takes the abort before the length and stop checks, so a
        # partial output may run past the reference's end; the common part must agree.
        common = min(len(got), len(want["output_ids"]))
        same = (
            got[:common] == want["output_ids"][:common]
            if partial
            else (got, result["finish"]) == (want["output_ids"], want["finish"])
        )
        stop_at_length = (result["finish"], want["finish"]) == ("length", "stop") and (
            got[: len(want["output_ids"])] == want["output_ids"]
        )
        if not same and not (stop_at_length and not keep_stop_at_length):
            mismatches.append(
                {
                    "index": result["index"],
                    "partial": partial,
                    "got": got,
                    "want": want["output_ids"],
                    "finish": [result["finish"], want["finish"]],
                }
            )
    return mismatches


def past_the_end(results: list[dict], reference: dict[int, dict]) -> list[int]:
    """Aborted requests whose partial output is longer than the completed reference."""
    return [
        r["index"]
        for r in results
        if r["index"] in reference
        and r["finish"] == "abort"
        and len(r["output_ids"]) > len(reference[r["index"]]["output_ids"])
    ]


def read_load(base_url: str) -> dict[str, float]:
    """The scheduler's load snapshot (``/v1/loads``, rank 0): used KV tokens and requests."""
    wanted = ("num_used_tokens", "token_usage", "num_running_reqs", "num_waiting_reqs")
    with urllib.request.urlopen(f"{base_url}/v1/loads?include=core", timeout=60) as reply:
        load = json.loads(reply.read())["loads"][0]
    return {key: float(load.get(key, 0)) for key in wanted}


def idle_state(base_url: str, timeout_s: float = 90.0) -> dict[str, float]:
    """The load once the server is idle: no running or waiting request, and the same values
    on two reads two seconds apart."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        state = read_load(base_url)
        idle = state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
        if (idle and state == previous) or time.monotonic() > deadline:
            return state | {"settled": bool(idle and state == previous)}
        previous = state if idle else None
        time.sleep(2)


class PeakWatcher:
    """Samples the load every second during the soak: the peaks show the pool was used."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.peak = base_url, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                state = read_load(self.base_url)
            except OSError:
                continue
            for key, value in state.items():
                self.peak[key] = max(self.peak.get(key, value), value)

    def __enter__(self) -> PeakWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def resident_memory(pid: int) -> dict[str, float]:
    """RSS in MiB of the launcher and each of its child processes (scheduler, detokenizer)."""
    import psutil

    root = psutil.Process(pid)
    memory = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            memory[f"{name}[{process.pid}]"] = round(process.memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            continue
    return memory


def log_problems(log: Path) -> list[str]:
    return [
        line for line in log.read_text(errors="replace").splitlines() if LOG_PROBLEMS.search(line)
    ]


class RunningServer:
    """A server of one configuration (``serve_throughput``'s command), started and stopped."""

    def __init__(self, args: argparse.Namespace, config: str, log: Path, extra: list[str]) -> None:
        port = free_port()
        # serve_throughput's command reads ``concurrency`` as its list of levels.
        levels = argparse.Namespace(**{**vars(args), "concurrency": [args.concurrency]})
        command = throughput_server_command(levels, config, port)
        self.command = [*command, "--sleep-on-idle", *extra]
        self.base_url, self.log = f"http://127.0.0.1:{port}", log
        self.process = launch(self.command, log, plugins="ddtree")

    def __enter__(self) -> RunningServer:
        try:
            wait_until_healthy(self.base_url, self.process, self.log)
        except BaseException:
            stop(self.process)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.process)


def soak(args: argparse.Namespace, items: list[dict], log: Path) -> dict:
    """The soak on the DDTREE server, then the seeded replay there."""
    with RunningServer(args, args.config, log, []) as server:
        warm = [dict(item, abort=None) for item in items[:2]]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda item: stream_request(server.base_url, item), warm))
        before = idle_state(server.base_url)
        memory_before = resident_memory(server.process.pid)
        start = time.perf_counter()
        with (
            PeakWatcher(server.base_url) as watcher,
            tqdm(total=len(items), desc=f"soak {args.config}", unit="req", file=sys.stdout) as bar,
            ThreadPoolExecutor(args.concurrency) as pool,
        ):

            def one(item: dict) -> dict:
                result = stream_request(server.base_url, item)
                bar.update(1)
                return result

            results = list(pool.map(one, items))
        wall = time.perf_counter() - start
        after = idle_state(server.base_url)
        memory_after = resident_memory(server.process.pid)
        seeded = [item for item in items if item["kind"] == "seeded"][::-1]
        with tqdm(total=len(seeded), desc="seeded replay", unit="req", file=sys.stdout) as bar:
            rerun = replay(server.base_url, seeded, args.concurrency, bar)
        final = idle_state(server.base_url)
    return {
        "results": results,
        "wall_s": round(wall, 1),
        "kv_before": before,
        "kv_peak": watcher.peak,
        "kv_after": after,
        "kv_after_replay": final,
        "rss_mib_before": memory_before,
        "rss_mib_after": memory_after,
        "seeded_replay": rerun,
        "log_problems": log_problems(log),
    }


def baseline(args: argparse.Namespace, items: list[dict], log: Path) -> dict:
    """Every greedy request on a synchronous no-speculation server: the unpenalised ones at
    the soak's concurrency, the penalised ones one at a time. (Seen on 0.5.17: a penalised
    greedy request replayed among 7 others came out different from the same server's answer
    alone, which equals DDTREE's and the target's own penalised argmax.)"""
    greedy = [item for item in items if item["kind"] != "seeded"]
    penalised = [item for item in greedy if item["kind"] == "penalty"]
    plain = [item for item in greedy if item["kind"] != "penalty"]
    with RunningServer(args, "none", log, ["--disable-overlap-schedule"]) as server:
        with tqdm(total=len(greedy), desc="no-spec replay", unit="req", file=sys.stdout) as bar:
            outputs = replay(server.base_url, plain, args.concurrency, bar)
            outputs |= replay(server.base_url, penalised, 1, bar)
        return {"outputs": outputs, "log_problems": log_problems(log)}


def summarise(items: list[dict], run: dict, reference: dict) -> dict:
    results = run["results"]
    by_index = {item["index"]: item for item in items}
    lost = [r["index"] for r in results if is_lost(by_index[r["index"]], r)]
    greedy = [r for r in results if by_index[r["index"]]["kind"] != "seeded"]
    greedy_mismatch = compare(greedy, reference["outputs"], keep_stop_at_length=False)
    # SGLang's ``Req.update_finish_state`` tests the length before the stop strings: a step
    # that accepts several tokens and reaches ``max_new_tokens`` finishes ``length`` even when
    # a stop string completed inside it (one-token decoding stops there first). Counted apart.
    stop_at_length = [
        m["index"]
        for m in compare(greedy, reference["outputs"])
        if m["finish"] == ["length", "stop"] and m["got"][: len(m["want"])] == m["want"]
    ]
    # A seeded request's first token is the prefill's, drawn by SGLang's own sampler, which
    # ignores ``sampling_seed`` without ``--enable-deterministic-inference``; DDTREE draws the
    # rest with coins keyed by seed and position. So the replay must agree wherever its first
    # token does; the others are counted apart.
    seeded = [r for r in results if by_index[r["index"]]["kind"] == "seeded"]
    first_differs = [
        r["index"]
        for r in seeded
        if r["output_ids"][:1] != run["seeded_replay"][r["index"]]["output_ids"][:1]
    ]
    seeded_mismatch = compare(
        [r for r in seeded if r["index"] not in first_differs], run["seeded_replay"]
    )
    kinds: dict[str, dict[str, int]] = {}
    for r in results:
        row = kinds.setdefault(by_index[r["index"]]["kind"], {"requests": 0, "completed": 0})
        row["requests"] += 1
        row["completed"] += int(r["finish"] in ("length", "stop") and not r["closed"])
    aborts = [(by_index[r["index"]]["abort"], r) for r in results if by_index[r["index"]]["abort"]]
    used_before = run["kv_before"].get("num_used_tokens")
    used_after = run["kv_after"].get("num_used_tokens")
    return {
        "requests": len(results),
        "kinds": kinds,
        "aborts": {
            "planned": len(aborts),
            "closed_mid_stream": sum(r["closed"] for _, r in aborts),
            "abort_request_ended_abort": sum(r["finish"] == "abort" for _, r in aborts),
            "finished_before_abort": sum(
                r["finish"] in ("length", "stop") and not r["closed"] for _, r in aborts
            ),
        },
        "generated_tokens": sum(len(r["output_ids"]) for r in results),
        "lost": lost,
        "errors": [r["error"] for r in results if r["error"]][:20],
        "greedy_compared": sum(r["index"] in reference["outputs"] for r in results),
        "greedy_mismatches": greedy_mismatch,
        "aborted_past_reference_end": past_the_end(
            results, {**reference["outputs"], **run["seeded_replay"]}
        ),
        "stop_string_missed_at_length": stop_at_length,
        "seeded_compared": len(seeded) - len(first_differs),
        "seeded_first_token_differs": first_differs,
        "seeded_mismatches": seeded_mismatch,
        "kv_idle_before": used_before,
        "kv_idle_after": used_after,
        "kv_peak_used": run["kv_peak"].get("num_used_tokens"),
        "kv_back_to_idle": used_before is not None
        and used_after == used_before
        and run["kv_after"]["settled"]
        and run["kv_after_replay"].get("num_used_tokens") == used_before,
        "server_log_problems": run["log_problems"][:20],
        "baseline_log_problems": reference["log_problems"][:20],
    }


def target_alone(target: Path, item: dict) -> list[int]:
    """A penalised greedy request decoded by the target alone (transformers, float32) with
    SGLang's penalty arithmetic over the output so far: frequency and presence subtracted, then
    the repetition penalty scaling every token seen; EOS masked below ``min_new_tokens``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    params = item["payload"]["sampling_params"]
    frequency = params.get("frequency_penalty", 0.0)
    presence = params.get("presence_penalty", 0.0)
    repetition = params.get("repetition_penalty", 1.0)
    ids, out = list(item["payload"]["input_ids"]), []
    for _ in range(params["max_new_tokens"]):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel())
        counts = counts[: logits.numel()].float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(counts > 0, scaled, logits)
        if len(out) < params.get("min_new_tokens", 0) and model.config.eos_token_id is not None:
            logits[model.config.eos_token_id] = -float("inf")
        out.append(int(logits.argmax()))
    return out


def arbitrate(summary: dict, items: list[dict], target: Path) -> dict:
    """Penalised greedy mismatches decided by the target alone: where DDTREE's output is the
    target's own penalised argmax, the no-speculation server is the one that differs (seen on
    0.5.17: its penalties depend on the batch it ran in). Those are moved to
    ``penalised_no_speculation_differs``; what stays in ``greedy_mismatches`` is DDTREE's."""
    by_index = {item["index"]: item for item in items}
    kept, plain_wrong = [], []
    for m in summary["greedy_mismatches"]:
        item = by_index[m["index"]]
        penalised = item["kind"] == "penalty" and not m["partial"]
        if penalised and target_alone(target, item) == m["got"]:
            plain_wrong.append(m["index"])
        else:
            kept.append(m)
    return summary | {"greedy_mismatches": kept, "penalised_no_speculation_differs": plain_wrong}


def markdown(record: dict) -> str:
    s, env, run = record["summary"], record["env"], record["run"]
    before, after = run["rss_mib_before"], run["rss_mib_after"]
    rss_rows = [
        f"| {name} | {before[name]:.0f} | {after.get(name, float('nan')):.0f} "
        f"| {after.get(name, float('nan')) - before[name]:+.0f} |"
        for name in before
    ]
    kinds = ", ".join(
        f"{k} {v['requests']} ({v['completed']} completed)" for k, v in s["kinds"].items()
    )
    mismatch_total = (  # a stop string run past at max_new_tokens is an output difference
        len(s["greedy_mismatches"])
        + len(s["seeded_mismatches"])
        + len(s["stop_string_missed_at_length"])
    )
    return "\n".join(
        [
            f"# Soak: DDTREE ({env['config']}) on {env['device']}, SGLang {env.get('sglang', '')}",
            "",
            f"Command: `{env['command']}`",
            "",
            f"{s['requests']} streamed requests at concurrency {env['concurrency']} in "
            f"{run['wall_s']:.0f} s ({s['generated_tokens']} tokens): {kinds}. Prompts "
            f"{env['prompt_tokens']} tokens, max_new_tokens {env['new_tokens']}.",
            "",
            "| check | result |",
            "|---|---|",
            f"| lost requests | {len(s['lost'])} |",
            f"| greedy outputs vs no speculation (`--disable-overlap-schedule`) | "
            f"{len(s['greedy_mismatches'])} mismatches of {s['greedy_compared']} |",
            f"| penalised greedy outputs where the no-speculation server differs and DDTREE "
            f"equals the target alone (offline, SGLang's penalty arithmetic) "
            f"| {len(s.get('penalised_no_speculation_differs', []))} |",
            f"| greedy outputs that ran to `max_new_tokens` past a stop string completed in "
            f"their last step (SGLang tests the length first), else equal "
            f"| {len(s['stop_string_missed_at_length'])} |",
            f"| seeded outputs vs DDTREE replay (reverse order), same first token | "
            f"{len(s['seeded_mismatches'])} mismatches of {s['seeded_compared']} |",
            f"| seeded replays whose first (prefill, SGLang-sampled) token differs | "
            f"{len(s['seeded_first_token_differs'])} |",
            f"| aborted | {s['aborts']['planned']} planned: {s['aborts']['closed_mid_stream']} "
            f"connections closed mid-stream, {s['aborts']['abort_request_ended_abort']} ended "
            f"by `/abort_request`, {s['aborts']['finished_before_abort']} finished first |",
            "| KV pool used tokens (`/v1/loads` `num_used_tokens`) idle before / peak / idle after "
            f"| {s['kv_idle_before']:.0f} / {s['kv_peak_used'] or 0:.0f} / "
            f"{s['kv_idle_after']:.0f} (back to idle: {s['kv_back_to_idle']}) |",
            f"| aborted outputs longer than the completed reference (abort taken before the "
            f"length / stop checks; common part equal) | {len(s['aborted_past_reference_end'])} |",
            f"| server log Traceback / ERROR / leak lines | {len(s['server_log_problems'])} |",
            f"| all exact (0 mismatches, 0 stop strings run past, 0 lost) "
            f"| {mismatch_total == 0 and not s['lost']} |",
            "",
            "Resident memory (MiB) of the server's processes:",
            "",
            "| process | before | after | change |",
            "|---|---:|---:|---:|",
            *rss_rows,
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=SMALL_PAIR_DIR / "target")
    parser.add_argument("--drafter", type=Path, default=SMALL_PAIR_DIR / "drafter")
    parser.add_argument(
        "--config", default="ddtree:auto", help="serve_throughput's ddtree:B|auto, ddtree-graft:..."
    )
    parser.add_argument("--auto-max-budget", type=int, default=32)
    parser.add_argument("--auto-candidates", default=None, help="e.g. 0,4,8 (serve_throughput's)")
    parser.add_argument("--token-map", type=Path, default=None, help="serve_throughput's")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--abort-fraction", type=float, default=0.1)
    parser.add_argument("--min-prompt-tokens", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=160)
    parser.add_argument("--min-new-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="torch_native")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = heldout_prompts(args.requests)  # at most the 880 shipped ones, reused in turn
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    items = plan(args, prompts)
    logs = Path(tempfile.mkdtemp(prefix="soak-"))
    print(f"server logs: {logs}", flush=True)
    env = environment(args.device, args.dtype)  # the commit and the load as the run starts
    run = soak(args, items, logs / "ddtree.log")
    reference = baseline(args, items, logs / "none.log")
    summary = arbitrate(summarise(items, run, reference), items, args.target)
    env |= {
        "config": args.config,
        "concurrency": args.concurrency,
        "prompt_tokens": f"{args.min_prompt_tokens}-{args.max_prompt_tokens}",
        "new_tokens": f"{args.min_new_tokens}-{args.max_new_tokens}",
        "abort_fraction": args.abort_fraction,
        "seed": args.seed,
        "command": command_line("benchmarks/soak.py", argv),
        "logs": str(logs),
    }
    try:
        import sglang

        env["sglang"] = sglang.__version__
    except ImportError:
        pass
    record = {
        "env": env,
        "summary": summary,
        "run": {k: v for k, v in run.items() if k not in ("results", "seeded_replay")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = portable_record(record)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    raw = {"results": run["results"], "seeded_replay": run["seeded_replay"]}
    (logs / "raw.json").write_text(json.dumps(raw | {"baseline": reference["outputs"]}))
    table = markdown(record)
    args.out.with_suffix(".md").write_text(portable(table))
    print(table)
    print(f"wrote {args.out} (+ .md)")
    return record


if __name__ == "__main__":
    exit_on_sigterm()  # a killed run stops its servers too
    main()
