"""Closed-form compaction of one KV block (Attention Matching, Zweiger et al., 2026).

A block of ``T`` cached keys/values of one KV head is replaced by ``t`` compact
keys ``Ck`` (a subset of the original keys), refitted values ``Cv`` and one
additive logit bias ``beta`` per compact key, so that for the reference
queries both the block's local attention output and its attention mass
``sum_j exp(logit_j)`` are preserved. Matching the mass is what makes the
compact block a drop-in replacement next to other blocks (the paper's
argument). :func:`compact_block` runs the stages it times: the keys, as a
:class:`KeyChoice` chooses them (keys.py: scores.py's rankings or omp.py's pursuit), the
bounded NNLS for the biases (nnls.py), the value least squares (values.py, as
:class:`FitSettings` says), all on linalg.py's batched ridge solves.

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together, e.g. all KV heads of a layer); all maths is float32 whatever the input dtype.
Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key
dim, ``dv`` value dim.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from kvlab.compression.solvers.keys import BlockData, Chosen, HighestAttn, KeyChoice, MassFit
from kvlab.compression.solvers.linalg import FALLBACKS
from kvlab.compression.solvers.values import fit_values
from kvlab.runtime.attention import attention_logits, matmul

ValueFit = Literal["least_squares", "original"]


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
    :class:`HighestAttn` ranks by, or :class:`GivenScores`' scores; also filled for
    :class:`OMP`, for display), or None;
    fallbacks: [B] long, the head's ridge solves that never factorised (each
    solved to 0 instead); nonfinite: [B] long, non-finite fitted values or
    biases found in the head and replaced (values by 0, biases by the lower
    bound). Both 0 for a fit that went as asked; never silent (the run's details).
    train_output, train_mass: [B] the stored block's relative attention-output
    error and mass error on the fit's own reference queries (unweighted means
    over them, as :func:`kvlab.metrics.block_errors` measures), or None.
    exact: [B, t] bool, the slots that hold exact keys (:class:`ExactFirst`: their own
    key, value and bias, outside the fit), or None when there are none.
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
    exact: torch.Tensor | None = None


def fit_residuals(
    x: torch.Tensor, lse_c: torch.Tensor, cv: torch.Tensor, y: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact block's errors on its own fitting queries: (output [B], mass [B]).

    x: [B, n, t] the queries' attention over the compact keys and lse_c: [B, n]
    its log-mass; cv: [B, t, dv] the stored values; y: [B, n, dv] and lse: [B, n]
    the original block's output and log-mass. The fit holds all of them already:
    recomputing the original block's would cost as much as the features. Means
    over the queries of ``||x cv - y|| / ||y||`` and ``|exp(lse_c - lse) - 1|``,
    as :func:`kvlab.metrics.block_errors`.
    """
    out = (matmul(x, cv.float()) - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)
    return out.mean(dim=-1), (torch.exp(lse_c - lse) - 1).abs().mean(dim=-1)


def _clock(device: torch.device) -> float:
    # Kernels are asynchronous on accelerators; without a sync the timings
    # would charge one step's work to the next.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class FitSettings:
    """How the bias and value stages fit the chosen keys.

    beta_bounds: the stored beta's bounds (None: the key choice's, :attr:`KeyChoice.beta_bounds`);
    nnls_iters: projected-gradient steps of the bounded bias fit; ridge: of the value and bias
    least squares (and OMP's), relative to the Gram's mean diagonal.
    value_fit: ``least_squares`` (the values refitted from ``x = softmax(q Ck^T * scale + beta)``
    to the block's output) or ``original`` (the chosen keys' own values; only beta is fitted).
    value_anchor: lambda > 0 (relative, as ``ridge``) pulls the values toward the chosen keys' own
    values instead of toward zero: ``argmin ||X Cv - Y||^2 + lambda ||Cv - V_S||^2``, solved as the
    ridge on ``Y - X V_S`` plus ``V_S`` (primal or n x n dual alike, the exact ridge estimator: see
    :func:`fit_values`), so a direction no reference query constrains keeps the original value.
    """

    beta_bounds: tuple[float, float] | None = None
    nnls_iters: int = 2
    ridge: float = 1e-6
    value_fit: ValueFit = "least_squares"
    value_anchor: float = 0.0

    def __post_init__(self) -> None:
        if self.value_fit not in ("least_squares", "original") or self.value_anchor < 0:
            raise ValueError(
                f"value_fit must be 'least_squares' or 'original' and value_anchor >= 0, "
                f"got {self.value_fit!r}, {self.value_anchor}"
            )


