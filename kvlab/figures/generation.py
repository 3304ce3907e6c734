"""Figures of generation under a bounded cache, from plain data (no model, no torch).

- :func:`cache_size_figure`: keys per head against written tokens, one line per method,
  every eviction or compaction marked;
- :func:`logprob_figure`: each token's log-probability of the unbounded text under each cache;
- :func:`beacon_figure`: which tokens were BeaconKV's beacons at each eviction;
- :func:`texts_html`: the written texts side by side, from where each leaves the unbounded one.
"""

from __future__ import annotations

import html
from typing import Mapping, Sequence

import plotly.graph_objects as go

from kvlab.figures.plots import FIGURE_HEIGHT, METHOD_COLORS, human_bytes

_LAYOUT = dict(height=FIGURE_HEIGHT, margin=dict(l=60, r=20, t=60, b=50), template="plotly_white")
#: Colour of the text after a method leaves the unbounded text.
DIVERGED = "#fde68a"


def _color(i: int) -> str:
    return METHOD_COLORS[i % len(METHOD_COLORS)]


def cache_size_figure(
    sizes: Mapping[str, Sequence[int]],
    nbytes: Mapping[str, Sequence[int]],
    events: Mapping[str, Sequence[tuple[int, int, int]]],
    budget: int,
) -> go.Figure:
    """Keys per head of the cache each token was predicted from, against written tokens.

    sizes / nbytes: per method label, one value per written token; events: per
    label, (step, before, after) of every shrink, drawn as a drop at that step.
    """
    fig = go.Figure()
    for i, (label, ys) in enumerate(sizes.items()):
        fig.add_trace(
            go.Scatter(
                x=list(range(len(ys))),
                y=list(ys),
                mode="lines",
                name=label,
                line=dict(color=_color(i), width=2),
                customdata=[human_bytes(b) for b in nbytes.get(label, [])],
                hovertemplate=label + ": %{y} keys per head (%{customdata}) at token %{x}<extra></extra>",
            )
        )
        marks = events.get(label, [])
        if marks:
            fig.add_trace(
                go.Scatter(
                    x=[s for s, _, _ in marks],
                    y=[b for _, b, _ in marks],
                    mode="markers",
                    showlegend=False,
                    marker=dict(symbol="triangle-down", size=7, color=_color(i)),
                    customdata=[[b, a] for _, b, a in marks],
                    hovertemplate=label
                    + " shrinks at token %{x}: %{customdata[0]} -> %{customdata[1]} keys<extra></extra>",
                )
            )
    fig.add_hline(y=budget, line=dict(color="#6b7280", dash="dash"), annotation_text=f"budget {budget}")
    fig.update_layout(
        title=dict(text="Cache size while writing (triangles: evictions and compactions)"),
        xaxis=dict(title=dict(text="tokens written")),
        yaxis=dict(title=dict(text="keys per KV head"), rangemode="tozero"),
        **_LAYOUT,
    )
    return fig


def logprob_figure(forced: Mapping[str, Sequence[float]], divergence: Mapping[str, int | None]) -> go.Figure:
    """Per method, the log-probability of each token of the unbounded text (teacher-forced) against its position;
    a dotted line where that method's own text leaves the unbounded one."""
    fig = go.Figure()
    for i, (label, ys) in enumerate(forced.items()):
        fig.add_trace(
            go.Scatter(
                x=list(range(len(ys))),
                y=list(ys),
                mode="lines",
                name=label,
                line=dict(color=_color(i), width=1.5),
                hovertemplate=label + ": token %{x}, log p %{y:.3f}<extra></extra>",
            )
        )
        cut = divergence.get(label)
        if cut is not None:
            fig.add_vline(x=cut, line=dict(color=_color(i), dash="dot", width=1))
    fig.update_layout(
        title=dict(text="Log-probability of the unbounded text under each cache (dotted: first difference)"),
        xaxis=dict(title=dict(text="token of the unbounded text")),
        yaxis=dict(title=dict(text="log p")),
        **_LAYOUT,
    )
    return fig


def beacon_figure(
    steps: Sequence[int], tokens: Sequence[Sequence[int]], rows: Sequence[Sequence[int]], prompt_tokens: int
) -> go.Figure:
    """BeaconKV's beacons over time: at each eviction (x: tokens written), the positions of the tokens whose
    queries were beacons (y), coloured by in how many (layer, query head) rows; the dashed line
    separates the prompt from the written text."""
    xs = [s for s, ts in zip(steps, tokens) for _ in ts]
    ys = [t for ts in tokens for t in ts]
    counts = [c for cs in rows for c in cs]
    fig = go.Figure(
        go.Scatter(
            x=xs,
            y=ys,
            mode="markers",
            marker=dict(
                size=5, color=counts, colorscale="Viridis", showscale=True, colorbar=dict(title=dict(text="rows"))
            ),
            hovertemplate="after %{x} tokens: token %{y} is a beacon in %{marker.color} rows<extra></extra>",
        )
    )
    fig.add_hline(y=prompt_tokens - 0.5, line=dict(color="#6b7280", dash="dash"), annotation_text="written text above")
    fig.update_layout(
        title=dict(text="BeaconKV's beacons at each eviction"),
        xaxis=dict(title=dict(text="tokens written")),
        yaxis=dict(title=dict(text="token position")),
        **_LAYOUT,
    )
    return fig


def texts_html(texts: Sequence[tuple[str, str, str]]) -> str:
    """The texts side by side: (label, the part equal to the unbounded text, the rest), the rest highlighted."""
    cells = []
    for label, same, rest in texts:
        body = html.escape(same) + (f'<mark style="background:{DIVERGED}">{html.escape(rest)}</mark>' if rest else "")
        cells.append(
            f'<div style="flex:1;min-width:180px"><b>{html.escape(label)}</b>'
            f'<div style="white-space:pre-wrap;font-family:monospace;font-size:0.85em;max-height:420px;'
            f'overflow-y:auto;border:1px solid #e5e7eb;border-radius:6px;padding:6px">{body}</div></div>'
        )
    return f'<div style="display:flex;gap:8px">{"".join(cells)}</div>'
