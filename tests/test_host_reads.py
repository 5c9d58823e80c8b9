"""The shared decode step reads nothing back to the host, as it runs on a GPU (design rule 4).

A host read (``.item()``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero``,
boolean indexing, ``unique``) waits for the device: it stalls the stream, serialises the batch
and cannot be captured in a CUDA graph. On a CPU nothing waits, so the reads are counted instead:
every aten op that needs the data on the host (a dispatch mode) and every Python-level read
(``torch.Tensor`` methods wrapped for the test), each attributed to the backend (inside its
``draft_topk`` / ``verify`` / ``keep``) or to the step's own code (everything else).

The reference engine runs :func:`sglang_tree_spec.step.decode_step` on the committed small pair
with the batched device builder the GPU uses (``prune=False``; the CPU's pruned builder reads
scores back by design). Checked, after a warm-up (cached index tables are built once): the
step's own code -- budget choice, DDTree, verify layout, acceptance, the selector's learning,
budget control's update -- reads nothing at a fixed budget, and under budget control only the
controller's one read per forecast (``control/totals``). The backends' methods (the
engine's transformers models here; SGLang's worker on a server) are not checked.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tree_helpers import small_pair

import sglang_tree_spec.engine.spec_engine as spec_engine
from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.engine.backend import TransformersBackend

READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive"}  # fmt: skip
READ_METHODS = ("tolist", "numpy", "cpu", "item")
BACKEND_METHODS = ("draft_topk", "verify", "keep")


class _Reads:
    def __init__(self) -> None:
        self.in_step = self.in_backend = False
        self.steps = 0
        self.sites: collections.Counter[str] = collections.Counter()  # the step's own reads

    def note(self) -> None:
        if not self.in_step or self.in_backend:
            return
        ours = [f for f in traceback.extract_stack() if "/sglang_tree_spec/" in f.filename]
        site = "?"
        if ours:
            site = f"{ours[-1].filename.rsplit('sglang_tree_spec/', 1)[1]}:{ours[-1].lineno}"
        self.sites[site] += 1


class _ReadOps(TorchDispatchMode):
    def __init__(self, reads: _Reads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        boolean_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        if name in READ_OPS or boolean_index:
            self.reads.note()
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Reads]:
    """Count the host reads of the step's own code in every decode step the engine runs."""
    reads = _Reads()
    for name in READ_METHODS:
        method = getattr(torch.Tensor, name)

        def wrapped(self, *args, _method=method, **kwargs):
            reads.note()
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    for name in BACKEND_METHODS:
        method = getattr(TransformersBackend, name)

        def backend_call(self, *args, _method=method, **kwargs):
            reads.in_backend = True
            try:
                return _method(self, *args, **kwargs)
            finally:
                reads.in_backend = False

        monkeypatch.setattr(TransformersBackend, name, backend_call)
    step = spec_engine.decode_step

    def counted_step(*args, **kwargs):
        reads.steps += 1
        reads.in_step = True
        try:
            with _ReadOps(reads):
                return step(*args, **kwargs)
        finally:
            reads.in_step = False

    monkeypatch.setattr(spec_engine, "decode_step", counted_step)
    yield reads


@pytest.fixture(scope="module")
def pair():
    return small_pair(torch.float32)


def steady_reads(pair, monkeypatch, **engine_kwargs) -> _Reads:
    target, drafter, prompts = pair
    engine = SpecEngine(target, drafter, method="ddtree", **engine_kwargs)
    engine.selector.prune = False  # the batched device builder, as on a GPU
    engine.generate(prompts, 16, stop_token_ids=[])  # warm-up: cached tables are built once
    with counting_host_reads(monkeypatch) as reads:
        engine.generate(prompts, 48, stop_token_ids=[])
    assert reads.steps >= 10
    return reads


def test_a_fixed_budget_step_reads_nothing_back(pair, monkeypatch):
    reads = steady_reads(pair, monkeypatch, budget=8)
    assert not reads.sites, dict(reads.sites)


def test_budget_control_reads_once_per_forecast_and_nowhere_else(pair, monkeypatch):
    reads = steady_reads(pair, monkeypatch, budget=32, auto=True)
    assert all(site.startswith("control/totals.py:") for site in reads.sites), reads.sites
    assert 0 < sum(reads.sites.values()) <= reads.steps
