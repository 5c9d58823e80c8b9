"""The drafter context of plain steps, deferred to the next draft (``plugin/deferred.py``).

A plain step (budget 0) writes no drafter context KV; the next drafted step (or a full buffer)
writes the pending tokens in one append. What reaches the drafter's KV must be what DFlash's
every-step append writes: the same hidden states at the same slots and positions. The backend
runs here over a real request-to-slot table; the drafter's append is recorded (slot ->
position, hidden state) the way SGLang's prefix-valid writer applies it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.backend import SGLangBackend
from sglang_tree_spec.plugin.deferred import MAX_PENDING, DeferredContext

HIDDEN = 6
ROWS, CONTEXT = 4, 64


class DraftKV:
    """What the drafter's context KV holds: ``slot -> (position, hidden state)``, written as
    ``DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc`` writes it (with ``cache_loc_2d``
    only the first ``commit_lens[b]`` entries of row ``b``)."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, tuple[float, ...]]] = {}
        self.appends = 0

    def append(self, *, target_hidden, cache_loc, positions, cache_loc_2d=None, commit_lens=None):
        self.appends += 1
        keep = torch.ones(cache_loc.numel(), dtype=torch.bool)
        if cache_loc_2d is not None:
            width = cache_loc_2d.shape[1]
            keep = (torch.arange(width)[None, :] < commit_lens[:, None].long()).reshape(-1)
        for i in keep.nonzero().flatten().tolist():
            hidden = tuple(round(x, 5) for x in target_hidden[i].tolist())
            self.slots[int(cache_loc[i])] = (int(positions[i]), hidden)


def fake_req(row: int) -> SimpleNamespace:
    """A request on ``req_to_token`` row ``row``, where the installed release keeps it."""
    *outer, name = compat.REQ_ROW[compat.check_release()].split(".")
    req = SimpleNamespace(**{name: row})
    for attribute in reversed(outer):
        req = SimpleNamespace(**{attribute: req})
    return req


def make_worker(deferred: DeferredContext | None, kv: DraftKV) -> SimpleNamespace:
    req_to_token = (1000 * torch.arange(ROWS)[:, None] + torch.arange(CONTEXT)).to(torch.int32)
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=SimpleNamespace(move_kv_cache=lambda dst, src: None),
    )
    return SimpleNamespace(
        model_runner=runner,
        deferred_context=lambda hidden=None: deferred,
        _append_target_hidden_to_draft_kv_by_loc=kv.append,
    )


def step(worker, rows: list[int], prefix: torch.Tensor, path: torch.Tensor, draft: bool, seed):
    """One decode step's keep (after the draft's context write when it drafts): window slots
    at ``prefix + j``, verify hidden states drawn from ``seed``, accepted ``path [bs, P]``."""
    batch = SimpleNamespace(
        req_pool_indices=torch.tensor(rows),
        reqs=[fake_req(row) for row in rows],
        seq_lens_cpu=prefix.clone(),
    )
    backend = SGLangBackend(worker, batch)
    if draft:
        backend.write_deferred_context(prefix)  # what draft_topk does first
    window = 4
    backend._window_pos = prefix[:, None] + torch.arange(window)
    backend._window_locs = backend._slots(backend._window_pos)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(rows) * window, HIDDEN, generator=generator)
    backend.logits_output = SimpleNamespace(hidden_states=hidden)
    commit = (path >= 0).sum(1)
    backend.keep(path, commit)
    return prefix + commit


PLAIN = torch.zeros(2, 1, dtype=torch.long)
DRAFTED = torch.tensor([[0, 2, -1], [0, 1, 3]])  # accepted 1 and 2 draft tokens


def run(deferred: DeferredContext | None, schedule: str) -> DraftKV:
    """Steps of batch rows [2, 0] by ``schedule`` ("p": plain, "d": drafted), then the
    write a next draft would make."""
    kv = DraftKV()
    worker = make_worker(deferred, kv)
    rows, prefix = [2, 0], torch.tensor([5, 9])
    for seed, kind in enumerate(schedule):
        path = PLAIN if kind == "p" else DRAFTED
        prefix = step(worker, rows, prefix, path, kind == "d", seed)
    batch = SimpleNamespace(
        req_pool_indices=torch.tensor(rows),
        reqs=[fake_req(row) for row in rows],
        seq_lens_cpu=prefix.clone(),
    )
    SGLangBackend(worker, batch).write_deferred_context(prefix)
    return kv


