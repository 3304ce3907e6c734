"""RULER-style synthetic tasks, generated in the project from a seed (no downloads).

The structure follows RULER (Hsieh et al., 2024, scripts/data/synthetic/):
needles "the special magic number for <key> is: <value>" hidden in noise
lines, with a short instruction before the text, the question after it and
an answer prefix that opens the model's answer; variable tracking hides a
chain VAR A = 12345, VAR B = VAR A, ... in the same noise. Keys are
adjective-noun pairs and values 7-digit numbers, as in RULER; the wording and
the noise line are the project's own.

The needle tasks take two further choices. ``haystack="prose"`` fills with
the project's own essay text (assets/haystack/prose.txt) instead of the one
repeated noise line: in noise the needle is the only sentence unlike the
rest, which flatters methods that keep whatever stands out (RULER has an
essay haystack for the same reason). That essay text was written for the
project with no digits and no names, so a needle's value is still the only
one of its kind: ``haystack="books"`` fills with real public-domain books
(the evaluation data's ``prose/`` folder, :func:`book_paragraphs`), whose own
numbers, dates and names are the distractors, each item a passage of its
own from a book of its own (the books in turn). ``values`` picks the
needle's shape: 7-digit numbers, word-number codes ("4821-violet"),
people's names, or ``mixed``: the three in turn, item by item.

Each generator sizes its filler so that the document is at most ``length``
model tokens (RULER's binary search over the haystack size).
"""

from __future__ import annotations

import functools
import random
import re
import string
from pathlib import Path
from typing import Callable, Literal, Sequence

from kvlab import messages
from kvlab.paths import assets_dir
from kvlab.tasks.datasets import data_dir
from kvlab.tasks.items import TaskError, TaskItem, TokenCounter

#: The noise line repeated as filler (RULER's "noise" haystack, our sentences).
NOISE = "The river runs past the old mill. The hills are quiet. A cart rolls down the lane. The bell rings at noon."

_ADJECTIVES = tuple(
    (
        "amber brave calm dusty eager faint gentle hollow icy jolly kind lucky mellow narrow odd pale quick "
        "rusty silent tall upper vivid warm young zesty bold crisp deep early fancy"
    ).split()
)
_NOUNS = tuple(
    (
        "anchor basket candle dragon engine feather garden harbor island jacket kettle ladder meadow needle "
        "orchard pillow quarry rocket saddle tunnel umbrella valley window yarrow zipper button cellar falcon "
        "lantern marble"
    ).split()
)

#: What fills the document around the needles.
Haystack = Literal["noise", "prose", "books"]
HAYSTACKS: tuple[Haystack, ...] = ("noise", "prose", "books")
#: The shape of a needle's value (``mixed``: the other three in turn, item by item).
ValueShape = Literal["number", "code", "name", "mixed"]
VALUE_SHAPES: tuple[ValueShape, ...] = ("number", "code", "name", "mixed")
MIXED_SHAPES: tuple[ValueShape, ...] = ("number", "code", "name")

#: The word half of a code; the prose filler may use these words, never with digits.
_CODE_WORDS = tuple(
    (
        "violet azure cobalt crimson olive scarlet indigo ivory copper jade maroon ochre silver teal umber "
        "saffron coral slate pearl russet"
    ).split()
)
#: Given names and family names for the name shape; the prose filler names no one.
_GIVEN_NAMES = tuple(
    (
        "Amara Bertil Cosima Dario Elif Fintan Greta Hamid Ines Jonah Kalina Lucan Mireille Nikolai Odile "
        "Pavel Quilla Rosalind Soren Thandiwe"
    ).split()
)
_FAMILY_NAMES = tuple(
    (
        "Abernathy Brandvold Castellanos Delacroix Eriksdottir Fairweather Grabowski Hollingsworth Iwasaki "
        "Jaramillo Kowalczyk Lindqvist Montgomery Nakashima Okonkwo Pemberton Quintero Rasmussen Szymanski "
        "Thorvaldsen"
    ).split()
)

#: RULER's 40 needle depths (0 to 100 %, rounded), as fractions.
RULER_DEPTHS = tuple(round(100 * i / 39) / 100 for i in range(40))
#: The needle grid's depths.
GRID_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def needle_sentence(key: str, value: str, one_of: bool = False, shape: ValueShape = "number") -> str:
    """The needle: one fact to retrieve."""
    noun = value_noun(shape)
    lead = f"One of the special magic {noun}s" if one_of else f"The special magic {noun}"
    return f"{lead} for {key} is: {value}."


