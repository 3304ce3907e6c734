"""One lab run: answer from the full cache, compress, answer again, measure.

The CLI and the app both call :func:`run`; the numbers they show come from
the :class:`RunResult` it returns.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Hashable, TypeVar

import torch

from kvlab.compression.interface import Method
from kvlab.compression.request import Request
from kvlab.context import Context, Memo, Progress, no_progress
from kvlab.metrics import (
    HeadErrors,
    head_errors,
    log_perplexity,
    output_shares,
    reference_attention,
    weighted_output_error,
)
from kvlab.prompts import question_tokens
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import Generation, greedy, greedy_from_draft
from kvlab.runtime.hooks import QueryCapture

T = TypeVar("T")

DEFAULT_MAX_NEW_TOKENS = 48


@dataclass
class Evaluation:
    """The full cache's answer to a question, and the held-out queries it produced.

    queries: per layer [H, n, d], the question turn's and the answer tokens'
    queries over the full cache: what the compressed cache must serve, never
    used for fitting.
    """

    question: str
    question_ids: torch.Tensor
    answer: Generation
    queries: list[torch.Tensor]
    answer_s: float


@dataclass(frozen=True)
class EvaluationKey(Memo):
    """Where :func:`evaluation` keeps the full cache's answer of ``max_new_tokens`` to ``question``."""

    store = "evaluations"
    max_new_tokens: int


