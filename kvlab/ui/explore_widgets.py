"""The Explore tab's shared vocabulary: its settings' bounds and first values, and the widgets of each
section of the page (drawn by kvlab.ui.explore, wired to their events by kvlab.ui.explore_events)."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from kvlab.ui.knobs import KnobPanel
from kvlab.ui.tasks import TaskOutputs

#: The needle test's first settings: methods besides the one chosen, ratios, depths.
NEEDLE_METHODS, NEEDLE_RATIOS, NEEDLE_DEPTHS = ("streaming_llm",), "5, 10, 20", 3
MAX_NEW_TOKENS_MAX = 256


@dataclass
class DocumentWidgets:
    """The document column: the example menu, the upload, the document's text and the line saying it is prepared."""

    example: gr.Dropdown
    upload: gr.File
    text: gr.Textbox
    status: gr.Markdown


@dataclass
class ChoiceWidgets:
    """The method column: the method and its description, the ratio, the question, the answer length,
    the knob panel (the description line among what a method's pick sets), Run and Stop."""

    method: gr.Dropdown
    info: gr.Markdown
    ratio: gr.Slider
    suggested: gr.Dropdown
    question: gr.Textbox
    max_new: gr.Slider
    knobs: KnobPanel
    run: gr.Button
    stop: gr.Button


@dataclass
class ResultWidgets:
    """What a run shows above the token view: the summary, both answers with their marks, their diff, the figures
    (``roles``: each head's role for the question, beside the keys per head)."""

    summary: gr.Markdown
    mark_full: gr.Markdown
    answer_full: gr.Textbox
    mark_comp: gr.Markdown
    answer_comp: gr.Textbox
    diff: gr.HighlightedText
    err: gr.Plot
    mass: gr.Plot
    kept: gr.Plot
    roles: gr.Plot
    memory: gr.Plot
    time: gr.Plot
    divergence: gr.Plot
    fit_row: gr.Row
    bias: gr.Plot
    fit: gr.Plot


@dataclass
class TokenWidgets:
    """The token view: its layer, KV head (labelled with the heads' roles) and intensity, the counts line, the
    coloured document, and the last run's head roles (kvlab.lab.head_roles.HeadRoles) the head's label reads."""

    layer: gr.Slider
    head: gr.Slider
    intensity: gr.Radio
    counts: gr.Markdown
    tokens: gr.HTML
    roles: gr.State


@dataclass
class NeedleWidgets:
    """The needle test's settings, its Run and Stop, and the views of its results."""

    methods: gr.CheckboxGroup
    ratios: gr.Textbox
    depths: gr.Slider
    run: gr.Button
    stop: gr.Button
    views: TaskOutputs
