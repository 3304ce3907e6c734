"""Method knobs as widgets: one panel of slots that the method picked relabels to its own knobs.

A method's knobs (kvlab.catalog.Knob) each take a slot of their kind (a dropdown of choices, a
checkbox, a whole number, a number, a slider, a text box), among the method's own knobs or, in a fold,
the selection wrappers'; a kind has as many slots as the method with most knobs of that kind needs
(35 in all, 8 of them the wrappers', where one widget per knob of every method made 320). Every
widget is a component that each page open and each new session copies, so a class of thirty opening
the page at once waited seconds on the 300 widgets nobody looked at.

The values travel as one hidden text box (``values``, a JSON object by knob name) that the page
sends with Run: a knob the learner edits rewrites it in the browser (:func:`compose_js`, no request),
a pick of a method, a preset or a link rewrites it with the slots (:func:`method_panel`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import gradio as gr

from kvlab.catalog import Knob, knobs, method_info, options_from, presets
from kvlab.compression.options import MethodError

#: The slots' kinds, in the panel's order.
SLOT_KINDS = ("choice", "flag", "whole", "number", "range", "text")
#: The preset menu's entry for knobs set by hand.
CUSTOM = "(knobs as set below)"
#: The fold of the selection wrappers' knobs (kvlab.compression.selection), the same for every scoring method.
WRAPPERS = "Selection wrappers (the same knobs on every scoring method; see Learn)"


class Slot(NamedTuple):
    """Where a slot is (among the selection wrappers' knobs, or the method's own) and its widget's kind."""

    wrapper: bool
    kind: str


def slot_kind(knob: Knob) -> str:
    """The kind of widget ``knob`` takes: its choices, a flag, a whole number, a slider, a number or a text."""
    if knob.choices:
        return "choice"
    if knob.kind is bool:
        return "flag"
    if knob.kind is int:
        return "whole"
    if knob.slider is not None:
        return "range"
    return "number" if knob.kind is float else "text"


def slot_layout(every: dict[str, list[Knob]]) -> tuple[tuple[Slot, ...], dict[str, tuple[int, ...]]]:
    """(each slot's section and kind, each method's slot per knob in its knobs' order): a method's ``i``-th
    knob of a kind in a section (its own knobs, then the selection wrappers') takes that section's ``i``-th
    slot of the kind, and there are as many as the method needing most of them needs."""

    def place(knob: Knob) -> Slot:
        return Slot(knob.wrapper, slot_kind(knob))

    counts: dict[Slot, int] = {}
    for method_knobs in every.values():
        for where, n in Counter(map(place, method_knobs)).items():
            counts[where] = max(counts.get(where, 0), n)
    slots = tuple(
        Slot(wrapper, kind)
        for wrapper in (False, True)
        for kind in SLOT_KINDS
        for _ in range(counts.get(Slot(wrapper, kind), 0))
    )
    layout = {}
    for method, method_knobs in every.items():
        taken: Counter = Counter()
        chosen = []
        for knob in method_knobs:
            chosen.append(slots.index(place(knob)) + taken[place(knob)])
            taken[place(knob)] += 1
        layout[method] = tuple(chosen)
    return slots, layout


def knob_props(knob: Knob, value: Any) -> dict[str, Any]:
    """The properties that make a slot of ``knob``'s kind show ``knob`` holding ``value``."""
    props: dict[str, Any] = dict(label=knob.name, info=f"{knob.help} (default {knob.default!r})".strip(), visible=True)
    kind = slot_kind(knob)
    if kind == "choice":
        props["choices"] = list(knob.choices)
    elif kind == "range":
        low, high = knob.slider
        props.update(minimum=low, maximum=high, step=(high - low) / 20)
    if kind == "flag":
        props["value"] = bool(value)
    elif kind == "text":
        props["value"] = "" if value is None else str(value)
    else:
        props["value"] = value
    return props


def slot_widget(kind: str, knob: Knob | None) -> gr.components.Component:
    """A slot of ``kind``, showing ``knob`` at its default (hidden when None)."""
    props = knob_props(knob, knob.default) if knob is not None else {"visible": False}
    if kind == "choice":
        return gr.Dropdown(**{"choices": [], **props})
    if kind == "flag":
        return gr.Checkbox(**props)
    if kind == "whole":
        return gr.Number(precision=0, step=1, **props)
    if kind == "number":
        return gr.Number(step=0.01, **props)
    if kind == "range":
        return gr.Slider(**props)
    return gr.Textbox(**props)


