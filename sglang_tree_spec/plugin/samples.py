"""``n > 1`` with a ``sampling_seed``: each of the ``n`` samples gets its own coins.

DDTREE draws the coin of the token at position ``p`` of a seeded request as
``counter_uniforms(seed, p)`` (:class:`~sglang_tree_spec.step.Sampling`), so a seeded request
gives the same output at every budget. SGLang expands ``n = 2`` into two requests with the
same prompt and the same ``sampling_params`` (its child requests carry nothing else that tells
them apart), so both drew the same coins and returned the same sample. Plain SGLang (no
``--enable-deterministic-inference``, which the CPU backends cannot run) ignores the seed and
returns ``n`` independent samples.

Here the coin key includes the sample index: of the requests alive at once with the same seed
and prompt, the first prefilled is sample 0 (coins of ``seed`` itself, as a lone request), the
next sample 1, and so on (the lowest index no live sibling holds); sample ``i > 0`` draws its
coins with :func:`sample_seed` ``(seed, i)``. Each sample is still the target's own draw with
its coins; the ``n`` samples no longer share them. A request sent again after its siblings
finished is sample 0 again, so a seeded request still reproduces.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

SAMPLE_ATTRIBUTE = "_ddtree_sample"  # set on SGLang's Req: its sample index
_MASK = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The coin seed of sample ``index`` of a request seeded ``seed``: ``seed`` itself for
    sample 0, else a SplitMix64 mix of both, as a signed 64-bit int."""
    if index == 0:
        return seed
    x = ((seed & _MASK) * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def sample_index(req: Any) -> int:
    """The sample index :class:`SampleNumbers` gave ``req`` (0 when it gave none)."""
    return getattr(req, SAMPLE_ATTRIBUTE, 0)


class SampleNumbers:
    """Numbers the seeded requests of a server that share a seed and a prompt while alive.

    SGLang-agnostic beyond the duck-typed request: ``sampling_params.sampling_seed``,
    ``sampling_params.max_new_tokens``, ``origin_input_ids``, ``finished()``; the index is
    stored on the request (a retracted request keeps it when prefilled again).
    """

    def __init__(self) -> None:
        self._alive: dict[Hashable, list[Any]] = {}

    def number(self, reqs: Iterable[Any]) -> None:
        """Give each new seeded request of a prefill batch its sample index."""
        self._forget_finished()
        for req in reqs:
            params = req.sampling_params
            seed = params.sampling_seed
            if seed is None or hasattr(req, SAMPLE_ATTRIBUTE) or params.max_new_tokens == 0:
                continue  # unseeded, numbered already, or SGLang's prefix-caching request
            siblings = self._alive.setdefault((seed, tuple(req.origin_input_ids)), [])
            taken = {sample_index(other) for other in siblings}
            setattr(req, SAMPLE_ATTRIBUTE, min(set(range(len(taken) + 1)) - taken))
            siblings.append(req)

    def _forget_finished(self) -> None:
        for key in list(self._alive):
            alive = [req for req in self._alive[key] if not req.finished()]
            if alive:
                self._alive[key] = alive
            else:
                del self._alive[key]
