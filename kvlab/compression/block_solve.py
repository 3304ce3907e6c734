"""Batched solves of Attention Matching's head blocks (kvlab.methods.families.compaction): one
:class:`BlockJob` per batch of heads, :func:`solve` for a batch, and :func:`solve_ragged`, which
regroups the heads of many batches (every layer's) by budget so that non-uniform head budgets are solved
batched, never padded to the largest budget. ``opts`` is Attention Matching's options
(kvlab.methods.families.am_recipe.AMOptions, a layer above: typed here by their base).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.options import Options
from kvlab.compression.solvers.compact import CompactBlock, FitSettings, compact_block
from kvlab.compression.solvers.keys import OMP, ExactFirst, GivenScores, GivenScoresUnion, HighestAttn, KeyChoice


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
    scale: float | None = None  # the layer's factor on q.k (kvlab.runtime.model.LayerGeometry.scaling; None: 1/sqrt(d))
    exact_scores: torch.Tensor | None = None  # [B, T]: rank the exact keys by these (exact_keys=kvzip)


def solve(job: BlockJob, opts: Options) -> CompactBlock:
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
            keys=job.keys,
            values=job.values,
            bias=torch.zeros(valid.shape, device=valid.device) if job.bias is None else job.bias.float(),
            index=torch.where(valid, index, -1),
            lengths=valid.sum(-1),
            timings={"keys": 0.0, "bias": 0.0, "values": 0.0},
            train_output=exact,
            train_mass=exact,
        )
    fit = FitSettings(
        nnls_iters=opts.nnls_iters, ridge=opts.ridge, value_fit=opts.value_fit, value_anchor=opts.value_anchor
    )
    return compact_block(
        job.queries,
        job.keys,
        job.values,
        int(job.budgets.max()),
        bias=job.bias,
        budgets=job.budgets,
        scale=job.scale,
        query_weights=job.weights,
        keys=key_choice(job, opts),
        fit=fit,
    )


def key_choice(job: BlockJob, opts: Options) -> KeyChoice:
    """How ``opts`` (its ``key_selection``) chooses the job's keys: OMP; the job's key scores (kvzip,
    or kvzip_union below a share of 1); HighestAttnKeys where the job has none; exact keys first
    where ``opts.exact_share`` > 0 (ExactFirst refuses OMP and the union)."""
    keys: KeyChoice
    if opts.key_selection == "omp":
        keys = OMP(opts.keys_per_iter, opts.refit_every, opts.drop_below, scoring=opts.scoring)
    elif job.key_scores is None:
        keys = HighestAttn(opts.scoring)
    elif opts.key_selection == "kvzip_union" and opts.kvzip_share < 1.0:
        keys = GivenScoresUnion(job.key_scores, opts.kvzip_share, opts.scoring)
    else:
        keys = GivenScores(job.key_scores)
    return ExactFirst(keys, opts.exact_share, job.exact_scores) if opts.exact_share > 0 else keys


#: Heads solved together differ in budget by at most this factor (the largest pads the others): a
#: head's solve costs about n t^2, so padding costs at most this squared on the smallest.
BUCKET_SPREAD = 1.05


def job_heads(job: BlockJob) -> list[BlockJob]:
    """One BlockJob per head of ``job`` (views, no copies): the unit :func:`solve_ragged` regroups."""

    def row(x: torch.Tensor | None, h: int) -> torch.Tensor | None:
        return None if x is None else x[h : h + 1]

    return [
        BlockJob(
            row(job.queries, h),
            row(job.keys, h),
            row(job.values, h),
            row(job.bias, h),
            job.budgets[h : h + 1],
            row(job.key_scores, h),
            row(job.weights, h),
            job.scale,
            row(job.exact_scores, h),
        )
        for h in range(job.keys.shape[0])
    ]


def stack_jobs(heads: list[BlockJob]) -> BlockJob:
    """The heads' jobs as one batch (they share shapes, scale and which inputs they have)."""

    def cat(xs: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if xs[0] is None else torch.cat(xs)

    return BlockJob(
        cat([j.queries for j in heads]),
        cat([j.keys for j in heads]),
        cat([j.values for j in heads]),
        cat([j.bias for j in heads]),
        cat([j.budgets for j in heads]),
        cat([j.key_scores for j in heads]),
        cat([j.weights for j in heads]),
        heads[0].scale,
        cat([j.exact_scores for j in heads]),
    )


def shape_key(job: BlockJob) -> tuple:
    """What heads must share to be solved in one batch."""
    return (
        tuple(job.queries.shape[1:]),
        tuple(job.keys.shape[1:]),
        tuple(job.values.shape[1:]),
        job.scale,
        job.bias is None,
        job.key_scores is None,
        job.weights is None,
        job.exact_scores is None,
    )


def buckets(heads: list[BlockJob], max_heads: int) -> list[list[int]]:
    """Indices of ``heads`` in batches to solve together: heads that keep every key apart (their solve
    is the block itself), the rest sorted by budget, at most ``max_heads`` a batch and its largest
    budget at most :data:`BUCKET_SPREAD` x its smallest."""

    def valid(j: BlockJob) -> int:
        return j.keys.shape[1] if j.bias is None else int(torch.isfinite(j.bias).sum())

    whole = [i for i, j in enumerate(heads) if int(j.budgets[0]) >= valid(j)]
    kept_whole = set(whole)
    rest = sorted((i for i in range(len(heads)) if i not in kept_whole), key=lambda i: int(heads[i].budgets[0]))
    out: list[list[int]] = [whole] if whole else []
    for i in rest:
        t = max(1, int(heads[i].budgets[0]))
        if out and out[-1] is not whole and out[-1]:
            first = max(1, int(heads[out[-1][0]].budgets[0]))
            if t <= BUCKET_SPREAD * first and len(out[-1]) < max_heads:
                out[-1].append(i)
                continue
        out.append([i])
    return out


def pad_slots(x: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """``x`` [B, t, ...] padded with ``fill`` along the slots to ``width``."""
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), fill)], dim=1)


