"""Method knobs as widgets: one input per field of a method's Options (kvlab.catalog.Knob)."""

from __future__ import annotations

import json

import gradio as gr

from kvlab.catalog import Knob


def knob_component(knob: Knob) -> gr.components.Component:
    """The input for one knob: a dropdown of choices, a checkbox, a slider, a number or a text box."""
    info = f"{knob.help} (default {knob.default!r})".strip()
    if knob.choices:
        return gr.Dropdown(choices=list(knob.choices), value=knob.default, label=knob.name, info=info)
    if knob.kind is bool:
        return gr.Checkbox(value=bool(knob.default), label=knob.name, info=info)
    if knob.kind is int:
        return gr.Number(value=knob.default, precision=0, step=1, label=knob.name, info=info)
    if knob.slider is not None:
        low, high = knob.slider
        step = (high - low) / 20
        return gr.Slider(minimum=low, maximum=high, value=knob.default, step=step, label=knob.name, info=info)
    if knob.kind is float:
        return gr.Number(value=knob.default, step=0.01, label=knob.name, info=info)
    return gr.Textbox(value="" if knob.default is None else str(knob.default), label=knob.name, info=info)


def knob_updates(chosen: str, knobs: list[Knob]) -> list:
    """Explore's knob inputs (``knobs``, in that order) set to a link's knobs (JSON by :attr:`Knob.key`, as
    kvlab.ui.app's page load writes it into a hidden box), the others left as they are."""
    values = json.loads(chosen) if chosen else {}
    return [values[k.key] if k.key in values else gr.update() for k in knobs]
