"""The page's links (kvlab.lab.links) in the page: what a link opens (its settings applied on load, Explore's
method and knobs through the knob panel) and "Link to this" (the shown tab's settings as a link)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import gradio as gr

from kvlab import limits
from kvlab.bounded.policies import bounded_policies
from kvlab.catalog import method_names
from kvlab.documents import DocumentError
from kvlab.examples import Example
from kvlab.lab import links, pick_examples
from kvlab.lab.inputs import MAX_RATIO, MIN_RATIO
from kvlab.ui.common import (
    RATIO_MAX,
    RATIO_MIN,
    CompareInputs,
    DocumentInputs,
    GenerateInputs,
    PickInputs,
    example_model,
)
from kvlab.ui.compare import SWEEP_RATIOS
from kvlab.ui.generate import SOURCES as GENERATE_SOURCES
from kvlab.ui.knobs import changed, link_panel

log = logging.getLogger("kvlab.app")


def link_choices(examples: list[Example], specs: list[str]) -> links.LinkChoices:
    """What this page's links may choose from: its examples, methods, ranges and models."""
    return links.LinkChoices(
        examples=tuple(ex.id for ex in examples),
        pick_examples=tuple(ex.id for ex in pick_examples(examples)),
        methods=tuple(method_names()),
        ratio_range=(RATIO_MIN, RATIO_MAX),
        sweep_ratios=tuple(SWEEP_RATIOS),
        sweep_range=(MIN_RATIO, MAX_RATIO),
        generate_methods=tuple(bounded_policies()),
        models=tuple(specs),
        question_chars=limits.LIMITS.question_chars,
    )


def _read_link(
    request: gr.Request | None, choices: links.LinkChoices, by_id: dict[str, Example]
) -> tuple[links.Link, Example | None, str | None]:
    """The page's link (its notes say what could not be applied), its example and that example's text."""
    try:
        link = links.parse_link(dict(request.query_params or {}) if request else {}, choices)
    except Exception:  # noqa: BLE001 - a link never breaks the page: it opens on its defaults
        log.exception("reading the page's link failed")
        link = links.Link(notes=("the link could not be read: the page opens on its defaults.",))
    ex = by_id.get(link.example) if link.example else None
    if ex is None:
        return link, None, None
    try:
        return link, ex, ex.text()
    except DocumentError as exc:
        return dataclasses.replace(link, notes=(*link.notes, f"example `{ex.id}` is unreadable ({exc}).")), None, None


def follow_tabs(tab: gr.State, tab_objects: tuple[gr.Tab, ...]) -> None:
    """Keep ``tab`` on the name (kvlab.lab.links.TABS) of the tab shown, which "Link to this" reads."""
    for name, one_tab in zip(links.TABS, tab_objects, strict=True):
        one_tab.select(lambda name=name: name, None, tab, api_name=False, queue=False)


def link_updates(link: links.Link, ex: Example | None, doc: str | None, choices: links.LinkChoices) -> tuple:
    """What the page's components become for ``link`` (``gr.update()``: left as they are), in the order
    :func:`wire_links` lists them, the last the link's Explore method and its knobs for
    :func:`kvlab.ui.knobs.link_panel` (JSON; left as it is when the link names no method). A pick link
    sets the Your pick tab's document, question and ratio, and leaves Explore's as they are; a link to
    the first tab (or none) leaves the tabs as the visitor has them."""
    keep = gr.update()
    suggested = keep
    if ex is not None:
        suggested = gr.Dropdown(
            choices=list(ex.questions), value=link.question if link.question in ex.questions else ex.questions[0]
        )
    question = link.question or (ex.questions[0] if ex is not None else keep)
    ticked = more = keep
    if link.ratios is not None:
        ticked = [r for r in link.ratios if r in choices.sweep_ratios]
        more = ", ".join(f"{r:g}" for r in link.ratios if r not in choices.sweep_ratios)
    source = keep if link.source is None else GENERATE_SOURCES[links.SOURCES.index(link.source)]
    compare_methods = list(link.methods) if link.tab == "compare" and link.methods else keep
    generate_methods = list(link.methods) if link.tab == "generate" and link.methods else keep
    picked = link.tab == "pick"
    pick = [keep] * 5  # example, text, suggested, question, ratio
    if picked:
        pick = [keep, keep, keep, link.question or keep, keep if link.ratio is None else link.ratio]
        if ex is not None and doc is not None:
            pick[:4] = [ex.id, doc, suggested, question]
    # The page opens on its first tab: selecting that one again when the load answers would only take
    # back a tab the visitor clicked while the page was loading.
    opens_where_it_is = link.tab == links.TABS[0]
    return (
        link.note(),
        keep if opens_where_it_is else gr.Tabs(selected=link.tab),
        keep if opens_where_it_is else link.tab,
        ex.id if ex is not None else keep,
        keep if doc is None else doc,
        suggested,
        question,
        link.method or keep,
        keep if link.ratio is None or picked else link.ratio,
        link.model or example_model(ex, list(choices.models)) or keep,
        compare_methods,
        ticked,
        more,
        keep if link.models is None else list(link.models),
        source,
        generate_methods,
        keep if link.budget is None else link.budget,
        *pick,
        json.dumps({"method": link.method, "knobs": dict(link.options)}) if link.method else keep,
    )


