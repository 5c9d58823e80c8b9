"""The DFlash authors' reference (``dflash`` 0.1.0 on PyPI: ``DFlashDraftModel``,
``dflash_generate``) as the oracle of the project's DFlash drafter, fp32 on CPU.

* Random-weight DFlash v1 checkpoints saved by the reference's own class, with every
  ``dflash_config`` field it reads set (``input_embedding_scale``, ``output_multiplier``,
  ``final_logit_softcapping``), load in the engine: the draft logits equal the reference's
  ``compute_logits`` of its forward, and the engine's greedy ``chain`` drafts, scores and
  accepts what ``dflash_generate`` does at every full-block step.
* A random-weight DFlash2 checkpoint saved by the reference's ``DFlash2DraftModel`` loads in
  the engine; the greedy chain drafts the reference's per-position marginals (its convolved
  forward) and accepts what ``dflash_generate`` does when the reference drafts them too (its
  own chain follows the candidate selector's path, which the engine does not use); a DDTREE
  server takes it on SGLang 0.5.23 and refuses it in one line on 0.5.17.
* The project's shipped drafters load in the reference: the small pair's drafter generates with
  ``dflash_generate`` what the chain generates, step by step; the SmolLM2 drafter's block hidden
  states equal the engine's.

Needs the reference installed without its dependencies (``pip install --no-deps
dflash==0.1.0``: it pins torch, transformers and datasets). With transformers older than 5.15
(SGLang 0.5.17's 5.12.1) its generation loop needs two cache methods of later releases; the
``reference`` fixture supplies them (see there) and nothing else.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, Qwen3Config

try:
    import dflash.model as reference_model
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate
except ImportError as error:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"the DFlash reference package is not importable ({error}); install it with "
        "`pip install --no-deps dflash==0.1.0`",
        allow_module_level=True,
    )

from sglang_tree_spec.demo import PACKAGED_DRAFTER_DIR
from sglang_tree_spec.drafters import DFlashDrafter
from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.backend import TransformersBackend
from sglang_tree_spec.models.small_pair import SMALL_PAIR_DIR, heldout_prompts
from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.validation import DDTreeConfigError, load_drafter

VOCAB = 48
BLOCK = 6
FIELDS = {"input_embedding_scale": 3.0, "output_multiplier": 1.7, "final_logit_softcapping": 2.5}


@pytest.fixture(scope="module")
def reference():
    """The reference module, runnable here: on transformers < 5.15 ``DynamicCache`` lacks
    ``activate_past_recording`` (in later releases a flag that full-attention layers never
    read) and ``crop(n)`` with ``n >= 0`` keeps the first ``n`` tokens, so the reference's
    ``_crop_to(cache, length)`` (``crop(-(len - length))``, written for 5.15's count
    semantics) would empty the cache when nothing is to be removed: both get the 5.15
    behaviour. ``_cuda_time`` (the reference's timer, which synchronises CUDA) reads the clock
    alone on CPU."""
    patch = pytest.MonkeyPatch()
    if not hasattr(DynamicCache, "activate_past_recording"):
        patch.setattr(DynamicCache, "activate_past_recording", lambda self: None, raising=False)
        patch.setattr(reference_model, "_crop_to", lambda cache, length: cache.crop(length))
    if not torch.cuda.is_available():
        patch.setattr(reference_model, "_cuda_time", time.perf_counter)
    yield reference_model
    patch.undo()


def tiny_target() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def reference_drafter(fields: dict, seed: int = 1) -> DFlashDraftModel:
    """A random-weight DFlash v1 drafter built by the reference's own class."""
    config = Qwen3Config(
        architectures=["DFlashDraftModel"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.2,
        block_size=BLOCK,
        num_target_layers=4,
        dflash_config={"target_layer_ids": [1, 2], "mask_token_id": VOCAB - 1, **fields},
    )
    torch.manual_seed(seed)
    return DFlashDraftModel(config).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module", params=["every-field", "no-field"])
def pair(request, target, tmp_path_factory):
    """(reference drafter, the engine's drafter loaded from the reference's checkpoint)."""
    fields = FIELDS if request.param == "every-field" else {}
    ref = reference_drafter(fields)
    path = tmp_path_factory.mktemp(f"reference-{request.param}")
    ref.save_pretrained(path)
    return ref, DFlashDrafter.from_pretrained(path)


def test_checkpoint_loads_with_the_reference_fields(pair):
    ref, drafter = pair
    fields = ref.config.dflash_config
    assert drafter.input_embedding_scale == fields.get("input_embedding_scale", 1.0)
    assert drafter.output_multiplier == fields.get("output_multiplier", 1.0)
    assert drafter.final_logit_softcapping == fields.get("final_logit_softcapping")
    assert drafter.target_layer_ids == ref.target_layer_ids and drafter.block_size == BLOCK
    assert drafter.mask_token_id == ref.mask_token_id
    for name, tensor in ref.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name


def test_draft_logits_equal_the_reference(reference, target, pair):
    """One block after a 9-token context: the engine's draft logits (slots 1..B-1) equal the
    reference's ``compute_logits`` of its forward on the same features."""
    ref, drafter = pair
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden_states = target(ids, output_hidden_states=True).hidden_states
        features = reference.extract_context_feature(hidden_states, ref.target_layer_ids)
        block = drafter.block_token_ids(torch.tensor([7]))
        scale = float(reference._draft_value(ref.config, "input_embedding_scale", 1.0))
        noise = reference._raw_input_embeddings(target, block, scale)
        hidden = ref(
            target_hidden=features,
            noise_embedding=noise,
            position_ids=torch.arange(9 + BLOCK)[None],
        )[:, 1:]
        expected = ref.compute_logits(hidden, reference._output_head(target))
        cache = drafter.new_cache(1)
        cache.append(drafter.target_hidden_features(hidden_states))
        got = cache.draft_logits(block, target.get_input_embeddings(), target.lm_head)
    torch.testing.assert_close(got, expected)


def run_reference(reference, ref, target, prompt, max_new):
    """``dflash_generate``'s greedy run: (tokens, acceptance lengths, per-step top-1 draft
    (tokens [B - 1], log-probs [B - 1]) of every full-block step)."""
    drafts = []
    compute_logits = ref.compute_logits

    def spy(hidden, head):
        logits = compute_logits(hidden, head)
        if logits.shape[1] == ref.block_size - 1:
            top = torch.log_softmax(logits.float(), -1).max(-1)
            drafts.append((top.indices[0], top.values[0]))
        return logits

    ref.compute_logits = spy
    try:
        out = dflash_generate(ref, target, prompt, max_new, None, return_stats=True)
    finally:
        del ref.compute_logits
    return out.output_ids[0, prompt.shape[1] :].tolist(), out.acceptance_lengths, drafts


def run_chain(drafter, target, prompt, max_new, monkeypatch):
    """The engine's greedy chain: (tokens, tokens committed per step, per-step top-1 drafts)."""
    drafts = []
    draft_topk = TransformersBackend.draft_topk

    def spy(self, bonus, prefix_lens, k, depths):
        logprobs, tokens = draft_topk(self, bonus, prefix_lens, k, depths)
        drafts.append((tokens[0, :, 0], logprobs[0, :, 0]))
        return logprobs, tokens

    with monkeypatch.context() as patch:
        patch.setattr(TransformersBackend, "draft_topk", spy)
        (result,) = SpecEngine(target, drafter, method="chain").generate(
            [prompt[0].tolist()], max_new, stop_token_ids=[]
        )
    return result.tokens, result.stats.commit_lengths[1:], drafts


def full_block_steps(acceptance: list[int], max_new: int, block: int) -> int:
    """Steps that ``dflash_generate`` drafts a whole block for (it shortens the last ones to
    the length limit; the engine never does)."""
    start, steps = 1, 0  # the prefill's token
    for produced in acceptance:
        if start + block > max_new + 1:
            break
        start, steps = start + produced, steps + 1
    return steps


def assert_chain_equals_reference(reference, ref, drafter, target, prompt, max_new, patch):
    ref_tokens, ref_accept, ref_drafts = run_reference(reference, ref, target, prompt, max_new)
    tokens, commits, drafts = run_chain(drafter, target, prompt, max_new, patch)
    assert tokens[: len(ref_tokens)] == ref_tokens
    steps = full_block_steps(ref_accept, max_new, ref.block_size)
    assert steps >= 4
    assert commits[:steps] == ref_accept[:steps]
    for (ref_ids, ref_lp), (ids, lp) in zip(ref_drafts[:steps], drafts[:steps], strict=True):
        assert ids.tolist() == ref_ids.tolist()
        torch.testing.assert_close(lp, ref_lp)
    return ref_accept[:steps]


def test_chain_drafts_and_accepts_what_dflash_generate_does(reference, target, pair, monkeypatch):
    """Random weights: the drafts are rarely accepted (each step commits the bonus alone), so
    the per-step drafted tokens and their log-probs carry the comparison."""
    ref, drafter = pair
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    assert_chain_equals_reference(reference, ref, drafter, target, prompt, 24, monkeypatch)


SMALL_PAIR_FIELDS = {
    "input_embedding_scale": 2.2,
    "output_multiplier": 0.7,
    "final_logit_softcapping": 5.0,
}


@pytest.fixture(scope="module")
def small_pair():
    target = AutoModelForCausalLM.from_pretrained(
        SMALL_PAIR_DIR / "target", dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(SMALL_PAIR_DIR / "target")
    prompt = torch.tensor([tokenizer.encode(heldout_prompts(1)[0], add_special_tokens=False)])
    return target, prompt


def test_shipped_small_pair_drafter_runs_in_the_reference(reference, small_pair, monkeypatch):
    """The small pair's drafter (assets/small-pair, bf16) loads in the reference in fp32, and
    the engine's chain generates, drafts and accepts what ``dflash_generate`` does."""
    target, prompt = small_pair
    ref, info = DFlashDraftModel.from_pretrained(
        SMALL_PAIR_DIR / "drafter", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    drafter = DFlashDrafter.from_pretrained(SMALL_PAIR_DIR / "drafter", dtype=torch.float32)
    accepted = assert_chain_equals_reference(
        reference, ref.eval(), drafter, target, prompt, 48, monkeypatch
    )
    assert max(accepted) > 4  # the trained drafter is accepted deep


def test_small_pair_drafter_with_every_field_matches_the_reference(
    reference, small_pair, monkeypatch, tmp_path
):
    """The shipped drafter's weights re-saved by the reference's class with every field set:
    the engine's chain still equals ``dflash_generate`` step by step, and the fields change
    what both accept."""
    target, prompt = small_pair
    ref = DFlashDraftModel.from_pretrained(SMALL_PAIR_DIR / "drafter", dtype=torch.float32)
    ref.config.dflash_config = {**ref.config.dflash_config, **SMALL_PAIR_FIELDS}
    ref.save_pretrained(tmp_path)
    ref = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(tmp_path)
    assert drafter.output_multiplier == SMALL_PAIR_FIELDS["output_multiplier"]
    with_fields = assert_chain_equals_reference(
        reference, ref, drafter, target, prompt, 48, monkeypatch
    )
    plain = DFlashDraftModel.from_pretrained(SMALL_PAIR_DIR / "drafter", dtype=torch.float32)
    without = run_reference(reference, plain.eval(), target, prompt, 48)[1]
    assert with_fields != without[: len(with_fields)]
    assert max(with_fields) > 2


def test_shipped_smollm2_drafter_loads_in_the_reference(reference):
    """The SmolLM2 drafter (assets/smollm2-135m-instruct-dflash) loads in the reference; its
    block hidden states on random context features equal the engine's."""
    ref, info = DFlashDraftModel.from_pretrained(
        PACKAGED_DRAFTER_DIR, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    drafter = DFlashDrafter.from_pretrained(PACKAGED_DRAFTER_DIR, dtype=torch.float32)
    hidden = drafter.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 7, 2 * hidden, generator=generator)
    embed = torch.nn.Embedding(drafter.config.vocab_size, hidden)
    block = drafter.block_token_ids(torch.tensor([42]))
    with torch.no_grad():
        expected = ref.eval()(
            target_hidden=features,
            noise_embedding=embed(block),
            position_ids=torch.arange(7 + drafter.block_size)[None],
        )
        cache = drafter.new_cache(1)
        cache.append(features)
        got = cache.draft_hidden(block, embed)
    torch.testing.assert_close(got, expected)


DFLASH2_FIELDS = {
    "conv_kernel_size": 3,
    "conv_group_size": 8,
    "selector_rank": 4,
    "selector_top_k": 5,
}


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    """(reference DFlash2 drafter, the engine's drafter from the reference's checkpoint): random
    weights, the convolutions' base kernels and the selector's codebooks drawn too (the
    reference's init leaves them empty)."""
    config = reference_drafter(FIELDS).config
    config.architectures = ["DFlash2DraftModel"]
    config.dflash_config = {**config.dflash_config, **DFLASH2_FIELDS}
    torch.manual_seed(3)
    ref = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if "base_kernel" in name or "codebook" in name:
                param.copy_(torch.randn_like(param) * 0.5)
    path = tmp_path_factory.mktemp("reference-dflash2")
    ref.save_pretrained(path)
    return ref, DFlashDrafter.from_pretrained(path), path


def test_dflash2_checkpoint_loads_every_weight(dflash2_pair):
    ref, drafter, _ = dflash2_pair
    assert drafter.dflash2 and drafter.output_multiplier == FIELDS["output_multiplier"]
    state = drafter.state_dict()
    assert set(state) == set(ref.state_dict())
    for name, tensor in ref.state_dict().items():
        assert torch.equal(state[name], tensor), name


def marginal_propose(ref):
    """The reference's DFlash2 ``propose`` drafting each block slot's marginal argmax (its
    ``compute_logits`` of the convolved forward) instead of the selector's path: the draft the
    engine's chain makes (see drafters/dflash.py on why trees use the marginals)."""

    def propose(hidden, anchor_ids, output_head, temperature):
        assert temperature == 0
        return ref.compute_logits(hidden, output_head).argmax(-1), None, None

    return propose


def test_dflash2_chain_equals_dflash_generate(reference, target, dflash2_pair, monkeypatch):
    """The engine's greedy chain on a DFlash2 drafter generates what ``dflash_generate`` does
    with the marginal draft, with its per-step acceptance lengths, and drafts from the same
    per-position marginals (top-1 ids and log-probs per step)."""
    ref, drafter, _ = dflash2_pair
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(ref, "propose", marginal_propose(ref))
    accepted = assert_chain_equals_reference(
        reference, ref, drafter, target, prompt, 24, monkeypatch
    )
    assert max(accepted) > 1


def test_dflash2_checkpoint_is_served_where_sglang_has_the_model(dflash2_pair):
    """A DDTREE server takes the DFlash2 checkpoint on SGLang 0.5.23 (``test_sglang_dflash2``
    serves one) and refuses it at start-up in one line on 0.5.17, which has no DFlash2 model."""
    path = dflash2_pair[2]
    load_drafter.cache_clear()
    if compat.SERVES_DFLASH2[compat.release()]:
        assert load_drafter(str(path)).dflash2
        return
    with pytest.raises(DDTreeConfigError) as error:
        load_drafter(str(path))
    assert str(error.value) == (
        f"DDTREE: --speculative-draft-model-path {path}: DFlash drafter "
        "architectures=['DFlash2DraftModel'] needs SGLang's DFlash2 model, which SGLang "
        f"{compat.installed_version()} does not have (0.5.23 has it)"
    )
