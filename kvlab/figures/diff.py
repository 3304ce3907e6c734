"""Word-level comparison of the full cache's answer with the compressed cache's."""
from __future__ import annotations

import difflib
import re

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
