"""CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference from an
Output Perturbation Perspective", arXiv 2502.03805): scores reweighted by what a
value would add to the layer's output.

A wrapper over any scoring method (``critical=true``). A kept token changes the
attention output by its attention weight times its value, and the layer's
output by that times the output projection W_o; so, in two stages (the
paper's and kvpress's CriticalKVPress):

1. each head keeps its top ``first_stage_ratio`` share of its budget (default
   0.5) by the method's own scores;
2. the rest of the budget goes to the best of
   ``(s_j + critical_epsilon) * || v_j W_o^(h) ||_1``, the L1 norm of the value
   projected through the head's slice of W_o, averaged over the query heads
   of the KV head's group (default epsilon 1e-4).

With Expected Attention, whose scores already carry ||v||, kvpress advises
``use_vnorm=false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.compression.budget_profiles import HeadBudgets
from kvlab.compression.options import knob
from kvlab.compression.request import Request
from kvlab.compression.scoring import BLOCK_ELEMENTS, pool_group
from kvlab.compression.stage import Stage
from kvlab.runtime.attention import output_projection


def projected_value_norm(
    values: torch.Tensor, o_weight: torch.Tensor, block_elements: int = BLOCK_ELEMENTS
) -> torch.Tensor:
    """|| v_j W_o^(h) ||_1 per token, mean over each KV head's query-head group.

    values: [H_kv, T, d]; o_weight: the output projection's weight [hidden, H * d]
    (query head h reads columns h*d..(h+1)*d) -> [H_kv, T] float32. Computed per
    query head in blocks of tokens of at most ``block_elements`` outputs.
    """
    n_kv, length, d = values.shape
    hidden = o_weight.shape[0]
    n_heads = o_weight.shape[1] // d
    group = n_heads // n_kv
    rows = max(1, block_elements // hidden)
    out = torch.empty(n_heads, length, device=values.device)
    for h in range(n_heads):
        w = o_weight[:, h * d : (h + 1) * d].detach().float()  # [hidden, d]; no autograd through the weights
        v = values[h // group]
        for start in range(0, length, rows):
            out[h, start : start + rows] = (v[start : start + rows].float() @ w.T).abs().sum(dim=-1)
    return pool_group(out, n_kv, "mean")


def critical_scores(
    scores: torch.Tensor, projected: torch.Tensor, budgets: torch.Tensor, first_stage_ratio: float, epsilon: float
) -> torch.Tensor:
    """One layer's two-stage CriticalKV scores.

    scores: [H_kv, T] the method's; projected: [H_kv, T] (:func:`projected_value_norm`);
    budgets: [H_kv] tokens each head keeps -> [H_kv, T]: each head's first-stage
    picks (its top ``int(first_stage_ratio * budget)``) and the method's
    protected tokens at +inf, the others ``(s + epsilon) * projected``.
    """
    scores = scores.float()
    out = torch.where(torch.isinf(scores), scores, (scores + epsilon) * projected)
    first = (budgets.to(scores.device).double() * first_stage_ratio).long()
    width = int(first.max())
    if width > 0:
        top = torch.topk(scores, width, dim=-1).indices
        mine = torch.arange(width, device=scores.device).unsqueeze(0) < first.unsqueeze(1)
        out.scatter_(-1, top, torch.where(mine, float("inf"), out.gather(-1, top)))
    return out


@dataclass(frozen=True)
class CriticalKnobs:
    """CriticalKV's knobs (:func:`reweight`); on with ``critical=true``."""

    critical: bool = knob(
        False, "CriticalKV: after a first stage by the method's scores, reweight by the value's norm through o_proj"
    )
    first_stage_ratio: float = knob(
        0.5, "critical: share of each head's budget chosen by the method's own scores", low=0.0, high=1.0
    )
    critical_epsilon: float = knob(1e-4, "critical: added to the scores before the reweighting", low=0.0)


def reweight(
    req: Request, scores: list[torch.Tensor], head: HeadBudgets, opts: Any
) -> tuple[list[torch.Tensor], HeadBudgets]:
    """Per layer [H_kv, T_doc] scores -> :func:`critical_scores` with each head's budget in ``head``
    (the allocation's, the stages before this one having run) and the document's values through the
    layer's o_proj; the budgets as they are."""
    ctx = req.ctx
    return [
        critical_scores(
            s,
            projected_value_norm(ctx.full.values[i][:, ctx.prefix_len :], output_projection(ctx.lm.model, i)),
            head.budgets[i],
            opts.first_stage_ratio,
            opts.critical_epsilon,
        )
        for i, s in enumerate(scores)
    ], head


STAGE = Stage(
    name="criticalkv", order=30, knobs=CriticalKnobs, preset={"critical": True}, scores=reweight, records=("critical",)
)
