"""Plotly figures and token highlighting for the app, built from plain data.

Every function here takes lists, dicts and numbers (the fields of
:class:`kvlab.pipeline.RunResult`, a token-fate dict) and returns a plotly
figure, ``(text, label)`` pairs for ``gr.HighlightedText`` or HTML. Nothing here
imports a model, torch or gradio, so the figures can be tested (and reused
by notebooks or reports) on small synthetic data.
"""
from __future__ import annotations

import difflib
import html
import itertools
import math
import re
from typing import Iterable, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

FIGURE_HEIGHT = 380
"""Every figure sets its height: an autosized plotly figure can render at zero height."""

EVICTED = "evicted"

#: Colours of token fates in the document view; fates not listed get a fallback colour.
FATE_COLORS: dict[str, str] = {
    "template": "#93c5fd",  # blue: the chat template, always kept
    "kept": "#86efac",  # green: stored at full precision
    "beacon": "#22c55e",  # strong green: kept because beacon queries attend to it
    "8-bit": "#fef3c7",  # ambers, darker for fewer bits: stored as packed low-bit codes
    "4-bit": "#fde68a",
    "2-bit": "#f59e0b",
    "compacted": "#fdba74",  # orange: a compact key with a fitted bias and value (Attention Matching)
    "read": "#a5f3fc",  # cyan: read after the document (online compaction)
    EVICTED: "#e5e7eb",  # grey: dropped
}
_FALLBACK_COLORS = ["#f9a8d4", "#5eead4", "#a5b4fc", "#bef264"]

DIFF_FULL, DIFF_COMPRESSED = "full cache only", "compressed cache only"
DIFF_COLORS: dict[str, str] = {DIFF_FULL: "#fca5a5", DIFF_COMPRESSED: "#93c5fd"}

_LAYOUT = dict(
    height=FIGURE_HEIGHT,
    margin=dict(l=60, r=20, t=60, b=50),
    template="plotly_white",
)


def fate_colors(fates: Iterable[str]) -> dict[str, str]:
    """A colour for every fate in ``fates`` (known fates keep theirs)."""
    colors = dict(FATE_COLORS)
    extra = iter(_FALLBACK_COLORS * 4)
    for fate in fates:
        if fate not in colors:
            colors[fate] = next(extra, "#d1d5db")
    return colors


# --------------------------------------------------------------------------- heatmaps


