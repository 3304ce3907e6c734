"""How Attention Matching chooses a block's compact keys: one strategy per way (Zweiger et al., 2026).

:func:`kvlab.compression.solvers.compact.compact_block` runs its first stage, the keys, through a
:class:`KeyChoice`: :class:`HighestAttn` (the reference queries' attention), :class:`GivenScores` (a
ranking from elsewhere, e.g. KVzip's), :class:`GivenScoresUnion` (a share by each), :class:`ExactFirst`
(some keys kept exact, outside the fit) or :class:`OMP` (matching pursuit on the mass). Each holds the
knobs it needs; ways that exclude each other cannot be built together. A choice also says how the
bias stage fits the chosen keys' biases (:meth:`KeyChoice.fit_bias`: OMP keeps its own weights).

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together); all maths is float32 whatever the input dtype. Shapes: ``B`` heads, ``n``
reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key dim, ``dv`` value dim.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.solvers.nnls import nnls, nnls_bias
from kvlab.compression.solvers.omp import omp_select
from kvlab.compression.solvers.scores import Scoring, scores_from_mass, select_highest_attn, shifted_exp, streamed_mass
from kvlab.runtime.attention import matmul


@dataclass
class BlockData:
    """The block a choice reads: q [B, n, d] reference queries, k [B, T, d], v [B, T, dv],
    bias [B, T] or None (``-inf`` = padding), ``scale`` on q.k, weights [B, n] the queries' weights
    as given and root_w [B, n] their float32 square roots on q's device (None: unweighted),
    key_valid [B, T] bool (None: every key real), block_elements: logits per streamed chunk
    (None: the device's, :func:`kvlab.compression.solvers.scores.block_elements_for`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    scale: float
    weights: torch.Tensor | None
    root_w: torch.Tensor | None
    key_valid: torch.Tensor | None
    block_elements: int | None


@dataclass
class Mass:
    """What the fit needs of the block's attention: shift [B, n] (each query's largest logit),
    z [B, n] (``sum_j exp(s_ij - shift_i)``), y [B, n, dv] (the block's output), scores [B, T]
    (what the keys were ranked by, or shown: the CompactBlock's) or None, and phi [B, n, T] (OMP's
    whole features, rows times sqrt(w_i) when weighted; None once used, or when streamed)."""

    shift: torch.Tensor
    z: torch.Tensor
    y: torch.Tensor
    scores: torch.Tensor | None
    phi: torch.Tensor | None = None


@dataclass
class Chosen:
    """A choice's keys: index [B, t] long (-1 where a head has no more real keys; slots past a
    head's length are masked by the caller), the block's :class:`Mass`, OMP's NNLS weights [B, t]
    of its selection (else None) and exact [B, t] bool, the slots kept exact (else None)."""

    index: torch.Tensor
    mass: Mass
    weights: torch.Tensor | None = None
    exact: torch.Tensor | None = None


@dataclass
class MassFit:
    """The bias stage's problem: ``features [B, n, t] w ~ target [B, n]`` with ``w = exp(beta)``
    in ``exp(bounds)``. features: the chosen keys' mass features without any old bias (rows
    times sqrt(w_i) when weighted), old [B, t] their old bias (0 on padding slots), had_bias:
    whether the block had one, slot_valid [B, t] the real slots; nnls_iters and ridge the fit's.
    After the bias stage the value stage turns the features into the compact attention, in place
    (:func:`kvlab.compression.solvers.compact.attention_from_features`)."""

    features: torch.Tensor
    target: torch.Tensor
    old: torch.Tensor
    slot_valid: torch.Tensor
    had_bias: bool
    bounds: tuple[float, float]
    nnls_iters: int
    ridge: float


def nnls_beta(fit: MassFit, target: torch.Tensor, fit_valid: torch.Tensor) -> torch.Tensor:
    """beta [B, t] of the bounded mass fit of ``target`` [B, n] on the slots ``fit_valid`` [B, t]
    (``-inf`` elsewhere; all ``-inf`` when no head has a slot to fit)."""
    if not bool(fit_valid.any()):
        return torch.full_like(fit.old, float("-inf"))
    # Design without the old bias, so that the fitted w is exp(total beta) and the bounds apply to it.
    design = fit.features if not fit.had_bias else fit.features * torch.exp(-fit.old).unsqueeze(1)
    lo, hi = fit.bounds
    return nnls_bias(design, target, fit_valid, math.exp(lo), math.exp(hi), fit.nnls_iters, fit.ridge)


def ranked_by(scores: torch.Tensor, data: BlockData) -> torch.Tensor:
    """Caller's scores [B, T] as float32 on the block's device, padding keys at ``-inf``."""
    ranked = scores.to(data.q.device).float()
    return ranked if data.key_valid is None else ranked.masked_fill(~data.key_valid, float("-inf"))


def streamed(data: BlockData, scoring: Scoring | None) -> Mass:
    """The block's mass, a chunk of queries at a time (:func:`streamed_mass`), with the keys'
    HighestAttnKeys scores under ``scoring`` (None: no scores)."""
    shift, z, y, scores = streamed_mass(
        data.q, data.k, data.v, data.bias, data.scale, scoring, data.block_elements, data.weights
    )
    return Mass(shift, z, y, scores)


def check_scores(name: str, scores: torch.Tensor | None, data: BlockData) -> None:
    """Refuse ``scores`` that are not one per key of each head ([B, T])."""
    want = (data.k.shape[0], data.k.shape[1])
    if scores is not None and tuple(scores.shape) != want:
        raise ValueError(f"{name} must be [B={want[0]}, T={want[1]}], got {tuple(scores.shape)}")


class KeyChoice(ABC):
    """A way to choose each head's ``t`` compact keys, and the biases' fit that goes with it."""

    #: The bias bounds when the fit names none: the published (-3, 3).
    beta_bounds: ClassVar[tuple[float, float]] = (-3.0, 3.0)

    @abstractmethod
    def choose(self, data: BlockData, t: int, lengths: torch.Tensor, ridge: float) -> Chosen:
        """Each head's keys for ``t`` slots; lengths [B] long: its real slots (a prefix, <= t)."""

    def fit_bias(self, chosen: Chosen, fit: MassFit) -> torch.Tensor:
        """beta [B, t] float32 of the chosen keys: the bounded NNLS on the block's mass."""
        return nnls_beta(fit, fit.target, fit.slot_valid)


class Ranking(KeyChoice):
    """A choice by one score per key: each head's top ``t`` (sorted, as :func:`select_highest_attn`)."""

    @abstractmethod
    def ranked_mass(self, data: BlockData) -> Mass:
        """The block's mass, its ``scores`` [B, T] what the keys are ranked by."""

    def choose(self, data: BlockData, t: int, lengths: torch.Tensor, ridge: float) -> Chosen:
        mass = self.ranked_mass(data)
        return Chosen(select_highest_attn(mass.scores, t), mass)


@dataclass(frozen=True)
class HighestAttn(Ranking):
    """HighestAttnKeys: rank by the reference queries' attention (``scoring`` over the queries,
    each weighted by its query weight). Never holds the [B, n, T] features: streams over chunks
    of queries and recomputes the t chosen keys' features."""

    scoring: Scoring = "rms"

    def ranked_mass(self, data: BlockData) -> Mass:
        return streamed(data, self.scoring)


@dataclass(frozen=True, eq=False)
class GivenScores(Ranking):
    """Rank by ``scores`` [B, T] from elsewhere (e.g. KVzip's, from other queries under another
    softmax); the bias and value fits are the same."""

    scores: torch.Tensor

    def ranked_mass(self, data: BlockData) -> Mass:
        check_scores("key_scores", self.scores, data)
        mass = streamed(data, None)
        mass.scores = ranked_by(self.scores, data)
        return mass


@dataclass(frozen=True, eq=False)
class GivenScoresUnion(KeyChoice):
    """A union: each head's ``ceil(share * t_h)`` best keys by ``scores`` [B, T] first, then its
    best remaining keys by the queries' attention (``scoring``, the CompactBlock's scores).
    ``share`` in [0, 1): a share of 1 is :class:`GivenScores`."""

    scores: torch.Tensor
    share: float
    scoring: Scoring = "rms"

    def __post_init__(self) -> None:
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"the union's share must be in [0, 1) (1: GivenScores), got {self.share}")

    def choose(self, data: BlockData, t: int, lengths: torch.Tensor, ridge: float) -> Chosen:
        check_scores("key_scores", self.scores, data)
        mass = streamed(data, self.scoring)
        ranked = ranked_by(self.scores, data)
        first = torch.ceil(self.share * lengths.float()).long()
        order = ranked.topk(t, dim=-1).indices
        taken = torch.zeros_like(ranked, dtype=torch.bool).scatter_(
            1, order, torch.arange(t, device=ranked.device) < first.unsqueeze(-1)
        )
        return Chosen(select_highest_attn(mass.scores.masked_fill(taken, float("inf")), t), mass)


