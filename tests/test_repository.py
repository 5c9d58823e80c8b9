"""The repository contract: the README's commands, CI and the console script agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FOLDERS = ("sglang_tree_spec", "patches", "launch", "tests", "benchmarks")
RUN_VERSION = re.compile(r"_v\d+(?![A-Za-z\d])")  # a run number in a file name
MACHINE_PATH = re.compile(rb"(?<![\w.])/(work|tmp|root|home|Users|mnt|opt)/")


def readme_commands() -> list[str]:
    """The shell commands in the README's bash code blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command_as_written():
    test_command = next(c for c in readme_commands() if "launch/run-tests.sh" in c)
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines
    script = (ROOT / "launch/run-tests.sh").read_text()
    assert ".venv/bin/ruff check ." in script
    assert ".venv/bin/python -m pytest" in script and ".venv-0.5.23/bin/python -m pytest" in script


def test_readme_run_command_is_the_serving_benchmark_and_its_arguments_parse():
    """The first command (the main job) benchmarks a real server; the demo's subcommand exists."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serve_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from sglang_tree_spec.cli import build_parser

    run_command = readme_commands()[0]
    assert "benchmarks/serve_throughput.py" in run_command
    args = serve_throughput.parse_args(run_command.split("serve_throughput.py", 1)[1].split())
    assert "ddtree:auto" in args.configs and "none" in args.configs and "chain" in args.configs
    assert args.concurrency == [1, 2, 4, 8, 16]
    demo = next(c for c in readme_commands() if "sglang-tree-spec " in c)
    argv = demo.split("sglang-tree-spec ", 1)[1].split()
    assert callable(build_parser(with_models=False).parse_args(argv).handler)


def test_tree_demo_runs_and_reports_a_tree_better_than_the_chain():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_tree_spec.cli",
            "tree-demo",
            "--budgets",
            "16",
            "64",
            "--samples",
            "500",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line[:6] in ("chain ", "ddtree")
    }
    chain_tau = float(rows["chain"][3])
    assert float(rows["ddtree-16"][3]) > chain_tau
    assert float(rows["ddtree-64"][3]) > float(rows["ddtree-16"][3])
    # The surrogate and the simulated verification agree (the simulation uses greedy_accept).
    for name in ("chain", "ddtree-16", "ddtree-64"):
        surrogate, simulated = float(rows[name][3]), float(rows[name][4])
        assert abs(surrogate - simulated) < 0.15, (name, surrogate, simulated)
    assert "(bonus)" in out


def test_cli_reports_bad_training_input_in_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_tree_spec.cli",
            "models",
            "train-drafter",
            "--target",
            str(tmp_path / "missing"),
            "--out",
            str(tmp_path / "out"),
            "--data",
            str(tmp_path / "missing.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr


def test_launch_scripts_parse_and_the_cpu_demo_launches_ddtree():
    """Every launch script is valid bash; the CPU demo passes DDTREE to SGLang's launcher."""
    for script in sorted((ROOT / "launch").glob("*.sh")):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, (script.name, result.stderr)
    demo = (ROOT / "launch" / "serve-cpu-demo.sh").read_text()
    assert "--speculative-algorithm DDTREE" in demo
    assert "sglang.launch_server" in demo


def test_setup_refuses_a_new_venv_on_a_full_disk_in_one_line(tmp_path):
    """A disk too full for torch's wheels stops setup before pip, with one line saying so
    (pip's own failure is an OSError deep in its output); nothing is created."""
    (tmp_path / "launch").mkdir()
    for name in ("setup-dev.sh", "sglang-cpu-requirements.txt"):
        (tmp_path / "launch" / name).write_text((ROOT / "launch" / name).read_text())
    shims = tmp_path / "bin"
    shims.mkdir()
    df = shims / "df"  # the disk as df reports it: 300 MB free
    df.write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available'\necho 'x 1 1 307200'\n")
    df.chmod(0o755)
    env = {"PATH": f"{shims}:/usr/local/bin:/usr/bin:/bin", "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(tmp_path / "launch" / "setup-dev.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"setup-dev: only 300 MB free under {tmp_path}; a new .venv needs about 8 GB"
    ]
    assert not (tmp_path / ".venv").exists()


def test_benchmarks_write_no_machine_paths():
    """What a benchmark writes names the checkout's files relative to it, the home folder as
    ``~`` and the temporary folder as ``<tmp>``; leaves rates, endpoints and ratios alone."""
    import tempfile

    from benchmark_helpers import load_benchmark

    common = load_benchmark("common")
    tmp = tempfile.gettempdir()
    text = (
        f'"target": "{ROOT}/sglang_tree_spec/assets/small-pair/target", '
        f"--token-map {Path.home()}/.cache/x/token_map.pt --logs {tmp}/exp/logs "
        "--drafter /work/other-checkout/drafter, cwd "
        + str(ROOT)
        + " 12.5 tok/s 0.98 / 1.01 /generate"
    )
    assert common.portable(text) == (
        '"target": "sglang_tree_spec/assets/small-pair/target", '
        "--token-map ~/.cache/x/token_map.pt --logs <tmp>/exp/logs "
        "--drafter <path>/drafter, cwd . 12.5 tok/s 0.98 / 1.01 /generate"
    )
    assert not common.MACHINE_PATH.search(common.portable(text))


def results_files() -> list[Path]:
    """The files under benchmarks/results/ that the repository keeps: all on disk but those git
    ignores (the main job's output, raw GPU validation folders)."""
    files = sorted(p for p in RESULTS.rglob("*") if p.is_file())
    try:
        ignored = subprocess.run(
            ["git", "-C", str(ROOT), "check-ignore", "--stdin"],
            input="\n".join(str(p.relative_to(ROOT)) for p in files),
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):  # no git: every file counts
        ignored = []
    return [p for p in files if str(p.relative_to(ROOT)) not in set(ignored)]


def readmes() -> list[Path]:
    return [ROOT / "README.md", *(ROOT / folder / "README.md" for folder in FOLDERS)]


def test_readme_is_for_users():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines (at most 350)"


def test_every_top_level_folder_explains_itself():
    missing = [folder for folder in FOLDERS if not (ROOT / folder / "README.md").is_file()]
    assert not missing, f"no README.md in {missing}"


def test_readmes_carry_no_development_log():
    """No numbered work periods and no run-versioned file names in any README."""
    found = []
    for readme in readmes():
        if not readme.is_file():
            continue
        for number, line in enumerate(readme.read_text().splitlines(), 1):
            if re.search(r"\bsession \d+", line, flags=re.I) or RUN_VERSION.search(line):
                found.append(f"{readme.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert not found, "\n".join(found)


def test_results_are_current_and_portable():
    """One current file set per benchmark: few files, none named by run version, none holding
    the absolute path of the machine it ran on."""
    files = results_files()
    assert len(files) <= 40, f"{len(files)} files in benchmarks/results/ (at most 40)"
    versioned = [p.name for p in files if RUN_VERSION.search(p.name)]
    assert not versioned, f"run-versioned result files: {versioned}"
    with_paths = [p.name for p in files if MACHINE_PATH.search(p.read_bytes())]
    assert not with_paths, f"result files holding machine paths: {with_paths}"
