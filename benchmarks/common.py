"""What the reference-engine benchmarks share: the run loop, statistics, environment record.

* :func:`decode_prompts` decodes prompts with several engines, batch by batch, the engines
  taking turns (a change of machine load hits all alike), into one :class:`Tally` per engine;
  step times come from each engine's own phase timer (the decode step's, no patching).
* :func:`bootstrap_interval` gives 95% intervals of pooled tau, or of a ratio of two pooled
  taus, under a (paired) bootstrap over prompts: decoding is deterministic, so the noise that
  matters is the choice of prompts.
* :func:`environment` records the versions, device, threads and load of a run.
* :func:`portable` / :func:`portable_record` take this machine's paths out of what a benchmark
  writes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from sglang_tree_spec.engine import SpecEngine

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# An absolute path under a machine's own folders (what portable() must not leave behind).
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|Users|mnt|opt)/[^\s\"'`()<>,;]*")


def portable(text: str) -> str:
    """``text`` without this machine's paths: the checkout's become repository-relative, the
    home folder ``~``, the temporary folder ``<tmp>``, any other machine path ``<path>/NAME``
    (its last part). Results are committed and read on other machines."""
    text = text.replace(str(ROOT) + "/", "")
    for prefix, short in (
        (str(ROOT), "."),
        (str(Path.home()), "~"),
        (os.path.realpath(tempfile.gettempdir()), "<tmp>"),
        (tempfile.gettempdir(), "<tmp>"),
    ):
        if prefix not in ("", "/"):
            text = re.sub(re.escape(prefix) + r"(?![\w.-])", short, text)
    return MACHINE_PATH.sub(lambda m: "<path>/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def portable_record(value):
    """``value`` (a record: dicts, lists, tuples, strings, numbers) with :func:`portable` applied
    to every string in it, so that what a benchmark returns is what it writes."""
    if isinstance(value, str):
        return portable(value)
    if isinstance(value, dict):
        return {portable_record(k): portable_record(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(portable_record(v) for v in value)
    return value


class Tally:
    """Outputs, step counts and times of one engine over the batches of a run."""

    def __init__(self) -> None:
        self.outputs: list[list[int]] = []
        self.steps: list[int] = []  # per prompt: decode steps
        self.committed: list[int] = []  # per prompt: accepted + bonus over its steps
        self.hist: list[int] = []  # pooled accept_hist
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.batch_steps = 0  # batched decode steps
        self.phase_s: dict[str, float] = {}  # seconds per phase of the batched steps

    def add(self, results, wall: float, cpu: float) -> None:
        self.wall_s += wall
        self.cpu_s += cpu
        for result in results:
            stats = result.stats
            self.outputs.append(result.tokens)
            self.steps.append(stats.steps)
            self.committed.append(sum((n + 1) * c for n, c in enumerate(stats.accept_hist)))
            if len(stats.accept_hist) > len(self.hist):
                self.hist.extend([0] * (len(stats.accept_hist) - len(self.hist)))
            for n, c in enumerate(stats.accept_hist):
                self.hist[n] += c

    @property
    def tau(self) -> float:
        return sum(self.committed) / max(sum(self.steps), 1)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)

    def step_ms(self, *phases: str) -> float:
        """Mean ms per batched step in ``phases`` (all of them when none is named)."""
        names = phases or tuple(self.phase_s)
        return 1e3 * sum(self.phase_s.get(p, 0.0) for p in names) / max(self.batch_steps, 1)


def decode_prompts(
    engines: dict[str, SpecEngine],
    prompts: list[list[int]],
    new_tokens: int,
    batch_size: int,
    stops: list[int] | None,
    desc: str = "",
) -> dict[str, Tally]:
    """Greedy decoding of ``prompts`` by every engine, batch by batch, the engines taking
    turns. ``desc`` labels the progress bar (one tick per engine per batch)."""
    tallies = {label: Tally() for label in engines}
    starts = range(0, len(prompts), batch_size)
    progress = tqdm(total=len(starts) * len(engines), desc=desc, unit="batch", leave=False)
    for start in starts:
        batch = prompts[start : start + batch_size]
        for label, engine in engines.items():
            progress.set_postfix_str(label)
            steps_before, phases_before = engine.timer.steps, engine.timer.totals()
            wall, cpu = time.perf_counter(), time.process_time()
            results = engine.generate(batch, new_tokens, stop_token_ids=stops)
            tally = tallies[label]
            tally.add(results, time.perf_counter() - wall, time.process_time() - cpu)
            tally.batch_steps += engine.timer.steps - steps_before
            for phase, seconds in engine.timer.totals().items():
                spent = seconds - phases_before.get(phase, 0.0)
                tally.phase_s[phase] = tally.phase_s.get(phase, 0.0) + spent
            progress.update()
    progress.close()
    return tallies


def bootstrap_interval(
    num: Tally, den: Tally | None = None, resamples: int = 2000, seed: int = 0
) -> list[float]:
    """95% interval of pooled tau of ``num`` (or of ``tau(num) / tau(den)``, paired) under a
    bootstrap over prompts."""
    rng = random.Random(seed)
    n = len(num.steps)
    values = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        taus = [
            sum(t.committed[i] for i in pick) / max(sum(t.steps[i] for i in pick), 1)
            for t in (num, den) if t is not None
        ]  # fmt: skip
        values.append(taus[0] / taus[1] if den is not None else taus[0])
    values.sort()
    return [round(values[int(0.025 * resamples)], 4), round(values[int(0.975 * resamples)], 4)]


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length if one is a prefix)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def sha256_file(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run (``OMP_WAIT_POLICY`` included when set)."""
    omp = os.environ.get("OMP_WAIT_POLICY")
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join([*([f"OMP_WAIT_POLICY={omp}"] if omp else []), "python", script, *args])


def code_version() -> str:
    """The commit of the checkout the benchmark runs from (``+dirty`` when tracked files
    differ from it), ``unknown`` outside a git checkout: which code a result measured."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def environment(device: torch.device | str, dtype: str = "float32") -> dict:
    """Versions, the code's commit, device, threads and load average at the start of a run."""
    return {
        "code": code_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }


def paired_medians(
    before: Callable[[], object],
    after: Callable[[], object],
    repeats: int,
    block: int,
    device: str,
) -> tuple[float, float, float]:
    """Median ms of two callables and the median before/after ratio, timed in alternating
    blocks of ``block`` warm calls (a change of machine load hits both alike)."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def once(fn: Callable[[], object]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) * 1e3

    def block_median(fn: Callable[[], object]) -> float:
        return statistics.median(once(fn) for _ in range(block))

    once(before), once(after)  # warm-up: caches, allocator, kernel selection
    pairs = [(block_median(before), block_median(after)) for _ in range(repeats)]
    return (
        statistics.median(b for b, _ in pairs),
        statistics.median(a for _, a in pairs),
        statistics.median(b / a for b, a in pairs),
    )
