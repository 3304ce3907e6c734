"""The bounded non-negative least squares of Attention Matching's biases (Zweiger et al., 2026):
``w = exp(beta)`` fitted on the attention mass, ``beta`` kept in a box.

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together, e.g. all KV heads of a layer); all maths is float32 whatever the input dtype.
Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key
dim, ``dv`` value dim.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvlab.compression.solvers.linalg import (
    RIDGE_FLOOR,
    active_block,
    factor_solve,
    gram_matrix,
    masked_design,
    masked_gram,
    product,
    ridge_factor,
    ridge_lstsq,
    ridge_lstsq_dual,
)


def _top_eig(gram: torch.Tensor, active: torch.Tensor, steps: int = 10) -> torch.Tensor:
    """Largest eigenvalue of PSD ``gram`` [B, m, m] by power iteration: [B].

    Starts from the all-ones vector: the mass Gram has non-negative entries,
    so its Perron vector is positive and a positive start converges in a few
    steps. Projected gradient stays stable for any step below 2/L, so a
    slightly low estimate is harmless.
    """
    v = active / active.sum(-1, keepdim=True).clamp_min(1.0).sqrt()
    for _ in range(steps):
        u = product(gram, v.unsqueeze(-1)).squeeze(-1)
        v = u / u.norm(dim=-1, keepdim=True).clamp_min(RIDGE_FLOOR)
    return (v * product(gram, v.unsqueeze(-1)).squeeze(-1)).sum(-1)


def box_nnls_gram(
    gram: torch.Tensor,
    b: torch.Tensor,
    active: torch.Tensor,
    lo: float,
    hi: float,
    iters: int,
    ridge: float,
    design: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
) -> torch.Tensor:
    """Box-constrained least squares in Gram form: [B, m].

    Minimises ``||M w - z||^2`` over ``lo <= w <= hi`` given ``gram = M^T M``
    [B, m, m] and ``b = M^T z`` [B, m]; padding entries (active 0) stay 0.
    Start from the ridge least-squares solution (usually close to the optimum,
    as most weights are interior), clamp into the box, then ``iters``
    projected-gradient steps with step ``1 / ||M||_2^2``. Working on the Gram
    keeps each step at O(m^2) instead of O(n m). With ``design`` M [B, n, m]
    (padding columns zero) and ``target`` z [B, n], the start is refined
    against the design (see :func:`_refine`).
    """
    if design is None:
        chol, ok = ridge_factor(gram, active, ridge)
        w = factor_solve(chol, ok, b.unsqueeze(-1), active).squeeze(-1)
    else:
        w = ridge_lstsq(design, target.unsqueeze(-1), active, ridge, gram, b.unsqueeze(-1)).squeeze(-1)
    g, b = active_block(gram, active), b * active
    return _box_steps(
        w, active, lo, hi, iters, lambda: _top_eig(g, active), lambda x: product(g, x.unsqueeze(-1)).squeeze(-1) - b
    )


def _box_steps(
    w: torch.Tensor,
    active: torch.Tensor,
    lo: float,
    hi: float,
    iters: int,
    lipschitz: Callable[[], torch.Tensor],
    gradient: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """From a least-squares start ``w`` [B, m]: clamp into ``[lo, hi]``, then ``iters`` projected-gradient steps.

    ``gradient(w)`` = ``M^T (M w - z)`` [B, m]; ``lipschitz()`` = ``||M||_2^2``
    [B] (only evaluated when a step is taken); padding entries (active 0) stay 0.
    """
    real = active > 0
    clamped = w.clamp(lo, hi)
    # An interior least-squares solution is already the box optimum; skipping
    # the gradient loop then saves ~30 small kernels per OMP refit.
    interior = bool(((clamped == w) | ~real).all())
    w = torch.where(real, clamped, torch.zeros_like(w))
    if iters > 0 and not interior:
        step = 1.0 / lipschitz().clamp_min(RIDGE_FLOOR)
        for _ in range(iters):
            w = torch.where(real, (w - step.unsqueeze(-1) * gradient(w)).clamp(lo, hi), w)
    return w


def _box_nnls_dual(
    m: torch.Tensor, z: torch.Tensor, active: torch.Tensor, lo: float, hi: float, iters: int, ridge: float
) -> torch.Tensor:
    """:func:`box_nnls_gram` for a wide design, never forming the m x m Gram: [B, m].

    m: [B, n, m] design with fewer rows than active columns (padding columns
    zero), z: [B, n]. The start is the same ridge estimator through the
    n x n dual (:func:`ridge_lstsq_dual`); gradient steps use design
    products, and ``||M||_2^2`` is the top eigenvalue of ``M M^T`` as of
    ``M^T M``. Memory O(n^2 + n m) instead of O(m^2): m is the number of kept
    keys, which grows with the document.
    """
    mt = m.transpose(-1, -2)
    kern = gram_matrix(mt)  # [B, n, n]
    w = ridge_lstsq_dual(m, z.unsqueeze(-1), active, ridge, kern).squeeze(-1)
    rows = torch.ones(m.shape[0], m.shape[1], dtype=m.dtype, device=m.device)
    return _box_steps(
        w,
        active,
        lo,
        hi,
        iters,
        lambda: _top_eig(kern, rows),
        lambda x: product(mt, product(m, x.unsqueeze(-1)) - z.unsqueeze(-1)).squeeze(-1),
    )


def nnls(
    m: torch.Tensor, z: torch.Tensor, valid: torch.Tensor | None = None, iters: int = 20, ridge: float = 1e-6
) -> torch.Tensor:
    """Non-negative least squares ``argmin_{w >= 0} ||m w - z||^2``: [B, t].

    m: [B, n, t], z: [B, n], valid: [B, t] bool or None. The plain NNLS of
    OMP's refits (no upper bound, more iterations than the bias fit since
    many weights sit on the w = 0 face there). Padding columns get w = 0.
    """
    gram, b, active, m = masked_gram(m, z, valid)
    return box_nnls_gram(gram, b, active, 0.0, math.inf, iters, ridge, m, z.float())


def nnls_bias(
    m: torch.Tensor,
    z: torch.Tensor,
    valid: torch.Tensor | None = None,
    w_min: float = math.exp(-3.0),
    w_max: float = math.exp(3.0),
    iters: int = 2,
    ridge: float = 1e-6,
) -> torch.Tensor:
    """Mass-matching biases ``beta = log w``: [B, t] float32.

    m: [B, n, t] mass features of the compact keys (without their own bias),
    z: [B, n] target masses, valid: [B, t] bool or None (False = padding).
    ``w = argmin ||m w - z||^2`` with ``w_min <= w <= w_max`` (the published
    HighestAttnKeys setting bounds beta to [-3, 3]: a key standing for more
    than e^3 originals, or almost none, is over-fitting the reference
    queries). Padding columns get ``beta = -inf`` (exactly an absent key).
    """
    if not 0.0 < w_min <= w_max:
        raise ValueError(f"need 0 < w_min <= w_max, got {w_min}, {w_max}")
    m_real, active = masked_design(m, valid)
    if m.shape[-2] < int(active.sum(-1).max()):
        # Fewer queries than kept keys (a long document): the n x n dual, not the t x t Gram.
        w = _box_nnls_dual(m_real, z.float(), active, w_min, w_max, iters, ridge)
    else:
        gram, b, _, m_real = masked_gram(m_real, z, None)  # padding columns zeroed once, above
        w = box_nnls_gram(gram, b, active, w_min, w_max, iters, ridge, m_real, z.float())
    beta = w.log()
    if valid is not None:
        beta = beta.masked_fill(~valid, float("-inf"))
    return beta
