"""Attention Matching (Zweiger, Fu, Guo, Kim, 2026, "Fast KV Compaction via Attention Matching").

Each KV head's document block is replaced by t compact keys (a subset of the
original keys, RoPE phases kept), one bias beta per key and refitted values,
chosen in closed form so that, for reference queries, the block's attention
output and attention mass are preserved (kvlab.methods.solvers). The
chat-template prefix stays as it is.

PRESETS holds the published configurations under the public code's names.
The defaults are ``AM-HighestAttnKeys-basic`` (HighestAttnKeys, not
on-policy): on-policy fitting reads the document once more per layer, which
on a CPU multiplies the compression time by the number of layers, for what
the paper reports as a small gain.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvlab.kernels import dispatch as kernels
from kvlab.cancel import checkpoint
from kvlab.context import Context
from kvlab.methods.base import EvictionMethod, Method, MethodError, Options, Request, knob, register
from kvlab.methods.budgets import head_budgets
from kvlab.methods.kvzip import KVzipOptions, kvzip_scores
from kvlab.methods.solvers import CompactBlock, compact_block
from kvlab.metrics import block_attention, block_errors
from kvlab.prompts import question_tokens, repeat_tokens
from kvlab.queries import (
    context_queries,
    question_queries,
    random_queries,
    read_after,
    repeat_queries,
    self_study_queries,
)
from kvlab.runtime.attention import group_queries
from kvlab.runtime.cache import (
    CompressedKV,
    DenseSegment,
    PaddedView,
    Segment,
    segment_from_view,
    select_keys,
    template_segment,
    token_importance,
)

QuerySource = Literal["repeat", "context", "self_study", "random", "question"]

@dataclass(frozen=True)
class QueryOptions(Options):
    """Where reference queries come from (shared by the methods that use them)."""

    query_source: QuerySource = knob(
        "repeat", "reference queries: repeat (repeat-prefill), context (prefill), self_study, random, "
                  "question (query-aware: the user's question)")
    max_queries: int = knob(
        2048, "cap on reference queries per KV head (seeded subsample; 50000, the published runs' cap, keeps "
              "every repeat-pass query of the lab's documents)", low=1)
    seed: int = knob(0, "seed of the query subsample and of random queries", low=0)
    self_study_tokens: int = knob(256, "self-study: generated tokens over all prompts", low=1)


@dataclass(frozen=True)
class ScoredOptions(QueryOptions):
    """Reference queries and the HighestAttnKeys score over them."""

    # RMS is the published code's choice. On the embedded model, mean keeps the
    # model's own answers closer to the full cache at the same attention error
    # (`python -m benchmarks.attention_matching`); the default stays the paper's.
    scoring: Literal["rms", "mean", "max"] = knob(
        "rms", "HighestAttnKeys score over queries: rms (the published code's), mean or max attention")


@dataclass(frozen=True)
class AMOptions(ScoredOptions):
    key_selection: Literal["highest_attn", "omp", "kvzip", "kvzip_union"] = knob(
        "highest_attn", "highest_attn (HighestAttnKeys), omp (orthogonal matching pursuit on the mass), "
                        "kvzip (KVzip's reconstruction scores per head, then the same bias and value fit) or "
                        "kvzip_union (kvzip_share of each head's keys by KVzip's scores, the rest by HighestAttnKeys)")
    kvzip_share: float = knob(0.5, "kvzip_union: share of each head's keys chosen by KVzip's scores", low=0.0, high=1.0)
    keys_per_iter: int = knob(4, "OMP: keys added per iteration (the fast variant's 4; plain OMP: 1)", low=1)
    refit_every: int = knob(2, "OMP: refit the weights every this many iterations (the fast variant's 2; plain OMP: 1)", low=1)
    # Also OMP's lower bound on beta: above 0 it would drop keys standing for a whole original key.
    drop_below: float = knob(-7.0, "OMP: drop and replace keys whose beta falls below this", high=0.0)
    nnls_iters: int = knob(2, "projected-gradient steps of the bounded bias fit", low=0)
    ridge: float = knob(1e-6, "ridge of the value and bias least squares, relative to the Gram's mean diagonal", low=0.0)
    budgets: Literal["uniform", "nonuniform"] = knob(
        "uniform", "per-head budgets: uniform, or nonuniform from the model's sensitivity sweep (python -m kvlab budgets)")
    chunk_size: int = knob(0, "compact the document in chunks of this many tokens (0: one block)", low=0)
    on_policy: bool = knob(
        False, "re-extract each layer's queries with the layers before it already compacted (slow: one pass per layer)")
    value_fit: Literal["least_squares", "original"] = knob(
        "least_squares", "least_squares (the paper's refitted values) or original (keep the kept keys' own values, "
                         "fit only beta)")
    value_anchor: float = knob(
        0.0, "ridge pulling the fitted values toward the kept keys' own values instead of toward 0, relative to "
             "the Gram's mean diagonal (0: the paper's fit)", low=0.0)
    self_study_weight: float = knob(
        0.0, "self-study queries added to query_source's, each weighted this much in the fit (0: none)", low=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.value_fit == "original" and self.value_anchor > 0:
            raise MethodError("value_anchor needs value_fit=least_squares (value_fit=original fits no values)")
        if self.self_study_weight > 0 and (self.query_source == "self_study" or self.on_policy):
            raise MethodError("self_study_weight mixes self-study queries into another, not on-policy, query_source")


# The published configurations (the public code's algorithm configs). The
# beta bounds follow the key selection: [-3, 3] for HighestAttnKeys, at most
# 7 above and ``drop_below`` below for OMP (kvlab.methods.solvers.compact_block);
# the values are always refitted by least squares. Plain OMP adds one key per
# iteration and refits every time; the fast variant four keys and every other time.
_HIGHEST_ATTN: dict[str, Any] = {"key_selection": "highest_attn", "scoring": "rms", "nnls_iters": 2}
_OMP: dict[str, Any] = {"key_selection": "omp", "keys_per_iter": 1, "refit_every": 1, "drop_below": -7.0}
PRESETS: dict[str, dict[str, Any]] = {
    "AM-HighestAttnKeys-basic": {**_HIGHEST_ATTN, "on_policy": False},
    "AM-HighestAttnKeys": {**_HIGHEST_ATTN, "on_policy": True},
    "AM-OMP-basic": {**_OMP, "on_policy": False},
    "AM-OMP": {**_OMP, "on_policy": True},
    "AM-OMP-fast": {**_OMP, "keys_per_iter": 4, "refit_every": 2, "on_policy": True},
}


def reference_queries(ctx: Context, opts: QueryOptions, question: str | None) -> list[torch.Tensor]:
    """Per layer [H, n, d] fitting queries from the chosen source."""
    if opts.query_source == "repeat":
        return repeat_queries(ctx)
    if opts.query_source == "context":
        return context_queries(ctx)
    if opts.query_source == "self_study":
        return self_study_queries(ctx, opts.self_study_tokens)
    if opts.query_source == "random":
        return random_queries(ctx, n=opts.max_queries, seed=opts.seed)
    if not question:
        raise MethodError("query_source=question needs a question")
    return question_queries(ctx, question)


def source_tokens(ctx: Context, opts: QueryOptions, question: str | None) -> torch.Tensor:
    """The tokens read after the document whose queries a source records (on-policy sources only)."""
    if opts.query_source == "repeat":
        return repeat_tokens(ctx.lm.tokenizer, ctx.tokens.ids[ctx.prefix_len :])
    if opts.query_source == "question" and question:
        return question_tokens(ctx.lm.tokenizer, question)
    raise MethodError("on-policy queries need query_source=repeat (or question, with a question)")


def subsample(q: torch.Tensor, cap: int, seed: int) -> torch.Tensor:
    """[B, n, d] -> [B, min(n, cap), d]: the same seeded random subset of query slots for every head."""
    n = q.shape[1]
    if n <= cap:
        return q
    # Drawn on the CPU generator: the same subset on every device (a CPU index is fine for indexing).
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(seed), device="cpu")[:cap]
    return q[:, torch.sort(keep).values]


def fitting_queries(q: torch.Tensor, n_kv_heads: int, opts: QueryOptions) -> torch.Tensor:
    """[H, n, d] one layer's reference queries -> [H_kv, min(g*n, max_queries), d].

    Each KV head gets the queries of its whole GQA group, capped by a seeded
    subsample; every layer draws with the same seed, so Attention Matching and
    its eviction baseline fit on the same queries.
    """
    return subsample(group_queries(q, n_kv_heads), opts.max_queries, opts.seed)


@dataclass
class BlockJob:
    """The inputs of one batched solve: B heads' queries, keys, values, bias, budgets."""

    queries: torch.Tensor  # [B, n, d]
    keys: torch.Tensor  # [B, T, d]
    values: torch.Tensor  # [B, T, d]
    bias: torch.Tensor | None  # [B, T]
    budgets: torch.Tensor  # [B]
    key_scores: torch.Tensor | None = None  # [B, T]: rank keys by these (key_selection=kvzip, kvzip_union)
    weights: torch.Tensor | None = None  # [B, n]: each query's weight in the fit (None: 1)
    scale: float | None = None  # the layer's factor on q.k (kvlab.models.LayerGeometry.scaling; None: 1/sqrt(d))


