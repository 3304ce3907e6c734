"""Warming the result store ahead of a workshop: a sheet of Explore configurations, each computed once and kept.

A sheet is a text file, one configuration a line (blank lines and lines
starting with ``#`` are skipped), either a link the page would open
(kvlab.lab.links; the part from ``?`` on counts, so a full address works)::

    ?tab=explore&example=story&method=attention_matching:budgets=uniform&ratio=10

(a Your pick link, ``?tab=pick&example=story&ratio=10``, warms the runs a
learner's pick is ranked among: kvlab.lab.pick.DEFAULT_RIVALS at that ratio)

or ``METHOD RATIO EXAMPLE [QUESTION]``, where METHOD may carry knobs the
way ``kvlab bench`` takes them (``name:knob=value:knob=value``)::

    snapkv 10 story
    attention_matching:self_study_weight=4 5 story Who kept the ledger?

The question defaults to the example's first, the answer length to the
page's default, the model to the example's own (a long example's,
kvlab.examples.Example.model), else the lab's default. Each configuration is what
the page's Run would compute for it (the same kvlab.results.RunKey), so a
warmed configuration is answered from the store at once. :func:`warm` skips
what is stored already: a warm that stopped half way goes on where it stopped.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager
from urllib.parse import parse_qsl

from kvlab.catalog import method_spec, method_text
from kvlab.compression.request import MAX_RATIO, MIN_RATIO
from kvlab.documents import DocumentError
from kvlab.examples import Example
from kvlab.lab.explore import explore
from kvlab.lab.inputs import InputError, check_ratio, examples
from kvlab.lab.links import ONE_RATIO_TABS, LinkChoices, parse_link
from kvlab.lab.pick import DEFAULT_RIVALS
from kvlab.lab.spec import RunSpec, run_spec
from kvlab.lab.views import RunView, present
from kvlab.methods import REGISTRY, MethodError
from kvlab.results import ResultStore, RunKey, Served

#: What :func:`warm` did with one configuration: served from the store, computed now, or failed.
Outcome = Served | str


class SheetError(InputError):
    """A sheet that cannot be read, or one of its lines; the message names the file and line."""


@dataclass(frozen=True)
class WarmItem:
    """One configuration of a sheet (``line``: its line number, for messages)."""

    line: int
    example: str
    question: str
    method: str
    options: tuple[tuple[str, Any], ...]
    ratio: float
    model: str | None = None

    @property
    def label(self) -> str:
        return f"{method_text(self.method, self.options)} at {self.ratio:g}x on {self.example}"


@dataclass
class Warmed:
    """What happened to one configuration: its outcome, the seconds it took, the error when it failed."""

    item: WarmItem
    outcome: Outcome
    seconds: float
    error: str = ""


def _link_items(text: str, line: int, by_id: dict[str, Example], default_model: str | None) -> list[WarmItem]:
    """An Explore link's configuration (its method's knobs included), or for a Your pick link the runs a pick
    is ranked among: each of kvlab.lab.pick.DEFAULT_RIVALS at the link's ratio on its question."""
    query = text[text.index("?") + 1 :] if "?" in text else text
    choices = LinkChoices(
        examples=tuple(by_id),
        methods=tuple(sorted(REGISTRY)),
        ratio_range=(MIN_RATIO, MAX_RATIO),
        sweep_ratios=(),
        sweep_range=(MIN_RATIO, MAX_RATIO),
        generate_methods=(),
        models=(default_model,) if default_model else (),
    )
    link = parse_link(dict(parse_qsl(query, keep_blank_values=True)), choices)
    if link.notes:
        raise SheetError(f"line {line}: {' '.join(link.notes)}")
    if link.tab not in ONE_RATIO_TABS:
        raise SheetError(
            f"line {line}: only Explore and Your pick links can be warmed (this one opens the {link.tab} tab)"
        )
    methods = DEFAULT_RIVALS if link.tab == "pick" else (link.method,)
    if link.example is None or link.ratio is None or None in methods:
        raise SheetError(f"line {line}: a link to warm names an example and a ratio, an Explore link a method too")
    ex = by_id[link.example]
    question = link.question or ex.questions[0]
    model = link.model or ex.model or default_model
    return [WarmItem(line, ex.id, question, m, link.options, link.ratio, model) for m in methods]


