"""Where a needle went: one needle's tokens followed through a compression, from plain data (no model, no torch).

:func:`needle_figure` draws a :class:`kvlab.lab.fates.NeedleTrace` given as
its dict (``NeedleTrace.to_dict()``, or the ``--json`` file
``python -m benchmarks.needle_view --item ...`` writes); :func:`needle_table`
writes the same numbers as markdown.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.figures.plots import METHOD_COLORS
from kvlab.figures.tokens import fate_colors

#: Colours of the two caches in the figure's lines and bars.
FULL_COLOR, COMPRESSED_COLOR = "#6b7280", METHOD_COLORS[0]


def _head_labels(fates: Sequence[Sequence[Sequence[str]]]) -> list[str]:
    return [f"L{layer} h{head}" for layer, heads in enumerate(fates) for head in range(len(heads))]


def _token_label(i: int, text: str, value: bool) -> str:
    shown = text.replace(" ", "␣") or "∅"
    return f"{i}: <b>{shown}</b>" if value else f"{i}: {shown}"


def head_shares(attention: Sequence[Sequence[Sequence[float]]]) -> list[float]:
    """[layer][head][token] shares -> one value per (layer, head), layer-major: the span's total share."""
    return [float(sum(tokens)) for heads in attention for tokens in heads]


def token_shares(attention: Sequence[Sequence[Sequence[float]]]) -> list[float]:
    """[layer][head][token] shares -> [token]: each token's share, averaged over every layer and head."""
    rows = [tokens for heads in attention for tokens in heads]
    return [sum(r[p] for r in rows) / len(rows) for p in range(len(rows[0]))] if rows else []


def _fate_panel(fig: go.Figure, trace: Mapping[str, Any], heads: list[str], tokens: list[str]) -> None:
    """Row 1: each traced token's fate per (layer, KV head), one colour per fate, with its legend."""
    fates = trace["fates"]
    names = list(dict.fromkeys(f for layer in fates for head in layer for f in head))
    colors = fate_colors(names)
    code = {name: i for i, name in enumerate(names)}
    k = max(1, len(names))
    # A step colourscale: code i takes the band [i, i + 1) / k, so each fate keeps its own colour.
    scale = [[stop, colors[name]] for i, name in enumerate(names) for stop in (i / k, (i + 1) / k)]
    scale = scale or [[0, "#fff"], [1, "#fff"]]
    flat = [(layer, head) for layer, hs in enumerate(fates) for head in range(len(hs))]
    positions = range(len(trace["span_texts"]))
    z = [[code[fates[layer][head][p]] for layer, head in flat] for p in positions]
    hover = [
        [
            f"{fates[layer][head][p]}<br>attention share full {trace['attention_full'][layer][head][p]:.4f}, "
            f"compressed {trace['attention_compressed'][layer][head][p]:.4f}"
            for layer, head in flat
        ]
        for p in positions
    ]
    fig.add_trace(
        go.Heatmap(
            z=z,
            x=heads,
            y=tokens,
            colorscale=scale,
            zmin=0,
            zmax=k,
            showscale=False,
            text=hover,
            hovertemplate="%{y}, %{x}<br>%{text}<extra></extra>",
            xgap=1,
            ygap=1,
        ),
        row=1,
        col=1,
    )
    for name in names:  # the legend of the fates (a heatmap has none)
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=name,
                legendgroup="fates",
                marker=dict(symbol="square", size=12, color=colors[name]),
            ),
            row=1,
            col=1,
        )


def _share_panels(fig: go.Figure, trace: Mapping[str, Any], heads: list[str], tokens: list[str]) -> None:
    """Rows 2 and 3: the span's share of the attention per (layer, KV head), and per token over heads."""
    for which, color, label in (
        ("attention_full", FULL_COLOR, "full cache"),
        ("attention_compressed", COMPRESSED_COLOR, "compressed"),
    ):
        fig.add_trace(
            go.Scatter(
                x=heads,
                y=head_shares(trace[which]),
                mode="lines+markers",
                name=label,
                legendgroup=label,
                line=dict(color=color, width=1.5),
                marker=dict(size=4),
                hovertemplate=label + ", %{x}: %{y:.4f}<extra></extra>",
            ),
            row=2,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=tokens,
                y=token_shares(trace[which]),
                name=label,
                legendgroup=label,
                showlegend=False,
                marker_color=color,
                hovertemplate=label + ", %{x}: %{y:.4f}<extra></extra>",
            ),
            row=3,
            col=1,
        )


