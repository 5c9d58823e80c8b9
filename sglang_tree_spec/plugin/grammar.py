"""Grammar-constrained requests (JSON schema, regex, EBNF, structural tags) inside a tree verify.

SGLang compiles a request's grammar into ``req.grammar`` (a ``BaseGrammarObject``: xgrammar's
matcher by default) and, in one-token decoding, masks the target's logits by the tokens the
grammar allows next. A DDTREE verify scores a whole tree at once, so every window slot needs the
mask of the grammar state reached along its own path: the root (the bonus committed last step)
by the request's current state, a node by that state advanced over the tokens of its path.

:func:`tree_token_bitmask` walks each constrained request's tree depth first on the host, once
per step for the whole batch: at a slot it fills that slot's row of an xgrammar-layout bitmask
(``[bs * W, ceil(V / 32)]`` int32, bit ``t`` of a row set iff token ``t`` is allowed), then for
each child whose token the row allows it advances the grammar by that token, recurses and rolls
the token back, so the request's grammar ends the walk where it started. A child the row forbids
is never entered: the target gives its token probability 0 there, so it cannot be accepted and
its subtree's rows are never read. A slot whose grammar has terminated keeps an all-allowed row
(SGLang's one-token decoding leaves such a row unconstrained too; the request finishes there).

:func:`apply_token_bitmask` masks the ``[bs * W, V]`` verify logits with it (forbidden tokens to
``-inf``, as xgrammar's kernels do), on the logits' device. The acceptance rule reads the masked
logits unchanged: a forbidden draft token is never the target's argmax or sample, and the bonus
is drawn from the accepted slot's masked row.

The grammar is committed once, by SGLang: its scheduler advances ``req.grammar`` over every
committed token of a speculative result (``advance_grammar_fsm``, cutting the run where the
grammar terminates). DDTREE's algorithm does not claim SGLang's grammar overlap, so the scheduler
processes a constrained batch's previous result before the next step starts, and the walk reads
the state every committed token has reached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

BITS = 32  # tokens per word of xgrammar's bitmask layout


def bitmask_words(vocab_size: int) -> int:
    """Words of one bitmask row for ``vocab_size`` tokens."""
    return -(-int(vocab_size) // BITS)


def constrained(reqs: Sequence[Any]) -> bool:
    """Whether any request of a batch carries a grammar."""
    return any(getattr(req, "grammar", None) is not None for req in reqs)


def slot_parents(ancestor_mask: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """``[bs, W]`` int64 parent slot of every window slot (the root: -1) from a verify layout:
    slot ``j`` is slot ``i``'s parent iff it is an ancestor of ``i`` one level up."""
    one_up = depths[:, None, :] == depths[:, :, None] - 1  # [bs, i, j]
    parent = (ancestor_mask & one_up).to(torch.int8).argmax(dim=-1)
    return torch.where(depths == 0, torch.full_like(parent, -1), parent)


def tree_token_bitmask(
    grammars: Sequence[Any | None],
    tokens: torch.Tensor,
    parents: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor | None:
    """The ``[bs * W, words]`` int32 host bitmask of every slot of a batch's verify windows.

    Args:
        grammars: each request's grammar object (``req.grammar``) or None (unconstrained: its
            rows allow every token).
        tokens: ``[bs, W]`` the window's tokens (slot 0: the root).
        parents: ``[bs, W]`` each slot's parent slot (:func:`slot_parents`; root -1).
        vocab_size: tokens the grammar's mask covers (SGLang's ``sampling_info.vocab_size``).

    Returns None when no request is constrained. Each grammar is left in the state it had.
    """
    rows = [b for b, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return None
    bs, window = tokens.shape
    mask = torch.full((bs * window, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    words = mask.numpy()  # the same memory: per-bit reads without tensor indexing
    host_tokens = tokens[rows].tolist()  # one host copy of the constrained rows
    host_parents = parents[rows].tolist()
    for row, slot_tokens, slot_parent in zip(rows, host_tokens, host_parents, strict=True):
        _walk(grammars[row], slot_tokens, slot_parent, mask, words, row * window, vocab_size)
    return mask


def _walk(
    grammar: Any,
    tokens: list[int],
    parents: list[int],
    mask: torch.Tensor,
    words: np.ndarray,
    base: int,
    vocab_size: int,
) -> None:
    """Fill rows ``base .. base + W - 1`` of ``mask`` for one request's window (see the module
    docstring), advancing ``grammar`` along each path and rolling it back."""
    if grammar.is_terminated():
        return
    children: list[list[int]] = [[] for _ in tokens]
    for slot in range(1, len(tokens)):
        children[parents[slot]].append(slot)
    grammar.fill_vocab_mask(mask, base)
    stack = [(0, iter(children[0]))]  # (slot, its children still to visit)
    while stack:
        slot, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            if stack:  # leave the slot: its token off the grammar again
                grammar.rollback(1)
            continue
        token = tokens[child]
        if not (0 <= token < vocab_size and _allowed(words[base + slot], token)):
            continue
        grammar.accept_token(token)
        if grammar.is_terminated():  # the path ends here (its row stays all-allowed)
            grammar.rollback(1)
            continue
        grammar.fill_vocab_mask(mask, base + child)
        stack.append((child, iter(children[child])))


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // BITS]) >> (token % BITS)) & 1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every token a row of ``bitmask [N, words]`` forbids to ``-inf`` in ``logits [N, V]``,
    in place on the logits' device; columns past the bitmask's ``words * 32`` are forbidden."""
    vocab = logits.shape[-1]
    device_mask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)
    bits = (device_mask[:, :, None] >> shifts) & 1  # [N, words, 32]
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits.masked_fill_(~allowed, float("-inf"))


def mask_verify_logits(
    reqs: Sequence[Any],
    logits: torch.Tensor,
    tokens: torch.Tensor,
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    vocab_size: int,
) -> None:
    """Mask a decode batch's ``[bs * W, V]`` verify logits in place by each slot's grammar
    state (nothing when no request is constrained)."""
    grammars = [getattr(req, "grammar", None) for req in reqs]
    if all(grammar is None for grammar in grammars):
        return
    parents = slot_parents(ancestor_mask, depths)
    bitmask = tree_token_bitmask(grammars, tokens.cpu(), parents.cpu(), vocab_size)
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
