"""One DDTREE server at SGLang's default capture arguments: the ``defaults-8b`` step of
``launch/gpu-validate.sh``.

Writes the 8B-shaped pair (``sglang-tree-spec models shaped-pair``: random weights, made on the
device, no model hub), starts the server command given after ``--`` (the README's launch line:
no capture sizes, no ``--cuda-graph-max-bs``, no ``--max-running-requests``, no attention
backend; this script adds only the host and port), waits for health, sends a few greedy
requests at once, then stops it. Then the same target without speculation (the command less
its ``--speculative-*`` flags, eager: ``--disable-cuda-graph`` starts sooner and decodes with
the same kernels) answers the same requests with its two best log-probs per token: DDTREE's
outputs must equal them up to near-ties (bfloat16: a verify batch and a decode batch may round
differently, so an output may differ only from a position where no speculation's two best
log-probs are within ``TIE_LOGITS``, as in ``tests/test_gpu_exactness.py``).

The JSON it writes holds what start-up logged of the capture (``DDTREE capture plan: ...``, the
verify graphs' shapes, SGLang's ``Capture ... CUDA graph end`` lines with their memory), the
device memory after capture (SGLang's ``avail mem`` and nvidia-smi's used / total) and after the
requests, the comparison, and each phase's seconds. It stops each server itself before
``--within`` seconds (the step's kill would leave it running: a server is its own process group).

    python launch/default_capture_check.py --shape llama-3.1-8b --pair DIR --out FILE.json \
        --log SERVER.log --within S -- python -m sglang.launch_server --model-path DIR/target ...
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sglang_tree_spec.server_process import free_port, http_json, launch, stop  # noqa: E402

REQUESTS = 4  # sent at once: a verify of batch size > 1
NEW_TOKENS = 32
PROMPT_TOKENS = 64
PROMPT_IDS = (2, 2048)  # the small pair's tokenizer (the shaped pair's): ids past it unused
STOP_MARGIN_S = 20.0  # the server's stop (SIGTERM, then SIGKILL after 20 s) before --within
BASELINE_S = 60.0  # kept for no speculation: an eager 8B server's load and four short replies
TIE_LOGITS = 0.5  # tests/test_gpu_exactness.py BF16_TIE_LOGITS
BASELINE_FLAGS = ("--disable-cuda-graph",)
# What start-up logs of the capture, in both releases' words (0.5.23 adds bs=[...] to SGLang's).
LOG_LINES = {
    "capture_plan": re.compile(r"DDTREE capture plan: .*"),
    "verify_graphs": re.compile(r"DDTREE verify graphs \(.*"),
    "sglang_capture_end": re.compile(r"Capture [\w ]+? CUDA graph end\. .*"),
    "verify_replays": re.compile(r"DDTREE verify graph replayed: .*"),
    "eager_verifies": re.compile(r"DDTREE verify ran eagerly: .*"),
    "ddtree_errors": re.compile(r"DDTREE: .*"),
}
CAPTURE_END = re.compile(
    r"Capture (?P<name>[\w ]+?) CUDA graph end\. .*?elapsed=(?P<elapsed_s>[\d.]+) s, "
    r"mem usage=(?P<mem_usage_gb>[\d.]+) GB, avail mem=(?P<avail_gb>[\d.]+) GB"
)


def log_facts(text: str) -> dict:
    """The capture lines of a server log (each kind's lines, in order) and SGLang's capture
    memory per runner (``target verify``, ``draft decode``, ``target prefill``, ...)."""
    facts: dict = {kind: pattern.findall(text) for kind, pattern in LOG_LINES.items()}
    facts["capture_memory"] = [
        {"name": m["name"], **{k: float(m[k]) for k in ("elapsed_s", "mem_usage_gb", "avail_gb")}}
        for m in CAPTURE_END.finditer(text)
    ]
    return facts


def device_memory() -> dict | None:
    """The first GPU's used and total memory in MiB (nvidia-smi), None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return None
    used, total = (int(x) for x in lines[0].split(","))
    return {"used_mib": used, "total_mib": total}


def healthy(base_url: str, process: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(f"{base_url}/health", timeout=2).read()
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    return False


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("default_capture_check: the server command goes after --")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="launch/default_capture_check.py")
    parser.add_argument("--shape", required=True, help="models shaped-pair --shape")
    parser.add_argument("--pair", type=Path, required=True, help="the pair's folder")
    parser.add_argument("--out", type=Path, required=True, help="the results JSON")
    parser.add_argument("--log", type=Path, required=True, help="the DDTREE server's log "
                        "(no speculation's beside it, baseline.log)")  # fmt: skip
    parser.add_argument("--within", type=float, required=True, help="seconds for everything")
    server = argv[split + 1 :]
    if not server:
        raise SystemExit("default_capture_check: no server command after --")
    return parser.parse_args(argv[:split]), server


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(*PROMPT_IDS) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]


