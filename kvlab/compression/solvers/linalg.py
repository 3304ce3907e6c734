"""The solvers' batched, padding-aware linear algebra: ridge least squares in primal and dual form.

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together, e.g. all KV heads of a layer); all maths is float32 whatever the input dtype.
Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key
dim, ``dv`` value dim.

Memory: a long document has many kept keys ``t``; no solve holds a ``t x t`` matrix when there
are fewer reference queries than kept keys (the ``n x n`` dual, :func:`ridge_lstsq_dual`).

Ridge convention: every ``ridge`` argument is *relative*: the added diagonal is
``ridge * mean(diag(Gram))`` over the real (non-padding) columns. The Gram matrices here range
from ``n`` (mass features near 1) to ``n / t**2`` (softmax weights), so an absolute lambda would
be negligible for one and dominant for the other.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

from kvlab.runtime.attention import matmul

# Cholesky retries multiply the ridge by 10 this many times (1e-6 -> 1 relative)
# before giving up on a batch element; past that the Gram matrix holds
# non-finite numbers and no ridge will help.
MAX_RIDGE_RETRIES = 6
# Refinement steps after each normal-equations solve (see _refine).
REFINE_STEPS = 2
# Floor for the ridge scale: an all-zero Gram would otherwise get lambda = 0
# and never become positive definite however often it is multiplied.
RIDGE_FLOOR = 1e-30


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` [B, m, c] of ``a`` [B, m, k] and ``b`` [B, k, c], a single column (c = 1) as the row
    ``(b^T a^T)^T``: a batched matrix-vector product in MKL's column form runs 3-12x slower on an AMD
    CPU than the same product as a row times a matrix (the bias fit's products all have one column);
    others as kvlab.runtime.attention.matmul multiplies them."""
    if b.shape[-1] == 1:
        return torch.bmm(b.mT, a.mT).mT
    return matmul(a, b)


#: Columns per block of :func:`gram_matrix`'s products.
GRAM_BLOCK = 192


def gram_matrix(design: torch.Tensor, lower_only: bool = False) -> torch.Tensor:
    """``design^T design`` [B, m, m] of a design [B, n, m], by blocks of :data:`GRAM_BLOCK` columns:
    the lower triangle (half the products of one ``bmm``, and on a CPU the narrow blocks stay in
    cache: about 2x faster from a few hundred columns, kept keys, on), mirrored above unless
    ``lower_only`` (zeros above the diagonal blocks: a Cholesky factorisation reads the lower triangle)."""
    m = design.shape[-1]
    if m <= 2 * GRAM_BLOCK:
        return matmul(design.mT, design)
    out = design.new_empty(design.shape[0], m, m)
    for a in range(0, m, GRAM_BLOCK):
        b = min(m, a + GRAM_BLOCK)
        rows = matmul(design[:, :, a:b].mT, design[:, :, :b])  # [B, b - a, b]: block row a:b, left of b
        out[:, a:b, :b] = rows
        if lower_only:
            out[:, a:b, b:] = 0.0  # only right of the block: zeroing all of ``out`` first costs a pass more
        else:
            out[:, :a, a:b] = rows[:, :, :a].mT
    return out


