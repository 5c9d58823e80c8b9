"""``fill_decode_logprobs``: the committed tokens' log-probs written into SGLang's result.

The function reads ``batch.sampling_info`` (``is_all_greedy``, ``temperatures [bs, 1]``),
``batch.top_logprobs_nums`` and ``batch.token_ids_logprobs`` and writes fields of the logits
output, so plain namespaces carrying real tensors stand in for SGLang's batch and output
(importing SGLang's classes costs seconds per test file).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_tree_spec.plugin.logprobs import fill_decode_logprobs

VOCAB, WINDOW = 11, 4
SLOTS = torch.tensor([[0, 2, 3], [0, 1, -1], [0, -1, -1]])  # accepted path, -1 past it
TOKENS = torch.tensor([[4, 7, 1], [9, 2, -1], [5, -1, -1]])  # committed, -1 padded
TOP = [2, 0, 3]
IDS = [[1, 5, 10], None, [0]]


def batch(temperatures: list[float], all_greedy: bool) -> SimpleNamespace:
    info = SimpleNamespace(
        is_all_greedy=all_greedy,
        temperatures=torch.tensor(temperatures).view(-1, 1),  # SGLang's [bs, 1]
    )
    return SimpleNamespace(sampling_info=info, top_logprobs_nums=TOP, token_ids_logprobs=IDS)


def expected_rows(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``[bs, P, V]``: ``log_softmax(logits / T)`` at each path slot (slot 0 past the path)."""
    rows = torch.stack([logits[b, SLOTS[b].clamp_min(0)] for b in range(logits.shape[0])])
    return torch.log_softmax(rows / temperatures.view(-1, 1, 1), dim=-1)


def fill(info_batch) -> tuple[SimpleNamespace, torch.Tensor]:
    logits = torch.randn(3, WINDOW, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    out = SimpleNamespace()
    fill_decode_logprobs(info_batch, out, logits, SLOTS, TOKENS)
    return out, logits


def assert_filled(out, expected: torch.Tensor) -> None:
    """Every committed token's log-prob, the top log-probs and the asked-for ids' log-probs
    of every flat row ``i * P + j`` read ``expected``."""
    bs, width, _ = expected.shape
    for b in range(bs):
        for j in range(width):
            row, token = expected[b, j], int(TOKENS[b, j])
            if token >= 0:
                assert out.next_token_logprobs[b, j].item() == pytest.approx(
                    row[token].item(), abs=1e-5
                ), (b, j)
            flat = b * width + j
            values, ids = row.topk(TOP[b]) if TOP[b] else (row[:0], row[:0].long())
            assert torch.equal(out.next_token_top_logprobs_idx[flat], ids), (b, j)
            torch.testing.assert_close(
                out.next_token_top_logprobs_val[flat], values, atol=1e-5, rtol=0
            )
            wanted = IDS[b] or []
            assert list(out.next_token_token_ids_logprobs_idx[flat]) == wanted, (b, j)
            torch.testing.assert_close(
                out.next_token_token_ids_logprobs_val[flat], row[wanted], atol=1e-5, rtol=0
            )


def test_sampled_batch_logprobs_are_of_the_tempered_distribution():
    """Guards the temperature of a sampled batch: each committed token's log-prob, top
    log-probs and token-id log-probs are ``log_softmax(logits / T)`` of its own request's
    temperature (SGLang's sampler returns those), not the untempered greedy ones."""
    temperatures = [0.5, 1.0, 2.0]
    out, logits = fill(batch(temperatures, all_greedy=False))
    assert out.next_token_logprobs.shape == TOKENS.shape
    assert_filled(out, expected_rows(logits, torch.tensor(temperatures)))


@pytest.mark.parametrize("no_info", [False, True])
def test_greedy_batch_logprobs_are_untempered(no_info):
    """An all-greedy batch (or one without sampling info) reports ``log_softmax(logits)``."""
    greedy = batch([1.0, 1.0, 1.0], all_greedy=True)
    if no_info:
        greedy.sampling_info = None
    out, logits = fill(greedy)
    assert_filled(out, expected_rows(logits, torch.ones(3)))
