"""Links that open the lab on one configuration, and the link to what a page shows.

``?tab=explore&example=story&method=kvzip&ratio=10&question=Who+kept+the+ledger``
opens the Explore tab on the bundled example ``story`` with that question,
KVzip at 10x. Explore's method may carry knobs the way ``kvlab bench`` takes
them, ``method=attention_matching:budgets=uniform`` (a knob the method lacks,
or a value it refuses, is dropped with a note). The Your pick tab reads
``example``, ``question`` and ``ratio``. The Compare tab reads ``methods``, ``ratios`` and ``models``
(comma-separated; models: the same sweep on each of the page's models named),
the Generate tab ``methods`` (its bounded-cache methods), ``budget`` and
``source=document`` (write after the Explore tab's document and question).
``method``/``methods`` and ``ratio``/``ratios`` are the same parameter, so a
link reads naturally for one tab or several values.

A parameter that is unknown or out of range is dropped: the page keeps its
default there and :attr:`Link.notes` says so (one line each), never an error.
Pure functions on strings, no gradio: :mod:`kvlab.ui.page_links` applies a
:class:`Link` to the widgets at page load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlencode

from kvlab.catalog import method_spec, method_text, renamed_knobs
from kvlab.lab.spec import RunSpec, run_spec
from kvlab.methods import MethodError, get_method

TABS = ("explore", "pick", "compare", "generate", "learn")
#: The tabs that read one method at one ratio (Explore's slider range).
ONE_RATIO_TABS = ("explore", "pick")
#: Parameters a link may carry; anything else gets a note.
PARAMETERS = (
    "tab",
    "example",
    "question",
    "method",
    "methods",
    "ratio",
    "ratios",
    "budget",
    "source",
    "model",
    "models",
)
SOURCES = ("prompt", "document")


@dataclass(frozen=True)
class LinkChoices:
    """What a link may choose from: the page's own menus and ranges."""

    examples: tuple[str, ...]
    methods: tuple[str, ...]
    ratio_range: tuple[float, float]  # the Explore slider's
    sweep_ratios: tuple[float, ...]  # the Compare tab's ticks; other ratios in sweep_range go to "More ratios"
    sweep_range: tuple[float, float]
    generate_methods: tuple[str, ...]
    models: tuple[str, ...] = ()
    question_chars: int = 2_000
    pick_examples: tuple[str, ...] | None = None  # the examples Your pick lists (None: all of ``examples``)


@dataclass(frozen=True)
class Link:
    """What a link sets (None: the page's default) and a note per refused parameter."""

    tab: str = "explore"
    example: str | None = None
    question: str | None = None
    model: str | None = None
    method: str | None = None
    options: tuple[tuple[str, Any], ...] = ()  # Explore's method's knobs, (name, value) as kvlab.catalog.method_spec
    ratio: float | None = None
    methods: tuple[str, ...] | None = None
    ratios: tuple[float, ...] | None = None
    budget: int | None = None
    source: str | None = None
    models: tuple[str, ...] | None = None
    notes: tuple[str, ...] = field(default=())
    renamed: tuple[str, ...] = field(default=())  # old spellings read as today's, one line each

    def note(self) -> str:
        """The page's lines about the link: "" when every parameter was taken as written."""
        lines = []
        if self.notes:
            lines.append("**This link was partly understood:** " + " ".join(self.notes))
        if self.renamed:
            lines.append("**This link uses older spellings, read as today's:** " + " ".join(self.renamed))
        return "\n\n".join(lines)


def number(text: str) -> float | None:
    """``text`` as a finite number, None when it is not one."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _read_document(got: dict[str, str], tab: str, choices: LinkChoices, values: dict, notes: list[str]) -> None:
    """The example (one ``tab`` lists), the question and the model, for every tab."""
    if got.get("example"):
        listed = choices.pick_examples if tab == "pick" and choices.pick_examples is not None else choices.examples
        if got["example"] in listed:
            values["example"] = got["example"]
        elif got["example"] in choices.examples:
            notes.append(f"example `{got['example']}` is not offered on this tab (one of {', '.join(listed)}).")
        else:
            notes.append(f"example `{got['example']}` is not bundled (one of {', '.join(choices.examples)}).")
    if got.get("question"):
        if len(got["question"]) <= choices.question_chars:
            values["question"] = got["question"]
        else:
            notes.append(f"the question is longer than {choices.question_chars:,} characters: not used.")
    if got.get("model"):
        if got["model"] in choices.models:
            values["model"] = got["model"]
        else:
            notes.append(f"model `{got['model']}` is not offered here.")


def _read_models(got: dict[str, str], choices: LinkChoices, values: dict, notes: list[str]) -> None:
    """Compare's models (only Compare reads them)."""
    names = _names(got["models"])
    unknown = [n for n in names if n not in choices.models]
    if unknown:
        notes.append(f"model {', '.join(f'`{n}`' for n in unknown)} is not offered here.")
    offered_models = tuple(dict.fromkeys(n for n in names if n in choices.models))
    if offered_models:
        values["models"] = offered_models


