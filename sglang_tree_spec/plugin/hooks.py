"""Every change the plugin makes to SGLang's behaviour, as ``HookRegistry`` hooks.

One hook per reason; each is mirrored by an upstream-ready diff in ``patches/sglang-<ver>/``
(tests dry-run every diff against the installed SGLang and check every target exists).
The table of each tested release is here; :func:`.entry.register_hooks` registers the installed
release's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_tree_spec.plugin.hook import Hook

SGLANG_VERSION = "0.5.17"  # the release of HOOKS; HOOKS_BY_RELEASE holds every tested release


def _ddtree_server_args() -> type:
    from sglang_tree_spec.plugin.server_args import DDTreeServerArgs

    return DDTreeServerArgs


def _native_rotary_on_cpu() -> Callable[..., None]:
    from sglang_tree_spec.plugin.cpu import native_rotary_on_cpu

    return native_rotary_on_cpu


def _tree_verify_torch_backend() -> type:
    from sglang_tree_spec.plugin.cpu import tree_verify_torch_backend

    return tree_verify_torch_backend()


def _native_kv_move_on_cpu() -> Callable[..., None]:
    from sglang_tree_spec.plugin.cpu import native_kv_move_on_cpu

    return native_kv_move_on_cpu


def _torch_native_draft_backend_on_cpu() -> Callable[..., str]:
    from sglang_tree_spec.plugin.cpu import torch_native_draft_backend_on_cpu

    return torch_native_draft_backend_on_cpu


def _prefill_graph_off_on_cpu() -> Callable[..., Any]:
    from sglang_tree_spec.plugin.cpu import prefill_graph_off_on_cpu

    return prefill_graph_off_on_cpu


def _torch_native_draft_worker_backend_on_cpu() -> Callable[..., str]:
    from sglang_tree_spec.plugin.cpu import torch_native_draft_worker_backend_on_cpu

    return torch_native_draft_worker_backend_on_cpu


def _assign_req_to_token_on_cpu() -> Callable[..., None]:
    from sglang_tree_spec.plugin.cpu import assign_req_to_token_on_cpu

    return assign_req_to_token_on_cpu


def _input_embeds_in_model_dtype() -> Callable[..., dict]:
    from sglang_tree_spec.plugin.cpu import input_embeds_in_model_dtype

    return input_embeds_in_model_dtype


def _req_to_token_headroom() -> Callable[..., int]:
    from sglang_tree_spec.plugin.server_args import req_to_token_headroom

    return req_to_token_headroom


def _refuse_inexact_requests() -> Callable[..., str | None]:
    from sglang_tree_spec.plugin.validation import refuse_inexact_requests

    return refuse_inexact_requests


def _refuse_out_of_vocab_input_ids() -> Callable[..., None]:
    from sglang_tree_spec.plugin.admission import refuse_out_of_vocab_input_ids

    return refuse_out_of_vocab_input_ids


def _refuse_empty_prompts() -> Callable[..., None]:
    from sglang_tree_spec.plugin.admission import refuse_empty_prompts

    return refuse_empty_prompts


def _finish_state_token_by_token() -> Callable[..., None]:
    from sglang_tree_spec.plugin.finish import update_finish_state_token_by_token

    return update_finish_state_token_by_token


def _ddtree_verify_graph_runner() -> Callable[..., type]:
    from sglang_tree_spec.plugin.graphs import ddtree_decode_graph_runner_cls

    return ddtree_decode_graph_runner_cls


def _spec_relay_on_cpu() -> Callable[..., Any]:
    from sglang_tree_spec.plugin.cpu import spec_relay_on_cpu

    return spec_relay_on_cpu


def _ddtree_default_attention_backend() -> Callable[..., str]:
    from sglang_tree_spec.plugin.validation import around_default_attention_backend

    return around_default_attention_backend


def _xgrammar_bitmask_on_cpu() -> Callable[..., Any]:
    from sglang_tree_spec.plugin.cpu import xgrammar_bitmask_on_cpu

    return xgrammar_bitmask_on_cpu


def _xgrammar_mask_applied_on_cpu() -> Callable[..., None]:
    from sglang_tree_spec.plugin.cpu import xgrammar_mask_applied_on_cpu

    return xgrammar_mask_applied_on_cpu


def _no_pynccl_for_gloo_groups() -> Callable[..., Any]:
    from sglang_tree_spec.plugin.cpu import no_pynccl_for_gloo_groups

    return no_pynccl_for_gloo_groups


HOOKS: tuple[Hook, ...] = (
    Hook(
        target="sglang.srt.server_args.ServerArgs",
        kind="REPLACE",
        make=_ddtree_server_args,
        patch="0001-server-args-ddtree-flags.diff",
        reason="add the --speculative-ddtree-* fields (CLI, Engine kwargs, config bags); the "
        "class also carries DDTREE's KV reservation (diff 0010) and, on 0.5.17, its default "
        "attention backend (diff 0023)",
    ),
    Hook(
        target="sglang.srt.entrypoints.engine.Engine.server_args_class",
        kind="REPLACE",
        make=_ddtree_server_args,
        patch="0008-engine-server-args-class-after-plugins.diff",
        reason="sglang.Engine binds its ServerArgs class before plugins load; it must build "
        "(and pickle) the same class as the CLI",
    ),
    Hook(
        target="sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len",
        kind="AROUND",
        make=_req_to_token_headroom,
        patch="0012-req-to-token-row-holds-the-decode-reservation.diff",
        reason="a speculative decode step reserves twice its allocation past the committed "
        "tokens, beyond a req_to_token row near the end of the context at page size 1",
    ),
    Hook(
        target="sglang.srt.speculative.dflash_utils.validate_dflash_request",
        kind="AROUND",
        make=_refuse_inexact_requests,
        patch="0013-dflash-refuses-penalties.diff",
        reason="0.5.17 refuses return_logprob for the whole DFlash family; the DDTREE worker "
        "serves it (and penalties, per tree node), so keep the refusal for DFLASH only and name "
        "the served algorithm in SGLang's reasons",
    ),
    Hook(
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        kind="BEFORE",
        make=_refuse_out_of_vocab_input_ids,
        patch="0014-tokenizer-manager-refuses-out-of-vocab-input-ids.diff",
        reason="input_ids outside [0, vocab_size) reach the embedding unchecked and kill the "
        "scheduler (any server, speculative or not); refuse them at admission (HTTP 400)",
    ),
    Hook(
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        kind="BEFORE",
        make=_refuse_empty_prompts,
        patch="0016-tokenizer-manager-refuses-empty-prompts.diff",
        reason="a prompt of no tokens (a text that tokenizes to nothing, an empty prompt in a "
        "batch) reaches the prefill and kills the scheduler (any server, speculative or not); "
        "refuse it at admission (HTTP 400)",
    ),
    Hook(
        target="sglang.srt.managers.schedule_batch.Req.update_finish_state",
        kind="AROUND",
        make=_finish_state_token_by_token,
        patch="0015-finish-state-token-by-token.diff",
        reason="a speculative step's accepted run is checked for its finish once, length first "
        "and stop strings before stop tokens: a run crossing max_new_tokens runs past a stop "
        "string, and EOS before a stop string is missed; check the run token by token",
    ),
    Hook(
        target="sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__",
        kind="BEFORE",
        make=_native_rotary_on_cpu,
        patch="0002-rotary-native-on-cpu.diff",
        reason="--device cpu without SGLANG_USE_CPU_ENGINE must not import vllm's rotary kernel",
    ),
    Hook(
        target="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup",
        kind="AROUND",
        make=_native_kv_move_on_cpu,
        patch="0005-native-kv-move-on-cpu.diff",
        reason="a speculative KV pool warms a Triton copy kernel; on CPU use the native move",
    ),
    Hook(
        target="sglang.srt.speculative.draft_worker_common._resolve_draft_attention_backend_fallback",
        kind="AROUND",
        make=_torch_native_draft_backend_on_cpu,
        patch="0006-torch-native-draft-backend-on-cpu.diff",
        reason="draft workers fall back to flashinfer for any non-GPU backend; on CPU keep "
        "torch_native",
    ),
    Hook(
        target="sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func",
        kind="AROUND",
        make=_assign_req_to_token_on_cpu,
        patch="0007-assign-req-to-token-on-cpu.diff",
        reason="speculative decode slot assignment is a Triton kernel (or sgl_kernel's CPU "
        "engine); on CPU write the slots with torch",
    ),
    Hook(
        target="sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs",
        kind="AROUND",
        make=_input_embeds_in_model_dtype,
        patch="0009-input-embeds-in-model-dtype.diff",
        reason="input_embeds (a DFlash drafter's block) are cast to bfloat16 whatever the "
        "served dtype; cast to the model's dtype",
    ),
    Hook(
        target="sglang.srt.distributed.parallel_state.init_model_parallel_group",
        kind="AROUND",
        make=_no_pynccl_for_gloo_groups,
        patch="0011-no-pynccl-for-gloo-groups.diff",
        reason="every parallel group asks for a PyNccl communicator, which needs CUDA; a CPU "
        "server's groups are gloo (--tp-size > 1 on CPU)",
    ),
    Hook(
        target="sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend",
        kind="REPLACE",
        make=_tree_verify_torch_backend,
        patch="0004-torch-native-target-verify.diff",
        reason="the torch-native (CPU) backend has no TARGET_VERIFY: tree-masked verify, "
        "non-causal drafter block",
    ),
)


# 0.5.17 only (0.5.23 turns the prefill graph off on CPU itself); numbered 0020 to stay clear of
# the numbers other work in progress takes.
HOOKS += (
    Hook(
        target="sglang.srt.server_args.ServerArgs._apply_cuda_graph_compatibility",
        kind="AROUND",
        make=_prefill_graph_off_on_cpu,
        patch="0020-prefill-cuda-graph-off-on-cpu.diff",
        reason="--device cpu without SGLANG_USE_CPU_ENGINE keeps the piecewise prefill CUDA "
        "graph, whose capture dies on CPU (with or without speculation)",
    ),
)

# 0.5.17 only (0.5.23 skips the stream record for CPU tensors itself): DDTREE under SGLang's
# overlap scheduler on CPU (a test switch, validation.CPU_OVERLAP_ENV).
HOOKS += (
    Hook(
        target="sglang.srt.managers.overlap_utils.FutureMap._resolve_spec_extras",
        kind="AROUND",
        make=_spec_relay_on_cpu,
        patch="0022-spec-relay-skips-stream-record-on-cpu.diff",
        reason="under overlap scheduling the speculative relay records its request indices on "
        "the current stream, which a CPU tensor refuses: the first speculative decode step "
        "kills a CPU server",
    ),
)

# 0.5.17 only (0.5.23 pins the bitmask only where pinning exists and masks CPU logits with
# xgrammar's CPU kernel itself): grammar-constrained requests on a CPU server, any algorithm.
HOOKS += (
    Hook(
        target="sglang.srt.constrained.xgrammar_backend._allocate_token_bitmask",
        kind="AROUND",
        make=_xgrammar_bitmask_on_cpu,
        patch="0024-xgrammar-bitmask-unpinned-on-cpu.diff",
        reason="the grammar bitmask is always allocated in pinned memory, which needs a CUDA "
        "driver: the first grammar-constrained request kills a CPU server",
    ),
    Hook(
        target="sglang.srt.constrained.xgrammar_backend.XGrammarGrammar.apply_vocab_mask",
        kind="AROUND",
        make=_xgrammar_mask_applied_on_cpu,
        patch="0025-xgrammar-bitmask-applied-on-cpu.diff",
        reason="the grammar bitmask is applied with a GPU kernel only (CPU logits raise "
        "'Unsupported device'); CPU logits go through xgrammar's CPU kernel",
    ),
)

# Both releases: the DDTREE target's decode graphs capture the tree mask, one shape per
# (batch size, budget) (plugin/graphs.py); numbered 0021 to stay clear of work in progress.
VERIFY_GRAPH_HOOK = Hook(
    target="sglang.srt.model_executor.model_runner.ModelRunner._decode_cuda_graph_runner_cls",
    kind="AROUND",
    make=_ddtree_verify_graph_runner,
    patch="0021-ddtree-verify-graph-runner.diff",
    reason="the DFlash-family verify graph is captured without a custom mask (a replayed tree "
    "verify would attend causally) and at one width; DDTREE's runner captures the tree mask "
    "for every (batch size, budget)",
)
HOOKS += (VERIFY_GRAPH_HOOK,)

_BY_PATCH = {hook.patch: hook for hook in HOOKS}

# SGLang 0.5.23 (patches/sglang-0.5.23/): the same reasons, each read against 0.5.23's source.
# 0.5.23 resolves ServerArgs into per-namespace bags, so several targets read the bags instead
# of a ServerArgs argument (the hook callables accept both forms); DDTREE's KV reservation
# (0.5.17's diff 0010) goes through 0.5.23's public
# ``CustomSpecAlgo.resolve_max_speculative_num_draft_tokens`` (algorithm.py), no hook.
HOOKS_0_5_23: tuple[Hook, ...] = (
    _BY_PATCH["0001-server-args-ddtree-flags.diff"],
    _BY_PATCH["0008-engine-server-args-class-after-plugins.diff"],
    _BY_PATCH["0012-req-to-token-row-holds-the-decode-reservation.diff"],
    _BY_PATCH["0013-dflash-refuses-penalties.diff"],
    _BY_PATCH["0014-tokenizer-manager-refuses-out-of-vocab-input-ids.diff"],
    _BY_PATCH["0016-tokenizer-manager-refuses-empty-prompts.diff"],
    Hook(
        target="sglang.srt.managers.schedule_batch.Req.update_finish_state",
        kind="AROUND",
        make=_finish_state_token_by_token,
        patch="0015-finish-state-token-by-token.diff",
        reason="a speculative step's accepted run is checked for its finish once, stop strings "
        "before stop tokens: EOS before a stop string in one run is missed (0.5.23 already "
        "checks stops before the length); check the run token by token",
    ),
    _BY_PATCH["0002-rotary-native-on-cpu.diff"],
    _BY_PATCH["0005-native-kv-move-on-cpu.diff"],
    Hook(
        target="sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend",
        kind="AROUND",
        make=_torch_native_draft_worker_backend_on_cpu,
        patch="0006-torch-native-draft-backend-on-cpu.diff",
        reason="draft workers fall back to flashinfer for any backend outside their list "
        "(0.5.23 renamed the resolver and reads the bags); on CPU keep torch_native",
    ),
    _BY_PATCH["0007-assign-req-to-token-on-cpu.diff"],
    _BY_PATCH["0009-input-embeds-in-model-dtype.diff"],
    _BY_PATCH["0011-no-pynccl-for-gloo-groups.diff"],
    _BY_PATCH["0004-torch-native-target-verify.diff"],
    VERIFY_GRAPH_HOOK,
    # 0.5.17's DDTreeServerArgs overrides the method that 0.5.23 made this module function.
    Hook(
        target="sglang.srt.arg_groups.overrides.get_default_attn_backend",
        kind="AROUND",
        make=_ddtree_default_attention_backend,
        patch="0023-ddtree-default-attention-backend.diff",
        reason="without --attention-backend SGLang picks fa3 on Hopper, whose target verify "
        "ignores the tree mask; DDTREE then gets triton",
    ),
)

HOOKS_BY_RELEASE: dict[str, tuple[Hook, ...]] = {"0.5.17": HOOKS, "0.5.23": HOOKS_0_5_23}
"""The hook table of every tested release (``compat.RELEASES``)."""
