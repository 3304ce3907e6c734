"""The scores several methods share, and the maths under them: one place, so that no method imports
another.

Each scorer gives, per layer, [H_kv, T_doc] scores of the document tokens (higher = keep); the
method files say where each comes from and what differs from the paper's code. KVzip's
reconstruction attention (kvzip, kvzip_plus, Attention Matching's key choice), SnapKV's window
attention (snapkv, snapkv_question, pyramidkv), H2O's heavy hitters (h2o, observed_attention, cam),
StreamingLLM's recency (streaming_llm, simlayerkv), Expected Attention's query statistics
(expected_attention, capkv), leverage and non-causal attention (leverage, non_causal_attn,
compactor), and KNorm's and TOVA's scores, which the merging family's ``scorer`` knob names
(kvlab.methods.families.merging_core). The options a shared scorer reads live here with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvlab.compression.options import MethodError, knob
from kvlab.compression.request import Request
from kvlab.compression.scoring import pool_group, protect, received_attention
from kvlab.compression.selection import SelectionOptions
from kvlab.context import Memo
from kvlab.prompts import REPEAT_INSTRUCTION
from kvlab.queries import question_queries, repeat_pass
from kvlab.runtime.attention import attention_weights, expand_kv_heads
from kvlab.runtime.model import LoadedModel
from kvlab.runtime.rope import rope_cos_sin, unrotate

# --------------------------------------------------------------------------- KVzip: reconstruction attention


@dataclass(frozen=True)
class KVzipOptions(SelectionOptions):
    prune: Literal["global", "layer", "head"] = knob(
        "global", "global (across all layers and heads, ragged), layer (across the heads of each layer), head (uniform)"
    )
    n_sink: int = knob(4, "first context tokens in every reconstruction softmax (never evicted)", low=0)
    instruction: str = knob(REPEAT_INSTRUCTION, "the reconstruction prompt read after the document")


@dataclass(frozen=True)
class KVzipScores(Memo):
    """Where :func:`kvzip_scores` keeps its scores: the knobs they depend on (not ``prune``, so every
    pruning reads the same scores)."""

    n_sink: int
    instruction: str


def kvzip_scores(req: Request, opts: KVzipOptions) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: max attention from the reconstruction queries and the group's heads."""
    ctx = req.ctx
    sink = min(opts.n_sink, ctx.prefix_len)

    def make() -> list[torch.Tensor]:
        recon = repeat_pass(ctx, opts.instruction)
        out = []
        for layer, (q, k_own) in enumerate(zip(recon.queries, recon.keys)):
            keys = ctx.full.keys[layer]
            if ctx.full.window(layer) is not None:
                # A sliding-window layer keeps its window whatever its scores (and its working
                # cache held only the window, not the repeat's own keys in order): none needed.
                out.append(torch.zeros(keys.shape[0], ctx.doc_len, device=keys.device))
                continue
            # Sinks, document, reconstruction: the queries are the last n of these keys.
            keys = torch.cat([keys[:, :sink], keys[:, ctx.prefix_len :], k_own], dim=1)
            received = received_attention(q, keys, reduce="max", causal=True, scale=ctx.lm.geometry[layer].scaling)
            # Without a template prefix the sinks are the document's first tokens: never evicted.
            doc_sinks = max(0, opts.n_sink - ctx.prefix_len)
            scored = pool_group(received, ctx.lm.n_kv_heads, "max")[:, sink : sink + ctx.doc_len]
            out.append(protect(scored, slice(0, doc_sinks)))
        return out

    return ctx.cached(KVzipScores(opts.n_sink, opts.instruction), make)


# --------------------------------------------------------------------------- SnapKV: window attention


@dataclass(frozen=True)
class SnapKVOptions(SelectionOptions):
    window: int = knob(64, "observation window: the last queries of the document", low=1)
    # Odd, as in SnapKV's code: padding kernel // 2 on both sides keeps one score per token.
    kernel: int = knob(5, "1-D average-pooling kernel over token scores (odd: centred on each token)", low=1, odd=True)


