"""Attention Matching's compaction (Zweiger, Fu, Guo, Kim, 2026), shared by the methods that fit on
reference queries (``attention_matching``, ``attention_topk``, ``summary_am``) and by bounded
generation: the query knobs (:class:`QueryOptions`, :class:`ScoredOptions`, :class:`AMOptions`), the
reference queries, and :func:`compact_cache`, which replaces each KV head's document block by t
compact keys, one bias per key and refitted values (kvlab.compression.solvers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvlab.cancel import checkpoint
from kvlab.compression.block_solve import BlockJob, solve_ragged
from kvlab.compression.budget_profiles import (
    BUDGET_SOURCES,
    HeadBudgets,
    from_profile,
    global_ranking,
    resolve,
    spread,
    uniform,
)
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.request import Request
from kvlab.compression.solvers.compact import CompactBlock
from kvlab.context import Context
from kvlab.kernels import dispatch as kernels
from kvlab.metrics import block_attention, block_errors
from kvlab.prompts import question_tokens, repeat_tokens
from kvlab.queries import (
    context_queries,
    question_queries,
    random_queries,
    repeat_queries,
    self_study_queries,
)
from kvlab.runtime.attention import attention_weights, group_queries
from kvlab.runtime.cache import (
    CompressedKV,
    DenseSegment,
    PaddedView,
    Segment,
    concat_views,
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
    budgets: Literal["auto", "uniform", "nonuniform", "document", "global"] = knob(
        "auto", "per-head budgets, the total always T/r per head on average: auto (the paper's recipe: the model's "
                "profile where it has one, else uniform, said), uniform, nonuniform (the model's profile from its "
                "sensitivity sweep, kvlab budgets), document (this document's reference queries: heads whose "
                "attention is concentrated keep more) or global (one ranking of the reference queries' attention "
                "across every head and layer)")
    compaction_chunk: int = knob(0, "compact the document in chunks of this many tokens (0: one block)", low=0)
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
    exact_share: float = knob(
        0.0, "share of each head's budget kept as exact tokens (own key and value, bias 0, outside the fit); the "
             "compact keys fit only what they leave unexplained (0: none; 1: eviction)", low=0.0, high=1.0)
    exact_keys: Literal["kvzip", "attention"] = knob(
        "kvzip", "exact_share: which keys stay exact: kvzip (KVzip's reconstruction scores) or attention (the "
                 "reference queries' HighestAttnKeys scores)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.exact_share > 0 and self.key_selection in ("omp", "kvzip_union"):
            raise MethodError("exact_share needs key_selection=highest_attn or kvzip (the compact keys are the best "
                              "remaining keys by one score)")
        if self.budgets in ("document", "global") and self.on_policy:
            raise MethodError(f"budgets={self.budgets} reads the reference queries before the fit: not on-policy")
        if self.value_fit == "original" and self.value_anchor > 0:
            raise MethodError("value_anchor needs value_fit=least_squares (value_fit=original fits no values)")
        if self.self_study_weight > 0 and (self.query_source == "self_study" or self.on_policy):
            raise MethodError("self_study_weight mixes self-study queries into another, not on-policy, query_source")


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


def concentration(q: torch.Tensor, keys: torch.Tensor, scale: float | None = None, rows: int = 256) -> torch.Tensor:
    """How concentrated each head's attention is: [H_kv], log T minus the mean entropy (nats) of a query's
    softmax over the T keys (0: every query spreads evenly; log T: each reads one key).

    q: [H_kv, n, d] grouped queries, keys: [H_kv, T, d], at the layer's ``scale``;
    ``rows`` queries at a time (never the whole [H_kv, n, T] matrix). A head that
    copies (each repeat-pass query reads the token it repeats) scores high
    although its attention averaged over the queries is spread: the entropy is
    each query's own, then averaged.
    """
    total = torch.zeros(keys.shape[0], device=keys.device)
    for a in range(0, q.shape[1], rows):
        w = attention_weights(q[:, a : a + rows], keys, scale=scale)
        total += -(w * w.clamp_min(torch.finfo(w.dtype).tiny).log()).sum(dim=(-1, -2))
    return math.log(keys.shape[1]) - total / max(1, q.shape[1])


def document_budgets(ctx: Context, queries: list[torch.Tensor], opts: QueryOptions, per_head: int) -> torch.Tensor:
    """budgets=document: [n_layers, H_kv] compact keys per head from this document's reference queries
    (per layer [H, n, d]): each head's share of the total in proportion to its :func:`concentration`, then
    capped and rounded as the model profiles' shares are (kvlab.compression.budget_profiles.allocate), so
    that the total stays ``per_head`` x the compressed layers' heads. The shares are a small plan made on
    the CPU, the budgets used on the model's device."""
    rows = torch.ones(ctx.lm.n_layers, ctx.lm.n_kv_heads, dtype=torch.float64, device="cpu")
    for layer in ctx.lm.compressed_layers:
        keys = ctx.full.keys[layer][:, ctx.prefix_len :]
        grouped = fitting_queries(queries[layer], keys.shape[0], opts).to(keys.device)
        rows[layer] = concentration(grouped, keys, ctx.lm.geometry[layer].scaling).cpu().double()
    return spread(ctx.lm, rows, per_head, ctx.doc_len)