@dataclass
class KnobPanel:
    """The method's description line, its published-configuration menu, the knob slots (``places[i]`` where
    ``slots[i]`` is and its kind; ``layout[method]`` the slot of each of its knobs), the fold holding the
    selection wrappers' slots, and the hidden box of the knobs' values."""

    info: gr.Markdown
    preset: gr.Dropdown
    slots: list[gr.components.Component]
    places: tuple[Slot, ...]
    layout: dict[str, tuple[int, ...]]
    wrappers: gr.Accordion
    values: gr.Textbox

    @property
    def outputs(self) -> list:
        """What :func:`method_panel` sets, in its order."""
        return [self.info, self.preset, self.wrappers, *self.slots, self.values]


def build_panel(methods: list[str], start_method: str, info: gr.Markdown) -> KnobPanel:
    """The panel of ``methods``' knobs, showing ``start_method``'s; ``info``: the method's description line
    (drawn under the method menu)."""
    every = {name: knobs(name) for name in methods}
    places, layout = slot_layout(every)
    preset = gr.Dropdown(
        **preset_menu(start_method), label="Published configuration", elem_id="kvlab-preset",
        info="Sets the knobs below to a configuration of the paper",
    )  # fmt: skip
    shown = dict(zip(layout[start_method], every[start_method]))
    slots: list[gr.components.Component] = []
    with gr.Row():
        slots += [slot_widget(p.kind, shown.get(i)) for i, p in enumerate(places) if not p.wrapper]
    with gr.Accordion(WRAPPERS, open=False, visible=has_wrappers(start_method)) as wrappers:
        with gr.Row():
            slots += [slot_widget(p.kind, shown.get(i)) for i, p in enumerate(places) if p.wrapper]
    values = gr.Textbox(visible=False, elem_id="kvlab-knobs")
    return KnobPanel(info, preset, slots, places, layout, wrappers, values)


def has_wrappers(method: str) -> bool:
    """Whether ``method`` takes the selection wrappers' knobs."""
    return any(k.wrapper for k in knobs(method))


def preset_menu(method: str) -> dict[str, Any]:
    """The preset menu's properties for ``method``: its presets after CUSTOM, hidden when it has none."""
    names = list(presets(method))
    return dict(choices=[CUSTOM, *names], value=CUSTOM, visible=bool(names))


def method_panel(panel: KnobPanel, method: str, values: dict[str, Any] | None = None) -> list:
    """:attr:`KnobPanel.outputs` showing ``method``: its description, its preset menu, whether the wrappers'
    fold shows, then :func:`knob_values`."""
    return [
        method_info(method),
        gr.update(**preset_menu(method)),
        gr.update(visible=has_wrappers(method)),
        *knob_values(panel, method, values),
    ]


def knob_values(panel: KnobPanel, method: str, values: dict[str, Any] | None = None) -> list:
    """The slots showing ``method``'s knobs, each at ``values``' entry (by knob name) or its default (the
    other slots hidden), then the hidden box holding ``values`` (as JSON; empty for none)."""
    values = values or {}
    shown = dict(zip(panel.layout[method], knobs(method)))
    slots = [
        gr.update(**knob_props(shown[i], values.get(shown[i].name, shown[i].default)))
        if i in shown
        else gr.update(visible=False)
        for i in range(len(panel.slots))
    ]
    return [*slots, json.dumps(values) if values else ""]


def preset_updates(panel: KnobPanel, method: str, preset: str) -> list:
    """The slots and the hidden box for ``method``'s ``preset`` (each knob the preset does not name at its
    default); nothing changes for CUSTOM."""
    if preset == CUSTOM or preset not in presets(method):
        return [gr.update() for _ in panel.slots] + [gr.update()]
    return knob_values(panel, method, presets(method)[preset])


def link_panel(panel: KnobPanel, chosen: str) -> list:
    """:func:`method_panel` for a link's Explore method and its knobs (JSON ``{"method", "knobs"}``, as
    kvlab.ui.page_links' page load writes it into a hidden box)."""
    link = json.loads(chosen)
    return method_panel(panel, link["method"], link["knobs"])


def changed(method: str, values: str) -> tuple[tuple[str, Any], ...]:
    """``method``'s knobs in the panel's ``values`` (its hidden box) that differ from their defaults, in the
    knobs' order: what a link carries; () when the values are not the method's."""
    try:
        given = options_from(method, values)
    except MethodError:  # the box of a method picked an instant ago: its panel not yet followed
        return ()
    return tuple((k.name, given[k.name]) for k in knobs(method) if k.name in given and given[k.name] != k.default)


def compose_js(panel: KnobPanel) -> str:
    """The browser function of a knob edited by hand: (method, every slot's value) -> the hidden box's JSON,
    the method's knobs by name (no request: the box is what Run sends)."""
    names = {method: [[k.name, i] for k, i in zip(knobs(method), slots)] for method, slots in panel.layout.items()}
    return (
        "(method, ...values) => { const out = {}; "
        f"for (const [name, slot] of ({json.dumps(names)}[method] || [])) out[name] = values[slot]; "
        "return JSON.stringify(out); }"
    )
