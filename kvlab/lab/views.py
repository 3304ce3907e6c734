"""A finished Explore run as plain data: what a page shows, kept per configuration (kvlab.results).

:func:`present` turns a run (kvlab.lab.Explored, which holds the model and the
caches) into a :class:`RunView`: texts, token fates and the numbers the
figures are drawn from, and nothing else. A RunView is what the result store
keeps, what a ZeroGPU worker returns (it pickles), and what ``kvlab warm``
computes ahead of a workshop; no gradio here.
"""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass

from kvlab import figures
from kvlab.compression.budget_profiles import budgets_text
from kvlab.lab.explore import Explored
from kvlab.lab.fates import TokenFates
from kvlab.lab.head_roles import HeadRoles
from kvlab.methods.families.am_recipe import queries_text
from kvlab.pipeline import RunResult


def summary_markdown(ex: Explored) -> str:
    """The run's headline: method, ratio, verdict on the answers, memory, time and errors."""
    r = ex.run.result
    prefix = r.context_tokens - r.doc_tokens
    agree = figures.answers_agree(r.answer_full, r.answer_compressed)
    verdict = (
        "The two answers are **identical**."
        if r.answer_full.strip() == r.answer_compressed.strip()
        else f"The answers **differ** (word overlap {agree:.0%})."
    )
    expected = ""
    if ex.expected:
        mark = {True: "right", False: "**wrong**"}
        expected = (
            f" Expected answer (from the example): **{ex.expected[0]}**; the full cache's answer is "
            f"{mark[ex.full_right]}, the compressed cache's is {mark[ex.compressed_right]}."
        )
    prefill = (
        f"Prefill {r.prefill_s:.2f} s: reused (done before this run), not re-run."
        if ex.prefill_reused
        else f"Prefill {r.prefill_s:.2f} s (done now; reused by later runs on this document)."
    )
    return (
        f"**{r.method}**{' (query-aware: compressed for this question)' if ex.query_aware else ''} "
        f"at **{r.ratio:g}x** on {r.doc_tokens:,} document tokens "
        f"(+ {prefix} chat-template tokens, always kept) with {r.model}: "
        f"{r.kept_tokens_mean:.1f} keys stored per head on average"
        f"{budgets_note(r)}. {verdict}{expected}\n\n"
        "| | full cache | compressed cache |\n|---|---|---|\n"
        f"| memory{' (whole cache)' if 'compressed_layers' in r.details else ''} | {figures.human_bytes(r.bytes_full)} "
        f"| {figures.human_bytes(r.bytes_compressed)} ({r.memory_ratio:.1f}x smaller) |\n"
        + hybrid_memory_row(r)
        + f"| answer time | {r.answer_full_s:.2f} s{' (cached)' if ex.full_answer_reused else ''} "
        f"| {r.answer_compressed_s:.2f} s{' (cached)' if ex.run.answer_reused else ''} |\n"
        f"| log-perplexity of the full cache's answer | {r.logppl_full:.3f} | {r.logppl_compressed:.3f} |\n\n"
        f"Attention error on held-out queries (mean over layers x KV heads): "
        f"output {r.attn_output_rel_err:.3f} ({r.attn_output_rel_err_weighted:.3f} weighted by each head's share "
        f"of its layer's output), mass {r.attn_mass_rel_err:.3f}. "
        f"{prefill} Compression {r.compress_s:.2f} s"
        f"{' (reused: same method, options and ratio as an earlier run)' if ex.run.compression_reused else ''}; "
        f"this run took {ex.wall_s:.1f} s in all." + (f"\n\n**{r.numerics_warning}**" if r.numerics_warning else "")
    )


def budgets_note(r: RunResult) -> str:
    """Where the run's per-head budgets came from ("; head budgets profile: the model's profile ...") and,
    for a fit on reference queries, which queries ("; reference queries repeat, ... on-policy"), or ""."""
    budgets, queries = budgets_text(r.details), queries_text(r.details)
    return (f"; head budgets {budgets}" if budgets else "") + (f"; reference queries {queries}" if queries else "")


