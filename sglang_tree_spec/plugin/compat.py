"""Which SGLang release is installed, and where the plugin finds what it uses in it.

The plugin is tested against SGLang 0.5.17 and 0.5.23 (:data:`RELEASES`). Everything it takes
from SGLang is declared here or in :mod:`.hooks` per release:

* the hook targets (``hooks.HOOKS_BY_RELEASE``), each mirrored by a diff in
  ``patches/sglang-<release>/``;
* :data:`INTERNALS`: the other SGLang names the plugin imports (the worker, the algorithm, the
  flags), checked at start-up like the hook targets;
* :data:`MOVED`: names whose module differs between releases; :func:`moved` imports them from
  the installed release's location.

:func:`check_release` runs when the plugin registers (in every SGLang process). On a tested
release it returns that release. On another one it uses the tables of the newest tested release
not newer than the installed one (0.5.18-0.5.22 use 0.5.17's) if every declared target exists
there, with a one-line warning; otherwise it raises :class:`UnsupportedSGLang`, whose one line
names the installed release and the first missing target.
"""

from __future__ import annotations

import importlib.metadata
import logging
import operator
import pkgutil
from collections.abc import Callable
from functools import cache
from typing import Any

from sglang_tree_spec.plugin.hooks import HOOKS_BY_RELEASE

logger = logging.getLogger(__name__)

RELEASES = ("0.5.17", "0.5.23")
"""SGLang releases the plugin is tested on (oldest first)."""

# SGLang names the plugin imports besides the hook targets, per release (dotted paths).
_COMMON_INTERNALS = (
    # algorithm.py
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm",
    "sglang.srt.speculative.spec_registry.CustomSpecAlgo",
    "sglang.srt.speculative.spec_registry.get_spec",
    "sglang.srt.managers.overlap_utils.FutureMap",
    "sglang.srt.runtime_context.get_server_args",
    # server_args.py / validation.py
    "sglang.srt.arg_groups.arg_utils.A",
    "sglang.srt.arg_groups.arg_utils.Arg",
    "sglang.srt.arg_groups.arg_utils.NS",
    "sglang.srt.arg_groups.overrides.resolved_view",
    "sglang.srt.arg_groups.overrides.attention_backends_of",
    "sglang.srt.mem_cache.allocation_sizing.get_alloc_reserve_per_decode",
    "sglang.srt.sampling.sampling_params.SamplingParams",
    # admission.py (the request objects _validate_one_request's admission hooks read)
    "sglang.srt.managers.io_struct.GenerateReqInput.input_embeds",
    "sglang.srt.managers.io_struct.GenerateReqInput.contains_mm_input",
    "sglang.srt.managers.io_struct.EmbeddingReqInput.input_embeds",
    "sglang.srt.managers.io_struct.EmbeddingReqInput.contains_mm_input",
    # cpu.py
    "sglang.srt.layers.radix_attention.AttentionType",
    "sglang.srt.mem_cache.memory_pool.KVWriteLoc",
    # worker.py / backend.py (DFlashWorkerV2's private members included)
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
    "sglang.srt.speculative.dflash_info.DFlashVerifyInput.prepare_for_verify",
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.move_kv_cache",
    "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
    "sglang.srt.distributed.get_tp_group",
    "sglang.srt.distributed.parallel_state.GroupCoordinator.broadcast_object",
    "sglang.srt.managers.scheduler.GenerationBatchResult",
    "sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode",
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch",
    "sglang.srt.model_executor.forward_batch_info.ForwardMode",
    "sglang.srt.speculative.dflash_info.DFlashVerifyInput",
    "sglang.srt.speculative.dflash_utils.apply_dflash_verify_logits_adjustments",
    "sglang.srt.speculative.spec_utils.load_token_map",
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2",
    "sglang.srt.speculative.draft_worker_common.build_block_pos_offsets",
    "sglang.srt.speculative.draft_worker_common.make_draft_block_spec_info",
    "sglang.srt.speculative.draft_worker_common.make_draft_input_v2",
    # accounting.py (step accounting, diagnostics: plugin.accounting.TARGETS)
    "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu",
    "sglang.srt.plugins.hook_registry.HookRegistry",
    "sglang.srt.arg_groups.speculative_hook._handle_dflash",
    "sglang.srt.speculative.dflash_worker_v2.assign_extend_cache_locs_func",
    # graphs.py (the DDTREE verify graph runner)
    "sglang.srt.model_executor.runner.base_cuda_graph_runner.get_batch_sizes_to_capture",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
    "sglang.srt.model_executor.forward_context.ForwardContext",
    "sglang.srt.model_executor.forward_context.forward_context",
    "sglang.srt.distributed.parallel_state.graph_capture",
    "sglang.srt.layers.logits_processor.LogitsProcessorOutput",
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.init_cuda_graph_state",
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.init_forward_metadata_out_graph",
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.init_forward_metadata_in_graph",
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.next_token_logits_buffer",
    "sglang.srt.model_executor.graph_shared_output.GraphSharedOutput.get_logits_buffer",
)