def compact_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    t: int,
    *,
    bias: torch.Tensor | None = None,
    budgets: torch.Tensor | None = None,
    scale: float | None = None,
    query_weights: torch.Tensor | None = None,
    keys: KeyChoice = HighestAttn(),
    fit: FitSettings = FitSettings(),
    block_elements: int | None = None,
) -> CompactBlock:
    """Attention Matching compaction of one block for ``B`` heads at once.

    q: [B, n, d] reference queries (post-RoPE; for GQA the queries of all query
    heads of the group concatenated), k: [B, T, d], v: [B, T, dv],
    bias: [B, T] or None (an earlier compaction's beta; ``-inf`` = padding).
    ``t``: slots per head; ``budgets`` [B] long gives head b only ``min(budgets[b], t)``
    real slots (the rest are padding with beta -inf); ``scale`` on q.k (None: 1/sqrt(d)).

    1. keys: as ``keys`` chooses them (:mod:`kvlab.compression.solvers.keys`);
    2. beta: mass fit ``phi[:, :, S] w ~ z`` with ``w`` in ``exp(beta_bounds)`` (:meth:`KeyChoice.fit_bias`);
    3. values: as ``fit`` says (:class:`FitSettings`), toward the block's original
       output ``attend(q, k, v, bias).output``.

    A pre-existing bias is part of the targets and is carried into beta
    (``beta`` is the total bias of the compact key), which is what makes
    re-compaction of a compacted cache work.

    ``query_weights`` [B, n] >= 0: a weighted fit (each query's equation in
    the mass and value least squares multiplied by ``sqrt(w_i)``, its
    attention in the scores by ``w_i``), to mix query sources.
    ``block_elements``: logits per chunk of queries where the mass is streamed
    (None: the device's, :func:`block_elements_for`; see :func:`streamed_mass`).
    """
    B, n, d = q.shape
    T = k.shape[1]
    if not 0 <= t <= T:
        raise ValueError(f"t={t} must be in [0, T={T}]")
    if query_weights is not None and (query_weights.shape != (B, n) or bool((query_weights < 0).any())):
        raise ValueError(f"query_weights must be [B={B}, n={n}] and >= 0, got {tuple(query_weights.shape)}")
    lo, hi = keys.beta_bounds if fit.beta_bounds is None else fit.beta_bounds
    dev = q.device
    fallbacks = torch.zeros(B, dtype=torch.long, device=dev)
    counting = FALLBACKS.set(fallbacks)
    try:
        key_valid = None if bias is None else torch.isfinite(bias)
        lengths = slot_lengths(key_valid, budgets, B, T, t, dev)
        slot_valid = torch.arange(t, device=dev) < lengths.unsqueeze(-1)

        start = _clock(dev)
        root_w = None if query_weights is None else query_weights.to(dev).float().sqrt()  # [B, n]
        data = BlockData(
            q,
            k,
            v,
            bias,
            1.0 / math.sqrt(d) if scale is None else scale,
            query_weights,
            root_w,
            key_valid,
            block_elements,
        )
        chosen = keys.choose(data, t, lengths, fit.ridge)
        index = torch.where(slot_valid, chosen.index, torch.full_like(chosen.index, -1))
        safe = index.clamp_min(0)
        tick = _clock(dev)

        problem = mass_fit(data, chosen, safe, slot_valid, fit, (lo, hi))
        beta = keys.fit_bias(chosen, problem)
        tock = _clock(dev)

        return _fit_values(
            data, chosen, problem, beta, index, safe, slot_valid, lengths, fit, lo, fallbacks, (start, tick, tock)
        )
    finally:
        FALLBACKS.reset(counting)


