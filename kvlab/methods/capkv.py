"""CapKV (Yang, Tang, Zhen, Lv, 2026, "Rethinking KV Cache Eviction via a Unified Information-Theoretic
Objective", arXiv 2604.25975; kvpress's CapPress): keep the tokens that add most capacity.

The paper treats the kept cache as a design whose information is log det A, with
A = I + sum_i w_i u_i u_i^T over the tokens i (u_i the direction token i writes to the
output, w_i how strongly future queries read it). A token's marginal gain of log det is, to
first order, its weighted leverage s_i = w_i u_i^T A^{-1} u_i, the score. As kvpress's press:
u_i = v_i (the value as the output-direction proxy); w_i = exp(tau <k_i, mu_q>) with mu_q the
mean of the context's queries (all but the first ``n_sink``) rotated by the RoPE rotation
averaged over the next ``n_future_positions`` positions (Expected Attention's query mean), the
keys and the anchor L2-normalised and the exponent shifted by its maximum over the head's
tokens (kvpress's numerical choices: the paper's dot products are unnormalised), and
A = I + sum_i (w_i + epsilon) v_i v_i^T, one [d, d] matrix per query head, over every context
token but the sinks; scores averaged over each KV head's group; the sinks are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import pool_group, protect
from kvlab.compression.selection import SelectionOptions
from kvlab.methods.families.scorers import ExpectedAttentionOptions, query_statistics
from kvlab.runtime.attention import expand_kv_heads


@dataclass(frozen=True)
class CapKVOptions(SelectionOptions):
    tau: float = knob(5.0, "temperature of the query-key alignment weights w = exp(tau cos(k, mu_q))", low=0.0)
    n_future_positions: int = knob(512, "future positions whose RoPE rotations are averaged for the anchor", low=1)
    n_sink: int = knob(4, "first context tokens kept and left out of the scoring", low=0)
    epsilon: float = knob(1e-6, "added to the weights inside the capacity matrix", low=0.0)


def capacity_scores(
    anchor: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tau: float, epsilon: float
) -> torch.Tensor:
    """w_i v_i^T A^{-1} v_i per query head: anchor [H, d], keys and values [H, T, d] -> [H, T] float32."""
    cos = torch.einsum("hd,htd->ht", F.normalize(anchor.float(), dim=-1), F.normalize(keys.float(), dim=-1))
    logits = tau * cos.clamp(-1.0, 1.0)
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    v = values.float()
    eye = torch.eye(v.shape[-1], device=v.device)
    capacity = eye + torch.einsum("ht,htd,hte->hde", weights + epsilon, v, v)
    # A is symmetric positive definite by construction (I plus a weighted Gram): a Cholesky solve, the
    # small [H, d, d] factor in float64, the [H, d, T] solve in float32 (its memory is the method's peak).
    # An LU solve (torch.linalg.solve) failed on Gemma 3's values once in the full suite ("pivots given
    # to lu_solve"), never alone; the cause was not found.
    factor = torch.linalg.cholesky_ex(capacity.double())[0].float()
    solved = torch.cholesky_solve(v.transpose(1, 2), factor)  # A^{-1} v_i: [H, d, T]
    return weights * (v * solved.transpose(1, 2)).sum(dim=-1)


def capkv_scores(req: Request, opts: CapKVOptions) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc] CapKV scores; document tokens among the sinks score +inf."""
    ctx, lm = req.ctx, req.ctx.lm
    sink = min(opts.n_sink, ctx.length - 1)
    stats = ExpectedAttentionOptions(n_future_positions=opts.n_future_positions, n_sink=sink, use_covariance=False)
    out = []
    for layer, q in enumerate(ctx.queries["context"]):
        if ctx.full.window(layer) is not None:  # a sliding-window layer keeps its window whatever its scores
            out.append(torch.zeros(lm.n_kv_heads, ctx.doc_len, device=lm.device))
            continue
        anchor, _ = query_statistics(q, lm, ctx.length, stats, layer)  # [H, d]
        keys = expand_kv_heads(ctx.full.keys[layer][:, sink:], q.shape[0])
        values = expand_kv_heads(ctx.full.values[layer][:, sink:], q.shape[0])
        score = pool_group(capacity_scores(anchor, keys, values, opts.tau, opts.epsilon), lm.n_kv_heads, "mean")
        doc_sinks = max(0, sink - ctx.prefix_len)
        score = torch.cat(
            [score.new_zeros(score.shape[0], doc_sinks), score[:, max(0, ctx.prefix_len - sink) :]], dim=1
        )
        out.append(protect(score, slice(0, doc_sinks)))
    return out


@register
class CapKV(EvictionMethod):
    name = "capkv"
    summary = "log-det capacity: query-weighted leverage of the values, w_i v_i^T A^-1 v_i (A = I + sum w v v^T)"
    paper = Paper(
        "Yang, Tang, Zhen, Lv",
        2026,
        "Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective",
        arxiv="2604.25975",
        note="CapKV",
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = CapKVOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return capkv_scores(req, self.options)
