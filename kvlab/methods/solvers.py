"""Closed-form solvers of Attention Matching (Zweiger et al., 2026).

A block of ``T`` cached keys/values of one KV head is replaced by ``t`` compact
keys ``Ck`` (a subset of the original keys), refitted values ``Cv`` and one
additive logit bias ``beta`` per compact key, so that for the reference
queries both the block's local attention output and its attention mass
``sum_j exp(logit_j)`` are preserved. Matching the mass is what makes the
compact block a drop-in replacement next to other blocks (the paper's
argument).

Every function is a pure function on tensors, batched over a leading dim
``B`` (the heads compacted together, e.g. all KV heads of a layer) so that one
call does the work of all heads; only OMP iterates in Python, over its
selection rounds, never over heads. All maths is float32 whatever the input
dtype: the mass targets are sums of exponentials.

Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t``
compact keys, ``d`` key dim, ``dv`` value dim. Attention itself is computed
only through :mod:`kvlab.runtime.attention`.

One module on purpose (about 1,070 lines): key scoring, the bounded NNLS for the
biases, the value least squares and OMP are the stages of one solve and share
their batched shapes, masks and float32 conventions; split apart, each stage
would have to re-derive them.

Memory: a long document has many kept keys ``t``; no stage holds a ``t x t``
matrix when there are fewer reference queries than kept keys (both least
squares then use the ``n x n`` dual), and HighestAttnKeys streams over query
chunks instead of holding the ``[B, n, T]`` mass features (also the faster
way on a CPU: see :data:`STREAM_BLOCK_ELEMENTS`).

Ridge convention: every ``ridge`` argument is *relative*: the added diagonal
is ``ridge * mean(diag(Gram))`` over the real (non-padding) columns. The
Gram matrices here range from ``n`` (mass features near 1) to ``n / t**2``
(softmax weights), so an absolute lambda would be negligible for one and
dominant for the other.
"""
from __future__ import annotations

import math
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from kvlab.runtime.attention import attention_logits

Scoring = Literal["rms", "mean", "max"]
KeySelection = Literal["highest_attn", "omp"]
ValueFit = Literal["least_squares", "original"]

# Cholesky retries multiply the ridge by 10 this many times (1e-6 -> 1 relative)
# before giving up on a batch element; past that the Gram matrix holds
# non-finite numbers and no ridge will help.
_MAX_RIDGE_RETRIES = 6
# Refinement steps after each normal-equations solve (see _refine).
_REFINE_STEPS = 2
# Floor for the ridge scale: an all-zero Gram would otherwise get lambda = 0
# and never become positive definite however often it is multiplied.
_RIDGE_FLOOR = 1e-30


# --------------------------------------------------------------------------
# Mass features and key scores
# --------------------------------------------------------------------------


def _shifted_exp(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phi, shift)``: phi [B, n, T] = ``exp(s_ij - shift_i)``, shift [B, n] = ``max_j s_ij`` (0 for a
    query that sees only padding: shifting by -inf would give NaN instead of the correct zero mass)."""
    s = attention_logits(q, k, bias, scale)
    m = s.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return s.sub_(m.unsqueeze(-1)).exp_(), m  # in place: phi is the largest tensor here


def mass_features(
    q: torch.Tensor,
    k: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query shifted exponentials of the logits and their sums.

    q: [B, n, d], k: [B, T, d], bias: [B, T] or None (``-inf`` = padding key).
    Returns ``phi`` [B, n, T] with ``phi_ij = exp(s_ij - max_j s_ij)`` and
    ``z`` [B, n] = ``sum_j phi_ij``; ``s`` includes the bias, so a block that
    was compacted before contributes its ``exp(beta)`` mass, and padding keys
    get ``phi = 0``. The block's log-mass is ``max_j s_ij + log z_i``.

    The max shift keeps ``phi`` in [0, 1] in float32; it scales query i's
    equation by ``exp(-m_i)``, which turns the mass fit into a per-query
    weighted least squares: each query is measured against its own largest
    term, so a few high-logit queries cannot dominate the fit.
    """
    phi, _ = _shifted_exp(q, k, bias, scale)
    return phi, phi.sum(dim=-1)


