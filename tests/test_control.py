"""Budget control: surrogate vs brute force, calibration, latency model, the choice."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from tree_helpers import random_marginals

from sglang_tree_spec.control import (
    DEVICES,
    MODEL_SHAPES,
    AcceptCalibrator,
    BudgetController,
    CalibrationConfig,
    ControlConfig,
    LatencyConfig,
    LatencyModel,
    candidate_budgets,
    dflash_drafter,
    expected_accept,
    isotonic,
    rank_nodes,
    roofline_step_seconds,
    top_nodes,
)
from sglang_tree_spec.control.controller import PENDING_STEPS
from sglang_tree_spec.control.latency import bucket_of
from sglang_tree_spec.tree import build_ddtree, greedy_accept

FIELDS = ("tokens", "parents", "depths", "logprobs", "valid")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread (two spin-waiting threads on a loaded CPU cost 5x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def brute_force_accept(tree, lp_full: torch.Tensor, b: int) -> float:
    """E[accepted draft tokens] of request ``b``'s tree when the target draws every position
    independently from ``lp_full`` (``[bs, L, V]``: log-probs over the whole vocabulary):
    enumerate all V^L target continuations and walk the tree."""
    depth, vocab = lp_full.shape[1:]
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for i in range(tree.budget):
        if tree.valid[b, i]:
            children[(int(tree.parents[b, i]), int(tree.tokens[b, i]))] = i
    total = 0.0
    for seq in itertools.product(range(vocab), repeat=depth):
        prob = math.exp(sum(float(lp_full[b, d, t]) for d, t in enumerate(seq)))
        node, accepted = -1, 0
        for t in seq:
            node = children.get((node, t), None)
            if node is None:
                break
            accepted += 1
        total += prob * accepted
    return total


def test_candidate_budgets():
    assert candidate_budgets(64) == (0, 4, 8, 16, 32, 64)
    assert candidate_budgets(32) == (0, 4, 8, 16, 32)
    assert candidate_budgets(20) == (0, 4, 8, 16, 20)
    assert candidate_budgets(3, (0, 1, 8)) == (0, 1, 3)


def test_surrogate_equals_brute_force_expected_accept_with_nesting():
    bs, depth, vocab, big = 3, 4, 3, 40  # 3 + 9 + 27 + 81 = 120 lattice prefixes
    lp, tok = random_marginals(bs, depth, vocab, vocab, seed=7, sharpness=1.5)  # K = V: full
    lp_full = torch.full((bs, depth, vocab), float("-inf"))
    lp_full.scatter_(2, tok, lp)
    budgets = (0, 1, 2, 5, 9, 17, big)
    tree = build_ddtree(lp, tok, big)
    predicted = expected_accept(tree, budgets)  # [bs, C] from ONE tree
    assert predicted.shape == (bs, len(budgets))
    for c, n in enumerate(budgets):
        for b in range(bs):
            if n == 0:
                assert predicted[b, c] == 0
                continue
            exact_tree = build_ddtree(lp, tok, n)  # the optimal n-tree, built on its own
            truth = brute_force_accept(exact_tree, lp_full, b)
            assert predicted[b, c].item() == pytest.approx(truth, rel=1e-4, abs=1e-6), (b, n)
            # ...and it is the top-n prefix of the big tree (nesting), node for node.
            sub = top_nodes(tree, n)
            ranked = top_nodes(tree, n, rank_nodes(tree.logprobs, tree.depths, tree.valid).slots)
            for name in FIELDS:
                assert torch.equal(getattr(sub, name)[b], getattr(exact_tree, name)[b]), name
                assert torch.equal(getattr(ranked, name)[b], getattr(exact_tree, name)[b]), name


def test_surrogate_beyond_tree_size_and_padding():
    lp, tok = random_marginals(2, 2, 2, 2, seed=1)  # 2 + 4 = 6 prefixes, budget 10 pads 4
    tree = build_ddtree(lp, tok, 10)
    acc = expected_accept(tree, (0, 6, 10, 64))
    assert torch.allclose(acc[:, 1], acc[:, 2]) and torch.allclose(acc[:, 2], acc[:, 3])
    assert torch.allclose(acc[:, 1], tree.logprobs.exp().where(tree.valid, 0).sum(1))


def tree_prob_sum(tree, lp_full: torch.Tensor, b: int) -> float:
    """sum over request ``b``'s nodes of their path probability under ``lp_full``
    (``[bs, L, V]``): the expected accepted length (the identity the test above checks)."""
    path_lp: list[float] = []
    for i in range(tree.budget):
        parent, token = int(tree.parents[b, i]), int(tree.tokens[b, i])
        depth = int(tree.depths[b, i])
        own = float(lp_full[b, depth - 1, token])
        path_lp.append((path_lp[parent] if parent >= 0 else 0.0) + own)
    return sum(math.exp(v) for v, ok in zip(path_lp, tree.valid[b].tolist(), strict=True) if ok)


def factorised_target_argmax(tree, draws: torch.Tensor) -> torch.Tensor:
    """``[bs, B + 1]`` the target's token at every verify slot when it ignores the context:
    draws[:, d] at every slot of depth d (root depth 0)."""
    slot_depth = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1)
    return draws.gather(1, slot_depth.clamp(max=draws.shape[1] - 1))


def run_stream(ctl, tree, target_lp_full, steps, generator, budget):
    """Verify ``tree``'s top-``budget`` nodes ``steps`` times against a target that samples
    each position from ``target_lp_full``; returns per-step [bs] predictions and observations."""
    bs, depth, vocab = target_lp_full.shape
    rows = torch.arange(bs)
    preds, obs = [], []
    sub = top_nodes(tree, budget)
    column = ctl.config.budgets.index(budget)
    for _ in range(steps):
        fc = ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid)
        draws = torch.multinomial(
            target_lp_full.exp().reshape(bs * depth, vocab), 1, generator=generator
        ).reshape(bs, depth)
        result = greedy_accept(sub, factorised_target_argmax(sub, draws))
        preds.append(fc.accept[:, column].clone())
        obs.append(result.accept_len.float())
        ctl.observe(fc, budget, result.accept_len)
    return torch.stack(preds), torch.stack(obs)  # [steps, bs]


def full_logprobs(logits: torch.Tensor, k: int):
    lp_full = torch.log_softmax(logits, dim=-1)
    lp, tok = lp_full.topk(k, dim=-1)
    return lp_full, lp, tok


def test_calibration_converges_to_observed_rates_per_request_and_resets():
    gen = torch.Generator().manual_seed(3)
    bs, depth, vocab, budget = 2, 6, 6, 16
    logits = torch.randn(1, depth, vocab, generator=gen).expand(bs, -1, -1) * 2.5
    _, lp, tok = full_logprobs(logits, vocab)
    # Row 0's target is sharper than the drafter: under-confident drafter; row 1's flatter.
    target_full = torch.log_softmax(logits * torch.tensor([2.0, 0.4]).view(bs, 1, 1), dim=-1)
    tree = build_ddtree(lp, tok, budget)
    truth = torch.tensor([tree_prob_sum(tree, target_full, b) for b in range(bs)])
    raw = expected_accept(tree, (budget,))[:, 0]
    assert ((raw - truth).abs() / truth > 0.25).all()  # uncalibrated: badly off for both

    config = ControlConfig(budgets=(0, budget), fixed_budget=budget, max_depth=depth)
    ctl = BudgetController(config, None, max_slots=4)
    preds, obs = run_stream(ctl, tree, target_full, 400, gen, budget)
    late_pred, late_obs = preds[200:].mean(0), obs[200:].mean(0)  # [bs]
    assert torch.allclose(late_obs, truth, rtol=0.1)  # the stream is what we think it is
    assert torch.allclose(late_pred, late_obs, rtol=0.1), (late_pred, late_obs, truth)
    stats = ctl.stats()
    assert stats.request_steps == 400 * bs and stats.budget_counts == {}
    assert stats.mean_observed_accept == pytest.approx(obs.mean().item(), rel=1e-5)

    # A new request in slot 1 starts from the pooled per-depth calibration, r = 1.
    ctl.reset(torch.tensor([1]))
    assert ctl.calibrator.request_scale(torch.tensor([0, 1]))[1].item() == 1.0
    assert ctl.calibrator.request_scale(torch.tensor([0]))[0].item() != pytest.approx(1.0)


def test_one_unlucky_step_does_not_cut_a_new_requests_predictions():
    """One step's acceptance is noisy (0..L for the same tree): a step that accepts nothing
    where 2 were predicted says little about the request. In small-pair server traces with a
    weak per-request prior (1 token, decay 0.9), requests whose factor had fallen below 0.8
    accepted 1.3-2.5x their predictions (more plain steps chosen than paid); the prior of 16
    tokens keeps one empty step within 15% of 1, while 100 steps at half the prediction still
    bring the factor near 1/2 (the age factor, pooled over every request, off here)."""
    cal = AcceptCalibrator(max_slots=2, max_depth=4, config=CalibrationConfig(age_prior=1e9))
    rows, mass = torch.tensor([0]), torch.zeros(1, 5)
    cal.update(rows, mass, calibrated_pred=torch.tensor([2.0]), accept=torch.tensor([0.0]))
    assert cal.request_scale(rows).item() > 0.85
    for _ in range(100):
        cal.update(rows, mass, calibrated_pred=torch.tensor([2.0]), accept=torch.tensor([1.0]))
    assert cal.request_scale(rows).item() < 0.6
    assert cal.request_scale(torch.tensor([1])).item() == 1.0  # another slot: untouched


def test_the_age_factor_follows_acceptance_that_falls_through_a_reply():
    """Every reply accepts a depth-1 node of mass 0.8 with probability 0.72 for its first 10
    steps and 0.32 after (SmolLM2's drafter at batch size 1 saw its ratio fall through each
    reply). The pooled depth factors average the two, so without the age factor the
    predictions run high late in every reply and low early; with it, both stretches' summed
    predictions land within 10% of what was accepted."""
    cal = AcceptCalibrator(max_slots=1, max_depth=4)
    rows, gen = torch.tensor([0]), torch.Generator().manual_seed(0)
    mass = torch.tensor([[0.0, 0.8, 0.0, 0.0, 0.0]])
    sums = {"early": [0.0, 0.0], "late": [0.0, 0.0]}  # predicted, accepted
    for request in range(300):
        cal.reset(rows)
        for step in range(30):
            stretch = "early" if step < 10 else "late"
            depth_cal = mass @ cal.depth_table()  # [1]
            predicted = (depth_cal * cal.scale(rows)).item()
            hit = torch.rand(1, generator=gen).item() < (0.72 if step < 10 else 0.32)
            cal.update(rows, mass, depth_cal, torch.tensor([float(hit)]))
            if request >= 100:
                sums[stretch][0] += predicted
                sums[stretch][1] += float(hit)
    for stretch, (predicted, accepted) in sums.items():
        assert predicted == pytest.approx(accepted, rel=0.1), stretch
    table = cal.age_table()
    assert table[0].item() > 1.2 * table[-1].item()


def test_a_depth_without_history_reads_the_factor_of_the_depth_above():
    """A depth the verified trees rarely reach keeps the factor of the depths above it, not
    1 (the drafter's marginals at face value); a depth with history converges to its own ratio;
    the closed form equals the recurrence s_d = (O_d + c s_{d-1}) / (M_d + c)."""
    cal = AcceptCalibrator(max_slots=1, max_depth=4, config=CalibrationConfig(depth_decay=1.0))
    rows = torch.tensor([0])
    for step in range(200):  # depth-1 node of mass 0.8, accepted on 2 steps in 5; nothing deeper
        mass = torch.tensor([[0.0, 0.8, 0.0, 0.0, 0.0]])
        cal.update(rows, mass, torch.tensor([0.8]), torch.tensor([float(step % 5 < 2)]))
    table = cal.depth_table()
    assert table[1].item() == pytest.approx(0.5, rel=0.01)
    assert table[2:].tolist() == pytest.approx([table[1].item()] * 3, rel=1e-5)
    gen = torch.Generator().manual_seed(3)
    cal.depth_sums.copy_(torch.rand(2, 5, generator=gen) * torch.tensor([[0, 50, 9, 2, 0.1]]))
    c, (mass, observed), expected = cal.config.depth_prior, cal.depth_sums, [1.0]
    for d in range(1, 5):
        expected.append((observed[d].item() + c * expected[-1]) / (mass[d].item() + c))
    assert cal._depth_table().tolist() == pytest.approx(expected, rel=1e-5)  # (sums set by hand)


def test_per_depth_calibration_tracks_depth_acceptance():
    gen = torch.Generator().manual_seed(5)
    bs, depth, vocab, budget = 8, 5, 4, 8
    logits = torch.randn(bs, depth, vocab, generator=gen) * 3.0
    _, lp, tok = full_logprobs(logits, vocab)
    # The target agrees at depth 1 and is flat deeper: acceptance falls faster than drafted.
    target_logits = torch.cat([logits[:, :1], logits[:, 1:] * 0.2], dim=1)
    target_full = torch.log_softmax(target_logits, dim=-1)
    tree = build_ddtree(lp, tok, budget)
    calib = CalibrationConfig(depth_decay=0.995, request_decay=0.0, request_prior=1e9)
    config = ControlConfig(
        budgets=(0, budget), fixed_budget=budget, max_depth=depth, calibration=calib
    )  # per-request factor off: depth only
    ctl = BudgetController(config, None, max_slots=bs)
    preds, obs = run_stream(ctl, tree, target_full, 300, gen, budget)
    scale = ctl.calibrator.depth_scale()
    assert scale[0].item() == pytest.approx(1.0, abs=0.1)
    assert scale[1].item() < 0.8
    assert preds[150:].mean().item() == pytest.approx(obs[150:].mean().item(), rel=0.08)


def test_latency_prior_is_monotone_in_budget_and_batch():
    target = MODEL_SHAPES["qwen3-8b"]
    drafter = dflash_drafter(target, 5)
    budgets = (0, 1, 4, 8, 16, 32, 64, 128)
    for device in DEVICES.values():
        table = [
            [roofline_step_seconds(target, device, bs, n, 1024, drafter, 16) for n in budgets]
            for bs in (1, 2, 4, 8, 16, 64)
        ]
        for row in table:
            assert all(a < b for a, b in itertools.pairwise(row))
        for col in zip(*table, strict=True):
            assert all(a < b for a, b in itertools.pairwise(col))
    # H100 at bs 1, Qwen3-8B: memory-bound, a 16-node tree costs little over a plain step.
    h100 = DEVICES["h100"]
    plain = roofline_step_seconds(target, h100, 1, 0, 1024)
    assert 4e-3 < plain < 15e-3
    assert roofline_step_seconds(target, h100, 1, 16, 1024) < 1.3 * plain
    # ...while at bs 64 the same tree is compute-bound and costs over 2.5 plain steps.
    assert roofline_step_seconds(target, h100, 64, 16, 1024) > 2.5 * roofline_step_seconds(
        target, h100, 64, 0, 1024
    )


def test_latency_refinement_converges_to_measured_times():
    budgets = (0, 8, 32)
    buckets = (1, 4, 16, 64)
    model = LatencyModel.from_roofline(
        MODEL_SHAPES["llama-3.1-8b"], DEVICES["h200"], budgets, bs_buckets=buckets
    )
    truth = [[2.0 * p + 3e-3 for p in row] for row in model.prior]  # "a different device"
    assert model.seconds(1, 8) == pytest.approx(model.prior[0][1])  # nothing measured yet
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):  # measure only bs 1 and 16 (bucket 16 as bs 13), 5% noise
        for bs, bucket in ((1, 0), (13, 2)):
            for c, n in enumerate(budgets):
                noise = 1.0 + 0.05 * (2 * torch.rand(1, generator=gen).item() - 1)
                model.record(bs, n, truth[bucket][c] * noise)
    a, b = model.calibration()
    assert a == pytest.approx(2.0, rel=0.15) and b == pytest.approx(3e-3, abs=2e-3)
    for bucket, bs in enumerate(buckets):  # buckets 4 and 64 never measured: calibrated prior
        for c, n in enumerate(budgets):
            assert model.seconds(bs, n) == pytest.approx(truth[bucket][c], rel=0.06), (bs, n)
    assert model.mean_abs_rel_error() < 0.2
    measured = sum(truth[0]) + sum(truth[2])  # ~ the 60 rounds' mean (noise +-5%)
    assert model.measured_seconds == pytest.approx(60 * measured, rel=0.02)
    assert model.predicted_seconds == pytest.approx(model.measured_seconds, rel=0.15)
    assert not model.record(1, 5, 0.1)  # not a candidate: ignored
    for _ in range(30):  # a measured cell drifts (thermal, a neighbour): its EMA follows
        model.record(1, 32, 1.5 * truth[0][2])
    assert model.seconds(1, 32) == pytest.approx(1.5 * truth[0][2], rel=0.02)


def test_an_unmeasured_cell_keeps_its_columns_ratio_to_its_rows_measured_cells():
    """A row with some cells measured scales its others, read from the measured buckets, by
    how its measured cells compare with those buckets: budget 4 at batch size 2 costs 1.5x
    its batch-size-1 cell, so budgets 0 and 8 there read 1.5x theirs, not 1x (which made them
    look cheap next to the measured cell)."""
    model = LatencyModel([[0.01, 0.01, 0.01]] * 2, (0, 4, 8), bs_buckets=(1, 2))
    for budget, seconds in ((0, 0.010), (4, 0.012), (8, 0.016)):
        for _ in range(3):
            model.record(1, budget, seconds)
    model.record(2, 4, 0.018)
    assert model.load == pytest.approx(1.0)
    assert model.row(2) == pytest.approx([0.015, 0.018, 0.024])


def test_a_held_cells_steps_refit_no_row_and_every_decision_reads_a_fresh_one(monkeypatch):
    """A step of the cell before it, once that cell is settled and weighs its most, moves no
    cell, only the calibration's weights: its step-time error reads its row as last fitted (no
    refit per held step), while a decision's read (:meth:`row`) is refitted to the calibration
    as it stands (here batch size 2's row, read from batch size 1's through the calibrated
    priors). A switch moves two cells, and the next step's error reads its row refitted."""
    prior = [[0.01, 0.02, 0.04], [0.02, 0.03, 0.06]]
    model = LatencyModel(prior, (0, 4, 8), bs_buckets=(1, 2))
    times = {0: 0.010, 4: 0.014, 8: 0.030}  # not on one line with the priors
    for _ in range(3):
        for budget, seconds in times.items():
            model.record(1, budget, seconds)
    for budget, seconds in times.items():  # each settles at its full weight
        for _ in range(int(model.config.max_weight)):
            model.record(1, budget, seconds)
    fits = []
    fit_row = model._fit_row
    monkeypatch.setattr(model, "_fit_row", lambda bucket: fits.append(bucket) or fit_row(bucket))
    stale = model.row(2)
    fits.clear()
    for seconds in (0.031, 0.029, 0.032):  # held: no cell moves, no refit
        model.record(1, 8, seconds)
    assert fits == []
    fresh = [model.load * c for c in fit_row(1)]
    assert fresh != pytest.approx(stale, rel=1e-4)  # the calibration's weights moved
    assert model.row(2) == pytest.approx(fresh, rel=1e-12) and fits == [1]  # a decision's read
    model.record(1, 0, 0.010)  # a switch: both cells move
    fits.clear()
    model.record(1, 0, 0.010)
    assert fits == [0]


