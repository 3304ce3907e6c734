"""RULER-style synthetic tasks, generated in the project from a seed (no downloads).

The structure follows RULER (Hsieh et al., 2024, scripts/data/synthetic/):
needles "the special magic number for <key> is: <value>" hidden in noise
lines, with a short instruction before the text, the question after it and
an answer prefix that opens the model's answer; variable tracking hides a
chain VAR A = 12345, VAR B = VAR A, ... in the same noise. Keys are
adjective-noun pairs and values 7-digit numbers, as in RULER; the wording and
the noise line are the project's own.

Each generator sizes its filler so that the document is at most ``length``
model tokens (RULER's binary search over the haystack size).
"""
from __future__ import annotations

import random
import re
import string
from typing import Callable, Sequence

from kvlab.tasks.items import TaskError, TaskItem, TokenCounter

#: The noise line repeated as filler (RULER's "noise" haystack, our sentences).
NOISE = "The river runs past the old mill. The hills are quiet. A cart rolls down the lane. The bell rings at noon."

_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "kind", "lucky", "mellow", "narrow", "odd", "pale", "quick", "rusty", "silent", "tall",
    "upper", "vivid", "warm", "young", "zesty", "bold", "crisp", "deep", "early", "fancy",
)
_NOUNS = (
    "anchor", "basket", "candle", "dragon", "engine", "feather", "garden", "harbor", "island", "jacket",
    "kettle", "ladder", "meadow", "needle", "orchard", "pillow", "quarry", "rocket", "saddle", "tunnel",
    "umbrella", "valley", "window", "yarrow", "zipper", "button", "cellar", "falcon", "lantern", "marble",
)

#: RULER's 40 needle depths (0 to 100 %, rounded), as fractions.
RULER_DEPTHS = tuple(round(100 * i / 39) / 100 for i in range(40))
#: The needle grid's depths.
GRID_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def needle_sentence(key: str, value: str, one_of: bool = False) -> str:
    """The needle: one fact to retrieve."""
    lead = "One of the special magic numbers" if one_of else "The special magic number"
    return f"{lead} for {key} is: {value}."


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def split_units(text: str) -> list[str]:
    """Cut prose into sentences, each keeping its trailing whitespace: "".join(units) == text."""
    units, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        units.append(text[start : m.end()])
        start = m.end()
    if start < len(text):
        units.append(text[start:])
    return units


def insert_at_depths(units: Sequence[str], needles: Sequence[tuple[float, str]], sep: str = "\n") -> str:
    """Join ``units`` with each (depth, text) needle placed before unit round(depth * len(units)).

    depth 0 puts the needle first, 1 after the last unit. Needles at the same
    position keep their given order.
    """
    out = list(units)
    n = len(units)
    # Insert from the back so that earlier positions stay valid.
    placed = sorted(((round(d * n), i, t) for i, (d, t) in enumerate(needles)), reverse=True)
    for pos, _, text in placed:
        if pos == n and out and not out[-1][-1:].isspace():
            text = sep + text
        out.insert(pos, text + sep)
    return "".join(out)


def fit_filler(build: Callable[[int], str], count: TokenCounter, length: int) -> str:
    """The document ``build(n)`` with the most noise lines n whose length is at most ``length`` tokens."""
    if count(build(1)) > length:
        raise TaskError(f"length {length} tokens is too short for this task (one noise line does not fit)")
    lo, hi = 1, 2
    while count(build(hi)) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(build(mid)) <= length else (lo, mid)
    return build(lo)


def _haystack(preamble: str, needles: Sequence[tuple[float, str]]) -> Callable[[int], str]:
    return lambda n: preamble + "\n" + insert_at_depths([NOISE + "\n"] * n, needles)


def _item_id(task: str, length: int, seed: int, index: int) -> str:
    return f"{task}-L{length}-s{seed}-{index}"


def niah_single(count: TokenCounter, n: int, seed: int, length: int, depths: Sequence[float] | None = None) -> list[TaskItem]:
    """One needle in noise; ask for its number.

    depths: one per item, cycled (the needle grid); default a random RULER depth per item.
    """
    task = "niah_single" if depths is None else "needle_grid"
    rng = random.Random(f"{task}:{seed}")
    items = []
    for i in range(n):
        key, value = _keys(rng, 1)[0], _number(rng)
        depth = rng.choice(RULER_DEPTHS) if depths is None else depths[i % len(depths)]
        preamble = "A special magic number is hidden in the text below. Remember it: you will be asked for it afterwards."
        doc = fit_filler(_haystack(preamble, [(depth, needle_sentence(key, value))]), count, length)
        items.append(TaskItem(
            task, _item_id(task, length, seed, i), doc,
            question=f"What is the special magic number for {key} in the text above?",
            answers=(value,), scoring="contains",
            answer_prefix=f"The special magic number for {key} is", depth=depth,
        ))
    return items