def head_heatmap(
    values: Sequence[Sequence[float]],
    title: str,
    colorbar: str,
    colorscale: str = "Reds",
    fmt: str = ".3f",
    zmin: float | None = 0.0,
    height: int = FIGURE_HEIGHT,
) -> go.Figure:
    """A per layer x KV head heatmap: ``values[layer][head]``.

    Layers run along the x axis (models have many more layers than KV heads,
    so the figure stays wide and short), KV heads along the y axis.
    """
    rows = [list(map(float, row)) for row in values]
    flat = [v for row in rows for v in row]
    zmax = (max(flat) if flat and max(flat) > (zmin or 0.0) else (zmin or 0.0) + 1.0) if zmin is not None else None
    n_layers = len(rows)
    n_heads = len(rows[0]) if rows else 0
    z = [[rows[layer][head] for layer in range(n_layers)] for head in range(n_heads)]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_layers)),
            y=list(range(n_heads)),
            colorscale=colorscale,
            zmin=zmin,
            zmax=zmax,
            colorbar=dict(title=dict(text=colorbar)),
            hovertemplate="layer %{x}, KV head %{y}<br>" + colorbar + ": %{z:" + fmt + "}<extra></extra>",
            xgap=1,
            ygap=1,
        )
    )
    fig.update_layout(
        title=dict(text=title),
        xaxis=dict(title=dict(text="layer"), dtick=max(1, n_layers // 15)),
        yaxis=dict(title=dict(text="KV head"), dtick=1),
        **{**_LAYOUT, "height": height},
    )
    return fig


def error_heatmap(per_head: Mapping[str, Sequence[Sequence[float]]]) -> go.Figure:
    """Attention-output relative error per layer and KV head (``RunResult.per_head``)."""
    return head_heatmap(
        per_head["attn_output_rel_err"],
        "Attention-output relative error (held-out queries)",
        "rel. error",
    )


MASS_RATIO_LIMIT = 8.0
"""The mass figure's colour scale spans 1/8x to 8x of the full cache's attention mass."""


def mass_heatmap(per_head: Mapping[str, Sequence[Sequence[float]]]) -> go.Figure:
    """Attention mass of the compressed cache against the full one, per layer and per KV head.

    Top: per layer, the mean over KV heads of the mass ratio (compressed /
    full, ``per_head["attn_mass_ratio"]``) beside the full cache's 1. Bottom:
    the ratio per layer x KV head on a log2 scale (blue: the compressed cache
    draws less attention than the full one, red: more), with the relative
    error ``|ratio - 1|`` on hover.
    """
    ratios = [[float(v) for v in row] for row in per_head["attn_mass_ratio"]]
    errors = per_head["attn_mass_rel_err"]
    n_layers = len(ratios)
    n_heads = len(ratios[0]) if ratios else 0
    layers = list(range(n_layers))
    limit = math.log2(MASS_RATIO_LIMIT)
    log_ratio = [[math.log2(max(ratios[layer][head], 1e-12)) for layer in layers] for head in range(n_heads)]
    ticks = list(range(-int(limit), int(limit) + 1))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.35, 0.65], vertical_spacing=0.06)
    fig.add_trace(go.Scatter(
        x=layers, y=[1.0] * n_layers, mode="lines", name="full cache", line=dict(color="#6b7280", dash="dash"),
        hoverinfo="skip",
    ), row=1, col=1)
    fig.add_trace(go.Scatter(
        x=layers, y=[sum(row) / len(row) if row else 0.0 for row in ratios], mode="lines+markers",
        name="compressed", line=dict(color="#ea580c"),
        hovertemplate="layer %{x}: %{y:.2f}x the full mass<extra></extra>",
    ), row=1, col=1)
    fig.add_trace(go.Heatmap(
        z=log_ratio, x=layers, y=list(range(n_heads)), colorscale="RdBu", reversescale=True,
        zmid=0.0, zmin=-limit, zmax=limit,
        customdata=[[[ratios[layer][head], float(errors[layer][head])] for layer in layers] for head in range(n_heads)],
        colorbar=dict(title=dict(text="compressed / full"), tickvals=ticks,
                      ticktext=[f"{2.0 ** t:g}x" for t in ticks], len=0.62, y=0.31),
        hovertemplate="layer %{x}, KV head %{y}<br>mass %{customdata[0]:.2f}x the full cache's"
                      "<br>rel. error %{customdata[1]:.3f}<extra></extra>",
        xgap=1, ygap=1,
    ), row=2, col=1)
    fig.update_layout(
        title=dict(text="Attention mass, compressed vs full (held-out queries)"),
        legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"),
        **_LAYOUT,
    )
    fig.update_yaxes(title_text="mass ratio", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="KV head", dtick=1, row=2, col=1)
    fig.update_xaxes(title_text="layer", dtick=max(1, n_layers // 15), row=2, col=1)
    return fig


def kept_heatmap(per_head: Mapping[str, Sequence[Sequence[float]]]) -> go.Figure:
    """Stored keys per layer and KV head (template prefix included)."""
    return head_heatmap(
        per_head["kept_tokens"], "Keys stored per head", "keys", colorscale="Greens", fmt=".0f"
    )


# --------------------------------------------------------------------------- bars


def bias_histogram(biases: Sequence[float]) -> go.Figure:
    """Histogram of fitted per-key biases beta; exp(beta) reads as "how many original keys' mass"."""
    fig = go.Figure(go.Histogram(x=list(biases), nbinsx=60, marker_color="#fb923c"))
    fig.add_vline(x=0.0, line_dash="dash", line_color="#6b7280")
    fig.update_layout(
        **_LAYOUT, title="Fitted biases beta (0 = one key's own mass)",
        xaxis_title="beta", yaxis_title="compact keys",
    )
    return fig


def fit_vs_eval_figure(train: Sequence[Sequence[float]], held_out: Sequence[Sequence[float]]) -> go.Figure:
    """Per layer, mean attention-output error on the fitting queries vs on the held-out queries.

    train, held_out: [n_layers][H_kv] errors.
    """
    layers = list(range(len(train)))
    fig = go.Figure()
    for name, rows, color in (("fitting queries", train, "#2563eb"), ("evaluation queries", held_out, "#dc2626")):
        fig.add_trace(go.Scatter(x=layers, y=[sum(r) / len(r) for r in rows], mode="lines+markers",
                                 name=name, line_color=color))
    fig.update_layout(**_LAYOUT, title="Attention-output error: fitting vs evaluation queries",
                      xaxis_title="layer", yaxis_title="rel. error (mean over KV heads)")
    return fig


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def memory_figure(
    bytes_full: int, bytes_compressed: int, breakdown: Mapping[str, int], height: int = FIGURE_HEIGHT
) -> go.Figure:
    """Stored bytes: the full cache, and the compressed one stacked by part."""
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            name="full cache",
            x=["full"],
            y=[bytes_full],
            marker_color="#9ca3af",
            text=[_human_bytes(bytes_full)],
            textposition="auto",
            hovertemplate="full cache: %{y:,} bytes<extra></extra>",
        )
    )
    parts = dict(breakdown) or {"compressed": bytes_compressed}
    for i, (part, n) in enumerate(parts.items()):
        fig.add_trace(
            go.Bar(
                name=part,
                x=["compressed"],
                y=[n],
                marker_color=["#2563eb", "#f59e0b", "#10b981", "#8b5cf6", "#ef4444"][i % 5],
                hovertemplate=part + ": %{y:,} bytes<extra></extra>",
            )
        )
    ratio = bytes_full / max(1, bytes_compressed)
    fig.add_annotation(
        x="compressed",
        y=bytes_compressed,
        text=f"{_human_bytes(bytes_compressed)} ({ratio:.1f}x smaller)",
        showarrow=False,
        yshift=12,
    )
    fig.update_layout(
        title=dict(text=f"KV-cache memory: {ratio:.1f}x smaller"),
        barmode="stack",
        yaxis=dict(title=dict(text="bytes")),
        legend=dict(orientation="h", y=-0.15),
        **{**_LAYOUT, "height": height},
    )
    return fig