def solve(job: BlockJob, opts: AMOptions) -> CompactBlock:
    """Compact one batch of head blocks with the method's knobs.

    When every head may keep all its keys, the exact solution is the block
    itself (beta unchanged, values unchanged); least squares would only add
    rounding noise to it.
    """
    valid = torch.ones_like(job.keys[..., 0], dtype=torch.bool) if job.bias is None else torch.isfinite(job.bias)
    if bool((job.budgets >= valid.sum(-1)).all()):
        index = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
        exact = torch.zeros(valid.shape[0], device=valid.device)  # the block itself: no error
        return CompactBlock(
            keys=job.keys, values=job.values,
            bias=torch.zeros(valid.shape, device=valid.device) if job.bias is None else job.bias.float(),
            index=torch.where(valid, index, -1), lengths=valid.sum(-1),
            timings={"keys": 0.0, "bias": 0.0, "values": 0.0}, train_output=exact, train_mass=exact,
        )
    return compact_block(
        job.queries, job.keys, job.values, int(job.budgets.max()),
        bias=job.bias, key_selection="omp" if opts.key_selection == "omp" else "highest_attn",
        scoring=opts.scoring, key_scores=job.key_scores,
        key_scores_share=opts.kvzip_share if opts.key_selection == "kvzip_union" else 1.0,
        query_weights=job.weights, value_fit=opts.value_fit, value_anchor=opts.value_anchor,
        budgets=job.budgets, nnls_iters=opts.nnls_iters, keys_per_iter=opts.keys_per_iter,
        refit_every=opts.refit_every, drop_below=opts.drop_below, ridge=opts.ridge, scale=job.scale,
    )