@pytest.mark.parametrize("schedule", ["pppdppd", "dpdpp", "ppppppppp"])
@pytest.mark.parametrize("cap", [2, 3, MAX_PENDING])
def test_deferred_context_writes_what_every_step_writes(schedule, cap):
    eager = run(None, schedule)
    deferred = run(DeferredContext(ROWS, cap), schedule)
    assert deferred.slots == eager.slots
    plain_steps = schedule.count("p")
    assert len(eager.slots) == 2 * plain_steps + 5 * schedule.count("d")
    # one append per drafted step, per full buffer, and the final write, not one per plain step
    assert deferred.appends < eager.appends or plain_steps == 0


def test_a_run_of_plain_steps_writes_once():
    kv = run(DeferredContext(ROWS, MAX_PENDING), "pppppp")
    assert kv.appends == 1 and len(kv.slots) == 12


def test_rows_outside_the_batch_are_never_written():
    """A request that left the batch (finished, retracted) keeps its pending tokens unwritten:
    its slots may already be another request's; its row starts empty at its next prefill."""
    deferred = DeferredContext(ROWS, 8)
    kv = DraftKV()
    worker = make_worker(deferred, kv)
    step(worker, [2, 0], torch.tensor([5, 9]), PLAIN, False, 0)
    assert deferred.pending([2, 0, 1]) == [1, 1, 0]
    path = torch.tensor([[0, 1, -1]])
    step(worker, [0], torch.tensor([10]), path, True, 1)  # row 2 left the batch
    assert {slot // 1000 for slot in kv.slots} == {0}
    assert deferred.pending([2, 0]) == [1, 0]
    deferred.reset([2])  # the row's next request is prefilled
    assert deferred.pending([2]) == [0]


def test_pending_tokens_come_back_in_position_order_with_padding_in_range():
    deferred = DeferredContext(ROWS, 4)
    rows = torch.tensor([1, 3])
    values = []
    for i in range(3):
        hidden = torch.full((2, HIDDEN), float(i))
        values.append(hidden)
        rows_now = [1] if i == 2 else [1, 3]
        index = rows if i < 2 else rows[:1]
        prefix = torch.tensor([10 + i, 20 + i]) if i < 2 else torch.tensor([12])
        deferred.stash(rows_now, index, prefix, hidden[: len(rows_now)])
    hidden, positions, counts = deferred.take([1, 3], rows, torch.tensor([13, 22]))
    assert counts.tolist() == [3, 2]
    assert positions.tolist() == [[10, 11, 12], [20, 21, 21]]  # padding: the last cached
    assert hidden[0, :, 0].tolist() == [0.0, 1.0, 2.0]
    assert hidden[1, :2, 0].tolist() == [0.0, 1.0]
    assert deferred.pending([1, 3]) == [0, 0] and deferred.take([1, 3], rows, positions) is None


def test_a_buffer_is_kept_only_when_it_is_small():
    assert DeferredContext.for_pool(8, 1152 * 4).cap == MAX_PENDING  # SmolLM2 on CPU
    assert DeferredContext.for_pool(2048, 5 * 4096 * 2) is None  # a large GPU pool
    with pytest.raises(ValueError, match="capacity"):
        DeferredContext(4, 1)


def test_a_request_without_a_row_has_nothing_pending():
    """A request SGLang finished after scheduling the batch (a grammar batch under overlap)
    has no row: its plain-step token is not kept, and the other rows' are."""
    deferred = DeferredContext(rows=4, cap=4)
    rows_dev = torch.tensor([1, 2])
    hidden = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert not deferred.is_full([1, None])
    deferred.stash([1, None], rows_dev, torch.tensor([5, 7]), hidden)
    assert deferred.pending([1, None, 2]) == [1, 0, 0]
    taken = deferred.take([1, None], rows_dev, torch.tensor([6, 8]))
    assert taken is not None and taken[2].tolist() == [1, 0]
    assert torch.equal(taken[0][0, 0], hidden[0])
    deferred.reset([None, 1])
    assert deferred.pending([1]) == [0]
