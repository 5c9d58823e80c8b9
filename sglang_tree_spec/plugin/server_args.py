"""DDTREE's flags: SGLang's ``ServerArgs`` plus the ``--speculative-ddtree-*`` fields.

SGLang derives its CLI, its ``sglang.Engine(**kwargs)`` keywords and its per-process config
bags (``get_spec()``) from the ``ServerArgs`` dataclass fields. A REPLACE hook on the class
(:mod:`.hooks`) swaps in this subclass, so a DDTREE flag is parsed, documented in ``--help``,
accepted by ``sglang.Engine`` and pickled to every process like a built-in one. Mirrored by
``patches/sglang-0.5.17/0001-server-args-ddtree-flags.diff``.
"""

from __future__ import annotations

import dataclasses

from sglang.srt import server_args as sglang_server_args
from sglang.srt.arg_groups.arg_utils import NS, A, Arg

TOPK_HELP = (
    "DDTREE only. Cap on the draft top-K per depth the tree is built from. Default: the tree "
    "budget (--speculative-num-draft-tokens minus one), which makes the tree exactly the "
    "budget's most probable prefixes; a smaller cap is faster and approximate."
)


@dataclasses.dataclass
class DDTreeServerArgs(sglang_server_args.ServerArgs):
    """SGLang's ServerArgs with the DDTREE fields (all optional, ignored by other algorithms)."""

    speculative_ddtree_topk: A[int | None, Arg(help=TOPK_HELP), NS("spec")] = None