INTERNALS: dict[str, tuple[str, ...]] = {
    "0.5.17": (
        *_COMMON_INTERNALS,
        # server_args.py: DDTreeServerArgs overrides SGLang's default attention backend choice.
        "sglang.srt.server_args.ServerArgs._get_default_attn_backend",
    ),
    "0.5.23": (
        *_COMMON_INTERNALS,
        # 0.5.23 resolves the configuration into per-namespace bags (server_args.py).
        "sglang.srt.runtime_context.get_spec",
        "sglang.srt.runtime_context.max_speculative_num_draft_tokens",
        # 0.5.23 asks the decode graph runner class about gathers (graphs.py delegates).
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner."
        "decode_graph_gather_requirements",
        # DFlash2 drafters: SGLang's model, whose block convolutions the worker sizes.
        "sglang.srt.models.dflash.DFlash2DraftModel",
        "sglang.srt.models.dflash.DFlashDraftModel.set_block_size",
    ),
}

# Whether the release serves DFlash2 drafters (``DFlash2DraftModel``; SGLang added it in 0.5.19).
SERVES_DFLASH2: dict[str, bool] = {"0.5.17": False, "0.5.23": True}

# Instance attributes of DFlashWorkerV2 the DDTREE worker reads or overrides (set in its
# constructor, so checked on the constructed worker: :func:`check_worker_attributes`).
WORKER_ATTRIBUTES = (
    "_mask_token_id",
    "_draft_worker",
    "_use_fused_kv_materialize",
    "_fused_kv_helper",
    "_draft_sampler",
    "draft_model",
    "draft_model_runner",
    "target_worker",
    "model_runner",
)

# The target ``ModelRunner``'s attribute holding its decode graph runner on CUDA (DDTREE's verify
# graphs, plugin/graphs.py), read by the worker for the capture batch sizes of its tree graphs;
# set (None until captured) in both tested releases' ``ModelRunner``.
MODEL_RUNNER_GRAPH_RUNNER = "decode_cuda_graph_runner"

# The target ``ModelRunner``'s shared graph output (``GraphSharedOutput``: one fp32 logits buffer
# every graph runner of the process writes a view of), which DDTREE's verify graphs share where it
# is large enough (graphs.py); set (None until captured) in both tested releases' ``ModelRunner``.
MODEL_RUNNER_GRAPH_OUTPUT = "graph_shared_output"

# flashinfer's captured target-verify wrappers, a dict keyed by batch size alone (set in the
# backend's constructor, planned by its out-of-graph hook, in both tested releases): DDTREE's
# verify graphs keep one set per (batch size, budget) and hand a shape's back before its replay
# plans them (graphs.py ``WrappersPerBatchSize``; tests/test_verify_graph_wrappers.py).
BACKEND_VERIFY_WRAPPERS = "prefill_cuda_graph_metadata"
# How many prefill wrappers flashinfer makes a shape (2 with a sliding window or cross
# attention, else 1; set in its constructor in both tested releases): the capture plan counts
# each kept wrapper's workspace (capture_plan.py ``kept_wrapper_bytes``).
BACKEND_WRAPPERS_PER_SHAPE = "num_wrappers"

# Attributes of SGLang's scheduler ``Req`` the DDTREE worker and the finish hook (finish.py) read
# (checked on a real Req by tests/test_compat.py).
REQ_ATTRIBUTES = (
    "rid",
    "origin_input_ids",
    "sampling_params",
    "extra_key",
    "finished",
    "output_ids",
    "grammar",
)