def test_unpadded_batch_sizes_are_cells_of_their_own_between_profiled_neighbours():
    """Where nothing pads a batch (a CPU), every batch size is a cell: a step of 11 requests
    is not recorded as one of 16 (which costs more). Only the usual buckets are profiled; a
    size between them reads its column's measured neighbours (linear in bs) until measured."""
    from sglang_tree_spec.control.latency import (
        DEFAULT_BS_BUCKETS,
        EXACT_BS_BUCKETS,
        bs_buckets_for,
    )

    assert bs_buckets_for("cpu") == EXACT_BS_BUCKETS == tuple(range(1, 257))
    assert bs_buckets_for("cuda") == DEFAULT_BS_BUCKETS  # CUDA graphs pad to these
    budgets = (0, 4)
    exact = EXACT_BS_BUCKETS[:16]
    model = LatencyModel(
        [[0.01, 0.01]] * 16, budgets, bs_buckets=exact, profile_buckets=(1, 2, 4, 8, 16)
    )
    assert [bs for bs in exact if model.profiles(bs)] == [1, 2, 4, 8, 16]
    model.record(8, 4, 0.010)
    model.record(16, 4, 0.020)
    assert model.seconds(12, 4) == pytest.approx(0.015)  # between its measured neighbours
    assert model.seconds(4, 4) == pytest.approx(0.010)  # one side: its ratio to the prior
    model.record(11, 4, 0.012)
    assert model.seconds(11, 4) == pytest.approx(0.012)
    assert model.seconds(16, 4) == pytest.approx(0.020)  # bs 11 did not move bs 16's cell
    assert model.seconds(12, 4) == pytest.approx(0.0136)  # now between 11 and 16
    model.forget(11, 4)
    assert model.seconds(11, 4) == pytest.approx(0.01375)  # between 8 and 16 again
    ctl = BudgetController(ControlConfig(budgets=budgets, profile_steps=1), model, max_slots=16)
    assert ctl.should_draft(12) and ctl.held_budget(12) is None  # not profiled: a forecast
    assert not ctl.should_draft(4)  # profiled: budget 0's cell first, by a plain step


FLAT_64 = LatencyModel([[0.01] * 6] * 3, (0, 4, 8, 16, 32, 64), bs_buckets=(1, 8, 64))


def strong_or_useless_tree(bs: int, strong: bool, budget: int = 64):
    """A 15-deep tree: two likely tokens per position (0.6 and 0.39, so every added node still
    adds), or probabilities ~1e-9."""
    depth, k = 15, 8
    lp = torch.full((bs, depth, k), -30.0)
    lp[..., 0] = math.log(0.6) if strong else -20.0
    lp[..., 1] = math.log(0.39) if strong else -21.0
    lp[..., 2:] -= torch.arange(2, k).float()  # sorted descending
    tok = torch.arange(k).expand(bs, depth, k)
    return build_ddtree(lp, tok, budget)


def roofline_controller(budgets=(0, 4, 8, 16, 32, 64), **kwargs):
    latency = LatencyModel.from_roofline(
        MODEL_SHAPES["qwen3-8b"],
        DEVICES["h100"],
        budgets,
        drafter=dflash_drafter(MODEL_SHAPES["qwen3-8b"], 5),
        block=16,
    )
    return BudgetController(ControlConfig(budgets=budgets, **kwargs), latency, max_slots=64)


def step_budget(ctl: BudgetController, bs: int, fc) -> tuple[int, bool]:
    """One step's budget as ``decode_step`` asks for it: plain, given without a forecast
    (fixed, profiled, explored, held) or chosen from ``fc``; and whether the step drafted."""
    if not ctl.should_draft(bs):
        return ctl.choose(None, bs), False
    held = ctl.held_budget(bs)
    return (held if held is not None else ctl.choose(fc, bs)), True