def chunk_spans(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) spans covering ``length`` tokens in chunks (one span when chunk_size <= 0)."""
    if chunk_size <= 0 or chunk_size >= length:
        return [(0, length)]
    return [(s, min(s + chunk_size, length)) for s in range(0, length, chunk_size)]


def split_budget(budgets: torch.Tensor, spans: list[tuple[int, int]], total: int) -> list[torch.Tensor]:
    """Share each head's budget [B] among chunks in proportion to their lengths (at least 1 each)."""
    shares = []
    left = budgets.clone()
    for i, (s, e) in enumerate(spans):
        share = left if i == len(spans) - 1 else (budgets * (e - s) + total - 1) // total
        share = share.clamp(1, e - s)
        shares.append(share)
        left = (left - share).clamp_min(1)
    return shares


def compact_blocks(
    block: PaddedView, queries: torch.Tensor, budgets: torch.Tensor, opts: AMOptions, score: bool = False,
    key_scores: torch.Tensor | None = None, weights: torch.Tensor | None = None, scale: float | None = None,
) -> tuple[list[CompactBlock], list[torch.Tensor], torch.Tensor | None]:
    """Compact one layer's block (all heads at once), chunk by chunk.

    block: keys/values [H_kv, T, d], bias [H_kv, T]; queries: [H_kv, n, d];
    budgets: [H_kv]; key_scores: [H_kv, T] what to rank the keys by instead of
    the queries' attention (None: HighestAttnKeys or OMP); weights: [H_kv, n] each
    query's weight in the fit (None: 1); scale: the layer's factor on q.k. Returns each
    chunk's CompactBlock and its token offset, and with ``score`` each key's
    score [H_kv, T] within its chunk (``CompactBlock.scores``; scored here only for a chunk kept whole,
    which the solver returns unscored).
    """
    spans = chunk_spans(block.keys.shape[1], opts.chunk_size)
    out, offsets, scores = [], [], []
    for (s, e), share in zip(spans, split_budget(budgets, spans, block.keys.shape[1])):
        bias = block.bias[:, s:e]
        job = BlockJob(queries, block.keys[:, s:e], block.values[:, s:e], None if bool((bias == 0).all()) else bias, share,
                       None if key_scores is None else key_scores[:, s:e], weights, scale)
        out.append(solve(job, opts))
        offsets.append(torch.tensor(s, device=block.keys.device))
        if score:
            block_scores = out[-1].scores
            if block_scores is None:
                block_scores = job.key_scores if job.key_scores is not None else kernels.key_scores(
                    job.queries, job.keys, job.bias, scale=scale, scoring=opts.scoring)
            scores.append(block_scores)
    return out, offsets, torch.cat(scores, dim=1) if score else None


