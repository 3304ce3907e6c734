"""The full cache's answer against the compressed cache's: a word diff, and where the answers part."""

from __future__ import annotations

import difflib
import re
from typing import Sequence

import plotly.graph_objects as go

from kvlab.figures.plots import FIGURE_HEIGHT

DIFF_FULL, DIFF_COMPRESSED = "full cache only", "compressed cache only"
DIFF_COLORS: dict[str, str] = {DIFF_FULL: "#fca5a5", DIFF_COMPRESSED: "#93c5fd"}

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


def divergence_figure(
    tokens: Sequence[str],
    logprobs_full: Sequence[float],
    logprobs_compressed: Sequence[float],
    first_divergence: int | None,
) -> go.Figure:
    """Each token of the full cache's answer and its log-probability under both caches (teacher-forced).

    tokens: the full cache's answer, one text per token; first_divergence: the
    first token where the compressed cache's own greedy answer differs (None:
    never), marked with a vertical line. Where the compressed line drops, the
    compressed cache finds that token unlikely: the answer's divergence starts there.
    """
    x = list(range(len(tokens)))
    labels = [repr(t)[1:-1] for t in tokens]
    fig = go.Figure()
    for name, values, color in (
        ("full cache", logprobs_full, "#111827"),
        ("compressed cache", logprobs_compressed, "#dc2626"),
    ):
        fig.add_trace(
            go.Scatter(
                x=x,
                y=list(values),
                mode="lines+markers",
                name=name,
                line=dict(color=color, width=2),
                customdata=labels,
                hovertemplate="token %{x} %{customdata}: log p = %{y:.3f}<extra>" + name + "</extra>",
            )
        )
    title = "The full cache's answer, token by token"
    if first_divergence is not None:
        fig.add_vline(x=first_divergence, line=dict(color="#f59e0b", dash="dash", width=2))
        title += f": greedy answers part at token {first_divergence}"
        if first_divergence < len(labels):
            title += f" ({labels[first_divergence]!r})"
    else:
        title += ": the greedy answers are the same"
    fig.update_layout(
        title=dict(text=title),
        xaxis=dict(title=dict(text="answer token"), tickvals=x, ticktext=labels, tickangle=-45),
        yaxis=dict(title=dict(text="log-probability (teacher-forced)")),
        legend=dict(orientation="h", y=-0.35),
        height=FIGURE_HEIGHT,
        template="plotly_white",
        margin=dict(l=60, r=20, t=60, b=110),
    )
    return fig