def hybrid_memory_row(r: RunResult) -> str:
    """On a model with sliding-window layers, the table row of the layers a method compresses (where
    its ratio is counted, as the Attention Matching code counts it); "" on any other model."""
    d = r.details
    if "compressed_layers" not in d:
        return ""
    windows = sorted({w for w in d["layer_windows"] if w is not None})
    n_window = sum(w is not None for w in d["layer_windows"])
    return (
        f"| memory of the {len(d['compressed_layers'])} full-attention layers (the ratio's; the {n_window} "
        f"window layers keep their last {'/'.join(map(str, windows))} tokens) "
        f"| {figures.human_bytes(d['compressed_layers_bytes_full'])} "
        f"| {figures.human_bytes(d['compressed_layers_bytes_compressed'])} "
        f"({d['compressed_layers_memory_ratio']:.1f}x smaller) |\n"
    )


def stage_timings(ex: Explored) -> tuple[dict[str, float], dict[str, str]]:
    """(seconds per stage of this run, notes for stages reused from earlier runs) for the time figure.

    Stages: prefill, reference queries (when the method reports them in
    ``details["fit_s"]["queries"]``), compression, both answers, and the
    rest of the run (errors, log-perplexity, token texts). A reused stage
    counts 0 s and is labelled with the time it took when it ran.
    """
    r = ex.run.result
    fit = r.details.get("fit_s") if isinstance(r.details.get("fit_s"), dict) else {}
    queries_s = float(fit.get("queries", 0.0)) if fit else 0.0
    has_queries = bool(fit) and "queries" in fit
    timings: dict[str, float] = {}
    notes: dict[str, str] = {}
    timings["prefill"] = 0.0 if ex.prefill_reused else r.prefill_s
    if ex.prefill_reused:
        notes["prefill"] = f"reused ({r.prefill_s:.2f} s when run)"
    if has_queries:
        timings["reference queries"] = queries_s
    compression = "compression" + (" (fit)" if has_queries else "")
    timings[compression] = 0.0 if ex.run.compression_reused else max(0.0, r.compress_s - queries_s)
    if ex.run.compression_reused:
        if has_queries:
            timings["reference queries"] = 0.0
        notes[compression] = f"reused ({r.compress_s:.2f} s when run)"
    timings["answer, full cache"] = 0.0 if ex.full_answer_reused else r.answer_full_s
    if ex.full_answer_reused:
        notes["answer, full cache"] = f"reused ({r.answer_full_s:.2f} s when run)"
    timings["answer, compressed cache"] = 0.0 if ex.run.answer_reused else r.answer_compressed_s
    if ex.run.answer_reused:
        notes["answer, compressed cache"] = f"reused ({r.answer_compressed_s:.2f} s when run)"
    timings["errors, log-ppl, other"] = max(0.0, ex.wall_s - sum(timings.values()))
    return timings, notes


@dataclass
class FigureJSON:
    """A run's figures as plotly JSON (``Figure.to_json``): error, mass, kept, memory and time; Attention
    Matching's fit (None for other methods); the answers token by token; the heads' roles (None without
    roles). Made once, with the run (:func:`present`), and kept with it: a stored run is served to
    thirty pages without building a figure again (building and validating a run's plotly figures
    costs about 0.2 s of the interpreter's one lock, which every page being served waits for)."""

    main: tuple[str, ...]
    fit: tuple[str, ...] | None
    divergence: str
    roles: str | None


@dataclass
class RunView:
    """Everything ``/run`` shows for one run, as plain picklable data (no model, no cache).

    texts: summary, full answer, compressed answer, word diff, shown as soon
    as the run is done; answer_marks: a line above each answer, right or
    wrong when the gold answer is known, else ""; result, timings, notes,
    wall_s and fitted_biases (Attention Matching's, None for other methods):
    what the figures are made from (:func:`run_figures`); roles: each KV head's
    role for the question (kvlab.lab.head_roles; None for a view made without them); figures: the
    figures made from them, as JSON (:class:`FigureJSON`; :func:`present` fills it).
    """

    texts: tuple[str, str, str, str]
    fates: TokenFates
    result: RunResult
    timings: dict[str, float]
    notes: dict[str, str]
    wall_s: float
    fitted_biases: list[float] | None = None
    answer_marks: tuple[str, str] = ("", "")
    roles: HeadRoles | None = None
    figures: FigureJSON | None = None


def present(ex: Explored) -> RunView:
    """The texts of one finished run, the data its figures are made from, and the figures (as JSON)."""
    r = ex.run.result
    timings, notes = stage_timings(ex)
    fitted = ex.run.fitted_biases() if r.details.get("train_attn_output_rel_err") is not None else None
    view = RunView(
        (
            summary_markdown(ex),
            r.answer_full,
            r.answer_compressed,
            figures.word_diff(r.answer_full, r.answer_compressed),
        ),
        TokenFates.of(ex),
        r,
        timings,
        notes,
        ex.wall_s,
        fitted,
        answer_marks(ex),
        ex.roles,
    )
    return dataclasses.replace(view, figures=figure_json(view))


