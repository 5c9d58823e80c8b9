"""Start-up validation and defaults of DDTREE server arguments.

SGLang calls :func:`validate_server_args` (registered as ``validate_server_args=`` of the
algorithm) from ``ServerArgs.__post_init__``, after the device, attention backend and page size
are resolved and before the algorithm's ``handle_server_args`` (:func:`apply_defaults`). Every
refused configuration raises :class:`DDTreeConfigError` with one line that names the flag.

The tree budget is ``--speculative-num-draft-tokens`` minus one (the root is the bonus token);
the draft block size comes from the drafter's config.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, Qwen3Config

from sglang_tree_spec.config import GRAFT_POLICIES, TreeConfig
from sglang_tree_spec.drafters.dflash import (
    ARCHITECTURE,
    CONFIG_NAME,
    DFlashDrafter,
    DrafterConfigError,
    non_neutral_fields,
)
from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.cpu import triton_interpreted

logger = logging.getLogger(__name__)

ALGORITHM = "DDTREE"
MIN_BUDGET = 1
MAX_BUDGET = 1024
# Attention backends whose verify path the DDTREE worker targets, per device: triton and
# flashinfer honour a custom tree mask in TARGET_VERIFY on CUDA; on CPU the plugin supplies
# a verify-capable torch backend behind torch_native, and SGLang's triton backend runs there
# under Triton's interpreter (TRITON_INTERPRET=1, for tests: see plugin/interpreter.py).
SUPPORTED_ATTENTION_BACKENDS: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "flashinfer"),
    "cpu": ("torch_native", "triton"),
}
INTERPRETED_ATTENTION_BACKENDS: dict[str, tuple[str, ...]] = {"cpu": ("triton",)}
# DDTREE's backend when none is given and SGLang's default is not one of the above: triton, which
# keeps no plan workspace per captured verify shape (flashinfer: 8 MiB per batch size and budget).
DEFAULT_ATTENTION_BACKENDS: dict[str, str] = {"cuda": "triton"}
# Why SGLang's default cannot verify a tree, per backend it may choose on CUDA (fa3: Hopper's).
UNSUPPORTED_DEFAULT_REASONS: dict[str, str] = {
    "fa3": (
        "its target verify reads no custom mask at --speculative-eagle-topk 1 (DDTREE's), so "
        "a tree would be verified as a causal chain"
    ),
}
# Whether DDTREE keeps CUDA graphs on a GPU: its target-verify graphs carry the tree mask, one per
# (batch size, budget) (plugin/graphs.py; --disable-cuda-graph turns them off as for any server);
# launch/gpu-validate.sh states it in its plan and checks the servers' logs.
TREE_MASK_CUDA_GRAPHS = True


GRAFT_CHOICES = GRAFT_POLICIES  # --speculative-ddtree-graft
# --speculative-ddtree-table: who shares Graft's successor table. "shared": every request;
# "per-key": requests of one SGLang extra_key (OpenAI cache_salt) only; "off": no two requests.
TABLE_CHOICES = ("shared", "per-key", "off")
DEFAULT_TABLE_PARTITIONS = 8  # --speculative-ddtree-table-partitions (per-key and off)
MAX_TABLE_PARTITIONS = 4096


class DDTreeConfigError(ValueError):
    """A DDTREE configuration SGLang must refuse at start-up (one-line message)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{ALGORITHM}: {message}")


# ---------------------------------------------------------------------------------------------
# Validation (no mutation)
# ---------------------------------------------------------------------------------------------


def validate_server_args(server_args: Any) -> None:
    """Refuse a configuration DDTREE cannot serve; cheap checks first, the drafter last."""
    check_draft_model_path(server_args.speculative_draft_model_path)
    check_budget(server_args.speculative_num_draft_tokens)
    check_topk(getattr(server_args, "speculative_ddtree_topk", None))
    check_graft(getattr(server_args, "speculative_ddtree_graft", "none"))
    check_table(
        getattr(server_args, "speculative_ddtree_table", "shared"),
        getattr(server_args, "speculative_ddtree_table_partitions", None),
    )
    tree_config(server_args)  # budget mode and candidates against the largest budget
    view = _resolved(server_args)
    check_device(view.device)
    check_attention_backends(view.device, *_attention_backends(view))
    check_page_size(view.page_size, view.device)
    check_parallelism(view.tp_size, view.pp_size, bool(view.enable_dp_attention))
    drafter = load_drafter(
        server_args.speculative_draft_model_path, server_args.speculative_draft_model_revision
    )
    check_served_drafter_fields(drafter, compat.release())
    check_drafter_matches_target(drafter, compat.model_config(server_args).hf_config)
    check_block_size(drafter, server_args.speculative_dflash_block_size)
    check_window_covers_block(server_args.speculative_num_draft_tokens, drafter.block_size)


