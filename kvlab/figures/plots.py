"""Plotly figures of a run and of a sweep, built from plain data (no model, no torch).

Every figure sets its height and shares one layout; heatmaps are layer x KV head.
"""

from __future__ import annotations

import bisect
import math
from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

FIGURE_HEIGHT = 380
"""Every figure sets its height: an autosized plotly figure can render at zero height."""

_LAYOUT = dict(height=FIGURE_HEIGHT, margin=dict(l=60, r=20, t=60, b=50), template="plotly_white")


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
        per_head["attn_output_rel_err"], "Attention-output relative error (held-out queries)", "rel. error"
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
    fig.add_trace(
        go.Scatter(
            x=layers,
            y=[1.0] * n_layers,
            mode="lines",
            name="full cache",
            line=dict(color="#6b7280", dash="dash"),
            hoverinfo="skip",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=layers,
            y=[sum(row) / len(row) if row else 0.0 for row in ratios],
            mode="lines+markers",
            name="compressed",
            line=dict(color="#ea580c"),
            hovertemplate="layer %{x}: %{y:.2f}x the full mass<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            z=log_ratio,
            x=layers,
            y=list(range(n_heads)),
            colorscale="RdBu",
            reversescale=True,
            zmid=0.0,
            zmin=-limit,
            zmax=limit,
            customdata=[
                [[ratios[layer][head], float(errors[layer][head])] for layer in layers] for head in range(n_heads)
            ],
            colorbar=dict(
                title=dict(text="compressed / full"),
                tickvals=ticks,
                ticktext=[f"{2.0**t:g}x" for t in ticks],
                len=0.62,
                y=0.31,
            ),
            hovertemplate="layer %{x}, KV head %{y}<br>mass %{customdata[0]:.2f}x the full cache's"
            "<br>rel. error %{customdata[1]:.3f}<extra></extra>",
            xgap=1,
            ygap=1,
        ),
        row=2,
        col=1,
    )
    fig.update_layout(
        title=dict(text="Attention mass, compressed vs full (held-out queries)"),
        legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"),
        **_LAYOUT,
    )
    fig.update_yaxes(title_text="mass ratio", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="KV head", dtick=1, row=2, col=1)
    fig.update_xaxes(title_text="layer", dtick=max(1, n_layers // 15), row=2, col=1)
    return fig


def kept_heatmap(per_head: Mapping[str, Sequence[Sequence[float]]], budgets: str = "") -> go.Figure:
    """Stored keys per layer and KV head (template prefix included); ``budgets``: where the per-head
    budgets came from, one line under the title ("" for none)."""
    title = "Keys stored per head" + (f"<br><sup>budgets: {budgets}</sup>" if budgets else "")
    return head_heatmap(per_head["kept_tokens"], title, "keys", colorscale="Greens", fmt=".0f")


def roles_heatmap(shares: Sequence[Sequence[float]], labels: Sequence[Sequence[str]], settings: str) -> go.Figure:
    """Each KV head's role for the question, beside "Keys per head": ``shares[layer][head]``, the share of the
    question's attention beyond the sinks and the recent window (0 to 1), each cell marked R (retrieval) or S
    (streaming) by ``labels[layer][head]``; ``settings``: the split's settings, one line under the title."""
    fig = head_heatmap(
        [[100.0 * float(v) for v in row] for row in shares],
        f"Head roles: retrieval (R) or streaming (S)<br><sup>{settings}</sup>",
        "% beyond",
        colorscale="Purples",
        fmt=".0f",
    )
    n_layers, n_heads = len(shares), len(shares[0]) if shares else 0
    roles = [[str(labels[layer][head]) for layer in range(n_layers)] for head in range(n_heads)]
    fig.update_traces(
        zmax=100.0,
        text=[[role[:1].upper() for role in row] for row in roles],
        texttemplate="%{text}",
        customdata=roles,
        hovertemplate="layer %{x}, KV head %{y}: %{customdata}<br>%{z:.0f}% of the question's attention "
        "beyond the window<extra></extra>",
    )
    return fig


def budget_profile_figure(shares: Sequence[Sequence[float]], model: str) -> go.Figure:
    """A model's head-budget profile: each KV head's budget as a multiple of the uniform one
    (``shares[layer][head]``, mean 1; kvlab.compression.budget_profiles)."""
    return head_heatmap(
        shares,
        f"Where the budget goes: {model}'s profile (x the uniform budget)",
        "x uniform",
        colorscale="Viridis",
        fmt=".2f",
    )


# --------------------------------------------------------------------------- bars


#: Bins of the fitted-bias histogram.
BIAS_BINS = 60


def histogram_bins(values: Sequence[float], bins: int) -> tuple[list[float], list[int]]:
    """(bins + 1 equal-width edges spanning min..max, the count in each bin); the last bin includes max.

    A value equal to an inner edge counts in the bin that edge opens (numpy's
    convention). All values equal: one unit-wide bin around them, the rest empty.
    """
    if not values:
        return [], []
    low, high = min(values), max(values)
    if high == low:
        low, high = low - 0.5, high + 0.5
    width = (high - low) / bins
    edges = [low + i * width for i in range(bins)] + [high]
    counts = [0] * bins
    for v in values:  # against the edges themselves, so a value on an edge is never off by one bin
        counts[min(bisect.bisect_right(edges, v) - 1, bins - 1)] += 1
    return edges, counts


def bias_histogram(biases: Sequence[float], bins: int = BIAS_BINS) -> go.Figure:
    """Histogram of fitted per-key biases beta; exp(beta) reads as "how many original keys' mass".

    Binned here, not in the browser: a run has tens of thousands of biases,
    which as raw points made this one figure half of a page's answer.
    """
    edges, counts = histogram_bins(list(biases), bins)
    centres = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    widths = [b - a for a, b in zip(edges, edges[1:])]
    fig = go.Figure(
        go.Bar(
            x=centres,
            y=counts,
            width=widths,
            marker_color="#fb923c",
            hovertemplate="beta %{x:.3g}: %{y} compact keys<extra></extra>",
        )
    )
    fig.add_vline(x=0.0, line_dash="dash", line_color="#6b7280")
    fig.update_layout(
        **_LAYOUT,
        title="Fitted biases beta (0 = one key's own mass)",
        xaxis_title="beta",
        yaxis_title="compact keys",
        bargap=0,
    )
    return fig


def fit_vs_eval_figure(train: Sequence[Sequence[float]], held_out: Sequence[Sequence[float]]) -> go.Figure:
    """Per layer, mean attention-output error on the fitting queries vs on the held-out queries.

    train, held_out: [n_layers][H_kv] errors.
    """
    layers = list(range(len(train)))
    fig = go.Figure()
    for name, rows, color in (("fitting queries", train, "#2563eb"), ("evaluation queries", held_out, "#dc2626")):
        fig.add_trace(
            go.Scatter(x=layers, y=[sum(r) / len(r) for r in rows], mode="lines+markers", name=name, line_color=color)
        )
    fig.update_layout(
        **_LAYOUT,
        title="Attention-output error: fitting vs evaluation queries",
        xaxis_title="layer",
        yaxis_title="rel. error (mean over KV heads)",
    )
    return fig


def human_bytes(n: float) -> str:
    """A byte count for people: "512 B", "1.5 KiB", "3.2 MiB", "1.1 GiB" (1024-based)."""
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
            text=[human_bytes(bytes_full)],
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
        text=f"{human_bytes(bytes_compressed)} ({ratio:.1f}x smaller)",
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
    "#2563eb",
    "#dc2626",
    "#059669",
    "#d97706",
    "#7c3aed",
    "#0891b2",
    "#db2777",
    "#65a30d",
    "#4b5563",
    "#ea580c",
    "#0d9488",
    "#9333ea",
    "#ca8a04",
    "#be123c",
    "#1d4ed8",
    "#15803d",
    "#a16207",
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
            title=dict(text="compression ratio"), type="log", tickvals=ratios, ticktext=[f"{r:g}x" for r in ratios]
        ),
        yaxis=dict(title=dict(text=y_title or metric), rangemode="tozero"),
        legend=dict(orientation="h", y=-0.22),
        **{**_LAYOUT, "height": height, "margin": dict(l=60, r=20, t=60, b=90)},
    )
    return fig
