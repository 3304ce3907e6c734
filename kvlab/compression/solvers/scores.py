"""Attention Matching's mass features and key scores (HighestAttnKeys; Zweiger et al., 2026).

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together, e.g. all KV heads of a layer); all maths is float32 whatever the input dtype.
Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key
dim, ``dv`` value dim.

HighestAttnKeys streams over query chunks instead of holding the ``[B, n, T]`` mass features
(also the faster way on a CPU: see :data:`STREAM_BLOCK_ELEMENTS`). Attention itself is computed
only through :mod:`kvlab.runtime.attention`.
"""

from __future__ import annotations

from typing import Literal

import torch

from kvlab.runtime.attention import attention_logits, matmul

Scoring = Literal["rms", "mean", "max"]


def shifted_exp(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phi, shift)``: phi [B, n, T] = ``exp(s_ij - shift_i)``, shift [B, n] = ``max_j s_ij`` (0 for a
    query that sees only padding: shifting by -inf would give NaN instead of the correct zero mass)."""
    s = attention_logits(q, k, bias, scale)
    m = s.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return s.sub_(m.unsqueeze(-1)).exp_(), m  # in place: phi is the largest tensor here


def mass_features(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None
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
    phi, _ = shifted_exp(q, k, bias, scale)
    return phi, phi.sum(dim=-1)


def _score_sums(
    phi: torch.Tensor,
    inv_z: torch.Tensor,
    scoring: Scoring,
    weights: torch.Tensor | None = None,
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


def scores_from_mass(
    phi: torch.Tensor,
    z: torch.Tensor,
    scoring: Scoring,
    key_valid: torch.Tensor | None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """HighestAttnKeys scores from precomputed mass features (see :func:`score_keys`); weights: [B, n] or None."""
    inv_z = 1.0 / z.clamp_min(torch.finfo(torch.float32).tiny)  # [B, n]
    return _finish_scores(
        _score_sums(phi, inv_z, scoring, weights), _total_weight(phi.shape[-2], weights), scoring, key_valid
    )


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
    each query weighted by ``weights`` [B, n] when given; None when ``scoring``
    is None). Each chunk of queries sees every key, so its
    softmax is complete and one pass gives all four; the [B, n, T] features are
    never held whole. ``block_elements``: logits per chunk (None: :func:`block_elements_for` q's device).
    """
    n_batch, n = q.shape[:2]
    block_elements = block_elements_for(q.device) if block_elements is None else block_elements
    rows = max(1, block_elements // max(1, n_batch * k.shape[1]))
    vf = v.float()
    shifts, zs, ys, sums = [], [], [], None
    for a in range(0, max(n, 1), rows):  # one (empty) chunk when n = 0
        phi, shift = shifted_exp(q[:, a : a + rows], k, bias, scale)
        z = phi.sum(dim=-1)
        # z = 0 (a query that sees only padding): its output is 0, never 0/0.
        inv_z = 1.0 / z.clamp_min(torch.finfo(torch.float32).tiny)
        ys.append(matmul(phi, vf).mul_(inv_z.unsqueeze(-1)))
        if scoring is not None:
            part = _score_sums(phi, inv_z, scoring, None if weights is None else weights[:, a : a + rows], True)
            sums = part if sums is None else (torch.maximum(sums, part) if scoring == "max" else sums.add_(part))
        shifts.append(shift)
        zs.append(z)
    scores = None
    if scoring is not None:
        scores = _finish_scores(
            sums, _total_weight(n, weights), scoring, None if bias is None else torch.isfinite(bias)
        )
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
    return scores_from_mass(phi, z, scoring, key_valid)


def select_highest_attn(scores: torch.Tensor, t: int) -> torch.Tensor:
    """Indices of the ``t`` best keys per head: [B, T] -> [B, t] long.

    Sorted by descending score, so ``idx[:, :t_h]`` is exactly the top-``t_h``
    selection for a head whose budget ``t_h`` is below the batch's ``t``.
    """
    if not 0 <= t <= scores.shape[-1]:
        raise ValueError(f"t={t} must be in [0, T={scores.shape[-1]}]")
    return torch.topk(scores, t, dim=-1, largest=True, sorted=True).indices
