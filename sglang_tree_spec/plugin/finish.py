"""When a request finishes, decided as one-token decoding would have decided it.

A speculative step appends a whole accepted run to ``req.output_ids`` and SGLang then calls
``Req.update_finish_state(new_accepted_len)`` once for the run. Its checks come in an order that
is right for one token but not for a run:

- 0.5.17 tests the length first: a run that crosses ``max_new_tokens`` finishes on length even
  when a stop string or stop token completed earlier in the same run (the output runs past it);
- both releases test stop strings before stop tokens: a run holding EOS at position i and a stop
  string completed at j > i finishes at j, where one-token decoding stops at i.

The output then differs from the target alone. Here the run is checked token by token: the
original check called on each prefix of the run with ``new_accepted_len = 1``, stopping at the
first prefix that finishes, so the finish reason and ``finished_len`` are those of one-token
decoding (``finished_len`` trims the rest of the run as it does for SGLang's own multi-token
finishes). The cost is that of one-token decoding's checks, one per committed token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def update_finish_state_token_by_token(
    original: Callable[..., None], req: Any, new_accepted_len: int = 1
) -> None:
    """AROUND hook on ``Req.update_finish_state``; mirrored by
    ``patches/sglang-<release>/0015-finish-state-token-by-token.diff``.

    Reads and writes ``req.output_ids`` (a list or an ``array``); reads ``req.grammar`` and
    ``req.finished()``. Runs of 0 or 1 tokens (SGLang's own calls outside speculative
    decoding) go to the original unchanged, and so do grammar-constrained runs: their grammar
    state is already past the whole run (SGLang truncates the run where it terminates)."""
    if new_accepted_len <= 1 or req.grammar is not None or req.finished():
        original(req, new_accepted_len)
        return
    output_ids = req.output_ids
    start = len(output_ids) - new_accepted_len
    try:
        for end in range(start + 1, len(output_ids) + 1):
            req.output_ids = output_ids[:end]
            original(req, 1)
            if req.finished():
                break
    finally:
        # The checks may rewrite ids in place (an out-of-vocabulary id becomes a stop id).
        output_ids[: len(req.output_ids)] = req.output_ids
        req.output_ids = output_ids