def _score_sums(
    phi: torch.Tensor, inv_z: torch.Tensor, scoring: Scoring, weights: torch.Tensor | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """One batch of queries' share of the HighestAttnKeys scores: [B, T] (see :func:`_finish_scores`).

    phi: [B, c, T] mass features, inv_z: [B, c] their ``1 / z``, weights: [B, c]
    each query's weight (None: 1). rms: ``sum_i w_i a_ij^2``, mean: ``sum_i w_i a_ij``,
    max: ``max_i a_ij`` over the queries of positive weight, with ``a_ij = phi_ij / z_i``,
    each as a batched matvec where it can be (no [B, c, T] temporary); ``in_place`` may overwrite phi.
    """
    if scoring == "max":
        if weights is not None:
            inv_z = inv_z * (weights > 0)
        return (phi.mul_(inv_z.unsqueeze(-1)) if in_place else phi * inv_z.unsqueeze(-1)).amax(dim=-2)
    if scoring == "mean":
        row = inv_z
    elif scoring == "rms":
        row = inv_z.square()
        phi = phi.square_() if in_place else phi.square()
    else:
        raise ValueError(f"scoring must be 'rms', 'mean' or 'max', got {scoring!r}")
    row = row if weights is None else row * weights
    return torch.bmm(row.unsqueeze(1), phi).squeeze(1)


def _finish_scores(
    sums: torch.Tensor, total: torch.Tensor | float, scoring: Scoring, key_valid: torch.Tensor | None
) -> torch.Tensor:
    """Scores [B, T] from :func:`_score_sums` summed over all queries (max: the running max);
    ``total``: the queries' total weight ([B, 1], or their number)."""
    if scoring == "rms":
        scores = sums.div_(total).sqrt_()
    elif scoring == "mean":
        scores = sums.div_(total)
    else:
        scores = sums
    if key_valid is not None:
        # A real key whose attention underflows to 0 must still rank above padding.
        scores = scores.masked_fill(~key_valid, float("-inf"))
    return scores


def _scores_from_mass(
    phi: torch.Tensor, z: torch.Tensor, scoring: Scoring, key_valid: torch.Tensor | None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """HighestAttnKeys scores from precomputed mass features (see :func:`score_keys`); weights: [B, n] or None."""
    inv_z = 1.0 / z.clamp_min(torch.finfo(torch.float32).tiny)  # [B, n]
    return _finish_scores(_score_sums(phi, inv_z, scoring, weights), _total_weight(phi.shape[-2], weights),
                          scoring, key_valid)


def _total_weight(n: int, weights: torch.Tensor | None) -> torch.Tensor | float:
    """The queries' total weight: [B, 1], or ``n`` when unweighted."""
    return float(n) if weights is None else weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


# Logits per query chunk of the HighestAttnKeys fit. On a CPU (2 MiB of
# float32) the chunk's six passes (scale, max, shift, exp, sum, square) stay in
# cache: the fit's features took half the time of one [B, n, T] buffer of tens
# of MiB, whose page faults cost more than the exp over it
# (``python -m benchmarks.attention_matching --app``). On an accelerator
# (64 MiB) fewer, larger kernels. At least one query a chunk.
STREAM_BLOCK_ELEMENTS = {"cpu": 1 << 19, "other": 1 << 24}


def block_elements_for(device: torch.device) -> int:
    """Logits per query chunk on ``device`` (:data:`STREAM_BLOCK_ELEMENTS`)."""
    return STREAM_BLOCK_ELEMENTS["cpu" if device.type == "cpu" else "other"]


def streamed_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    scoring: Scoring | None = "rms",
    block_elements: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the HighestAttnKeys fit needs of :func:`mass_features`, a chunk of queries at a time.

    q: [B, n, d], k: [B, T, d], v: [B, T, dv], bias: [B, T] or None ->
    ``shift`` [B, n] (each query's largest logit, 0 for a query that sees only
    padding), ``z`` [B, n] (``sum_j exp(s_ij - shift_i)``), ``y`` [B, n, dv]
    (the block's attention output) and the key scores [B, T] (:func:`score_keys`,
    each query weighted by ``weights`` [B, n] when given; None when ``scoring`` is None). Each chunk of queries sees every key, so its
    softmax is complete and one pass gives all four; the [B, n, T] features are
    never held whole. ``block_elements``: logits per chunk (None: :func:`block_elements_for` q's device).
    """
    n_batch, n = q.shape[:2]
    block_elements = block_elements_for(q.device) if block_elements is None else block_elements
    rows = max(1, block_elements // max(1, n_batch * k.shape[1]))
    vf = v.float()
    shifts, zs, ys, sums = [], [], [], None
    for a in range(0, max(n, 1), rows):  # one (empty) chunk when n = 0
        phi, shift = _shifted_exp(q[:, a : a + rows], k, bias, scale)
        z = phi.sum(dim=-1)
        # z = 0 (a query that sees only padding): its output is 0, never 0/0.
        inv_z = 1.0 / z.clamp_min(torch.finfo(torch.float32).tiny)
        ys.append(torch.bmm(phi, vf).mul_(inv_z.unsqueeze(-1)))
        if scoring is not None:
            part = _score_sums(phi, inv_z, scoring, None if weights is None else weights[:, a : a + rows], True)
            sums = part if sums is None else (torch.maximum(sums, part) if scoring == "max" else sums.add_(part))
        shifts.append(shift)
        zs.append(z)
    scores = None
    if scoring is not None:
        scores = _finish_scores(sums, _total_weight(n, weights), scoring, None if bias is None else torch.isfinite(bias))
    return torch.cat(shifts, dim=1), torch.cat(zs, dim=1), torch.cat(ys, dim=1), scores


def score_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    scoring: Scoring = "rms",
) -> torch.Tensor:
    """HighestAttnKeys importance of each key: [B, T].

    q: [B, n, d], k: [B, T, d], bias: [B, T] or None. With
    ``a_ij = softmax_j(s_ij)``: ``rms`` = sqrt(mean_i a_ij^2) (the published
    default: rewards keys that some queries need badly, not only keys that
    everyone glances at), ``mean`` = mean_i a_ij, ``max`` = max_i a_ij.
    Padding keys (bias ``-inf``) score ``-inf``.
    """
    phi, z = mass_features(q, k, bias, scale)
    key_valid = None if bias is None else torch.isfinite(bias)
    return _scores_from_mass(phi, z, scoring, key_valid)


def select_highest_attn(scores: torch.Tensor, t: int) -> torch.Tensor:
    """Indices of the ``t`` best keys per head: [B, T] -> [B, t] long.

    Sorted by descending score, so ``idx[:, :t_h]`` is exactly the top-``t_h``
    selection for a head whose budget ``t_h`` is below the batch's ``t``.
    """
    if not 0 <= t <= scores.shape[-1]:
        raise ValueError(f"t={t} must be in [0, T={scores.shape[-1]}]")
    return torch.topk(scores, t, dim=-1, largest=True, sorted=True).indices


# --------------------------------------------------------------------------
# Linear algebra helpers (batched, padding-aware)
# --------------------------------------------------------------------------


def _ridge_scale(gram: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Mean diagonal of ``gram`` [B, m, m] over active rows: [B]."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1) * active
    return (diag.sum(-1) / active.sum(-1).clamp_min(1.0)).clamp_min(_RIDGE_FLOOR)


#: While :func:`compact_block` runs: per head [B], the ridge solves that never factorised
#: (they solved to 0). A context variable, so concurrent fits never mix their counts.
_FALLBACKS: ContextVar[torch.Tensor | None] = ContextVar("kvlab_solver_fallbacks", default=None)


def _record_fallbacks(bad: torch.Tensor) -> None:
    """Count ``bad`` [B] solves against the heads of the running :func:`compact_block`."""
    counts = _FALLBACKS.get()
    if counts is not None and counts.shape == bad.shape:
        counts += bad.to(counts.dtype)


def _ridge_factor(
    gram: torch.Tensor,
    active: torch.Tensor,
    ridge: float,
    ridge_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cholesky factor of ``gram + lam I`` on the active rows: ``(chol, ok)``.

    gram: [B, m, m], active: [B, m] float (1 = real row/column, 0 = padding).
    Padding rows/columns are replaced by the identity, so they solve to
    exactly 0 without shrinking the system. ``lam = ridge * ridge_scale``,
    ``ridge_scale`` [B] defaulting to the mean active diagonal. A batch
    element whose factorisation fails retries with 10x the ridge, up to
    ``_MAX_RIDGE_RETRIES`` times, and only failing elements are refactorised.
    One that never factorises (non-finite input) gets ``ok = False`` and an
    identity factor, so it solves to 0 rather than NaNs that would poison
    the whole cache; it is counted for its head (:attr:`CompactBlock.fallbacks`).
    """
    m = gram.shape[-1]
    base = _active_block(gram, active)
    ridge_scale = (_ridge_scale(base, active) if ridge_scale is None else ridge_scale).clamp_min(_RIDGE_FLOOR)
    lam = ridge * ridge_scale  # [B]

    def assemble(b: torch.Tensor, lam_: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        # Added on the diagonal in place: an identity times the diagonal would be
        # two more [B, m, m] temporaries, and m (kept keys) reaches thousands.
        out = b.clone()
        out.diagonal(dim1=-2, dim2=-1).add_(lam_.unsqueeze(-1) * act + (1.0 - act))
        return out

    chol, info = torch.linalg.cholesky_ex(assemble(base, lam, active))
    bad = info != 0
    tries = 0
    while bool(bad.any()) and tries < _MAX_RIDGE_RETRIES:
        tries += 1
        # max(): a caller's ridge of 0 must still grow on retry
        lam = torch.where(bad, torch.maximum(lam * 10.0, 1e-6 * ridge_scale), lam)
        where = bad.nonzero(as_tuple=True)[0]
        chol_b, info_b = torch.linalg.cholesky_ex(assemble(base[where], lam[where], active[where]))
        chol[where] = chol_b
        info[where] = info_b
        bad = info != 0
    if bool(bad.any()):
        chol = torch.where(bad.view(-1, 1, 1), torch.eye(m, dtype=gram.dtype, device=gram.device), chol)
        _record_fallbacks(bad)
    return chol, ~bad


def _active_block(gram: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``gram`` [B, m, m] with the rows and columns of padding entries (active 0) zeroed; no copy without padding."""
    if bool((active > 0).all()):
        return gram
    return gram * (active.unsqueeze(-1) * active.unsqueeze(-2))


def _factor_solve(
    chol: torch.Tensor, ok: torch.Tensor, rhs: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """Solve with a factor from :func:`_ridge_factor`; rhs [B, m, c] -> [B, m, c]."""
    mask = active.unsqueeze(-1) * ok.view(-1, 1, 1).to(rhs.dtype)
    return torch.cholesky_solve(rhs * mask, chol) * mask


def _refine(x, residual, pull, solve, steps: int):
    """Iterative refinement of a normal-equations solution ``x``.

    The Gram matrix is formed in float32, which squares the condition number:
    on a keep-all mass fit the weights came out ~1e-2 off. Each step solves
    for a correction from the residual recomputed with the *design* (its
    own float32 accuracy, not the Gram's) and reuses the factor, so it costs
    two design products. A step is kept only for heads whose residual
    norm it reduces, so it can never make a fit worse; with a ridged factor
    the fixed point moves towards the unridged solution only along
    well-determined directions, the near-null ones stay damped.
    """
    r = residual(x)
    err = r.square().flatten(1).sum(-1)
    for _ in range(steps):
        x_new = x + solve(pull(r))
        r_new = residual(x_new)
        err_new = r_new.square().flatten(1).sum(-1)
        better = err_new < err
        if not bool(better.any()):
            break
        if bool(better.all()):  # the usual case: no [B, ...] selects
            x, r, err = x_new, r_new, err_new
            continue
        x = torch.where(better.view(-1, 1, 1), x_new, x)
        r = torch.where(better.view(-1, 1, 1), r_new, r)
        err = torch.where(better, err_new, err)
    return x


def _ridge_lstsq(
    design: torch.Tensor,
    target: torch.Tensor,
    active: torch.Tensor,
    ridge: float,
    gram: torch.Tensor | None = None,
    rhs: torch.Tensor | None = None,
    steps: int = _REFINE_STEPS,
) -> torch.Tensor:
    """Ridge least squares ``min ||design X - target||`` by normal equations.

    design: [B, n, m] (padding columns already zero), target: [B, n, c],
    active: [B, m] -> X [B, m, c], refined by :func:`_refine` ``steps`` times. ``gram``
    and ``rhs`` may be passed when the caller already holds them.
    """
    dt = design.transpose(-1, -2)
    gram = torch.bmm(dt, design) if gram is None else gram
    rhs = torch.bmm(dt, target) if rhs is None else rhs
    chol, ok = _ridge_factor(gram, active, ridge)
    solve = lambda b: _factor_solve(chol, ok, b, active)  # noqa: E731
    return _refine(
        solve(rhs),
        lambda x: target - torch.bmm(design, x),
        lambda r: torch.bmm(dt, r),
        solve,
        steps,
    )


def _ridge_lstsq_dual(
    design: torch.Tensor,
    target: torch.Tensor,
    active: torch.Tensor,
    ridge: float,
    kern: torch.Tensor | None = None,
    steps: int = _REFINE_STEPS,
) -> torch.Tensor:
    """:func:`_ridge_lstsq` through the n x n dual, for designs with fewer rows than columns.

    design: [B, n, m] (padding columns zero), target: [B, n, c], active: [B, m]
    -> ``X = D^T (D D^T + lam I)^{-1} target`` [B, m, c], the same ridge
    estimator as the primal (the push-through identity) and the minimum-norm
    solution as lam -> 0. ``lam = ridge * ||D||_F^2 / m_active``: the primal
    Gram's mean diagonal, not the dual's own (/ n), so that both forms are one
    estimator and switching between them is invisible to callers. ``kern``:
    ``D D^T`` when the caller holds it.
    """
    dt = design.transpose(-1, -2)
    kern = torch.bmm(design, dt) if kern is None else kern  # [B, n, n]
    fro2 = torch.diagonal(kern, dim1=-2, dim2=-1).sum(-1)
    rows = torch.ones(design.shape[0], design.shape[1], dtype=design.dtype, device=design.device)
    chol, ok = _ridge_factor(kern, rows, ridge, fro2 / active.sum(-1).clamp_min(1.0))
    solve = lambda b: _factor_solve(chol, ok, b, rows)  # noqa: E731
    alpha = _refine(
        solve(target),
        lambda a: target - torch.bmm(design, torch.bmm(dt, a)),
        lambda r: r,
        solve,
        steps,
    )
    return torch.bmm(dt, alpha)


def _top_eig(gram: torch.Tensor, active: torch.Tensor, steps: int = 10) -> torch.Tensor:
    """Largest eigenvalue of PSD ``gram`` [B, m, m] by power iteration: [B].

    Starts from the all-ones vector: the mass Gram has non-negative entries,
    so its Perron vector is positive and a positive start converges in a few
    steps. Projected gradient stays stable for any step below 2/L, so a
    slightly low estimate is harmless.
    """
    v = active / active.sum(-1, keepdim=True).clamp_min(1.0).sqrt()
    for _ in range(steps):
        u = torch.bmm(gram, v.unsqueeze(-1)).squeeze(-1)
        v = u / u.norm(dim=-1, keepdim=True).clamp_min(_RIDGE_FLOOR)
    return (v * torch.bmm(gram, v.unsqueeze(-1)).squeeze(-1)).sum(-1)


def _box_nnls_gram(
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
        chol, ok = _ridge_factor(gram, active, ridge)
        w = _factor_solve(chol, ok, b.unsqueeze(-1), active).squeeze(-1)
    else:
        w = _ridge_lstsq(design, target.unsqueeze(-1), active, ridge, gram, b.unsqueeze(-1)).squeeze(-1)
    g, b = _active_block(gram, active), b * active
    return _box_steps(w, active, lo, hi, iters, lambda: _top_eig(g, active),
                      lambda x: torch.bmm(g, x.unsqueeze(-1)).squeeze(-1) - b)


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
        step = 1.0 / lipschitz().clamp_min(_RIDGE_FLOOR)
        for _ in range(iters):
            w = torch.where(real, (w - step.unsqueeze(-1) * gradient(w)).clamp(lo, hi), w)
    return w


def _box_nnls_dual(m: torch.Tensor, z: torch.Tensor, active: torch.Tensor, lo: float, hi: float, iters: int,
                   ridge: float) -> torch.Tensor:
    """:func:`_box_nnls_gram` for a wide design, never forming the m x m Gram: [B, m].

    m: [B, n, m] design with fewer rows than active columns (padding columns
    zero), z: [B, n]. The start is the same ridge estimator through the
    n x n dual (:func:`_ridge_lstsq_dual`); gradient steps use design
    products, and ``||M||_2^2`` is the top eigenvalue of ``M M^T`` as of
    ``M^T M``. Memory O(n^2 + n m) instead of O(m^2): m is the number of kept
    keys, which grows with the document.
    """
    mt = m.transpose(-1, -2)
    kern = torch.bmm(m, mt)  # [B, n, n]
    w = _ridge_lstsq_dual(m, z.unsqueeze(-1), active, ridge, kern).squeeze(-1)
    rows = torch.ones(m.shape[0], m.shape[1], dtype=m.dtype, device=m.device)
    return _box_steps(
        w, active, lo, hi, iters, lambda: _top_eig(kern, rows),
        lambda x: torch.bmm(mt, torch.bmm(m, x.unsqueeze(-1)) - z.unsqueeze(-1)).squeeze(-1),
    )


def _masked(m: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float32 M with padding columns zeroed, active [B, t])`` for a design ``m`` [B, n, t]."""
    m = m.float()
    if valid is None or bool(valid.all()):
        return m, torch.ones(m.shape[0], m.shape[-1], dtype=m.dtype, device=m.device)
    # padding columns may hold inf/NaN (exp of a -inf bias shift): drop them
    return torch.where(valid.unsqueeze(-2), m, torch.zeros_like(m)), valid.to(m.dtype)


def _gram(m: torch.Tensor, z: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(M^T M, M^T z, active, masked M)`` for a design ``m`` [B, n, t]."""
    m, active = _masked(m, valid)
    mt = m.transpose(-1, -2)
    return torch.bmm(mt, m), torch.bmm(mt, z.float().unsqueeze(-1)).squeeze(-1), active, m


def nnls(
    m: torch.Tensor,
    z: torch.Tensor,
    valid: torch.Tensor | None = None,
    iters: int = 20,
    ridge: float = 1e-6,
) -> torch.Tensor:
    """Non-negative least squares ``argmin_{w >= 0} ||m w - z||^2``: [B, t].

    m: [B, n, t], z: [B, n], valid: [B, t] bool or None. The plain NNLS of
    OMP's refits (no upper bound, more iterations than the bias fit since
    many weights sit on the w = 0 face there). Padding columns get w = 0.
    """
    gram, b, active, m = _gram(m, z, valid)
    return _box_nnls_gram(gram, b, active, 0.0, math.inf, iters, ridge, m, z.float())


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
    m_real, active = _masked(m, valid)
    if m.shape[-2] < int(active.sum(-1).max()):
        # Fewer queries than kept keys (a long document): the n x n dual, not the t x t Gram.
        w = _box_nnls_dual(m_real, z.float(), active, w_min, w_max, iters, ridge)
    else:
        gram, b, _, m_real = _gram(m_real, z, None)  # padding columns zeroed once, above
        w = _box_nnls_gram(gram, b, active, w_min, w_max, iters, ridge, m_real, z.float())
    beta = w.log()
    if valid is not None:
        beta = beta.masked_fill(~valid, float("-inf"))
    return beta


# --------------------------------------------------------------------------
# Orthogonal matching pursuit on the mass
# --------------------------------------------------------------------------


def omp_select(
    phi: torch.Tensor,
    z: torch.Tensor,
    t: int,
    keys_per_iter: int = 4,
    refit_every: int = 2,
    drop_below: float | None = -7.0,
    key_valid: torch.Tensor | None = None,
    nnls_iters: int = 20,
    ridge: float = 1e-6,
    max_iters: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy key selection that matches the attention mass.

    phi: [B, n, T] mass features, z: [B, n] targets (from :func:`mass_features`),
    key_valid: [B, T] bool or None (False = padding key, never selected).
    Returns ``idx`` [B, t] long in the order picked (-1 where a head has fewer
    than ``t`` real keys) and ``w`` [B, t] >= 0, the NNLS weights of the final
    selection on ``phi`` (0 for -1 slots); ``log w`` is the bias *relative to*
    any bias already inside ``phi``.

    Each round picks, per head, the ``keys_per_iter`` unselected keys with the
    largest correlation ``sum_i phi_ij r_i`` with the residual ``r = z - phi_S w``.
    The residual is only refreshed by a refit (every ``refit_every`` rounds and
    whenever all heads are full), which is what makes the "fast" variant fast.
    At a refit, keys with ``log w < drop_below`` are removed (their mass is
    explained by others) and banned, so each key is picked at most once and
    the loop ends; later rounds refill the freed slots.

    The Gram matrix of the selection is grown by the new columns only
    (O(n t k) per round), so a refit costs a t x t Cholesky and O(n t)
    refinement products instead of re-forming ``phi_S^T phi_S`` (O(n t^2))
    every time. Cost per round is dominated by the O(n T) correlation.
    """
    B, n, T = phi.shape
    if not 0 <= t <= T:
        raise ValueError(f"t={t} must be in [0, T={T}]")
    if keys_per_iter < 1 or refit_every < 1:
        raise ValueError("keys_per_iter and refit_every must be >= 1")
    phi = phi.float()
    z = z.float()
    dev = phi.device
    valid_keys = (
        torch.ones(B, T, dtype=torch.bool, device=dev) if key_valid is None else key_valid.to(dev)
    )
    target = valid_keys.sum(-1).clamp(max=t)  # [B]
    # No round picks more than the slots (t) or the keys (T): the picks index ``slots``.
    kpi = max(1, min(keys_per_iter, t, T))
    if max_iters is None:
        # Enough rounds to fill t slots several times over (drops refill);
        # bans make each key pickable once, so this is a safety net only.
        max_iters = 4 * (-(-t // kpi)) + 2 * refit_every + 4
    drop_w = None if drop_below is None else math.exp(drop_below)

    # Slot t is a sink: picks a head does not take are scattered there, so
    # every head can share one fixed-shape scatter.
    slot_idx = torch.full((B, t + 1), -1, dtype=torch.long, device=dev)
    m_sel = phi.new_zeros(B, n, t + 1)
    gram = phi.new_zeros(B, t + 1, t + 1)
    rhs = phi.new_zeros(B, t + 1)
    w = phi.new_zeros(B, t + 1)
    count = torch.zeros(B, dtype=torch.long, device=dev)
    taken = ~valid_keys  # selected, banned or padding
    slots = torch.arange(t + 1, device=dev)

    def append(picks: torch.Tensor, take: torch.Tensor) -> None:
        nonlocal taken, count, m_sel, gram, rhs, slot_idx
        c = picks.shape[-1]
        pos = torch.where(take, count.unsqueeze(-1) + slots[:c], torch.full_like(picks, t))
        slot_idx.scatter_(1, pos, torch.where(take, picks, torch.full_like(picks, -1)))
        new = phi.gather(2, picks.unsqueeze(1).expand(B, n, c)) * take.unsqueeze(1)
        m_sel.scatter_(2, pos.unsqueeze(1).expand(B, n, c), new)
        cross = torch.bmm(m_sel.transpose(1, 2), new)  # [B, t+1, c], new columns included
        gram.scatter_(2, pos.unsqueeze(1).expand(B, t + 1, c), cross)
        gram.scatter_(1, pos.unsqueeze(2).expand(B, c, t + 1), cross.transpose(1, 2))
        rhs.scatter_(1, pos, torch.bmm(z.unsqueeze(1), new).squeeze(1))
        taken = taken | torch.zeros_like(taken).scatter_(1, picks, take)
        count = count + take.sum(-1)

    def refit() -> torch.Tensor:
        active = (slots[:t] < count.unsqueeze(-1)).float()
        out = phi.new_zeros(B, t + 1)
        out[:, :t] = _box_nnls_gram(gram[:, :t, :t], rhs[:, :t], active, 0.0, math.inf, nnls_iters,
                                    ridge, m_sel[:, :, :t], z)
        return out

    def correlation() -> torch.Tensor:
        r = z - torch.bmm(m_sel, w.unsqueeze(-1)).squeeze(-1)
        return torch.bmm(r.unsqueeze(1), phi).squeeze(1)  # [B, T]

    corr = correlation()
    fresh = True  # w belongs to the current selection
    since_refit = 0
    for _ in range(max_iters):
        need = target - count
        if not bool((need > 0).any()):
            break
        vals, picks = corr.masked_fill(taken, float("-inf")).topk(kpi, dim=-1)
        take = (slots[:kpi] < need.unsqueeze(-1)) & torch.isfinite(vals)
        if not bool(take.any()):
            break  # every head that still needs keys has run out of candidates
        append(picks, take)
        fresh = False
        since_refit += 1
        if since_refit < refit_every and bool((count < target).any()):
            continue
        w = refit()
        fresh = True
        since_refit = 0
        if drop_w is not None:
            drop = (slots < count.unsqueeze(-1)) & (w < drop_w)
            drop[:, t] = False
            if bool(drop.any()):
                keep = (slots < count.unsqueeze(-1)) & ~drop
                # stable order: kept slots first, in picking order; sink stays last
                key = torch.where(keep, slots, slots + t + 1)
                key[:, t] = 3 * (t + 1)
                perm = key.argsort(dim=-1, stable=True)
                count = keep.sum(-1)
                live = slots < count.unsqueeze(-1)
                slot_idx = slot_idx.gather(1, perm).masked_fill(~live, -1)
                w = w.gather(1, perm) * live
                rhs = rhs.gather(1, perm) * live
                m_sel = m_sel.gather(2, perm.unsqueeze(1).expand(B, n, t + 1)) * live.unsqueeze(1)
                liveg = live.unsqueeze(-1) & live.unsqueeze(-2)
                gram = gram.gather(1, perm.unsqueeze(-1).expand(B, t + 1, t + 1))
                gram = gram.gather(2, perm.unsqueeze(1).expand(B, t + 1, t + 1)) * liveg
        corr = correlation()

    need = target - count
    if bool((need > 0).any()):
        # Ran out of rounds or of unbanned keys: fill with the best remaining
        # real keys (banned ones included) rather than leave real slots empty.
        # empty slots (-1) scatter into an extra column T, so they cannot
        # clobber the mark of a real key
        sel = slot_idx[:, :t]
        chosen = torch.zeros(B, T + 1, dtype=torch.bool, device=dev)
        chosen.scatter_(1, torch.where(sel >= 0, sel, torch.full_like(sel, T)), True)
        avail = valid_keys & ~chosen[:, :T]
        c = int(need.max())
        vals, picks = corr.masked_fill(~avail, float("-inf")).topk(c, dim=-1)
        take = (slots[:c] < need.unsqueeze(-1)) & torch.isfinite(vals)
        append(picks, take)
        fresh = False
    if not fresh:
        w = refit()
    return slot_idx[:, :t].contiguous(), w[:, :t].contiguous()


# --------------------------------------------------------------------------
# Value refit
# --------------------------------------------------------------------------


def fit_values(
    x: torch.Tensor,
    y: torch.Tensor,
    valid: torch.Tensor | None = None,
    ridge: float = 1e-6,
    exact_ridge: bool = False,
) -> torch.Tensor:
    """Least-squares values ``argmin ||x cv - y||_F``: [B, t, dv] float32.

    x: [B, n, t] attention weights of the queries over the compact keys,
    y: [B, n, dv] target outputs, valid: [B, t] bool or None. When there are
    fewer queries than real compact keys the system is under-determined and
    the n x n dual ``cv = x^T (x x^T + lam I)^{-1} y`` is both cheaper and the
    minimum-norm choice; otherwise the t x t normal equations. Both are the
    same ridge estimator with ``lam = ridge * ||x||_F^2 / t_real``, solved by
    Cholesky with per-element ridge escalation on failure. Padding columns
    get zero values. The solve is refined toward the unridged solution along
    well-determined directions (:func:`_refine`), which suits a ridge meant only
    to keep the factorisation stable; ``exact_ridge`` skips that and returns the
    ridge estimator itself, for a ridge meant as a prior (a large lambda keeps
    the factorisation well conditioned without refinement).
    """
    x = x.float()
    y = y.float()
    B, n, t = x.shape
    if valid is not None:
        if not bool(valid.all()):
            x = torch.where(valid.unsqueeze(-2), x, torch.zeros_like(x))
        t_real = int(valid.sum(-1).max()) if valid.numel() else 0
    else:
        t_real = t
    active = torch.ones(B, t, dtype=x.dtype, device=x.device) if valid is None else valid.to(x.dtype)
    steps = 0 if exact_ridge else _REFINE_STEPS
    cv = (_ridge_lstsq_dual(x, y, active, ridge, steps=steps) if n < t_real
          else _ridge_lstsq(x, y, active, ridge, steps=steps))
    if valid is not None:
        cv = cv * valid.unsqueeze(-1)
    return cv


# --------------------------------------------------------------------------
# The whole block
# --------------------------------------------------------------------------


@dataclass
class CompactBlock:
    """A compacted KV block, batched over heads.

    keys: [B, t, d] selected original keys (RoPE phases kept; input dtype),
    values: [B, t, dv] refitted values (cast to the input value dtype),
    bias: [B, t] float32 beta (``-inf`` for padding slots),
    index: [B, t] long original key index (-1 for padding),
    lengths: [B] long number of real slots per head (always a prefix),
    timings: seconds spent on ``keys``, ``bias`` and ``values``,
    scores: [B, T] float32 HighestAttnKeys score of every original key (what
    ``highest_attn`` ranks by, or the caller's ``key_scores``; also filled for
    ``omp``, for display), or None;
    fallbacks: [B] long, the head's ridge solves that never factorised (each
    solved to 0 instead); nonfinite: [B] long, non-finite fitted values or
    biases found in the head and replaced (values by 0, biases by the lower
    bound). Both 0 for a fit that went as asked; never silent (the run's details).
    train_output, train_mass: [B] the stored block's relative attention-output
    error and mass error on the fit's own reference queries (unweighted means
    over them, as :func:`kvlab.metrics.block_errors` measures), or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    index: torch.Tensor
    lengths: torch.Tensor
    timings: dict[str, float] = field(default_factory=dict)
    scores: torch.Tensor | None = None
    fallbacks: torch.Tensor | None = None
    nonfinite: torch.Tensor | None = None
    train_output: torch.Tensor | None = None
    train_mass: torch.Tensor | None = None


def fit_residuals(
    x: torch.Tensor, lse_c: torch.Tensor, cv: torch.Tensor, y: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact block's errors on its own fitting queries: (output [B], mass [B]).

    x: [B, n, t] the queries' attention over the compact keys and lse_c: [B, n]
    its log-mass; cv: [B, t, dv] the stored values; y: [B, n, dv] and lse: [B, n]
    the original block's output and log-mass. The fit holds all of them already:
    recomputing the original block's would cost as much as the features. Means
    over the queries of ``||x cv - y|| / ||y||`` and ``|exp(lse_c - lse) - 1|``,
    as :func:`kvlab.metrics.block_errors`.
    """
    out = (torch.bmm(x, cv.float()) - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)
    return out.mean(dim=-1), (torch.exp(lse_c - lse) - 1).abs().mean(dim=-1)


def _clock(device: torch.device) -> float:
    # Kernels are asynchronous on accelerators; without a sync the timings
    # would charge one step's work to the next.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def compact_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    t: int,
    *,
    bias: torch.Tensor | None = None,
    key_selection: KeySelection = "highest_attn",
    scoring: Scoring = "rms",
    budgets: torch.Tensor | None = None,
    scale: float | None = None,
    beta_bounds: tuple[float, float] | None = None,
    nnls_iters: int = 2,
    ridge: float = 1e-6,
    keys_per_iter: int = 4,
    refit_every: int = 2,
    drop_below: float | None = -7.0,
    omp_nnls_iters: int = 20,
    key_scores: torch.Tensor | None = None,
    key_scores_share: float = 1.0,
    query_weights: torch.Tensor | None = None,
    value_fit: ValueFit = "least_squares",
    value_anchor: float = 0.0,
    block_elements: int | None = None,
) -> CompactBlock:
    """Attention Matching compaction of one block for ``B`` heads at once.

    q: [B, n, d] reference queries (post-RoPE; for GQA the queries of all query
    heads of the group concatenated), k: [B, T, d], v: [B, T, dv],
    bias: [B, T] or None (an earlier compaction's beta; ``-inf`` = padding).
    ``t``: slots per head; ``budgets`` [B] long gives head b only
    ``min(budgets[b], t)`` real slots (the rest are padding with beta -inf).

    1. keys: top-``t`` by attention score, or OMP on the mass;
    2. beta: mass fit ``phi[:, :, S] w ~ z`` with ``w`` in
       ``exp(beta_bounds)``; default bounds are (-3, 3) for ``highest_attn``
       (published) and (``drop_below``, 7) for ``omp`` (whose own NNLS
       weights are used, refitted only for heads cut short by a budget);
    3. values: least squares from ``x = softmax(q Ck^T * scale + beta)`` to
       the block's original output ``attend(q, k, v, bias).output``.

    A pre-existing bias is part of the targets and is carried into beta
    (``beta`` is the total bias of the compact key), which is what makes
    re-compaction of a compacted cache work.

    ``key_scores`` [B, T] (``highest_attn`` only): rank the keys by these
    scores instead of the reference queries' attention, e.g. KVzip's, which
    come from other queries under another softmax; steps 2 and 3 are unchanged.
    With ``key_scores_share`` s < 1 the selection is a union: each head's
    ``ceil(s * t_h)`` best keys by ``key_scores``, then its best remaining keys
    by the queries' attention.

    ``query_weights`` [B, n] >= 0: a weighted fit (each query's equation in
    the mass and value least squares multiplied by ``sqrt(w_i)``, its
    attention in the scores by ``w_i``), to mix query sources.

    ``value_fit="original"`` keeps the selected keys' own values and fits
    only beta (step 3 skipped). ``value_anchor`` lambda > 0 (relative, as
    ``ridge``) pulls the values toward the selected keys' own values instead
    of toward zero: ``argmin ||X Cv - Y||^2 + lambda ||Cv - V_S||^2``, solved
    as the ridge on ``Y - X V_S`` plus ``V_S`` (primal or n x n dual alike,
    the exact ridge estimator: see :func:`fit_values`), so a direction no
    reference query constrains keeps the original value.

    ``highest_attn`` never holds the [B, n, T] mass features: it streams
    over chunks of queries of at most ``block_elements`` logits (None: the
    device's, :func:`block_elements_for`; see :func:`streamed_mass`) and recomputes the t selected keys' features;
    OMP needs them all at once.
    """
    B, n, d = q.shape
    T = k.shape[1]
    if not 0 <= t <= T:
        raise ValueError(f"t={t} must be in [0, T={T}]")
    if key_selection not in ("highest_attn", "omp"):
        raise ValueError(f"key_selection must be 'highest_attn' or 'omp', got {key_selection!r}")
    if key_scores is not None and (key_selection != "highest_attn" or key_scores.shape != (B, T)):
        raise ValueError(f"key_scores must be [B={B}, T={T}] with highest_attn selection, "
                         f"got {tuple(key_scores.shape)} with {key_selection!r}")
    if not 0.0 <= key_scores_share <= 1.0:
        raise ValueError(f"key_scores_share must be in [0, 1], got {key_scores_share}")
    if query_weights is not None and (query_weights.shape != (B, n) or bool((query_weights < 0).any())):
        raise ValueError(f"query_weights must be [B={B}, n={n}] and >= 0, got {tuple(query_weights.shape)}")
    if value_fit not in ("least_squares", "original") or value_anchor < 0:
        raise ValueError(f"value_fit must be 'least_squares' or 'original' and value_anchor >= 0, "
                         f"got {value_fit!r}, {value_anchor}")
    if beta_bounds is None:
        beta_bounds = (-3.0, 3.0) if key_selection == "highest_attn" else (
            -7.0 if drop_below is None else drop_below, 7.0)
    lo, hi = beta_bounds
    dev = q.device
    fallbacks = torch.zeros(B, dtype=torch.long, device=dev)
    counting = _FALLBACKS.set(fallbacks)
    try:
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        key_valid = None if bias is None else torch.isfinite(bias)
        n_real = torch.full((B,), T, dtype=torch.long, device=dev) if key_valid is None else key_valid.sum(-1)
        lengths = n_real.clamp(max=t)
        if budgets is not None:
            lengths = torch.minimum(lengths, budgets.to(dev).long().clamp(0, t))
        slot_valid = torch.arange(t, device=dev) < lengths.unsqueeze(-1)
        timings: dict[str, float] = {}

        start = _clock(dev)
        phi = shift = None
        root_w = None if query_weights is None else query_weights.to(dev).float().sqrt()  # [B, n]
        if key_selection == "omp":
            phi, shift = _shifted_exp(q, k, bias, scale)
            z = phi.sum(dim=-1)
            # The block's own output is phi V / z (the max shift cancels): reusing phi
            # saves recomputing every logit, the largest cost of the whole fit.
            # z = 0 (a query that sees only padding) gives 0, as in mass_features, never NaN.
            y = torch.matmul(phi, v.float()) / z.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
            # Cheap next to the features; the app shows it as each token's importance.
            scores = _scores_from_mass(phi, z, scoring, key_valid, query_weights)
        else:
            own = None if key_scores is not None and key_scores_share >= 1.0 else scoring
            shift, z, y, scores = streamed_mass(q, k, v, bias, scale, own, block_elements, query_weights)
        if key_scores is not None:
            ranked = key_scores.to(dev).float()
            if key_valid is not None:
                ranked = ranked.masked_fill(~key_valid, float("-inf"))
            if key_scores_share < 1.0:
                # The union: the key_scores' share of each head's slots first, then the queries' choice.
                first = torch.ceil(key_scores_share * lengths.float()).long()
                order = ranked.topk(t, dim=-1).indices
                taken = torch.zeros_like(ranked, dtype=torch.bool).scatter_(
                    1, order, torch.arange(t, device=dev) < first.unsqueeze(-1))
                idx = select_highest_attn(scores.masked_fill(taken, float("inf")), t)
            else:
                scores = ranked
        w_omp = None
        if key_selection == "omp":
            if root_w is not None:  # weighted least squares: each query's row times sqrt(w_i)
                phi.mul_(root_w.unsqueeze(-1))
            idx, w_omp = omp_select(phi, z if root_w is None else z * root_w, t, keys_per_iter, refit_every,
                                    drop_below, key_valid, omp_nnls_iters, ridge)
        elif key_scores is None or key_scores_share >= 1.0:
            idx = select_highest_attn(scores, t)
        index = torch.where(slot_valid, idx, torch.full_like(idx, -1))
        safe = index.clamp_min(0)
        tick = _clock(dev)
        timings["keys"] = tick - start

        # Design of the compact keys *without* any old bias, so that the fitted
        # w is exp(total beta) and the bounds apply to the stored beta.
        # (Weighted rows: phi already carries sqrt(w) for OMP; the recomputed features get it here.)
        if phi is not None:
            m_sel = phi.gather(2, safe.unsqueeze(1).expand(B, n, t))
            del phi  # the largest tensor; the value fit needs the room
        else:
            chosen = attention_logits(q, k.gather(1, safe.unsqueeze(-1).expand(B, t, d)),
                                      None if bias is None else bias.gather(1, safe), scale)
            m_sel = chosen.sub_(shift.unsqueeze(-1)).exp_()
            if root_w is not None:
                m_sel.mul_(root_w.unsqueeze(-1))
        zw = z if root_w is None else z * root_w
        old = torch.zeros(B, t, device=dev) if bias is None else bias.float().gather(1, safe)
        old = torch.where(slot_valid, old, torch.zeros_like(old))
        if w_omp is None:
            design = m_sel if bias is None else m_sel * torch.exp(-old).unsqueeze(1)
            beta = nnls_bias(design, zw, slot_valid, math.exp(lo), math.exp(hi), nnls_iters, ridge)
            del design
        else:
            w = w_omp
            # OMP fitted its weights for its full selection; a head cut short by a
            # budget loses keys whose mass the others no longer cover: refit it.
            cut = (slot_valid != (idx >= 0)).any(-1)
            if bool(cut.any()):
                w = torch.where(cut.unsqueeze(-1), nnls(m_sel, zw, slot_valid, omp_nnls_iters, ridge), w)
            beta = (w.clamp_min(torch.finfo(torch.float32).tiny).log() + old).clamp(lo, hi)
            beta = beta.masked_fill(~slot_valid, float("-inf"))
        del m_sel
        tock = _clock(dev)
        timings["bias"] = tock - tick

        ck = k.gather(1, safe.unsqueeze(-1).expand(B, t, d)) * slot_valid.unsqueeze(-1).to(k.dtype)
        own = v.gather(1, safe.unsqueeze(-1).expand(B, t, v.shape[-1])) * slot_valid.unsqueeze(-1).to(v.dtype)
        logits = attention_logits(q, ck, beta, scale)
        x = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)  # a head with no real slot: all -inf
        lse_c = torch.logsumexp(logits, dim=-1)  # for the residuals
        del logits
        if value_fit == "original":
            cv = own.float()
        else:
            target = y
            if value_anchor > 0:
                # Anchored ridge: solve for the change from the own values (the prior's mean).
                target = y - torch.bmm(x, own.float())
            lam, exact = (value_anchor, True) if value_anchor > 0 else (ridge, False)
            if root_w is not None:
                cv = fit_values(x * root_w.unsqueeze(-1), target * root_w.unsqueeze(-1), slot_valid, lam, exact)
            else:
                cv = fit_values(x, target, slot_valid, lam, exact)
            del target
            if value_anchor > 0:
                cv = cv + own.float()
        timings["values"] = _clock(dev) - tock

        # Values or biases that came out non-finite are replaced and counted: never stored silently.
        bad_values = ~torch.isfinite(cv)
        bad_bias = torch.isnan(beta) | (beta == float("inf"))
        nonfinite = bad_values.flatten(1).sum(-1) + bad_bias.sum(-1)
        cv = own if value_fit == "original" else cv.masked_fill(bad_values, 0.0).to(v.dtype)
        beta = beta.masked_fill(bad_bias, lo)
        train_output, train_mass = fit_residuals(x, lse_c, cv, y, shift + z.log())
        return CompactBlock(
            keys=ck,
            values=cv,
            bias=beta,
            index=index,
            lengths=lengths,
            timings=timings,
            scores=scores,
            fallbacks=fallbacks.clone(),
            nonfinite=nonfinite,
            train_output=train_output,
            train_mass=train_mass,
        )
    finally:
        _FALLBACKS.reset(counting)