def check_draft_model_path(path: str | None) -> None:
    """A DFlash drafter is required."""
    if not path:
        raise DDTreeConfigError(
            "--speculative-draft-model-path is required (a DFlash drafter checkpoint)"
        )


def check_budget(num_draft_tokens: int | None) -> None:
    """Budget = num_draft_tokens - 1 must lie in [MIN_BUDGET, MAX_BUDGET] (None: default)."""
    if num_draft_tokens is None:
        return
    budget = int(num_draft_tokens) - 1
    if not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise DDTreeConfigError(
            f"tree budget {budget} (--speculative-num-draft-tokens {num_draft_tokens} minus the "
            f"root) is out of range [{MIN_BUDGET}, {MAX_BUDGET}]"
        )


def tree_config(server_args: Any) -> TreeConfig:
    """The :class:`TreeConfig` of DDTREE's flags (``--speculative-num-draft-tokens`` is the
    largest budget plus the root; the drafter's block when unset)."""
    tokens = server_args.speculative_num_draft_tokens
    largest = int(tokens) - 1 if tokens is not None else MAX_BUDGET
    mode = str(getattr(server_args, "speculative_ddtree_budget", "auto"))
    if mode != "auto" and not (mode.isdigit() and int(mode) <= largest):
        raise DDTreeConfigError(
            f"--speculative-ddtree-budget must be 'auto' or a number in [0, {largest}] (the "
            f"largest budget, --speculative-num-draft-tokens minus one), got {mode!r}"
        )
    candidates = getattr(server_args, "speculative_ddtree_candidates", None)
    try:
        return TreeConfig(
            budget=largest if mode == "auto" else int(mode),
            topk=getattr(server_args, "speculative_ddtree_topk", None),
            graft=getattr(server_args, "speculative_ddtree_graft", "none"),
            table_partitions=table_partitions(server_args),
            auto=mode == "auto",
            candidates=tuple(int(c) for c in candidates.split(",")) if candidates else None,
        )
    except ValueError as error:
        raise DDTreeConfigError(f"--speculative-ddtree-candidates: {error}") from None


def check_topk(topk: int | None) -> None:
    """``--speculative-ddtree-topk`` caps the draft top-K per depth; it must be positive."""
    if topk is not None and int(topk) < 1:
        raise DDTreeConfigError(f"--speculative-ddtree-topk must be >= 1, got {topk}")


def check_graft(graft: str) -> None:
    """``--speculative-ddtree-graft`` names a graft method the worker serves."""
    if graft not in GRAFT_CHOICES:
        raise DDTreeConfigError(
            f"--speculative-ddtree-graft must be one of {', '.join(GRAFT_CHOICES)}, got {graft!r}"
        )


def check_table(mode: str, partitions: int | None) -> None:
    """``--speculative-ddtree-table`` names an isolation mode, and
    ``--speculative-ddtree-table-partitions`` is a count in ``[1, MAX_TABLE_PARTITIONS]``."""
    if mode not in TABLE_CHOICES:
        raise DDTreeConfigError(
            f"--speculative-ddtree-table must be one of {', '.join(TABLE_CHOICES)}, got {mode!r}"
        )
    if partitions is not None and not 1 <= int(partitions) <= MAX_TABLE_PARTITIONS:
        raise DDTreeConfigError(
            f"--speculative-ddtree-table-partitions must be in [1, {MAX_TABLE_PARTITIONS}], "
            f"got {partitions}"
        )