def test_choice_useless_drafter_picks_plain_decode_and_stops_drafting():
    """The model prefers plain steps: the drafter is skipped except for probes, which
    re-forecast and, their draft paid for, verify at the cheapest budget > 0; each probe that
    still prefers plain steps doubles the interval (4, 8, then 8 at the cap)."""
    for bs in (1, 16):
        ctl = roofline_controller(probe_every=4, probe_max_every=8)
        tree = strong_or_useless_tree(bs, strong=False)
        fc = ctl.forecast(torch.arange(bs), tree.logprobs, tree.depths, tree.valid)
        assert ctl.should_draft(bs)
        assert ctl.choose(fc, bs) == 4  # drafted: verified, but plain steps follow
        drafted, chosen = [], []
        for _ in range(20):
            drafted.append(ctl.should_draft(bs))
            chosen.append(ctl.choose(fc if drafted[-1] else None, bs))
        probes = [False] * 3 + [True] + ([False] * 7 + [True]) * 2
        assert drafted == probes
        assert chosen == [4 if probe else 0 for probe in probes]
        assert ctl.stats().budget_counts == {0: 17, 4: 4}


def test_a_probe_that_prefers_drafting_ends_the_plain_run():
    """After plain steps, a probe whose forecast pays for drafting drafts again at once; the
    next plain run starts over at the shortest probe interval."""
    ctl = roofline_controller(probe_every=2, probe_max_every=64)
    useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
    plain_fc, strong_fc = (
        ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid) for t in (useless, strong)
    )
    trace = []
    for forecast in (plain_fc, plain_fc, plain_fc, strong_fc, plain_fc):
        while not ctl.should_draft(1):
            trace.append(ctl.choose(None, 1))
        trace.append(ctl.choose(forecast, 1))
    # plain after the first forecast; probes after 2, 4 then 8 steps; the strong probe drafts
    # (no plain step before the next forecast); a new plain run probes after 2 steps again.
    assert trace[:7] == [4, 0, 4, 0, 0, 0, 4] and trace[7:14] == [0] * 7
    assert trace[14] >= 32 and trace[15] == 4 and len(trace) == 16
    # the strong step still weighs in the drafted steps' average: drafting goes on a while
    weak_drafted = 1
    while ctl.should_draft(1):
        assert ctl.choose(plain_fc, 1) == 4
        weak_drafted += 1
    assert 3 <= weak_drafted <= 40
    assert [ctl.choose(None, 1), ctl.should_draft(1)] == [0, True]


def test_an_uncertain_step_amid_paying_drafts_does_not_start_a_plain_run():
    """A forecast preferring plain steps starts a plain run only when the drafted steps'
    decayed average does not pay either: one uncertain step in three keeps the drafter on; a
    drafter that stays useless after a strong step stops once the average falls below a plain
    step's rate."""
    ctl = roofline_controller(probe_every=4, probe_max_every=64)
    useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
    plain_fc, strong_fc = (
        ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid) for t in (useless, strong)
    )
    chosen = []
    for forecast in [strong_fc, strong_fc, plain_fc] * 10:
        assert ctl.should_draft(1)
        chosen.append(ctl.choose(forecast, 1))
    assert chosen[2::3] == [4] * 10 and min(chosen[0::3]) >= 32  # drafted every step
    rare = [strong_fc] + [plain_fc] * 80
    steps = 0
    while ctl.should_draft(1):
        ctl.choose(rare[steps], 1)
        steps += 1
    assert 2 <= steps <= 80  # the average fell below a plain step's rate: a plain run


def test_a_hard_step_amid_paying_drafts_takes_hard_plain_steps_then_forecasts_again():
    """With ``hard_plain_steps``, a forecast that prefers plain steps while drafting pays on
    average is followed by exactly that many plain steps and a probe; a probe that prefers
    drafting drafts on, one that still prefers plain steps takes the same short run again. A
    drafter that does not pay on average still gets a plain run probed at growing intervals."""

    def trace_of(forecasts, **kwargs):
        ctl = roofline_controller(probe_every=4, probe_max_every=64, **kwargs)
        useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
        fcs = {
            name: ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid)
            for name, t in (("plain", useless), ("strong", strong))
        }
        trace = []
        for name in forecasts:
            while not ctl.should_draft(1):
                trace.append(ctl.choose(None, 1))
            trace.append(ctl.choose(fcs[name], 1))
        return trace

    paying = ["strong", "strong", "plain"] * 4 + ["strong", "plain", "plain", "strong"]
    trace = trace_of(paying, hard_plain_steps=1)
    assert [b == 0 for b in trace] == (
        [False, False, False, True] * 4 + [False, False, True, False, True, False]
    )
    assert trace_of(paying, hard_plain_steps=2).count(0) == 2 * 6
    assert 0 not in trace_of(paying)  # hard_plain_steps = 0: drafting goes on
    useless = trace_of(["strong"] + ["plain"] * 30, hard_plain_steps=1)
    plain_runs = "".join("p" if b == 0 else "d" for b in useless).split("d")
    assert max(map(len, plain_runs)) >= 8  # not paying on average: probes at growing intervals


def test_held_steps_that_pay_keep_a_hard_forecast_from_starting_a_plain_run():
    """Whether drafting pays on average counts the held steps too (committed tokens per request
    against the step's cost in plain forwards), not the forecast steps alone, which are the hard
    ones: after held steps committing 8 tokens a request, a forecast preferring plain steps takes
    ``hard_plain_steps`` plain steps and a probe; after held steps committing 1 (a drafter that
    does not pay), the same forecast starts a plain run probed at ``probe_every``."""

    def plain_steps_after(held_accept: int) -> int:
        ctl = roofline_controller(probe_every=8, probe_max_every=64, hard_plain_steps=1)
        useless = strong_or_useless_tree(2, strong=False)
        for _ in range(20):  # held steps at budget 16, two requests
            ctl.observe_committed(16, torch.full((2,), held_accept, dtype=torch.long))
        fc = ctl.forecast(torch.arange(2), useless.logprobs, useless.depths, useless.valid)
        assert ctl.choose(fc, 2) == 4  # prefers plain steps; this drafted step verifies
        steps = 0
        while not ctl.should_draft(2):
            assert ctl.choose(None, 2) == 0
            steps += 1
        return steps

    assert plain_steps_after(7) == 1  # drafting pays on average: one hard plain step
    assert plain_steps_after(0) == 7  # it does not: a plain run, the first probe after 8


def test_a_hard_stretch_does_not_start_a_plain_run_while_drafting_pays_in_the_long_run():
    """100 held steps paying twice what plain steps would, then 40 hard ones paying half, then
    a forecast preferring plain steps: on the recent average alone a plain run starts; with the
    long-run average (``plain_long_decay``) drafting still pays, the step verifies at the
    cheapest budget > 0 and that budget holds, like any choice, for ``hold_steps - 1`` drafted
    steps. A drafter that never paid gets its plain run either way."""
    budgets = (0, 4, 8)
    flat = LatencyModel([[0.01, 0.02, 0.02]] * 3, budgets, bs_buckets=(1, 2, 64))
    useless = strong_or_useless_tree(2, strong=False, budget=8)

    def after(held_accepts: list[int], long_decay: float | None) -> BudgetController:
        config = ControlConfig(budgets=budgets, plain_long_decay=long_decay, hold_steps=4)
        ctl = BudgetController(config, flat, max_slots=2)
        for accept in held_accepts:  # held steps at budget 4 (two plain forwards' time)
            ctl.observe_committed(4, torch.tensor(accept).expand(2))
        fc = ctl.forecast(torch.arange(2), useless.logprobs, useless.depths, useless.valid)
        assert ctl.choose(fc, 2) == 4
        return ctl

    stretch = [3] * 100 + [0] * 40  # 4 tokens a request, then 1, for two forwards' time
    assert not after(stretch, None).should_draft(2)  # recent average alone: a plain run
    both = after(stretch, 0.995)
    assert both.should_draft(2)
    assert [both.held_budget(2) for _ in range(4)] == [4, 4, 4, None]  # held, then forecast
    assert not after([0] * 140, 0.995).should_draft(2)  # never paid: a plain run
    # 1.5 tokens a request for two plain forwards' time does not pay; 2.5 does
    assert not after([[1, 0]] * 140, 0.995).should_draft(2)
    assert after([[2, 1]] * 140, 0.995).should_draft(2)


def test_one_lucky_probe_does_not_restart_a_useless_drafter():
    """A probe whose own forecast pays (one likely token) but leaves the drafted steps'
    average below a plain step's rate verifies its tree and keeps the plain run; a strong
    probe ends it."""
    ctl = roofline_controller(probe_every=2, probe_max_every=8)
    lp = torch.full((1, 15, 8), -30.0) - torch.arange(8).float()
    lp[:, 0, 0] = math.log(0.5)  # depth 1: one token at 0.5, nothing deeper
    lucky = build_ddtree(lp, torch.arange(8).expand(1, 15, 8), 64)
    useless, strong = (strong_or_useless_tree(1, strong=s) for s in (False, True))
    plain_fc, lucky_fc, strong_fc = (
        ctl.forecast(torch.arange(1), t.logprobs, t.depths, t.valid)
        for t in (useless, lucky, strong)
    )

    def probe(forecast):
        while not ctl.should_draft(1):
            assert ctl.choose(None, 1) == 0
        return ctl.choose(forecast, 1)

    for _ in range(8):  # a useless drafter: a plain run, probed every 8 steps
        assert probe(plain_fc) == 4
    assert probe(lucky_fc) == 4  # this forecast alone pays (1.5 tokens for 1.2 plain steps)
    assert not ctl.should_draft(1)  # the average does not: still plain
    assert probe(strong_fc) >= 32
    assert ctl.should_draft(1)  # the average pays again: the run is over


def test_a_plain_run_probes_once_the_batch_is_renewed():
    """A plain run decided on one request's text does not outlive it: once as many requests
    have arrived as the batch holds, the next step drafts (a probe, the interval unchanged)."""
    for bs, arrivals in ((1, [1]), (4, [1, 2, 1])):
        ctl = roofline_controller(probe_every=64, probe_max_every=64)
        useless = strong_or_useless_tree(bs, strong=False)
        fc = ctl.forecast(torch.arange(bs), useless.logprobs, useless.depths, useless.valid)
        assert ctl.choose(fc, bs) == 4 and not ctl.should_draft(bs)  # a plain run starts
        for n in arrivals:
            assert not ctl.should_draft(bs)
            ctl.choose(None, bs)
            ctl.reset(torch.arange(n))
        assert ctl.should_draft(bs)  # renewed: probe
        assert ctl.choose(fc, bs) == 4 and not ctl.should_draft(bs)  # still useless: plain
        assert ctl._probe_interval == 64


def test_choice_free_verification_and_strong_drafter_picks_max_budget():
    budgets = (0, 4, 8, 16, 32, 64)
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 8, 64))
    ctl = BudgetController(ControlConfig(budgets=budgets), flat, max_slots=8)
    tree = strong_or_useless_tree(8, strong=True)
    fc = ctl.forecast(torch.arange(8), tree.logprobs, tree.depths, tree.valid)
    assert ctl.choose(fc, 8) == 64
    assert ctl.last_budget == 64 and ctl.stats().budget_counts == {64: 1}
    # Nothing to gain (all probabilities 0) at equal cost: ties go to the smaller budget.
    useless = strong_or_useless_tree(8, strong=False)
    flat_fc = ctl.forecast(torch.arange(8), useless.logprobs, useless.depths, useless.valid)
    assert ctl.choose(flat_fc, 8) == 4  # the model prefers 0; a drafted step verifies anyway
    assert ctl.should_draft(8)  # drafting pays on average (the strong step): no plain run
    # A tree smaller than a candidate never gets that candidate.
    small = top_nodes(tree, 16)
    fc16 = ctl.forecast(torch.arange(8), small.logprobs, small.depths, small.valid)
    assert ctl.choose(fc16, 8) == 16


