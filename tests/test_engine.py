"""Reference engine exactness: chain and DDTree against plain decoding and transformers."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.engine import SpecEngine

VOCAB = 96
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [11, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


def tiny_config(arch: str, vocab: int = VOCAB):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=vocab - 2,
        bos_token_id=1,
        pad_token_id=0,
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    return LlamaConfig(**common)


def tiny_target(arch: str, seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    # float64: argmax ties between a 1-token and a tree forward cannot flip greedy output.
    return AutoModelForCausalLM.from_config(tiny_config(arch, vocab), dtype=torch.float64).eval()


def random_drafter(target, block_size: int, seed: int = 1) -> DFlashDrafter:
    drafter = DFlashDrafter.random_init(
        target.config, num_layers=1, block_size=block_size, seed=seed
    )
    return drafter.double()


def transformers_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def arch_target(request):
    return request.param, tiny_target(request.param)


@pytest.fixture(scope="module")
def ar_outputs(arch_target):
    _, target = arch_target
    results = SpecEngine(target, method="ar").generate(PROMPTS, 24, stop_token_ids=[])
    return [r.tokens for r in results]


def test_ar_equals_transformers_generate(arch_target, ar_outputs):
    _, target = arch_target
    for prompt, tokens in zip(PROMPTS, ar_outputs, strict=True):
        assert tokens == transformers_greedy(target, prompt, 24)


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize(
    ("method", "budget"),
    [("chain", 1), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)],
)
def test_greedy_speculation_equals_plain_decoding(
    arch_target, ar_outputs, method, budget, block_size
):
    _, target = arch_target
    drafter = random_drafter(target, block_size, seed=block_size + budget)
    engine = SpecEngine(target, drafter, method=method, budget=budget)
    batched = engine.generate(PROMPTS, 24, stop_token_ids=[])
    assert [r.tokens for r in batched] == ar_outputs
    alone = engine.generate(PROMPTS[:1], 24, stop_token_ids=[])
    assert alone[0].tokens == ar_outputs[0]
    for r in batched:
        assert r.finish_reason == "length"
        assert sum(r.stats.commit_lengths) >= 24
        assert r.stats.steps == len(r.stats.commit_lengths) - 1


# ------------------------------------------------------------ sampling


def exact_two_token_law(target, prompt, temperature, top_p) -> dict[tuple[int, int], float]:
    """P(first two generated tokens) of the target alone, by enumeration."""
    from sglang_tree_spec.tree import target_probs

    with torch.no_grad():
        first = target_probs(target(torch.tensor([prompt])).logits[:, -1], temperature, 0, top_p)[0]
        support = [t for t in range(first.shape[0]) if first[t] > 0]
        batch = torch.tensor([[*prompt, t] for t in support])
        second = target_probs(target(batch).logits[:, -1], temperature, 0, top_p)
    return {
        (a, b): float(first[a] * second[i, b])
        for i, a in enumerate(support)
        for b in range(second.shape[1])
        if second[i, b] > 0
    }


def chi_square_p_small(counts: Counter, law: dict, n: int) -> tuple[float, float]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled) and the 0.1%
    critical value (Wilson-Hilferty approximation of the chi-square quantile)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in law.items():
        expected = n * p
        if expected >= 5:
            stat += (counts.get(key, 0) - expected) ** 2 / expected
            cells += 1
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += expected
    unknown = sum(c for key, c in counts.items() if key not in law)
    assert unknown == 0, "sampled a pair the target gives probability zero"
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    dof = cells - 1
    z = 3.09  # one-sided 0.1%
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, critical


@pytest.mark.parametrize(
    ("method", "top_p"), [("ar", 1.0), ("ddtree", 1.0), ("ddtree", 0.8), ("chain", 1.0)]
)
def test_sampling_follows_the_target_distribution(method, top_p):
    vocab, n = 12, 3000
    target = tiny_target("llama", seed=4, vocab=vocab)
    with torch.no_grad():  # sharpen the target so drafts are accepted often
        target.lm_head.weight.mul_(6.0)
    drafter = random_drafter(target, block_size=4, seed=2)
    prompt = [3, 7, 1]
    engine = SpecEngine(target, drafter if method != "ar" else None, method=method, budget=8)
    results = engine.generate(
        [prompt] * n, 2, temperature=1.0, top_p=top_p, stop_token_ids=[], seed=1234
    )
    counts = Counter(tuple(r.tokens[:2]) for r in results)
    stat, critical = chi_square_p_small(counts, exact_two_token_law(target, prompt, 1.0, top_p), n)
    assert stat < critical, (stat, critical)
    if method != "ar":
        assert sum(r.stats.commit_lengths[1] > 1 for r in results) > n // 50  # drafts accepted


def test_sampling_is_reproducible_with_a_seed():
    target = tiny_target("qwen3", seed=5)
    engine = SpecEngine(target, random_drafter(target, 8), method="ddtree", budget=16)
    kwargs = dict(temperature=0.7, top_p=0.9, stop_token_ids=[], seed=7)
    a = engine.generate(PROMPTS, 16, **kwargs)
    b = engine.generate(PROMPTS, 16, **kwargs)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    c = engine.generate(PROMPTS, 16, **{**kwargs, "seed": 8})
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_seeded_sampling_is_the_same_for_every_method():
    """Coins are keyed by (request seed, token position) and the target samples while the
    tree only matches, so every method commits exactly the tokens ``ar`` samples: the
    speculation (chain, tree, budget, grafting) is invisible in the output."""
    target = tiny_target("llama", seed=6, vocab=12)  # a small vocabulary: drafts get accepted
    drafter = random_drafter(target, 8, seed=3)
    prompts = [[1, 2, 3, 4, 5], [0, 3], [5, 4, 3, 2, 1, 0, 1]]
    kwargs = dict(temperature=0.9, top_p=0.95, stop_token_ids=[], seed=11)
    plain = SpecEngine(target, None, method="ar", topk=12).generate(prompts, 24, **kwargs)
    for method, budget in [
        ("chain", 8),
        ("ddtree", 4),
        ("ddtree", 32),
        ("ddtree-graft-unified", 16),
    ]:
        engine = SpecEngine(target, drafter, method=method, budget=budget, topk=12)
        results = engine.generate(prompts, 24, **kwargs)
        assert [r.tokens for r in results] == [r.tokens for r in plain], (method, budget)
        assert sum(max(r.stats.commit_lengths) > 1 for r in results) > 0, method  # drafts used


# ------------------------------------------------------------ bad input


def test_bad_configuration_and_input_raise_clear_errors():
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        SpecEngine(target, method="ddtree")
    with pytest.raises(ValueError, match="method"):
        SpecEngine(target, method="beam")
    other = tiny_target("qwen3", vocab=VOCAB + 4)
    with pytest.raises(ValueError, match="vocab size mismatch"):
        SpecEngine(target, random_drafter(other, 8), method="ddtree")
    wide = AutoModelForCausalLM.from_config(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    with pytest.raises(ValueError, match="hidden size mismatch"):
        SpecEngine(target, random_drafter(wide, 8), method="ddtree")
    with pytest.raises(ValueError, match="out of range"):
        DFlashDrafter.random_init(target.config, 1, 8, target_layer_ids=[9])
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashDrafter.random_init(target.config, 1, 8, mask_token_id=VOCAB + 1)
    engine = SpecEngine(target, random_drafter(target, 8), method="ddtree", budget=4)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, VOCAB]], 4)
    with pytest.raises(ValueError, match="budget"):
        SpecEngine(target, random_drafter(target, 8), method="ddtree", budget=0)


def test_auto_budget_changes_budgets_not_tokens():
    """``auto``: the budget moves between steps (the in-line profile of a batch of 4, a
    profiled size, alone visits every candidate) and the greedy tokens and seeded samples are
    those of plain decoding."""
    target = tiny_target("qwen3")
    drafter = random_drafter(target, 8, seed=3)
    prompts = [[3, 7, 1, 4], [5, 2, 9, 9, 8, 1], [6], [2, 2, 5]]
    ar = SpecEngine(target, method="ar")
    auto = SpecEngine(target, drafter, "ddtree", budget=16, auto=True)
    assert auto.config.budgets == (0, 4, 8, 16)
    served, drafted = set(), 0
    for kwargs in ({}, {"temperature": 0.9, "top_p": 0.8, "seed": 5}):
        want = [r.tokens for r in ar.generate(prompts, 48, stop_token_ids=[], **kwargs)]
        results = auto.generate(prompts, 48, stop_token_ids=[], **kwargs)
        assert [r.tokens for r in results] == want
        served |= {b for r in results for b in r.stats.budgets}
        drafted += sum(b > 0 for r in results for b in r.stats.budgets)
    assert served == {0, 4, 8, 16}, served
    # Every drafted request-step is counted (forecast, held, profiled or explored alike; held
    # ones calibrate one in AUTO["held_observe_every"]).
    assert auto.controller.stats().request_steps == drafted
    # A random drafter is no use: once profiled, auto decodes plainly (and drafts to probe;
    # a forecast that errs on a step-time cell measured under load drafts for AUTO["hold_steps"]).
    assert Counter(results[0].stats.budgets).most_common(1)[0][0] == 0


def test_a_plain_step_of_several_forwards_commits_what_one_forward_steps_do(monkeypatch):
    """A plain step runs ``step.PLAIN_FORWARDS`` target forwards, forward ``i`` at position
    ``prefix + i`` with that position's coin: greedy tokens and seeded samples are those of
    one forward a step whatever the number (a length limit inside a step cuts it), and each
    forward counts as a decode step that accepted nothing."""
    from sglang_tree_spec import step

    target = tiny_target("qwen3", seed=5)
    outputs = {}
    for forwards in (1, 2, 3):
        monkeypatch.setattr(step, "PLAIN_FORWARDS", forwards)
        engine = SpecEngine(target, method="ar")
        for label, kwargs in (("greedy", {}), ("seeded", {"temperature": 0.9, "seed": 5})):
            results = engine.generate(PROMPTS, 12, stop_token_ids=[], **kwargs)
            outputs[forwards, label] = [r.tokens for r in results]
            for r in results:  # 11 tokens after the prefill's: ceil(11 / forwards) steps
                steps = -(-11 // forwards)
                assert r.stats.commit_lengths[1:] == [forwards] * steps
                assert r.stats.accept_hist == [forwards * steps] == [r.stats.steps]
    for label in ("greedy", "seeded"):
        assert outputs[2, label] == outputs[3, label] == outputs[1, label], label
        assert all(len(tokens) == 12 for tokens in outputs[1, label])
    assert outputs[1, "greedy"] != outputs[1, "seeded"]


def recorded_draft_shapes(monkeypatch) -> list[tuple[int, int]]:
    """A list that each engine draft appends its top-K's ``(D, K)`` to (the real drafter
    runs; the recording wraps it)."""
    from sglang_tree_spec.engine.backend import TransformersBackend

    shapes, original = [], TransformersBackend.draft_topk

    def recording(self, bonus, prefix_lens, k, depths):
        logprobs, tokens = original(self, bonus, prefix_lens, k, depths)
        shapes.append(tuple(logprobs.shape[1:]))  # (D, K)
        return logprobs, tokens

    monkeypatch.setattr(TransformersBackend, "draft_topk", recording)
    return shapes


def test_the_drafter_lm_head_runs_only_on_depths_a_tree_can_reach(monkeypatch):
    """A tree of ``B`` nodes is at most ``B`` deep: each step's draft top-K covers the first
    ``min(L, largest budget)`` depths only (the LM head is the drafter's largest matmul), and
    the tokens are those of plain decoding."""
    target = tiny_target("qwen3")
    drafter = random_drafter(target, 16, seed=3)
    shapes = recorded_draft_shapes(monkeypatch)
    want = [
        r.tokens for r in SpecEngine(target, method="ar").generate(PROMPTS, 12, stop_token_ids=[])
    ]
    for budget, depths in ((4, 4), (64, 15)):
        shapes.clear()
        engine = SpecEngine(target, drafter, "ddtree", budget=budget)
        assert [r.tokens for r in engine.generate(PROMPTS, 12, stop_token_ids=[])] == want
        assert shapes and {s[0] for s in shapes} == {depths}, (budget, shapes)


def test_auto_drafts_the_top_k_each_steps_tree_reads(monkeypatch):
    """Under auto a DDTree step drafts the top-K its tree can use: a held step at budget N
    the top N (a rank-r token is among the N best prefixes only behind its r - 1 better
    siblings), a forecast step its largest candidate's, where drafting every step at the
    largest candidate's K wasted top-K work over the vocabulary on the small held trees. A
    grafted tree keeps the whole top-K (it looks its grafted tokens up in it). The tokens are
    plain decoding's either way."""
    target = tiny_target("qwen3")
    drafter = random_drafter(target, 16, seed=3)
    shapes = recorded_draft_shapes(monkeypatch)
    prompts = [[3, 7, 1, 4], [5, 2, 9, 9, 8, 1], [6], [2, 2, 5]]  # a batch of 4: profiled
    want = [r.tokens for r in SpecEngine(target, method="ar").generate(prompts, 24)]
    for method, allowed in (
        ("ddtree", {(4, 4), (8, 8), (15, 16)}),  # budgets 4, 8 (held) and 16 or a forecast
        ("ddtree-graft-unified", {(4, 16), (8, 16), (15, 16)}),
    ):
        shapes.clear()
        engine = SpecEngine(target, drafter, method, budget=16, auto=True)
        assert [r.tokens for r in engine.generate(prompts, 24)] == want
        assert set(shapes) <= allowed and len(set(shapes)) > 1, (method, Counter(shapes))