def _fit_values(
    data: BlockData,
    chosen: Chosen,
    problem: MassFit,
    beta: torch.Tensor,
    index: torch.Tensor,
    safe: torch.Tensor,
    slot_valid: torch.Tensor,
    lengths: torch.Tensor,
    fit: FitSettings,
    lo: float,
    fallbacks: torch.Tensor,
    clocks: tuple[float, float, float],
) -> CompactBlock:
    """:func:`compact_block`'s last stage, the values (``fit.value_fit``), and its final checks: a
    non-finite fit falls back (:func:`finite_fit`), and the fit's residuals on the reference queries.
    ``problem``: the bias stage's (its features become the compact attention, in place);
    ``clocks``: the times the keys and bias stages started and the bias stage ended."""
    q, k, v, root_w, dev = data.q, data.k, data.v, data.root_w, data.q.device
    B, t = slot_valid.shape
    d = q.shape[-1]
    start, tick, tock = clocks
    ck = k.gather(1, safe.unsqueeze(-1).expand(B, t, d)) * slot_valid.unsqueeze(-1).to(k.dtype)
    own = v.gather(1, safe.unsqueeze(-1).expand(B, t, v.shape[-1])) * slot_valid.unsqueeze(-1).to(v.dtype)
    x, lse_c = attention_from_features(problem, beta, chosen.mass.shift, root_w, lambda: (q, ck, data.scale))
    cv = (
        own.float()
        if fit.value_fit == "original"
        else refit_values(x, chosen.mass.y, own, chosen.exact, slot_valid, root_w, fit)
    )
    timings = {"keys": tick - start, "bias": tock - tick, "values": _clock(dev) - tock}

    cv, beta, nonfinite = finite_fit(cv, beta, own, fit.value_fit == "original", lo)
    train_output, train_mass = fit_residuals(x, lse_c, cv, chosen.mass.y, chosen.mass.shift + chosen.mass.z.log())
    return CompactBlock(
        keys=ck,
        values=cv,
        bias=beta,
        index=index,
        lengths=lengths,
        timings=timings,
        scores=chosen.mass.scores,
        fallbacks=fallbacks.clone(),
        nonfinite=nonfinite,
        train_output=train_output,
        train_mass=train_mass,
        exact=chosen.exact,
    )


def slot_lengths(
    key_valid: torch.Tensor | None, budgets: torch.Tensor | None, B: int, T: int, t: int, dev: torch.device
) -> torch.Tensor:
    """[B] long real slots of each head: its real keys (key_valid [B, T] bool, None: all T), at most
    ``t`` and its budget (budgets [B], None: no budget)."""
    n_real = torch.full((B,), T, dtype=torch.long, device=dev) if key_valid is None else key_valid.sum(-1)
    lengths = n_real.clamp(max=t)
    if budgets is not None:
        lengths = torch.minimum(lengths, budgets.to(dev).long().clamp(0, t))
    return lengths


def mass_fit(
    data: BlockData,
    chosen: Chosen,
    safe: torch.Tensor,
    slot_valid: torch.Tensor,
    fit: FitSettings,
    bounds: tuple[float, float],
) -> MassFit:
    """The bias stage's problem on the chosen keys (safe: [B, t] their index, 0 on padding slots;
    slot_valid [B, t] the real slots). Frees OMP's whole features: the value fit needs the room."""
    q, k, bias, root_w = data.q, data.k, data.bias, data.root_w
    (B, n, d), t = q.shape, safe.shape[1]
    mass = chosen.mass
    # The compact keys' features *without* any old bias, so that the fitted w is exp(total beta)
    # (weighted rows: OMP's phi already carries sqrt(w); the recomputed features get it here).
    if mass.phi is not None:
        features = mass.phi.gather(2, safe.unsqueeze(1).expand(B, n, t))
        mass.phi = None
    else:
        logits = attention_logits(
            q,
            k.gather(1, safe.unsqueeze(-1).expand(B, t, d)),
            None if bias is None else bias.gather(1, safe),
            data.scale,
        )
        features = logits.sub_(mass.shift.unsqueeze(-1)).exp_()
        if root_w is not None:
            features.mul_(root_w.unsqueeze(-1))
    target = mass.z if root_w is None else mass.z * root_w
    old = torch.zeros(B, t, device=q.device) if bias is None else bias.float().gather(1, safe)
    old = torch.where(slot_valid, old, torch.zeros_like(old))
    return MassFit(features, target, old, slot_valid, bias is not None, bounds, fit.nnls_iters, fit.ridge)


