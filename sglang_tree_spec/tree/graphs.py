"""The DDTree build replayed from CUDA graphs: one graph per (batch size, depths, K, budget).

The batched builder (:func:`~sglang_tree_spec.tree.ddtree.build_ddtree` without ``prune``) has
fixed shapes and reads nothing back to the host at a given input shape and budget
(``tests/test_host_reads.py``), so one captured graph replays it: on a GPU its ~85 small
kernels (1.4-2.3 ms eager on an H100 at every batch size and budget: launch-bound,
``benchmarks/results/gpu_h100_2026-11-26.md``) become one graph launch.

:class:`TreeGraphs` captures a shape the first time it is asked for (after one warm-up build on
a side stream, which also fills the builder's cached index tables) and replays it afterwards:
each call copies the step's top-K into the shape's static inputs and returns the tree in the
shape's static outputs, **valid until the next call of the same shape** (a decode step reads
its tree before the next step's build; on one stream a replay cannot overtake the kernels that
read the previous one). ``mode="closure"`` keeps those semantics on a CPU: the build reads the
static inputs and its result is copied into the static outputs, so a caller that kept a tree
past the next build of its shape reads the new one there too, as it would on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from sglang_tree_spec.tree.ddtree import DraftTree, build_ddtree

logger = logging.getLogger(__name__)

MODES = ("cuda", "closure")


@dataclasses.dataclass
class _Shape:
    """One captured shape: static inputs, static outputs and the graph (None: closure)."""

    topk_logprobs: torch.Tensor  # [bs, L, K]
    topk_tokens: torch.Tensor  # [bs, L, K]
    tree: DraftTree  # its tensors are the static outputs
    graph: Any = None


class TreeGraphs:
    """DDTree builds of fixed shapes, replayed (``mode``: ``"cuda"`` graphs, or ``"closure"``
    on any device with the same static-buffer semantics)."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"TreeGraphs: mode {mode!r} is not one of {MODES}")
        self.mode = mode
        self._shapes: dict[tuple, _Shape] = {}
        self.replays = 0
        self.failed: str | None = None  # a capture failed: every build is eager from then on

    def build(
        self, topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, budget: int
    ) -> DraftTree:
        """The DDTree of ``budget`` nodes of ``[bs, L, K]`` top-K, in the shape's static outputs."""
        if self.failed is not None:
            return _build(topk_logprobs, topk_tokens, budget)
        key = (*topk_logprobs.shape, topk_logprobs.dtype, topk_tokens.dtype, budget)
        shape = self._shapes.get(key)
        if shape is None:
            try:
                shape = self._capture(topk_logprobs, topk_tokens, budget)
            except Exception as error:  # a server keeps serving: eager builds are as exact
                self.failed = f"{type(error).__name__}: {error}"
                logger.warning("DDTREE tree builds: graph capture failed (%s); eager builds "
                               "from now on", self.failed)  # fmt: skip
                return _build(topk_logprobs, topk_tokens, budget)
            self._shapes[key] = shape
        shape.topk_logprobs.copy_(topk_logprobs)
        shape.topk_tokens.copy_(topk_tokens)
        self.replay_shape(shape, budget)
        self.replays += 1
        return shape.tree

    def replay_shape(self, shape: _Shape, budget: int) -> None:
        """One replay of a captured shape over its static inputs (one launch on CUDA)."""
        if shape.graph is not None:
            shape.graph.replay()
            return
        fresh = _build(shape.topk_logprobs, shape.topk_tokens, budget)
        for field in dataclasses.fields(DraftTree):
            value = getattr(fresh, field.name)
            if isinstance(value, torch.Tensor):
                getattr(shape.tree, field.name).copy_(value)

    def _capture(self, topk_logprobs, topk_tokens, budget) -> _Shape:
        static_lp, static_tok = topk_logprobs.clone(), topk_tokens.clone()
        if self.mode == "closure":
            return _Shape(static_lp, static_tok, _build(static_lp, static_tok, budget))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the builder's cached tables, lazy inits
            _build(static_lp, static_tok, budget)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of the server's other threads must not void the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            tree = _build(static_lp, static_tok, budget)
        return _Shape(static_lp, static_tok, tree, graph)


def _build(topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, budget: int) -> DraftTree:
    return build_ddtree(topk_logprobs, topk_tokens, budget, validate=False)
