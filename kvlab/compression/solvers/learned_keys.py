"""KVSculpt's learned keys (Jiang, Jin, 2026, "KVSculpt: KV Cache Compression as Distillation").

Attention Matching (compact.py) keeps a *subset* of a block's original keys; KVSculpt lets each of a
head's ``t`` compact keys be any vector and moves them by L-BFGS (``torch.optim.LBFGS``) to reproduce
the block's attention for the reference queries. The values are never moved by gradient: as the
paper does, a few L-BFGS iterations on the keys alternate with the closed-form least squares of the
values for the current keys (values.py's :func:`fit_values`, Attention Matching's value fit). A value
solve costs ``n t^2`` (the attention's Gram), a key step ``n t d``: solving the values at every
evaluation instead (variable projection) would multiply the cost of the heads the pilot gives many
more keys than the key dim ``d``.

The objective of one head (:func:`objective`), with ``x_i = softmax(scale q_i C^T + beta)`` the
query's attention over the compact keys ``C`` [t, d], ``beta`` [t] fixed biases, ``V`` [t, dv] the
values of the last solve, ``y_i`` and ``lse_i`` the block's own output and log-mass, ``w_i`` the
query weights:

    f(C) = sum_i w_i ||x_i V - y_i||^2 / sum_i w_i ||y_i||^2
           + mass_weight * sum_i w_i (log sum_j exp(scale q_i.c_j + beta_j) - lse_i)^2 / sum_i w_i

the relative output error and the log-mass error (the mass the block contributes next to the other
tokens' keys, which the output alone leaves free: adding a constant to a query's logits keeps its
softmax; ``mass_weight = 0``: outputs only). Both a key step (line search) and a value solve lower
f, so the alternation never raises it.

Every function works on one head (the L-BFGS problem of a head: heads never share a line search)
except :func:`block_targets` and :func:`output_mse`, batched over a layer's ``B`` heads. The
objective keeps its inputs' dtype (float64 for the gradient checks); the method passes float32
whatever the model's dtype. Shapes: ``n`` reference queries, ``T`` original keys, ``t`` compact
keys, ``d`` key dim, ``dv`` value dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.compression.solvers.compact import compact_attention, fit_residuals
from kvlab.compression.solvers.scores import streamed_mass
from kvlab.compression.solvers.values import fit_values
from kvlab.runtime.attention import matmul


@dataclass(frozen=True)
class Targets:
    """What a block's compact keys must reproduce for its reference queries: ``output`` [..., n, dv]
    the block's attention output and ``lse`` [..., n] its log-mass (per head, or batched)."""

    output: torch.Tensor
    lse: torch.Tensor


def block_targets(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float | None
) -> Targets:
    """The block's attention for its queries, a chunk of queries at a time (Attention Matching's
    :func:`streamed_mass`): q [B, n, d], k [B, T, d], v [B, T, dv], bias [B, T] or None -> Targets
    (output [B, n, dv], lse [B, n]) in float32."""
    shift, z, y, _ = streamed_mass(q, k, v, bias, scale, scoring=None)
    return Targets(y, shift + z.log())