def time_figure(
    timings: Mapping[str, float],
    notes: Mapping[str, str] | None = None,
    total: float | None = None,
    height: int = FIGURE_HEIGHT,
) -> go.Figure:
    """Seconds per stage, e.g. {"prefill": 2.1, "compression": 0.3, ...}.

    notes: text shown on a stage's bar instead of its seconds (e.g. "reused:
    2.81 s on an earlier run" for a stage that was not re-run); total: the
    run's wall-clock seconds, shown in the title.
    """
    notes = notes or {}
    names = list(timings)
    secs = [float(timings[n]) for n in names]
    fig = go.Figure(
        go.Bar(
            x=secs,
            y=names,
            orientation="h",
            marker_color="#6366f1",
            text=[notes.get(n, f"{s:.2f} s") for n, s in zip(names, secs)],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{y}: %{x:.3f} s<extra></extra>",
        )
    )
    title = "Time per stage" + (f" (this run: {total:.1f} s)" if total is not None else "")
    longest = max(secs, default=0.0)
    fig.update_layout(
        title=dict(text=title),
        xaxis=dict(title=dict(text="seconds"), range=[0, max(longest * 1.45, 0.5)]),
        yaxis=dict(autorange="reversed", automargin=True),
        **{**_LAYOUT, "height": height},
    )
    return fig


METHOD_COLORS = [
    "#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
    "#4b5563", "#ea580c", "#0d9488", "#9333ea", "#ca8a04", "#be123c", "#1d4ed8", "#15803d", "#a16207",
]
"""One colour per method line of the sweep charts (cycled past the end)."""


def sweep_figure(
    points: Sequence[Mapping[str, float | str | None]],
    metric: str,
    title: str,
    y_title: str | None = None,
    reference: float | None = None,
    reference_label: str = "full cache",
    height: int = FIGURE_HEIGHT,
) -> go.Figure:
    """A metric against the compression ratio, one line per method.

    points: one mapping per run with ``"method"``, ``"ratio"`` and ``metric``
    (runs missing the metric, or with a non-finite value, are left out);
    reference: a horizontal dashed line (e.g. the full cache's log-perplexity),
    drawn as a trace so that it is in the legend. The ratio axis is
    logarithmic, ticked at the ratios present.
    """
    by_method: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        value = p.get(metric)
        if value is None or not math.isfinite(float(value)):
            continue
        by_method.setdefault(str(p["method"]), []).append((float(p["ratio"]), float(value)))
    ratios = sorted({x for xy in by_method.values() for x, _ in xy})
    fig = go.Figure()
    for i, (method, xy) in enumerate(by_method.items()):
        xy.sort()
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in xy],
                y=[y for _, y in xy],
                mode="lines+markers",
                name=method,
                line=dict(color=METHOD_COLORS[i % len(METHOD_COLORS)], width=2),
                marker=dict(size=7),
                hovertemplate=method + " at %{x:g}x: %{y:.4g}<extra></extra>",
            )
        )
    if reference is not None and math.isfinite(reference):
        span = [ratios[0], ratios[-1]] if ratios else [1.0, 1.0]
        fig.add_trace(
            go.Scatter(
                x=span,
                y=[reference, reference],
                mode="lines" if span[0] != span[1] else "lines+markers",
                name=f"{reference_label} ({reference:.3g})",
                line=dict(color="#111827", dash="dash", width=1.5),
                hovertemplate=reference_label + ": %{y:.4g}<extra></extra>",
            )
        )
    fig.update_layout(
        title=dict(text=title),
        xaxis=dict(
            title=dict(text="compression ratio"),
            type="log",
            tickvals=ratios,
            ticktext=[f"{r:g}x" for r in ratios],
        ),
        yaxis=dict(title=dict(text=y_title or metric), rangemode="tozero"),
        legend=dict(orientation="h", y=-0.22),
        **{**_LAYOUT, "height": height, "margin": dict(l=60, r=20, t=60, b=90)},
    )
    return fig