def head_picker_label(roles: HeadRoles | None, layer: int) -> str:
    """The token view's KV-head picker label at ``layer``: each head's role there, e.g. "KV head (layer 14:
    0 streaming 12%, 1 retrieval 81%)"; "KV head" without roles or outside their layers."""
    if roles is None or not 0 <= layer < len(roles.shares):
        return "KV head"
    heads = ", ".join(
        f"{head} {role} {share:.0%}" for head, (role, share) in enumerate(zip(roles.labels[layer], roles.shares[layer]))
    )
    return f"KV head (layer {layer}: {heads})"


def head_role_line(roles: HeadRoles | None, layer: int, head: int) -> str:
    """One line on the picked head's role ("" without roles or outside them); the figure gives the settings."""
    if roles is None or not 0 <= layer < len(roles.shares) or not 0 <= head < len(roles.shares[layer]):
        return ""
    return roles.descriptions[layer][head] + "."


def answer_marks(ex: Explored) -> tuple[str, str]:
    """A line above each answer: right or wrong against the gold answer when it is known, else ""."""
    if not ex.expected:
        return "", ""
    gold = f" (expected: {html.escape(ex.expected[0])})"
    return verdict_mark(ex.full_right) + gold, verdict_mark(ex.compressed_right) + gold


def verdict_mark(right: bool) -> str:
    """The word right or wrong, bold on green or red (kvlab.ui.common.CSS): words and colour, never
    an emoji glyph, which a browser without an emoji font (Debian's Chromium) draws as an empty box."""
    word = "right" if right else "wrong"
    return f'<span class="kvlab-mark kvlab-mark-{word}">{word}</span>'


@dataclass
class RunFigures:
    """The plotly figures of one run (built on the CPU from its results: no model, no gradio).

    main: error, mass, kept, memory and time; fit: Attention Matching's bias
    histogram and fitting vs evaluation error (None for other methods);
    divergence: the answers token by token (kvlab.figures.divergence_figure).
    """

    main: tuple
    fit: tuple | None
    divergence: object


def run_figures(view: "RunView") -> RunFigures:
    """The figures a page draws for ``view``."""
    r = view.result
    fit = None
    if view.fitted_biases is not None:
        fit = (
            figures.bias_histogram(view.fitted_biases),
            figures.fit_vs_eval_figure(r.details["train_attn_output_rel_err"], r.per_head["attn_output_rel_err"]),
        )
    main = (
        figures.error_heatmap(r.per_head),
        figures.mass_heatmap(r.per_head),
        figures.kept_heatmap(r.per_head, budgets_text(r.details) or ""),
        figures.memory_figure(r.bytes_full, r.bytes_compressed, r.memory_breakdown),
        figures.time_figure(view.timings, view.notes, total=view.wall_s),
    )
    divergence = figures.divergence_figure(
        r.answer_tokens, r.answer_logprobs_full, r.answer_logprobs_compressed, r.first_divergence
    )
    return RunFigures(main, fit, divergence)


def figure_json(view: RunView) -> FigureJSON:
    """:func:`run_figures` of ``view`` and its heads' roles map, as plotly JSON."""
    made = run_figures(view)
    roles = view.roles
    return FigureJSON(
        tuple(f.to_json() for f in made.main),
        None if made.fit is None else tuple(f.to_json() for f in made.fit),
        made.divergence.to_json(),
        None if roles is None else figures.roles_heatmap(roles.shares, roles.labels, roles.settings).to_json(),
    )


#: The line a page shows above a run's summary when it did not compute the run itself (kvlab.results.Served).
SERVED_NOTES = {
    "stored": "**Served from the result store**: this configuration was computed before (in {wall_s:.1f} s); "
    "nothing was recomputed, so the times below are those of that run.",
    "shared": "**Shared computation**: another page asked for this configuration at the same time; both show "
    "that one computation.",
}


def with_served_note(view: RunView, how: str) -> RunView:
    """``view`` with a line above its summary saying it was stored or shared (unchanged when computed)."""
    note = SERVED_NOTES.get(how)
    if note is None:
        return view
    summary, *rest = view.texts
    return dataclasses.replace(view, texts=(note.format(wall_s=view.wall_s) + "\n\n" + summary, *rest))