def output_mse(
    q: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    values: torch.Tensor,
    targets: Targets,
    scale: float,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each head's mean squared attention-output error of a compact block: [B] float32.

    q: [B, n, d]; keys [B, t, d], bias [B, t] (``-inf`` on padding slots), values [B, t, dv] the
    compact block; targets: the original block's (:func:`block_targets`); weights [B, n] each
    query's weight (None: 1). The pilot fit's difficulty per head (absolute, not relative: a head
    whose output is small costs the model little however badly it is fitted)."""
    x, _ = compact_attention(q, keys, bias.float(), scale)
    err = (matmul(x, values.float()) - targets.output).square().sum(-1)  # [B, n]
    w = torch.ones_like(err) if weights is None else weights.float()
    return (w * err).sum(-1) / w.sum(-1).clamp_min(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class HeadProblem:
    """One head's learned-key problem: q [n, d] its reference queries, beta [t] the compact keys'
    fixed biases, targets (output [n, dv], lse [n]), root_w [n] the square roots of the queries'
    weights (None: 1), scale on q.k, ridge (relative, as linalg.py's), mass_weight (see the module)."""

    q: torch.Tensor
    beta: torch.Tensor
    targets: Targets
    root_w: torch.Tensor | None
    scale: float
    ridge: float
    mass_weight: float


def head_values(keys: torch.Tensor, problem: HeadProblem) -> torch.Tensor:
    """The closed-form values [t, dv] (float32) for ``keys`` [t, d]: Attention Matching's least squares
    ``argmin_V sum_i w_i ||x_i V - y_i||^2`` (values.py's :func:`fit_values`, at the problem's ridge)."""
    with torch.no_grad():
        x, _ = attention(keys.detach(), problem)
        xw, yw = weighted(x, problem), weighted(problem.targets.output.to(x.dtype), problem)
        return fit_values(xw.unsqueeze(0), yw.unsqueeze(0), None, problem.ridge)[0]


def weighted(rows: torch.Tensor, problem: HeadProblem) -> torch.Tensor:
    """``rows`` [n, c] times each query's root weight (as is when unweighted)."""
    return rows if problem.root_w is None else rows * problem.root_w.to(rows.dtype).unsqueeze(-1)


def attention(keys: torch.Tensor, problem: HeadProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [n, t], lse [n]): the queries' attention over ``keys`` [t, d] with the fixed biases, and its
    log-mass. Written here rather than through kvlab.runtime.attention.attention_logits, which computes
    in float32 for the runtime's masses: this one must be differentiable in the caller's dtype. One
    exponential serves both (a softmax and a logsumexp would take one each, and one more backward)."""
    logits = torch.addmm(
        problem.beta.to(keys.dtype).unsqueeze(0), problem.q.to(keys.dtype), keys.T, alpha=problem.scale
    )
    top = logits.detach().amax(dim=-1, keepdim=True)  # the shift cancels in both: no gradient through it
    weights = torch.exp(logits - top)
    total = weights.sum(dim=-1, keepdim=True)
    return weights / total, (top + total.log()).squeeze(-1)


def objective(keys: torch.Tensor, values: torch.Tensor, problem: HeadProblem) -> torch.Tensor:
    """f(keys) as in the module docstring, a scalar, for the fixed ``values`` [t, dv]; differentiable
    in ``keys`` [t, d], in their dtype."""
    x, lse = attention(keys, problem)
    xw, yw = weighted(x, problem), weighted(problem.targets.output.to(x.dtype), problem)
    residual = (xw @ values.to(x.dtype) - yw).square().sum()
    output = residual / yw.square().sum().clamp_min(torch.finfo(x.dtype).tiny)
    if problem.mass_weight == 0:
        return output
    w = torch.ones_like(lse) if problem.root_w is None else problem.root_w.to(lse.dtype).square()
    mass = (w * (lse - problem.targets.lse.to(lse.dtype)).square()).sum() / w.sum()
    return output + problem.mass_weight * mass


def alternate(
    start: torch.Tensor, problem: HeadProblem, iterations: int, every: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [t, d], values [t, dv]), float32: from ``start``, ``iterations`` L-BFGS iterations on the
    keys (strong Wolfe line search), the values solved again every ``every`` of them and at the end
    (:func:`head_values`; one L-BFGS run throughout, its curvature pairs kept across the solves). The
    start and its values where the end is no lower on f (a non-finite objective included)."""
    learned = start.detach().float().clone().requires_grad_(True)
    optimiser = torch.optim.LBFGS([learned], max_iter=every, line_search_fn="strong_wolfe")
    values = begin_values = head_values(learned, problem)
    begin = float(objective(learned.detach(), values, problem))
    done = 0
    while done < iterations:
        steps = min(every, iterations - done)
        optimiser.param_groups[0].update(max_iter=steps, max_eval=steps * 5 // 4)

        def closure(values: torch.Tensor = values) -> torch.Tensor:
            optimiser.zero_grad()
            loss = objective(learned, values, problem)
            loss.backward()
            return loss

        with torch.enable_grad():
            optimiser.step(closure)
        done += steps
        values = head_values(learned, problem)
    end = float(objective(learned.detach(), values, problem))
    if end <= begin:
        return learned.detach(), values
    return start.detach().float(), begin_values


@dataclass(frozen=True)
class LearnedHead:
    """One head's result: keys [t, d] and values [t, dv] (float32), and its errors on its own
    reference queries, output and mass (as :func:`kvlab.compression.solvers.compact.fit_residuals`)."""

    keys: torch.Tensor
    values: torch.Tensor
    train_output: torch.Tensor
    train_mass: torch.Tensor


def sculpt_head(start: torch.Tensor, problem: HeadProblem, iterations: int, every: int) -> LearnedHead:
    """One head's compact keys and values learned from ``start`` [t, d] (:func:`alternate`; with no
    iteration, the start's keys and their least-squares values), and their errors. Runs outside any
    inference mode of the caller's (the lab compresses in one): autograd records the key steps."""
    with torch.inference_mode(False):
        problem = recordable(problem)
        keys, values = alternate(start, problem, iterations, every)
        with torch.no_grad():
            x, lse = attention(keys, problem)
            out, mass = fit_residuals(x.unsqueeze(0), lse.unsqueeze(0), values.unsqueeze(0), *_batched(problem.targets))
    return LearnedHead(keys, values, out[0], mass[0])


def recordable(problem: HeadProblem) -> HeadProblem:
    """``problem`` with tensors autograd may save for a backward pass: those made in inference mode
    (inference tensors, which autograd refuses) cloned, the others as they are. Call outside
    inference mode (a clone made inside one is an inference tensor again)."""
    targets = Targets(trainable(problem.targets.output), trainable(problem.targets.lse))
    return dataclasses.replace(
        problem, q=trainable(problem.q), beta=trainable(problem.beta), targets=targets, root_w=trainable(problem.root_w)
    )


def trainable(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as autograd may save it: an inference tensor (made in inference mode, which autograd refuses)
    copied, any other tensor (or None) as it is. Call outside inference mode."""
    return t.clone() if t is not None and t.is_inference() else t


def _batched(targets: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's targets as a batch of one, as :func:`fit_residuals` takes them."""
    return targets.output.unsqueeze(0), targets.lse.unsqueeze(0)
