"""The DDTree build replayed from graphs (``tree/graphs.py``): the same trees as the eager build,
in static outputs that the next build of the same shape overwrites.

On a CPU the ``closure`` mode keeps the CUDA mode's semantics (static inputs, static outputs);
the engine's decode steps through it must commit the same tokens, step by step, as the eager
build, which is what shows that no step reads a tree after the next build of its shape (budget
control included: its forecast builds the widest tree and cuts the step's from it). The CUDA
mode runs where a GPU is (``launch/gpu-validate.sh``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tree_helpers import random_marginals, small_pair

from sglang_tree_spec.config import TreeConfig
from sglang_tree_spec.engine import SpecEngine
from sglang_tree_spec.step import make_selector
from sglang_tree_spec.tree import build_ddtree, build_verify_layout, greedy_accept
from sglang_tree_spec.tree.graphs import TreeGraphs
from sglang_tree_spec.tree.select import DDTreeSelector


def topk(bs: int, depth: int, k: int, seed: int, device: str = "cpu"):
    lp, tok = random_marginals(bs, depth, k, vocab=64, seed=seed)
    return lp.to(device), tok.to(device)


def assert_same_tree(got, want) -> None:
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b), field.name
        else:
            assert a == b, field.name


@pytest.mark.parametrize("mode", ["closure", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
def test_replays_equal_the_eager_build_on_every_shape(mode):
    device = "cuda" if mode == "cuda" else "cpu"
    graphs = TreeGraphs(mode)
    for step in range(3):  # a new top-K each step, the same shapes
        for bs, budget in ((1, 4), (3, 16), (3, 32), (5, 16)):
            lp, tok = topk(bs, 7, 8, seed=100 * step + 10 * bs + budget, device=device)
            want = build_ddtree(lp, tok, budget, validate=False)
            assert_same_tree(graphs.build(lp, tok, budget), want)
    assert graphs.replays == 12 and len(graphs._shapes) == 4


@pytest.mark.parametrize("mode", ["closure", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
def test_replayed_greedy_acceptance_equals_the_eager_one(mode):
    """Trees from the build's static outputs and fresh ones, targets that agree with a path
    for a while: the replayed acceptance is the eager one, field by field, every step."""
    device = "cuda" if mode == "cuda" else "cpu"
    graphs = TreeGraphs(mode)
    for step in range(3):
        for bs, budget in ((1, 4), (3, 16), (5, 16)):
            seed = 100 * step + 10 * bs + budget
            lp, tok = topk(bs, 7, 8, seed=seed, device=device)
            tree = graphs.build(lp, tok, budget) if step % 2 else build_ddtree(lp, tok, budget)
            generator = torch.Generator().manual_seed(seed)
            target = torch.randint(0, 64, (bs, budget + 1), generator=generator).to(device)
            follow = torch.rand(bs, budget, generator=generator).to(device) < 0.7
            parents = tree.parent_slots()  # most nodes' token is the target's at the parent
            target.scatter_(1, parents, torch.where(follow, tree.tokens, target.gather(1, parents)))
            assert_same_tree(graphs.greedy_accept(tree, target), greedy_accept(tree, target))
    assert len([key for key in graphs._shapes if key[1] == "accept"]) == 3


def test_a_built_trees_layout_comes_from_its_replay_and_equals_the_eager_one():
    """The ancestor mask and depths of a tree in a build's static outputs are the replay's
    (no eager layout ops); a tree from elsewhere is laid out eagerly. Both equal
    ``build_verify_layout``, padded batch sizes included."""
    graphs = TreeGraphs("closure", batch_sizes=[4])
    for bs, budget in ((3, 8), (4, 16)):
        lp, tok = topk(bs, 7, 8, seed=bs + budget)
        root, prefix = torch.arange(bs) + 5, torch.arange(bs) * 3 + 10
        for tree in (graphs.build(lp, tok, budget), build_ddtree(lp, tok, budget)):
            got, want = (
                graphs.verify_layout(tree, root, prefix),
                build_verify_layout(tree, root, prefix),
            )
            assert_same_tree(got, want)
    built = graphs.build(*topk(4, 7, 8, seed=9), 16)
    assert graphs.verify_layout(built, root, prefix).ancestor_mask.data_ptr() in {
        shape.output.ancestors.data_ptr()
        for shape in graphs._shapes.values()
        if hasattr(shape.output, "ancestors")
    }  # the build's static output, not a new mask


def test_shapes_captured_at_start_up_serve_every_padded_batch_size():
    """Captured up front at the verify graphs' batch sizes: steps at the sizes between them
    pad up, capture nothing more, and build and accept what the eager code does."""
    graphs = TreeGraphs("closure", batch_sizes=[1, 4, 8])
    shapes = graphs.capture_all((0, 4, 8, 16), depths=7, topk=8, device="cpu")
    assert shapes == 3 * (
        3 + 4
    )  # per size: 3 builds; acceptances of (4, 4), (4, 7), (8, 7), (16, 7)
    captured = graphs.captures
    for bs, budget in ((3, 8), (5, 16), (1, 4), (7, 4)):
        lp, tok = topk(bs, min(7, budget), min(8, budget), seed=bs * budget)
        tree = graphs.build(lp, tok, budget)
        assert_same_tree(tree, build_ddtree(lp, tok, budget, validate=False))
        target = torch.randint(0, 64, (bs, budget + 1), generator=torch.Generator().manual_seed(bs))
        target[:, 0] = tree.tokens[:, 0]  # the first child matches
        assert_same_tree(graphs.greedy_accept(tree, target), greedy_accept(tree, target))
    assert graphs.captures == captured
    graphs.build(*topk(9, 7, 8, seed=0), 8)  # past the largest size: its own shape
    assert graphs.captures == captured + 1


def test_a_build_s_own_tree_is_accepted_where_the_build_wrote_it():
    """The acceptance of a build's tree (start-up shapes) reads the build's static outputs and
    the argmax is written into its static input: no copy a step; a tree that is not the
    build's (auto's cut) is copied in and accepted as exactly."""
    graphs = TreeGraphs("closure", batch_sizes=[1, 4])
    graphs.capture_all((4, 8), depths=7, topk=8, device="cpu")
    gen = torch.Generator().manual_seed(3)
    for bs, budget in ((3, 8), (4, 4), (1, 8)):
        lp, tok = topk(bs, min(7, budget), min(8, budget), seed=bs + budget)
        tree = graphs.build(lp, tok, budget)
        logits = torch.randn(bs, budget + 1, 64, generator=gen)
        logits[:, 0, tok[:, 0, 0]] += 100  # the first child matches
        with _copies(graphs) as outside_replays:
            got = graphs.greedy_accept_logits(tree, logits)
        assert outside_replays.seen == [], outside_replays.seen
        want = greedy_accept(build_ddtree(lp, tok, budget, validate=False), logits.argmax(-1))
        assert_same_tree(got, want)
    own = graphs.build(*topk(4, 7, 8, seed=1), 8)
    kept = dataclasses.replace(own, **{f: getattr(own, f).clone() for f in ("tokens", "parents",
                                "depths", "logprobs", "valid")})  # fmt: skip
    other = build_ddtree(*topk(4, 7, 8, seed=2), 8, validate=False)  # same shape, not the build's
    logits = torch.randn(4, 9, 64, generator=gen)
    assert_same_tree(graphs.greedy_accept_logits(other, logits),
                     greedy_accept(other, logits.argmax(-1)))  # fmt: skip
    assert_same_tree(graphs.greedy_accept_logits(graphs.build(*topk(4, 7, 8, seed=1), 8), logits),
                     greedy_accept(kept, logits.argmax(-1)))  # fmt: skip


class _copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shapes of the ``copy_`` ops dispatched inside it outside ``graphs``'s
    replays (a closure replay copies its fresh outputs into the static ones, as the graph
    writes them)."""

    def __init__(self, graphs: TreeGraphs) -> None:
        super().__init__()
        self.seen, self.replaying, self.graphs = [], False, graphs

    def __enter__(self):
        replay = self.graphs.replay_shape

        def quiet(shape):
            self.replaying = True
            try:
                replay(shape)
            finally:
                self.replaying = False

        self.graphs.replay_shape = quiet
        return super().__enter__()

    def __exit__(self, *exc):
        del self.graphs.replay_shape
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("copy_") and not self.replaying:
            self.seen.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_a_tree_lives_until_the_next_build_of_its_shape():
    graphs = TreeGraphs("closure")
    first = graphs.build(*topk(2, 7, 8, seed=1), 16)
    kept = first.tokens.clone()
    other_shape = graphs.build(*topk(2, 7, 8, seed=2), 8)  # another budget: untouched
    assert torch.equal(first.tokens, kept) and other_shape is not first
    second = graphs.build(*topk(2, 7, 8, seed=3), 16)
    assert second.tokens.data_ptr() == first.tokens.data_ptr()  # the same static outputs
    assert not torch.equal(first.tokens, kept)  # so the first tree now reads the second


