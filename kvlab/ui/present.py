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
from typing import Any, Callable, Hashable, TypeVar

from gradio.components.plot import PlotData

from kvlab import figures
from kvlab.context import Progress, no_progress
from kvlab.lab import DoneForIt, Prepared, RunSpec, Sweep, TokenFates, compare, explore, sweep_charts, sweep_label
from kvlab.lab.views import RunView, present
from kvlab.memo import compute_once, recently_used
from kvlab.ui.common import GPU_MAX_S, GPU_RUN_S, GPU_SWEEP_BASE_S, GPU_SWEEP_POINT_S, on_gpu

#: What shades the token view: (label, value); the value names an entry of TokenFates.levels.
INTENSITIES = [("method's score", "score"), ("question's attention (full cache)", "question"), ("none", "none")]
INTENSITY_DEFAULT = "score"
#: What each intensity measures, for the view's legend.
INTENSITY_NOTES = {
    "score": "the method's own score of the token",
    "question": "the attention the question and the answer pay the token in the full cache",
}

T = TypeVar("T")

COMPARE_COLUMNS = [
    "method",
    "ratio",
    "query-aware",
    "memory ratio",
    "output error",
    "output error (weighted)",
    "mass error",
    "log-ppl (full answer)",
    "compression s",
    "answer (compressed cache)",
]


def token_view(view: TokenFates | None, layer: int, head: int, intensity: str = INTENSITY_DEFAULT) -> tuple[str, str]:
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
    """The figures of one run (kvlab.lab.views.FigureJSON), as gr.Plot sends them (:func:`as_plot`); roles:
    the heads' roles map (None without roles)."""

    figures: tuple
    fit: tuple | None
    divergence: object
    roles: object


def as_plot(figure_json: str) -> PlotData:
    """A plotly figure's JSON as gr.Plot sends it (its postprocess passes PlotData through)."""
    return PlotData(type="plotly", plot=figure_json)


def drawn(view: RunView) -> Drawn:
    """The figures of a run as gr.Plot sends them, from the JSON made with the run (no plotly work here)."""
    made = view.figures
    if made is None:
        raise ValueError("a RunView without figures: kvlab.lab.views.present makes them")
    return Drawn(
        tuple(as_plot(f) for f in made.main),
        None if made.fit is None else tuple(as_plot(f) for f in made.fit),
        as_plot(made.divergence),
        None if made.roles is None else as_plot(made.roles),
    )


class Recent:
    """Values kept per key, the ``size`` most recently used, each made once however many pages race
    for it (kvlab.memo.compute_once). Thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._making: dict[Hashable, Future] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The value kept for ``key``, else ``make()``'s (kept, the least recently used dropped)."""

        def keep(made: T) -> None:
            self._kept[key] = made
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

        return compute_once(self._lock, self._making, key, lambda: recently_used(self._kept, key), make, keep)

    def has(self, key: Hashable) -> bool:
        """Whether a value is kept for ``key`` now (:meth:`get` would return it at once)."""
        with self._lock:
            return key in self._kept


#: Token views ((counts line, HTML)) kept per configuration (kvlab.results.RunKey.digest), layer, head
#: and intensity, the most recently used.
TOKEN_VIEWS_KEPT = 64
_token_views = Recent(TOKEN_VIEWS_KEPT)


def token_view_for(digest: str, view: TokenFates, layer: int, head: int, intensity: str) -> tuple[str, str]:
    """:func:`token_view` of a run's configuration, made once per layer, head and intensity while kept
    (its HTML, about 0.03 s of the interpreter per page served otherwise)."""
    return _token_views.get((digest, layer, head, intensity), lambda: token_view(view, layer, head, intensity))


@on_gpu(duration=GPU_RUN_S)
def run_view(spec: RunSpec, progress: Progress = no_progress, before: tuple[Prepared, ...] = ()) -> RunView:
    """The heavy part of ``/run``: kvlab.lab.explore, then :func:`present` (figures are drawn after, by :func:`draw`).

    ``progress`` may be a ``gr.Progress`` (it is picklable; a lambda would not be); ``before``: what the run's
    own preparation did just before it (kvlab.ui.common.prepared_first).
    """
    done = DoneForIt(
        any(p.prefilled_now for p in before),
        any(p.answer_s is not None for p in before),
        sum(p.wall_s for p in before),
        any(p.compress_s is not None for p in before),
    )
    return present(explore(spec, progress, done))


@dataclass
class SweepView:
    """Everything ``/compare`` computes, as plain picklable data: the sweep and its three charts."""

    sweep: Sweep
    charts: tuple


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
    budgets: list[str] | None = None,
) -> SweepView:
    """The heavy part of ``/compare``: kvlab.lab.compare (on ``models`` when given, else ``model``; each
    method once per head-budgets value of ``budgets``) and its charts."""
    sweep = compare(text, file, methods, ratios, question, max_new_tokens, progress, model, models, budgets or ())
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
        text += (
            "\n\nEach model's own full cache (its ceiling): "
            + "; ".join(
                f"**{c.model}** answers {c.answer_full!r} (log-perplexity {c.logppl_full:.3f}, "
                f"{c.doc_tokens:,} document tokens)"
                for c in sweep.ceilings
            )
            + "."
        )
    if sweep.errors:
        text += "\n\n**Failed** (left out of the charts): " + "; ".join(
            f"{e.method} at {e.ratio:g}x{f' on {e.model}' if e.model else ''} ({e.message})" for e in sweep.errors
        )
    return text


def compare_rows(sweep: Sweep) -> list[list]:
    """The comparison table's rows (see COMPARE_COLUMNS), one per (method, ratio)."""
    return [
        [
            sweep_label(sweep, r),
            r.ratio,
            "yes" if a else "no",
            round(r.memory_ratio, 2),
            round(r.attn_output_rel_err, 4),
            round(r.attn_output_rel_err_weighted, 4),
            round(r.attn_mass_rel_err, 4),
            round(r.logppl_compressed, 3),
            round(r.compress_s, 2),
            r.answer_compressed,
        ]
        for r, a in zip(sweep.results, sweep.query_aware)
    ]