def attention_scores(ctx: Context, queries: list[torch.Tensor], opts: ScoredOptions) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc] each document key's HighestAttnKeys score (``scoring``) under the fitting
    queries (per layer [H, n, d]): attention probabilities, comparable across heads and layers. A
    sliding-window layer (not compacted) scores 0."""
    out = []
    for layer, q in enumerate(queries):
        keys = ctx.full.keys[layer][:, ctx.prefix_len :]
        if layer not in ctx.lm.compressed_layers:
            out.append(torch.zeros(keys.shape[:2], device=keys.device))
            continue
        grouped = fitting_queries(q, keys.shape[0], opts).to(keys.device)
        out.append(kernels.key_scores(grouped, keys, None, scale=ctx.lm.geometry[layer].scaling, scoring=opts.scoring))
    return out


def am_budgets(req: Request, opts: AMOptions, queries: list[torch.Tensor] | None = None) -> HeadBudgets:
    """The compact keys per head for ``opts.budgets`` (kvlab.compression.budget_profiles): ``auto`` the
    model's profile where it has one, else uniform with the reason; ``document`` and ``global`` read
    the reference ``queries`` (per layer [H, n, d]; MethodError without them: not on-policy)."""
    mode, why = resolve(req.ctx.lm, opts.budgets)
    if mode == "uniform":
        return uniform(req, why or BUDGET_SOURCES["uniform"])
    if mode == "nonuniform":
        return from_profile(req)
    if queries is None:
        raise MethodError(f"budgets={mode} reads the reference queries before the fit: not on-policy")
    if mode == "document":
        return HeadBudgets(document_budgets(req.ctx, queries, opts, req.doc_budget), "document",
                           BUDGET_SOURCES["document"])
    return global_ranking(req, attention_scores(req.ctx, queries, opts))


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


def block_jobs(
    block: PaddedView, queries: torch.Tensor, budgets: torch.Tensor, opts: AMOptions,
    key_scores: torch.Tensor | None = None, weights: torch.Tensor | None = None, scale: float | None = None,
    exact_scores: torch.Tensor | None = None,
) -> tuple[list[BlockJob], list[torch.Tensor]]:
    """One layer's block (all heads) as the solves it takes, chunk by chunk (``compaction_chunk``), and
    each chunk's token offset.

    block: keys/values [H_kv, T, d], bias [H_kv, T]; queries: [H_kv, n, d];
    budgets: [H_kv]; key_scores: [H_kv, T] what to rank the keys by instead of
    the queries' attention (None: HighestAttnKeys or OMP); weights: [H_kv, n] each
    query's weight in the fit (None: 1); scale: the layer's factor on q.k; exact_scores: [H_kv, T]
    what to rank the exact keys by (exact_share; None: the selection's own scores).
    """
    spans = chunk_spans(block.keys.shape[1], opts.compaction_chunk)
    jobs, offsets = [], []
    for (s, e), share in zip(spans, split_budget(budgets, spans, block.keys.shape[1])):
        bias = block.bias[:, s:e]
        jobs.append(BlockJob(queries, block.keys[:, s:e], block.values[:, s:e], None if bool((bias == 0).all()) else bias,
                             share, None if key_scores is None else key_scores[:, s:e], weights, scale,
                             None if exact_scores is None else exact_scores[:, s:e]))
        offsets.append(torch.tensor(s, device=block.keys.device))
    return jobs, offsets


def block_scores(jobs: list[BlockJob], solved: list[CompactBlock], opts: AMOptions) -> torch.Tensor:
    """[H_kv, T] each key's score within its chunk (``CompactBlock.scores``; scored here for a chunk
    kept whole, which the solver returns unscored)."""
    scores = []
    for job, block in zip(jobs, solved):
        got = block.scores
        if got is None:
            got = job.key_scores if job.key_scores is not None else kernels.key_scores(
                job.queries, job.keys, job.bias, scale=job.scale, scoring=opts.scoring)
        scores.append(got)
    return torch.cat(scores, dim=1)


def to_segments(blocks: list[CompactBlock], offsets: list[torch.Tensor], token_index: torch.Tensor) -> list[DenseSegment]:
    """Join the chunks' compact keys per head into one stored segment (fate "compacted"), the exact keys
    (``CompactBlock.exact``) first into their own (fate "kept", no bias stored when theirs are all 0).

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
    if all(b.exact is None for b in blocks):
        return [segment_from_view(select_keys(joined, local >= 0), fate="compacted")]
    exact = torch.cat([torch.zeros_like(b.index, dtype=torch.bool) if b.exact is None else b.exact for b in blocks], dim=1)
    kept = select_keys(joined, (local >= 0) & exact)
    plain = bool((kept.bias[torch.isfinite(kept.bias)] == 0).all())
    return [segment_from_view(kept, fate="kept", keep_bias=not plain),
            segment_from_view(select_keys(joined, (local >= 0) & ~exact), fate="compacted")]


