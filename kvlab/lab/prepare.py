"""Preparing a document ahead of a run: the prefill, then the chosen method's document-only work.

A front end calls :func:`prepare_document` as soon as a document is chosen,
so that the user's Run finds the slow part done. A Run that starts while the
preparation is still going waits for it rather than doing it again
(kvlab.context_store.ContextStore keeps one computation per document in flight,
and recorded query sources are made once per context under its lock). On the page,
a preparation runs in the background (kvlab.lab.background), bounded on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvlab import cancellation, models
from kvlab.context import Progress, no_progress
from kvlab.context_store import CONTEXTS
from kvlab.lab.explore import prepared_context, sub_progress
from kvlab.lab.inputs import InputError, check_answer_length, check_question, check_question_tokens, document_text
from kvlab.methods import get_method
from kvlab.pipeline import COMPRESSION_SPAN, DEFAULT_MAX_NEW_TOKENS, compressed, evaluation, has_evaluation

#: Each step's share of a preparation's progress, in prefills: on Gemma 3 270M at 8k-32k tokens a repeat
#: pass takes 1.1-1.6 times the prefill (docs/long-context.md) and the full cache's answer a few seconds.
#: Shares near the steps' real costs keep the time left read from the progress's rate (kvlab.lab.background)
#: honest as one step gives way to the next. A long compression (Method.long_compression) costs about three
#: to four prefills: the paper's recipe of Attention Matching at 16k tokens on Gemma 3 270M 265 s against a
#: 68 s prefill (docs/long-context.md), Cartridges on the story about three (docs/claims.md).
PREFILL_SHARE, METHOD_SHARE, ANSWER_SHARE, COMPRESS_SHARE = 1.0, 1.3, 0.1, 3.0


def progress_bands(shares: list[float], start: float = 0.02) -> list[tuple[float, float]]:
    """(start, width) of each step in [start, 1], in proportion to ``shares`` (a step of share 0 has width 0)."""
    total = sum(shares) or 1.0
    bands, lo = [], start
    for share in shares:
        width = (1.0 - start) * share / total
        bands.append((lo, width))
        lo += width
    return bands


@dataclass
class Prepared:
    """A prepared document: what was done now, and how long it took.

    prefilled_now: this call ran the prefill (else an earlier call had);
    method_s: seconds of the method's own preparation (reference queries...);
    answer_s: seconds of the full cache's answer to the question given (None:
    no question, or it was already answered);
    compress_s: seconds of the compression at the ratio given, when the method's is long work
    (None: none asked, a short one, or it was already made).
    """

    model: str
    method: str
    doc_tokens: int
    prefill_s: float
    prefilled_now: bool
    method_s: float
    wall_s: float
    answer_s: float | None = None
    compress_s: float | None = None


def prepare_document(
    text: str | None,
    file: str | None,
    method: str,
    options: dict[str, Any] | None = None,
    model: str | None = None,
    progress: Progress = no_progress,
    question: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    ratio: float | None = None,
) -> Prepared:
    """Prefill the document (cached), run ``method``'s preparation for it (e.g. its reference
    queries), then answer ``question`` from the full cache (kept: every run on it reuses that answer);
    with ``ratio``, a method whose compression is long work (Method.long_compression) also compresses
    at that ratio, kept on the context where the run's kvlab.pipeline.compressed finds it.

    Raises the same user-facing errors as kvlab.lab.explore.explore, except for the
    question: one that a run would refuse is not answered here (the run says why).
    """
    start = time.perf_counter()
    document = document_text(text, file)
    method_obj = get_method(method, **(options or {}))
    progress(0.0, "loading the model")
    lm = models.get_model(model or None)
    try:
        asked = check_question(question or "")
        check_question_tokens(lm.tokenizer, asked)
        length = check_answer_length(max_new_tokens)
    except InputError:
        asked = None
    known = CONTEXTS.peek(lm, document)
    fresh = known is None
    # A question answered already takes no time: no share of the progress (the time left is read from it).
    answering = asked is not None and (fresh or not has_evaluation(known, asked, length))
    # A method reading the question compresses for one the run accepts; the run says why it refuses another.
    compressing = ratio is not None and method_obj.long_compression() and not (method_obj.uses_question() and not asked)
    prefill_band, method_band, answer_band, compress_band = progress_bands(
        [
            PREFILL_SHARE * fresh,
            METHOD_SHARE * method_obj.prepares(),
            ANSWER_SHARE * answering,
            COMPRESS_SHARE * compressing,
        ]
    )
    if fresh:  # the first chunk's report comes only once it is read (seconds on a long document)
        progress(prefill_band[0], "prefill")
    ctx, prefilled = prepared_context(lm, document, sub_progress(progress, *prefill_band))
    progress(method_band[0], f"{method_obj.name}'s document-only work")
    method_start = time.perf_counter()
    with cancellation.reporting(sub_progress(progress, *method_band, f"{method_obj.name}: ")):
        method_obj.prepare(ctx)
    method_s = time.perf_counter() - method_start
    answer_s = None
    if asked is not None and not has_evaluation(ctx, asked, length):
        progress(answer_band[0], "answering the question from the full cache")
        answer_s = evaluation(ctx, asked, length).answer_s
    compress_s = None
    if compressing:
        progress(compress_band[0], f"compressing with {method_obj.name} at {ratio:g}x")
        # Each step the method reports is a point where the job can be stopped (nobody waits, its bound).
        band, (lo, hi) = sub_progress(progress, *compress_band, f"{method_obj.name}: "), COMPRESSION_SPAN
        report = cancellation.checked(lambda f, desc: band((f - lo) / (hi - lo), desc))
        made, reused = compressed(ctx, method_obj, ratio, asked or "", report, record_importance=True)
        compress_s = None if reused else made.compress_s
    progress(1.0, "ready")
    return Prepared(
        lm.name,
        method_obj.name,
        ctx.doc_len,
        ctx.prefill_s,
        prefilled,
        method_s,
        time.perf_counter() - start,
        answer_s,
        compress_s,
    )
