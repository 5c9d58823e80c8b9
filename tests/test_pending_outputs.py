"""Output tokens the host has not seen yet (overlap scheduling): ``plugin/pending.py`` and
``TreePenalties.with_missing``.

Under SGLang's overlap scheduler a decode step starts before the previous step's result is
appended to ``req.output_ids``. The worker's :class:`RecentOutputs` keeps every request row's
output count and newest tokens on the device; the penalty state built from the lagging host
lists plus the missing tokens must equal the state built from the complete output, bit for bit.
"""

from __future__ import annotations

import random

import torch

from sglang_tree_spec.plugin.pending import RecentOutputs
from sglang_tree_spec.tree.penalties import TreePenalties

VOCAB = 7


def state(outputs: list[list[int]]) -> TreePenalties:
    bs = len(outputs)
    return TreePenalties.from_outputs(
        outputs,
        [0.3 + 0.1 * b for b in range(bs)],
        [0.7] * bs,
        [1.3 + 0.2 * b for b in range(bs)],
        [9] * bs,
        [[2]] * bs,
        VOCAB,
        "cpu",
    )


def assert_same(got: TreePenalties, want: TreePenalties) -> None:
    for name in ("base_frequency", "base_presence", "base_repetition", "output_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def simulate(seed: int, overlap: bool) -> None:
    """Requests in rows of a pool run prefill then decode steps committing 1..width tokens;
    the host lists lag one step when ``overlap``. At every step the penalty state from the
    lagging lists plus the missing tokens equals the one from the true outputs."""
    rng = random.Random(seed)
    width = 4
    recent = RecentOutputs(rows=6, width=width, device="cpu")
    rows = torch.tensor([4, 1, 3])
    truth: list[list[int]] = [[], [], [rng.randrange(VOCAB) for _ in range(3)]]  # row 3: retracted
    host = [list(out) for out in truth]
    first = torch.tensor([rng.randrange(VOCAB) for _ in truth])
    recent.prefilled(rows, first, [len(out) for out in host])
    for out, token in zip(truth, first.tolist(), strict=True):
        out.append(token)
    if not overlap:
        host = [list(out) for out in truth]
    for _ in range(12):
        tokens, valid, counts = recent.missing(rows, [len(out) for out in host])
        assert counts.tolist() == [len(out) for out in truth]
        assert_same(state(host).with_missing(tokens, valid, counts), state(truth))
        lens = torch.tensor([rng.randint(1, width) for _ in truth])
        step = torch.tensor([[rng.randrange(VOCAB) for _ in range(width)] for _ in truth])
        step[torch.arange(width)[None, :] >= lens[:, None]] = -1  # -1 past the run, as served
        host = [list(out) for out in truth]  # the previous step is processed now
        recent.committed(rows, step.clamp_min(0), lens)
        for out, run, n in zip(truth, step.tolist(), lens.tolist(), strict=True):
            out.extend(run[:n])
        if not overlap:
            host = [list(out) for out in truth]


def test_lagging_outputs_plus_missing_tokens_equal_the_true_outputs():
    for seed in range(20):
        simulate(seed, overlap=True)


def test_without_lag_nothing_is_missing():
    for seed in range(5):
        simulate(seed, overlap=False)


def test_missing_tokens_change_the_state():
    """Not vacuous: dropping the missing tokens gives another state."""
    truth = [[1, 2, 2, 5], [3]]
    host = [[1, 2], [3]]
    lagging = state(host)
    assert not torch.equal(lagging.base_frequency, state(truth).base_frequency)
    recent = RecentOutputs(rows=2, width=3, device="cpu")
    rows = torch.tensor([0, 1])
    recent.prefilled(rows, torch.tensor([1, 3]), [0, 0])
    recent.committed(rows, torch.tensor([[2, 0], [0, 0]]), torch.tensor([1, 0]))
    recent.committed(rows, torch.tensor([[2, 5], [0, 0]]), torch.tensor([2, 0]))
    tokens, valid, counts = recent.missing(rows, [2, 1])
    assert valid.tolist() == [[False, True, True], [False, False, False]]
    assert tokens[0, 1:].tolist() == [2, 5] and counts.tolist() == [4, 1]
    assert_same(lagging.with_missing(tokens, valid, counts), state(truth))