def _plain_items(text: str, line: int, by_id: dict[str, Example], default_model: str | None) -> list[WarmItem]:
    parts = text.split(maxsplit=3)
    if len(parts) < 3:
        raise SheetError(f"line {line}: expected METHOD RATIO EXAMPLE [QUESTION] or a link, got {text!r}")
    spec, ratio_text, example_id = parts[:3]
    try:
        name, options = method_spec(spec)
        ratio = check_ratio(ratio_text)
    except (MethodError, InputError) as exc:
        raise SheetError(f"line {line}: {exc}") from None
    if example_id not in by_id:
        raise SheetError(f"line {line}: example {example_id!r} is not bundled (one of {', '.join(by_id)})")
    ex = by_id[example_id]
    question = parts[3].strip() if len(parts) > 3 else ex.questions[0]
    return [WarmItem(line, ex.id, question, name, options, ratio, ex.model or default_model)]


def parse_sheet(text: str, default_model: str | None = None, pool: list[Example] | None = None) -> list[WarmItem]:
    """Every configuration of a sheet's text, checked (SheetError names the first bad line)."""
    by_id = {ex.id: ex for ex in (examples() if pool is None else pool)}
    items = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        first = line.split()[0]  # a link is one word; a plain line's method may hold "=" but never "&"
        is_link = first.startswith(("?", "http://", "https://")) or ("=" in first and "&" in first)
        items += (_link_items if is_link else _plain_items)(line, number, by_id, default_model)
    if not items:
        raise SheetError("the sheet names no configuration")
    return items


def read_sheet(path: str | Path, default_model: str | None = None) -> list[WarmItem]:
    """:func:`parse_sheet` of a file; SheetError (naming the file) when it cannot be read or has a bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SheetError(f"{path}: cannot read the sheet ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return parse_sheet(text, default_model)
    except SheetError as exc:
        raise SheetError(f"{path}: {exc}") from None


def item_spec(item: WarmItem) -> RunSpec:
    """The configuration as the page's Run would check it (InputError, MethodError, ... for a bad one)."""
    document = next(ex for ex in examples() if ex.id == item.example).text()
    return run_spec(
        document, None, item.method, item.ratio, item.question, options=dict(item.options), model=item.model
    )


def item_key(item: WarmItem) -> RunKey:
    """The configuration's key: the one the page's Run computes for the same inputs."""
    return item_spec(item).key()


def compute(item: WarmItem) -> RunView:
    """What the page's Run computes for the configuration (kvlab.lab.views.RunView)."""
    return present(explore(item_spec(item)))


def warm(
    items: list[WarmItem],
    store: ResultStore,
    on_item: Callable[[int, Warmed], None] = lambda i, w: None,
    hold: Callable[[], ContextManager] = nullcontext,
    between: Callable[[], None] = lambda: None,
) -> list[Warmed]:
    """Compute and store every configuration not stored yet, one at a time.

    on_item(index, what happened) after each; hold(): held around each
    computation (the server's compute slot, at background priority, so a
    visitor never waits more than one configuration); between(): called
    before each item (a stopped warm raises there). A configuration that
    fails is reported and the rest go on; a visitor asking for one being
    warmed shares that computation (kvlab.results.ResultStore.serve).
    """
    done = []
    for i, item in enumerate(items):
        between()
        start = time.perf_counter()

        def make(item: WarmItem = item) -> RunView:
            with hold():
                return compute(item)

        try:
            _, outcome = store.serve(item_key(item), make)
            warmed = Warmed(item, outcome, time.perf_counter() - start)
        except (DocumentError, InputError, MethodError) as exc:
            warmed = Warmed(item, "failed", time.perf_counter() - start, str(exc))
        done.append(warmed)
        on_item(i, warmed)
    return done
