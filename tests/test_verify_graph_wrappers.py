"""DDTREE's verify graphs on a backend that keeps its captured verify wrappers per batch size.

SGLang's flashinfer backend files the target-verify wrappers its capture hook makes under the
batch size alone (``prefill_cuda_graph_metadata[bs]``) and its replay hook plans the wrappers
filed there. A CUDA graph reads the plan workspace of the wrappers made for its own capture,
so with several budgets (``--speculative-ddtree-budget auto``) the (bs, W) graph would replay
over a plan made for another window unless the runner files each shape's wrappers back before
its replay (``plugin/graphs.py``, ``WrappersPerBatchSize``).

:class:`PerBatchSizeBackend` keeps that discipline: a new wrapper per capture, filed by batch
size, planned by the replay hook; :data:`PerBatchSizeBackend.graph_reads` is what a CUDA graph
binds implicitly (the wrapper made for its capture), so the closure replay on CPU reads the
wrapper a GPU replay would. The target's "logits" report the window and sequence lengths that
wrapper was last planned with. The runner itself is the real one in closure mode, over real
``ForwardBatch`` / ``DFlashVerifyInput`` objects. About 25 s on 2 shared cores, nearly all
SGLang's imports.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.graphs import DDTreeVerifyGraphs, WrappersPerBatchSize

DRAFTER = Path(__file__).resolve().parents[1] / "sglang_tree_spec/assets/small-pair/drafter"
BATCH_SIZES = [1, 3]  # a batch of 2 replays padded to 3
BUDGETS = (4, 8)
CONTEXT = 64  # a req_to_token row
VOCAB = 4  # logits columns: planned window, planned sequence length, unused


class Wrapper:
    """One captured verify wrapper: what its last plan was made for."""

    def __init__(self) -> None:
        self.window: int | None = None
        self.seq_lens: list[int] = []

    def plan(self, window: int, seq_lens: list[int]) -> None:
        self.window, self.seq_lens = window, seq_lens


class PerBatchSizeBackend:
    """flashinfer's capture discipline in small: wrappers made per capture, filed per batch."""

    def __init__(self) -> None:
        self.graph_reads: dict[tuple[int, int], Wrapper] = {}
        setattr(self, compat.BACKEND_VERIFY_WRAPPERS, {})  # (flashinfer's __init__ makes it)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        return None

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        bs, window = forward_batch.batch_size, int(forward_batch.spec_info.draft_token_num)
        filed = getattr(self, compat.BACKEND_VERIFY_WRAPPERS)
        if in_capture:
            filed[bs] = self.graph_reads[(bs, window)] = Wrapper()
        filed[bs].plan(window, forward_batch.seq_lens_cpu[:bs].tolist())

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        return None


class PlannedTarget:
    """A target whose logits rows say which plan its attention ran with."""

    def __init__(self, backend: PerBatchSizeBackend) -> None:
        self.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> Any:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        bs, window = forward_batch.batch_size, int(forward_batch.spec_info.draft_token_num)
        wrapper = self.backend.graph_reads[(bs, window)]
        logits = torch.zeros(bs * window, VOCAB)
        logits[:, 0] = -1 if wrapper.window is None else wrapper.window
        seq_lens = wrapper.seq_lens + [-1] * (bs - len(wrapper.seq_lens))
        logits[:, 1] = torch.tensor(seq_lens, dtype=torch.float32).repeat_interleave(window)
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=None)


def runner() -> tuple[DDTreeVerifyGraphs, PerBatchSizeBackend]:
    backend = PerBatchSizeBackend()
    model_runner = SimpleNamespace(
        device="cpu",
        attn_backend=backend,
        model=PlannedTarget(backend),
        server_args=SimpleNamespace(
            speculative_draft_model_path=str(DRAFTER), speculative_draft_model_revision=None
        ),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(8, CONTEXT, dtype=torch.int32)),
        model_config=SimpleNamespace(vocab_size=VOCAB, hidden_size=8, dtype=torch.float32),
        spec_algorithm=None,
    )
    graphs = DDTreeVerifyGraphs(
        model_runner, batch_sizes=BATCH_SIZES, budgets=BUDGETS, replay="closure"
    )
    return graphs, backend