def _settings_link(
    by_id: dict[str, Example],
    specs: list[str],
    tab_,
    example_id,
    text,
    question,
    method,
    ratio,
    model,
    methods,
    ticked,
    more,
    compare_models,
    source,
    gen_methods,
    budget,
    pick: tuple = (None, None, None, None),
    options: tuple[tuple[str, Any], ...] = (),
) -> gr.Textbox:
    """ "Link to this": the tab's current settings as a link query (kvlab.lab.links); a document of the
    visitor's own is not part of it (the box says so). pick: the Your pick tab's (example, text, question,
    ratio), which its link carries; options: Explore's method's knobs, which Explore's link carries."""
    if tab_ == "pick":
        example_id, text, question, ratio = pick
    ex = by_id.get(example_id)
    own = ex is None or _example_body(ex) != (text or "").strip()
    ratios = [float(r) for r in ticked or []] + [
        x for x in (links.number(t) for t in (more or "").split(",")) if x is not None
    ]
    link = links.Link(
        tab=tab_ or "explore",
        example=None if own else ex.id,
        question=(question or "").strip() or None,
        model=None if not model or model == specs[0] else model,
        method=method if tab_ == "explore" else None,
        options=options if tab_ == "explore" else (),
        ratio=float(ratio) if tab_ in links.ONE_RATIO_TABS and ratio is not None else None,
        methods=tuple(methods or ()) if tab_ == "compare" else tuple(gen_methods or ()) if tab_ == "generate" else None,
        ratios=tuple(ratios) if tab_ == "compare" else None,
        models=tuple(compare_models) if tab_ == "compare" and compare_models else None,
        budget=int(budget or 0) if tab_ == "generate" else None,
        source=links.SOURCES[GENERATE_SOURCES.index(source)]
        if tab_ == "generate" and source in GENERATE_SOURCES
        else None,
    )
    info = (
        "Your own document is not part of a link: it opens on the bundled example's."
        if own and text
        else "Opens the lab on these settings"
    )
    return gr.Textbox(value=links.link_query(link), info=info)


def settings_widgets(inputs: DocumentInputs, sweep: CompareInputs, writing: GenerateInputs) -> list[gr.Component]:
    """The widgets a link sets and "Link to this" reads after the document's: Explore's method, ratio and
    model, Compare's methods, ratios and models, Generate's source, methods and budget, in that order."""
    return [
        inputs.method,
        inputs.ratio,
        inputs.model,
        sweep.methods,
        sweep.ratios,
        sweep.more_ratios,
        sweep.models,
        writing.source,
        writing.methods,
        writing.budget,
    ]


def wire_links(
    demo: gr.Blocks,
    choices: links.LinkChoices,
    examples: list[Example],
    specs: list[str],
    inputs: DocumentInputs,
    picking: PickInputs,
    sweep: CompareInputs,
    writing: GenerateInputs,
    tabs: gr.Tabs,
    tab: gr.State,
    note: gr.Markdown,
    button: gr.Button,
    box: gr.Textbox,
) -> None:
    """Page load: apply the URL's link (kvlab.lab.links), then prepare the document shown; and
    "Link to this" (:func:`wire_link_button`)."""
    by_id = {ex.id: ex for ex in examples}

    def open_link(request: gr.Request):
        return link_updates(*_read_link(request, choices, by_id), choices)

    # A link's method relabels the knob panel through a hidden box whose change does it: an output left as
    # it is still costs the server a component's construction (Gradio's update), so a page opened without
    # a method in its link (nearly every one) must not list the panel's.
    link_knobs = gr.Textbox(visible=False)
    demo.load(
        open_link,
        None,
        [
            note,
            tabs,
            tab,
            inputs.example,
            inputs.text,
            inputs.suggested,
            inputs.question,
            *settings_widgets(inputs, sweep, writing),
            picking.example,
            picking.text,
            picking.suggested,
            picking.question,
            picking.ratio,
            link_knobs,
        ],
        api_name=False,
        queue=False,
    ).then(api_name=False, **inputs.prepare)  # the document the page opens on
    link_knobs.change(
        lambda chosen: link_panel(inputs.knobs, chosen), link_knobs, inputs.knobs.outputs, api_name=False, queue=False
    ).then(api_name=False, **inputs.prepare)  # the method prepared with the link's knobs

    wire_link_button(button, box, by_id, specs, tab, inputs, picking, sweep, writing)


def wire_link_button(
    button: gr.Button,
    box: gr.Textbox,
    by_id: dict[str, Example],
    specs: list[str],
    tab: gr.State,
    inputs: DocumentInputs,
    picking: PickInputs,
    sweep: CompareInputs,
    writing: GenerateInputs,
) -> None:
    """ "Link to this": the shown tab's settings as a link (kvlab.lab.links), Explore's method's knobs
    that differ from their defaults included, in the box as a whole address."""
    shown = [tab, inputs.example, inputs.text, inputs.question, *settings_widgets(inputs, sweep, writing)]
    pick_shown = [picking.example, picking.text, picking.question, picking.ratio]

    def make_link(*settings):
        tab_settings, rest = settings[: len(shown)], settings[len(shown) :]
        pick_settings, values = rest[: len(pick_shown)], rest[len(pick_shown)]
        return _settings_link(by_id, specs, *tab_settings, pick=pick_settings, options=changed(tab_settings[4], values))

    button.click(make_link, [*shown, *pick_shown, inputs.knobs.values], [box], api_name=False, queue=False).then(
        None, [box], [box], js="(q) => q.startsWith('?') ? window.location.origin + window.location.pathname + q : q"
    )


def _example_body(ex: Example) -> str | None:
    """An example's document as the text box shows it, None when unreadable."""
    try:
        return ex.text().strip()
    except DocumentError:
        return None
