"""The value refit of Attention Matching (Zweiger et al., 2026): the compact values by ridge least
squares on the block's attention outputs.

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together, e.g. all KV heads of a layer); all maths is float32 whatever the input dtype.
Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key
dim, ``dv`` value dim.
"""

from __future__ import annotations

import torch

from kvlab.compression.solvers.linalg import REFINE_STEPS, ridge_lstsq, ridge_lstsq_dual


def fit_values(
    x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None, ridge: float = 1e-6, exact_ridge: bool = False
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
            x = x.masked_fill(~valid.unsqueeze(-2), 0.0)
        t_real = int(valid.sum(-1).max()) if valid.numel() else 0
    else:
        t_real = t
    active = torch.ones(B, t, dtype=x.dtype, device=x.device) if valid is None else valid.to(x.dtype)
    steps = 0 if exact_ridge else REFINE_STEPS
    cv = (
        ridge_lstsq_dual(x, y, active, ridge, steps=steps)
        if n < t_real
        else ridge_lstsq(x, y, active, ridge, steps=steps)
    )
    if valid is not None:
        cv = cv * valid.unsqueeze(-1)
    return cv
