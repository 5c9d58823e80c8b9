"""Online calibration of the surrogate from acceptance history (DynaTree's history adaptation).

The surrogate sum_u q(u) is the expected accepted length if the TARGET followed the drafter's
marginals. It does not, so predictions are rescaled toward what verification observes, with three
ratio estimators, all sync-free tensors updated after every calibrated verify:

1. Per depth, pooled over all requests (``[L]``). The expected accepted length decomposes by
   depth, E[accept] = sum_d P(accept >= d), and P(accept >= d) = sum of the target's probability
   of the depth-d nodes, which the drafter predicts as the depth-d mass m_d = sum_{depth(u)=d}
   q(u) of the verified tree. So each depth keeps exponentially decayed sums of predicted mass
   M_d and of observed events O_d = #[accept >= d], and every depth-d node probability is scaled
   by s_d = (O_d + c s_{d-1}) / (M_d + c) (s_0 = 1): the ratio-of-sums (ratio) estimator of
   E[1(accept >= d)] / E[m_d], shrunk by a pseudo-count c toward the factor of the depth above
   (depth 1 toward 1). Block-diffusion drafters
   are over-confident deeper in the block (their marginals ignore the earlier positions' draws),
   which this corrects where a single factor cannot.
2. Per request (slot-indexed ``[max_slots]``): the residual ratio r_i = (O_i + c_r) / (P_i + c_r)
   of decayed sums of request i's observed accepted lengths and its depth-calibrated predictions
   (code vs chat, an easy vs a hard prompt). A new request starts at r = 1 (``reset``).

3. Per request age, pooled over all requests (``[age_buckets]``): the ratio g_a = (O_a + c_a) /
   (P_a + c_a) of decayed sums of the observed accepted lengths and the predictions (depth- and
   request-calibrated) of the steps taken at age a, a request's age being its calibrated
   drafted steps so far in buckets of ``age_steps`` (the last bucket holds every older step).
   How well the drafter's marginals predict acceptance changes through a reply: SmolLM2's
   drafter at batch size 1 (16 prompts, 32 new tokens, reference engine) saw its depth-1
   observed / predicted ratio fall 0.82, 0.61, 0.62, 0.56, 0.38 over buckets of 5 steps. The
   pooled depth factors average the ages of the last few requests, so predictions ran high late
   in every reply and low early; the per-request factor, shrunk hard toward 1, cannot follow a
   change within a 20-step reply.

Calibrated prediction for request i at budget N: A_i(N) = g_a(i) * r_i * sum_{j < N} s_{d(j)} q(j)
over the ranked nodes j, clipped to [0, L]. Every factor is positive, so A_i stays non-decreasing
in N; since a ratio-of-sums estimator weights each step by its predicted mass, its fixed point
makes the summed predictions equal the summed observations (unbiased in aggregate). The request
and age ratios are fitted in turn on each other's residual (each one's prediction includes the
other factor), so the two do not both count one effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class Factors(NamedTuple):
    """A batch's calibration factors, ``[bs]`` each: r_i, g_a(i), the age bucket a(i) (int64)
    they were read at, and their product r_i * g_a(i), the factor of each request's
    depth-calibrated prediction."""

    request: torch.Tensor
    age: torch.Tensor
    buckets: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class CalibrationConfig:
    """Decays are per verify step (a window of about 1 / (1 - decay) steps).

    Attributes:
        depth_decay: per-depth pooled sums (every request of a step adds to them).
        depth_prior: pseudo-count c of the per-depth ratio (in accepted tokens).
        request_decay: per-request sums.
        request_prior: pseudo-count c_r of the per-request ratio (in accepted tokens). One
            step's acceptance is noisy (0..L for the same tree), so the factor is shrunk hard
            toward 1: replaying small-pair server traces (SGLang, concurrency 2-4, 3906
            request-steps), decay 0.9 with c_r = 1 gave a squared error of 1.04 per step and
            requests whose factor had fallen below 0.8 accepted 1.3-2.5x their predictions,
            which then chose plain steps; decay 0.98 with c_r = 16 gives 0.92 and a factor
            calibrated in every bin (no per-request factor: 0.94).
        age_steps: calibrated drafted steps per age bucket.
        age_buckets: age buckets (the last one holds every older step); 1 turns the age factor
            into one pooled factor.
        age_decay: per-age pooled sums (every request of a step adds to its own bucket's).
        age_prior: pseudo-count c_a of the per-age ratio (in accepted tokens). Each bucket
            pools every request's steps at that age (SmolLM2 at batch size 1: ~0.3 accepted
            tokens a step, ~40 steps a bucket within the decay's window), so a small prior
            suffices once the server has served a few requests; it keeps one unlucky step at
            start-up from halving every new request's predictions.
    """

    depth_decay: float = 0.98
    depth_prior: float = 0.5
    request_decay: float = 0.98
    request_prior: float = 16.0
    age_steps: int = 5
    age_buckets: int = 6
    age_decay: float = 0.995
    age_prior: float = 2.0


class AcceptCalibrator:
    """Per-depth x per-request calibration state for ``max_slots`` request slots, L depths.

    Depth sums are indexed by the depth itself (column 0 unused): a node's depth (1..L, a
    :class:`~sglang_tree_spec.tree.DraftTree` invariant) reads its factor without an offset.
    """

    def __init__(
        self,
        max_slots: int,
        max_depth: int,
        config: CalibrationConfig = CalibrationConfig(),
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.max_depth = max_depth
        self.depth_sums = torch.zeros(2, max_depth + 1, device=device)  # [2, L+1] M_d, O_d
        self.request_sums = torch.zeros(max_slots, 2, device=device)  # [S, 2] P_i, O_i
        self.age_sums = torch.zeros(config.age_buckets, 2, device=device)  # [A, 2] P_a, O_a
        self.ages = torch.zeros(max_slots, dtype=torch.long, device=device)  # [S] steps
        # the depth and age tables of the sums as they are, until the next update (the sums
        # change there alone): a forecast and the calibrated step after it read them once
        self._tables: dict[str, torch.Tensor] = {}
        # [L+1] the depth of each column; column 0 is no depth: an id no accept length reaches
        self._depth_ids = torch.arange(max_depth + 1, device=device)
        self._depth_ids[0] = max_depth + 1

    def depth_table(self) -> torch.Tensor:
        """``[L+1]`` s_d at column d (:meth:`_depth_table`), read once per update."""
        table = self._tables.get("depth")
        if table is None:
            table = self._tables["depth"] = self._depth_table()
        return table

    def _depth_table(self) -> torch.Tensor:
        """``[L+1]`` s_d at column d (column 0: 1, no depth, never read by a mass).

        Each depth is shrunk toward the depth above it, not toward 1:
        s_d = (O_d + c * s_{d-1}) / (M_d + c) with s_0 = 1. A depth the history has little of
        (deep nodes: at batch size 1 a tree of 2-4 nodes rarely reaches depth 3) then reads
        the factor of the depths above (for a drafter over-confident deeper in the block, still
        too high, but nearer than 1), instead of taking the drafter's marginals at face value
        (SmolLM2 at batch size 1 through the reference engine: depth-3 nodes predicted 1.9
        accepted tokens where 0 were accepted, with s_3 ~ 1). Sync-free closed form of the
        recurrence, s_d = P_d (1 + sum_{k<=d} a_k / P_k) with a_k = O_k / (M_k + c),
        b_k = c / (M_k + c) and P_d = prod_{k<=d} b_k, in float64 (P falls to ~1e-60 over 15
        depths of long histories; b is floored at 1e-18)."""
        c = self.config.depth_prior
        mass, observed = self.depth_sums.double()  # [L+1] each; column 0 holds no data
        keep = (c / (mass + c)).clamp_min_(1e-18)  # b_d (column 0: 1)
        product = keep.cumprod(0)  # P_d
        table = product * (1.0 + (observed / (mass + c) / product).cumsum(0))
        return table.to(self.depth_sums.dtype)

    def depth_scale(self) -> torch.Tensor:
        """``[L]`` s_d."""
        return self.depth_table()[1:]

    def request_scale(self, rows: torch.Tensor) -> torch.Tensor:
        """``[bs]`` r_i for the batch's slots ``rows`` (``[bs]`` int64)."""
        c = self.config.request_prior
        sums = self.request_sums[rows] + c  # [bs, 2]
        return sums[:, 1] / sums[:, 0]

    def _age_buckets(self, rows: torch.Tensor) -> torch.Tensor:
        """``[bs]`` int64 the age bucket of each slot in ``rows``."""
        cfg = self.config
        return (self.ages[rows] // cfg.age_steps).clamp_(max=cfg.age_buckets - 1)

    def age_table(self) -> torch.Tensor:
        """``[A]`` g_a of every age bucket, read once per update."""
        table = self._tables.get("age")
        if table is None:
            sums = self.age_sums + self.config.age_prior
            table = self._tables["age"] = sums[:, 1] / sums[:, 0]
        return table

    def age_scale(self, rows: torch.Tensor) -> torch.Tensor:
        """``[bs]`` g_a for the age of each slot in ``rows`` (``[bs]`` int64)."""
        return self.age_table()[self._age_buckets(rows)]

    def factors(self, rows: torch.Tensor) -> Factors:
        """Each request's factors (``[bs]`` each) for the batch's slots ``rows``."""
        buckets = self._age_buckets(rows)
        request, age = self.request_scale(rows), self.age_table()[buckets]
        return Factors(request, age, buckets, request * age)

    def scale(self, rows: torch.Tensor) -> torch.Tensor:
        """``[bs]`` the factor of each request's depth-calibrated prediction, r_i * g_a(i)."""
        return self.factors(rows).scale

    def node_weights(self, probs: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """``[bs, B]`` depth-calibrated node probabilities s_{d(u)} q(u) (depths in 1..L)."""
        return probs * self.depth_table()[depths]

    def depth_mass(self, probs: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """``[bs, L+1]`` predicted mass per depth (column d) of the given nodes (``[bs, n]``
        each, depths in 1..L; column 0 stays 0)."""
        mass = probs.new_zeros(probs.shape[0], self.max_depth + 1)
        return mass.scatter_add_(1, depths, probs)

    def update(
        self,
        rows: torch.Tensor,
        mass: torch.Tensor,
        calibrated_pred: torch.Tensor,
        accept: torch.Tensor,
        weight: int = 1,
        factors: Factors | None = None,
    ) -> None:
        """Fold in one verified step; its requests grow ``weight`` steps older.

        Args:
            rows: ``[bs]`` int64 request slots.
            mass: ``[bs, L+1]`` raw predicted mass per depth of the VERIFIED tree
                (:meth:`depth_mass`).
            calibrated_pred: ``[bs]`` depth-calibrated prediction (before r and g) of that tree.
            accept: ``[bs]`` accepted draft tokens (bonus excluded), in ``mass``'s dtype.
            weight: the steps this one stands for (one of every ``weight``, sampled): its sums
                count ``weight`` times, after ``weight`` steps' decay.
            factors: :meth:`factors` of ``rows`` when the caller has them (the state has not
                changed since), else computed.
        """
        cfg = self.config
        observed = (accept.unsqueeze(1) >= self._depth_ids).to(mass.dtype)  # [bs, L+1]
        step = torch.stack([mass, observed]).sum(1)  # [2, L+1]
        self.depth_sums.mul_(cfg.depth_decay**weight).add_(step, alpha=weight)
        # the factors and age buckets ([bs] each) the predictions were made with
        request_factor, age_factor, buckets, _ = self.factors(rows) if factors is None else factors
        request = torch.stack([calibrated_pred * age_factor, accept], dim=1)  # [bs, 2]
        age = torch.stack([calibrated_pred * request_factor, accept], dim=1)  # [bs, 2]
        decayed = self.request_sums[rows].mul_(cfg.request_decay**weight)
        self.request_sums[rows] = decayed.add_(request, alpha=weight)
        self.age_sums.mul_(cfg.age_decay**weight).index_add_(0, buckets, age, alpha=weight)
        self.ages[rows] += weight
        self._tables.clear()  # the sums moved

    def reset(self, rows: torch.Tensor) -> None:
        """Forget the history of slots ``rows`` (``[n]`` int64): a request left or arrived."""
        self.request_sums[rows] = 0.0
        self.ages[rows] = 0
