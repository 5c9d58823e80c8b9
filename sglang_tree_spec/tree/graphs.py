"""The DDTree build and greedy acceptance replayed from CUDA graphs, one graph per shape.

The batched builder (:func:`~sglang_tree_spec.tree.ddtree.build_ddtree` without ``prune``) has
fixed shapes and reads nothing back to the host at a given input shape and budget
(``tests/test_host_reads.py``), so one captured graph replays it: on a GPU its ~85 small
kernels (1.4-2.3 ms eager on an H100 at every batch size and budget: launch-bound,
``benchmarks/results/gpu_h100.md``) become one graph launch.

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
from collections.abc import Callable
from typing import Any

import torch

from sglang_tree_spec.tree.accept import AcceptResult, greedy_accept
from sglang_tree_spec.tree.ddtree import DraftTree, build_ddtree
from sglang_tree_spec.tree.layout import (
    VerifyLayout,
    ancestor_mask,
    build_verify_layout,
    slot_depths,
)

logger = logging.getLogger(__name__)

MODES = ("cuda", "closure")


@dataclasses.dataclass
class _Shape:
    """One captured shape: static inputs, static outputs (a dataclass of tensors) and the
    graph (None: closure, which reruns ``run`` on the static inputs)."""

    inputs: tuple[torch.Tensor, ...]
    output: Any
    run: Callable[..., Any]
    graph: Any = None


class TreeGraphs:
    """DDTree builds and greedy acceptances of fixed shapes, replayed (``mode``: ``"cuda"``
    graphs, or ``"closure"`` on any device with the same static-buffer semantics)."""

    def __init__(self, mode: str, batch_sizes: list[int] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"TreeGraphs: mode {mode!r} is not one of {MODES}")
        self.mode = mode
        self._shapes: dict[tuple, _Shape] = {}
        # a build's static tree -> its layout's parts, ``[bs, W, W]`` mask and ``[bs, W]`` depths
        self._layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._built: dict[int, int] = {}  # a build's static tree tokens -> its max depth
        self.replays = 0
        self.captures = 0
        self.failed: str | None = None  # a capture failed: every build is eager from then on
        self.batch_sizes: list[int] = []  # the padded batch sizes (set_batch_sizes)
        if batch_sizes:
            self.set_batch_sizes(batch_sizes)

    def set_batch_sizes(self, batch_sizes: list[int]) -> None:
        """Pad every batch up to the next of ``batch_sizes`` (SGLang's capture sizes: the
        verify graph pads to them too); a larger batch keeps its own size."""
        self.batch_sizes = sorted(set(int(size) for size in batch_sizes))

    def padded(self, bs: int) -> int:
        return next((size for size in self.batch_sizes if size >= bs), bs)

    def capture_all(
        self,
        budgets: tuple[int, ...],
        depths: int,
        topk: int,
        device: torch.device | str,
        max_batch_size: int | None = None,
    ) -> int:
        """Capture at start-up every shape a decode step can ask for at the padded batch
        sizes (up to ``max_batch_size``): the build of each budget ``b`` (``min(depths, b)``
        drafted depths, top ``min(topk, b)``) and the greedy acceptance of a ``b``-node tree
        cut from any tree at least as wide (auto's forecast). Returns the shapes captured."""
        before = len(self._shapes)
        drafted = sorted(b for b in budgets if b > 0)
        limit = max_batch_size or max(self.batch_sizes, default=0)
        for bs in (size for size in self.batch_sizes if size <= limit):
            for budget in drafted:
                d, k = min(depths, budget), min(topk, budget)
                scores = -torch.arange(k, dtype=torch.float32, device=device).expand(bs, d, k)
                ids = torch.arange(k, dtype=torch.long, device=device).expand(bs, d, k)
                tree = self.build(scores.contiguous(), ids.contiguous(), budget)
                argmax = torch.zeros(bs, budget + 1, dtype=torch.long, device=device)
                for width in (w for w in drafted if w >= budget):
                    wide = dataclasses.replace(tree, max_depth=min(depths, width))
                    self.greedy_accept(wide, argmax)
        return len(self._shapes) - before

    def build(
        self, topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, budget: int
    ) -> DraftTree:
        """The DDTree of ``budget`` nodes of ``[bs, L, K]`` top-K, in the shape's static outputs."""
        depths, k = topk_logprobs.shape[1:]  # (the batch size is padded: _replayed)
        key = _build_key(depths, k, topk_logprobs.dtype, topk_tokens.dtype, budget)

        def run(lp: torch.Tensor, tok: torch.Tensor) -> _BuiltTree:
            tree = _build(lp, tok, budget)
            fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(DraftTree)}
            return _BuiltTree(**fields, ancestors=ancestor_mask(tree), slots=slot_depths(tree))

        built = self._replayed(key, run, (topk_logprobs, topk_tokens))
        tree = DraftTree(*(getattr(built, f.name) for f in dataclasses.fields(DraftTree)))
        if self.failed is None:  # static outputs only (a fresh tree's address is reused)
            self._layouts[tree.tokens.data_ptr()] = (built.ancestors, built.slots)
            self._built[tree.tokens.data_ptr()] = tree.max_depth
        return tree

    def build_inputs(
        self, bs: int, depths: int, k: int, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The static ``[bs, depths, k]`` float32 log-prob and int64 token inputs of the
        captured build of ``budget`` nodes at ``bs``'s padded size (a top-K written there is
        not copied again), else None."""
        key = (self.padded(bs), *_build_key(depths, k, torch.float32, torch.long, budget))
        shape = self._shapes.get(key)
        if shape is None or self.failed is not None:
            return None
        return shape.inputs[0][:bs], shape.inputs[1][:bs]

    def greedy_accept_logits(self, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        """:meth:`greedy_accept` of the target's ``[bs, B + 1, V]`` logits: their argmax is
        written straight into the captured shape's static input (no copy)."""
        bs = logits.shape[0]
        shape = self._shapes.get((self.padded(bs), *_accept_key(tree, torch.long)))
        if shape is None or self.failed is not None:
            return self.greedy_accept(tree, logits.argmax(dim=-1))
        argmax = shape.inputs[-1][:bs]
        torch.argmax(logits, dim=-1, out=argmax)
        return self.greedy_accept(tree, argmax)

    def verify_layout(
        self, tree: DraftTree, root_tokens: torch.Tensor, prefix_lens: torch.Tensor
    ) -> VerifyLayout:
        """:func:`~sglang_tree_spec.tree.layout.build_verify_layout` of ``tree``: for a tree
        in a build's static outputs its ancestor mask and depths were computed in the build's
        replay (two ops are left); any other tree is laid out eagerly."""
        parts = self._layouts.get(tree.tokens.data_ptr())
        if parts is None or parts[0].shape[0] != tree.batch_size or tree.budget == 0:
            return build_verify_layout(tree, root_tokens, prefix_lens)
        ancestors, slots = parts
        root = root_tokens.view(-1, 1).to(torch.long)
        return VerifyLayout(
            tokens=torch.cat([root, tree.tokens], dim=1),
            ancestor_mask=ancestors,
            positions=prefix_lens.view(-1, 1).to(torch.long) + slots,
        )

    def greedy_accept(self, tree: DraftTree, target_argmax: torch.Tensor) -> AcceptResult:
        """:func:`~sglang_tree_spec.tree.accept.greedy_accept` of a ``[bs, B]`` tree and the
        target's ``[bs, B + 1]`` argmax, in the shape's static outputs: its ~40 small ops one
        replay, after the copies of the tree and the argmax into the static inputs."""
        key = _accept_key(tree, target_argmax.dtype)
        depth = tree.max_depth

        def run(tokens, parents, depths, logprobs, valid, argmax) -> AcceptResult:
            return greedy_accept(DraftTree(tokens, parents, depths, logprobs, valid, depth), argmax)

        fields = (tree.tokens, tree.parents, tree.depths, tree.logprobs, tree.valid)
        # a build's own tree (same depth) is read where the build wrote it: no copies
        shared = self._built.get(tree.tokens.data_ptr()) == depth
        return self._replayed(key, run, (*fields, target_argmax), shared=len(fields) * shared)

    def _replayed(self, key: tuple, run: Callable[..., Any], inputs: tuple, shared: int = 0) -> Any:
        """``run(*inputs)`` replayed from the graph of shape ``key`` at the padded batch size
        (rows are independent: a padded row computes on whatever its static input holds),
        captured on first use; the output's rows of the batch. The first ``shared`` inputs,
        when at the padded size, are another shape's static outputs: a capture reads them
        there (a step's copy of them is then none)."""
        if self.failed is not None:
            return run(*inputs)
        bs = inputs[0].shape[0]
        padded = self.padded(bs)
        key = (padded, *key)
        shape = self._shapes.get(key)
        if shape is None:
            try:
                padded_inputs = tuple(_pad_rows(value, padded) for value in inputs)
                shape = self._capture(run, padded_inputs, shared if padded == bs else 0)
            except Exception as error:  # a server keeps serving: eager builds are as exact
                self.failed = f"{type(error).__name__}: {error}"
                self._layouts.clear()
                self._built.clear()
                logger.warning("DDTREE tree graphs: graph capture failed (%s); eager "
                               "from now on", self.failed)  # fmt: skip
                return run(*inputs)
            self._shapes[key] = shape
            self.captures += 1
        for static, value in zip(shape.inputs, inputs, strict=True):
            if static.data_ptr() != value.data_ptr():
                static[:bs].copy_(value)
        self.replay_shape(shape)
        self.replays += 1
        if padded == bs:
            return shape.output
        return _first_rows(shape.output, bs)

    def replay_shape(self, shape: _Shape) -> None:
        """One replay of a captured shape over its static inputs (one launch on CUDA)."""
        if shape.graph is not None:
            shape.graph.replay()
            return
        fresh = shape.run(*shape.inputs)
        for field in dataclasses.fields(fresh):
            value = getattr(fresh, field.name)
            if isinstance(value, torch.Tensor):
                getattr(shape.output, field.name).copy_(value)

    def _capture(self, run: Callable[..., Any], inputs: tuple, shared: int = 0) -> _Shape:
        static = tuple(value if i < shared else value.clone() for i, value in enumerate(inputs))
        if self.mode == "closure":
            return _Shape(static, run(*static), run)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the builder's cached tables, lazy inits
            run(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of the server's other threads must not void the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = run(*static)
        return _Shape(static, output, run, graph)


@dataclasses.dataclass(frozen=True)
class _BuiltTree(DraftTree):
    """A build's output: the tree and the parts of its verify layout that depend on the tree
    alone (``ancestors`` ``[bs, W, W]``, ``slots`` ``[bs, W]`` window-slot depths)."""

    ancestors: torch.Tensor = None
    slots: torch.Tensor = None


def _build_key(depths: int, k: int, lp_dtype, token_dtype, budget: int) -> tuple:
    """A build's shape key, less the padded batch size (``_replayed`` prepends it)."""
    return ("build", depths, k, lp_dtype, token_dtype, budget)


def _accept_key(tree: DraftTree, argmax_dtype) -> tuple:
    """A greedy acceptance's shape key, less the padded batch size."""
    return ("accept", tree.budget, tree.max_depth, tree.logprobs.dtype, argmax_dtype)


def _pad_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    """``value`` with its first row repeated up to ``rows`` rows (a capture's padded input)."""
    if value.shape[0] == rows:
        return value
    pad = value[:1].expand(rows - value.shape[0], *value.shape[1:])
    return torch.cat([value, pad])


def _first_rows(output: Any, rows: int) -> Any:
    """A dataclass of ``[padded, ...]`` tensors cut to its first ``rows`` rows (views)."""
    cut = {
        field.name: getattr(output, field.name)[:rows]
        for field in dataclasses.fields(output)
        if isinstance(getattr(output, field.name), torch.Tensor)
    }
    return dataclasses.replace(output, **cut)


def _build(topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, budget: int) -> DraftTree:
    return build_ddtree(topk_logprobs, topk_tokens, budget, validate=False)