def test_every_forecast_builds_the_largest_candidate_so_the_choice_reaches_the_best():
    """Auto builds (and drafts the depths of) the largest candidate at every forecast, so the
    choice reaches the best budget in one forecast even where the rate is not concave in N: here
    B 8 costs 100 plain steps and B 16 1% more than B 4. Built one candidate above the last
    choice, a forecast after B 4 saw B 4 and B 8 alone and B 4 held for ever."""
    budgets = (0, 4, 8, 16, 32, 64)
    ctl = BudgetController(ControlConfig(budgets=budgets), FLAT_64, max_slots=8)
    strong = strong_or_useless_tree(8, strong=True)
    rows = torch.arange(8)
    assert ctl.tree_budget(8) == 64  # no forecast yet
    steep = [[0.01, 0.0101] + [1.0] * 4] * 3  # a tree above 4 nodes costs 100 plain steps
    ctl.latency = LatencyModel(steep, budgets, bs_buckets=(1, 8, 64))
    fc = ctl.forecast(rows, strong.logprobs, strong.depths, strong.valid)
    assert ctl.choose(fc, 8) == 4
    assert ctl.tree_budget(8) == 64  # after a choice of 4 too
    dented = [[0.01, 0.0101, 1.0, 0.0102, 1.0, 1.0]] * 3  # B 8 dear, B 16 1% above B 4
    ctl.latency = LatencyModel(dented, budgets, bs_buckets=(1, 8, 64))
    fc = ctl.forecast(rows, strong.logprobs, strong.depths, strong.valid)
    assert fc.tree_budget == 64 and ctl.choose(fc, 8) == 16
    assert roofline_controller(profile_steps=1).tree_budget(1) == 64  # profiling


def test_forecasts_between_full_ones_reach_one_candidate_above_the_contenders():
    """With ``full_forecast_every``, a bucket's first forecast and one in that many build the
    largest candidate's tree; the others build the tree of the candidate above the largest
    contender of the last full one (here B 16 and above are 80x dearer: B 16), and the budgets
    above it keep their per-request averages until the next full forecast: a smaller tree's
    prediction for them is its whole sum, clamped. A request arriving meanwhile starts those
    averages at the next full forecast, not at the clamped values; a renewed batch forecasts
    in full."""
    budgets = (0, 4, 8, 16, 32, 64)
    row = [0.01, 0.012, 0.0125, 1.0, 1.0, 1.0]
    latency = LatencyModel([row] * 3, budgets, bs_buckets=(1, 8, 64))
    config = ControlConfig(
        budgets=budgets, explore_margin=0.3, full_forecast_every=3, choice_decay=0.5
    )
    ctl = BudgetController(config, latency, max_slots=8)
    strong = strong_or_useless_tree(8, strong=True)
    rows = torch.arange(8)

    def forecast(width: int):
        tree = top_nodes(strong, width)
        fc = ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid)
        return fc, ctl.choose(fc, 8)

    assert ctl.tree_budget(8) == 64  # the bucket's first forecast
    full, choice = forecast(64)
    assert choice in (4, 8) and ctl.tree_budget(8) == 16  # contenders 4 and 8: reach 16
    assert ctl.tree_budget(1) == 64  # another bucket has its own first forecast
    ctl.reset(rows[:1])  # a request arrives in slot 0
    reduced, _ = forecast(16)
    above = slice(budgets.index(32), None)
    assert torch.equal(reduced.expected[1:, above], full.expected[1:, above])  # kept
    assert torch.allclose(
        reduced.expected[1:, : above.start],
        0.5 * (full.expected + reduced.accept)[1:, : above.start],
    )
    assert ctl.tree_budget(8) == 16
    forecast(16)
    assert ctl.tree_budget(8) == 64  # the third since the full one: full again
    again, _ = forecast(64)
    assert torch.equal(again.expected[0, above], again.accept[0, above])  # its first full one
    assert torch.allclose(again.expected[1, above], 0.5 * (full.expected + again.accept)[1, above])
    assert ctl.tree_budget(8) == 16
    ctl.reset(rows)  # a renewed batch: its own full forecast
    assert ctl.tree_budget(8) == 64
    every = BudgetController(ControlConfig(budgets=budgets, explore_margin=0.3), latency, 8)
    fc = every.forecast(rows, strong.logprobs, strong.depths, strong.valid)
    every.choose(fc, 8)
    assert every.tree_budget(8) == 64  # full_forecast_every=1: every forecast is full
    with pytest.raises(ValueError, match="full_forecast_every"):
        ControlConfig(full_forecast_every=0)


def test_the_choice_reads_each_requests_average_forecast_not_one_hard_step():
    """With ``choice_decay``, one hard step (a useless-looking draft) after easy ones does not
    move the choice to the smallest budget: the choice reads the request's decayed average of
    its forecasts (half the weight on the latest here), and the choice holds for steps whose text
    is the request's, not that step's. A request arriving in the slot starts its own average
    (its first forecast alone), and without the decay the hard step alone decides."""
    budgets = (0, 4, 8, 16, 32, 64)
    cells = [[0.01, 0.01, 0.011, 0.012, 0.014, 0.02]] * 3
    latency = LatencyModel(cells, budgets, bs_buckets=(1, 2, 64))
    strong, useless = (strong_or_useless_tree(2, strong=s) for s in (True, False))
    rows = torch.arange(2)

    def choices(decay: float, trees, reset_before: int | None = None):
        config = ControlConfig(budgets=budgets, choice_decay=decay, hard_plain_steps=1)
        ctl = BudgetController(config, latency, max_slots=2)
        seen, forecasts = [], []
        for i, tree in enumerate(trees):
            if i == reset_before:
                ctl.reset(rows)
            forecasts.append(ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid))
            seen.append(ctl.choose(forecasts[-1], 2))
        return seen, forecasts

    easy_then_hard = [strong, strong, strong, useless]
    assert choices(0.0, easy_then_hard)[0][-1] == 4  # the hard step alone: the smallest
    seen, (easy, *_, hard) = choices(0.5, easy_then_hard)
    assert seen == [seen[0]] * 4 and seen[0] >= 16  # the request's average: the easy choice
    assert torch.allclose(hard.expected, 0.5 * (easy.accept + hard.accept))
    seen, (*_, fresh) = choices(0.5, easy_then_hard, reset_before=3)
    assert seen[-1] == 4 and torch.equal(fresh.expected, fresh.accept)  # a new request's own
    with pytest.raises(ValueError, match="choice_decay"):
        ControlConfig(choice_decay=1.0)


def test_a_choice_holds_for_hold_steps_of_the_same_batch():
    """A forecast's budget > 0 serves the next ``hold_steps - 1`` drafted steps of the same
    batch without a forecast (counted as their choices); as many requests arriving as the
    batch holds or a batch that outgrows the one the choice was made for ends the hold (one
    arrival of several does not, nor do requests leaving, nor others replacing them), a
    forecast that prefers plain steps starts none. Each step names why
    it has its budget (``reason``, the step log's column)."""
    budgets = (0, 4, 8, 16, 32, 64)
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 8, 64))
    ctl = BudgetController(ControlConfig(budgets=budgets, hold_steps=3), flat, max_slots=8)
    strong = strong_or_useless_tree(8, strong=True)
    rows = torch.arange(8)

    def forecast_step(bs: int = 8, reason: str = "expired") -> int:
        assert ctl.held_budget(bs) is None  # not held: this step forecasts
        assert ctl.reason == reason
        fc = ctl.forecast(rows[:bs], strong.logprobs[:bs], strong.depths[:bs], strong.valid[:bs])
        return ctl.choose(fc, bs)

    assert forecast_step() == 64
    assert [ctl.held_budget(8), ctl.held_budget(8)] == [64, 64] and ctl.reason == "held"
    assert ctl.stats().budget_counts == {64: 3}
    ctl.record_step(8, 64, 0.5, drafted=True, forecast=True)  # a forecast step's time: not
    ctl.record_step(8, 64, 0.02, drafted=True)  # recorded while choices hold; a held one is
    assert flat.count[1][budgets.index(64)] == 1 and flat.seconds(8, 64) == pytest.approx(0.02)
    every = BudgetController(ControlConfig(budgets=budgets), flat, max_slots=8)  # no hold:
    every.record_step(8, 64, 0.02, drafted=True, forecast=True)  # every step forecasts
    assert flat.count[1][budgets.index(64)] == 2
    assert forecast_step() == 64  # the hold is over: forecast again
    ctl.reset(torch.tensor([3]))  # one request of 8 arrived: the hold goes on
    assert ctl.held_budget(8) == 64
    ctl.reset(torch.arange(7))  # as many arrivals as the batch holds: a renewed batch
    assert forecast_step(reason="arrivals") == 64
    assert ctl.held_budget(4) == 64  # requests left: the rest were forecast, held on
    assert ctl.held_budget(8) == 64  # others replaced them: the batch the choice was made for
    assert forecast_step(bs=4) == 64
    assert ctl.held_budget(5) is None and ctl.reason == "grew"  # the batch grew: forecast again
    useless = strong_or_useless_tree(8, strong=False)
    fc = ctl.forecast(rows, useless.logprobs, useless.depths, useless.valid)
    steep = LatencyModel([[0.01] + [1.0] * 5] * 3, budgets, bs_buckets=(1, 8, 64))
    ctl.latency = steep
    assert ctl.choose(fc, 8) == 4  # plain steps win: verified (paid for), nothing held
    for _ in range(ctl.config.probe_every - 1):  # a plain run, then a probe
        assert not ctl.should_draft(8) and ctl.reason == "plain"
        ctl.choose(None, 8)
    assert ctl.should_draft(8) and ctl.held_budget(8) is None and ctl.reason == "probe"
    fixed = BudgetController(ControlConfig(fixed_budget=16), None, max_slots=8)
    assert [fixed.held_budget(8) for _ in range(5)] == [16] * 5  # fixed: held for ever
    assert fixed.reason == "fixed"
    with pytest.raises(ValueError, match="hold_steps"):
        ControlConfig(hold_steps=0)
    with pytest.raises(ValueError, match="held_observe_every"):
        ControlConfig(held_observe_every=0)