def pooled_window_scores(
    queries: torch.Tensor, keys: torch.Tensor, kernel: int, causal: bool, drop_last: int = 0, scale: float | None = None
) -> torch.Tensor:
    """Mean attention from a query window, pooled along the tokens.

    queries: [H, w, d], keys: [H_kv, T, d] -> [H_kv, T - drop_last]; scale:
    the layer's own (None: 1/sqrt(d)). The
    softmax runs over all T keys; the last ``drop_last`` columns (the window's
    own tokens, kept anyway) are cut before pooling, as SnapKV does, so they
    do not leak into their neighbours' scores.
    """
    n_heads, n_kv = queries.shape[0], keys.shape[0]
    weights = attention_weights(queries, expand_kv_heads(keys, n_heads), scale=scale, causal=causal)
    per_head = weights.mean(dim=1)[:, : keys.shape[1] - drop_last]
    if per_head.shape[1] == 0:  # the window is the whole context: nothing left to pool
        return per_head.reshape(n_kv, n_heads // n_kv, 0).mean(dim=1)
    pooled = F.avg_pool1d(per_head.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
    return pooled.reshape(n_kv, n_heads // n_kv, -1).mean(dim=1)


def snap_scores(req: Request, window: int, kernel: int, from_question: bool) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc] SnapKV scores; the window's own tokens score +inf."""
    ctx = req.ctx
    if from_question and not req.question:
        raise MethodError("query-aware SnapKV needs a question")
    window = min(window, ctx.doc_len)
    sources = question_queries(ctx, req.question) if from_question else ctx.queries["context"]
    out = []
    for layer, q in enumerate(sources):
        keys, scale = ctx.full.keys[layer], ctx.lm.geometry[layer].scaling
        if from_question:
            score = pooled_window_scores(q, keys, kernel, causal=False, scale=scale)[:, ctx.prefix_len :]
        else:
            cut = pooled_window_scores(q[:, -window:], keys, kernel, causal=True, drop_last=window, scale=scale)
            score = torch.cat(
                [cut[:, ctx.prefix_len :], torch.full((keys.shape[0], window), float("inf"), device=cut.device)], dim=1
            )
        out.append(score)
    return out


# --------------------------------------------------------------------------- H2O: heavy hitters

#: H2O's share of each head's budget kept as the most recent tokens by default (the paper's 0.5).
H2O_RECENT_SHARE = 0.5


def received_per_group(
    q: torch.Tensor, keys: torch.Tensor, n_kv: int, scale: float, seen_by: torch.Tensor | None = None
) -> torch.Tensor:
    """[H_kv, L]: the attention each key of ``keys`` [H_kv, L, d] received from the queries ``q``
    [H, n, d] (the last n positions, causal), summed over the queries, divided by ``seen_by`` [L]
    when given, averaged over the query heads of each KV head's group."""
    received = received_attention(q, keys, reduce="sum", causal=True, scale=scale)
    return pool_group(received if seen_by is None else received / seen_by, n_kv, "mean")


def protect_recent(score: torch.Tensor, share: float, budget: int) -> torch.Tensor:
    """Keep the ``round(share * budget)`` most recent keys (at most all L) of ``score`` [H_kv, L]:
    +inf, in place; returns ``score``."""
    recent = min(round(share * budget), score.shape[-1])
    if recent:
        protect(score, slice(score.shape[-1] - recent, None))
    return score


@dataclass(frozen=True)
class H2OScores(Memo):
    """Where :func:`h2o_scores` keeps its scores (they depend on the document alone)."""


def h2o_scores(req: Request) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: mean attention received from the queries that can see each key."""
    ctx = req.ctx

    def make() -> list[torch.Tensor]:
        # Key j is seen by queries j..N-1.
        seen_by = torch.arange(ctx.length, 0, -1, dtype=torch.float32, device=ctx.lm.device)
        return [
            received_per_group(q, ctx.full.keys[layer], ctx.lm.n_kv_heads, ctx.lm.geometry[layer].scaling, seen_by)[
                :, ctx.prefix_len :
            ]
            for layer, q in enumerate(ctx.queries["context"])
        ]

    return ctx.cached(H2OScores(), make)


def h2o_recent_scores(req: Request, recent_share: float) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: :func:`h2o_scores` with the most recent ``recent_share`` of the
    request's budget protected (+inf): heavy hitters plus a recent window, at the request's ratio."""
    return [protect_recent(score.clone(), recent_share, req.doc_budget) for score in h2o_scores(req)]


# --------------------------------------------------------------------------- StreamingLLM: recency

#: StreamingLLM's attention sinks by default (its ``n_sink``).
N_SINK = 4


def sink_window_scores(length: int, n_sink: int, device: torch.device | str) -> torch.Tensor:
    """StreamingLLM's keep rule as scores [length]: recency (the position) for every token, +inf for
    the first ``n_sink`` (the attention sinks); a budget's top-k keeps the sinks and the most recent."""
    score = torch.arange(length, dtype=torch.float32, device=device)
    score[:n_sink] = float("inf")
    return score


def recency_scores(req: Request, n_sink: int) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: the position (recency), the context's first ``n_sink`` tokens +inf."""
    ctx = req.ctx
    # Recency is the score; the sinks are the context's first tokens, which
    # the template prefix usually already holds.
    score = sink_window_scores(ctx.doc_len, max(0, n_sink - ctx.prefix_len), ctx.lm.device)
    return [score.expand(ctx.lm.n_kv_heads, -1) for _ in range(ctx.lm.n_layers)]


# --------------------------------------------------------------------------- KNorm and TOVA


def knorm_scores(req: Request) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: minus each document key's L2 norm."""
    ctx = req.ctx
    return [-keys[:, ctx.prefix_len :].float().norm(dim=-1) for keys in ctx.full.keys]


def tova_scores(req: Request) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: the last context query's attention, mean over all query heads."""
    ctx = req.ctx
    out = []
    for layer, q in enumerate(ctx.queries["context"]):
        keys = expand_kv_heads(ctx.full.keys[layer], q.shape[0])
        # The last token sees every key: no causal mask needed.
        weights = attention_weights(q[:, -1:], keys, scale=ctx.lm.geometry[layer].scaling)[:, 0]  # [H, T]
        score = weights.mean(dim=0)[ctx.prefix_len :].clone()
        protect(score, slice(ctx.doc_len - 1, None))
        out.append(score.expand(ctx.lm.n_kv_heads, -1))
    return out


# --------------------------------------------------------------------------- Expected Attention: query statistics


@dataclass(frozen=True)
class ExpectedAttentionOptions(SelectionOptions):
    n_future_positions: int = knob(512, "future positions whose RoPE rotations are averaged", low=1)
    n_sink: int = knob(4, "first context tokens left out of the statistics and the softmax (always kept)", low=0)
    stats_window: int = knob(
        0, "estimate the query statistics from the last N context queries (0: all but the sinks, as kvpress)", low=0
    )
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
        score = torch.cat(
            [score.new_zeros(score.shape[0], doc_sinks), score[:, max(0, ctx.prefix_len - sink) :]], dim=1
        )
        out.append(protect(score, slice(0, doc_sinks)))
    return out


# ---------------------------------------------------------------- Compactor's halves: leverage, non-causal attention

#: Ridge added to the sketched Gram matrix: kvpress's first Cholesky jitter.
RIDGE = 1e-2
#: Tokens of the average pooling over the non-causal scores (kvpress's kernel_size=3, padding 1).
POOL = 3


def gaussian_sketches(seed: int, n_layers: int, n_kv_heads: int, head_dim: int, k: int) -> list[torch.Tensor]:
    """Per layer [H_kv, d, k] float32 sketches with N(0, 1/k) entries, on the CPU (moved where used)."""
    # Drawn on the CPU on purpose: a seeded CPU generator gives the same sketch on every device.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(n_kv_heads, head_dim, k, generator=gen, device="cpu") / math.sqrt(k) for _ in range(n_layers)]


def leverage(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """Approximate leverage of each key: [H, N, d] pre-RoPE keys, [H, d, k] sketch -> [H, N] float32."""
    x = keys.float() - keys.float().mean(dim=1, keepdim=True)
    y = x @ sketch.to(x.device)  # [H, N, k]
    gram = y.transpose(1, 2) @ y + RIDGE * torch.eye(y.shape[-1], device=y.device)
    solved = torch.linalg.solve(gram, y.transpose(1, 2))  # (Y^T Y + lambda I)^{-1} Y^T: [H, k, N]
    return (y * solved.transpose(1, 2)).sum(dim=-1).clamp_min(0)


def z_score(scores: torch.Tensor) -> torch.Tensor:
    """(s - mean) / std over the whole layer [H, N] (kvpress's normalisation; std floored at 1e-6)."""
    return (scores - scores.mean()) / scores.std().clamp_min(1e-6)


def pre_rope_keys(req: Request, layer: int) -> torch.Tensor:
    """[H_kv, N, d] float32: the context's keys of ``layer`` rotated back to before RoPE."""
    ctx = req.ctx
    cos, sin = rope_cos_sin(ctx.lm, torch.arange(ctx.length, device=ctx.lm.device), layer)
    return unrotate(ctx.full.keys[layer].float(), cos, sin)


def chunk_attention(queries: torch.Tensor, keys: torch.Tensor, chunk_size: int, scale: float) -> torch.Tensor:
    """Attention each key receives from the queries of its chunk, non-causal, summed over them.

    queries: [H, N, d], keys: [H_kv, N, d] (the same N tokens) -> [H, N] float32.
    """
    n_heads, n = queries.shape[0], queries.shape[1]
    out = torch.empty(n_heads, n, device=keys.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        k = expand_kv_heads(keys[:, start:end].float(), n_heads)
        out[:, start:end] = attention_weights(queries[:, start:end].float(), k, scale=scale).sum(dim=1)
    return out


def non_causal_layer(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk_size: int, scale: float
) -> torch.Tensor:
    """One layer's scores before the z-score: [H, N, d] queries, [H_kv, N, d] keys and values -> [H_kv, N]."""
    received = pool_group(chunk_attention(queries, keys, chunk_size, scale), keys.shape[0], "mean")
    weighted = received * values.float().norm(dim=-1)
    return F.avg_pool1d(weighted.unsqueeze(1), POOL, stride=1, padding=POOL // 2).squeeze(1)