def table_partitions(server_args: Any) -> int:
    """Partitions of Graft's table: 1 when it is shared, else
    ``--speculative-ddtree-table-partitions`` (default :data:`DEFAULT_TABLE_PARTITIONS`)."""
    if getattr(server_args, "speculative_ddtree_table", "shared") == "shared":
        return 1
    partitions = getattr(server_args, "speculative_ddtree_table_partitions", None)
    return DEFAULT_TABLE_PARTITIONS if partitions is None else int(partitions)


def check_device(device: str) -> None:
    """DDTREE serves on CUDA and on CPU."""
    if device not in SUPPORTED_ATTENTION_BACKENDS:
        raise DDTreeConfigError(
            f"device {device!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ATTENTION_BACKENDS)})"
        )


def check_attention_backends(device: str, prefill: str | None, decode: str | None) -> None:
    """Prefill and decode attention backends must be ones the tree verify runs on."""
    supported = SUPPORTED_ATTENTION_BACKENDS[device]
    interpreted = INTERPRETED_ATTENTION_BACKENDS.get(device, ())
    for role, backend in (("prefill", prefill), ("decode", decode)):
        if backend is not None and backend not in supported:
            raise DDTreeConfigError(
                f"{role} attention backend {backend!r} is not supported on {device} "
                f"(use --attention-backend {' or '.join(supported)})"
            )
        if backend in interpreted and not triton_interpreted():
            others = [name for name in supported if name not in interpreted]
            raise DDTreeConfigError(
                f"{role} attention backend {backend!r} runs on {device} only under Triton's "
                f"interpreter (set TRITON_INTERPRET=1, or use --attention-backend "
                f"{' or '.join(others)})"
            )


def default_attention_backend(algorithm: str | None, device: str, chosen: str) -> str:
    """The attention backend a server without ``--attention-backend`` gets: SGLang's default
    ``chosen``, except for DDTREE when DDTREE cannot verify a tree on it (fa3, SGLang's default
    on Hopper): then :data:`DEFAULT_ATTENTION_BACKENDS` for the device, said in one log line.
    An explicit unsupported backend is still refused by :func:`check_attention_backends`."""
    fallback = DEFAULT_ATTENTION_BACKENDS.get(device)
    if (algorithm or "").upper() != ALGORITHM or fallback is None:
        return chosen
    if chosen in SUPPORTED_ATTENTION_BACKENDS[device]:
        return chosen
    reason = UNSUPPORTED_DEFAULT_REASONS.get(
        chosen, f"DDTREE verifies trees on {' or '.join(SUPPORTED_ATTENTION_BACKENDS[device])} only"
    )
    logger.info(
        "%s: --attention-backend not given; using %s instead of SGLang's default %s on %s: %s",
        ALGORITHM,
        fallback,
        chosen,
        device,
        reason,
    )
    return fallback


def around_default_attention_backend(
    original: Any, server_args: Any, use_mla_backend: bool, model_config: Any
) -> str:
    """AROUND hook on SGLang 0.5.23's ``arg_groups.overrides.get_default_attn_backend`` (the
    name ``_attention_backend_default`` calls): :func:`default_attention_backend` of SGLang's
    choice. Mirrored by ``patches/sglang-0.5.23/0023-ddtree-default-attention-backend.diff``;
    on 0.5.17 ``DDTreeServerArgs._get_default_attn_backend`` does it."""
    chosen = original(server_args, use_mla_backend, model_config)
    return default_attention_backend(server_args.speculative_algorithm, server_args.device, chosen)


def check_page_size(page_size: int | None, device: str) -> None:
    """Any page size: the verify window, the drafter's block and the accepted path's KV moves
    address KV through the request's ``req_to_token`` row (position -> slot), which SGLang's
    paged allocator fills page by page, so the accepted nodes' KV moves to the committed
    positions' slots inside the request's own pages as at page size 1. On CPU, SGLang 0.5.17
    (and the releases served with its tables) allocates pages only with a Triton kernel
    (``mem_cache/allocator/paged.py``: ``alloc_extend_kernel``, ``alloc_decode_kernel``), which
    runs there under Triton's interpreter alone; 0.5.23 falls back to torch on a platform
    without Triton."""
    if page_size is None or int(page_size) <= 1 or device != "cpu" or triton_interpreted():
        return
    if compat.is_release("0.5.17"):
        raise DDTreeConfigError(
            f"--page-size {page_size} on cpu needs Triton's interpreter: SGLang "
            f"{compat.installed_version()} allocates KV pages with a Triton kernel only (set "
            "TRITON_INTERPRET=1, or use --page-size 1)"
        )