def value_noun(shape: ValueShape) -> str:
    """The word a value of ``shape`` takes in the needle, question and answer prefix: the shape's own name.

    TaskError for an unknown shape (``mixed`` names no one value: :func:`item_shape` first).
    """
    if shape not in MIXED_SHAPES:
        raise TaskError(messages.unknown("needle value shape", shape, VALUE_SHAPES))
    return shape


def item_shape(values: ValueShape, index: int) -> ValueShape:
    """The value shape of item ``index``: ``values`` itself, or for ``mixed`` number, code, name in turn."""
    if values == "mixed":
        return MIXED_SHAPES[index % len(MIXED_SHAPES)]
    value_noun(values)  # refuses an unknown shape
    return values


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _code(rng: random.Random) -> str:
    return f"{rng.randint(1000, 9999)}-{rng.choice(_CODE_WORDS)}"


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_GIVEN_NAMES)} {rng.choice(_FAMILY_NAMES)}"


_VALUE_MAKERS: dict[str, Callable[[random.Random], str]] = {"number": _number, "code": _code, "name": _name}


def needle_values(rng: random.Random, shape: ValueShape, k: int) -> list[str]:
    """``k`` distinct needle values of ``shape``.

    A repeat is drawn again (several values of one key must be told apart);
    7-digit numbers almost never repeat, so the number items are the ones
    drawn before the shapes existed.
    """
    value_noun(shape)  # refuses an unknown shape
    make = _VALUE_MAKERS[shape]
    values: list[str] = []
    while len(values) < k:
        value = make(rng)
        if value not in values:
            values.append(value)
    return values


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
    """The document ``build(n)`` with the most filler units n (noise lines, prose sentences) whose length
    is at most ``length`` tokens."""
    if count(build(1)) > length:
        raise TaskError(f"length {length} tokens is too short for this task (one line of filler does not fit)")
    lo, hi = 1, 2
    while count(build(hi)) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(build(mid)) <= length else (lo, mid)
    return build(lo)


@functools.cache
def prose_paragraphs() -> tuple[str, ...]:
    """The prose filler's paragraphs (blank-line separated in the asset), each on one line."""
    text = (assets_dir() / "haystack" / "prose.txt").read_text(encoding="utf-8")
    return tuple(" ".join(block.split()) for block in text.split("\n\n") if block.strip())


def prose_units(order: Sequence[int], n: int) -> list[str]:
    """The first ``n`` sentences of the prose paragraphs read in ``order``, cycled.

    Cycling one order (rather than reshuffling each pass) keeps the same
    paragraph a whole filler apart (about 6,300 tokens on the embedded
    model), so a document shorter than that never repeats one. A paragraph's
    last sentence ends in a blank line, so the paragraphs stay visible.
    """
    paragraphs = prose_paragraphs()
    units: list[str] = []
    pos = 0
    while len(units) < n:
        units += split_units(paragraphs[order[pos % len(order)]] + "\n\n")
        pos += 1
    return units[:n]


#: Where the books haystack reads its books: the evaluation data's folder of public-domain texts.
BOOKS_FOLDER = "prose"
#: A book's paragraph enters the haystack when it is prose: at least this many characters, not
#: indented (verse, tables of contents and title pages are).
MIN_BOOK_PARAGRAPH = 120


def books_dir() -> Path:
    """The folder of public-domain books (``$KVLAB_DATA/prose``, kvlab.tasks.datasets.data_dir)."""
    return data_dir() / BOOKS_FOLDER


