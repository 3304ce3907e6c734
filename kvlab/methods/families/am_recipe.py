"""What the Attention Matching family shares (kvlab/methods/attention_matching.py, attention_topk.py,
summary_am.py; bounded generation's online compaction, kvlab.bounded.online): the paper and its
published configurations, the knobs (:class:`QueryOptions`, :class:`ScoredOptions`,
:class:`AMOptions`), the reference queries, the per-head budgets and :class:`QuerySourced`, the base
of the methods fitted on reference queries. The fit itself is kvlab.methods.families.compaction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvlab.compression.budget_profiles import BUDGET_ALIASES, BUDGET_SOURCES, HeadBudgets, allocation, spread, uniform
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.request import Request
from kvlab.context import Context
from kvlab.kernels import dispatch as kernels
from kvlab.prompts import question_tokens, repeat_tokens
from kvlab.queries import (
    context_queries,
    question_queries,
    random_queries,
    repeat_queries,
    self_study,
    self_study_queries,
)
from kvlab.runtime.attention import attention_weights, group_queries

PAPER = Paper("Zweiger, Fu, Guo, Kim", 2026, "Fast KV Compaction via Attention Matching", arxiv="2602.16284")

# The published configurations (the public code's algorithm configs). The
# beta bounds follow the key selection: [-3, 3] for HighestAttnKeys, at most
# 7 above and ``drop_below`` below for OMP (kvlab.compression.solvers.compact.compact_block);
# the values are always refitted by least squares. Plain OMP adds one key per
# iteration and refits every time; the fast variant four keys and every other time.
_HIGHEST_ATTN: dict[str, Any] = {"key_selection": "highest_attn", "scoring": "rms", "nnls_iters": 2}
_OMP: dict[str, Any] = {"key_selection": "omp", "keys_per_iter": 1, "refit_every": 1, "drop_below": -7.0}
# The headline runs' query configuration, ss-plus-repeat: one pool of the repeat and the self-study
# conversations, no weight per kind, capped at 50,000 queries per KV head.
_SS_PLUS_REPEAT: dict[str, Any] = {"query_source": "repeat", "self_study_weight": 1.0, "max_queries": 50000}
PRESETS: dict[str, dict[str, Any]] = {
    "AM-HighestAttnKeys-basic": {**_HIGHEST_ATTN, "on_policy": False},
    "AM-HighestAttnKeys": {**_HIGHEST_ATTN, "on_policy": True},
    "AM-OMP-basic": {**_OMP, "on_policy": False},
    "AM-OMP": {**_OMP, "on_policy": True},
    "AM-OMP-fast": {**_OMP, "keys_per_iter": 4, "refit_every": 2, "on_policy": True},
    # The paper's "fastest" headline rows (scripts/main/*-quality.sh): HighestAttnKeys on-policy on ss-plus-repeat.
    "AM-HighestAttnKeys-ss-plus-repeat": {**_HIGHEST_ATTN, "on_policy": True, **_SS_PLUS_REPEAT},
}

QuerySource = Literal["repeat", "context", "self_study", "random", "question"]


@dataclass(frozen=True)
class QueryOptions(Options):
    """Where reference queries come from (shared by the methods that use them)."""

    query_source: QuerySource = knob(
        "repeat",
        "reference queries: repeat (repeat-prefill), context (prefill), self_study, random, "
        "question (query-aware: the user's question)",
    )
    max_queries: int = knob(
        2048,
        "cap on reference queries per KV head (seeded subsample; 50000, the published runs' cap, keeps "
        "every repeat-pass query of the lab's documents)",
        low=1,
    )
    seed: int = knob(0, "seed of the query subsample and of random queries", low=0)
    self_study_tokens: int = knob(256, "self-study: generated tokens over all prompts", low=1)


@dataclass(frozen=True)
class ScoredOptions(QueryOptions):
    """Reference queries and the HighestAttnKeys score over them."""

    # RMS is the published code's choice. On the embedded model, mean keeps the
    # model's own answers closer to the full cache at the same attention error
    # (`python -m benchmarks.attention_matching`); the default stays the paper's.
    scoring: Literal["rms", "mean", "max"] = knob(
        "rms", "HighestAttnKeys score over queries: rms (the published code's), mean or max attention"
    )


@dataclass(frozen=True)
class AMOptions(ScoredOptions):
    key_selection: Literal["highest_attn", "omp", "kvzip", "kvzip_union"] = knob(
        "highest_attn",
        "highest_attn (HighestAttnKeys), omp (orthogonal matching pursuit on the mass), "
        "kvzip (KVzip's reconstruction scores per head, then the same bias and value fit) or "
        "kvzip_union (kvzip_share of each head's keys by KVzip's scores, the rest by HighestAttnKeys)",
    )
    kvzip_share: float = knob(0.5, "kvzip_union: share of each head's keys chosen by KVzip's scores", low=0.0, high=1.0)
    keys_per_iter: int = knob(4, "OMP: keys added per iteration (the fast variant's 4; plain OMP: 1)", low=1)
    refit_every: int = knob(
        2, "OMP: refit the weights every this many iterations (the fast variant's 2; plain OMP: 1)", low=1
    )
    # Also OMP's lower bound on beta: above 0 it would drop keys standing for a whole original key.
    drop_below: float = knob(-7.0, "OMP: drop and replace keys whose beta falls below this", high=0.0)
    nnls_iters: int = knob(2, "projected-gradient steps of the bounded bias fit", low=0)
    ridge: float = knob(
        1e-6, "ridge of the value and bias least squares, relative to the Gram's mean diagonal", low=0.0
    )
    budgets: Literal["auto", "uniform", "profile", "document", "global"] = knob(
        "auto",
        "per-head budgets, the total always T/r per head on average: auto (the paper's recipe: the model's "
        "profile where it has one, else uniform, said), uniform, profile (the model's profile from its "
        "sensitivity sweep, kvlab budgets), document (this document's reference queries: heads whose "
        "attention is concentrated keep more) or global (one ranking of the reference queries' attention "
        "across every head and layer)",
        aliases=BUDGET_ALIASES,
    )
    # Chunks keep the fit's cost linear in the document (one block's Gram grows like (T/r)^2): 8k-32k tokens on
    # Gemma 3 270M, exponent 1.03 in chunks against 1.31 in one block, for the same needles on books at 8k and
    # 16k tokens (10/24 at 2x in chunks, 11/24 in one block; docs/long-context.md). Documents up to a chunk
    # long are one block, as in the paper's QuALITY runs.
    compaction_chunk: int = knob(
        4096,
        "compact the document in chunks of this many tokens, each fitted on every reference query with each "
        "head's budget shared by the chunks' lengths (4096: the published code's fixed chunk size; 0: one block)",
        low=0,
    )
    on_policy: bool = knob(
        False,
        "each layer's queries read with the layers before it already compacted (one forward sweep that fits "
        "each layer as it reaches it)",
    )
    on_policy_sweep: bool = knob(
        True,
        "on_policy: in one forward sweep (true), or by re-reading the text once per layer as the paper's code "
        "does (false: the same cache, about L times slower; the reference the sweep is tested against)",
    )
    value_fit: Literal["least_squares", "original"] = knob(
        "least_squares",
        "least_squares (the paper's refitted values) or original (keep the kept keys' own values, fit only beta)",
    )
    value_anchor: float = knob(
        0.0,
        "ridge pulling the fitted values toward the kept keys' own values instead of toward 0, relative to "
        "the Gram's mean diagonal (0: the paper's fit)",
        low=0.0,
    )
    self_study_weight: float = knob(
        0.0, "self-study queries added to query_source's, each weighted this much in the fit (0: none)", low=0.0
    )
    exact_share: float = knob(
        0.0,
        "share of each head's budget kept as exact tokens (own key and value, bias 0, outside the fit); the "
        "compact keys fit only what they leave unexplained (0: none; 1: eviction)",
        low=0.0,
        high=1.0,
    )
    exact_keys: Literal["kvzip", "attention"] = knob(
        "kvzip",
        "exact_share: which keys stay exact: kvzip (KVzip's reconstruction scores) or attention (the "
        "reference queries' HighestAttnKeys scores)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.exact_share > 0 and self.key_selection in ("omp", "kvzip_union"):
            raise MethodError(
                "exact_share needs key_selection=highest_attn or kvzip (the compact keys are the best "
                "remaining keys by one score)"
            )
        if self.budgets in ("document", "global") and self.on_policy:
            raise MethodError(f"budgets={self.budgets} reads the reference queries before the fit: not on-policy")
        if self.value_fit == "original" and self.value_anchor > 0:
            raise MethodError("value_anchor needs value_fit=least_squares (value_fit=original fits no values)")
        if self.self_study_weight > 0 and self.query_source == "self_study":
            raise MethodError("self_study_weight mixes self-study queries into another query_source")


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


def on_policy_segments(ctx: Context, opts: AMOptions, question: str | None) -> list[torch.Tensor]:
    """What the on-policy pass reads, each segment [n_k] on its own right after the document (as the
    paper's code re-reads each conversation over the context's cache): the source's tokens
    (:func:`source_tokens`), then, with ``self_study_weight``, each self-study conversation
    (kvlab.queries.SelfStudy.turns)."""
    ids = source_tokens(ctx, opts, question)
    if opts.self_study_weight == 0:
        return [ids]
    return [ids, *(turn.to(ids.device) for turn in self_study(ctx, opts.self_study_tokens).turns)]


def queries_text(details: dict) -> str | None:
    """A fit's reference queries in words from a run's details (kvlab.methods.families.document_fit.query_meta):
    "repeat + self_study (weight 1), 6,144-8,010 per KV head (cap 50,000), on-policy (one sweep)"; None
    for a run without them."""
    if "query_kinds" not in details:
        return None
    kinds = " + ".join(details["query_kinds"])
    if "self_study" in details["query_kinds"][1:]:
        kinds += f" (weight {details['self_study_weight']:g})"
    # Per layer; a sliding-window layer fits nothing (0): the count is the fitted layers'.
    counts = [c for c in details.get("queries_per_head") or [] if c] or [0]
    low, high = min(counts), max(counts)
    count = f"{low:,}" if low == high else f"{low:,}-{high:,}"
    policy = {"no": "off-policy", "sweep": "on-policy (one sweep)", "reread": "on-policy (re-read per layer)"}
    return f"{kinds}, {count} per KV head (cap {details['max_queries']:,}), {policy[details['on_policy']]}"


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
    weights = torch.cat(
        [
            torch.ones(grouped.shape[:2], device=grouped.device),
            torch.full(more.shape[:2], opts.self_study_weight, device=grouped.device),
        ],
        dim=1,
    )
    return torch.cat([grouped, more], dim=1), weights


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
    """The compact keys per head for ``opts.budgets`` (kvlab.compression.budget_profiles.allocation): ``auto``
    the model's profile where it has one, else uniform with the reason; ``document`` (how concentrated
    each head's attention is) and ``global`` read the reference ``queries`` (per layer [H, n, d];
    MethodError without them: not on-policy)."""

    def read() -> list[torch.Tensor]:
        if queries is None:
            raise MethodError(f"budgets={opts.budgets} reads the reference queries before the fit: not on-policy")
        return queries

    return allocation(
        req,
        opts.budgets,
        uniform(req),
        lambda: attention_scores(req.ctx, read(), opts),
        lambda: HeadBudgets(
            document_budgets(req.ctx, read(), opts, req.doc_budget), "document", BUDGET_SOURCES["document"]
        ),
    )


class QuerySourced:
    """Methods fitted on QueryOptions' reference queries: query-aware only when those are the question's."""

    query_aware_when = "query_source=question"

    def uses_question(self) -> bool:
        return self.options.query_source == "question"  # type: ignore[attr-defined]

    def long_compression(self) -> bool:
        """On-policy: the compression reads the reference text through the model (one pass, or one per layer)."""
        return bool(getattr(self.options, "on_policy", False))  # type: ignore[attr-defined]

    def prepare(self, ctx: Context) -> None:
        """Record the reference queries of a query-agnostic source (on-policy ones depend on the fit)."""
        opts = self.options  # type: ignore[attr-defined]
        if not self.uses_question() and not getattr(opts, "on_policy", False):
            reference_queries(ctx, opts, None)
        if getattr(opts, "self_study_weight", 0.0) > 0:
            self_study_queries(ctx, opts.self_study_tokens)
