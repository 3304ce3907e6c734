"""The registered methods as any front end shows them: knobs, labels, Learn text.

It sits above the methods: importing it imports kvlab.methods, which registers them all, so
a front end reading the catalog sees every method file.
Everything here is read off the method classes (``summary``, ``learn``: the
markdown file beside the method's own, ``paper``, ``query_aware*``, ``presets``)
and their Options dataclasses (each field's type, default, help and bounds), so
that the app, the command line and the docs cannot drift apart. No gradio here: the app turns a
:class:`Knob` into a widget, the CLI into a flag.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any, Literal

import kvlab.methods  # noqa: F401 - every method registered before the catalog reads the registry
from kvlab.compression.interface import FAMILIES
from kvlab.compression.options import MethodError, alias_of, allowed, option_types
from kvlab.compression.paper import Baseline, Paper
from kvlab.compression.registry import REGISTRY, method_class, method_presets
from kvlab.compression.selection import SELECTION_PRESETS, SelectionOptions, selection_learn

Awareness = Literal["yes", "no", "options"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Knob:
    """One field of one method's Options dataclass.

    kind: the field's resolved type (``int``, ``float``, ``bool``, ``str`` or a
    ``Literal[...]`` of its choices); wrapper: a selection wrapper's knob (the same on every
    scoring method, :class:`SelectionOptions`), not the method's own.
    """

    method: str
    field: dataclasses.Field
    kind: Any
    wrapper: bool = False

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def slider(self) -> tuple[float, float] | None:
        """The (low, high) range of a knob declared as a slider, else None."""
        if not self.field.metadata.get("slider"):
            return None
        return self.field.metadata["low"], self.field.metadata["high"]

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The allowed values of a Literal field, else None."""
        return typing.get_args(self.kind) if typing.get_origin(self.kind) is typing.Literal else None

    @property
    def allowed(self) -> str:
        """What the knob accepts, in words (the wording of the validation errors)."""
        return allowed(self.field, self.kind)

    def convert(self, value: Any) -> Any:
        """``value`` (as a widget or a command line gives it) as the field's type; None when empty.

        Only the type is checked here (a whole number for an int, a choice for
        a Literal); ranges are the Options dataclass's own check.
        """
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        text = str(value).strip()
        kind, problem = self.kind, f"{self.method}: {self.name} must be {self.allowed}, got {value!r}"
        if self.choices is not None:
            text = alias_of(self.field, text) or text
            if text not in self.choices:
                raise MethodError(problem)
            return text
        if kind is bool:
            if isinstance(value, bool):
                return value
            if text.lower() not in _TRUE + _FALSE:
                raise MethodError(problem)
            return text.lower() in _TRUE
        if kind in (int, float):
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise MethodError(problem) from None
            if kind is float:
                return number
            if not number.is_integer():
                raise MethodError(problem)
            return int(number)
        return value


def knobs(name: str) -> list[Knob]:
    """The knobs of method ``name``: its own in the order of its Options fields, then the selection
    wrappers' (:class:`SelectionOptions`, a base class, whose fields dataclasses would list first)."""
    options = method_class(name).Options
    kinds = option_types(options)
    shared = {f.name for f in dataclasses.fields(SelectionOptions)} if issubclass(options, SelectionOptions) else set()
    fields = [f for f in dataclasses.fields(options) if f.init]
    return [Knob(name, f, kinds[f.name], f.name in shared) for f in sorted(fields, key=lambda f: f.name in shared)]