@dataclass(frozen=True, eq=False)
class ExactFirst(KeyChoice):
    """Exact keys inside the fit: each head's ``round(share * t_h)`` best keys by ``exact_scores``
    [B, T] (None: by what ``ranking`` ranks by) stay exact: their own key, value and bias, untouched
    by the fit (the first slots, :attr:`Chosen.exact`). The other slots are compact keys, the best of
    the remaining keys by ``ranking``, fitted only to what the exact keys leave unexplained: the mass
    fit's target is the block's mass minus the exact keys' own, and the values are fitted, under the
    softmax over every slot, to the block's output minus the exact keys' part of it. ``share`` in
    (0, 1]; 1: every slot exact, eviction to the top ``t`` keys. Only over one score per key
    (:class:`HighestAttn` or :class:`GivenScores`): the compact keys are the best remaining by it."""

    ranking: Ranking
    share: float
    exact_scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"the exact share must be in (0, 1], got {self.share}")
        if not isinstance(self.ranking, Ranking):
            raise ValueError(
                f"exact keys need a ranking by one score (HighestAttn or GivenScores), "
                f"got {type(self.ranking).__name__}"
            )

    def choose(self, data: BlockData, t: int, lengths: torch.Tensor, ridge: float) -> Chosen:
        check_scores("exact_scores", self.exact_scores, data)
        mass = self.ranking.ranked_mass(data)
        exact_by = None if self.exact_scores is None else self.exact_scores.to(data.q.device)
        index, exact = exact_first(mass.scores, exact_by, lengths, t, self.share, data.key_valid)
        return Chosen(index, mass, exact=exact)

    def fit_bias(self, chosen: Chosen, fit: MassFit) -> torch.Tensor:
        """The compact keys fit the block's mass less the exact keys' own (their stored bias
        included); an exact slot keeps its bias."""
        exact = chosen.exact
        target = (fit.target - (fit.features * exact.unsqueeze(1)).sum(-1)).clamp_min(0.0)
        beta = nnls_beta(fit, target, fit.slot_valid & ~exact)
        return torch.where(exact, fit.old, beta)


