"""Closed-form compaction of one KV block (Attention Matching, Zweiger et al., 2026).

A block of ``T`` cached keys/values of one KV head is replaced by ``t`` compact
keys ``Ck`` (a subset of the original keys), refitted values ``Cv`` and one
additive logit bias ``beta`` per compact key, so that for the reference
queries both the block's local attention output and its attention mass
``sum_j exp(logit_j)`` are preserved. Matching the mass is what makes the
compact block a drop-in replacement next to other blocks (the paper's
argument). :func:`compact_block` runs the stages: key scores (scores.py) or OMP
(omp.py), the bounded NNLS for the biases (nnls.py), the value least squares
(values.py), all on linalg.py's batched ridge solves.

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together, e.g. all KV heads of a layer); all maths is float32 whatever the input dtype.
Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key
dim, ``dv`` value dim.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvlab.compression.solvers.linalg import FALLBACKS
from kvlab.compression.solvers.nnls import nnls, nnls_bias
from kvlab.compression.solvers.omp import omp_select
from kvlab.compression.solvers.scores import Scoring, scores_from_mass, select_highest_attn, shifted_exp, streamed_mass
from kvlab.compression.solvers.values import fit_values
from kvlab.runtime.attention import attention_logits

KeySelection = Literal["highest_attn", "omp"]
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
    ``highest_attn`` ranks by, or the caller's ``key_scores``; also filled for
    ``omp``, for display), or None;
    fallbacks: [B] long, the head's ridge solves that never factorised (each
    solved to 0 instead); nonfinite: [B] long, non-finite fitted values or
    biases found in the head and replaced (values by 0, biases by the lower
    bound). Both 0 for a fit that went as asked; never silent (the run's details).
    train_output, train_mass: [B] the stored block's relative attention-output
    error and mass error on the fit's own reference queries (unweighted means
    over them, as :func:`kvlab.metrics.block_errors` measures), or None.
    exact: [B, t] bool, the slots that hold exact keys (``exact_share``: their own
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
    exact_share: float = 0.0,
    exact_scores: torch.Tensor | None = None,
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

    ``exact_share`` s > 0 (``highest_attn`` only): each head's ``round(s * t_h)``
    best keys by ``exact_scores`` [B, T] (None: by what step 1 ranks the keys by)
    stay exact: their own key, value and bias, untouched by the fit (the first
    slots, flagged in ``CompactBlock.exact``). The other slots are compact keys,
    the best of the remaining keys, fitted only to what the exact keys leave
    unexplained: the mass fit's target is the block's mass minus the exact
    keys' own, and the values are fitted, under the softmax over every slot, to
    the block's output minus the exact keys' part of it (:func:`exact_first`).
    With s = 1 every slot is exact: eviction to the top ``t`` keys.

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
    if not 0.0 <= exact_share <= 1.0 or (exact_share > 0 and (key_selection != "highest_attn" or key_scores_share < 1.0)):
        raise ValueError(f"exact_share must be in [0, 1], and above 0 only with highest_attn selection and no "
                         f"key_scores union; got {exact_share} with {key_selection!r}, share {key_scores_share}")
    if exact_scores is not None and exact_scores.shape != (B, T):
        raise ValueError(f"exact_scores must be [B={B}, T={T}], got {tuple(exact_scores.shape)}")
    if beta_bounds is None:
        beta_bounds = (-3.0, 3.0) if key_selection == "highest_attn" else (
            -7.0 if drop_below is None else drop_below, 7.0)
    lo, hi = beta_bounds
    dev = q.device
    fallbacks = torch.zeros(B, dtype=torch.long, device=dev)
    counting = FALLBACKS.set(fallbacks)
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
            phi, shift = shifted_exp(q, k, bias, scale)
            z = phi.sum(dim=-1)
            # The block's own output is phi V / z (the max shift cancels): reusing phi
            # saves recomputing every logit, the largest cost of the whole fit.
            # z = 0 (a query that sees only padding) gives 0, as in mass_features, never NaN.
            y = torch.matmul(phi, v.float()) / z.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
            # Cheap next to the features; the app shows it as each token's importance.
            scores = scores_from_mass(phi, z, scoring, key_valid, query_weights)
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
        w_omp = slot_exact = None
        if key_selection == "omp":
            if root_w is not None:  # weighted least squares: each query's row times sqrt(w_i)
                phi.mul_(root_w.unsqueeze(-1))
            idx, w_omp = omp_select(phi, z if root_w is None else z * root_w, t, keys_per_iter, refit_every,
                                    drop_below, key_valid, omp_nnls_iters, ridge)
        elif exact_share > 0:
            idx, slot_exact = exact_first(scores, None if exact_scores is None else exact_scores.to(dev),
                                          lengths, t, exact_share, key_valid)
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
        fit_valid = slot_valid
        if slot_exact is not None:
            # The exact keys' own mass (their stored bias included) is part of the block's: the compact keys
            # fit the rest, and an exact slot keeps its bias.
            zw = (zw - (m_sel * slot_exact.unsqueeze(1)).sum(-1)).clamp_min(0.0)
            fit_valid = slot_valid & ~slot_exact
        if w_omp is None:
            design = m_sel if bias is None else m_sel * torch.exp(-old).unsqueeze(1)
            beta = (nnls_bias(design, zw, fit_valid, math.exp(lo), math.exp(hi), nnls_iters, ridge)
                    if bool(fit_valid.any()) else torch.full_like(old, float("-inf")))
            if slot_exact is not None:
                beta = torch.where(slot_exact, old, beta)
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
        lse_c = torch.logsumexp(logits, dim=-1)  # for the residuals
        # The softmax, in place; a head with no real slot (all -inf) or a non-finite key gives NaN: 0.
        x = logits.sub_(lse_c.unsqueeze(-1)).exp_().nan_to_num_(nan=0.0)
        del logits
        if value_fit == "original":
            cv = own.float()
        else:
            target, x_fit = y, x
            if slot_exact is not None:
                # The exact keys' part of the output (their own values, under the softmax over every slot)
                # is theirs: the compact values fit what it leaves, the residual of the attention output.
                x_exact = x * slot_exact.unsqueeze(1)
                target, x_fit = y - torch.bmm(x_exact, own.float()), x - x_exact
            if value_anchor > 0:
                # Anchored ridge: solve for the change from the own values (the prior's mean).
                target = target - torch.bmm(x_fit, own.float())
            lam, exact = (value_anchor, True) if value_anchor > 0 else (ridge, False)
            if root_w is not None:
                cv = fit_values(x_fit * root_w.unsqueeze(-1), target * root_w.unsqueeze(-1), fit_valid, lam, exact)
            else:
                cv = fit_values(x_fit, target, fit_valid, lam, exact)
            del target, x_fit
            if value_anchor > 0:
                cv = cv + own.float()
            if slot_exact is not None:
                cv = torch.where(slot_exact.unsqueeze(-1), own.float(), cv)
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
            exact=slot_exact,
        )
    finally:
        FALLBACKS.reset(counting)


def exact_first(
    scores: torch.Tensor, exact_scores: torch.Tensor | None, lengths: torch.Tensor, t: int, share: float,
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
