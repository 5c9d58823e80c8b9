"""The ``DDTREE`` speculative algorithm as SGLang sees it (``SpeculativeAlgorithm.register``).

:class:`DDTreeSpecAlgo` states DDTREE's capabilities to SGLang's scheduler, model runner and
KV-cache code, which dispatch on ``is_*()`` / ``supports_*()`` instead of on names:

* DFlash family (``is_dflash_family``): a DFlash drafter reads the target's hidden states at
  the drafter's ``target_layer_ids`` (SGLang captures them), keeps its context KV in the shared
  pool (SGLang sizes a KV cell for target + draft layers) and runs its block as a
  TARGET_VERIFY batch (``supports_target_verify_for_draft``). It is not SGLang's DFLASH chain
  (``is_dflash`` is False), so DFLASH's own worker and argument handling are never used.
* Overlap scheduling (``supports_overlap=True``): the worker drives SGLang's overlap
  scheduler as DFLASH's does (the next step's inputs come from SGLang's ``FutureMap``), and
  stays exact there (penalties included: ``plugin/pending.py``).
  :func:`.validation.apply_defaults` turns it off where DDTREE must run synchronously (on CPU,
  as SGLang does for its own algorithms, and for a verify window shorter than the drafter's
  block), with a warning saying why.
* No EAGLE top-k relay, no draft hidden states across disaggregation, no ragged verify, no
  grammar overlap (SGLang processes a grammar batch's previous result before the batch runs,
  so the worker masks each tree node from grammars that hold every committed token:
  :mod:`.grammar`).

SGLang 0.5.17's ``CustomSpecAlgo`` lacks three methods its scheduler calls on every
speculative algorithm (``create_future_map``, ``carries_draft_hidden_states``, ``need_topk``);
they are defined here (see ``patches/sglang-0.5.17/0003-custom-spec-algo-defaults.diff``).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

from sglang_tree_spec.plugin import validation
from sglang_tree_spec.plugin.validation import ALGORITHM


class DDTreeSpecAlgo(CustomSpecAlgo):
    """DDTREE: DFlash drafter, tree of the budget's best prefixes, one tree verify per step."""

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def handle_server_args(self, server_args: Any) -> None:
        validation.apply_defaults(server_args)

    def resolve_max_speculative_num_draft_tokens(self, server_args: Any) -> int | None:
        """KV slots SGLang 0.5.23 reserves per request and decode step (0.5.17 has no such
        method; ``DDTreeServerArgs.max_speculative_num_draft_tokens`` does it there): the
        longer of the verify window and the drafter's block, which a step writes at the same
        slots (see ``patches/sglang-0.5.17/0010-ddtree-kv-reservation.diff``)."""
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        tokens = cfg.speculative_num_draft_tokens
        block = validation.load_drafter(
            cfg.speculative_draft_model_path, cfg.speculative_draft_model_revision
        ).block_size
        return block if tokens is None else max(int(tokens), block)

    def get_num_tokens_per_req_for_target_verify(
        self, num_draft_tokens: int, is_draft_worker: bool
    ) -> int:
        """Target verify: root + budget nodes; drafter: one DFlash block."""
        if is_draft_worker:
            return int(_server_args().speculative_dflash_block_size)
        return num_draft_tokens

    def create_future_map(
        self,
        device: Any,
        req_to_token_pool: Any,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> Any:
        """SGLang's overlap relay buffers, built as for the builtin algorithms: host lengths
        are relayed only where an attention backend needs them (triton and flashinfer do not).
        DDTREE sizes its tree mask and the verify graph's metadata from host upper bounds
        (the step's KV reservation, ``backend.host_lengths``, as DFLASH does) when no host
        lengths come, so no step waits on the previous one's ``seq_lens``."""
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )


def worker_factory(server_args: Any) -> type:
    """The speculative worker class SGLang instantiates for DDTREE."""
    from sglang_tree_spec.plugin.worker import ddtree_worker_class

    return ddtree_worker_class()


def register_algorithm() -> None:
    """Register DDTREE once per process (SGLang refuses a second registration)."""
    if get_spec(ALGORITHM) is not None:
        return
    SpeculativeAlgorithm.register(
        ALGORITHM,
        supports_overlap=True,
        validate_server_args=validation.validate_server_args,
        spec_class=DDTreeSpecAlgo,
    )(worker_factory)


def _server_args() -> Any:
    """The process-wide ServerArgs SGLang published (scheduler and worker processes), as
    resolved (0.5.23 keeps resolved values in declarations, read through a view)."""
    from sglang.srt.runtime_context import get_server_args

    from sglang_tree_spec.plugin import compat

    return compat.resolved(get_server_args())