def compact_attention(
    q: torch.Tensor, ck: torch.Tensor, beta: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries' attention over the compact block: (x [B, n, t], its log-mass lse_c [B, n]).

    q: [B, n, d], ck: [B, t, d], beta: [B, t]. A head with no real slot (all -inf) or a
    non-finite key gives NaN in the softmax: 0 there.
    """
    logits = attention_logits(q, ck, beta, scale)
    # The softmax and its log-mass from one pass in place (logsumexp would hold a second [B, n, t]
    # copy and exponentiate it once more); an all -inf row keeps lse_c = -inf, as logsumexp's.
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
    lse_c = (top + total.log()).squeeze(-1)  # for the residuals
    return logits.div_(total).nan_to_num_(nan=0.0), lse_c


#: A row whose compact mass, relative to its block's largest logit (what the mass features are
#: shifted by), is below this has features near float32's underflow: its attention is recomputed
#: from the logits (:func:`attention_from_features`). Above it every feature that matters to the
#: row is a normal float32, as precise as the logits' own exponential.
FEATURE_FLOOR = 1e-20


def attention_from_features(
    problem: MassFit,
    beta: torch.Tensor,
    shift: torch.Tensor,
    root_w: torch.Tensor | None,
    operands: Callable[[], tuple[torch.Tensor, torch.Tensor, float]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compact_attention`'s ``(x [B, n, t], lse_c [B, n])`` from the bias stage's features,
    without forming the logits again: the features are ``sqrt(w_i) exp(s_ij + old_j - shift_i)``
    (:func:`mass_fit`), so the compact softmax is the features times ``exp(beta_j - old_j)``,
    normalised per row (the row's weight and shift cancel), and ``lse_c = shift + log`` of the
    unweighted row sum. The features are overwritten (the value fit needs the room). Rows whose
    sum is below :data:`FEATURE_FLOOR`, not finite, or weighted by 0 are recomputed by
    :func:`compact_attention` on ``operands()`` ``(q [B, n, d], ck [B, t, d], scale)``, for the
    heads that have one. shift: [B, n]; beta: [B, t] (``-inf`` on padding); root_w: [B, n] or None.
    """
    x = problem.features.mul_(torch.exp(beta - problem.old).unsqueeze(1))
    total = x.sum(dim=-1)  # [B, n]
    mass = total if root_w is None else total / root_w
    redo = ~((total >= FEATURE_FLOOR) & torch.isfinite(mass))
    x.div_(torch.where(redo, torch.ones_like(total), total).unsqueeze(-1))
    lse_c = shift + torch.where(redo, torch.ones_like(mass), mass).log()
    heads = redo.any(dim=-1)
    if bool(heads.any()):
        q, ck, scale = operands()
        again, lse_again = compact_attention(q[heads], ck[heads], beta[heads], scale)
        rows = redo[heads].unsqueeze(-1)
        x[heads] = torch.where(rows, again, x[heads])
        lse_c[heads] = torch.where(rows.squeeze(-1), lse_again, lse_c[heads])
    return x, lse_c


def refit_values(
    x: torch.Tensor,
    y: torch.Tensor,
    own: torch.Tensor,
    exact: torch.Tensor | None,
    slot_valid: torch.Tensor,
    root_w: torch.Tensor | None,
    fit: FitSettings,
) -> torch.Tensor:
    """The least-squares values [B, t, dv] float32 from ``x`` [B, n, t] to the block's output
    ``y`` [B, n, dv] (:class:`FitSettings`: the ridge, or the anchor toward the chosen keys' own
    values ``own`` [B, t, dv]); rows times root_w [B, n] when weighted. The exact slots (exact
    [B, t] bool) keep their own values and their part of the output is theirs: the compact values
    fit the residual (:class:`ExactFirst`)."""
    target, x_fit = y, x
    fit_valid = slot_valid
    if exact is not None:
        # The exact keys' part of the output (their own values, under the softmax over every slot).
        x_exact = x * exact.unsqueeze(1)
        target, x_fit = y - matmul(x_exact, own.float()), x - x_exact
        fit_valid = slot_valid & ~exact
    anchored = fit.value_anchor > 0
    if anchored:
        # Anchored ridge: solve for the change from the own values (the prior's mean).
        target = target - matmul(x_fit, own.float())
    lam = fit.value_anchor if anchored else fit.ridge
    if root_w is not None:
        cv = fit_values(x_fit * root_w.unsqueeze(-1), target * root_w.unsqueeze(-1), fit_valid, lam, anchored)
    else:
        cv = fit_values(x_fit, target, fit_valid, lam, anchored)
    del target, x_fit
    if anchored:
        cv = cv + own.float()
    if exact is not None:
        cv = torch.where(exact.unsqueeze(-1), own.float(), cv)
    return cv


def finite_fit(
    cv: torch.Tensor, beta: torch.Tensor, own: torch.Tensor, original: bool, lo: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored values and biases, non-finite ones replaced and counted (never stored silently):
    (values [B, t, dv] in own's dtype, beta [B, t], nonfinite [B] long). Non-finite values become
    0, biases NaN or +inf the lower bound ``lo``; ``original``: the values are ``own`` [B, t, dv]."""
    bad_values = ~torch.isfinite(cv)
    bad_bias = torch.isnan(beta) | (beta == float("inf"))
    nonfinite = bad_values.flatten(1).sum(-1) + bad_bias.sum(-1)
    cv = own if original else cv.masked_fill(bad_values, 0.0).to(own.dtype)
    return cv, beta.masked_fill(bad_bias, lo), nonfinite