# Fields of a Req's ``sampling_params`` (SGLang's ``SamplingParams``) the worker reads: the HTTP
# API's ``custom_params`` carries a benchmark's budget pin (worker.py, ``PIN_PARAM``); checked on
# a real SamplingParams by tests/test_compat.py.
SAMPLING_PARAMS_ATTRIBUTES = ("custom_params",)

# Where a Req keeps its ``req_to_token`` row, per release (0.5.23 moved it into the request's KV
# state, ``req.kv``): read by :func:`req_rows` (the deferred drafter context's host rows).
REQ_ROW: dict[str, str] = {"0.5.17": "req_pool_idx", "0.5.23": "kv.req_pool_idx"}

# Where a decode batch's draft input keeps the step's KV reservation on the host (an upper bound
# of the lengths the step reaches), per release: read by :func:`reserved_lens`.
RESERVED_LENS: dict[str, str] = {"0.5.17": "reserved_seq_lens_cpu", "0.5.23": "nxt_kv_lens_cpu"}

# The Req attributes SGLang separates prefix caches by, per release: the isolation key of
# ``--speculative-ddtree-table per-key``. 0.5.17 folds the OpenAI ``cache_salt`` (and a LoRA
# id) into ``extra_key``; 0.5.23 keeps ``cache_salt`` apart (its radix key holds both).
ISOLATION_KEY: dict[str, tuple[str, ...]] = {
    "0.5.17": ("extra_key",),
    "0.5.23": ("extra_key", "cache_salt"),
}

MOVED: dict[str, dict[str, str]] = {
    # 0.5.23 moved the tree-verify kernels to sglang.kernels (eagle_utils re-exports them).
    "verify_tree_greedy_func": {
        "0.5.17": "sglang.srt.speculative.eagle_utils.verify_tree_greedy_func",
        "0.5.23": "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func",
    },
    "TreeMaskMode": {
        "0.5.17": "sglang.srt.speculative.eagle_utils.TreeMaskMode",
        "0.5.23": "sglang.kernels.ops.speculative.spec_tree.TreeMaskMode",
    },
}


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang lacks something the plugin needs (one-line message)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"DDTREE: {message}")


def installed_version() -> str:
    """The installed SGLang's version string (``importlib.metadata``)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedSGLang("SGLang is not installed") from None


def _key(version: str) -> tuple[int, ...]:
    """``"0.5.23"`` -> ``(0, 5, 23)``; a suffix such as ``.post1`` or ``rc1`` is ignored."""
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def table_release(version: str) -> str | None:
    """The tested release whose tables serve ``version``: itself, else the newest tested release
    not newer than it; None for a release older than every tested one."""
    if version in RELEASES:
        return version
    older = [r for r in RELEASES if _key(r) <= _key(version)]
    return older[-1] if older else None


def release() -> str:
    """The tested release whose tables the plugin uses in this process (see
    :func:`check_release`)."""
    return check_release()


def declared_targets(table: str) -> tuple[str, ...]:
    """Every dotted SGLang name the plugin needs under release ``table``: hook targets,
    internals, moved names."""
    hooks = tuple(hook.target for hook in HOOKS_BY_RELEASE[table])
    moved = tuple(paths[table] for paths in MOVED.values() if table in paths)
    return hooks + INTERNALS[table] + moved


def missing_targets(targets: tuple[str, ...]) -> list[str]:
    """The dotted names among ``targets`` the installed SGLang does not define."""
    return [target for target in targets if not _exists(target)]


def _exists(target: str) -> bool:
    module_path, _, attribute = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(module_path)
    except (ImportError, AttributeError, ValueError):
        return False
    return hasattr(owner, attribute)


@cache
def check_release() -> str:
    """The tested release whose hook table and internals serve the installed SGLang.

    Raises :class:`UnsupportedSGLang` (one line: the installed release, the table tried and the
    first missing target) when the installed SGLang is not a tested release and lacks a target
    of the nearest tested release's table; on a tested release the targets are checked by the
    tests (``tests/test_plugin_registration.py``), not at every start-up.
    """
    version = installed_version()
    if version in RELEASES:
        return version
    table = table_release(version)
    tested = ", ".join(RELEASES)
    if table is None:
        raise UnsupportedSGLang(
            f"SGLang {version} is older than every release sglang-tree-spec supports ({tested})"
        )
    missing = missing_targets(declared_targets(table))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UnsupportedSGLang(
            f"SGLang {version} is not supported by sglang-tree-spec (tested: {tested}): "
            f"{missing[0]}{more}, which the plugin's SGLang {table} support needs, is missing"
        )
    logger.warning(
        "DDTREE: SGLang %s is untested (tested: %s); using the plugin's SGLang %s support "
        "(every target it needs is present)",
        version,
        tested,
        table,
    )
    return table


def check_worker_attributes(worker: Any) -> None:
    """Raise :class:`UnsupportedSGLang` (one line) when the constructed DFlash worker lacks an
    attribute of :data:`WORKER_ATTRIBUTES`."""
    missing = [name for name in WORKER_ATTRIBUTES if not hasattr(worker, name)]
    if missing:
        raise UnsupportedSGLang(
            f"SGLang {installed_version()}'s DFlashWorkerV2 has no {', '.join(missing)}, which "
            "the DDTREE worker needs"
        )


@cache
def _req_row() -> Callable[[Any], int | None]:
    return operator.attrgetter(REQ_ROW[check_release()])


def req_rows(reqs: list[Any]) -> list[int | None]:
    """Each request's ``req_to_token`` row (:data:`REQ_ROW`), from the host requests."""
    row = _req_row()
    return [row(req) for req in reqs]