def _read_methods(
    got: dict[str, str], tab: str, choices: LinkChoices, values: dict, notes: list[str], renamed: list[str]
) -> None:
    """The method (Explore runs one, its knobs too) or methods, each offered by the tab."""
    offered = choices.generate_methods if tab == "generate" else choices.methods
    entries = _names(got.get("methods") or got.get("method") or "")
    names = [e.split(":")[0] for e in entries] if tab == "explore" else entries
    unknown = [n for n in names if n not in offered]
    if unknown:
        notes.append(
            f"method {', '.join(f'`{n}`' for n in unknown)} is not offered here (one of {', '.join(offered)})."
        )
    known = tuple(dict.fromkeys(n for n in names if n in offered))
    if tab == "explore" and known:
        values["method"] = known[0]
        values["options"] = _knobs(entries[names.index(known[0])], notes, renamed)
        if len(known) > 1:
            notes.append(f"Explore runs one method: `{known[0]}`.")
    elif tab in ("compare", "generate") and known:
        values["methods"] = known


def _knobs(spec: str, notes: list[str], renamed: list[str]) -> tuple[tuple[str, Any], ...]:
    """The knobs of an Explore method ``name:knob=value:...``, each checked as the method's Options check it;
    () with a note when one is refused (the method then runs with its defaults); a line in ``renamed`` for
    each old spelling read as today's (kvlab.catalog.renamed_knobs)."""
    try:
        name, options = method_spec(spec)
        get_method(name, **dict(options))
    except MethodError as exc:
        notes.append(f"{exc} (the method's defaults are used).")
        return ()
    renamed += renamed_knobs(spec)
    return options


def _read_ratios(ratio_text: str, tab: str, choices: LinkChoices, values: dict, notes: list[str]) -> None:
    """Explore's ratio (the first good one) or Compare's ratios, each within the tab's range."""
    low, high = choices.ratio_range if tab in ONE_RATIO_TABS else choices.sweep_range
    numbers = [(t, number(t)) for t in _names(ratio_text)]
    bad = [t for t, x in numbers if x is None or not low <= x <= high]
    if bad:
        notes.append(f"ratio {', '.join(f'`{t}`' for t in bad)} is not a number from {low:g} to {high:g}.")
    good = tuple(dict.fromkeys(x for _, x in numbers if x is not None and low <= x <= high))
    if tab in ONE_RATIO_TABS and good:
        values["ratio"] = good[0]
    elif good:
        values["ratios"] = good


def _read_generation(got: dict[str, str], values: dict, notes: list[str]) -> None:
    """Generate's budget and source."""
    if got.get("budget"):
        budget = number(got["budget"])
        if budget is None or budget < 0 or budget != int(budget):
            notes.append(f"budget `{got['budget']}` is not a whole number of keys (0: a quarter of the text).")
        else:
            values["budget"] = int(budget)
    if got.get("source"):
        if got["source"] in SOURCES:
            values["source"] = got["source"]
        else:
            notes.append(f"source `{got['source']}` is not one of {', '.join(SOURCES)}.")


def parse_link(params: Mapping[str, str], choices: LinkChoices) -> Link:
    """The configuration ``params`` (a page's query parameters) asks for, each checked against ``choices``."""
    notes: list[str] = []
    got = {k: str(v).strip() for k, v in params.items()}
    for key in sorted(set(got) - set(PARAMETERS)):
        notes.append(f"`{key}` is not a parameter (use {', '.join(PARAMETERS)}).")
    values: dict[str, object] = {}
    tab = got.get("tab", "").lower() or "explore"
    if tab not in TABS:
        notes.append(f"tab `{tab}` does not exist (one of {', '.join(TABS)}): Explore opens.")
        tab = "explore"
    _read_document(got, tab, choices, values, notes)
    if got.get("models") and tab == "compare":
        _read_models(got, choices, values, notes)
    renamed: list[str] = []
    _read_methods(got, tab, choices, values, notes, renamed)
    ratio_text = got.get("ratios") or got.get("ratio") or ""
    if ratio_text and tab in (*ONE_RATIO_TABS, "compare"):
        _read_ratios(ratio_text, tab, choices, values, notes)
    if tab == "generate":
        _read_generation(got, values, notes)
    return Link(tab=tab, notes=tuple(notes), renamed=tuple(renamed), **values)  # type: ignore[arg-type]


def link_query(link: Link) -> str:
    """``?tab=...&...``: the query of a link that opens ``link`` (parameters the tab reads, None left out)."""
    pairs: list[tuple[str, str]] = [("tab", link.tab)]
    for key in ("example", "question", "model", "method", "source"):
        value = getattr(link, key)
        if key == "method" and value is not None:
            value = method_text(value, link.options)
        if value is not None:
            pairs.append((key, value))
    if link.ratio is not None:
        pairs.append(("ratio", f"{link.ratio:g}"))
    if link.methods:
        pairs.append(("methods", ",".join(link.methods)))
    if link.ratios:
        pairs.append(("ratios", ",".join(f"{r:g}" for r in link.ratios)))
    if link.models:
        pairs.append(("models", ",".join(link.models)))
    if link.budget is not None:
        pairs.append(("budget", str(link.budget)))
    return "?" + urlencode(pairs, safe=",:")


def spec_link(spec: RunSpec, example: str) -> Link:
    """The Explore link that opens ``spec``, whose document is the bundled example ``example``'s."""
    return Link(
        example=example,
        question=spec.question,
        model=spec.model,
        method=spec.method,
        options=spec.knobs,
        ratio=spec.ratio,
    )


def link_spec(link: Link, document: str, question: str) -> RunSpec:
    """The run an Explore ``link`` opens (its example's ``document``; ``question``: the page's question when
    the link names none), checked as the page's Run checks it (kvlab.lab.spec.run_spec)."""
    return run_spec(
        document,
        None,
        link.method or "",
        link.ratio,
        link.question or question,
        options=dict(link.options),
        model=link.model,
    )