def gather_heads(parts: list[tuple[CompactBlock, int, int]]) -> CompactBlock:
    """One layer's CompactBlock from its heads' rows of solved batches: (batch, row, heads in the batch),
    in head order; slots padded to the widest (bias -inf, index -1), each batch's timings shared
    evenly by its heads."""
    width = max(b.keys.shape[1] for b, _, _ in parts)

    def rows(get, fill: float) -> torch.Tensor:
        return torch.cat([pad_slots(get(b)[r : r + 1], width, fill) for b, r, _ in parts])

    def optional(name: str) -> torch.Tensor | None:
        # A head kept whole has no counts or errors (None): zeros, as its solve would report.
        values = [getattr(b, name) for b, _, _ in parts]
        known = next((v for v in values if v is not None), None)
        if known is None:
            return None
        return torch.cat(
            [torch.zeros_like(known[:1]) if v is None else v[r : r + 1] for v, (_, r, _) in zip(values, parts)]
        )

    exact = None
    if any(b.exact is not None for b, _, _ in parts):
        exact = torch.cat(
            [
                pad_slots(
                    torch.zeros_like(b.index[r : r + 1], dtype=torch.bool) if b.exact is None else b.exact[r : r + 1],
                    width,
                    False,
                )
                for b, r, _ in parts
            ]
        )
    scores = None
    if all(b.scores is not None for b, _, _ in parts):
        scores = torch.cat([b.scores[r : r + 1] for b, r, _ in parts])
    return CompactBlock(
        keys=rows(lambda b: b.keys, 0.0),
        values=rows(lambda b: b.values, 0.0),
        bias=rows(lambda b: b.bias, float("-inf")),
        index=rows(lambda b: b.index, -1),
        lengths=torch.cat([b.lengths[r : r + 1] for b, r, _ in parts]),
        timings={k: sum(b.timings.get(k, 0.0) / n for b, _, n in parts) for k in ("keys", "bias", "values")},
        scores=scores,
        fallbacks=optional("fallbacks"),
        nonfinite=optional("nonfinite"),
        train_output=optional("train_output"),
        train_mass=optional("train_mass"),
        exact=exact,
    )


def solve_ragged(jobs: list[BlockJob], opts: Options) -> list[CompactBlock]:
    """:func:`solve` of many batches of heads (e.g. every layer's), regrouped so that heads of like
    budgets are solved together: a head is never padded to a much larger budget than its own
    (:func:`buckets`), and a head keeping every key costs nothing. Returns one CompactBlock per job,
    its heads in order, with the same content as solving the job alone.

    A batch holds at most as many heads as the widest job (a layer's KV heads): its memory stays
    what one layer's solve holds, and the key scores' query chunks (sized by the heads x keys they
    hold, :func:`kvlab.compression.solvers.scores.streamed_mass`) stay as large.
    """
    heads = [(j, h, one) for j, job in enumerate(jobs) for h, one in enumerate(job_heads(job))]
    max_heads = max(job.keys.shape[0] for job in jobs)
    groups: dict[tuple, list[int]] = {}
    for i, (_, _, one) in enumerate(heads):
        groups.setdefault(shape_key(one), []).append(i)
    placed: dict[int, tuple[CompactBlock, int, int]] = {}
    for members in groups.values():
        for batch in buckets([heads[i][2] for i in members], max_heads):
            chosen = [members[k] for k in batch]
            solved = solve(stack_jobs([heads[i][2] for i in chosen]), opts)
            for row, i in enumerate(chosen):
                placed[i] = (solved, row, len(chosen))
    out, start = [], 0
    for job in jobs:
        n = job.keys.shape[0]
        out.append(gather_heads([placed[i] for i in range(start, start + n)]))
        start += n
    return out