# --------------------------------------------------------------------------- text


#: Intensity steps of the token view: levels (bytes 1-255) are bucketed into this many shades.
LEVEL_STEPS = 8
#: Shade of the weakest step (the strongest is the fate's own colour), as a share of that colour.
WEAKEST_SHADE = 0.15
#: Evicted tokens carry no fate colour: with an intensity they get a grey background, so that
#: an important but evicted token stands out.
EVICTED_SHADE = "#cbd5e1"


def level_step(level: int) -> int | None:
    """A token level (0: none; 1-255: percentile rank, see kvlab.metrics.percentile_levels) -> its step."""
    return None if level == 0 else (level - 1) * LEVEL_STEPS // 255


def fate_segments(
    token_texts: Sequence[str],
    fates: Mapping[int, str],
    default: str = EVICTED,
    levels: bytes | Sequence[int] | None = None,
) -> list[tuple[str, str, int | None]]:
    """(text, fate, step) runs: adjacent tokens of one fate and one intensity step are joined.

    token_texts: the decoded text of each token of the context, in order;
    fates: original token index -> fate (as from ``CompressedKV.fates``); tokens
    missing from it get ``default``. levels: one level per token (0: none),
    or None: every step is then None (no intensity).
    """
    out: list[tuple[str, str, int | None]] = []
    for i, text in enumerate(token_texts):
        key = (fates.get(i, default), None if levels is None else level_step(levels[i]))
        if out and out[-1][1:] == key:
            out[-1] = (out[-1][0] + text, *key)
        else:
            out.append((text, *key))
    return [seg for seg in out if seg[0]]


def _shade(color: str, strength: float) -> str:
    """``color`` (#rrggbb) mixed with white: strength 1 is the colour itself, 0 is white.

    Opaque on purpose: a translucent background would take the page's colour
    and leave dark text unreadable on a dark theme."""
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - c) * strength):02x}" for c in rgb)


def _step_strength(step: int) -> float:
    return WEAKEST_SHADE + (1 - WEAKEST_SHADE) * step / (LEVEL_STEPS - 1)


def _step_title(fate: str, step: int | None) -> str:
    if step is None:
        return fate
    return f"{fate}, percentile {100 * step // LEVEL_STEPS}-{100 * (step + 1) // LEVEL_STEPS}"


def fate_html(
    segments: Sequence[tuple[str, str, int | None]], max_height: int = 440, intensity: str | None = None
) -> str:
    """The document as HTML, each run of tokens coloured by its fate and shaded by its step, with a legend.

    segments: (text, fate, step) runs as from :func:`fate_segments`. Evicted
    tokens are grey text; other fates get a background colour, paler for
    lower steps; with a step, an evicted token gets a grey background as
    strong as its step. Each run's tooltip says its fate and percentile.
    intensity: what the steps measure, for the legend (None: no intensity
    note). Text is HTML-escaped and whitespace (newlines included) is kept.
    """
    present = list(dict.fromkeys(fate for _, fate, _ in segments))
    colors = fate_colors(present)
    legend = " ".join(
        f'<span class="kvlab-chip" style="{_fate_style(fate, colors)}">{html.escape(fate)}</span>'
        for fate in (present or [EVICTED])
    )
    if intensity:
        shown = next((f for f in present if f not in (EVICTED, "template")), "kept")
        scale = "".join(
            f'<span style="{_fate_style(shown, colors, step)};padding:0 5px"> </span>' for step in range(LEVEL_STEPS)
        )
        legend += (
            f'<div style="margin-top:4px;font-size:0.9em">intensity = {html.escape(intensity)}, as a percentile '
            f"within this head: low {scale} high</div>"
        )
    body = "".join(
        f'<span title="{html.escape(_step_title(fate, step))}" style="{_fate_style(fate, colors, step)}">'
        f"{html.escape(text)}</span>"
        for text, fate, step in segments
    )
    return (
        f'<div class="kvlab-legend" style="margin:4px 0 8px 0">{legend}</div>'
        f'<div class="kvlab-doc" style="white-space:pre-wrap;line-height:1.6;max-height:{max_height}px;'
        'overflow-y:auto;padding:10px;border:1px solid #e5e7eb;border-radius:8px;font-size:0.95em">'
        f"{body}</div>"
    )