def train_errors(
    queries: torch.Tensor, block: PaddedView, stored: PaddedView, blocks: list[CompactBlock], n_max: int = 512,
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
    return block_errors(held, block_attention(held, block, scale), stored, scale)[:2]


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


@dataclass
class LayerWork:
    """One layer of a stored cache prepared for Attention Matching: its solves and what finishing needs.

    view: the layer as attention sees it; keep: [H_kv, L] the template's slots (left as they are);
    block: the document block, left-packed; grouped: [H_kv, n, d] the fitting queries;
    jobs, offsets: the block's solves, one per chunk, and their token offsets.
    """

    view: PaddedView
    keep: torch.Tensor
    block: PaddedView
    grouped: torch.Tensor
    jobs: list[BlockJob]
    offsets: list[torch.Tensor]
    scale: float | None


def layer_work(
    view: PaddedView, q: torch.Tensor, budgets: torch.Tensor, opts: AMOptions, protected: int,
    key_scores: torch.Tensor | None = None, extra: torch.Tensor | None = None,
    scale: float | None = None, exact_scores: torch.Tensor | None = None,
) -> LayerWork:
    """Prepare one layer of a stored cache (see :func:`compact_layer` for the arguments)."""
    checkpoint()
    keep = (view.token_index < protected) & (view.token_index >= 0)
    grouped, weights = mixed_queries(q, extra, view.keys.shape[0], opts)
    block = select_keys(view, ~keep & torch.isfinite(view.bias))
    for scored in (key_scores, exact_scores):
        if scored is not None and scored.shape != block.keys.shape[:2]:
            raise MethodError("KVzip's scores are the full document's: they cannot re-compact a compacted cache")
    device = block.keys.device
    jobs, offsets = block_jobs(
        block, grouped.to(device), budgets, opts,
        key_scores=None if key_scores is None else key_scores.to(device),
        weights=None if weights is None else weights.to(device), scale=scale,
        exact_scores=None if exact_scores is None else exact_scores.to(device),
    )
    return LayerWork(view, keep, block, grouped, jobs, offsets, scale)


def solve_layers(work: list[LayerWork], opts: AMOptions) -> list[list[CompactBlock]]:
    """Every layer's solves, per layer in chunk order: the heads of all the layers' solves regrouped
    by budget (:func:`solve_ragged`), so that ragged budgets are solved batched, not padded."""
    jobs = [job for w in work for job in w.jobs]
    solved = solve_ragged(jobs, opts) if jobs else []
    out, start = [], 0
    for w in work:
        out.append(solved[start : start + len(w.jobs)])
        start += len(w.jobs)
    return out


def finish_layer(
    work: LayerWork, blocks: list[CompactBlock], opts: AMOptions, protected: int, importance_len: int | None,
) -> LayerFit:
    """The layer's stored segments and what the fit measured, from its solved blocks."""
    timings = {k: sum(b.timings.get(k, 0.0) for b in blocks) for k in ("keys", "bias", "values")}
    stored = to_segments(blocks, work.offsets, work.block.token_index)
    out_err, mass_err = train_errors(work.grouped, work.block, concat_views([seg.view() for seg in stored]), blocks,
                                     scale=work.scale)
    segments: list[Segment] = list(stored)
    if protected:
        # The template's keys, left-packed in reading order; their bias is 0 (never fitted).
        kept = select_keys(work.view, work.keep)
        segments.insert(0, template_segment(kept.keys, kept.values, protected))
    importance = None
    if importance_len is not None:
        scores = block_scores(work.jobs, blocks, opts)
        importance = token_importance(scores, work.block.token_index, importance_len)
    n_heads = work.block.keys.shape[0]
    fallbacks, nonfinite = (
        [sum(int(getattr(b, part)[h]) for b in blocks if getattr(b, part) is not None) for h in range(n_heads)]
        for part in ("fallbacks", "nonfinite")
    )
    return LayerFit(segments, timings, work.grouped.shape[1], out_err, mass_err, importance, fallbacks, nonfinite)


def compact_layer(
    view: PaddedView, q: torch.Tensor, budgets: torch.Tensor, opts: AMOptions, protected: int,
    importance_len: int | None = None, key_scores: torch.Tensor | None = None, extra: torch.Tensor | None = None,
    scale: float | None = None, exact_scores: torch.Tensor | None = None,
) -> LayerFit:
    """Attention Matching on one layer of a stored cache.

    view: the layer as attention sees it (a full or already compacted cache:
    an existing bias enters the targets); q: [H, n, d] reference queries;
    budgets: [H_kv] compact keys per head; protected: leading original tokens
    (the template prefix) left as they are; importance_len: the cache's
    logical length, to record each compacted token's key score (None: not recorded);
    key_scores: [H_kv, T_doc] each document key's score to rank by (key_selection=kvzip, kvzip_union),
    which only a full cache's block matches; extra: [H, n2, d] self-study queries mixed in
    (self_study_weight, :func:`mixed_queries`); scale: the layer's factor on q.k (None: 1/sqrt(d));
    exact_scores: [H_kv, T_doc] what to rank the exact keys by (exact_keys=kvzip), a full cache's block only.
    """
    work = layer_work(view, q, budgets, opts, protected, key_scores, extra, scale, exact_scores)
    return finish_layer(work, solve_layers([work], opts)[0], opts, protected, importance_len)


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
    exact_scores: list[torch.Tensor] | None = None,
) -> CompressedKV:
    """Attention Matching on every layer of ``reference`` (see :func:`compact_layer`).

    queries: per layer [H, n, d]; budgets: [n_layers, H_kv]. Re-compacting an
    already compacted cache works the same way: its bias is part of the targets.
    record_importance: fill ``importance`` with each compacted token's key score.
    key_scores: per layer [H_kv, T_doc] scores to rank the keys by (key_selection=kvzip, kvzip_union).
    extra: per layer [H, n2, d] self-study queries mixed in (self_study_weight).
    exact_scores: per layer [H_kv, T_doc] what to rank the exact keys by (exact_share, exact_keys=kvzip).
    Each layer is fitted at its own scaling (``reference.scales``); a sliding-window layer keeps its window.
    """
    length = reference.logical_len if record_importance else None
    scales = reference.scales or [None] * reference.n_layers
    fitted = [i for i in range(reference.n_layers) if not is_window(reference.layers[i])]
    work = {
        i: layer_work(reference.layer_view(i), queries[i], budgets[i], opts, protected,
                      None if key_scores is None else key_scores[i], None if extra is None else extra[i], scales[i],
                      None if exact_scores is None else exact_scores[i])
        for i in fitted
    }
    # Every layer's heads solved together, regrouped by budget (ragged budgets batched, not padded).
    solved = dict(zip(fitted, solve_layers([work[i] for i in fitted], opts)))
    fits = [
        finish_layer(work[i], solved[i], opts, protected, length) if i in work else
        window_fit(reference.layers[i], q.shape[1], length)
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