def check_parallelism(tp_size: int, pp_size: int, enable_dp_attention: bool) -> None:
    """Any TP size (the draft top-K merges the vocab-parallel LM head's shards); like SGLang's
    DFlash path, no pipeline parallelism, no DP attention."""
    if int(tp_size) < 1:
        raise DDTreeConfigError(f"--tp-size must be at least 1, got {tp_size}")
    if int(pp_size) != 1:
        raise DDTreeConfigError(f"--pp-size {pp_size} is not supported (use --pp-size 1)")
    if enable_dp_attention:
        raise DDTreeConfigError("--enable-dp-attention is not supported")


def check_drafter_matches_target(drafter: DFlashDrafter, target_config: PretrainedConfig) -> None:
    """The drafter's sizes, vocabulary, target layers and mask token fit the target."""
    try:
        drafter.check_compatible(target_config)
    except ValueError as exc:
        raise DDTreeConfigError(str(exc)) from None
    last = int(getattr(target_config, "text_config", target_config).num_hidden_layers) - 1
    if last in drafter.target_layer_ids:
        raise DDTreeConfigError(
            f"the drafter reads the target's last layer ({last}); SGLang captures hidden states "
            "before a layer, so the last layer's output cannot reach the drafter"
        )


# The drafter's output fields (drafters/dflash.py COMPUTE_FIELDS: input_embedding_scale,
# output_multiplier, final_logit_softcapping) that a DDTREE server honours, per SGLang release.
# The served draft is SGLang's own DFlashDraftModel (sglang/srt/models/dflash.py) for the hidden
# states, fed the target's embedding module's output, and the plugin's top-K over the target's
# LM head weight (plugin/backend.py draft_topk). Neither SGLang release applies any of the three
# to a DFlash v1 drafter: 0.5.17 reads none of them; 0.5.23 parses output_multiplier and
# final_logit_softcapping (speculative/dflash_utils.py parse_dflash_draft_config) but applies
# them only to DFlash2's candidate-selector logits (DFlash2DraftModel._transform_unary_logits),
# and reads no input_embedding_scale; plugin/backend.py applies none. A field is added here once
# the served path applies it with the reference's semantics (DFlashDrafter.output_logits and
# DFlashDrafter.forward).
SERVED_DRAFTER_FIELDS: dict[str, tuple[str, ...]] = {"0.5.17": (), "0.5.23": ()}


def check_served_drafter_fields(drafter: DFlashDrafter, release: str) -> None:
    """Refuse a drafter activation SGLang's DFlash model lacks, and a drafter that sets an
    output field to a value that changes its drafts
    (:func:`~sglang_tree_spec.drafters.dflash.non_neutral_fields`) when a DDTREE server on SGLang
    ``release`` (a table release of :mod:`compat`) would ignore it: the served tree would be
    built from other marginals than the drafter's (still exact, silently slower)."""
    hidden_act = getattr(drafter.config, "hidden_act", "silu")
    if hidden_act != "silu":  # both releases' DFlashMLP raise on it (0.5.23 adds swigluoai)
        raise DDTreeConfigError(
            f"the drafter's hidden_act={hidden_act!r} is not supported by SGLang {release}'s "
            "DFlash drafter (silu only)"
        )
    honoured = SERVED_DRAFTER_FIELDS.get(release, ())
    for name, value in non_neutral_fields(drafter.config).items():
        if name not in honoured:
            raise DDTreeConfigError(
                f"the drafter sets dflash_config.{name}={value}, which a DDTREE server on SGLang "
                f"{release} ignores (its drafts would not be the drafter's; the reference engine "
                "honours it)"
            )


def check_block_size(drafter: DFlashDrafter, requested: int | None) -> None:
    """``--speculative-dflash-block-size``, if given, must equal the drafter's block size."""
    if requested is not None and int(requested) != drafter.block_size:
        raise DDTreeConfigError(
            f"--speculative-dflash-block-size {requested} differs from the drafter's "
            f"block_size {drafter.block_size}"
        )