def reserved_lens(batch: Any) -> Any:
    """``[bs]`` host tensor of the KV lengths SGLang reserved for a decode batch's step
    (:data:`RESERVED_LENS`), or None where the draft input has none."""
    return getattr(batch.spec_info, RESERVED_LENS[check_release()], None)


def isolation_key(req: Any) -> tuple[str | None, ...]:
    """The key SGLang separates ``req``'s prefix cache by (:data:`ISOLATION_KEY`); an empty
    string is no key, as in SGLang."""
    return tuple(getattr(req, name) or None for name in ISOLATION_KEY[check_release()])


def moved(name: str) -> Any:
    """``name`` from :data:`MOVED`, imported from the installed release's module (e.g.
    ``moved("verify_tree_greedy_func")``)."""
    return pkgutil.resolve_name(MOVED[name][check_release()])


def is_release(table: str) -> bool:
    """Whether the plugin runs with release ``table``'s tables (e.g. ``is_release("0.5.23")``)."""
    return check_release() == table


# ---------------------------------------------------------------------------------------------
# ServerArgs across releases: 0.5.17 resolves in ``__post_init__`` and writes the results into
# the record; 0.5.23 resolves in ``resolve_once()`` into declarations read through views, and
# hands a plugin's ``validate_server_args`` / ``handle_server_args`` a stand-in that reads
# through the resolving view and records its writes.
# ---------------------------------------------------------------------------------------------


def resolve(server_args: Any) -> Any:
    """Run SGLang's resolution on a freshly built record (0.5.23's ``resolve_once``; 0.5.17
    resolved it on construction); returns it."""
    resolve_once = getattr(server_args, "resolve_once", None)
    if resolve_once is not None:
        resolve_once()
    return server_args


def resolved(server_args: Any) -> Any:
    """What resolution decided (so far) for ``server_args``, read like a ServerArgs: the record
    itself on 0.5.17, its resolving view on 0.5.23 (a plugin stand-in as it is)."""
    if not is_release("0.5.23") or _is_stand_in(server_args):
        return server_args
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(server_args)


def resolution_view(server_args: Any) -> Any:
    """SGLang's mid-resolution view (declared overrides applied) inside a plugin validator."""
    if is_release("0.5.23"):
        return resolved(server_args)
    from sglang.srt.arg_groups.overrides import resolved_view

    return resolved_view(server_args)


def model_config(server_args: Any) -> Any:
    """The target's ``ModelConfig`` for ``server_args`` (a record, a view or a stand-in)."""
    if not is_release("0.5.23"):
        return server_args.get_model_config()
    from sglang.srt.arg_groups.overrides import model_config_of

    if _is_stand_in(server_args):
        server_args = object.__getattribute__(server_args, "_cfg")
    return model_config_of(server_args)


def _is_stand_in(server_args: Any) -> bool:
    """Whether ``server_args`` is 0.5.23's plugin stand-in (``overrides._ForeignDefaults``)."""
    return type(server_args).__name__ == "_ForeignDefaults"