def exact_first(
    scores: torch.Tensor,
    exact_scores: torch.Tensor | None,
    lengths: torch.Tensor,
    t: int,
    share: float,
    key_valid: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's slots, its exact keys first: (index [B, t], exact [B, t] bool).

    scores: [B, T] what the compact keys are ranked by; exact_scores: [B, T]
    what the exact keys are ranked by (None: ``scores``); lengths: [B] real
    slots per head, at most ``t``, the slots; share: of each head's slots, ``round(share * t_h)``
    are exact. The exact keys are the head's best by ``exact_scores``, the
    compact ones its best remaining keys by ``scores`` (sorted, as
    :func:`select_highest_attn`); slots past a head's length are padding.
    """
    B, T = scores.shape
    n_exact = torch.floor(share * lengths.float() + 0.5).long().minimum(lengths)
    ranked = scores if exact_scores is None else exact_scores.float()
    if key_valid is not None:
        ranked = ranked.masked_fill(~key_valid, float("-inf"))
    slots = torch.arange(t, device=scores.device).expand(B, t)
    first = slots < n_exact.unsqueeze(-1)
    best = ranked.topk(t, dim=-1).indices
    taken = torch.zeros(B, T, dtype=torch.bool, device=scores.device).scatter_(1, best, first)
    rest = select_highest_attn(scores.masked_fill(taken, float("-inf")), t)
    index = torch.where(first, best, rest.gather(1, (slots - n_exact.unsqueeze(-1)).clamp_min(0)))
    return index, first


@dataclass(frozen=True)
class OMP(KeyChoice):
    """Orthogonal matching pursuit on the mass (:func:`omp_select`, whose knobs these are;
    ``nnls_iters`` its NNLS steps). Holds the whole [B, n, T] features; the CompactBlock's scores
    (``scoring``) are for display. Its own NNLS weights are the biases, refitted only for heads cut
    short by a budget; its default bounds are (``drop_below``, 7)."""

    keys_per_iter: int = 4
    refit_every: int = 2
    drop_below: float | None = -7.0
    nnls_iters: int = 20
    scoring: Scoring = "rms"

    @property
    def beta_bounds(self) -> tuple[float, float]:
        return (-7.0 if self.drop_below is None else self.drop_below, 7.0)

    def choose(self, data: BlockData, t: int, lengths: torch.Tensor, ridge: float) -> Chosen:
        phi, shift = shifted_exp(data.q, data.k, data.bias, data.scale)
        z = phi.sum(dim=-1)
        # The block's own output is phi V / z (the max shift cancels): reusing phi
        # saves recomputing every logit, the largest cost of the whole fit.
        # z = 0 (a query that sees only padding) gives 0, as in mass_features, never NaN.
        y = matmul(phi, data.v.float()) / z.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        # Cheap next to the features; the app shows it as each token's importance.
        scores = scores_from_mass(phi, z, self.scoring, data.key_valid, data.weights)
        root_w = data.root_w
        if root_w is not None:  # weighted least squares: each query's row times sqrt(w_i)
            phi.mul_(root_w.unsqueeze(-1))
        index, w = omp_select(
            phi,
            z if root_w is None else z * root_w,
            t,
            self.keys_per_iter,
            self.refit_every,
            self.drop_below,
            data.key_valid,
            self.nnls_iters,
            ridge,
        )
        return Chosen(index, Mass(shift, z, y, scores, phi), weights=w)

    def fit_bias(self, chosen: Chosen, fit: MassFit) -> torch.Tensor:
        """beta = log of OMP's weights plus the old bias, in the bounds. OMP fitted its weights for
        its full selection; a head cut short by a budget loses keys whose mass the others no longer
        cover: it is refitted."""
        w = chosen.weights
        cut = (fit.slot_valid != (chosen.index >= 0)).any(-1)
        if bool(cut.any()):
            w = torch.where(
                cut.unsqueeze(-1), nnls(fit.features, fit.target, fit.slot_valid, self.nnls_iters, fit.ridge), w
            )
        lo, hi = fit.bounds
        beta = (w.clamp_min(torch.finfo(torch.float32).tiny).log() + fit.old).clamp(lo, hi)
        return beta.masked_fill(~fit.slot_valid, float("-inf"))
