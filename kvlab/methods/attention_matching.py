"""Attention Matching (Zweiger, Fu, Guo, Kim, 2026, "Fast KV Compaction via Attention Matching").

Each KV head's document block is replaced by t compact keys (a subset of the
original keys, RoPE phases kept), one bias beta per key and refitted values,
chosen in closed form so that, for reference queries, the block's attention
output and attention mass are preserved (kvlab.methods.solvers). The
chat-template prefix stays as it is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvlab.context import Context
from kvlab.methods.base import EvictionMethod, Method, MethodError, Request, register
from kvlab.methods.budgets import head_budgets
from kvlab.methods.solvers import CompactBlock, compact_block, score_keys
from kvlab.metrics import block_errors
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
    token_importance,
)

QuerySource = Literal["repeat", "context", "self_study", "random", "question"]

# Above this many float32 logits per solve (B x n x T), layers are compacted in
# smaller groups: 2^28 is 1 GiB, well inside the lab machines' memory.
MAX_LOGITS_PER_SOLVE = 1 << 28


@dataclass(frozen=True)
class QueryOptions:
    """Where reference queries come from (shared by the methods that use them)."""

    query_source: QuerySource = field(default="repeat", metadata={
        "help": "reference queries: repeat (repeat-prefill), context (prefill), self_study, random, "
                "question (query-aware: the user's question)"})
    max_queries: int = field(default=2048, metadata={"help": "cap on reference queries per KV head (seeded subsample)"})
    seed: int = field(default=0, metadata={"help": "seed of the query subsample and of random queries"})
    self_study_tokens: int = field(default=256, metadata={"help": "self-study: generated tokens over all prompts"})


@dataclass(frozen=True)
class ScoredOptions(QueryOptions):
    """Reference queries and the HighestAttnKeys score over them."""

    # RMS is the published code's choice. On the embedded model, mean keeps the
    # model's own answers closer to the full cache at the same attention error
    # (`python -m benchmarks.attention_matching`); the default stays the paper's.
    scoring: Literal["rms", "mean", "max"] = field(default="rms", metadata={
        "help": "HighestAttnKeys score over queries: rms (the published code's), mean or max attention"})


@dataclass(frozen=True)
class AMOptions(ScoredOptions):
    key_selection: Literal["highest_attn", "omp"] = field(default="highest_attn", metadata={
        "help": "highest_attn (HighestAttnKeys) or omp (orthogonal matching pursuit on the mass)"})
    keys_per_iter: int = field(default=4, metadata={"help": "OMP: keys added per iteration (fast variant: 4)"})
    refit_every: int = field(default=2, metadata={"help": "OMP: refit the weights every this many iterations"})
    drop_below: float = field(default=-7.0, metadata={"help": "OMP: drop and replace keys whose beta falls below this"})
    nnls_iters: int = field(default=2, metadata={"help": "projected-gradient steps of the bounded bias fit"})
    ridge: float = field(default=1e-6, metadata={"help": "ridge of the value and bias least squares, relative to the Gram's mean diagonal"})
    budgets: Literal["uniform", "nonuniform"] = field(default="uniform", metadata={
        "help": "per-head budgets: uniform, or nonuniform from the model's sensitivity sweep (python -m kvlab budgets)"})
    chunk_size: int = field(default=0, metadata={"help": "compact the document in chunks of this many tokens (0: one block)"})
    on_policy: bool = field(default=False, metadata={
        "help": "re-extract each layer's queries with the layers before it already compacted (slow: one pass per layer)"})


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
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:cap]
    return q[:, torch.sort(keep).values]


@dataclass
class BlockJob:
    """The inputs of one batched solve: B heads' queries, keys, values, bias, budgets."""

    queries: torch.Tensor  # [B, n, d]
    keys: torch.Tensor  # [B, T, d]
    values: torch.Tensor  # [B, T, d]
    bias: torch.Tensor | None  # [B, T]
    budgets: torch.Tensor  # [B]