def without_speculation(command: list[str]) -> list[str]:
    """``command`` less its ``--speculative-*`` flags (each with its value), eager."""
    kept, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg.startswith("--speculative-"):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return [*kept, *BASELINE_FLAGS]


def serve(
    base_url: str, process: subprocess.Popen, deadline: float, result: dict, logprobs: bool
) -> list[dict] | str:
    """Health, the device memory after start-up, :func:`prompts` at once (greedy), the memory
    after them: the replies, or why not ("failed: ...")."""
    start = time.monotonic()
    up = healthy(base_url, process, deadline)
    result["seconds"]["start_up"] = round(time.monotonic() - start, 1)
    result["device_memory_after_capture"] = device_memory()
    if not up:
        return "failed: server exited" if process.poll() is not None else "failed: not healthy"
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    extra = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
    timeout = max(deadline - time.monotonic(), 1.0)

    def one(prompt: list[int]) -> dict:
        payload = {"input_ids": prompt, "sampling_params": params, **extra}
        return http_json(f"{base_url}/generate", payload, timeout=timeout)

    start = time.monotonic()
    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            replies = list(pool.map(one, prompts()))
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        return f"failed: requests ({error})"
    result["seconds"]["requests"] = round(time.monotonic() - start, 1)
    result["replies"] = [
        {"output_tokens": len(r["output_ids"]),
         **{k: r["meta_info"].get(k) for k in ("spec_accept_length", "spec_verify_ct")}}
        for r in replies
    ]  # fmt: skip
    result["device_memory_after_requests"] = device_memory()
    if any(r["output_tokens"] != NEW_TOKENS for r in result["replies"]):
        return "failed: short replies"
    return replies


def compare(got: list[list[int]], baseline: list[dict]) -> dict:
    """DDTREE's outputs against no speculation's: equal, or first differing at a near-tie
    (no speculation's two best log-probs there within :data:`TIE_LOGITS`)."""
    found: dict = {"equal": 0, "near_ties": [], "differs": []}
    for index, (mine, reply) in enumerate(zip(got, baseline, strict=True)):
        want = reply["output_ids"]
        if mine == want:
            found["equal"] += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(mine, want, strict=True)) if a != b)
        top = reply["meta_info"]["output_top_logprobs"][first]
        gap = float(top[0][0] - top[1][0])
        kind = "near_ties" if gap < TIE_LOGITS else "differs"
        found[kind].append({"request": index, "token": first, "top2_gap": round(gap, 4)})
    return found


def run_server(command: list[str], log: Path, deadline: float, result: dict, logprobs: bool):
    """Start ``command`` (host and port added), :func:`serve` it, stop it; the log's capture
    lines join ``result``."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    process = launch([*command, "--host", "127.0.0.1", "--port", str(port)], log,
                     plugins="ddtree")  # fmt: skip
    try:
        outcome = serve(f"http://127.0.0.1:{port}", process, deadline, result, logprobs)
    finally:
        stop(process)
    result["log"] = str(log)
    result |= log_facts(log.read_text(errors="replace"))
    return outcome


def main(argv: list[str]) -> int:
    args, server = parse_args(argv)
    deadline = time.monotonic() + args.within - STOP_MARGIN_S
    result: dict = {"server_command": server, "seconds": {}}
    start = time.monotonic()
    build = [sys.executable, "-m", "sglang_tree_spec.cli", "models", "shaped-pair",
             "--shape", args.shape, "--out", str(args.pair), "--device", "cuda"]  # fmt: skip
    try:
        code = subprocess.run(build, cwd=ROOT, check=False, timeout=deadline - start).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    result["seconds"]["weights"] = round(time.monotonic() - start, 1)
    status = f"failed: models shaped-pair exit {code}"
    if code == 0:
        status = check(args, server, deadline, result)
    shutil.rmtree(args.pair, ignore_errors=True)  # 16 GB of random weights
    result["status"] = status
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    shown = ("status", "seconds", "capture_plan", "capture_memory", "exactness")
    print(json.dumps({k: result.get(k) for k in shown}, indent=2))
    return 0 if status == "passed" else 1


def check(args: argparse.Namespace, server: list[str], deadline: float, result: dict) -> str:
    """The DDTREE server (its capture plan logged, served), then no speculation's replies and
    the comparison; the status."""
    replies = run_server(server, args.log, deadline - BASELINE_S, result, logprobs=False)
    if isinstance(replies, str):
        return replies
    if not result["capture_plan"]:
        return "failed: no DDTREE capture plan"
    baseline: dict = {"server_command": without_speculation(server), "seconds": {}}
    result["no_speculation"] = baseline
    log = args.log.with_name("baseline.log")
    want = run_server(baseline["server_command"], log, deadline, baseline, logprobs=True)
    if isinstance(want, str):
        return f"{want} (no speculation)"
    result["exactness"] = compare([r["output_ids"] for r in replies], want)
    if result["exactness"]["differs"]:
        return "failed: outputs differ from no speculation (not at a near-tie)"
    return "passed"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