def evaluation(ctx: Context, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> Evaluation:
    """Answer ``question`` from the full cache, once per (context, question, length).

    Racing requests for the same question wait for one answer; the context
    remembers a bounded number of questions (kvlab.context.Context.cached).
    """

    def make() -> Evaluation:
        ids = question_tokens(ctx.lm.tokenizer, question)
        capture = QueryCapture(ctx.lm.n_layers)
        start = time.perf_counter()
        answer = greedy(ctx.lm, ctx.full.stored, ids, max_new_tokens, capture)
        return Evaluation(question, ids, answer, capture.per_layer(), time.perf_counter() - start)

    return ctx.cached(EvaluationKey(max_new_tokens, question=question), make)


def has_evaluation(ctx: Context, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> bool:
    """Whether the full cache's answer to ``question`` is already kept (a run would reuse it)."""
    return ctx.holds(EvaluationKey(max_new_tokens, question=question))


@dataclass
class RunResult:
    """Everything one run measured (the CLI's JSON contract; extra keys may be added)."""

    method: str
    ratio: float
    model: str
    question: str
    doc_tokens: int
    context_tokens: int
    kept_tokens_mean: float
    bytes_full: int
    bytes_compressed: int
    memory_ratio: float
    memory_breakdown: dict[str, int]
    prefill_s: float
    compress_s: float
    answer_full_s: float
    answer_compressed_s: float
    answer_full: str
    answer_compressed: str
    attn_output_rel_err: float
    attn_mass_rel_err: float
    logppl_full: float
    logppl_compressed: float
    per_head: dict[str, list[list[float]]]
    details: dict = field(default_factory=dict)
    # Along the full cache's answer (teacher-forced): each token's text and its
    # log-probability under the full and the compressed cache, and the first
    # token where the compressed cache's own greedy answer leaves it (None: never).
    answer_tokens: list[str] = field(default_factory=list)
    answer_logprobs_full: list[float] = field(default_factory=list)
    answer_logprobs_compressed: list[float] = field(default_factory=list)
    first_divergence: int | None = None
    # The output error weighted by each head's share of its layer's output (metrics.output_shares;
    # per_head["output_share"]): per layer sum_h share_h err_h, averaged over the layers.
    attn_output_rel_err_weighted: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def numerics_warning(self) -> str | None:
        """One line naming the heads whose fit fell back or had non-finite results replaced, or None.

        Read from ``details``: per layer and KV head counts, ``solver_fallbacks`` and
        ``nonfinite_replaced`` (kvlab.methods.families.compaction.diagnostics).
        """
        parts = []
        for key, what in (
            ("solver_fallbacks", "a solve fell back to zeros"),
            ("nonfinite_replaced", "non-finite values were replaced"),
        ):
            rows = self.details.get(key) or []
            heads = [f"layer {i} head {h}" for i, row in enumerate(rows) for h, n in enumerate(row) if n]
            if heads:
                shown = ", ".join(heads[:6]) + (f" and {len(heads) - 6} more" if len(heads) > 6 else "")
                parts.append(f"{what} in {len(heads)} head(s): {shown}")
        return ("Warning: " + "; ".join(parts) + ".") if parts else None


@dataclass
class Run:
    """A run's result plus the objects the figures draw from.

    compression_reused / answer_reused: the stored cache, and its answer to
    this question, were kept from an earlier run with the same settings
    (:func:`compressed`, :func:`answered`), so this run did not redo them.
    """

    result: RunResult
    stored: CompressedKV
    ctx: Context
    evaluation: Evaluation
    compression_reused: bool = False
    answer_reused: bool = False

    def fitted_biases(self) -> list[float]:
        """Every stored key's fitted bias (Attention Matching's beta); empty for methods without one."""
        out: list[float] = []
        for layer in self.stored.layers:
            for seg in layer:
                bias = getattr(seg, "bias", None)
                if seg.fate == "compacted" and bias is not None:
                    out.extend(bias[torch.isfinite(bias)].tolist())
        return out


def window_details(ctx: Context, stored: CompressedKV, errors: HeadErrors) -> dict:
    """For a model with sliding-window layers, what its ratio is counted over: the layers a method
    compresses (their memory ratio, mean kept keys and mean attention errors: a window layer's are
    0, which the means over every layer include), and the window layers' bytes in each cache
    (``bytes_full`` and ``bytes_compressed`` count them): the same, unless the method rewrote the
    context (no_context, a summary), whose window layers hold its own tokens. Empty for any other model."""
    windows = [g.window for g in ctx.lm.geometry]
    layers, full = ctx.lm.compressed_layers, ctx.full.stored
    if len(layers) == len(windows):
        return {}
    kept = stored.kept_per_head().float()
    return {
        "layer_windows": windows,  # per layer, its sliding window (None: a full-attention layer)
        "window_layers_bytes": full.layers_nbytes([i for i, w in enumerate(windows) if w is not None]),
        "window_layers_bytes_compressed": stored.layers_nbytes([i for i, w in enumerate(windows) if w is not None]),
        "compressed_layers": layers,
        "compressed_layers_bytes_full": full.layers_nbytes(layers),
        "compressed_layers_bytes_compressed": stored.layers_nbytes(layers),
        "compressed_layers_memory_ratio": full.layers_nbytes(layers) / max(1, stored.layers_nbytes(layers)),
        "compressed_layers_kept_tokens_mean": float(kept[layers].mean()) if layers else 0.0,
        "compressed_layers_attn_output_rel_err": float(errors.output[layers].mean()) if layers else 0.0,
        "compressed_layers_attn_mass_rel_err": float(errors.mass[layers].mean()) if layers else 0.0,
    }


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """The first position where two token sequences differ (one ending early counts), or None if equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@dataclass
class Compressed:
    """A stored cache and how long the method took to make it."""

    stored: CompressedKV
    compress_s: float


@dataclass
class Answered:
    """What a stored cache gave for one question: its greedy answer, and the measures against the full cache.

    logprobs: [m] the full cache's answer teacher-forced under this cache.
    """

    answer: Generation
    answer_s: float
    errors: HeadErrors
    logprobs: torch.Tensor
    shares: torch.Tensor  # [n_layers, H_kv] each head's share of its layer's output (metrics.output_shares)


@dataclass(frozen=True)
class StoredCache(Memo):
    """Where :func:`compressed` keeps a stored cache: the method's name and options, the ratio, and
    the question only for methods that read it (the others serve every question)."""

    store = "runs"
    method: str
    options: Hashable
    ratio: float
    record_importance: bool

    @classmethod
    def of(cls, method: Method, ratio: float, question: str, record_importance: bool) -> StoredCache:
        """The key of ``method``'s stored cache at ``ratio`` for ``question``."""
        return cls(
            method.name, method.options, ratio, record_importance, question=question if method.uses_question() else None
        )


@dataclass(frozen=True)
class StoredAnswer(Memo):
    """Where :func:`answered` keeps a stored cache's answer of ``max_new_tokens`` to ``question``."""

    store = "runs"
    cache: StoredCache
    max_new_tokens: int


@dataclass(frozen=True)
class ReferenceAttention(Memo):
    """Where :func:`answered` keeps the full cache's side of the errors on ``question``'s evaluation."""

    max_new_tokens: int


#: The span of a run's progress (0-1) its compression reports in: a method's ``req.progress`` fractions lie
#: within it (kvlab.lab.prepare maps them onto its own step when it compresses ahead of a run).
COMPRESSION_SPAN = (0.25, 0.6)


def kept(ctx: Context, memo: Memo, make: Callable[[], T]) -> tuple[T, bool]:
    """``ctx.cached(memo, make)`` and whether it was there already."""
    found = ctx.holds(memo)
    return ctx.cached(memo, make), found


def compressed(
    ctx: Context, method: Method, ratio: float, question: str, progress: Progress, record_importance: bool
) -> tuple[Compressed, bool]:
    """The stored cache for these settings, made once and kept on the context (least recently
    used first out, within the byte budget), and whether it was reused."""

    def make() -> Compressed:
        start = time.perf_counter()
        stored = method.compress(Request(ctx, ratio, question, progress, record_importance))
        return Compressed(stored, time.perf_counter() - start)

    return kept(ctx, StoredCache.of(method, ratio, question, record_importance), make)


def reference_and_shares(ctx: Context, queries: list[torch.Tensor]) -> tuple[list, torch.Tensor]:
    """The full cache's side of a question's errors: its attention of the held-out queries and each
    head's share of its layer's output (the same for every cache compared on this question)."""
    full = reference_attention(ctx.full.stored, queries)
    return full, output_shares(ctx.lm, full)


def answered(
    ctx: Context, cache: StoredCache, stored: CompressedKV, ev: Evaluation, max_new_tokens: int
) -> tuple[Answered, bool]:
    """The stored cache's answer to ``ev``'s question and its measures, kept per question, and whether reused."""

    def make() -> Answered:
        # The full cache's answer is the draft: one pass scores it teacher-forced and checks how far
        # this cache's own greedy answer follows it; only the rest is decoded step by step.
        start = time.perf_counter()
        drafted = greedy_from_draft(ctx.lm, stored, ev.question_ids, ev.answer.ids, max_new_tokens)
        answer_s = time.perf_counter() - start
        # The full cache's side of the errors is the same for every cache compared on this question.
        full, shares = ctx.cached(
            ReferenceAttention(max_new_tokens, question=ev.question), lambda: reference_and_shares(ctx, ev.queries)
        )
        errors = head_errors(ctx.full.stored, stored, ev.queries, full=full, lm=ctx.lm)
        return Answered(drafted.generation, answer_s, errors, drafted.draft_logprobs, shares)

    return kept(ctx, StoredAnswer(cache, max_new_tokens, question=ev.question), make)


def run(
    ctx: Context,
    method: Method,
    ratio: float,
    question: str,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: Progress = no_progress,
    record_importance: bool = False,
) -> Run:
    """Compress ``ctx`` with ``method`` at ``ratio`` and compare it with the full cache on ``question``.

    record_importance: keep the method's per-token scores on the stored cache
    (``CompressedKV.importance``, for the app's token view).
    """
    progress(0.0, "answering from the full cache")
    ev = evaluation(ctx, question, max_new_tokens)
    progress(COMPRESSION_SPAN[0], f"compressing with {method.name}")
    made, compression_reused = compressed(ctx, method, ratio, question, progress, record_importance)
    stored = made.stored
    progress(COMPRESSION_SPAN[1], "answering from the compressed cache, measuring errors")
    cache = StoredCache.of(method, ratio, question, record_importance)
    got, answer_reused = answered(ctx, cache, stored, ev, max_new_tokens)
    answer, errors, logprobs = got.answer, got.errors, got.logprobs
    kept = stored.kept_per_head().float()
    result = RunResult(
        method=method.name,
        ratio=ratio,
        model=ctx.lm.name,
        question=question,
        doc_tokens=ctx.doc_len,
        context_tokens=ctx.length,
        kept_tokens_mean=float(kept.mean()),
        bytes_full=ctx.full.nbytes,
        bytes_compressed=stored.nbytes,
        memory_ratio=ctx.full.nbytes / max(1, stored.nbytes),
        memory_breakdown=stored.breakdown(),
        prefill_s=ctx.prefill_s,
        compress_s=made.compress_s,
        answer_full_s=ev.answer_s,
        answer_compressed_s=got.answer_s,
        answer_full=ev.answer.text,
        answer_compressed=answer.text,
        attn_output_rel_err=errors.mean_output,
        attn_mass_rel_err=errors.mean_mass,
        logppl_full=log_perplexity(torch.tensor(ev.answer.logprobs, device="cpu")),
        logppl_compressed=log_perplexity(logprobs),
        per_head={
            "attn_output_rel_err": errors.output.tolist(),
            "attn_mass_rel_err": errors.mass.tolist(),
            "attn_mass_ratio": errors.mass_ratio.tolist(),
            "kept_tokens": kept.tolist(),
            "output_share": got.shares.tolist(),
        },
        details={**{k: v for k, v in stored.meta.items() if k != "method"}, **window_details(ctx, stored, errors)},
        answer_tokens=[ctx.lm.tokenizer.decode([t]) for t in ev.answer.ids],
        answer_logprobs_full=list(ev.answer.logprobs),
        answer_logprobs_compressed=logprobs.tolist(),
        first_divergence=first_divergence(ev.answer.ids, answer.ids),
        attn_output_rel_err_weighted=weighted_output_error(errors, got.shares),
    )
    progress(1.0, "done")
    return Run(result, stored, ctx, ev, compression_reused, answer_reused)
