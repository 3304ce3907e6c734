"""Preparing a document ahead of a run: the prefill, then the chosen method's document-only work.

A front end calls :func:`prepare_document` as soon as a document is chosen,
so that the user's Run finds the slow part done. A Run that starts while the
preparation is still going waits for it rather than doing it again
(kvlab.context.ContextStore keeps one computation per document in flight,
and recorded query sources are made once per context under its lock).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvlab.context import Progress, no_progress
from kvlab.lab.explore import prepared_context, sub_progress
from kvlab.lab.inputs import document_text
from kvlab.methods import get_method
from kvlab import models


@dataclass
class Prepared:
    """A prepared document: what was done now, and how long it took.

    prefilled_now: this call ran the prefill (else an earlier call had);
    method_s: seconds of the method's own preparation (reference queries...).
    """

    model: str
    method: str
    doc_tokens: int
    prefill_s: float
    prefilled_now: bool
    method_s: float
    wall_s: float


def prepare_document(
    text: str | None,
    file: str | None,
    method: str,
    options: dict[str, Any] | None = None,
    model: str | None = None,
    progress: Progress = no_progress,
) -> Prepared:
    """Prefill the document (cached) and run ``method``'s preparation for it (e.g. its reference queries).

    Raises the same user-facing errors as kvlab.lab.explore.explore.
    """
    start = time.perf_counter()
    document = document_text(text, file)
    method_obj = get_method(method, **(options or {}))
    progress(0.0, "loading the model")
    lm = models.get_model(model or None)
    ctx, prefilled = prepared_context(lm, document, sub_progress(progress, 0.02, 0.6, "preparing: "))
    progress(0.62, f"preparing {method_obj.name}")
    method_start = time.perf_counter()
    method_obj.prepare(ctx)
    progress(1.0, "ready")
    return Prepared(
        lm.name, method_obj.name, ctx.doc_len, ctx.prefill_s, prefilled,
        time.perf_counter() - method_start, time.perf_counter() - start,
    )