def solve(job: BlockJob, opts: AMOptions) -> CompactBlock:
    """Compact one batch of head blocks with the method's knobs.

    When every head may keep all its keys, the exact solution is the block
    itself (beta unchanged, values unchanged); least squares would only add
    rounding noise to it.
    """
    valid = torch.ones_like(job.keys[..., 0], dtype=torch.bool) if job.bias is None else torch.isfinite(job.bias)
    if bool((job.budgets >= valid.sum(-1)).all()):
        index = torch.arange(valid.shape[1]).expand_as(valid)
        return CompactBlock(
            keys=job.keys, values=job.values,
            bias=torch.zeros(valid.shape) if job.bias is None else job.bias.float(),
            index=torch.where(valid, index, -1), lengths=valid.sum(-1),
            timings={"keys": 0.0, "bias": 0.0, "values": 0.0},
        )
    return compact_block(
        job.queries, job.keys, job.values, int(job.budgets.max()),
        bias=job.bias, key_selection=opts.key_selection, scoring=opts.scoring,
        budgets=job.budgets, nnls_iters=opts.nnls_iters, keys_per_iter=opts.keys_per_iter,
        refit_every=opts.refit_every, drop_below=opts.drop_below, ridge=opts.ridge,
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
    block: PaddedView, queries: torch.Tensor, budgets: torch.Tensor, opts: AMOptions, score: bool = False
) -> tuple[list[CompactBlock], list[torch.Tensor], torch.Tensor | None]:
    """Compact one layer's block (all heads at once), chunk by chunk.

    block: keys/values [H_kv, T, d], bias [H_kv, T]; queries: [H_kv, n, d];
    budgets: [H_kv]. Returns each chunk's CompactBlock and its token offset,
    and with ``score`` each key's HighestAttnKeys score [H_kv, T] within its
    chunk (``CompactBlock.scores``; scored here only for a chunk kept whole,
    which the solver returns unscored).
    """
    spans = chunk_spans(block.keys.shape[1], opts.chunk_size)
    out, offsets, scores = [], [], []
    for (s, e), share in zip(spans, split_budget(budgets, spans, block.keys.shape[1])):
        bias = block.bias[:, s:e]
        job = BlockJob(queries, block.keys[:, s:e], block.values[:, s:e], None if bool((bias == 0).all()) else bias, share)
        out.append(solve(job, opts))
        offsets.append(torch.tensor(s))
        if score:
            block_scores = out[-1].scores
            if block_scores is None:
                block_scores = score_keys(job.queries, job.keys, job.bias, scoring=opts.scoring)
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


def train_errors(queries: torch.Tensor, block: PaddedView, seg: DenseSegment, n_max: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and mass errors [H_kv] on (a subsample of) the fitting queries themselves."""
    return block_errors(subsample(queries, n_max, 0), block, seg.view())[:2]


@dataclass
class LayerFit:
    """One layer's compacted segments and what the fit measured."""

    segments: list[Segment]
    timings: dict[str, float]
    n_queries: int
    train_output: torch.Tensor  # [H_kv]
    train_mass: torch.Tensor  # [H_kv]
    importance: torch.Tensor | None = None  # [H_kv, logical length] (see CompressedKV.importance)


def compact_layer(
    view: PaddedView, q: torch.Tensor, budgets: torch.Tensor, opts: AMOptions, protected: int,
    importance_len: int | None = None,
) -> LayerFit:
    """Attention Matching on one layer of a stored cache.

    view: the layer as attention sees it (a full or already compacted cache:
    an existing bias enters the targets); q: [H, n, d] reference queries;
    budgets: [H_kv] compact keys per head; protected: leading original tokens
    (the template prefix) left as they are; importance_len: the cache's
    logical length, to record each compacted token's key score (None: not recorded).
    """
    keep = (view.token_index < protected) & (view.token_index >= 0)
    grouped = subsample(group_queries(q, view.keys.shape[0]), opts.max_queries, opts.seed)
    block = select_keys(view, ~keep & torch.isfinite(view.bias))
    blocks, offsets, scores = compact_blocks(
        block, grouped.to(block.keys.device), budgets, opts, score=importance_len is not None
    )
    timings = {k: sum(b.timings.get(k, 0.0) for b in blocks) for k in ("keys", "bias", "values")}
    seg = to_segment(blocks, offsets, block.token_index)
    out_err, mass_err = train_errors(grouped, block, seg)
    kept = select_keys(view, keep)
    segments: list[Segment] = [seg]
    if bool(keep.any()):
        segments.insert(0, segment_from_view(kept, fate="template", keep_bias=False))
    importance = None if scores is None else token_importance(scores, block.token_index, importance_len)
    return LayerFit(segments, timings, grouped.shape[1], out_err, mass_err, importance)


def diagnostics(fits: list[LayerFit]) -> dict:
    """What the app and the CLI show of a fit: time per step, queries, train errors."""
    return {
        "fit_s": {k: sum(f.timings[k] for f in fits) for k in ("keys", "bias", "values")},
        "queries_per_head": [f.n_queries for f in fits],
        "train_attn_output_rel_err": torch.stack([f.train_output for f in fits]).tolist(),
        "train_attn_mass_rel_err": torch.stack([f.train_mass for f in fits]).tolist(),
    }


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
) -> CompressedKV:
    """Attention Matching on every layer of ``reference`` (see :func:`compact_layer`).

    queries: per layer [H, n, d]; budgets: [n_layers, H_kv]. Re-compacting an
    already compacted cache works the same way: its bias is part of the targets.
    record_importance: fill ``importance`` with each compacted token's key score.
    """
    length = reference.logical_len if record_importance else None
    fits = [
        compact_layer(reference.layer_view(i), q, budgets[i], opts, protected, length)
        for i, q in enumerate(queries)
    ]
    return fitted_cache(fits, reference.logical_len)