def _answer_panel(fig: go.Figure, trace: Mapping[str, Any]) -> None:
    """Row 4: each answer token's log-probability under both caches."""
    answer = [_token_label(i, t, v) for i, (t, v) in enumerate(zip(trace["answer_texts"], trace["answer_value"]))]
    for which, color, label in (
        ("logprob_full", FULL_COLOR, "full cache"),
        ("logprob_compressed", COMPRESSED_COLOR, "compressed"),
    ):
        fig.add_trace(
            go.Bar(
                x=answer,
                y=trace[which],
                name=label,
                legendgroup=label,
                showlegend=False,
                marker_color=color,
                hovertemplate=label + ", %{x}: log p %{y:.3f}<extra></extra>",
            ),
            row=4,
            col=1,
        )


def needle_figure(trace: Mapping[str, Any]) -> go.Figure:
    """Four panels, top to bottom: each traced token's fate per (layer, KV head); the share of the
    held-out queries' attention on the span per (layer, KV head), full and compressed cache; each
    token's share averaged over heads; the log-probability of each answer token under both caches
    (the value's tokens in bold)."""
    heads = _head_labels(trace["fates"])
    tokens = [_token_label(i, t, v) for i, (t, v) in enumerate(zip(trace["span_texts"], trace["span_value"]))]
    fig = make_subplots(
        rows=4,
        cols=1,
        vertical_spacing=0.09,
        row_heights=[0.34, 0.22, 0.2, 0.24],
        subplot_titles=(
            "fate of each needle token per layer and KV head",
            "the needle's share of the question's attention, per layer and KV head",
            "each needle token's share, mean over heads",
            "log-probability of the full cache's answer (value tokens in bold)",
        ),
    )
    _fate_panel(fig, trace, heads, tokens)
    _share_panels(fig, trace, heads, tokens)
    _answer_panel(fig, trace)
    # Every token labelled (plotly would thin out the labels of a tall category axis).
    fig.update_yaxes(autorange="reversed", tickmode="array", tickvals=tokens, ticktext=tokens, row=1, col=1)
    fig.update_yaxes(title_text="share", row=2, col=1)
    fig.update_yaxes(title_text="share", row=3, col=1)
    fig.update_yaxes(title_text="log p", row=4, col=1)
    fig.update_xaxes(showticklabels=False, row=1, col=1)
    fig.update_xaxes(matches="x", row=2, col=1)
    fig.update_layout(
        title=dict(
            text=f"Where the needle went: {trace['label']} at {trace['ratio']:g}x. "
            f"Full: {trace['answer_full']!r}; compressed: {trace['answer_compressed']!r}"
        ),
        barmode="group",
        height=1150,
        margin=dict(l=140, r=20, t=90, b=60),
        template="plotly_white",
        legend=dict(orientation="h", y=-0.04),
    )
    return fig


def needle_table(trace: Mapping[str, Any]) -> str:
    """The trace as markdown: per needle token, its fates counted over heads and its mean shares; then
    per answer token, its log-probability under each cache."""
    fates = trace["fates"]
    names = list(dict.fromkeys(f for layer in fates for head in layer for f in head))
    full, comp = token_shares(trace["attention_full"]), token_shares(trace["attention_compressed"])
    lines = [
        "| needle token | value | "
        + " | ".join(f"heads {n}" for n in names)
        + " | attention share, full | compressed |",
        "|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for p, (text, value) in enumerate(zip(trace["span_texts"], trace["span_value"])):
        counts = [sum(head[p] == n for layer in fates for head in layer) for n in names]
        lines.append(
            f"| `{text}` | {'yes' if value else ''} | "
            + " | ".join(map(str, counts))
            + f" | {full[p]:.4f} | {comp[p]:.4f} |"
        )
    lines += ["", "| answer token | value | log p, full | log p, compressed |", "|---|---|---|---|"]
    for text, value, a, b in zip(
        trace["answer_texts"], trace["answer_value"], trace["logprob_full"], trace["logprob_compressed"]
    ):
        lines.append(f"| `{text}` | {'yes' if value else ''} | {a:.3f} | {b:.3f} |")
    return "\n".join(lines)
