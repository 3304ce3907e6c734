"""Presenting results: a run or a sweep as texts, tables and figures (plain picklable data).

The two heavy functions, :func:`run_view` and :func:`sweep_view`, are what a
ZeroGPU Space runs on its GPU (``spaces.GPU``): they take and return only
plain data (no model, no cache), because ZeroGPU runs them in a forked
worker and pickles what they return.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvlab import figures
from kvlab.context import Progress, no_progress
from kvlab.memo import MISSING, compute_once
from kvlab.lab import Sweep, TokenFates, compare, explore
from kvlab.lab.views import RunView, present
from kvlab.pipeline import RunResult
from kvlab.ui.common import GPU_MAX_S, GPU_RUN_S, GPU_SWEEP_BASE_S, GPU_SWEEP_POINT_S, on_gpu

#: What shades the token view: (label, value); the value names an entry of TokenFates.levels.
INTENSITIES = [("method's score", "score"), ("question's attention (full cache)", "question"), ("none", "none")]
INTENSITY_DEFAULT = "score"
#: What each intensity measures, for the view's legend.
INTENSITY_NOTES = {
    "score": "the method's own score of the token",
    "question": "the attention the question and the answer pay the token in the full cache",
}

COMPARE_COLUMNS = [
    "method", "ratio", "query-aware", "memory ratio", "output error", "mass error",
    "log-ppl (full answer)", "compression s", "answer (compressed cache)",
]


def token_view(
    view: TokenFates | None, layer: int, head: int, intensity: str = INTENSITY_DEFAULT
) -> tuple[str, str]:
    """(counts line, the document as HTML coloured by token fate) for one layer and KV head of a run.

    intensity: a value of INTENSITIES; tokens are shaded by that source's
    levels when the run has them, and the counts line says when it has not.
    """
    if view is None or not view.codes:
        return "Run a compression first: the document will appear here, coloured by what happened to each token.", ""
    layer = min(max(int(layer), 0), view.n_layers - 1)
    head = min(max(int(head), 0), view.n_kv_heads - 1)
    fates = view.fates(layer, head)
    n = len(view.token_texts)
    counts = figures.fate_counts(n, fates)
    parts = ", ".join(f"{c:,} {fate}" for fate, c in sorted(counts.items(), key=lambda kv: -kv[1]))
    line = f"Layer {layer}, KV head {head}: {parts} (of {n:,} context tokens)."
    levels, note = view.levels.get(intensity), None
    if levels is not None:
        note = INTENSITY_NOTES[intensity]
        line += f" Intensity: {note}, as a percentile within this head."
    elif intensity == "score":
        line += " This method has no per-token score: shown without intensity."
    segments = figures.fate_segments(view.token_texts, fates, levels=None if levels is None else levels[layer][head])
    return line, figures.bits_strip_html(n, fates) + figures.fate_html(segments, intensity=note)


@dataclass
class Drawn:
    """The figures of one run.

    figures: error, mass, kept, memory and time; fit: Attention Matching's
    bias histogram and fitting vs evaluation error (None for other methods);
    divergence: the answers token by token (kvlab.figures.divergence_figure).
    """

    figures: tuple
    fit: tuple | None
    divergence: object


def draw(view: RunView) -> Drawn:
    """The figures of a run (plotly, on the CPU: no model or compute slot needed)."""
    r = view.result
    fit = None
    if view.fitted_biases is not None:
        fit = (
            figures.bias_histogram(view.fitted_biases),
            figures.fit_vs_eval_figure(r.details["train_attn_output_rel_err"], r.per_head["attn_output_rel_err"]),
        )
    return Drawn(
        (
            figures.error_heatmap(r.per_head),
            figures.mass_heatmap(r.per_head),
            figures.kept_heatmap(r.per_head),
            figures.memory_figure(r.bytes_full, r.bytes_compressed, r.memory_breakdown),
            figures.time_figure(view.timings, view.notes, total=view.wall_s),
        ),
        fit,
        figures.divergence_figure(r.answer_tokens, r.answer_logprobs_full, r.answer_logprobs_compressed, r.first_divergence),
    )


#: Drawn figures kept per configuration (kvlab.results.RunKey.digest), most recently used.
DRAWN_KEPT = 64
_drawn: OrderedDict[str, Drawn] = OrderedDict()
_drawn_lock = threading.Lock()
_drawing: dict[str, Future] = {}


def drawn_for(digest: str, view: RunView) -> Drawn:
    """:func:`draw` of ``view``, drawn once per configuration while it is among the DRAWN_KEPT last used.

    Building a run's plotly figures costs about 0.1 s of the interpreter's one
    lock: thirty pages answered from the result store at once would queue for
    it, so pages asking for the same configuration's figures at once share
    one drawing (kvlab.memo.compute_once). The figures are only read afterwards.
    """

    def find() -> Drawn | object:
        if digest not in _drawn:
            return MISSING
        _drawn.move_to_end(digest)
        return _drawn[digest]

    def keep(made: Drawn) -> None:
        _drawn[digest] = made
        while len(_drawn) > DRAWN_KEPT:
            _drawn.popitem(last=False)

    return compute_once(_drawn_lock, _drawing, digest, find, lambda: draw(view), keep)


@on_gpu(duration=GPU_RUN_S)
def run_view(
    text: str | None,
    file: str | None,
    method: str,
    ratio: float,
    question: str,
    max_new_tokens: int,
    options: dict[str, Any],
    model: str | None,
    progress: Progress = no_progress,
) -> RunView:
    """The heavy part of ``/run``: kvlab.lab.explore, then :func:`present` (figures are drawn after, by :func:`draw`).

    ``progress`` may be a ``gr.Progress`` (it is picklable; a lambda would not be).
    """
    return present(explore(text, file, method, ratio, question, max_new_tokens, options, progress, model))


@dataclass
class SweepView:
    """Everything ``/compare`` computes, as plain picklable data: the sweep and its three charts."""

    sweep: Sweep
    charts: tuple


def run_label(sweep: Sweep, r: RunResult) -> str:
    """A run's line and row name: its method, and its model on a sweep over several models."""
    return f"{r.method} · {r.model}" if len(sweep.ceilings) > 1 else r.method