BIT_COLORS = {"full": "#1d4ed8", 8: "#60a5fa", 4: "#f59e0b", 2: "#f97316", 0: "#e5e7eb"}


def bits_of(fate: str) -> str | int:
    """What one stored token costs: "full" precision, N bits ("N-bit" fates), or 0 (evicted)."""
    if fate == EVICTED:
        return 0
    if fate.endswith("-bit") and fate[:-4].isdigit():
        return int(fate[:-4])
    return "full"


def bits_strip_html(n_tokens: int, fates: Mapping[int, str], default: str = EVICTED) -> str:
    """A one-row strip, in reading order, coloured by the bits each context token is stored with.

    A run of tokens with one colour is one cell as wide as the run (a cell per
    token would make the strip alone weigh ~60 bytes per token).
    """
    colors = (BIT_COLORS.get(bits_of(fates.get(i, default)), "#d1d5db") for i in range(n_tokens))
    cells = "".join(
        f'<span style="flex:{len(list(run))} 1 0;min-width:0;background:{color}"></span>'
        for color, run in itertools.groupby(colors)
    )
    legend = " ".join(
        f'<span class="kvlab-chip" style="background:{color};color:{"#fff" if key == "full" else "#111827"}">'
        f'{"full precision" if key == "full" else f"{key} bits"}</span>'
        for key, color in BIT_COLORS.items()
    )
    return (
        f'<div style="margin:2px 0 4px 0;font-size:0.9em">Bits per token: {legend}</div>'
        f'<div class="kvlab-bits" title="bits per token, in reading order" '
        f'style="display:flex;height:14px;border:1px solid #e5e7eb;border-radius:4px;overflow:hidden">{cells}</div>'
    )


def _fate_style(fate: str, colors: Mapping[str, str], step: int | None = None) -> str:
    if fate == EVICTED:
        if step is None:
            return "color:#9ca3af"
        return f"background-color:{_shade(EVICTED_SHADE, _step_strength(step))};color:#6b7280"
    color = colors[fate] if step is None else _shade(colors[fate], _step_strength(step))
    return f"background-color:{color};border-radius:3px;color:#111827"


def fate_counts(n_tokens: int, fates: Mapping[int, str], default: str = EVICTED) -> dict[str, int]:
    """How many of ``n_tokens`` tokens have each fate."""
    counts: dict[str, int] = {}
    for i in range(n_tokens):
        fate = fates.get(i, default)
        counts[fate] = counts.get(fate, 0) + 1
    return counts


_WORDS = re.compile(r"\S+|\s+")


def word_diff(full: str, compressed: str) -> list[tuple[str, str | None]]:
    """A word diff of two answers for ``gr.HighlightedText``.

    Shared words get ``None``; words only in the full-cache answer get
    :data:`DIFF_FULL`, words only in the compressed-cache answer :data:`DIFF_COMPRESSED`.
    """
    a, b = _WORDS.findall(full), _WORDS.findall(compressed)
    out: list[tuple[str, str | None]] = []

    def add(text: str, label: str | None) -> None:
        if not text:
            return
        if out and out[-1][1] == label:
            out[-1] = (out[-1][0] + text, label)
        else:
            out.append((text, label))

    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            add("".join(a[i1:i2]), None)
            continue
        if i2 > i1:
            add("".join(a[i1:i2]), DIFF_FULL)
            if j2 > j1:
                add(" ", None)
        if j2 > j1:
            add("".join(b[j1:j2]), DIFF_COMPRESSED)
    return out


def answers_agree(full: str, compressed: str) -> float:
    """Word-level similarity of two answers in [0, 1] (1 = identical words)."""
    a, b = full.split(), compressed.split()
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(a=a, b=b, autojunk=False).ratio()