def test_a_choice_made_again_holds_twice_as_long_up_to_hold_max_steps():
    """With ``hold_max_steps``, a forecast that chooses what the forecast before it chose holds
    twice as long as that one did (2, 4, 8, then 8 at the cap): a choice that keeps being made
    needs fewer forecasts, each costlier than a held step. A different choice holds
    ``hold_steps`` again, as does the first choice after a plain run; without the cap every
    choice holds ``hold_steps``."""
    budgets = (0, 4, 8, 16, 32, 64)
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 8, 64))
    four = LatencyModel([[0.01, 0.01] + [1.0] * 4] * 3, budgets, bs_buckets=(1, 8, 64))
    rows = torch.arange(8)
    strong, useless = (strong_or_useless_tree(8, strong=s) for s in (True, False))

    def holds(ctl, steps: int, latency: LatencyModel) -> list[int]:
        """The lengths of the holds (forecast step included) over ``steps`` drafted steps."""
        ctl.latency, lengths = latency, []
        for _ in range(steps):
            if ctl.held_budget(8) is None:
                fc = ctl.forecast(rows, strong.logprobs, strong.depths, strong.valid)
                ctl.choose(fc, 8)
                lengths.append(0)
            lengths[-1] += 1
        return lengths

    config = ControlConfig(budgets=budgets, hold_steps=2, hold_max_steps=8, hard_plain_steps=1)
    ctl = BudgetController(config, flat, max_slots=8)
    assert holds(ctl, 30, flat) == [2, 4, 8, 8, 8]  # 64 every time: doubled up to the cap
    assert holds(ctl, 14, four) == [2, 4, 8]  # 4 now: a new choice holds 2 again
    fc = ctl.forecast(rows, useless.logprobs, useless.depths, useless.valid)
    assert ctl.choose(fc, 8) == 4 and ctl._plain  # a hard step: a plain step follows ...
    assert holds(ctl, 6, four) == [2, 4]  # ... and the probe's choice of 4 holds 2 again
    plain = BudgetController(ControlConfig(budgets=budgets, hold_steps=2), flat, max_slots=8)
    assert holds(plain, 8, flat) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="hold_max_steps"):
        ControlConfig(hold_steps=4, hold_max_steps=2)


@pytest.mark.parametrize("observe_every", [1, 3])
def test_held_steps_calibrate_the_forecasts_they_follow(observe_every):
    """Forecast steps are the hard ones (a request's first steps, the step after a plain run);
    the held steps each forecast governs calibrate too, so the forecasts predict the steps they
    govern: here every forecast step accepts nothing and the three held steps after it 1, 2
    and 6 tokens, and the forecast predicts the mean of all steps, 2.25 (calibrated on forecast
    steps alone: ~0). With ``held_observe_every=3`` every third drafted step is calibrated,
    forecast or held, standing for three: the turns rotate through the 4-step cycle, (0 + 1 +
    2 + 6) / 4 = 2.25 again (the forecast steps calibrated every time, standing for one, and
    the held ones on a stride of their own, the third held step alone: (0 + 3 x 6) / 4 = 4.5)."""
    mean = 2.25
    budgets, bs, hold = (0, 4, 8), 4, 4
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 4, 64))
    config = ControlConfig(
        budgets=budgets, hold_steps=hold, max_depth=15, held_observe_every=observe_every
    )
    ctl = BudgetController(config, flat, max_slots=bs)
    tree, rows = strong_or_useless_tree(bs, strong=True, budget=8), torch.arange(bs)
    for _ in range(100):
        assert ctl.held_budget(bs) is None
        fc = ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid)
        budget = ctl.choose(fc, bs)
        ctl.observe(fc, budget, torch.zeros(bs, dtype=torch.long))
        for tokens in (1, 2, 6):  # hold - 1 held steps
            held = top_nodes(tree, ctl.held_budget(bs))
            accept = torch.full((bs,), tokens, dtype=torch.long)
            ctl.observe_committed(ctl.last_budget, accept)  # as decode_step: both, in order
            ctl.observe_held(rows, held.logprobs, held.depths, held.valid, accept)
    column = budgets.index(budget)
    assert fc.accept[:, column].mean().item() == pytest.approx(mean, rel=0.1)
    stats = ctl.stats()
    assert stats.request_steps == 100 * hold * bs  # request-steps served, sampled or not
    assert stats.accepted_tokens == 100 * (1 + 2 + 6) * bs  # exact, sampled or not
    assert stats.mean_predicted_accept == pytest.approx(mean, rel=0.1)  # the sampled estimate


def test_predicted_and_observed_accept_are_compared_on_the_same_calibrated_steps():
    """A grafted tree's held steps do not calibrate (not a nested DDTree: ``decode_step`` calls
    ``observe_committed`` alone), and its forecast steps are calibrated every time, off the
    held steps' stride (``sampled=False``): the prediction covers the forecast steps, and the
    observed accept length it is compared with (``mean_calibrated_accept``) covers those same
    steps, here 1 token against the held steps' 5; the exact totals still count every step."""
    budgets, bs, hold = (0, 4, 8), 2, 4
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 2, 64))
    config = ControlConfig(budgets=budgets, hold_steps=hold, max_depth=15, held_observe_every=8)
    ctl = BudgetController(config, flat, max_slots=bs)
    tree, rows = strong_or_useless_tree(bs, strong=True, budget=8), torch.arange(bs)
    for _ in range(50):
        assert ctl.held_budget(bs) is None
        fc = ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid)
        step = ctl.observe(fc, ctl.choose(fc, bs), torch.ones(bs, dtype=torch.long), False)
        assert step is not None
        for _ in range(hold - 1):
            ctl.observe_committed(ctl.held_budget(bs), torch.full((bs,), 5))
    stats = ctl.stats()
    assert stats.calibrated_request_steps == 50 * bs and stats.mean_calibrated_accept == 1.0
    assert stats.mean_predicted_accept == pytest.approx(1.0, rel=0.1)
    assert stats.request_steps == 50 * hold * bs and stats.mean_observed_accept == 4.0


def test_the_gap_between_predicted_and_observed_comes_with_its_standard_error():
    """Each calibrated request-step adds (weight x (predicted - accepted))^2, a drafted step
    (forecast or held) sampled one in ``held_observe_every`` counting for that many: the
    standard error of the mean gap is the square root of the sum over the calibrated
    request-steps (so a 10% gap over a few dozen request-steps reads as noise, over thousands
    as a bias)."""
    budgets, bs, hold, every = (0, 4, 8), 3, 3, 2
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 4, 64))
    config = ControlConfig(budgets=budgets, hold_steps=hold, held_observe_every=every)
    ctl = BudgetController(config, flat, max_slots=bs)
    tree, rows = strong_or_useless_tree(bs, strong=True, budget=8), torch.arange(bs)
    coins = torch.Generator().manual_seed(3)
    squared, steps, seen = 0.0, 0, 0
    logged = torch.zeros(2)  # the steps' own [predicted, accepted] sums, weighted by stride
    for _ in range(20):
        assert ctl.held_budget(bs) is None
        fc = ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid)
        budget = ctl.choose(fc, bs)
        accept = torch.randint(0, 4, (bs,), generator=coins)
        predicted = fc.accept[:, budgets.index(budget)]  # what the step is compared with
        seen += 1
        if seen % every == 0:
            error = (every * (predicted - accept)).square().sum().item()
            squared, steps = squared + error, steps + every * bs
        step = ctl.observe(fc, budget, accept)
        assert (step is not None) == (seen % every == 0)  # None: not calibrated
        if step is not None:
            assert step.tolist() == pytest.approx([predicted.sum().item(), accept.sum().item()])
            logged += every * step
        for _ in range(hold - 1):
            held = top_nodes(tree, ctl.held_budget(bs))
            # its prediction now: the same nodes, the calibration as it stands
            now = ctl.forecast(rows, tree.logprobs, tree.depths, tree.valid)
            predicted = now.accept[:, budgets.index(ctl.last_budget)]
            accept = torch.randint(0, 4, (bs,), generator=coins)
            seen += 1
            if seen % every == 0:  # sampled: counts for ``every`` steps
                error = (every * (predicted - accept)).square().sum().item()
                squared, steps = squared + error, steps + every * bs
            ctl.observe_committed(ctl.last_budget, accept)
            step = ctl.observe_held(rows, held.logprobs, held.depths, held.valid, accept)
            assert (step is not None) == (seen % every == 0)  # None: not calibrated
            if step is not None:
                logged += every * step
    stats = ctl.stats()
    assert logged.tolist() == pytest.approx(
        [stats.predicted_accept_tokens, stats.calibrated_accepted_tokens], rel=1e-5
    )
    assert stats.calibrated_request_steps == steps
    assert stats.calibration_squared_error == pytest.approx(squared, rel=1e-5)
    assert stats.accept_gap_stderr == pytest.approx(squared**0.5 / steps, rel=1e-5)


def test_choice_shrinks_at_a_compute_bound_batch():
    lp, tok = random_marginals(1, 15, 16, 64, seed=11, sharpness=4.0)
    chosen = {}
    for bs in (1, 4, 16, 64):
        ctl = roofline_controller()
        tree = build_ddtree(lp.expand(bs, -1, -1), tok.expand(bs, -1, -1), 64)
        fc = ctl.forecast(torch.arange(bs), tree.logprobs, tree.depths, tree.valid)
        chosen[bs] = ctl.choose(fc, bs)
    assert chosen[1] >= 32, chosen
    assert chosen[64] < chosen[1] and chosen[64] > 0, chosen
    assert all(chosen[a] >= chosen[b] for a, b in itertools.pairwise((1, 4, 16, 64))), chosen


def test_fixed_mode_same_interface_no_latency():
    ctl = BudgetController(ControlConfig(fixed_budget=32), None, max_slots=2)
    tree = strong_or_useless_tree(2, strong=True, budget=32)
    fc = ctl.forecast(torch.arange(2), tree.logprobs, tree.depths, tree.valid)
    assert ctl.should_draft(2) and ctl.choose(fc, 2) == 32
    ctl.observe(fc, 32, torch.tensor([15, 3]))
    ctl.record_step(2, 32, 0.01)
    assert ctl.stats().mean_observed_accept == 9.0
    assert not BudgetController(ControlConfig(fixed_budget=0), None, 1).should_draft(2)
    with pytest.raises(ValueError):
        BudgetController(ControlConfig(), None, max_slots=2)


def test_profile_measures_every_candidate_before_choosing():
    """With ``profile_steps``, each candidate's cell is measured (budget 0 without drafting)
    before the model chooses, round robin (every step a switch: a slow spell of the machine
    does not set whole cells); then the choice is the model's."""
    ctl = roofline_controller(profile_steps=2)
    tree = strong_or_useless_tree(1, strong=False)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    order = []
    for _ in range(2 * (len(ctl.config.budgets) + 1)):
        budget, drafted = step_budget(ctl, 1, None)  # a profile step needs no forecast
        ctl.record_step(1, budget, 0.01 * (budget + 1), drafted)
        order.append((budget, drafted))
    # the step after a plain one is not recorded (record_step): budget 4 runs twice a round
    assert order == 2 * ([(0, False), (4, True)] + [(b, True) for b in ctl.config.budgets[1:]])
    assert ctl.latency.count[0] == [2] * len(ctl.config.budgets)
    assert step_budget(ctl, 1, fc) == (4, True)  # profiled: useless drafter -> plain
    assert step_budget(ctl, 1, fc) == (0, False)


def test_the_drafted_step_after_a_plain_one_does_not_set_its_budgets_cell():
    """A drafted step right after a plain one pays the drafter's catch-up on the plain
    forwards' context. In the start-up profile's round robin that step is always budget 4's:
    recorded, budget 4's cell read the catch-up as its own cost (batch size 16 through SGLang:
    0.97x budget 8's cell for a true 0.85x) and auto never chose it again. Not recorded, the
    profile measures budget 4 on the next step and the cells keep their true ratio."""
    ctl = roofline_controller(budgets=(0, 4, 8), profile_steps=3)
    cost = {0: 0.013, 4: 0.0257, 8: 0.0304}  # per forward; held steps at batch size 16
    catch_up = 0.009  # the first drafted step after a plain one
    last_plain = False
    for _ in range(3 * 4):
        budget, drafted = step_budget(ctl, 16, None)
        ctl.record_step(16, budget, cost[budget] + (catch_up if last_plain else 0.0), drafted)
        last_plain = not drafted
    assert ctl.latency.count[bucket_of(ctl.latency.bs_buckets, 16)] == [3, 3, 3]
    row = ctl.latency.row(16)
    assert row[1] / row[2] == pytest.approx(cost[4] / cost[8], rel=0.02)


