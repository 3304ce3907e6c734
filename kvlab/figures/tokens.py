"""The document coloured by each token's fate, shaded by importance, as HTML (no model, no torch).

A fate is what a compressed cache did with a token in one layer and KV head
(``CompressedKV.fates``): kept, evicted, quantised to some bits, compacted, ...
Levels (bytes 1-255, kvlab.metrics.percentile_levels) shade tokens by a
percentile rank within the head.
"""

from __future__ import annotations

import html
import itertools
from typing import Iterable, Mapping, Sequence

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
    "merged": "#c4b5fd",  # violet: a kept token whose value absorbed evicted ones (the merging family)
    "read": "#a5f3fc",  # cyan: read after the document (online compaction)
    EVICTED: "#e5e7eb",  # grey: dropped
}
_FALLBACK_COLORS = ["#f9a8d4", "#5eead4", "#a5b4fc", "#bef264"]


def fate_colors(fates: Iterable[str]) -> dict[str, str]:
    """A colour for every fate in ``fates`` (known fates keep theirs)."""
    colors = dict(FATE_COLORS)
    extra = iter(_FALLBACK_COLORS * 4)
    for fate in fates:
        if fate not in colors:
            colors[fate] = next(extra, "#d1d5db")
    return colors


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
        f"{'full precision' if key == 'full' else f'{key} bits'}</span>"
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