def needle_grid(count: TokenCounter, n: int, seed: int, length: int) -> list[TaskItem]:
    """Single needles at the grid's depths (0, 25, 50, 75, 100 %), ``n`` items in all, depths cycled."""
    return niah_single(count, n, seed, length, depths=GRID_DEPTHS)


def niah_multikey(count: TokenCounter, n: int, seed: int, length: int, n_keys: int = 4) -> list[TaskItem]:
    """``n_keys`` needles with different keys (RULER's multikey_1: 4); ask for one key's number."""
    rng = random.Random(f"niah_multikey:{seed}")
    items = []
    for i in range(n):
        keys = _keys(rng, n_keys)
        values = [_number(rng) for _ in keys]
        depths = rng.sample(RULER_DEPTHS, n_keys)
        asked = rng.randrange(n_keys)
        preamble = ("Special magic numbers for several keys are hidden in the text below. "
                    "Remember them: you will be asked for one of them afterwards.")
        needles = [(d, needle_sentence(k, v)) for d, k, v in zip(depths, keys, values)]
        doc = fit_filler(_haystack(preamble, needles), count, length)
        key = keys[asked]
        items.append(TaskItem(
            "niah_multikey", _item_id("niah_multikey", length, seed, i), doc,
            question=f"What is the special magic number for {key} in the text above?",
            answers=(values[asked],), scoring="contains",
            answer_prefix=f"The special magic number for {key} is", depth=depths[asked],
        ))
    return items


def niah_multivalue(count: TokenCounter, n: int, seed: int, length: int, n_values: int = 4) -> list[TaskItem]:
    """One key with ``n_values`` numbers (RULER's multivalue: 4); all must come back."""
    rng = random.Random(f"niah_multivalue:{seed}")
    items = []
    for i in range(n):
        key = _keys(rng, 1)[0]
        values = [_number(rng) for _ in range(n_values)]
        depths = rng.sample(RULER_DEPTHS, n_values)
        preamble = ("Several special magic numbers are hidden in the text below. "
                    "Remember all of them: you will be asked for them afterwards.")
        needles = [(d, needle_sentence(key, v, one_of=True)) for d, v in zip(depths, values)]
        doc = fit_filler(_haystack(preamble, needles), count, length)
        items.append(TaskItem(
            "niah_multivalue", _item_id("niah_multivalue", length, seed, i), doc,
            question=f"What are all the special magic numbers for {key} in the text above?",
            answers=tuple(values), scoring="all",
            answer_prefix=f"The special magic numbers for {key} are", max_new_tokens=48,
        ))
    return items


def _variable_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def variable_tracking(count: TokenCounter, n: int, seed: int, length: int, hops: int = 4) -> list[TaskItem]:
    """A chain VAR A = value, VAR B = VAR A, ... (``hops`` links, RULER's vt: 4) in noise, in order.

    The answer is every variable of the chain (all must come back).
    """
    rng = random.Random(f"variable_tracking:{seed}")
    items = []
    for i in range(n):
        names = _variable_names(rng, hops + 1)
        value = str(rng.randint(10_000, 99_999))
        lines = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
        # Distinct depths, sorted, so the chain reads in order.
        depths = sorted(rng.sample(RULER_DEPTHS, len(lines)))
        preamble = "Follow the chain of variable assignments hidden in the text below."
        doc = fit_filler(_haystack(preamble, list(zip(depths, lines))), count, length)
        items.append(TaskItem(
            "variable_tracking", _item_id("variable_tracking", length, seed, i), doc,
            question=f"Which variables are assigned the value {value} in the text above?",
            answers=tuple(names), scoring="all",
            answer_prefix=f"Following the assignments above, {len(names)} variables are assigned the value {value}: they are",
            max_new_tokens=40,
        ))
    return items


def needle_items(document_text: str, depths: Sequence[float], seed: int = 0, per_depth: int = 1) -> list[TaskItem]:
    """A needle test on the user's own document: one item per (depth, repeat).

    The needle sentence goes between two sentences of the document at each
    depth (0 to 1); the document is otherwise unchanged.
    """
    if not document_text.strip():
        raise TaskError("the document is empty")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise TaskError("needle depths must be between 0 and 1")
    rng = random.Random(f"needle_document:{seed}")
    units = split_units(document_text)
    items = []
    for d in depths:
        for r in range(per_depth):
            key, value = _keys(rng, 1)[0], _number(rng)
            doc = insert_at_depths(units, [(d, needle_sentence(key, value))], sep=" ")
            items.append(TaskItem(
                "needle_document", f"needle_document-d{d:g}-s{seed}-{r}", doc,
                question=f"What is the special magic number for {key} in the text above?",
                answers=(value,), scoring="contains",
                answer_prefix=f"The special magic number for {key} is", depth=d,
            ))
    return items
