"""Attention Matching's compaction (Zweiger, Fu, Guo, Kim, 2026), shared by the methods that fit on
reference queries (``attention_matching``, ``summary_am``) and by bounded generation:
:func:`compact_cache` replaces each KV head's document block by t compact keys, one bias per key and
refitted values (the heads' batched solves: kvlab.compression.block_solve, on
kvlab.compression.solvers), and :func:`compact_layer` one layer of it. The cache of a request's
document (reference queries, budgets, the fit; on-policy in one sweep) is
kvlab.methods.families.document_fit; the knobs, reference queries and budgets are
kvlab.methods.families.am_recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.cancellation import checkpoint
from kvlab.compression.block_solve import BlockJob, solve_ragged
from kvlab.compression.options import MethodError
from kvlab.compression.solvers.compact import CompactBlock
from kvlab.kernels import dispatch as kernels
from kvlab.methods.families.am_recipe import AMOptions, mixed_queries, subsample
from kvlab.metrics import block_attention, block_errors
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
    block: PaddedView,
    queries: torch.Tensor,
    budgets: torch.Tensor,
    opts: AMOptions,
    key_scores: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    scale: float | None = None,
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
        jobs.append(
            BlockJob(
                queries,
                block.keys[:, s:e],
                block.values[:, s:e],
                None if bool((bias == 0).all()) else bias,
                share,
                None if key_scores is None else key_scores[:, s:e],
                weights,
                scale,
                None if exact_scores is None else exact_scores[:, s:e],
            )
        )
        offsets.append(torch.tensor(s, device=block.keys.device))
    return jobs, offsets


def block_scores(jobs: list[BlockJob], solved: list[CompactBlock], opts: AMOptions) -> torch.Tensor:
    """[H_kv, T] each key's score within its chunk (``CompactBlock.scores``; scored here for a chunk
    kept whole, which the solver returns unscored)."""
    scores = []
    for job, block in zip(jobs, solved):
        got = block.scores
        if got is None:
            got = (
                job.key_scores
                if job.key_scores is not None
                else kernels.key_scores(job.queries, job.keys, job.bias, scale=job.scale, scoring=opts.scoring)
            )
        scores.append(got)
    return torch.cat(scores, dim=1)


def to_segments(
    blocks: list[CompactBlock], offsets: list[torch.Tensor], token_index: torch.Tensor
) -> list[DenseSegment]:
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
    exact = torch.cat(
        [torch.zeros_like(b.index, dtype=torch.bool) if b.exact is None else b.exact for b in blocks], dim=1
    )
    kept = select_keys(joined, (local >= 0) & exact)
    plain = bool((kept.bias[torch.isfinite(kept.bias)] == 0).all())
    return [
        segment_from_view(kept, fate="kept", keep_bias=not plain),
        segment_from_view(select_keys(joined, (local >= 0) & ~exact), fate="compacted"),
    ]


def train_errors(
    queries: torch.Tensor,
    block: PaddedView,
    stored: PaddedView,
    blocks: list[CompactBlock],
    n_max: int = 512,
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
    view: PaddedView,
    q: torch.Tensor,
    budgets: torch.Tensor,
    opts: AMOptions,
    protected: int,
    key_scores: torch.Tensor | None = None,
    extra: torch.Tensor | None = None,
    scale: float | None = None,
    exact_scores: torch.Tensor | None = None,
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
        block,
        grouped.to(device),
        budgets,
        opts,
        key_scores=None if key_scores is None else key_scores.to(device),
        weights=None if weights is None else weights.to(device),
        scale=scale,
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
    work: LayerWork, blocks: list[CompactBlock], opts: AMOptions, protected: int, importance_len: int | None
) -> LayerFit:
    """The layer's stored segments and what the fit measured, from its solved blocks."""
    timings = {k: sum(b.timings.get(k, 0.0) for b in blocks) for k in ("keys", "bias", "values")}
    stored = to_segments(blocks, work.offsets, work.block.token_index)
    out_err, mass_err = train_errors(
        work.grouped, work.block, concat_views([seg.view() for seg in stored]), blocks, scale=work.scale
    )
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
    view: PaddedView,
    q: torch.Tensor,
    budgets: torch.Tensor,
    opts: AMOptions,
    protected: int,
    importance_len: int | None = None,
    key_scores: torch.Tensor | None = None,
    extra: torch.Tensor | None = None,
    scale: float | None = None,
    exact_scores: torch.Tensor | None = None,
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


def window_fit(segments: list[Segment], importance_len: int | None = None) -> LayerFit:
    """A sliding-window layer left as the model keeps it (fate "window"): nothing fitted (no query used),
    no error, no token scored (importance NaN, when recorded: see CompressedKV.importance)."""
    zeros = torch.zeros(segments[0].lengths().shape[0], device=segments[0].lengths().device)
    n_heads = zeros.shape[0]
    importance = None if importance_len is None else torch.full((n_heads, importance_len), float("nan"), device="cpu")
    return LayerFit(
        list(segments),
        {"keys": 0.0, "bias": 0.0, "values": 0.0},
        0,
        zeros,
        zeros,
        importance,
        [0] * n_heads,
        [0] * n_heads,
    )


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
        i: layer_work(
            reference.layer_view(i),
            queries[i],
            budgets[i],
            opts,
            protected,
            None if key_scores is None else key_scores[i],
            None if extra is None else extra[i],
            scales[i],
            None if exact_scores is None else exact_scores[i],
        )
        for i in fitted
    }
    # Every layer's heads solved together, regrouped by budget (ragged budgets batched, not padded).
    solved = dict(zip(fitted, solve_layers([work[i] for i in fitted], opts)))
    fits = [
        finish_layer(work[i], solved[i], opts, protected, length)
        if i in work
        else window_fit(reference.layers[i], length)
        for i in range(len(queries))
    ]
    return fitted_cache(fits, reference.logical_len)
