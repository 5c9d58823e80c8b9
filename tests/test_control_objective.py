"""Budget control's objective and calibration: the surrogate against brute force, the choice of
the predicted accepted tokens per second, the totals."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from control_helpers import (
    FLAT_64,
    neutral,
    one_thread,  # noqa: F401 (autouse: one intra-op thread)
    roofline_controller,
    strong_or_useless_tree,
)
from tree_helpers import random_marginals

from sglang_tree_spec.control import (
    AUTO,
    AcceptCalibrator,
    BudgetController,
    CalibrationConfig,
    LatencyConfig,
    LatencyModel,
    candidate_budgets,
    expected_accept,
    rank_nodes,
    top_nodes,
)
from sglang_tree_spec.control.totals import PENDING_STEPS
from sglang_tree_spec.tree import build_ddtree, greedy_accept

FIELDS = ("tokens", "parents", "depths", "logprobs", "valid")


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

    config = neutral(budgets=(0, budget), fixed_budget=budget, max_depth=depth)
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
    config = neutral(
        budgets=(0, budget), fixed_budget=budget, max_depth=depth, calibration=calib
    )  # per-request factor off: depth only
    ctl = BudgetController(config, None, max_slots=bs)
    preds, obs = run_stream(ctl, tree, target_full, 300, gen, budget)
    scale = ctl.calibrator.depth_scale()
    assert scale[0].item() == pytest.approx(1.0, abs=0.1)
    assert scale[1].item() < 0.8
    assert preds[150:].mean().item() == pytest.approx(obs[150:].mean().item(), rel=0.08)


def test_choice_free_verification_and_strong_drafter_picks_max_budget():
    budgets = (0, 4, 8, 16, 32, 64)
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 8, 64))
    ctl = BudgetController(neutral(budgets=budgets), flat, max_slots=8)
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
    ctl = BudgetController(neutral(budgets=budgets), FLAT_64, max_slots=8)
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
        config = neutral(budgets=budgets, choice_decay=decay, hard_plain_steps=1)
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
        neutral(choice_decay=1.0)


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
    config = neutral(
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
    config = neutral(budgets=budgets, hold_steps=hold, max_depth=15, held_observe_every=8)
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
    config = neutral(budgets=budgets, hold_steps=hold, held_observe_every=every)
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
    ctl = BudgetController(neutral(fixed_budget=32), None, max_slots=2)
    tree = strong_or_useless_tree(2, strong=True, budget=32)
    fc = ctl.forecast(torch.arange(2), tree.logprobs, tree.depths, tree.valid)
    assert ctl.should_draft(2) and ctl.choose(fc, 2) == 32
    ctl.observe(fc, 32, torch.tensor([15, 3]))
    ctl.record_step(2, 32, 0.01)
    assert ctl.stats().mean_observed_accept == 9.0
    assert not BudgetController(neutral(fixed_budget=0), None, 1).should_draft(2)
    with pytest.raises(ValueError):
        BudgetController(neutral(), None, max_slots=2)


def test_a_larger_budget_must_beat_the_best_smaller_one_by_the_tie_margin():
    """Neighbouring budgets' predicted rates are often closer than the latency model's error:
    auto takes a larger budget only for a clear gain (``AUTO["tie_rtol"]``), never for a close
    call, and a clear gain two candidates up still wins over a close call one up."""
    from sglang_tree_spec.config import TreeConfig
    from sglang_tree_spec.control import best_budget
    from sglang_tree_spec.step import make_controller

    budgets = (0, 4, 8, 16)
    seconds = [1.0, 1.0, 1.0, 1.0]
    # committed/seconds: 8 is 0.5% above 4, 16 is 2% above 4.
    close, clear = [1.0, 2.0, 2.01, 1.0], [1.0, 2.0, 2.01, 2.04]
    flat = LatencyModel([seconds], budgets, bs_buckets=(1,))
    auto = make_controller(TreeConfig(budget=16, auto=True), 15, 8, "cpu", flat).config
    assert auto.tie_rtol == AUTO["tie_rtol"] == 0.01
    assert best_budget(close, seconds, budgets, tie_rtol=auto.tie_rtol) == 4
    assert best_budget(close, seconds, budgets) == 8  # exact argmax without the margin
    assert best_budget(clear, seconds, budgets, tie_rtol=auto.tie_rtol) == 16
    assert best_budget(clear, seconds, budgets, max_budget=8, tie_rtol=auto.tie_rtol) == 4


def test_a_policy_strings_latency_keys_set_its_own_latency_models_config():
    """``auto:pair=0.05:hold=4`` (a benchmark's auto variant): ``hold`` is a ControlConfig
    field, ``pair`` its latency model's ``LatencyConfig.pair_rate``, which then moves a switch's
    cells by that rate; a controller made without overrides leaves its model's config alone."""
    from sglang_tree_spec.config import TreeConfig
    from sglang_tree_spec.step import auto_overrides, make_controller

    fields = auto_overrides("auto:pair=0.05:hold=4")
    assert fields == {"latency": {"pair_rate": 0.05}, "hold_steps": 4}
    assert auto_overrides("auto:stale=0:hold=2") == {
        "explore_stale_neighbours": False,
        "hold_steps": 2,
    }
    with pytest.raises(ValueError, match="0 or 1"):
        auto_overrides("auto:stale=true")
    for removed in ("below=1", "near=1", "full=4"):  # experiments measured within noise
        with pytest.raises(ValueError, match="unknown auto option"):
            auto_overrides(f"auto:{removed}")
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
    assert plain.config.hold_steps == AUTO["hold_steps"] and default.config == LatencyConfig()
    eight, four = budgets.index(8), budgets.index(4)
    gap = [m._cost[0, eight] - m._cost[0, four] for m in (model, default)]  # log cost B8 - B4
    assert math.log(1.2) < gap[0] < gap[1] < math.log(1.25)  # the slower rate lags the switches


def test_held_steps_do_no_device_work_and_a_long_run_without_a_read_stays_bounded():
    """A held step's accept lengths wait, by reference, for the next host read: no device op on
    the step. A run without a forecast (profiles, long holds) reads them every ``PENDING_STEPS``
    steps, so no more than that many wait; the totals stay exact across those reads."""
    budgets, bs = (0, 4, 8), 2
    flat = LatencyModel([[0.01] * len(budgets)] * 3, budgets, bs_buckets=(1, 2, 64))
    ctl = BudgetController(neutral(budgets=budgets, max_depth=15), flat, max_slots=bs)
    accept = torch.tensor([1, 2])
    with torch.autograd.profiler.profile() as prof:
        ctl.observe_committed(4, accept)
    assert not [e.name for e in prof.function_events]  # no tensor op at all
    steps = 3 * PENDING_STEPS + 5
    for _ in range(steps - 1):
        ctl.observe_committed(4, accept)
        assert len(ctl.totals._pending) < PENDING_STEPS
    stats = ctl.stats()
    assert stats.accepted_tokens == 3 * steps and stats.request_steps == bs * steps