def test_after_one_whole_profile_a_bucket_profiles_its_contenders_alone():
    """Once one bucket's row is measured for every candidate, another profiled bucket forecasts
    first (its unmeasured cells read the measured row) and profiles only the budgets within
    ``explore_margin`` of the best: round robin, then the model's choice."""
    ctl = roofline_controller(profile_steps=2, explore_margin=0.15)
    cost = {0: 0.010, 4: 0.012, 8: 0.013, 16: 0.015, 32: 0.020, 64: 0.030}  # per forward
    # batch size 1: every candidate, twice (budget 4 once more a round: after the plain step)
    for _ in range(2 * (len(cost) + 1)):
        budget, drafted = step_budget(ctl, 1, None)
        ctl.record_step(1, budget, cost[budget], drafted)
    assert ctl.latency.count[0] == [2] * len(cost)
    tree = strong_or_useless_tree(2, strong=True)
    fc = ctl.forecast(torch.arange(2), tree.logprobs, tree.depths, tree.valid)
    assert ctl.should_draft(2) and ctl.held_budget(2) is None  # a forecast first
    ctl.choose(fc, 2)
    order = []
    for _ in range(6):
        budget, drafted = step_budget(ctl, 2, fc)
        ctl.record_step(2, budget, 1.5 * cost[budget], drafted)
        order.append(budget)
    assert order == [8, 16, 32, 8, 16, 32]  # the contenders, twice; 0, 4 and 64 lose by > 15%
    assert ctl.latency.count[1] == [0, 0, 2, 2, 2, 0]
    assert step_budget(ctl, 2, fc) == (16, True)  # profiled: the model's choice again


def test_a_cell_is_set_by_its_first_times_and_then_moved_by_switches_alone():
    """A cell's first ``first_steps`` times set its cost (their lower median: a slow warm-up
    step does not). After that, one cell's times compared with each other measure the
    machine, not the cell: a lasting slowdown while one budget runs moves the load, and the
    other cell with it. Only a switch between cells measures one cost against the other:
    the first switches are averaged, so a few reach the true ratio, and later ones move it a
    tenth of the way (``pair_rate``): a burst across one switch then moves the ratio by
    ``pair_rate * pair_clip`` at most."""
    budgets = (0, 8)
    model = LatencyModel([[1.0, 1.0]], budgets, bs_buckets=(1,))
    for seconds in (5.0, 0.2, 0.3):  # a slow first step (warm-up), then the real cost
        model.record(1, 8, seconds)
    assert model.seconds(1, 8) == pytest.approx(0.3)
    for _ in range(8):  # the machine twice as slow while budget 8 runs
        model.record(1, 8, 0.6)
    assert model.load == pytest.approx(2.0)
    assert model.seconds(1, 8) == pytest.approx(0.6)
    for _ in range(3):  # budget 0's first times, at the slow speed: its cost at load 1 is 0.1
        model.record(1, 0, 0.2)
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(3.0)
    for _ in range(4):  # budget 8 truly costs 3.3 plain steps: four switches each way...
        model.record(1, 8, 0.66)
        model.record(1, 0, 0.2)
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(3.3, rel=0.01)  # ... find it
    assert plain == pytest.approx(0.2, rel=0.01)  # times the load, as measured now
    for _ in range(40):  # established cells
        model.record(1, 8, 0.66)
        model.record(1, 0, 0.2)
    model.record(1, 8, 1.32)  # a burst of twice the time across a switch: the ratio moves 2%
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(3.3 * math.exp(0.02), rel=1e-3)
    for _ in range(200):  # the cost of 8 changes to 4.5 plain steps: switches follow
        model.record(1, 0, 0.2)
        model.record(1, 8, 0.9)
    plain, eight = model.row(1)
    assert eight / plain == pytest.approx(4.5, rel=0.01)
    model.forget(1, 8)  # a forgotten cell's next first times set it afresh
    for _ in range(3):
        model.record(1, 8, 0.4)
    assert model.row(1)[1] == pytest.approx(0.4, rel=0.01)
    with pytest.raises(ValueError):
        LatencyModel([[1.0, 1.0]], budgets, (1,), LatencyConfig(load_window=0))


def test_cells_measured_at_other_speeds_of_the_machine_compare_as_budgets():
    """The machine slows down by a third while budget 8 runs (a neighbour, the OS): budget
    16, measured before at the old speed, must still read what it costs at the new one, or
    the choice would compare two speeds of the machine instead of two budgets (8's times
    alone would make 16 look 25% cheaper than 8 pays after it). The load follows the
    slowdown, the cells keep their relative costs, and a burst shorter than half the load
    window moves neither."""
    budgets = (8, 16)
    model = LatencyModel([[1.0, 1.0]], budgets, bs_buckets=(1,))
    for _ in range(8):  # both measured at the machine's usual speed: 16 costs 10% more
        model.record(1, 8, 0.010)
        model.record(1, 16, 0.011)
    model.record(1, 8, 0.010)
    assert model.load == pytest.approx(1.0)
    for _ in range(3):  # a burst of three steps: the load (median of 8 ratios) holds
        model.record(1, 8, 0.020)
    assert model.load == pytest.approx(1.0)
    for _ in range(16):  # then the machine is a third slower for good, while 8 runs
        model.record(1, 8, 0.0133)
    assert model.load == pytest.approx(1.33)
    eight, sixteen = model.row(1)
    assert eight == pytest.approx(0.0133)
    assert sixteen / eight == pytest.approx(1.1)  # 16's cost, at today's speed
    model.record(1, 16, 0.0146)  # 16 at the new speed: agrees, nothing moves
    assert model.row(1) == pytest.approx([0.0133, 0.0146], rel=0.01)


def test_a_cell_first_measured_in_a_burst_reads_its_cost_not_the_burst():
    """A cell's first times are taken over the speed of the last step of a cell already set
    (a switch's measure), not over the load's median: a burst of a few steps has not moved
    that median yet, and a budget first measured (or re-measured after ``forget``) in one read
    1.5x its cost, then was avoided for it (``benchmarks/latency_replay.py``, an auto server's steps
    under a synthetic bursty machine: the worst log error of a row's ratios 0.20, 0.18 so)."""
    budgets = (0, 4, 8)
    model = LatencyModel([[1.0, 1.0, 1.0]], budgets, bs_buckets=(1,))
    for _ in range(4):  # plain steps and budget 4 at the machine's usual speed
        model.record(1, 0, 0.010)
        model.record(1, 4, 0.020)
    model.record(1, 4, 0.030)  # a burst: 1.5x, two steps so far
    model.record(1, 4, 0.030)
    assert model.load == pytest.approx(1.0)  # the load's median has not moved
    for _ in range(3):  # budget 8 (truly 25 ms) first measured in the burst
        model.record(1, 8, 0.0375)
    _, four, eight = model.row(1)
    assert eight / four == pytest.approx(1.25)
    model.forget(1, 8)  # re-measured in another burst: the same
    for _ in range(2):
        model.record(1, 4, 0.030)
    for _ in range(3):
        model.record(1, 8, 0.0375)
    _, four, eight = model.row(1)
    assert eight / four == pytest.approx(1.25)


def test_isotonic_pools_decreasing_runs_by_weight():
    assert isotonic([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 3.0, 2.0], [1, 1, 3]) == pytest.approx([1.0, 2.25, 2.25])
    assert isotonic([4.0, 1.0, 1.0, 5.0], [2, 1, 1, 1]) == pytest.approx([2.5, 2.5, 2.5, 5.0])


def test_a_row_never_predicts_a_bigger_tree_cheaper():
    """A cell measured under a burst (budget 8 here) is pooled with the bigger budget measured
    often, weighted by sample counts; an unmeasured cell's prior is clamped between its
    measured neighbours. Without this, the burst keeps budget 8 unchosen until re-measured."""
    budgets = (0, 4, 8, 16, 32)
    model = LatencyModel([[1.0, 2.0, 3.0, 4.0, 100.0]], budgets, bs_buckets=(1,))
    for _ in range(3):
        model.record(1, 0, 0.006)
        model.record(1, 8, 0.0135)  # a burst of load while budget 8 was profiled
    for _ in range(8):
        model.record(1, 16, 0.0105)
    row = model.row(1)
    assert row == sorted(row)
    assert row[2] == row[3] == pytest.approx((3 * 0.0135 + 8 * 0.0105) / 11)
    assert row[0] == pytest.approx(0.006)
    assert row[0] <= row[1] <= row[2]  # unmeasured 4: between its measured neighbours
    assert row[4] >= row[3]  # unmeasured 32: at least 16's


def exploring_controller():
    """Auto at batch size 1 profiling each cell once, exploring every 4th drafted step, and a
    strong drafter's forecast."""
    ctl = roofline_controller(profile_steps=1, explore_every=4)
    tree = strong_or_useless_tree(1, strong=True)
    return ctl, ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)


def test_exploration_re_measures_plain_steps_while_auto_drafts():
    """C(bs, 0) is measured by plain steps only: while auto sits at a budget > 0, the stalest
    cell is sometimes budget 0's, and then a plain step (no draft) comes right before the
    exploration step, which takes the stalest budget > 0. A strong drafter keeps auto drafting."""
    ctl, fc = exploring_controller()
    steps, reasons = [], []
    profile = len(ctl.config.budgets) + 1  # budget 4 twice: once after the plain step
    for _ in range(profile + 16):  # the profile, then 16 steps
        budget, drafted = step_budget(ctl, 1, fc)
        ctl.record_step(1, budget, 0.01 + 2e-4 * budget, drafted)  # drafting pays
        steps.append((budget, drafted))
        reasons.append(ctl.reason)
    assert set(reasons[:profile]) == {"profile"}
    assert [reasons[profile + i] for i in (3, 4, 5, 8, 12)] == ["explore"] * 5
    assert {reasons[profile + i] for i in (0, 1, 2, 6, 7)} == {"expired"}  # no hold
    after = steps[profile:]
    plain = [i for i, (_, drafted) in enumerate(after) if not drafted]
    assert plain == [3]  # budget 0's cell (stamped at the profile) is explored first, once
    assert after[3] == (0, False)
    assert ctl.latency.count[0][0] == 2  # the profile's plain step and the explored one
    best = after[0][0]
    assert best > 0 and [b for i, (b, _) in enumerate(after) if i not in (3, 4, 5, 8, 12)] == (
        [best] * 11
    )
    assert len({after[i][0] for i in (4, 8, 12)} - {best}) == 3  # then the stalest > 0
    assert after[5] == after[4]  # after the plain step one step more (the first is not timed)


def test_an_exploration_takes_one_plain_step_even_when_its_time_is_lost():
    """The exploration's plain step comes once per exploration: when its time is not recorded
    (the SGLang worker drops a step's time when a prefill runs before the next step), budget 0
    stays the stalest cell, and the exploration still drafts next (it once took plain steps
    until the batch changed)."""
    ctl, fc = exploring_controller()
    drafted_flags = []
    profile = len(ctl.config.budgets) + 1  # budget 4 twice: once after the plain step
    for _ in range(profile + 40):  # the profile, then 40 steps
        budget, drafted = step_budget(ctl, 1, fc)
        if drafted or ctl.latency.count[0][0] == 0:  # the profile's plain step alone is timed
            ctl.record_step(1, budget, 0.01 + 2e-4 * budget, drafted)
        drafted_flags.append(drafted)
    after = drafted_flags[profile:]
    plain = [i for i, drafted in enumerate(after) if not drafted]
    assert ctl.latency.count[0][0] == 1
    assert len(plain) >= 4 and all(b - a >= 4 for a, b in itertools.pairwise(plain))