def to_segment(blocks: list[CompactBlock], offsets: list[torch.Tensor], token_index: torch.Tensor) -> DenseSegment:
    """Join the chunks' compact keys per head into one stored segment (fate "compacted").

    token_index: [H_kv, T] the block's original token positions.
    """
    local = torch.cat([torch.where(b.index >= 0, b.index + off, -1) for b, off in zip(blocks, offsets)], dim=1)
    joined = PaddedView(
        keys=torch.cat([b.keys for b in blocks], dim=1),
        values=torch.cat([b.values for b in blocks], dim=1),
        bias=torch.cat([b.bias for b in blocks], dim=1),
        token_index=torch.where(local >= 0, token_index.gather(1, local.clamp_min(0)), -1),
    )
    # Chunks leave padding between them: pack each head's real slots first.
    return segment_from_view(select_keys(joined, local >= 0), fate="compacted")


def train_errors(
    queries: torch.Tensor, block: PaddedView, seg: DenseSegment, blocks: list[CompactBlock], n_max: int = 512,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and mass errors [H_kv] on the fitting queries themselves.

    A layer fitted in one block has them from its solve, over every fitting
    query (CompactBlock.train_output); a chunked one is measured on a subsample
    of them (the chunks' own errors do not add up to the layer's).
    """
    if len(blocks) == 1 and blocks[0].train_output is not None and blocks[0].train_mass is not None:
        return blocks[0].train_output, blocks[0].train_mass
    held = subsample(queries, n_max, 0)
    return block_errors(held, block_attention(held, block, scale), seg.view(), scale)[:2]


def mixed_queries(
    q: torch.Tensor, extra: torch.Tensor | None, n_kv_heads: int, opts: AMOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's fitting queries [H_kv, n, d] and their weights [H_kv, n] (None: all 1).

    q: [H, n1, d] the query source's; extra: [H, n2, d] self-study queries mixed
    in, each capped like q (:func:`fitting_queries`) and weighted ``self_study_weight``.
    """
    grouped = fitting_queries(q, n_kv_heads, opts)
    if extra is None or opts.self_study_weight == 0:
        return grouped, None
    more = fitting_queries(extra, n_kv_heads, opts).to(grouped.device)
    weights = torch.cat([
        torch.ones(grouped.shape[:2], device=grouped.device),
        torch.full(more.shape[:2], opts.self_study_weight, device=grouped.device),
    ], dim=1)
    return torch.cat([grouped, more], dim=1), weights


@dataclass
class LayerFit:
    """One layer's compacted segments and what the fit measured."""

    segments: list[Segment]
    timings: dict[str, float]
    n_queries: int
    train_output: torch.Tensor  # [H_kv]
    train_mass: torch.Tensor  # [H_kv]
    importance: torch.Tensor | None = None  # [H_kv, logical length] (see CompressedKV.importance)
    fallbacks: list[int] = field(default_factory=list)  # [H_kv] solves that fell back (CompactBlock.fallbacks)
    nonfinite: list[int] = field(default_factory=list)  # [H_kv] non-finite results replaced (CompactBlock.nonfinite)


def compact_layer(
    view: PaddedView, q: torch.Tensor, budgets: torch.Tensor, opts: AMOptions, protected: int,
    importance_len: int | None = None, key_scores: torch.Tensor | None = None, extra: torch.Tensor | None = None,
    scale: float | None = None,
) -> LayerFit:
    """Attention Matching on one layer of a stored cache.

    view: the layer as attention sees it (a full or already compacted cache:
    an existing bias enters the targets); q: [H, n, d] reference queries;
    budgets: [H_kv] compact keys per head; protected: leading original tokens
    (the template prefix) left as they are; importance_len: the cache's
    logical length, to record each compacted token's key score (None: not recorded);
    key_scores: [H_kv, T_doc] each document key's score to rank by (key_selection=kvzip, kvzip_union),
    which only a full cache's block matches; extra: [H, n2, d] self-study queries mixed in
    (self_study_weight, :func:`mixed_queries`); scale: the layer's factor on q.k (None: 1/sqrt(d)).
    """
    checkpoint()
    keep = (view.token_index < protected) & (view.token_index >= 0)
    grouped, weights = mixed_queries(q, extra, view.keys.shape[0], opts)
    block = select_keys(view, ~keep & torch.isfinite(view.bias))
    if key_scores is not None and key_scores.shape != block.keys.shape[:2]:
        raise MethodError("key_selection=kvzip scores the full document: it cannot re-compact a compacted cache")
    blocks, offsets, scores = compact_blocks(
        block, grouped.to(block.keys.device), budgets, opts, score=importance_len is not None,
        key_scores=None if key_scores is None else key_scores.to(block.keys.device),
        weights=None if weights is None else weights.to(block.keys.device), scale=scale,
    )
    timings = {k: sum(b.timings.get(k, 0.0) for b in blocks) for k in ("keys", "bias", "values")}
    seg = to_segment(blocks, offsets, block.token_index)
    out_err, mass_err = train_errors(grouped, block, seg, blocks, scale=scale)
    segments: list[Segment] = [seg]
    if protected:
        # The template's keys, left-packed in reading order; their bias is 0 (never fitted).
        kept = select_keys(view, keep)
        segments.insert(0, template_segment(kept.keys, kept.values, protected))
    importance = None if scores is None else token_importance(scores, block.token_index, importance_len)
    fallbacks, nonfinite = (
        [sum(int(getattr(b, part)[h]) for b in blocks if getattr(b, part) is not None) for h in range(len(budgets))]
        for part in ("fallbacks", "nonfinite")
    )
    return LayerFit(segments, timings, grouped.shape[1], out_err, mass_err, importance, fallbacks, nonfinite)


def diagnostics(fits: list[LayerFit]) -> dict:
    """What the app and the CLI show of a fit: time per step, queries, train errors, and
    per layer and KV head the solves that fell back and the non-finite results replaced."""
    return {
        "fit_s": {k: sum(f.timings[k] for f in fits) for k in ("keys", "bias", "values")},
        "queries_per_head": [f.n_queries for f in fits],
        "train_attn_output_rel_err": torch.stack([f.train_output for f in fits]).tolist(),
        "train_attn_mass_rel_err": torch.stack([f.train_mass for f in fits]).tolist(),
        "solver_fallbacks": [f.fallbacks for f in fits],
        "nonfinite_replaced": [f.nonfinite for f in fits],
    }



def window_fit(segments: list[Segment], n_queries: int, importance_len: int | None = None) -> LayerFit:
    """A sliding-window layer left as the model keeps it (fate "window"): nothing fitted, no error,
    no token scored (importance NaN, when recorded: see CompressedKV.importance)."""
    zeros = torch.zeros(segments[0].lengths().shape[0], device=segments[0].lengths().device)
    n_heads = zeros.shape[0]
    importance = None if importance_len is None else torch.full((n_heads, importance_len), float("nan"), device="cpu")
    return LayerFit(list(segments), {"keys": 0.0, "bias": 0.0, "values": 0.0}, n_queries, zeros, zeros,
                    importance, [0] * n_heads, [0] * n_heads)


def is_window(segments: list[Segment]) -> bool:
    """Whether a stored layer is a sliding-window layer's window (kvlab.runtime.cache.window_segment)."""
    return all(seg.fate == "window" for seg in segments)


def fitted_cache(fits: list[LayerFit], logical_len: int) -> CompressedKV:
    """The stored cache of every layer's fit, with its diagnostics (and importance, when recorded)."""
    importance = [f.importance for f in fits] if all(f.importance is not None for f in fits) else None
    return CompressedKV([f.segments for f in fits], logical_len, meta=diagnostics(fits), importance=importance)


def compact_cache(
    reference: CompressedKV,
    queries: list[torch.Tensor],
    budgets: torch.Tensor,
    opts: AMOptions,
    protected: int,
    record_importance: bool = False,
    key_scores: list[torch.Tensor] | None = None,
    extra: list[torch.Tensor] | None = None,
) -> CompressedKV:
    """Attention Matching on every layer of ``reference`` (see :func:`compact_layer`).

    queries: per layer [H, n, d]; budgets: [n_layers, H_kv]. Re-compacting an
    already compacted cache works the same way: its bias is part of the targets.
    record_importance: fill ``importance`` with each compacted token's key score.
    key_scores: per layer [H_kv, T_doc] scores to rank the keys by (key_selection=kvzip, kvzip_union).
    extra: per layer [H, n2, d] self-study queries mixed in (self_study_weight).
    Each layer is fitted at its own scaling (``reference.scales``); a sliding-window layer keeps its window.
    """
    length = reference.logical_len if record_importance else None
    scales = reference.scales or [None] * reference.n_layers
    fits = [
        window_fit(reference.layers[i], q.shape[1], length) if is_window(reference.layers[i]) else
        compact_layer(reference.layer_view(i), q, budgets[i], opts, protected, length,
                      None if key_scores is None else key_scores[i], None if extra is None else extra[i], scales[i])
        for i, q in enumerate(queries)
    ]
    return fitted_cache(fits, reference.logical_len)


class QuerySourced:
    """Methods fitted on QueryOptions' reference queries: query-aware only when those are the question's."""

    query_aware_when = "query_source=question"

    def uses_question(self) -> bool:
        return self.options.query_source == "question"  # type: ignore[attr-defined]

    def prepare(self, ctx: Context) -> None:
        """Record the reference queries of a query-agnostic source (on-policy ones depend on the fit)."""
        opts = self.options  # type: ignore[attr-defined]
        if not self.uses_question() and not getattr(opts, "on_policy", False):
            reference_queries(ctx, opts, None)
        if getattr(opts, "self_study_weight", 0.0) > 0:
            self_study_queries(ctx, opts.self_study_tokens)


@register
class AttentionTopK(QuerySourced, EvictionMethod):
    """The key selection of Attention Matching alone: the paper's eviction baseline."""

    name = "attention_topk"
    summary = "keep the keys the reference queries attend to most, bias 0, values as they were"
    learn = (
        "The key selection of Attention Matching on its own, as the paper's eviction baseline: keep the "
        "B keys the reference queries attend to most, $s_j=\\sqrt{\\tfrac1n\\sum_i a_{ij}^2}$ (RMS over the "
        "queries of the head's group; mean or max with `scoring`, as in `attention_matching`, whose query "
        "subsample it shares), with no bias and the original values. The gap between this and "
        "`attention_matching` is what fitting $\\beta$ and the values buys."
    )
    paper = "Zweiger et al., 2026 (the eviction baseline of Attention Matching's ablations)"
    Options = ScoredOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        ctx, opts = req.ctx, self.options
        out = []
        for layer, q in enumerate(reference_queries(ctx, opts, req.question)):
            keys = ctx.full.keys[layer][:, ctx.prefix_len :]
            grouped = fitting_queries(q, keys.shape[0], opts)
            # Chunked over the keys (a Triton kernel on CUDA): no [H_kv, n, T] matrix at long context.
            scale = ctx.lm.geometry[layer].scaling
            out.append(kernels.key_scores(grouped.to(keys.device), keys, scale=scale, scoring=opts.scoring))
        return out


@register
class AttentionMatching(QuerySourced, Method):
    name = "attention_matching"
    summary = "compact keys + per-key bias + refitted values matching attention output and mass (closed form)"
    learn = (
        "Instead of choosing which tokens to keep, Attention Matching *builds* a small cache that behaves "
        "like the big one. Each KV head's T document keys and values are replaced by t = T/r keys "
        "$C_k$ (a subset of the original keys), one scalar bias $\\beta_j$ per key, and refitted values "
        "$C_v$, so that for reference queries $q$ both the attention **mass** and the attention **output** "
        "of the block are preserved:\n\n"
        "$$\\sum_{j=1}^{t} e^{q\\cdot c_j/\\sqrt d+\\beta_j}\\approx\\sum_{j=1}^{T} e^{q\\cdot k_j/\\sqrt d},"
        "\\qquad \\operatorname{softmax}\\!\\Big(\\tfrac{qC_k^\\top}{\\sqrt d}+\\beta\\Big)C_v\\approx"
        "\\operatorname{softmax}\\!\\Big(\\tfrac{qK^\\top}{\\sqrt d}\\Big)V$$\n\n"
        "Matching both makes the compact block a drop-in replacement whatever is read after it. Three "
        "closed-form steps, no gradient descent: keep the keys the reference queries attend to most "
        "(`scoring`: RMS attention as in the published code, mean or max) or pick them by orthogonal "
        "matching pursuit (`key_selection`), fit $w=e^{\\beta}$ by non-negative least squares on the mass "
        "($\\beta$ bounded to $[-3,3]$ for HighestAttnKeys as published, to [`drop_below`, 7] for OMP), "
        "then fit $C_v$ by least squares on the outputs. $e^{\\beta_j}$ reads as "
        "\"how many original keys' worth of mass key $j$ stands for\". The reference queries come from "
        "`query_source`: a *repeat-prefill* (the model is asked to repeat the document and its queries while "
        "re-reading it are recorded), the prefill itself, self-study answers or random vectors; your question "
        "is used only with `query_source=question`.\n\n"
        "The published configurations are presets: `AM-HighestAttnKeys-basic` (the defaults), "
        "`AM-HighestAttnKeys` (the same, on-policy: each layer's queries are re-read with the layers before "
        "it already compacted), `AM-OMP-basic`, `AM-OMP` (on-policy) and `AM-OMP-fast` (more keys per OMP "
        "iteration, fewer refits). The defaults are not on-policy because that costs one more pass over the "
        "document per layer, which is slow on a CPU, for a small gain. `key_selection=kvzip` keeps KVzip's "
        "keys (the most attended while the model repeats the document) and fits their bias and values.\n\n"
        "**Why it can lose a needle that eviction keeps** (`python -m benchmarks.retrieval_gap`, docs/benchmarks.md): "
        "on four needle documents that the full cache answers right, AM at 5x lost all four, and two "
        "things lose the needle, each on its own. Its keys (the most attended by the repeat pass's queries, "
        "one a token) hold 82% of the answer's attention to the needle where KVzip's hold 95%, and with AM's "
        "keys even the original values answer wrong. Its fit: on exactly KVzip's keys, which answer right "
        "with their own values, the refitted values answer wrong and the error on the question's queries "
        "rises from 0.17 to 0.30. The values are a least-squares compromise over the repeat-pass queries, "
        "of which only the few that copy the needle read its tokens, so they no longer spell it exactly. "
        "A small attention error does not guarantee recall of a rare token: OMP halves the error (0.09) "
        "and keeps the needle in no head.\n\n"
        "**Knobs that aim at keeping the needle** (issue #22; measured in `python -m benchmarks.retrieval_gap`, "
        "docs/benchmarks.md). *What the values are pulled toward:* `value_anchor` $\\lambda>0$ fits the "
        "$C_v$ that minimises the squared error $\\lVert XC_v-Y\\rVert$ plus $\\lambda$ times the squared "
        "distance $\\lVert C_v-V_S\\rVert$, a ridge toward the kept "
        "keys' own values $V_S$ rather than toward zero ($\\lambda$ relative to the Gram's mean diagonal, as "
        "`ridge`); solved as the ridge on $Y-XV_S$ plus $V_S$, in the same primal or $n\\times n$ dual form, so "
        "a key that no reference query reads keeps its own value. `value_fit=original` keeps the values as "
        "they were and fits only $\\beta$. *Which queries the fit sees:* `max_queries=50000` (the published "
        "runs' cap) fits on every repeat-pass query of every query head of the group instead of the default "
        "subsample; `self_study_weight` adds self-study queries (the model answering generic prompts about "
        "the document, closer to questions) to the repeat pass, each weighted in the least squares and in "
        "the scores. *Which keys:* `key_selection=kvzip_union` keeps `kvzip_share` of each head's keys by "
        "KVzip's scores and the rest by HighestAttnKeys.\n\n"
        "**What costs retrieval, measured** (twelve single needles and six keyed ones in documents of about "
        "two thousand tokens, 5x / 10x / 20x; `python -m benchmarks.retrieval_gap`, docs/benchmarks.md). "
        "KVzip keeps 12 / 11 / 11 single needles and 6 / 6 / 6 keyed ones; the published AM configuration 0 / 1 / 0 and 0 / 0 / 0. "
        "*The selection* costs some: AM's keys hold 80 / 70 / 61 % of the attention the answer pays to the "
        "needle, KVzip's 92 / 82 / 73 %. *The fit* costs more: on exactly KVzip's keys, which answer every "
        "needle with their own values, fitting the biases alone keeps at most 3 of 12 and the full fit none; "
        "anchoring the values to the kept ones (`value_anchor`) or keeping them (`value_fit=original`) leaves "
        "AM at 0. *The queries* decide: the repeat pass's queries barely read a needle, so the scores and the "
        "fit serve the rest of the document. Every repeat query instead of the subsample (`max_queries=50000`) "
        "keeps 8 / 3 / 1; self-study queries mixed in at weight 4.0 (`self_study_weight=4.0`) keep 10 / 10 / 7 "
        "single and 5 / 6 / 3 keyed needles, with the lowest attention error of every variant (0.098 / "
        "0.117 / 0.142 against the default's 0.168 / 0.202 / 0.236); self-study queries alone "
        "(`query_source=self_study`) keep 9 / 7 / 9 and 5 / 5 / 5, the most at 20x. Adding KVzip's keys to "
        "the self-study fit (`key_selection=kvzip_union`) holds more of the needle's attention (97 / 94 / 90 %) "
        "and no more needles (8 / 10 / 6): what the fit is asked to match matters more than which keys it gets. "
        "On the bundled examples' 15 questions the gap is wider: at 5x the best variants answer four where "
        "KVzip answers 12 (`kvlab bench --tasks examples`). "
        "Those needles sat in RULER's noise haystack, one line repeated, where the needle is the only "
        "sentence unlike the rest. **On prose** (the project's essay haystack, `kvlab bench --haystack prose`, "
        "docs/retrieval-prose.md: twelve single needles in 1,500-token documents, 2x / 5x / 10x / 20x) the "
        "published configuration keeps none at any ratio (four, four, three and none of the same needles in noise); "
        "`self_study_weight=4.0` keeps 10 / 10 / 9 / 8 (noise 11 / 11 / 11 / 8) and KVzip 12 / 12 / 12 / 7 "
        "(noise 12 / 12 / 12 / 12). The needles self-study loses on prose it loses at 2x too, spelling the "
        "number's first digits and then drifting: the fit, not the budget. "
        "So `self_study_weight=4.0` remains the best Attention Matching variant measured up to 10x on both "
        "haystacks (at 20x self-study queries alone kept more in noise; its attention error, measured in "
        "noise, is the lowest) and ties the best on the examples at 5x, for one self-study generation per "
        "document (`self_study_tokens` generated "
        "tokens); it stays below KVzip up to 10x, by one item of twelve in noise and two to three in prose, "
        "and far below it on the examples' questions. "
        "The default stays the published configuration and there is no retrieval preset."
    )
    paper = "Zweiger, Fu, Guo, Kim, 2026, Fast KV Compaction via Attention Matching (arXiv 2602.16284)"
    Options = AMOptions
    presets = PRESETS

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        budgets = head_budgets(ctx.lm, req, opts.budgets)
        req.progress(0.3, f"reference queries: {opts.query_source}")
        start = time.perf_counter()
        # KVzip's scores need the reconstruction pass: timed with the queries.
        key_scores = kvzip_scores(req, KVzipOptions()) if opts.key_selection in ("kvzip", "kvzip_union") else None
        if opts.on_policy:
            scores_s = time.perf_counter() - start
            stored, queries_s = self._on_policy(req, budgets, key_scores)
            queries_s += scores_s
        else:
            queries = reference_queries(ctx, opts, req.question)
            extra = self_study_queries(ctx, opts.self_study_tokens) if opts.self_study_weight > 0 else None
            queries_s = time.perf_counter() - start
            req.progress(0.4, "fitting keys, biases and values")
            stored = compact_cache(ctx.full.stored, queries, budgets, opts, ctx.prefix_len, req.record_importance,
                                   key_scores, extra)
        stored.meta = {
            "method": self.name,
            "query_source": opts.query_source,
            "key_selection": opts.key_selection,
            **stored.meta,
            "fit_s": {"queries": queries_s, **stored.meta["fit_s"]},
        }
        return stored

    def _on_policy(
        self, req: Request, budgets: torch.Tensor, key_scores: list[torch.Tensor] | None
    ) -> tuple[CompressedKV, float]:
        """Compact layer by layer, each layer's queries read with the layers before it compacted."""
        ctx, opts = req.ctx, self.options
        ids = source_tokens(ctx, opts, req.question)
        full = ctx.full.stored
        length = full.logical_len if req.record_importance else None
        fits: list[LayerFit] = []
        queries_s = 0.0
        for layer in range(ctx.lm.n_layers):
            start = time.perf_counter()
            mixed = CompressedKV([f.segments for f in fits] + full.layers[layer:], full.logical_len)
            q = read_after(ctx, ids, mixed, layers=layer + 1)[layer]
            queries_s += time.perf_counter() - start
            fits.append(window_fit(full.layers[layer], q.shape[1], length) if is_window(full.layers[layer]) else
                        compact_layer(full.layer_view(layer), q, budgets[layer], opts, ctx.prefix_len, length,
                                      None if key_scores is None else key_scores[layer],
                                      scale=ctx.lm.geometry[layer].scaling))
            req.progress(0.3 + 0.3 * (layer + 1) / ctx.lm.n_layers, f"on-policy: layer {layer + 1}")
        return fitted_cache(fits, full.logical_len), queries_s