class QuerySourced:
    """Methods fitted on QueryOptions' reference queries: query-aware only when those are the question's."""

    query_aware_when = "query_source=question"

    def uses_question(self) -> bool:
        return self.options.query_source == "question"  # type: ignore[attr-defined]


@register
class AttentionTopK(QuerySourced, EvictionMethod):
    """The key selection of Attention Matching alone: the paper's eviction baseline."""

    name = "attention_topk"
    summary = "keep the keys the reference queries attend to most, bias 0, values as they were"
    paper = "Zweiger et al., 2026 (the eviction baseline of Attention Matching's ablations)"
    Options = ScoredOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        ctx, opts = req.ctx, self.options
        out = []
        for layer, q in enumerate(reference_queries(ctx, opts, req.question)):
            keys = ctx.full.keys[layer][:, ctx.prefix_len :]
            grouped = subsample(group_queries(q, keys.shape[0]), opts.max_queries, opts.seed + layer)
            out.append(score_keys(grouped.to(keys.device), keys, scoring=opts.scoring))
        return out


@register
class AttentionMatching(QuerySourced, Method):
    name = "attention_matching"
    summary = "compact keys + per-key bias + refitted values matching attention output and mass (closed form)"
    paper = "Zweiger, Fu, Guo, Kim, 2026, Fast KV Compaction via Attention Matching (arXiv 2602.16284)"
    Options = AMOptions

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        budgets = head_budgets(ctx.lm, req, opts.budgets)
        req.progress(0.3, f"reference queries: {opts.query_source}")
        start = time.perf_counter()
        if opts.on_policy:
            stored, queries_s = self._on_policy(req, budgets)
        else:
            queries = reference_queries(ctx, opts, req.question)
            queries_s = time.perf_counter() - start
            req.progress(0.4, "fitting keys, biases and values")
            stored = compact_cache(ctx.full.stored, queries, budgets, opts, ctx.prefix_len, req.record_importance)
        stored.meta = {
            "method": self.name,
            "query_source": opts.query_source,
            "key_selection": opts.key_selection,
            **stored.meta,
            "fit_s": {"queries": queries_s, **stored.meta["fit_s"]},
        }
        return stored

    def _on_policy(self, req: Request, budgets: torch.Tensor) -> tuple[CompressedKV, float]:
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
            fits.append(compact_layer(full.layer_view(layer), q, budgets[layer], opts, ctx.prefix_len, length))
            req.progress(0.3 + 0.3 * (layer + 1) / ctx.lm.n_layers, f"on-policy: layer {layer + 1}")
        return fitted_cache(fits, full.logical_len), queries_s