def test_exploration_re_measures_the_stalest_budget_without_a_forecast():
    """After the profile, every ``explore_every``-th drafted step takes the budget > 0
    measured longest ago, whatever the model prefers, without a forecast (it costs what a
    held step of that budget costs); a plain run's probes always forecast."""
    steep = [[0.01] + [0.012] + [1.0] * 4] * 3  # the model wants 4 (trees above cost 100x)
    budgets = (0, 4, 8, 16, 32, 64)
    ctl = BudgetController(
        ControlConfig(budgets=budgets, profile_steps=1, explore_every=4),
        LatencyModel(steep, budgets, bs_buckets=(1, 8, 64)),
        max_slots=8,
    )
    tree = strong_or_useless_tree(1, strong=True)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    for _ in range(len(budgets) + 1):  # the profile (budget 4 twice: after the plain step)
        budget, drafted = step_budget(ctl, 1, None)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], drafted)
    chosen = []
    for _ in range(12):
        budget, drafted = step_budget(ctl, 1, fc)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], drafted)
        chosen.append(budget)
    # budget 0's cell (the profile's) is the stalest first: a plain step, then the stalest > 0
    # (for two steps: the first after a plain step is not timed)
    assert chosen == [4, 4, 4, 0, 8, 8, 4, 4, 16, 4, 4, 4]
    useless = roofline_controller(profile_steps=1, explore_every=2)
    bad = strong_or_useless_tree(1, strong=False)
    bad_fc = useless.forecast(torch.arange(1), bad.logprobs, bad.depths, bad.valid)
    for _ in range(len(budgets) + 1):
        budget, drafted = step_budget(useless, 1, None)
        useless.record_step(1, budget, 0.01 * (budget + 1), drafted)
    probes = []
    for _ in range(40):
        budget, drafted = step_budget(useless, 1, bad_fc)
        useless.record_step(1, budget, 0.01 * (budget + 1), drafted)
        probes.append(budget)
    assert set(probes) == {0, 4}  # probes forecast (and verify at 4): no exploration


def test_explorations_re_measure_the_contenders_alone():
    """With ``explore_margin``, an exploration re-measures only the budgets whose predicted
    rate at the bucket's last forecast was within that fraction of the best (a budget far
    behind cannot become the choice by a fresher time; at batch size 16 budget 32 costs twice
    budget 4's step); with margin 1 every budget takes its turn, plain steps included."""
    budgets = (0, 4, 8, 16, 32, 64)
    row = [0.01, 0.012, 0.0125, 1.0, 1.0, 1.0]  # 4 and 8 close; bigger trees 80x dearer

    def chosen(margin: float) -> list[tuple[int, bool]]:
        ctl = BudgetController(
            ControlConfig(budgets=budgets, profile_steps=1, explore_every=4, explore_margin=margin),
            LatencyModel([row] * 3, budgets, bs_buckets=(1, 8, 64)),
            max_slots=8,
        )
        tree = strong_or_useless_tree(1, strong=True)
        fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
        steps = []
        profile = len(budgets) + 1  # budget 4 twice: once after the plain step
        for _ in range(profile + 32):  # the profile, then 32 steps
            budget, drafted = step_budget(ctl, 1, fc)
            ctl.record_step(1, budget, row[budgets.index(budget)], drafted)
            steps.append((budget, drafted))
        return steps[profile:]

    contenders = chosen(0.3)
    assert {b for b, _ in contenders} == {4, 8} and all(drafted for _, drafted in contenders)
    everyone = chosen(1.0)
    assert {b for b, _ in everyone} == set(budgets)  # 16, 32, 64 and a plain step too
    assert (0, False) in everyone


def test_a_cell_dearer_than_a_larger_budgets_is_explored_whatever_its_rate():
    """A larger tree is never less work: a cell set dearer than a larger budget's (here budget
    4's profile times taken in a slow spell, 30 ms against budget 16's 16) is an artefact of
    when it was measured. The row's fit pools it up, its predicted rate falls more than
    ``explore_margin`` behind and explorations would never re-measure it; with
    ``explore_inverted`` it stays a contender, is explored, and its fresh times correct it."""
    budgets = (0, 4, 8, 16)
    true = {0: 0.008, 4: 0.010, 8: 0.014, 16: 0.016}
    slow_profile = dict(true) | {4: 0.030}

    def after_profile(inverted: float | None) -> tuple[list[int], BudgetController]:
        config = ControlConfig(
            budgets=budgets, profile_steps=1, explore_every=4, explore_margin=0.15,
            explore_inverted=inverted,
        )  # fmt: skip
        ctl = BudgetController(
            config, LatencyModel([list(true.values())] * 3, budgets, (1, 8, 64)), max_slots=8
        )
        tree = strong_or_useless_tree(1, strong=True)
        fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
        steps = []
        for i in range(len(budgets) + 1 + 48):  # the profile (budget 4 twice), then 48 steps
            budget, drafted = step_budget(ctl, 1, fc)
            times = slow_profile if i <= len(budgets) else true
            ctl.record_step(1, budget, times[budget], drafted)
            steps.append(budget)
        return steps[len(budgets) + 1 :], ctl

    steps, ctl = after_profile(None)
    assert 4 not in steps and ctl.latency.inverted(1, 0.1) == [4]  # never re-measured
    steps, ctl = after_profile(0.1)
    assert 4 in steps and ctl.latency.inverted(1, 0.1) == []  # explored and corrected
    # Against ANY larger budget, beyond the margin: 4 and 8 exceed 16 (4 not 8 by 10%).
    model = LatencyModel([[0.01] * len(budgets)] * 3, budgets, (1, 8, 64))
    for budget, seconds in ((4, 0.020), (8, 0.021), (16, 0.015), (0, 0.0155)):
        for _ in range(3):
            model.record(1, budget, seconds)
    assert model.inverted(1, 0.1) == [4, 8] and model.inverted(1, 0.5) == []  # 0: 3% over


def test_the_budget_below_the_best_is_explored_and_a_trapped_choice_walks_down():
    """A profile that read budgets 8 and 16 cheap (0.69x and 0.5x their true cost, budget 4 at
    its own) makes 16 the best by 12.5% over 8 and 25% over 4; both are more than
    ``explore_margin`` behind, so explorations never re-measure them and 16 holds for good.
    With ``explore_below_best`` the budget below the best is explored: the switches into and
    out of it correct the ratio, 8 becomes the best, then 4 (the true best, 1.3x 8's rate)."""
    budgets = (0, 4, 8, 16)
    tree = strong_or_useless_tree(1, strong=True)

    def run(below: bool) -> tuple[list[int], list[float], dict[int, float]]:
        config = ControlConfig(
            budgets=budgets, profile_steps=1, explore_every=4, explore_margin=0.08,
            explore_below_best=below,
        )  # fmt: skip
        latency = LatencyModel([[0.01] * 4] * 3, budgets, (1, 8, 64), LatencyConfig(first_steps=1))
        ctl = BudgetController(config, latency, max_slots=8)
        fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
        total = dict(zip(budgets, (1.0 + fc.expected).sum(0).tolist(), strict=True))
        scale = {4: 1.0, 8: 1.3, 16: 1.6}  # B 4's true rate over B N's
        true = {0: 0.008} | {b: 0.01 * total[b] / total[4] * scale[b] for b in scale}
        profile = true | {8: true[8] * 0.9 / 1.3, 16: true[16] * 0.8 / 1.6}
        steps = []
        for i in range(len(budgets) + 1 + 240):  # the profile (budget 4 twice), then 240
            budget, drafted = step_budget(ctl, 1, fc)
            ctl.record_step(1, budget, (profile if i <= len(budgets) else true)[budget], drafted)
            steps.append(budget)
        return steps[len(budgets) + 1 :], ctl.latency.row(1), true

    trapped, _, _ = run(below=False)
    assert set(trapped) == {16}  # 4 and 8 never re-measured
    steps, seconds, true = run(below=True)
    assert set(steps[-40:]) == {4} and 8 in steps[:40]
    # B 8 over B 4: the profile's 0.69x the true ratio, corrected to within 10% of it
    assert seconds[2] / seconds[1] == pytest.approx(true[8] / true[4], rel=0.1)


def test_a_neighbour_read_too_dear_is_explored_afresh_once_its_cell_is_stale():
    """The profile read budget 16 at 1.5x its cost, which puts it 27% behind budget 8 where it
    truly beats it by 10%: no contender, never re-measured, and 8 holds for good (seen on the
    small pair at batch size 1: B 16 and B 32 kept their 3 profile times through a whole run).
    With ``explore_stale_neighbours`` the best's neighbours whose cells are ``forget_after``
    drafted steps old are contenders: 16 is explored, its stale cost forgotten and set by its
    fresh times, and 16 holds; the stale neighbour below (8) is then re-measured once per
    ``forget_after`` drafted steps, and 4 (no neighbour of 16) never again."""
    budgets = (0, 4, 8, 16)
    tree = strong_or_useless_tree(1, strong=True)

    def run(stale: bool) -> tuple[list[int], list[int]]:
        config = ControlConfig(
            budgets=budgets, profile_steps=1, explore_every=8, explore_margin=0.08,
            forget_after=48, hold_steps=4, explore_stale_neighbours=stale,
        )  # fmt: skip
        latency = LatencyModel([[0.01] * 4] * 2, budgets, (1, 8), LatencyConfig(first_steps=1))
        ctl = BudgetController(config, latency, max_slots=8)
        fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
        total = dict(zip(budgets, (1.0 + fc.expected).sum(0).tolist(), strict=True))
        scale = {4: 0.9, 8: 1.0, 16: 1.1}  # B N's true rate over B 8's
        true = {0: 0.02} | {b: 0.01 * total[b] / total[8] / scale[b] for b in scale}
        profile = true | {16: 1.5 * true[16]}
        steps = []
        for i in range(len(budgets) + 1 + 200):  # the profile (budget 4 twice), then 200
            budget, drafted = step_budget(ctl, 1, fc)
            ctl.record_step(1, budget, (profile if i <= len(budgets) else true)[budget], drafted)
            steps.append(budget)
        return steps[len(budgets) + 1 :], latency.count[0]

    trapped, counts = run(stale=False)
    assert set(trapped) == {8} and counts[3] == 1  # B 16: its one profile time
    steps, counts = run(stale=True)
    assert 16 in steps[:80] and steps[-100:].count(16) >= 95
    assert steps.count(4) == 1  # stale next to 8 once, then no neighbour of the best


