"""Expected Attention (Devoto, Jeblick, Jégou, 2025, "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution"; kvpress).

No attention matrix is computed. The context's queries (before RoPE) are
summarised by their mean mu and covariance Sigma per head; future queries are
assumed to follow that distribution at the next ``n_future_positions``
positions, whose RoPE rotations are averaged into one matrix R. For a
Gaussian query, E[exp(q.k / sqrt(d))] = exp(k.R mu / sqrt(d) + k^T R Sigma R^T k / (2d)),
so a key's expected attention is the softmax of that over the keys; it is
averaged over the query heads of the group and multiplied by ||v||, the
size of what the key would contribute. The first ``n_sink`` context tokens
are left out of the softmax and always kept (they are inside the template
prefix, which kvlab keeps anyway).

Follows kvpress's ExpectedAttentionPress (statistics from all context queries
but the sinks). kvlab records post-RoPE queries; the pre-RoPE ones are
recovered exactly by rotating back with the model's own RoPE tables
(kvlab.runtime.rope).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import pool_group, protect
from kvlab.compression.selection import SelectionOptions
from kvlab.runtime.attention import attention_weights, expand_kv_heads
from kvlab.runtime.model import LoadedModel
from kvlab.runtime.rope import rope_cos_sin, unrotate


@dataclass(frozen=True)
class ExpectedAttentionOptions(SelectionOptions):
    n_future_positions: int = knob(512, "future positions whose RoPE rotations are averaged", low=1)
    n_sink: int = knob(4, "first context tokens left out of the statistics and the softmax (always kept)", low=0)
    stats_window: int = knob(
        0, "estimate the query statistics from the last N context queries (0: all but the sinks, as kvpress)", low=0)
    use_covariance: bool = knob(True, "include the query covariance term")
    use_vnorm: bool = knob(True, "multiply the expected attention by ||v||")
    epsilon: float = knob(0.0, "added to the scores before the ||v|| rescaling", low=0.0)


def average_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[d, d] mean over positions of the RoPE matrices R (q_rot = R q), from cos, sin [n, d]."""
    d, device = cos.shape[-1], cos.device
    half = d // 2
    swap = torch.zeros(d, d, device=device)
    swap[half:, :half] = torch.eye(half, device=device)
    swap[:half, half:] = -torch.eye(half, device=device)
    eye = torch.eye(d, device=device)
    return (cos.unsqueeze(-1) * eye + sin.unsqueeze(-1) * swap).mean(dim=0)


def query_statistics(
    ctx_queries: torch.Tensor, lm: LoadedModel, length: int, opts: ExpectedAttentionOptions, layer: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean [H, d] and covariance [H, d, d] of future queries (post-RoPE, averaged over positions).

    ctx_queries: [H, N, d] the context's post-RoPE queries at positions 0..N-1
    of ``layer`` (whose own RoPE un-rotates and re-rotates them).
    """
    n = ctx_queries.shape[1]
    start = max(opts.n_sink, n - opts.stats_window) if opts.stats_window > 0 else opts.n_sink
    start = min(start, n - 1)
    cos, sin = rope_cos_sin(lm, torch.arange(start, n, device=lm.device), layer)
    q = unrotate(ctx_queries[:, start:].float(), cos, sin)
    mu = q.mean(dim=1)
    cov = None
    if opts.use_covariance:
        centred = q - mu.unsqueeze(1)
        cov = torch.einsum("hni,hnj->hij", centred, centred) / q.shape[1]
    future = torch.arange(length, length + opts.n_future_positions, device=lm.device)
    rot = average_rotation(*rope_cos_sin(lm, future, layer))
    mu = mu @ rot.T
    if cov is not None:
        cov = rot @ cov @ rot.T
    return mu, cov


def expected_attention_scores(req: Request, opts: ExpectedAttentionOptions) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc] expected attention (times ||v||); sinks in the document score +inf."""
    ctx, lm = req.ctx, req.ctx.lm
    sink = min(opts.n_sink, ctx.length - 1)
    out = []
    for layer, q in enumerate(ctx.queries["context"]):
        mu, cov = query_statistics(q, lm, ctx.length, opts, layer)
        keys = expand_kv_heads(ctx.full.keys[layer][:, sink:].float(), q.shape[0])  # [H, T', d]
        scale = lm.geometry[layer].scaling  # 1/sqrt(d) but for e.g. Gemma 3's query_pre_attn_scalar
        quad = None
        if cov is not None:  # E[exp(s q.k)] for a Gaussian q: exp(s k.mu + s^2 k^T Sigma k / 2)
            quad = torch.einsum("htd,hde,hte->ht", keys, cov, keys) * scale**2 / 2
        weights = attention_weights(mu.unsqueeze(1), keys, bias=quad, scale=scale)[:, 0]  # [H, T']
        score = pool_group(weights, lm.n_kv_heads, "mean")
        if opts.use_vnorm:
            score = (score + opts.epsilon) * ctx.full.values[layer][:, sink:].float().norm(dim=-1)
        # Back to document coordinates; document tokens that are sinks are kept.
        doc_sinks = max(0, sink - ctx.prefix_len)
        score = torch.cat([score.new_zeros(score.shape[0], doc_sinks), score[:, max(0, ctx.prefix_len - sink) :]], dim=1)
        out.append(protect(score, slice(0, doc_sinks)))
    return out


@register
class ExpectedAttention(EvictionMethod):
    name = "expected_attention"
    summary = "attention expected from future queries (mean + covariance of the context's queries, averaged RoPE) x ||v||"
    learn = (
        "Estimates the attention future queries will pay, without computing any attention matrix. The "
        "context's queries are summarised per head by their mean $\\mu$ and covariance $\\Sigma$; with "
        "$\\bar R$ the RoPE rotation averaged over the next `n_future_positions` positions, a Gaussian query gives "
        "$$\\hat a_j\\propto\\exp\\!\\Big(\\tfrac{k_j^\\top\\bar R\\mu}{\\sqrt d}+"
        "\\tfrac{k_j^\\top\\bar R\\Sigma\\bar R^\\top k_j}{2d}\\Big),\\qquad s_j=\\hat a_j\\,\\lVert v_j\\rVert$$ "
        "(softmax over the keys, times the size of what the key would contribute)."
    )
    paper = Paper(
        "Devoto, Jeblick, Jégou", 2025,
        "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution",
        arxiv="2510.00636")
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = ExpectedAttentionOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return expected_attention_scores(req, self.options)