@pytest.mark.skipif(torch.cuda.is_available(), reason="a capture that fails: needs no CUDA")
def test_a_failed_capture_falls_back_to_eager_builds(caplog):
    graphs = TreeGraphs("cuda")  # on a machine without CUDA its capture raises
    lp, tok = topk(2, 7, 8, seed=5)
    with caplog.at_level("WARNING"):
        tree = graphs.build(lp, tok, 16)
    assert_same_tree(tree, build_ddtree(lp, tok, 16, validate=False))
    assert graphs.failed and "graph capture failed" in caplog.text
    assert_same_tree(graphs.build(lp, tok, 8), build_ddtree(lp, tok, 8, validate=False))
    assert not graphs._shapes
    assert not graphs._layouts  # eager trees' addresses are reused: never read a mask by them


def test_the_selector_graphs_the_batched_build_on_cuda_only():
    cuda = make_selector(TreeConfig(budget=16), 64, "cuda:0")
    cpu = make_selector(TreeConfig(budget=16), 64, "cpu")
    assert isinstance(cuda.graphs, TreeGraphs) and cuda.graphs.mode == "cuda" and not cuda.prune
    assert cpu.graphs is None and cpu.prune
    with pytest.raises(ValueError, match="cannot be graphed"):
        DDTreeSelector(8, prune=True, graphs=TreeGraphs("closure"))
    with pytest.raises(ValueError, match="mode"):
        TreeGraphs("eager")