def check_window_covers_block(num_draft_tokens: int | None, block_size: int) -> None:
    """The drafter's block must fit in the KV slots SGLang reserves per decode step.

    SGLang's DFlash decode reserves ``2 * --speculative-num-draft-tokens`` slots past each
    request's committed tokens; a DDTREE step writes the drafter's block of ``block_size``
    tokens there before the tree window, so ``2 * (budget + 1) >= block_size`` (None: the
    default budget, block_size - 1).
    """
    if num_draft_tokens is None or 2 * int(num_draft_tokens) >= block_size:
        return
    smallest = -(-block_size // 2)  # ceil(block / 2) window slots
    raise DDTreeConfigError(
        f"tree budget {int(num_draft_tokens) - 1} is too small for the drafter's block of "
        f"{block_size} (the step writes the block into the 2 x (budget + 1) KV slots SGLang "
        f"reserves); use --speculative-num-draft-tokens {smallest} or more"
    )


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def refuse_inexact_requests(original: Any, req: Any, enable_overlap: bool) -> str | None:
    """AROUND hook on ``speculative.dflash_utils.validate_dflash_request``: a DDTREE server
    finishes a request it cannot decode exactly at once, with the reason (an HTTP 400);
    SGLang's own reasons name DDTREE instead of DFLASH. ``return_logprob`` (refused by SGLang
    0.5.17's DFLASH), penalties, ``min_new_tokens`` and grammars are served exactly: the worker
    reads the committed tokens' log-probs from the verify logits, penalises every tree node by
    its own path (:mod:`sglang_tree_spec.plugin.penalties`) and masks it by the grammar state
    of its own path (:mod:`sglang_tree_spec.plugin.grammar`; on a CPU with SGLang 0.5.17,
    through the xgrammar hooks of :mod:`sglang_tree_spec.plugin.cpu`). Mirrored by
    ``patches/sglang-<release>/0013-dflash-refuses-penalties.diff``."""
    from sglang.srt.runtime_context import get_server_args

    error = original(req, enable_overlap)
    if get_server_args().speculative_algorithm != ALGORITHM:
        return error
    if error is not None and not (req.return_logprob and "return_logprob" in error):
        return error.replace("DFLASH", ALGORITHM)
    return None


# ---------------------------------------------------------------------------------------------
# Drafter config
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def load_drafter(path: str, revision: str | None = None) -> DFlashDrafter:
    """A weightless (meta-device) :class:`DFlashDrafter` from the config at ``path``.

    ``path`` is a local checkpoint directory or a Hugging Face repo id. Raises
    :class:`DDTreeConfigError` when the config is unreadable, not a DFlash drafter, or a DFlash
    variant the drafter does not implement.
    """
    raw = read_drafter_config(path, revision)
    architectures = raw.get("architectures") or []
    if not any("DFlash" in name for name in architectures):  # other DFlash kinds: named below
        raise DDTreeConfigError(
            f"--speculative-draft-model-path {path} is not a DFlash drafter "
            f"(architectures={architectures}, expected {ARCHITECTURE})"
        )
    try:
        with torch.device("meta"):
            drafter = DFlashDrafter(Qwen3Config.from_dict(raw))
    except DrafterConfigError as exc:
        raise DDTreeConfigError(f"--speculative-draft-model-path {path}: {exc.detail}") from None
    except (ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split())
        raise DDTreeConfigError(f"unsupported DFlash drafter {path}: {reason}") from None
    if drafter.dflash2 and not compat.SERVES_DFLASH2[compat.release()]:
        raise DDTreeConfigError(
            f"--speculative-draft-model-path {path}: DFlash drafter architectures={architectures} "
            f"needs SGLang's DFlash2 model, which SGLang {compat.installed_version()} does not "
            "have (0.5.23 has it)"
        )
    return drafter


def read_drafter_config(path: str, revision: str | None = None) -> dict[str, Any]:
    """The drafter's ``config.json`` as a dict (local directory or Hugging Face repo)."""
    try:
        local = Path(path) / CONFIG_NAME
        if local.is_file():
            return json.loads(local.read_text())
        if Path(path).exists():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {path}")
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(path, CONFIG_NAME, revision=revision)).read_text())
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DDTreeConfigError(f"cannot read the drafter config of {path}: {reason}") from None