def test_a_new_buckets_profile_walks_to_the_measured_best_through_its_neighbours():
    """Batch size 16 first reads its cells from batch size 1's through the prior, which puts
    B 8 at 0.05 s where it takes 0.032 (B 4 0.03): B 8 predicted 23% behind B 4, no
    contender, never profiled nor explored, and B 4 holds at 0.83x B 8's rate. With
    ``profile_neighbours`` the profile measures the best's neighbours (0 and 8), B 8 becomes
    the best, its neighbour 16 is measured once (0.06 s, no better) and B 8 holds."""
    budgets = (0, 4, 8, 16)
    prior = [[0.01] * 4, [0.02, 0.03, 0.05, 0.09]]
    true = {0: 0.02, 4: 0.03, 8: 0.032, 16: 0.06}  # batch size 16; batch size 1: 0.01 each
    tree = strong_or_useless_tree(16, strong=True)

    def run(neighbours: bool) -> tuple[list[int], list[int]]:
        config = ControlConfig(
            budgets=budgets, profile_steps=1, explore_every=4, explore_margin=0.08,
            profile_neighbours=neighbours,
        )  # fmt: skip
        latency = LatencyModel(prior, budgets, (1, 16), LatencyConfig(first_steps=1))
        ctl = BudgetController(config, latency, max_slots=16)
        for _ in range(len(budgets) + 1):  # batch size 1: every candidate (B 4 after 0 not timed)
            budget, drafted = step_budget(ctl, 1, None)
            ctl.record_step(1, budget, 0.01, drafted)
        assert latency.count[0] == [1] * 4
        fc = ctl.forecast(torch.arange(16), tree.logprobs, tree.depths, tree.valid)
        steps = []
        for _ in range(60):
            budget, drafted = step_budget(ctl, 16, fc)
            ctl.record_step(16, budget, true[budget], drafted)
            steps.append(budget)
        return steps, latency.count[1]

    steps, counts = run(neighbours=False)
    assert set(steps) == {4} and counts[2:] == [0, 0]  # B 8 and 16 never measured
    steps, counts = run(neighbours=True)
    assert set(steps[-40:]) == {8}
    assert counts[0] >= 1 and counts[3] >= 1  # 0 and 16 profiled as neighbours
    assert steps.count(16) == 1 and steps.count(0) == 1  # once each, not explored again


def test_a_stale_cell_is_re_measured_by_fresh_times_alone():
    """A cell measured under another load (here budget 8 at 30 ms, nine times) is explored for
    ``explore_steps`` steps and then reads those fresh times alone, so auto moves to it once it
    has become cheap; a fresh time or three in a window of old ones would leave it at 30 ms."""
    budgets = (0, 4, 8, 16)
    then = {0: 0.010, 4: 0.012, 8: 0.030, 16: 1.0}
    now = {0: 0.010, 4: 0.012, 8: 0.0125, 16: 1.0}
    ctl = BudgetController(
        ControlConfig(budgets=budgets, profile_steps=1, explore_every=4, explore_steps=3),
        LatencyModel([[then[b] for b in budgets]] * 2, budgets, bs_buckets=(1, 8)),
        max_slots=8,
    )
    tree = strong_or_useless_tree(1, strong=True)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    for _ in range(len(budgets) + 1):  # the profile, under the old load (budget 4 twice)
        budget, drafted = step_budget(ctl, 1, None)
        ctl.record_step(1, budget, then[budget], drafted)
    for _ in range(8):
        ctl.record_step(1, 8, then[8])
    steps = []
    for _ in range(12):
        budget, drafted = step_budget(ctl, 1, fc)
        ctl.record_step(1, budget, now[budget], drafted)
        steps.append(budget if drafted else "plain")
    # three forecasts at 4, budget 0's stale cell by a plain step, 8's by three held steps
    assert steps[:7] == [4, 4, 4, "plain", 8, 8, 8]
    assert ctl.latency.row(1)[budgets.index(8)] == pytest.approx(now[8])
    # 8 now pays more than 4; the exploration's held steps count as drafted: 16 is next
    assert steps[7:] == [8, 16, 16, 16, 8]


def test_a_larger_budget_must_beat_the_best_smaller_one_by_the_tie_margin():
    """Neighbouring budgets' predicted rates are often closer than the latency model's error:
    auto takes a larger budget only for a clear gain (``step.TIE_RTOL``), never for a close
    call, and a clear gain two candidates up still wins over a close call one up."""
    from sglang_tree_spec.config import TreeConfig
    from sglang_tree_spec.control import best_budget
    from sglang_tree_spec.step import TIE_RTOL, make_controller

    budgets = (0, 4, 8, 16)
    seconds = [1.0, 1.0, 1.0, 1.0]
    # committed/seconds: 8 is 0.5% above 4, 16 is 2% above 4.
    close, clear = [1.0, 2.0, 2.01, 1.0], [1.0, 2.0, 2.01, 2.04]
    flat = LatencyModel([seconds], budgets, bs_buckets=(1,))
    auto = make_controller(TreeConfig(budget=16, auto=True), 15, 8, "cpu", flat).config
    assert auto.tie_rtol == TIE_RTOL == 0.01
    assert best_budget(close, seconds, budgets, tie_rtol=auto.tie_rtol) == 4
    assert best_budget(close, seconds, budgets) == 8  # exact argmax without the margin
    assert best_budget(clear, seconds, budgets, tie_rtol=auto.tie_rtol) == 16
    assert best_budget(clear, seconds, budgets, max_budget=8, tie_rtol=auto.tie_rtol) == 4


def test_a_policy_strings_latency_keys_set_its_own_latency_models_config():
    """``auto:pair=0.05:hold=4`` (a benchmark's auto variant): ``hold`` is a ControlConfig
    field, ``pair`` its latency model's ``LatencyConfig.pair_rate``, which then moves a switch's
    cells by that rate; a controller made without overrides leaves its model's config alone."""
    from sglang_tree_spec.config import TreeConfig
    from sglang_tree_spec.step import HOLD_STEPS, auto_overrides, make_controller

    fields = auto_overrides("auto:pair=0.05:hold=4")
    assert fields == {"latency": {"pair_rate": 0.05}, "hold_steps": 4}
    assert auto_overrides("auto:below=1") == {"explore_below_best": True}
    assert auto_overrides("auto:below=0") == {"explore_below_best": False}
    assert auto_overrides("auto:near=1:below=0:stale=0") == {
        "profile_neighbours": True,
        "explore_below_best": False,
        "explore_stale_neighbours": False,
    }
    with pytest.raises(ValueError, match="0 or 1"):
        auto_overrides("auto:below=true")
    config = TreeConfig(budget=16, auto=True)
    budgets = config.budgets

    def switches(overrides):
        model = LatencyModel([[0.01] * len(budgets)], budgets, bs_buckets=(1,))
        ctl = make_controller(config, 15, 8, "cpu", model, overrides)
        for seconds in [0.010] * 3 + [0.012] * 3 + [0.010, 0.0125] * 20:  # B 4, B 8, switches
            ctl.record_step(1, 4 if seconds == 0.010 else 8, seconds)
        return ctl, model

    ctl, model = switches(fields)
    assert ctl.config.hold_steps == 4 and model.config.pair_rate == 0.05
    plain, default = switches(None)
    assert plain.config.hold_steps == HOLD_STEPS and default.config == LatencyConfig()
    eight, four = budgets.index(8), budgets.index(4)
    gap = [m._cost[0, eight] - m._cost[0, four] for m in (model, default)]  # log cost B8 - B4
    assert math.log(1.2) < gap[0] < gap[1] < math.log(1.25)  # the slower rate lags the switches


def test_the_log_line_shows_each_cells_time_and_measured_steps():
    """``latency_line``: C(bs, N) in ms and how many steps its cell has measured (a cell of
    few steps is the first suspect when auto avoids a budget)."""
    budgets = (0, 4, 8)
    model = LatencyModel([[0.01, 0.02, 0.03]], budgets, bs_buckets=(1,))
    ctl = BudgetController(ControlConfig(budgets=budgets), model, max_slots=4)
    for _ in range(2):
        ctl.record_step(1, 4, 0.025)
    plain, four, eight = ctl.latency_line(1).split()
    assert four == "4:25.0/2"
    assert plain == "0:12.5/0" and eight == "8:37.5/0"  # the prior, scaled by 25 / 20


def test_a_plain_steps_time_is_recorded_per_forward():
    """Budget 0's cell is per target forward: a plain step of two forwards records half its
    time (so C(bs, 0) stays below every drafted cell and rate(0) = bs / C(bs, 0)); a drafted
    step records its whole time."""
    budgets = (0, 4, 8)
    model = LatencyModel([[1.0, 2.0, 3.0]], budgets, bs_buckets=(1,))
    ctl = BudgetController(ControlConfig(budgets=budgets), model, max_slots=1)
    for _ in range(3):
        ctl.record_step(1, 0, 0.012, drafted=False, forwards=2)
        ctl.record_step(1, 8, 0.02)
    assert model.seconds(1, 0) == pytest.approx(0.006)
    assert model.seconds(1, 8) == pytest.approx(0.02)


def test_an_exploration_interrupts_a_hold_which_goes_on_after_it():
    """An exploration step (and the steps its budget holds for) interrupts the held choice,
    which then goes on with the steps it had left, no forecast in between (on CPU through
    SGLang a forecast after every exploration was a fifth of auto's forecasts, each costing
    more than the held step it replaced); arrivals still end the resumed hold."""
    budgets = (4, 8, 16)
    steep = [[0.012, 1.0, 1.0]]  # the model wants 4
    config = ControlConfig(budgets=budgets, profile_steps=1, explore_every=5, explore_steps=2,
                           hold_steps=6)  # fmt: skip
    ctl = BudgetController(config, LatencyModel(steep, budgets, bs_buckets=(1,)), max_slots=8)
    tree = strong_or_useless_tree(1, strong=True)
    fc = ctl.forecast(torch.arange(1), tree.logprobs, tree.depths, tree.valid)
    steps = []  # (budget, forecast)
    for _ in range(len(budgets) + 40):
        held = ctl.held_budget(1)
        budget = held if held is not None else ctl.choose(fc, 1)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], True, held is None)
        steps.append((budget, held is None))
    steps = steps[len(budgets) :]  # after the profile
    explored = [i for i, (b, _) in enumerate(steps) if b != 4]
    assert len(explored) >= 8  # two steps an exploration, every fifth drafted step
    for i in explored:
        if i + 1 < len(steps) and steps[i + 1][0] == 4:
            assert not steps[i + 1][1]  # back to the hold: no forecast
    forecasts = [i for i, (_, forecast) in enumerate(steps) if forecast]
    for a, b in itertools.pairwise(forecasts):  # each hold: its 6 steps, explorations aside
        assert sum(1 for budget, _ in steps[a:b] if budget == 4) == 6
    run = 0
    while run < 2:  # to the end of the next exploration
        held = ctl.held_budget(1)
        budget = held if held is not None else ctl.choose(fc, 1)
        ctl.record_step(1, budget, steep[0][budgets.index(budget)], True, held is None)
        run = run + 1 if budget != 4 else 0
    resumed = copy.deepcopy(ctl)
    assert resumed.held_budget(1) == 4
    ctl.reset(torch.arange(1))  # an arrival at batch size 1 ends the hold, resumed or not
    assert ctl.held_budget(1) is None


def test_held_steps_do_no_device_work_and_a_long_run_without_a_read_stays_bounded():
    """A held step's accept lengths wait, by reference, for the next host read: no device op on
    the step. A run without a forecast (profiles, long holds) reads them every ``PENDING_STEPS``
    steps, so no more than that many wait; the totals stay exact across those reads."""
    budgets, bs = (0, 4, 8), 2
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 2, 64))
    ctl = BudgetController(ControlConfig(budgets=budgets, max_depth=15), flat, max_slots=bs)
    accept = torch.tensor([1, 2])
    with torch.autograd.profiler.profile() as prof:
        ctl.observe_committed(4, accept)
    assert not [e.name for e in prof.function_events]  # no tensor op at all
    steps = 3 * PENDING_STEPS + 5
    for _ in range(steps - 1):
        ctl.observe_committed(4, accept)
        assert len(ctl._pending) < PENDING_STEPS
    stats = ctl.stats()
    assert stats.accepted_tokens == 3 * steps and stats.request_steps == bs * steps