def method_spec(entry: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """``name`` or ``name:knob=value:knob=value`` -> (name, ((knob, converted value), ...)).

    Raises MethodError for an unknown method, a knob the method does not have,
    or a value the knob does not allow (the message names what it allows).
    """
    name, *pairs = entry.strip().split(":")
    method_class(name)  # MethodError for an unknown name
    by_name = {k.name: k for k in knobs(name)}
    options = []
    for pair in pairs:
        knob, sep, text = pair.partition("=")
        if not sep or knob.strip() not in by_name:
            raise MethodError(
                f"{entry!r}: {pair!r} is not knob=value for one of {name}'s knobs "
                f"({', '.join(by_name) or 'it has none'})"
            )
        options.append((knob.strip(), by_name[knob.strip()].convert(text.strip())))
    return name, tuple(options)


def renamed_knobs(entry: str) -> list[str]:
    """One line per knob value of ``name:knob=value:...`` written in an old spelling that the knob reads as
    today's (kvlab.compression.options.knob's aliases): "`budgets=nonuniform` is `budgets=profile` now."."""
    name, *pairs = entry.strip().split(":")
    by_name = {k.name: k for k in knobs(name)}
    lines = []
    for pair in pairs:
        knob, _, text = (part.strip() for part in pair.partition("="))
        if knob in by_name and (today := alias_of(by_name[knob].field, text)) is not None:
            lines.append(f"`{knob}={text}` is `{knob}={today}` now.")
    return lines


def knob_text(value: Any) -> str:
    """A knob's value as text that :meth:`Knob.convert` reads back (a bool as true/false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def method_text(name: str, options: typing.Iterable[tuple[str, Any]] = ()) -> str:
    """``name:knob=value:...``, the spelling :func:`method_spec` reads back."""
    return name + "".join(f":{knob}={knob_text(value)}" for knob, value in options)


def method_names() -> list[str]:
    """Every registered method's name, sorted (a front end's method menu)."""
    return sorted(REGISTRY)


def prepares(name: str) -> bool:
    """Whether method ``name`` has document-only work to do before a run (e.g. KVzip's reconstruction pass)."""
    return method_class(name).prepares()


def all_knobs() -> dict[str, list[Knob]]:
    """Every registered method's knobs, by method name (sorted)."""
    return {name: knobs(name) for name in method_names()}


def options_from(name: str, given: str | dict[str, Any] | None) -> dict[str, Any]:
    """The Options keyword arguments of method ``name`` from its knobs as the app's ``knobs`` input holds them:
    a JSON object by knob name (what the page sends), ``knob=value:knob=value`` (the command line's and a
    link's spelling after the method's name), or a dict by knob name.

    Knobs left empty (None, blank) are skipped: the method's default (or its preset's value) applies.
    Raises MethodError for a knob the method does not have, a value it does not allow, or text that is neither.
    """
    if isinstance(given, str):
        text = given.strip()
        if not text.startswith("{"):
            return {
                knob: value for knob, value in method_spec(f"{name}:{text}" if text else name)[1] if value is not None
            }
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MethodError(f"{name}: the knobs {text!r} are not a JSON object ({exc.msg})") from None
    given = given or {}
    if not isinstance(given, dict):
        raise MethodError(f"{name}: the knobs must be a JSON object by knob name, got {given!r}")
    by_name = {k.name: k for k in knobs(name)}
    unknown = [knob for knob in given if knob not in by_name]
    if unknown:
        raise MethodError(
            f"{name} has no knob {', '.join(map(repr, unknown))} (its knobs: {', '.join(by_name) or 'none'})"
        )
    converted = {knob: by_name[knob].convert(value) for knob, value in given.items()}
    return {knob: value for knob, value in converted.items() if value is not None}


def presets(name: str) -> dict[str, dict[str, Any]]:
    """The method's named configurations (preset name -> option values); {} when it has none."""
    return {preset: dict(values) for preset, values in method_presets(method_class(name)).items()}


def query_awareness(name: str) -> Awareness:
    """ "yes", "no", or "options" when only some knob settings make the method query-aware."""
    cls = method_class(name)
    if cls.query_aware:
        return "yes"
    return "options" if cls.query_aware_when else "no"


def aware_tag(name: str) -> str:
    """The tag appended to a method's name in lists: ``"  [query-aware]"``,
    ``"  [query-aware with query_source=question]"``, or ``""``."""
    return {
        "yes": "  [query-aware]",
        "options": f"  [query-aware with {method_class(name).query_aware_when}]",
        "no": "",
    }[query_awareness(name)]


def method_label(name: str) -> str:
    """``name: summary`` and the query-awareness tag (the app's method menu)."""
    return f"{name}: {method_class(name).summary}{aware_tag(name)}"


def method_info(name: str) -> str:
    """The markdown line under the app's method menu: whether the question matters, and the paper."""
    cls = method_class(name)
    aware = {
        "yes": "**Query-aware**: the compression depends on your question "
        "(change the question, and the cache changes).",
        "no": "Query-agnostic: the same compressed cache serves any question.",
        "options": f"Query-agnostic with its default knobs; with {cls.query_aware_when} (see Advanced) it is "
        "**query-aware**, i.e. the compression then depends on your question.",
    }[query_awareness(name)]
    return f"{aware} {source_line(cls.paper)}".rstrip()


def source_line(paper: Paper | Baseline) -> str:
    """ "Paper: *...*." with the citation, or "This is a baseline: ..." for a baseline."""
    return f"This is {paper}." if isinstance(paper, Baseline) else f"Paper: *{paper}*."


def _cell(text: str) -> str:
    # A "|" inside a cell (e.g. ||v||) would split it.
    return text.replace("|", "\\|")


def knob_table(name: str) -> str:
    """A markdown table of the method's knobs: default (from Options), what is allowed, what it does."""
    rows = [f"| `{k.name}` | `{k.default!r}` | {_cell(k.allowed)} | {_cell(k.help)} |" for k in knobs(name)]
    if not rows:
        return ""
    return "\n".join(["| knob | default | allowed | what it does |", "|---|---|---|---|", *rows])


def _preset_lines(name: str) -> list[str]:
    return [
        f"- `{preset}`: " + ", ".join(f"`{k}={v!r}`" for k, v in values.items())
        for preset, values in presets(name).items()
    ]


def method_markdown(name: str) -> str:
    """One method's full text: heading with its tag, summary, Learn text, paper, presets, knob table."""
    cls = method_class(name)
    parts = [f"#### `{name}`{aware_tag(name)}", f"*{cls.summary}.*"]
    if cls.learn:
        parts.append(cls.learn)
    if issubclass(cls.Options, SelectionOptions):
        parts.append(selection_learn())
    parts.append(source_line(cls.paper))
    lines = _preset_lines(name)
    if lines:
        parts.append("Presets (`preset`; explicit knobs override them):\n\n" + "\n".join(lines))
    table = knob_table(name)
    if table:
        parts.append(table)
    return "\n\n".join(parts) + "\n"


def by_family() -> dict[str, list[str]]:
    """The registered methods' names by family: every family of FAMILIES, in its order; names sorted."""
    groups: dict[str, list[str]] = {family: [] for family in FAMILIES}
    for name in sorted(REGISTRY):
        groups[method_class(name).family].append(name)
    return groups


def methods_markdown() -> str:
    """Every registered method's :func:`method_markdown`, grouped by family (a heading each), sorted by name."""
    parts = []
    for family, names in by_family().items():
        if names:
            parts.append(f"### {family.capitalize()}\n\n*{FAMILIES[family].capitalize()}.*\n")
            parts.extend(method_markdown(name) for name in names)
    return "\n".join(parts)


def source_cell(paper: Paper | Baseline) -> str:
    """The table's link to where a method comes from: ``[authors, year](link)``, or "baseline"."""
    if isinstance(paper, Baseline):
        return "baseline"
    cited = paper.authors if paper.year is None else f"{paper.authors}, {paper.year}"
    return f"[{_cell(cited)}]({paper.link})"


#: Where docs/methods.md holds :func:`methods_table` (the lines between these two are generated).
TABLE_BEGIN = "<!-- methods table: generated from the catalog (kvlab.catalog.methods_table); do not edit -->"
TABLE_END = "<!-- end of the methods table -->"


def methods_table() -> str:
    """docs/methods.md's table of the methods: one per family (every family, empty ones said so),
    a row per method (name and tag, summary, source); a dagger marks the methods that take the
    selection wrappers' knobs and presets."""
    lines = []
    for family, names in by_family().items():
        lines += [f"**{family.capitalize()}**: {FAMILIES[family]}.", ""]
        if not names:
            lines += ["No method of this family yet.", ""]
            continue
        lines += ["| method | what it keeps | source |", "| --- | --- | --- |"]
        for name in names:
            cls = method_class(name)
            label = f"`{name}`" + (" †" if issubclass(cls.Options, SelectionOptions) else "")
            if aware_tag(name):
                label += " " + aware_tag(name).strip()
            lines.append(f"| {label} | {_cell(cls.summary)} | {source_cell(cls.paper)} |")
        lines.append("")
    wrappers = ", ".join(f"`{preset}`" for preset in SELECTION_PRESETS)
    lines.append(f"† takes the selection wrappers' knobs and their presets ({wrappers}): `kvlab methods --long`.")
    return "\n".join(lines)


def with_methods_table(doc: str) -> str:
    """``doc`` (docs/methods.md's text) with the lines between :data:`TABLE_BEGIN` and :data:`TABLE_END`
    replaced by :func:`methods_table`."""
    head, begin, rest = doc.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError("the document has no methods-table markers")
    return f"{head}{TABLE_BEGIN}\n{methods_table()}\n{TABLE_END}{tail}"


def describe(name: str, long: bool = False, width: int = 0) -> str:
    """The CLI's text for a method: one line (name padded to ``width``, summary, tag), or with
    ``long`` its full :func:`method_markdown`."""
    if long:
        return method_markdown(name)
    return f"{name:<{width}}  {method_class(name).summary}{aware_tag(name)}"
