"""DDTREE's flags: SGLang's ``ServerArgs`` plus the ``--speculative-ddtree-*`` fields.

SGLang derives its CLI, its ``sglang.Engine(**kwargs)`` keywords and its per-process config
bags (``get_spec()``) from the ``ServerArgs`` dataclass fields. A REPLACE hook on the class
(:mod:`.hooks`) swaps in this subclass, so a DDTREE flag is parsed, documented in ``--help``,
accepted by ``sglang.Engine`` and pickled to every process like a built-in one. The fields are
declared once (:data:`DDTREE_FIELDS`); each release builds its class from them (0.5.17 a
dataclass, 0.5.23 a msgspec Struct). Mirrored by
``patches/sglang-0.5.17/0001-server-args-ddtree-flags.diff``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sglang.srt import server_args as sglang_server_args
from sglang.srt.arg_groups.arg_utils import NS, A, Arg

from sglang_tree_spec.plugin.validation import (
    ALGORITHM,
    DEFAULT_TABLE_PARTITIONS,
    GRAFT_CHOICES,
    TABLE_CHOICES,
    default_attention_backend,
)

TOPK_HELP = (
    "DDTREE only. Cap on the draft top-K per depth the tree is built from. Default: the tree "
    "budget (--speculative-num-draft-tokens minus one), which makes the tree exactly the "
    "budget's most probable prefixes; a smaller cap is faster and approximate."
)

GRAFT_HELP = (
    "DDTREE only. Graft retrieved tokens into the draft tree from one successor table shared "
    "by all requests (refreshed from every verify step's top-k): 'unified' chooses the tree "
    "best-first over drafted and retrieved tokens at the same budget; 'stage' is Graft's "
    "prune-then-graft rule (uncalibrated default thresholds). Outputs are unchanged. "
    "Default: 'none'."
)

TABLE_HELP = (
    "DDTREE only, with --speculative-ddtree-graft. Who shares the successor table (and the "
    "learnt edge acceptance) grafting reads: 'shared' (default): every request, so a "
    "request's acceptance length (its latency) can show that another tenant's requests "
    "produced its text recently; 'per-key': only requests with the same extra_key (the "
    "OpenAI API's cache_salt, the key SGLang separates prefix caches by; requests without "
    "one share one partition); 'off': no two requests, each reads only what its own prompt "
    "and verify steps wrote. Isolated keys get partitions of the table "
    "(--speculative-ddtree-table-partitions); outputs are unchanged in every mode."
)

TABLE_PARTITIONS_HELP = (
    "DDTREE only, with --speculative-ddtree-table per-key or off. Partitions of the successor "
    "table, each the size of a shared table (vocabulary x 8 x 4 bytes), one per isolation key "
    "at a time: a new key takes the least recently used partition not in the running batch, "
    "cleared first; a key that finds none grafts from an empty table until one frees up. "
    f"Default: {DEFAULT_TABLE_PARTITIONS}."
)


BUDGET_HELP = (
    "DDTREE only. 'auto' (default): the tree budget of the whole batch is chosen from the "
    "predicted accepted tokens per second (a surrogate read from the tree, calibrated on "
    "acceptance history, over a latency model profiled on this device), among the candidates "
    "up to --speculative-num-draft-tokens minus one, and held for a few decode steps of the "
    "same batch; 0 is a plain decode step. A number: that budget every step."
)

CANDIDATES_HELP = (
    "DDTREE only. The budgets 'auto' chooses from, comma-separated and increasing (default: "
    "0,4,8,16,32,64 up to the largest budget, and the largest budget)."
)


# The DDTREE fields as (name, annotation, default), declared once for every release's class:
# all optional, ignored by other algorithms; SGLang reads Arg / NS as for its own fields.
DDTREE_FIELDS: tuple[tuple[str, Any, Any], ...] = (
    ("speculative_ddtree_topk", A[int | None, Arg(help=TOPK_HELP), NS("spec")], None),
    (
        "speculative_ddtree_graft",
        A[str, Arg(help=GRAFT_HELP, choices=list(GRAFT_CHOICES)), NS("spec")],
        "none",
    ),
    (
        "speculative_ddtree_table",
        A[str, Arg(help=TABLE_HELP, choices=list(TABLE_CHOICES)), NS("spec")],
        "shared",
    ),
    (
        "speculative_ddtree_table_partitions",
        A[int | None, Arg(help=TABLE_PARTITIONS_HELP), NS("spec")],
        None,
    ),
    ("speculative_ddtree_budget", A[str, Arg(help=BUDGET_HELP), NS("spec")], "auto"),
    ("speculative_ddtree_candidates", A[str | None, Arg(help=CANDIDATES_HELP), NS("spec")], None),
)


def _declare_ddtree_fields(cls: type) -> type:
    """Give ``cls`` the :data:`DDTREE_FIELDS` as class-body annotations and defaults, for the
    dataclass decorator applied next."""
    cls.__annotations__ = {name: annotation for name, annotation, _ in DDTREE_FIELDS}
    for name, _, default in DDTREE_FIELDS:
        setattr(cls, name, default)
    return cls


_SGLangServerArgs: Any = sglang_server_args.ServerArgs

if dataclasses.is_dataclass(_SGLangServerArgs):  # SGLang 0.5.17

    @dataclasses.dataclass
    @_declare_ddtree_fields
    class DDTreeServerArgs(_SGLangServerArgs):
        """SGLang's ServerArgs with the DDTREE fields (all optional, ignored by other
        algorithms)."""

        @property
        def max_speculative_num_draft_tokens(self) -> int | None:
            """KV slots SGLang reserves per request and decode step.

            A DDTREE step writes the verify window (``--speculative-num-draft-tokens``) and,
            before it, the drafter's block at the same slots; the reservation covers the longer
            of the two, so a budget below the block size works (down to half the block:
            SGLang's DFlash decode reserves twice the window, see
            ``validation.check_window_covers_block``). Mirrored by
            ``patches/sglang-0.5.17/0010-ddtree-kv-reservation.diff``. (A plain property, not
            SGLang's cached one: the block size is filled in after the arguments are parsed.)
            On 0.5.23 the algorithm's ``resolve_max_speculative_num_draft_tokens`` does this.
            """
            tokens = super().max_speculative_num_draft_tokens
            block = self.speculative_dflash_block_size
            if self.speculative_algorithm == ALGORITHM and tokens is not None and block:
                return max(tokens, int(block))
            return tokens

        def _get_default_attn_backend(self, use_mla_backend: bool, model_config: Any) -> str:
            """SGLang's default attention backend, or for DDTREE the one it verifies trees on
            when SGLang's cannot (fa3 on Hopper: ``validation.default_attention_backend``).
            Mirrored by ``patches/sglang-0.5.17/0023-ddtree-default-attention-backend.diff``."""
            chosen = super()._get_default_attn_backend(use_mla_backend, model_config)
            return default_attention_backend(self.speculative_algorithm, self.device, chosen)

else:  # SGLang 0.5.23: a msgspec Struct assembled from per-namespace field classes
    import msgspec

    # As SGLang builds its own ServerArgs; dict=True as SGLang's (it keeps resolution
    # bookkeeping outside the fields).
    DDTreeServerArgs = msgspec.defstruct(
        "DDTreeServerArgs",
        DDTREE_FIELDS,
        bases=(_SGLangServerArgs,),
        module=__name__,
        namespace={"__doc__": "SGLang's ServerArgs with the DDTREE fields (all optional)."},
        dict=True,
    )


def req_to_token_headroom(original: Callable[..., int], *server_args: Any) -> int:
    """AROUND hook on ``mem_cache.allocation_sizing.get_req_to_token_extra_context_len``.

    A ``req_to_token`` row holds ``context_len + extra`` slots. A speculative decode step
    reserves ``get_alloc_reserve_per_decode`` (twice the per-step allocation) slots past the
    committed tokens, but at page size 1 ``extra`` is only ``4 +`` one allocation, so a
    DDTREE request with more than about ``context_len + 4 - (budget + 1)`` tokens wrote past
    its row (an IndexError on CPU, the neighbour's row on GPU; seen at budgets 8 and 32). For
    DDTREE the row holds the whole reservation. Mirrored by
    ``patches/sglang-0.5.17/0012-req-to-token-row-holds-the-decode-reservation.diff``.
    """
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

    # 0.5.17 passes ServerArgs; 0.5.23 takes no argument and reads the published bags.
    extra = original(*server_args)
    if _speculative_algorithm(*server_args) != ALGORITHM:
        return extra
    return max(extra, 4 + get_alloc_reserve_per_decode(*server_args))


def _speculative_algorithm(*server_args: Any) -> str | None:
    """``--speculative-algorithm`` from the given ServerArgs, else from the ``spec`` bag."""
    if server_args:
        return server_args[0].speculative_algorithm
    from sglang.srt.runtime_context import get_spec

    return get_spec().speculative_algorithm