# ---------------------------------------------------------------------------------------------
# Defaults (mutation; the algorithm's handle_server_args)
# ---------------------------------------------------------------------------------------------


def apply_defaults(server_args: Any) -> None:
    """Fill DDTREE's defaults into validated server args (in place)."""
    drafter = load_drafter(
        server_args.speculative_draft_model_path, server_args.speculative_draft_model_revision
    )
    server_args.speculative_num_steps = 1
    server_args.speculative_eagle_topk = 1
    server_args.speculative_dflash_block_size = drafter.block_size
    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = drafter.block_size
        logger.info(
            "%s: --speculative-num-draft-tokens not set; using the drafter block size %d "
            "(tree budget %d)",
            ALGORITHM,
            drafter.block_size,
            drafter.block_size - 1,
        )
    reason = no_overlap_reason(
        server_args.device, int(server_args.speculative_num_draft_tokens), drafter.block_size
    )
    if reason is not None:
        disable_overlap(server_args, reason)
    if (
        server_args.device == "cpu"
        and server_args.speculative_draft_attention_backend is None
        and _prefill_backend(server_args) != "triton"  # interpreted (checked by validation)
    ):
        server_args.speculative_draft_attention_backend = "torch_native"  # SGLang picks a GPU one
    if server_args.enable_mixed_chunk:
        server_args.enable_mixed_chunk = False
        logger.warning("%s: mixed chunked prefill is disabled", ALGORITHM)


def _prefill_backend(server_args: Any) -> str | None:
    """The prefill attention backend asked for (SGLang's drafter defaults to it)."""
    prefill = getattr(server_args, "prefill_attention_backend", None)
    return prefill or getattr(server_args, "attention_backend", None)


CPU_OVERLAP_ENV = "SGLANG_TREE_SPEC_CPU_OVERLAP"
"""Test switch: ``1`` keeps SGLang's overlap scheduler for DDTREE on CPU (SGLang 0.5.23), where
DDTREE, like SGLang's own speculative algorithms, otherwise runs synchronously."""


def cpu_overlap_requested() -> bool:
    """Whether the tests asked for overlap scheduling on CPU (:data:`CPU_OVERLAP_ENV`)."""
    return os.environ.get(CPU_OVERLAP_ENV, "0") == "1"


def no_overlap_reason(device: str, num_draft_tokens: int, block_size: int) -> str | None:
    """Why DDTREE must run without SGLang's overlap scheduler, or None when it may overlap.

    * On CPU SGLang runs speculative decoding synchronously (its own algorithms call
      ``_disable_overlap_schedule_for_cpu``); a CPU device does not run ahead of the host, so
      overlap gains nothing there. :data:`CPU_OVERLAP_ENV` keeps it for tests.
    * Under overlap the scheduler reserves a step's KV slots (2 x the verify window past the
      committed tokens) before the previous step's accepted tokens are known, so that step may
      already have taken up to a window of them; a step writes the longer of the window and
      the drafter's block. A window shorter than the block would write past the reservation.
    """
    if device == "cpu" and not cpu_overlap_requested():
        return "SGLang runs speculative decoding on CPU without it"
    if num_draft_tokens < block_size:
        return (
            f"--speculative-num-draft-tokens {num_draft_tokens} is shorter than the drafter's "
            f"block ({block_size}): a step's KV writes could pass SGLang's overlap reservation "
            f"(give at least {block_size} for overlap scheduling)"
        )
    return None


def disable_overlap(server_args: Any, reason: str) -> None:
    """Run DDTREE synchronously (SGLang's ``--disable-overlap-schedule``), saying why."""
    if not server_args.disable_overlap_schedule:
        server_args.disable_overlap_schedule = True
        logger.warning("%s: overlap scheduling disabled: %s", ALGORITHM, reason)


# ---------------------------------------------------------------------------------------------
# SGLang adapters
# ---------------------------------------------------------------------------------------------


def _resolved(server_args: Any) -> Any:
    """SGLang's mid-resolution view of ``server_args`` (declared overrides applied)."""
    return compat.resolution_view(server_args)


def _attention_backends(view: Any) -> tuple[str | None, str | None]:
    """(prefill, decode) attention backends of a resolved view."""
    from sglang.srt.arg_groups.overrides import attention_backends_of

    return attention_backends_of(view)