@pytest.fixture(scope="module")
def pair():
    return small_pair(torch.float64)  # float64: no near-tie can flip a token between the two


@pytest.mark.parametrize("kwargs", [{"budget": 16}, {"budget": 32, "auto": True}],
                         ids=["fixed", "auto"])  # fmt: skip
def test_engine_steps_through_replayed_trees_commit_the_same_tokens(pair, kwargs):
    target, drafter, prompts = pair
    eager = SpecEngine(target, drafter, method="ddtree", **kwargs)
    eager.selector.prune = False  # the batched build, as on a GPU
    replayed = SpecEngine(target, drafter, method="ddtree", **kwargs)
    replayed.selector = DDTreeSelector(replayed.selector.topk, graphs=TreeGraphs("closure"))
    want = eager.generate(prompts, 40, stop_token_ids=[])
    got = replayed.generate(prompts, 40, stop_token_ids=[])
    assert [r.tokens for r in got] == [r.tokens for r in want]
    # Greedy verification keeps the tokens right whatever the tree: the trees themselves must
    # be the same too, so every step accepts as many tokens as the eager build's.
    assert [r.stats.commit_lengths for r in got] == [r.stats.commit_lengths for r in want]
    assert replayed.selector.graphs.replays > 10


def test_start_up_capture_stops_at_its_largest_batch_size():
    """Sizes past ``max_batch_size`` are padded to but captured on first use only."""
    graphs = TreeGraphs("closure", batch_sizes=[1, 4, 8])
    assert graphs.capture_all((4, 8), depths=7, topk=8, device="cpu", max_batch_size=4) == 2 * 5
    assert {key[0] for key in graphs._shapes} == {1, 4}
    graphs.build(*topk(6, 7, 8, seed=0), 8)  # pads to 8: captured now
    assert {key[0] for key in graphs._shapes} == {1, 4, 8}
