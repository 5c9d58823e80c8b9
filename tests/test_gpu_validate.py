"""``launch/gpu-validate.sh`` as far as it goes without a GPU: arguments, the plan, the results.

The dry run must print every command the GPU run would execute, keep the whole plan inside 30
minutes, state whether DDTREE keeps CUDA graphs (as the plugin itself says) and write the result
folder's skeleton (plan.json, summary.json, summary.md) with the device and versions.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tree_spec.plugin.validation import TREE_MASK_CUDA_GRAPHS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "gpu-validate.sh"
SMALL_PAIR = ROOT / "sglang_tree_spec" / "assets" / "small-pair"


def gpu_validate(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "SGLANG_TREE_SPEC_CACHE": str(cache)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


@pytest.fixture
def dry_run(tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "results"
    result = gpu_validate("--dry-run", "--out", str(out), cache=tmp_path / "empty-cache")
    assert result.returncode == 0, result.stderr
    return result, out


def test_dry_run_prints_every_command_of_the_plan(dry_run):
    result, out = dry_run
    plan = json.loads((out / "plan.json").read_text())
    names = [step["name"] for step in plan]
    assert names[-5:] == ["environment", "exactness", "tree-build", "throughput-triton", "phases"]
    # No SmolLM2 in the (empty) model cache: the committed small pair, block 8.
    small = SMALL_PAIR / "target"
    expected = [
        "-m pytest -v -rA tests/test_gpu_exactness.py",
        f"GPU_EXACTNESS_TARGET={small}",
        f"benchmarks/tree_build.py --device cuda --out {out}/tree_build_cuda.json",
        "benchmarks/serve_throughput.py --device cuda --attention-backend triton",
        "--configs none dflash ddtree:auto ddtree:auto/8 ddtree:auto/32 --auto-max-budget 32 --c",
        "--concurrency 1 2 4 8 16",
        f"--logs {out}/servers-triton --out {out}/serve_throughput_cuda_triton.json",
        "SGLANG_TREE_SPEC_STEP_TIMES=25",  # the phases step: the server logs its step times
        "--configs none ddtree:8 --concurrency 1 16 --repeats 1",
    ]
    for fragment in expected:
        assert fragment in result.stdout, fragment
    summary = json.loads((out / "summary.json").read_text())
    for step in summary["steps"]:  # each step's full command line, as it will run
        assert f"$ {step['command']}\n" in result.stdout
    assert "flashinfer skipped: head_dim 48" in result.stdout  # the small pair's head size


def test_dry_run_keeps_to_thirty_minutes_and_states_cuda_graphs(dry_run):
    result, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget_s"] <= 30 * 60
    assert summary["facts"]["tree_mask_cuda_graphs"] is TREE_MASK_CUDA_GRAPHS
    if TREE_MASK_CUDA_GRAPHS:
        assert "CUDA graphs for DDTREE: on" in result.stdout
    else:
        assert "CUDA graphs for DDTREE: OFF" in result.stdout
    assert "DDTREE auto (budget control): the throughput step's ddtree:auto rows" in result.stdout
    assert "overlap scheduling: on for every DDTREE server" in result.stdout
    exactness = next(step for step in summary["steps"] if step["name"] == "exactness")
    assert "under SGLang's overlap scheduler and (budget 32) without it" in exactness["purpose"]


def test_dry_run_writes_the_result_skeleton(dry_run):
    _, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert summary["device"]  # the GPU's name on a GPU host, else says there is none
    assert summary["versions"]["sglang"] == importlib.metadata.version("sglang")
    assert summary["versions"]["torch"] == importlib.metadata.version("torch")
    assert summary["command"].startswith("bash launch/gpu-validate.sh")
    assert {step["status"] for step in summary["steps"]} == {"planned"}
    assert all(step["command"] and step["budget_s"] > 0 for step in summary["steps"])
    table = (out / "summary.md").read_text()
    for step in summary["steps"]:
        assert f"| {step['name']} | planned |" in table


def test_dry_run_with_site_parts_plans_the_offline_install(tmp_path):
    out = tmp_path / "results"
    parts, links = tmp_path / "parts", tmp_path / "links"
    result = gpu_validate(
        "--dry-run", "--site-parts", str(parts), "--find-links", str(links), "--out", str(out),
        cache=tmp_path / "cache",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = {step["name"]: step for step in summary["steps"]}
    assert list(steps)[:3] == ["unpack-site", "install-plugin", "fetch-smollm2"]
    site = (out / "site").resolve()
    assert (
        f"cat {parts}/site-part-* | xz -dc | tar x --strip-components=1 -C {site}"
        in (steps["unpack-site"]["command"])
    )
    assert f"--target {site}" in steps["install-plugin"]["command"]
    assert steps["fetch-smollm2"]["env"]["PIP_NO_INDEX"] == "1"
    assert steps["fetch-smollm2"]["env"]["PIP_FIND_LINKS"] == str(links.resolve())
    for name in ("exactness", "tree-build", "throughput-triton", "throughput-flashinfer"):
        assert steps[name]["env"]["PYTHONPATH"] == str(site)
    # Planned for SmolLM2 (block 16, head_dim 64): both backends, budgets 16 and 64.
    flashinfer = steps["throughput-flashinfer"]["command"]
    assert "--configs none dflash ddtree:auto ddtree:auto/16 ddtree:auto/64 --auto" in flashinfer
    assert summary["budget_s"] <= 30 * 60


def test_the_fixed_budgets_are_pinned_in_the_auto_server_among_its_candidates(tmp_path):
    """The throughput table's fixed budgets run in the auto server (``ddtree:auto/N``); a
    ``--budgets SMALL`` that is not one of auto's candidates joins them (serve_throughput
    refuses a pin outside them), a default one adds nothing."""
    out = tmp_path / "results"
    result = gpu_validate("--dry-run", "--budgets", "12", "48", "--out", str(out),
                          cache=tmp_path / "cache")  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    table = steps["throughput-triton"]["command"]
    assert "--configs none dflash ddtree:auto ddtree:auto/12 ddtree:auto/48 " in table
    assert "--auto-max-budget 48 --auto-candidates 0,4,8,12,16,32,48 " in table
    assert (
        "--auto-candidates"
        not in gpu_validate(
            "--dry-run", "--budgets", "8", "48", "--out", str(out), cache=tmp_path / "cache"
        ).stdout
    )


def test_only_keeps_the_installs_and_the_steps_named(tmp_path):
    out = tmp_path / "results"
    result = gpu_validate(
        "--dry-run", "--site-parts", str(tmp_path / "parts"), "--only", "exactness",
        "throughput-triton", "--concurrency", "1", "8", "--out", str(out), cache=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = {step["name"]: step for step in json.loads((out / "plan.json").read_text())}
    assert list(steps) == ["unpack-site", "install-plugin", "exactness", "throughput-triton"]
    assert "--concurrency 1 8 --prompts" in " ".join(steps["throughput-triton"]["argv"])
    assert f"--basetemp={out.resolve() / 'exactness'}" in steps["exactness"]["argv"]


def test_the_8b_step_cost_runs_only_when_named(tmp_path):
    """``step-cost-8b`` (an 8B-shaped random pair, four 8B servers) is its own lease."""
    out = tmp_path / "results"
    result = gpu_validate("--dry-run", "--only", "step-cost-8b", "--out", str(out), cache=tmp_path)
    assert result.returncode == 0, result.stderr
    (step,) = json.loads((out / "plan.json").read_text())
    command = shlex.join(step["argv"])
    assert "models shaped-pair --shape llama-3.1-8b" in command and "--device cuda" in command
    assert "--configs none ddtree:4 ddtree:16 ddtree:64 --concurrency 1 16" in command
    assert step["budget_s"] < 600


def test_bad_arguments_exit_with_one_line(tmp_path):
    result = gpu_validate("--dry-run", "--target", "x", cache=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("--target and --drafter go together")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_a_gpu_only_the_dry_run_runs(tmp_path):
    result = gpu_validate("--out", str(tmp_path / "results"), cache=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "gpu-validate: no NVIDIA GPU (nvidia-smi found none); use --dry-run to see the plan"
    )
    assert not (tmp_path / "results").exists()


def test_environment_probe_compiles(monkeypatch):
    """The GPU run's first measuring step runs this code in the steps' environment."""
    spec = importlib.util.spec_from_file_location(
        "gpu_validate", ROOT / "launch" / "gpu_validate.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    compile(module.ENV_PROBE, "environment probe", "exec")
    assert "get_device_properties" in module.ENV_PROBE and "import pytest" in module.ENV_PROBE


def test_gpu_site_carries_what_the_h100_run_found_missing():
    """Each of these cost a failed server start on the H100 (benchmarks/results/gpu_h100_*.md)."""
    listed = subprocess.run(
        ["bash", str(ROOT / "launch" / "gpu-site.sh"), "--list"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.splitlines()  # fmt: skip
    wheels = {line.split()[1] for line in listed if line.startswith("wheel ")}
    trimmed = [line.split()[1] for line in listed if line.startswith("trim ")]
    for needed in ("sglang==0.5.17", "transformers==5.12.1", "tokenizers==0.22.2", "loguru",
                   "jsonschema", "opentelemetry-api", "ipython-pygments-lexers"):  # fmt: skip
        assert needed in wheels
    assert not any(path.startswith(("flashinfer", "tvm_ffi/lib")) for path in trimmed)


def load_launch_module(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


def test_quick_plan_fits_two_calls_of_a_fifteen_minute_lease(tmp_path, monkeypatch):
    """``--quick``: the 8B-shaped DDTREE server at SGLang's defaults, exactness at the small
    budget under overlap and the large one without (triton only, so pytest keeps one baseline
    server), no tree build, the table without the large budget; the small pair's servers
    without prefill graphs; the first run's two calls each under 10 minutes and together, with
    the machine's start, inside the lease."""
    out = tmp_path / "results"
    result = gpu_validate("--dry-run", "--quick", "--out", str(out), cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert list(steps) == ["environment", "defaults-8b", "exactness", "throughput-triton", "phases"]
    exactness, table = steps["exactness"], steps["throughput-triton"]
    quick_cases = "-k 'triton and (baseline or small-none-overlap or large-none-sync)'"
    assert quick_cases in exactness["command"]
    quick_table = "--configs none dflash ddtree:auto ddtree:auto/8 --auto-max-budget 32 --c"
    assert quick_table in table["command"]
    for step in (exactness, table):
        assert step["env"]["SGLANG_TREE_SPEC_SERVER_ARGS"] == "--disable-prefill-cuda-graph"
    module = load_launch_module("gpu_validate", monkeypatch)
    assert module.QUICK_CALLS == (("environment", "defaults-8b"), ("exactness",))
    calls = [sum(steps[name]["budget_s"] for name in call) for call in module.QUICK_CALLS]
    assert all(budget < 600 for budget in calls), calls
    assert module.LEASE_START_S + sum(calls) <= 15 * 60
    assert f"--only environment defaults-8b ({calls[0]} s); --only exactness" in result.stdout
    assert table["budget_s"] + steps["phases"]["budget_s"] < 600  # the next lease's call


def test_the_defaults_step_is_the_readme_launch_line_and_nothing_else(tmp_path, monkeypatch):
    """``defaults-8b``: the 8B-shaped pair served with DDTREE's flags only (SGLang's default
    capture sizes and prefill graphs, its default attention backend), checked against no
    speculation; in the full plan only when named."""
    out = tmp_path / "results"
    result = gpu_validate("--dry-run", "--quick", "--out", str(out), cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    (step,) = [s for s in json.loads((out / "plan.json").read_text()) if s["name"] == "defaults-8b"]
    argv = step["argv"]
    server = argv[argv.index("--") + 1 :]
    pair = str(load_launch_module("gpu_validate", monkeypatch).SHAPED_PAIR)
    check = f"launch/default_capture_check.py --shape llama-3.1-8b --pair {pair}"
    assert shlex.join(argv[1:6]) == check
    assert server[1:] == [
        "-m", "sglang.launch_server", "--model-path", f"{pair}/target",
        "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", f"{pair}/drafter",
        "--speculative-num-draft-tokens", "33",
    ]  # fmt: skip
    assert "SGLANG_TREE_SPEC_SERVER_ARGS" not in step["env"]  # prefill graphs as SGLang decides
    assert f"--within {step['budget_s']} --" in shlex.join(argv)
    full = gpu_validate("--dry-run", "--out", str(tmp_path / "full"), cache=tmp_path / "cache")
    assert "[defaults-8b]" not in full.stdout
    named = gpu_validate("--dry-run", "--only", "defaults-8b", "--out", str(tmp_path / "named"),
                         cache=tmp_path / "cache")  # fmt: skip
    assert "[defaults-8b]" in named.stdout


def test_the_defaults_check_compares_with_no_speculation_up_to_near_ties(monkeypatch):
    """``launch/default_capture_check.py``: no speculation's command is DDTREE's less its
    speculative flags (eager), outputs are equal or differ first at a near-tie of no
    speculation's two best log-probs, and the capture lines are read from both releases'
    words."""
    check = load_launch_module("default_capture_check", monkeypatch)
    ddtree = ["python", "-m", "sglang.launch_server", "--model-path", "T",
              "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", "D",
              "--speculative-num-draft-tokens=33"]  # fmt: skip
    assert check.without_speculation(ddtree) == [
        "python", "-m", "sglang.launch_server", "--model-path", "T", "--disable-cuda-graph"
    ]  # fmt: skip

    def reply(ids: list[int], gaps: list[float]) -> dict:
        top = [[(-1.0, 0, None), (-1.0 - gap, 1, None)] for gap in gaps]
        return {"output_ids": ids, "meta_info": {"output_top_logprobs": top}}

    baseline = [reply([5, 6, 7], [2.0, 2.0, 2.0]), reply([5, 6, 7], [2.0, 0.1, 2.0]),
                reply([5, 6, 7], [2.0, 0.7, 2.0])]  # fmt: skip
    found = check.compare([[5, 6, 7], [5, 9, 9], [5, 9, 7]], baseline)
    assert found == {
        "equal": 1,
        "near_ties": [{"request": 1, "token": 1, "top2_gap": 0.1}],
        "differs": [{"request": 2, "token": 1, "top2_gap": 0.7}],
    }
    log = (
        "DDTREE capture plan: 255 shapes (51 batch sizes x 5 budgets), 6.3 GiB: logits ...\n"
        "Capture target decode CUDA graph end. Time elapsed: 41.20 s. elapsed=41.2 s, "
        "mem usage=7.31 GB, avail mem=20.50 GB\n"
    )
    facts = check.log_facts(log)
    assert facts["capture_plan"] == [log.splitlines()[0]]
    assert facts["capture_memory"] == [
        {"name": "target decode", "elapsed_s": 41.2, "mem_usage_gb": 7.31, "avail_gb": 20.5}
    ]