@functools.cache
def book_paragraphs(folder: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(book file name, its prose paragraphs, each on one line) for every ``*.txt`` in ``folder``, by name.

    TaskError when the folder holds no book (the books haystack is evaluation data, not part of
    the product: set KVLAB_DATA to the folder holding ``prose/``).
    """
    books = []
    for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        blocks = path.read_text(encoding="utf-8").split("\n\n")
        prose = tuple(
            " ".join(block.split())
            for block in blocks
            if len(" ".join(block.split())) >= MIN_BOOK_PARAGRAPH
            and not any(line.startswith("    ") for line in block.strip("\n").splitlines())
        )
        if prose:
            books.append((path.name, prose))
    if not books:
        raise TaskError(
            f"the books haystack needs public-domain books in {folder} "
            f"(set KVLAB_DATA to the folder holding {BOOKS_FOLDER}/)"
        )
    return tuple(books)


def book_units(book: int, start: int, n: int) -> list[str]:
    """The first ``n`` sentences of book ``book``'s prose paragraphs from paragraph ``start`` on,
    wrapping to the book's start; a paragraph's last sentence ends in a blank line."""
    paragraphs = book_paragraphs(books_dir())[book][1]
    units: list[str] = []
    pos = start
    while len(units) < n:
        units += split_units(paragraphs[pos % len(paragraphs)] + "\n\n")
        pos += 1
    return units[:n]


def _book_passage(task: str, seed: int, index: int) -> tuple[int, int]:
    """Item ``index``'s book (the books in turn) and a seeded first paragraph, from its own generator."""
    books = book_paragraphs(books_dir())
    book = index % len(books)
    rng = random.Random(f"{task}:{seed}:books:{index}")
    return book, rng.randrange(len(books[book][1]))


def _filler_order(task: str, seed: int, index: int) -> list[int]:
    """A seeded paragraph order per item, from its own generator so the needles' draws stay those of noise."""
    rng = random.Random(f"{task}:{seed}:prose:{index}")
    return rng.sample(range(len(prose_paragraphs())), len(prose_paragraphs()))


def _haystack(
    preamble: str, needles: Sequence[tuple[float, str]], haystack: Haystack = "noise", order: Sequence[int] = ()
) -> Callable[[int], str]:
    """``build(n)`` for :func:`fit_filler`: n noise lines, n prose sentences read in ``order``, or n
    sentences of a book from a paragraph on (``order`` = (book, first paragraph)), around the needles."""
    if haystack == "noise":
        return lambda n: preamble + "\n" + insert_at_depths([NOISE + "\n"] * n, needles)
    # A needle goes between two sentences as one more sentence, as in RULER's essays.
    if haystack == "prose":
        return lambda n: preamble + "\n\n" + insert_at_depths(prose_units(order, n), needles, sep=" ")
    if haystack == "books":
        book, start = order
        return lambda n: preamble + "\n\n" + insert_at_depths(book_units(book, start, n), needles, sep=" ")
    raise TaskError(messages.unknown("haystack", haystack, HAYSTACKS))


def task_label(task: str, haystack: Haystack = "noise", values: ValueShape = "number") -> str:
    """The task's name in results: the plain name for the defaults, else e.g. ``niah_single[prose,code]``.

    The label keeps results on different haystacks or shapes apart in a
    report and in the resume keys, and leaves the defaults' results as before.
    """
    variant = [v for v, default in ((haystack, "noise"), (values, "number")) if v != default]
    return f"{task}[{','.join(variant)}]" if variant else task


def _item_id(task: str, length: int, seed: int, index: int) -> str:
    return f"{task}-L{length}-s{seed}-{index}"


def _needle_doc(
    task: str,
    count: TokenCounter,
    length: int,
    seed: int,
    index: int,
    preamble: str,
    needles: Sequence[tuple[float, str]],
    haystack: Haystack,
) -> str:
    """The document of item ``index``: ``needles`` in the longest filler that fits ``length`` tokens."""
    order: Sequence[int] = ()
    if haystack == "prose":
        order = _filler_order(task, seed, index)
    elif haystack == "books":
        order = _book_passage(task, seed, index)
    return fit_filler(_haystack(preamble, needles, haystack, order), count, length)


def niah_single(
    count: TokenCounter,
    n: int,
    seed: int,
    length: int,
    depths: Sequence[float] | None = None,
    haystack: Haystack = "noise",
    values: ValueShape = "number",
) -> list[TaskItem]:
    """One needle in the haystack; ask for its value.

    depths: one per item, cycled (the needle grid); default a random RULER depth per item.
    """
    task = "niah_single" if depths is None else "needle_grid"
    label = task_label(task, haystack, values)
    rng = random.Random(f"{task}:{seed}")
    items = []
    for i in range(n):
        shape = item_shape(values, i)
        noun = value_noun(shape)
        key, value = _keys(rng, 1)[0], needle_values(rng, shape, 1)[0]
        depth = rng.choice(RULER_DEPTHS) if depths is None else depths[i % len(depths)]
        preamble = (
            f"A special magic {noun} is hidden in the text below. Remember it: you will be asked for it afterwards."
        )
        needle = needle_sentence(key, value, shape=shape)
        doc = _needle_doc(task, count, length, seed, i, preamble, [(depth, needle)], haystack)
        items.append(
            TaskItem(
                label,
                _item_id(label, length, seed, i),
                doc,
                question=f"What is the special magic {noun} for {key} in the text above?",
                answers=(value,),
                scoring="contains",
                answer_prefix=f"The special magic {noun} for {key} is",
                depth=depth,
            )
        )
    return items


def needle_grid(
    count: TokenCounter, n: int, seed: int, length: int, haystack: Haystack = "noise", values: ValueShape = "number"
) -> list[TaskItem]:
    """Single needles at the grid's depths (0, 25, 50, 75, 100 %), ``n`` items in all, depths cycled."""
    return niah_single(count, n, seed, length, depths=GRID_DEPTHS, haystack=haystack, values=values)


def niah_multikey(
    count: TokenCounter,
    n: int,
    seed: int,
    length: int,
    n_keys: int = 4,
    haystack: Haystack = "noise",
    values: ValueShape = "number",
) -> list[TaskItem]:
    """``n_keys`` needles with different keys (RULER's multikey_1: 4); ask for one key's value."""
    label = task_label("niah_multikey", haystack, values)
    rng = random.Random(f"niah_multikey:{seed}")
    items = []
    for i in range(n):
        shape = item_shape(values, i)
        noun = value_noun(shape)
        keys = _keys(rng, n_keys)
        vals = needle_values(rng, shape, n_keys)
        depths = rng.sample(RULER_DEPTHS, n_keys)
        asked = rng.randrange(n_keys)
        preamble = (
            f"Special magic {noun}s for several keys are hidden in the text below. "
            "Remember them: you will be asked for one of them afterwards."
        )
        needles = [(d, needle_sentence(k, v, shape=shape)) for d, k, v in zip(depths, keys, vals)]
        doc = _needle_doc("niah_multikey", count, length, seed, i, preamble, needles, haystack)
        key = keys[asked]
        items.append(
            TaskItem(
                label,
                _item_id(label, length, seed, i),
                doc,
                question=f"What is the special magic {noun} for {key} in the text above?",
                answers=(vals[asked],),
                scoring="contains",
                answer_prefix=f"The special magic {noun} for {key} is",
                depth=depths[asked],
            )
        )
    return items


def niah_multivalue(
    count: TokenCounter,
    n: int,
    seed: int,
    length: int,
    n_values: int = 4,
    haystack: Haystack = "noise",
    values: ValueShape = "number",
) -> list[TaskItem]:
    """One key with ``n_values`` values (RULER's multivalue: 4); all must come back."""
    label = task_label("niah_multivalue", haystack, values)
    rng = random.Random(f"niah_multivalue:{seed}")
    items = []
    for i in range(n):
        shape = item_shape(values, i)
        noun = value_noun(shape)
        key = _keys(rng, 1)[0]
        vals = needle_values(rng, shape, n_values)
        depths = rng.sample(RULER_DEPTHS, n_values)
        preamble = (
            f"Several special magic {noun}s are hidden in the text below. "
            "Remember all of them: you will be asked for them afterwards."
        )
        needles = [(d, needle_sentence(key, v, one_of=True, shape=shape)) for d, v in zip(depths, vals)]
        doc = _needle_doc("niah_multivalue", count, length, seed, i, preamble, needles, haystack)
        items.append(
            TaskItem(
                label,
                _item_id(label, length, seed, i),
                doc,
                question=f"What are all the special magic {noun}s for {key} in the text above?",
                answers=tuple(vals),
                scoring="all",
                answer_prefix=f"The special magic {noun}s for {key} are",
                max_new_tokens=48,
            )
        )
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
        items.append(
            TaskItem(
                "variable_tracking",
                _item_id("variable_tracking", length, seed, i),
                doc,
                question=f"Which variables are assigned the value {value} in the text above?",
                answers=tuple(names),
                scoring="all",
                answer_prefix=f"Following the assignments above, {len(names)} variables "
                f"are assigned the value {value}: they are",
                max_new_tokens=40,
            )
        )
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
            items.append(
                TaskItem(
                    "needle_document",
                    f"needle_document-d{d:g}-s{seed}-{r}",
                    doc,
                    question=f"What is the special magic number for {key} in the text above?",
                    answers=(value,),
                    scoring="contains",
                    answer_prefix=f"The special magic number for {key} is",
                    depth=d,
                )
            )
    return items