def sweep_charts(sweep: Sweep) -> tuple:
    """(output error, mass error, log-perplexity) against the ratio, one line per method (and model).

    The full cache's log-perplexity is drawn as a reference on a one-model sweep; on several models each
    has its own (the status line lists them), so none is drawn."""
    points = [
        {"method": run_label(sweep, r), "ratio": r.ratio, "output": r.attn_output_rel_err,
         "mass": r.attn_mass_rel_err, "logppl": r.logppl_compressed}
        for r in sweep.results
    ]
    one_model = len(sweep.ceilings) <= 1
    return (
        figures.sweep_figure(points, "output", "Attention-output error vs ratio (held-out queries)", "relative error"),
        figures.sweep_figure(points, "mass", "Attention-mass error vs ratio (held-out queries)", "relative error"),
        figures.sweep_figure(
            points, "logppl", "Log-perplexity of the full cache's answer vs ratio", "log-perplexity (nats/token)",
            reference=sweep.logppl_full if one_model else None, reference_label="full cache",
        ),
    )


def sweep_duration(text, file, methods, ratios, *args, **kwargs) -> int:  # noqa: ANN001 - spaces' signature
    """The ZeroGPU slot of a sweep: a base plus a share per (method, ratio, model), capped."""
    points = max(1, len(methods or []) * len(ratios or []) * max(1, len(kwargs.get("models") or [])))
    return int(min(GPU_MAX_S, GPU_SWEEP_BASE_S + GPU_SWEEP_POINT_S * points))


@on_gpu(duration=sweep_duration)
def sweep_view(
    text: str | None,
    file: str | None,
    methods: list[str],
    ratios: list[float],
    question: str,
    max_new_tokens: int,
    model: str | None,
    progress: Progress = no_progress,
    models: list[str] | None = None,
) -> SweepView:
    """The heavy part of ``/compare``: kvlab.lab.compare (on ``models`` when given, else ``model``) and its charts."""
    sweep = compare(text, file, methods, ratios, question, max_new_tokens, progress, model, models)
    return SweepView(sweep, sweep_charts(sweep))


def sweep_status(sweep: Sweep) -> str:
    """The sweep's headline: what ran, how long, and what failed."""
    methods = list(dict.fromkeys(r.method for r in sweep.results))
    ratios = sorted({r.ratio for r in sweep.results})
    prefill = "reused from an earlier run" if sweep.prefill_reused else f"{sweep.prefill_s:.1f} s, done now"
    text = (
        f"**{len(sweep.results)} runs**: {len(methods)} method(s) x {len(ratios)} ratio(s) "
        f"({', '.join(f'{r:g}x' for r in ratios)}) on {sweep.doc_tokens:,} document tokens with {sweep.model}"
        f"{''.join(f' and {c.model}' for c in sweep.ceilings[1:])}, "
        f"in {sweep.wall_s:.1f} s (prefill {prefill}). Full cache's log-perplexity of its own answer: "
        f"{sweep.logppl_full:.3f}."
    )
    if len(sweep.ceilings) > 1:
        text += "\n\nEach model's own full cache (its ceiling): " + "; ".join(
            f"**{c.model}** answers {c.answer_full!r} (log-perplexity {c.logppl_full:.3f}, "
            f"{c.doc_tokens:,} document tokens)" for c in sweep.ceilings
        ) + "."
    if sweep.errors:
        text += "\n\n**Failed** (left out of the charts): " + "; ".join(
            f"{e.method} at {e.ratio:g}x{f' on {e.model}' if e.model else ''} ({e.message})" for e in sweep.errors
        )
    return text


def compare_rows(sweep: Sweep) -> list[list]:
    """The comparison table's rows (see COMPARE_COLUMNS), one per (method, ratio)."""
    return [
        [
            run_label(sweep, r),
            r.ratio,
            "yes" if a else "no",
            round(r.memory_ratio, 2),
            round(r.attn_output_rel_err, 4),
            round(r.attn_mass_rel_err, 4),
            round(r.logppl_compressed, 3),
            round(r.compress_s, 2),
            r.answer_compressed,
        ]
        for r, a in zip(sweep.results, sweep.query_aware)
    ]