def _ridge_scale(gram: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Mean diagonal of ``gram`` [B, m, m] over active rows: [B]."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1) * active
    return (diag.sum(-1) / active.sum(-1).clamp_min(1.0)).clamp_min(RIDGE_FLOOR)


#: While :func:`compact_block` runs: per head [B], the ridge solves that never factorised
#: (they solved to 0). A context variable, so concurrent fits never mix their counts.
FALLBACKS: ContextVar[torch.Tensor | None] = ContextVar("kvlab_solver_fallbacks", default=None)


def _record_fallbacks(bad: torch.Tensor) -> None:
    """Count ``bad`` [B] solves against the heads of the running :func:`compact_block`."""
    counts = FALLBACKS.get()
    if counts is not None and counts.shape == bad.shape:
        counts += bad.to(counts.dtype)


def ridge_factor(
    gram: torch.Tensor, active: torch.Tensor, ridge: float, ridge_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cholesky factor of ``gram + lam I`` on the active rows: ``(chol, ok)``.

    gram: [B, m, m] (only its lower triangle is read), active: [B, m] float (1 = real row/column, 0 = padding).
    Padding rows/columns are replaced by the identity, so they solve to
    exactly 0 without shrinking the system. ``lam = ridge * ridge_scale``,
    ``ridge_scale`` [B] defaulting to the mean active diagonal. A batch
    element whose factorisation fails retries with 10x the ridge, up to
    ``MAX_RIDGE_RETRIES`` times, and only failing elements are refactorised.
    One that never factorises (non-finite input) gets ``ok = False`` and an
    identity factor, so it solves to 0 rather than NaNs that would poison
    the whole cache; it is counted for its head (:attr:`CompactBlock.fallbacks`).
    """
    m = gram.shape[-1]
    base = active_block(gram, active)
    ridge_scale = (_ridge_scale(base, active) if ridge_scale is None else ridge_scale).clamp_min(RIDGE_FLOOR)
    lam = ridge * ridge_scale  # [B]

    def assemble(b: torch.Tensor, lam_: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        out = b.clone()
        out.diagonal(dim1=-2, dim2=-1).add_(lam_.unsqueeze(-1) * act + (1.0 - act))
        return out

    # The first try factors ``base`` with the ridge added to its diagonal in place and the diagonal
    # restored after: a copy of a [B, m, m] Gram costs as much as its factorisation when m (kept keys)
    # reaches thousands, and the caller may still need the Gram (the bias fit's gradient steps).
    diag = base.diagonal(dim1=-2, dim2=-1)
    saved = diag.clone()
    diag.add_(lam.unsqueeze(-1) * active + (1.0 - active))
    try:
        chol, info = torch.linalg.cholesky_ex(base)
    finally:
        diag.copy_(saved)
    bad = info != 0
    tries = 0
    while bool(bad.any()) and tries < MAX_RIDGE_RETRIES:
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


def active_block(gram: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``gram`` [B, m, m] with the rows and columns of padding entries (active 0) zeroed; no copy without padding."""
    if bool((active > 0).all()):
        return gram
    return gram * (active.unsqueeze(-1) * active.unsqueeze(-2))


def factor_solve(chol: torch.Tensor, ok: torch.Tensor, rhs: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Solve with a factor from :func:`ridge_factor`; rhs [B, m, c] -> [B, m, c]."""
    mask = active.unsqueeze(-1) * ok.view(-1, 1, 1).to(rhs.dtype)
    # Two triangular solves: cholesky_solve copies the factor to another layout first, which costs
    # more than the solves themselves for a large factor.
    half = torch.linalg.solve_triangular(chol, rhs * mask, upper=False)
    return torch.linalg.solve_triangular(chol.mT, half, upper=True) * mask


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


def ridge_lstsq(
    design: torch.Tensor,
    target: torch.Tensor,
    active: torch.Tensor,
    ridge: float,
    gram: torch.Tensor | None = None,
    rhs: torch.Tensor | None = None,
    steps: int = REFINE_STEPS,
) -> torch.Tensor:
    """Ridge least squares ``min ||design X - target||`` by normal equations.

    design: [B, n, m] (padding columns already zero), target: [B, n, c],
    active: [B, m] -> X [B, m, c], refined by :func:`_refine` ``steps`` times. ``gram``
    and ``rhs`` may be passed when the caller already holds them.
    """
    dt = design.transpose(-1, -2)
    gram = gram_matrix(design, lower_only=True) if gram is None else gram  # only factorised here
    rhs = product(dt, target) if rhs is None else rhs
    chol, ok = ridge_factor(gram, active, ridge)
    solve = lambda b: factor_solve(chol, ok, b, active)  # noqa: E731
    return _refine(solve(rhs), lambda x: target - product(design, x), lambda r: product(dt, r), solve, steps)


def ridge_lstsq_dual(
    design: torch.Tensor,
    target: torch.Tensor,
    active: torch.Tensor,
    ridge: float,
    kern: torch.Tensor | None = None,
    steps: int = REFINE_STEPS,
) -> torch.Tensor:
    """:func:`ridge_lstsq` through the n x n dual, for designs with fewer rows than columns.

    design: [B, n, m] (padding columns zero), target: [B, n, c], active: [B, m]
    -> ``X = D^T (D D^T + lam I)^{-1} target`` [B, m, c], the same ridge
    estimator as the primal (the push-through identity) and the minimum-norm
    solution as lam -> 0. ``lam = ridge * ||D||_F^2 / m_active``: the primal
    Gram's mean diagonal, not the dual's own (/ n), so that both forms are one
    estimator and switching between them is invisible to callers. ``kern``:
    ``D D^T`` when the caller holds it.
    """
    dt = design.transpose(-1, -2)
    kern = gram_matrix(dt) if kern is None else kern  # [B, n, n]
    fro2 = torch.diagonal(kern, dim1=-2, dim2=-1).sum(-1)
    rows = torch.ones(design.shape[0], design.shape[1], dtype=design.dtype, device=design.device)
    chol, ok = ridge_factor(kern, rows, ridge, fro2 / active.sum(-1).clamp_min(1.0))
    solve = lambda b: factor_solve(chol, ok, b, rows)  # noqa: E731
    alpha = _refine(solve(target), lambda a: target - product(design, product(dt, a)), lambda r: r, solve, steps)
    return product(dt, alpha)


def masked_design(m: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float32 M with padding columns zeroed, active [B, t])`` for a design ``m`` [B, n, t]."""
    m = m.float()
    if valid is None or bool(valid.all()):
        return m, torch.ones(m.shape[0], m.shape[-1], dtype=m.dtype, device=m.device)
    # padding columns may hold inf/NaN (exp of a -inf bias shift): drop them
    return m.masked_fill(~valid.unsqueeze(-2), 0.0), valid.to(m.dtype)


def masked_gram(m: torch.Tensor, z: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(M^T M, M^T z, active, masked M)`` for a design ``m`` [B, n, t]."""
    m, active = masked_design(m, valid)
    mt = m.transpose(-1, -2)
    return gram_matrix(m), product(mt, z.float().unsqueeze(-1)).squeeze(-1), active, m