def verify_batch(seq_lens: list[int], window: int) -> Any:
    """A real TARGET_VERIFY ForwardBatch of ``len(seq_lens)`` requests with a full tree mask."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    bs, tokens = len(seq_lens), len(seq_lens) * window
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    mask = torch.ones(sum(window * (n + window) for n in seq_lens), dtype=torch.bool)
    spec_info = DFlashVerifyInput(
        draft_token=None,
        positions=None,
        draft_token_num=window,
        custom_mask=mask,
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        req_pool_indices=torch.arange(bs, dtype=torch.int64),
        seq_lens=lens,
        seq_lens_cpu=lens.to(torch.int32),
        orig_seq_lens=lens,
        out_cache_loc=torch.zeros(tokens, dtype=torch.int64),
        seq_lens_sum=int(lens.sum()),
        return_logprob=False,
        positions=torch.zeros(tokens, dtype=torch.int64),
        spec_info=spec_info,
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )


def test_each_replay_reads_the_plan_of_its_own_window():
    """Every batch size and budget in turn, twice: the replayed graph's wrapper was planned for
    this step's window and sequence lengths (a padded request: one cached token)."""
    graphs, backend = runner()
    assert isinstance(graphs.wrappers, WrappersPerBatchSize)
    steps = [(bs, budget) for _ in range(2) for bs in (3, 2, 1) for budget in BUDGETS[::-1]]
    for step, (bs, budget) in enumerate(steps):
        window, padded = budget + 1, next(size for size in BATCH_SIZES if size >= bs)
        seq_lens = [10 + step + 3 * row for row in range(bs)]
        forward_batch = verify_batch(seq_lens, window)
        assert graphs.can_run_graph(forward_batch)
        logits = graphs.execute(forward_batch).next_token_logits.view(bs, window, VOCAB)
        assert logits[:, :, 0].eq(window).all(), (bs, budget, logits[:, 0, 0].tolist())
        assert logits[:, 0, 1].tolist() == seq_lens, (bs, budget, logits[:, 0, 1].tolist())
        fill = [DDTreeVerifyGraphs.SEQ_LEN_FILL] * (padded - bs)
        assert backend.graph_reads[(padded, window)].seq_lens == seq_lens + fill


def test_every_shapes_wrappers_stay_alive():
    """The wrappers each graph reads are kept (a CUDA graph holds no reference to them: one
    dropped from the backend's dict would free the plan workspace its graph still reads)."""
    graphs, backend = runner()
    assert set(graphs.wrappers.kept) == set(backend.graph_reads)
    for key, wrapper in backend.graph_reads.items():
        assert graphs.wrappers.kept[key] is wrapper


def test_the_capture_plan_counts_every_shapes_kept_wrappers():
    """Kept per shape, flashinfer's wrappers are device memory of the verify graphs: the plan
    counts one set (one prefill wrapper: no sliding window) for each captured shape."""
    from sglang_tree_spec.plugin.capture_plan import FLASHINFER_WRAPPER_BYTES

    graphs, _ = runner()
    assert graphs.plan.shapes == len(graphs.wrappers.kept)
    assert graphs.plan.wrappers == graphs.plan.shapes * FLASHINFER_WRAPPER_BYTES
    assert "backend wrappers" in graphs.plan.line()


def test_the_installed_flashinfer_backend_files_its_verify_wrappers_per_batch_size():
    """The discipline the stub copies, as the installed release writes it (read from its
    source: flashinfer's kernels need a GPU to import)."""
    sglang = importlib.util.find_spec("sglang")
    source = (
        Path(sglang.submodule_search_locations[0]) / "srt/layers/attention/flashinfer_backend.py"
    ).read_text()
    name = compat.BACKEND_VERIFY_WRAPPERS
    assert f"self.{name} = {{}}" in source  # made in the constructor
    assert f"self.{name}[bs] = prefill_wrappers" in source  # filed per capture, by batch size
    assert f"prefill_wrappers=self.{name}[bs]," in source  # planned by the replay hook
    count = compat.BACKEND_WRAPPERS_PER_SHAPE
    assert f"self.{count} = 1" in source and f"for i in range(self.{count})" in source
