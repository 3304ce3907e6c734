"""The Explore tab: one document, one method at one ratio, one question; everything measured.

Endpoints (each event has an ``api_name``, so ``gradio_client`` can drive it):

- ``/run``: (text, file, method, ratio, question, max_new_tokens, layer, head,
  model, intensity, and one keyword per knob named ``<method>__<field>``) ->
  summary, both answers, their word diff, five figures, the token-fate view;
  ``layer`` and ``head`` must lie in the sliders' range, which follows the
  model of the session's last run.
- ``/prepare``: (text, file, method, model, question, max_new_tokens, knobs)
  -> a status line. Fired as soon as a document or question is chosen
  (example, upload, or the text or question box left), so that Run finds the
  prefill, the method's reference queries and the full cache's answer done.
- ``/token_view``: (layer, head, intensity) -> the document coloured by token
  fate for that layer and KV head of the session's last run.
- ``/load_example``: (example id) -> document text, suggested questions, question.
- ``/pick_question``: (suggested question) -> question.
- ``/load_file``: (file) -> document text.
- ``/select_method``: (method) -> its description, which knobs show, and (for a method with
  document-only work to do) the value whose change prepares it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gradio as gr

from kvlab import figures
from kvlab.catalog import Knob, aware_tag, method_info, method_label, options_from, presets
from kvlab.documents import DocumentError
from kvlab.examples import Example
from kvlab.lab import InputError, Prepared, needle_test, parse_ratios, prepare_document
from kvlab.lab.explore import explore_key
from kvlab.lab.tasks import MAX_DEPTHS
from kvlab.lab.views import with_served_note
from kvlab.methods import REGISTRY, method_class
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS
from kvlab.ui import common
from kvlab.ui.common import GPU_MAX_S, USER_ERRORS, DocumentInputs, as_gr_error, checked_model, guarded, on_gpu, served
from kvlab.ui.knobs import knob_component
from kvlab.ui.present import (
    INTENSITIES,
    INTENSITY_DEFAULT,
    TokenFates,
    drawn_for,
    is_drawn,
    run_view,
    token_view,
    token_view_for,
)
from kvlab.ui.tasks import TaskOutputs, build_task_outputs, show

RATIO_MIN, RATIO_MAX, RATIO_DEFAULT = 2, 100, 10
#: The needle test's first settings: methods besides the one chosen, ratios, depths.
NEEDLE_METHODS, NEEDLE_RATIOS, NEEDLE_DEPTHS = ("streaming_llm",), "5, 10, 20", 3
#: The preset menu's entry for knobs set by hand.
CUSTOM = "(knobs as set below)"
MAX_NEW_TOKENS_MAX = 256


@on_gpu(duration=GPU_MAX_S)
def needle_view(text, file, methods, ratios, depths, model, progress=None):  # noqa: ANN001 - a ZeroGPU function
    """The heavy part of ``/needle_test``: kvlab.lab.needle_test (plain results come back)."""
    return needle_test(text, file, methods, ratios, depths, model, progress=progress or (lambda f, d: None))


def preset_values(method_knobs: list[Knob], preset: str) -> list:
    """Each knob's value under ``preset`` (its default where the preset says nothing); unchanged for CUSTOM."""
    if preset == CUSTOM or not method_knobs:
        return [gr.update() for _ in method_knobs]
    chosen = presets(method_knobs[0].method)[preset]
    return [chosen.get(k.name, k.default) for k in method_knobs]


def prepared_status(p: Prepared) -> str:
    """The line under the document once it is prepared."""
    prefill = f"prefill {p.prefill_s:.1f} s" + ("" if p.prefilled_now else " (already done)")
    answer = "" if p.answer_s is None else f"; the full cache's answer to the question in {p.answer_s:.1f} s"
    return (
        f"Ready: {p.doc_tokens:,} document tokens read by {p.model} ({prefill}; {p.method} prepared in "
        f"{p.method_s:.1f} s{answer}). Run reuses this work."
    )


@dataclass
class DocumentWidgets:
    """The document column: the example menu, the upload, the document's text and the line saying it is prepared."""

    example: gr.Dropdown
    upload: gr.File
    text: gr.Textbox
    status: gr.Markdown


@dataclass
class KnobWidgets:
    """The "Advanced" knobs: one column per method (shown for the method picked), each knob's
    input by its key (``<method>__<field>``), and the published-configuration menu of each method that has one."""

    groups: list[gr.Column]
    inputs: dict[str, gr.components.Component]
    presets: dict[str, gr.Dropdown]


@dataclass
class ChoiceWidgets:
    """The method column: the method and its description, the ratio, the question, the answer length,
    the knobs, Run and Stop."""

    method: gr.Dropdown
    info: gr.Markdown
    ratio: gr.Slider
    suggested: gr.Dropdown
    question: gr.Textbox
    max_new: gr.Slider
    knobs: KnobWidgets
    run: gr.Button
    stop: gr.Button


@dataclass
class ResultWidgets:
    """What a run shows above the token view: the summary, both answers with their marks, their diff, the figures."""

    summary: gr.Markdown
    mark_full: gr.Markdown
    answer_full: gr.Textbox
    mark_comp: gr.Markdown
    answer_comp: gr.Textbox
    diff: gr.HighlightedText
    err: gr.Plot
    mass: gr.Plot
    kept: gr.Plot
    memory: gr.Plot
    time: gr.Plot
    divergence: gr.Plot
    fit_row: gr.Row
    bias: gr.Plot
    fit: gr.Plot


@dataclass
class TokenWidgets:
    """The token view: its layer, KV head and intensity, the counts line and the coloured document."""

    layer: gr.Slider
    head: gr.Slider
    intensity: gr.Radio
    counts: gr.Markdown
    tokens: gr.HTML


@dataclass
class NeedleWidgets:
    """The needle test's settings, its Run and Stop, and the views of its results."""

    methods: gr.CheckboxGroup
    ratios: gr.Textbox
    depths: gr.Slider
    run: gr.Button
    stop: gr.Button
    views: TaskOutputs


def build_explore_tab(
    demo: gr.Blocks,
    model: gr.Dropdown,
    examples: list[Example],
    knobs: dict[str, list[Knob]],
    start_method: str,
    specs: list[str],
    n_layers: int,
    n_kv: int,
) -> DocumentInputs:
    """The Explore tab's widgets and events (inside an open ``gr.Tab``); returns the inputs other tabs share.

    The page opens on the first bundled example and its first question, so a
    visitor's first click on Run works.
    """
    methods = sorted(REGISTRY)
    first = examples[0] if examples else None
    last = gr.State(None, time_to_live=3600)
    with gr.Row(equal_height=False):
        with gr.Column(scale=5):
            doc = build_document_column(examples, first)
        with gr.Column(scale=4):
            choice = build_choice_column(methods, knobs, start_method, first)
    results = build_results()
    fates = build_token_view(n_layers, n_kv)
    needle = build_needle_test(methods, start_method)

    loaded, uploaded = wire_document(examples, doc, choice)
    prepare_pick = wire_method(methods, knobs, choice)
    prepare_args = wire_prepare(doc, choice, model, start_method, specs, loaded, uploaded, prepare_pick)
    wire_run(doc, choice, results, fates, last, model, start_method, specs)
    wire_needle(doc, needle, model, specs)
    wire_token_view(last, fates)
    # The page prepares the document it opens on after applying its link (kvlab.ui.app).
    return DocumentInputs(
        doc.text,
        doc.upload,
        choice.question,
        choice.max_new,
        model,
        doc.example,
        choice.suggested,
        choice.method,
        choice.ratio,
        prepare_args,
    )


def build_document_column(examples: list[Example], first: Example | None) -> DocumentWidgets:
    """The example menu, the upload and the document's text, opening on ``first``."""
    example = gr.Dropdown(
        choices=[(f"{ex.title}" + (f" (~{ex.tokens:,} tokens)" if ex.tokens else ""), ex.id) for ex in examples],
        value=first.id if first else None,
        label="Bundled example",
        info="Fills the document and offers questions about it",
        elem_id="kvlab-example",
    )
    upload = gr.File(
        label="Upload a document (.txt, .md, .pdf)",
        file_types=[".txt", ".md", ".pdf"],
        type="filepath",
        height=110,
        elem_id="kvlab-file",
    )
    text = gr.Textbox(
        label="Document",
        value=_example_text(first),
        placeholder="Paste a document here, upload a file or pick an example.",
        lines=9,
        max_lines=16,
        elem_id="kvlab-text",
    )
    return DocumentWidgets(example, upload, text, gr.Markdown(elem_id="kvlab-doc-status"))


def build_choice_column(
    methods: list[str], knobs: dict[str, list[Knob]], start_method: str, first: Example | None
) -> ChoiceWidgets:
    """The method, ratio and question (``first``'s first), the "Advanced" settings, Run and Stop."""
    method = gr.Dropdown(
        choices=[(method_label(n), n) for n in methods], value=start_method, label="Method", elem_id="kvlab-method"
    )
    info = gr.Markdown(method_info(start_method))
    ratio = gr.Slider(
        RATIO_MIN,
        RATIO_MAX,
        value=RATIO_DEFAULT,
        step=1,
        label="Compression ratio",
        info="The document's tokens are reduced to about 1/ratio per KV head",
        elem_id="kvlab-ratio",
    )
    suggested = gr.Dropdown(
        choices=list(first.questions) if first else [],
        value=first.questions[0] if first else None,
        label="Suggested questions",
        info="From the bundled example",
        elem_id="kvlab-suggested",
    )
    question = gr.Textbox(
        label="Question",
        value=first.questions[0] if first else "",
        placeholder="Ask something the document answers.",
        lines=1,
        elem_id="kvlab-question",
    )
    with gr.Accordion("Advanced", open=False, elem_id="kvlab-advanced"):
        max_new = gr.Slider(
            1,
            MAX_NEW_TOKENS_MAX,
            value=DEFAULT_MAX_NEW_TOKENS,
            step=1,
            label="Answer length (max new tokens)",
            elem_id="kvlab-max-new",
        )
        method_knobs = build_knobs(methods, knobs, start_method)
    with gr.Row():
        run_btn = gr.Button("Run", variant="primary", elem_id="kvlab-run", scale=4)
        stop_btn = gr.Button("Stop", variant="stop", elem_id="kvlab-stop", scale=1)
    return ChoiceWidgets(method, info, ratio, suggested, question, max_new, method_knobs, run_btn, stop_btn)


def build_knobs(methods: list[str], knobs: dict[str, list[Knob]], start_method: str) -> KnobWidgets:
    """Each method's knobs in a column of its own, visible for ``start_method`` only."""
    groups, knob_inputs, preset_menus = [], {}, {}
    for name in methods:
        with gr.Column(visible=name == start_method, min_width=160) as group:
            gr.Markdown(f"Knobs of **{name}**" if knobs[name] else f"**{name}** has no knobs.")
            if presets(name):
                preset_menus[name] = gr.Dropdown(
                    choices=[CUSTOM, *presets(name)],
                    value=CUSTOM,
                    label="Published configuration",
                    info="Sets the knobs below to a configuration of the paper",
                    elem_id=f"kvlab-preset-{name}",
                )
            # One wrapping row for all of a method's knobs: a row (and its form) per pair of knobs
            # made the page's config some 300 components larger, which every page open copies.
            with gr.Row():
                for knob in knobs[name]:
                    knob_inputs[knob.key] = knob_component(knob)
        groups.append(group)
    return KnobWidgets(groups, knob_inputs, preset_menus)


def build_results() -> ResultWidgets:
    """The summary, both answers and their diff, and the run's figures (the fitted ones hidden until a fit)."""
    summary = gr.Markdown(elem_id="kvlab-summary")
    with gr.Row():
        with gr.Column():
            mark_full = gr.Markdown(elem_id="kvlab-mark-full")
            answer_full = gr.Textbox(
                label="Answer from the full cache",
                lines=3,
                interactive=False,
                elem_id="kvlab-answer-full",
                elem_classes="kvlab-answer",
            )
        with gr.Column():
            mark_comp = gr.Markdown(elem_id="kvlab-mark-compressed")
            answer_comp = gr.Textbox(
                label="Answer from the compressed cache",
                lines=3,
                interactive=False,
                elem_id="kvlab-answer-compressed",
                elem_classes="kvlab-answer",
            )
    diff = gr.HighlightedText(
        label="Differences (word diff)",
        color_map=figures.DIFF_COLORS,
        show_legend=True,
        show_inline_category=False,
        elem_id="kvlab-diff",
    )
    with gr.Row():
        err_plot = gr.Plot(label="Attention-output error", elem_id="kvlab-err")
        mass_plot = gr.Plot(label="Attention mass, full vs compressed", elem_id="kvlab-mass")
    with gr.Row():
        kept_plot = gr.Plot(label="Keys per head", elem_id="kvlab-kept")
        mem_plot = gr.Plot(label="Memory", elem_id="kvlab-memory")
        time_plot = gr.Plot(label="Time", elem_id="kvlab-time")
    divergence_plot = gr.Plot(label="Where the answers part", elem_id="kvlab-divergence")
    with gr.Row(visible=False) as fit_row:
        bias_plot = gr.Plot(label="Fitted biases", elem_id="kvlab-bias")
        fit_plot = gr.Plot(label="Fitting vs evaluation queries", elem_id="kvlab-fit")
    return ResultWidgets(
        summary,
        mark_full,
        answer_full,
        mark_comp,
        answer_comp,
        diff,
        err_plot,
        mass_plot,
        kept_plot,
        mem_plot,
        time_plot,
        divergence_plot,
        fit_row,
        bias_plot,
        fit_plot,
    )


def build_token_view(n_layers: int, n_kv: int) -> TokenWidgets:
    """The document coloured by token fate, with sliders over the model's ``n_layers`` layers and ``n_kv`` KV heads."""
    gr.Markdown("### The document, coloured by token fate, shaded by importance")
    with gr.Row():
        # As index_slider: Gradio refuses a slider with one value (a model with one KV head).
        layer = gr.Slider(
            0,
            max(n_layers - 1, 1),
            value=n_layers // 2,
            step=1,
            interactive=n_layers > 1,
            label="Layer",
            elem_id="kvlab-layer",
        )
        head = gr.Slider(
            0, max(n_kv - 1, 1), value=0, step=1, interactive=n_kv > 1, label="KV head", elem_id="kvlab-head"
        )
        intensity = gr.Radio(
            INTENSITIES,
            value=INTENSITY_DEFAULT,
            label="Intensity",
            info="Shade each token by its percentile within the head",
            elem_id="kvlab-intensity",
        )
    counts = gr.Markdown(token_view(None, 0, 0)[0])
    tokens = gr.HTML(elem_id="kvlab-tokens", label="Token fates")
    return TokenWidgets(layer, head, intensity, counts, tokens)


def build_needle_test(methods: list[str], start_method: str) -> NeedleWidgets:
    """The needle test's folded section: which methods and ratios, how many depths, and its results."""
    with gr.Accordion("Needle test on this document", open=False, elem_id="kvlab-needle"):
        gr.Markdown(
            'A sentence with a number (*"The special magic number for ... is ..."*) is inserted into **this '
            "document** at evenly spaced depths; the model is asked for the number from the full cache, with no "
            "context, and from each method at each ratio. Low attention error does not always mean the number "
            "survives: this shows whether it does. Each depth is a document of its own (one prefill each)."
        )
        with gr.Row():
            needle_methods = gr.CheckboxGroup(
                choices=[(n + aware_tag(n), n) for n in methods],
                value=[m for m in dict.fromkeys([start_method, *NEEDLE_METHODS]) if m in REGISTRY],
                label="Methods",
                elem_id="kvlab-needle-methods",
                scale=3,
            )
            with gr.Column(scale=2):
                needle_ratios = gr.Textbox(value=NEEDLE_RATIOS, label="Ratios", lines=1, elem_id="kvlab-needle-ratios")
                needle_depths = gr.Slider(
                    1, MAX_DEPTHS, value=NEEDLE_DEPTHS, step=1, label="Depths", elem_id="kvlab-needle-depths"
                )
        with gr.Row():
            needle_go = gr.Button("Run the needle test", elem_id="kvlab-needle-run", scale=4)
            needle_stop = gr.Button("Stop", variant="stop", elem_id="kvlab-needle-stop", scale=1)
        needle_views = build_task_outputs("needle")
    return NeedleWidgets(needle_methods, needle_ratios, needle_depths, needle_go, needle_stop, needle_views)


def wire_document(
    examples: list[Example], doc: DocumentWidgets, choice: ChoiceWidgets
) -> tuple[gr.events.Dependency, gr.events.Dependency]:
    """``/load_example``, ``/pick_question`` and ``/load_file``; returns the example's and the upload's events."""

    def on_example(example_id: str | None):
        ex = next((e for e in examples if e.id == example_id), None)
        if ex is None:
            return gr.Textbox(), gr.Dropdown(choices=[], value=None), gr.Textbox(), None
        try:
            body = ex.text()
        except DocumentError as exc:
            raise as_gr_error(exc) from exc
        return body, gr.Dropdown(choices=list(ex.questions), value=ex.questions[0]), ex.questions[0], None

    # .input, not .change: a link sets the menu with its own question (kvlab.ui.app), which .change would undo.
    loaded = doc.example.input(
        on_example,
        [doc.example],
        [doc.text, choice.suggested, choice.question, doc.upload],
        api_name="load_example",
        concurrency_limit=None,
    )
    choice.suggested.input(
        lambda q: q or gr.Textbox(),
        [choice.suggested],
        [choice.question],
        api_name="pick_question",
        concurrency_limit=None,
    )

    def on_upload(path: str | None):
        if not path:
            return gr.Textbox()
        try:
            return common.read_upload(path)
        except (DocumentError, InputError) as exc:
            raise as_gr_error(exc) from exc

    uploaded = doc.upload.upload(on_upload, [doc.upload], [doc.text], api_name="load_file", concurrency_limit=4)
    return loaded, uploaded


def wire_method(methods: list[str], knobs: dict[str, list[Knob]], choice: ChoiceWidgets) -> gr.Textbox:
    """``/select_method`` and the preset menus; returns the hidden value whose change prepares a picked method."""
    # Set by a pick of a method that has document-only work (KVzip's pass), to a new value each
    # time: its change event prepares that method. Every Gradio event costs the browser CPU time
    # (about a second for this page on a 2-core machine), so the other picks send none.
    prepare_pick = gr.Textbox(visible=False)

    def on_method(name: str):
        pick = f"{name}@{time.monotonic_ns()}" if method_class(name).prepares() else gr.skip()
        return (method_info(name), *[gr.Column(visible=n == name) for n in methods], pick)

    choice.method.change(
        on_method,
        [choice.method],
        [choice.info, *choice.knobs.groups, prepare_pick],
        api_name="select_method",
        concurrency_limit=None,
    )

    for name, menu in choice.knobs.presets.items():
        menu.input(
            lambda preset, name=name: preset_values(knobs[name], preset),
            [menu],
            [choice.knobs.inputs[k.key] for k in knobs[name]],
            api_name=False,
            concurrency_limit=None,
        )
    return prepare_pick


def wire_prepare(
    doc: DocumentWidgets,
    choice: ChoiceWidgets,
    model: gr.Dropdown,
    start_method: str,
    specs: list[str],
    loaded: gr.events.Dependency,
    uploaded: gr.events.Dependency,
    prepare_pick: gr.Textbox,
) -> dict:
    """``/prepare``, after an example is ``loaded`` or a file ``uploaded``, when the text or question box is
    left, and on a change of ``prepare_pick`` (a method that prepares picked); returns the event's keyword arguments."""

    def on_prepare(
        text=None,
        file=None,
        method=start_method,
        model=None,
        question=None,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
        progress=gr.Progress(),
        **knob_values,
    ):
        if common.spaces is not None:  # ZeroGPU: nothing computed outside a GPU slot survives it
            return "The document is read when you click Run."
        try:
            with common.bounded(slot=None):  # the time limit, Stop and a disconnect bound it too
                prepared = prepare_document(
                    common.document_input(text, file),
                    None,
                    method,
                    options_from(method, knob_values),
                    checked_model(model, specs),
                    progress,
                    question,
                    max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                )
        except USER_ERRORS as exc:
            return f"Not prepared: {exc}"
        except Exception as exc:  # noqa: BLE001 - Run will report it; the server stays up
            ident = common.error_id()
            common.log.error("error %s: preparing the document failed", ident, exc_info=exc)
            return f"Not prepared ({type(exc).__name__}, error id {ident}); Run will try again."
        return prepared_status(prepared)

    prepare_args = dict(
        fn=on_prepare,
        inputs=[doc.text, doc.upload, choice.method, model, choice.question, choice.max_new],
        outputs=[doc.status],
        inputs_kwargs=choice.knobs.inputs,
        concurrency_limit=1,
        concurrency_id="prepare",
        trigger_mode="always_last",
        show_progress_on=[doc.status],
    )
    loaded.then(api_name="prepare", **prepare_args)
    uploaded.then(api_name=False, **prepare_args)
    doc.text.blur(api_name=False, **prepare_args)
    choice.question.blur(api_name=False, **prepare_args)  # a new question: its full-cache answer in the background
    # A method with document-only work picked: that work too, quietly: a progress animation
    # beside the Run the user may click at once costs the browser, and a CPU machine's server, time.
    prepare_pick.change(api_name=False, **{**prepare_args, "show_progress": "hidden"})
    return prepare_args


def wire_run(
    doc: DocumentWidgets,
    choice: ChoiceWidgets,
    results: ResultWidgets,
    fates: TokenWidgets,
    last: gr.State,
    model: gr.Dropdown,
    start_method: str,
    specs: list[str],
) -> None:
    """``/run`` on Run, and Stop."""
    run_outputs = [
        results.summary,
        results.answer_full,
        results.answer_comp,
        results.diff,
        results.err,
        results.mass,
        results.kept,
        results.memory,
        results.time,
        fates.layer,
        fates.head,
        fates.counts,
        fates.tokens,
        last,
        results.fit_row,
        results.bias,
        results.fit,
        results.divergence,
        results.mark_full,
        results.mark_comp,
    ]
    running = choice.run.click(
        run_handler(start_method, specs, len(run_outputs)),
        [
            doc.text,
            doc.upload,
            choice.method,
            choice.ratio,
            choice.question,
            choice.max_new,
            fates.layer,
            fates.head,
            model,
            fates.intensity,
        ],
        run_outputs,
        inputs_kwargs=choice.knobs.inputs,
        api_name="run",
        concurrency_limit=common.COMPUTE_ADMITTED,
        concurrency_id="compute",
        # One progress bar where the answers will appear: an animated overlay on
        # every output costs a CPU machine's browser (and the server beside it) time.
        show_progress_on=[results.summary, results.answer_full, results.answer_comp],
    )
    choice.stop.click(None, None, None, cancels=[running], api_name=False)


def run_handler(start_method: str, specs: list[str], n_outputs: int) -> Callable[..., Iterator[tuple]]:
    """The function of ``/run``: it yields the ``n_outputs`` values of wire_run's outputs, the answers first."""

    def on_run(
        text=None,
        file=None,
        method=start_method,
        ratio=RATIO_DEFAULT,
        question=None,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
        layer=0,
        head=0,
        model=None,
        intensity=INTENSITY_DEFAULT,
        request: gr.Request = None,
        progress=gr.Progress(),
        **knob_values,
    ):
        inputs: dict = {}

        def key():
            inputs.update(
                text=common.document_input(text, file),
                options=options_from(method, knob_values),
                model=checked_model(model, specs),
            )
            inputs["key"] = explore_key(
                inputs["text"],
                None,
                method,
                ratio,
                question,
                max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                inputs["options"],
                inputs["model"],
            )
            return inputs["key"]

        stored, how = served(
            method,
            key,
            lambda: run_view(
                inputs["text"],
                None,
                method,
                ratio,
                question,
                max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                inputs["options"],
                inputs["model"],
                progress,
            ),
            owner=common.session_of(request),
            kind="run",
            progress=progress,
        )
        view = with_served_note(stored, how)
        digest = inputs["key"].digest
        if not is_drawn(digest):
            # The answers and the summary first; the figures and the token view follow as they are drawn
            # (on the CPU, outside the compute slot, which the next visitor's run can take meanwhile).
            # Figures drawn already come in the same message: one update of the page instead of two.
            yield (*view.texts, *[gr.skip()] * (n_outputs - len(view.texts) - 2), *view.answer_marks)
        drawn = drawn_for(digest, stored)
        fates = view.fates
        layer = min(max(int(layer or 0), 0), fates.n_layers - 1)
        head = min(max(int(head or 0), 0), fates.n_kv_heads - 1)
        line, html = token_view_for(digest, fates, layer, head, intensity)
        yield (
            *view.texts,
            *drawn.figures,
            index_slider(fates.n_layers, layer),
            index_slider(fates.n_kv_heads, head),
            line,
            html,
            fates,
            gr.Row(visible=drawn.fit is not None),
            *(drawn.fit or (None, None)),
            drawn.divergence,
            *view.answer_marks,
        )

    return on_run


def wire_needle(doc: DocumentWidgets, needle: NeedleWidgets, model: gr.Dropdown, specs: list[str]) -> None:
    """``/needle_test`` on its Run, and its Stop."""

    def on_needle(
        text=None,
        file=None,
        methods=None,
        ratios="",
        depths=NEEDLE_DEPTHS,
        model=None,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        chosen = list(methods or [])
        run = guarded(
            ", ".join(chosen),
            lambda: needle_view(
                common.document_input(text, file),
                None,
                chosen,
                parse_ratios([], ratios),
                depths,
                checked_model(model, specs),
                progress,
            ),
            owner=common.session_of(request),
            kind="needle_test",
            progress=progress,
        )
        return show(run)

    needle_run = needle.run.click(
        on_needle,
        [doc.text, doc.upload, needle.methods, needle.ratios, needle.depths, model],
        needle.views.all,
        api_name="needle_test",
        concurrency_limit=common.COMPUTE_ADMITTED,
        concurrency_id="compute",
    )
    needle.stop.click(None, None, None, cancels=[needle_run], api_name=False)


def wire_token_view(last: gr.State, fates: TokenWidgets) -> None:
    """``/token_view``: the last run's token fates again, at another layer, head or intensity."""

    def on_view(view: TokenFates | None, layer: int, head: int, intensity: str = INTENSITY_DEFAULT):
        return token_view(view, layer, head, intensity)

    gr.on(
        [fates.layer.input, fates.head.input, fates.intensity.input],
        on_view,
        [last, fates.layer, fates.head, fates.intensity],
        [fates.counts, fates.tokens],
        api_name="token_view",
        show_progress="minimal",
        trigger_mode="always_last",
        concurrency_limit=4,
    )


def index_slider(count: int, value: int) -> gr.Slider:
    """A slider over 0..count-1 set to ``value``; with one choice (Gemma 3 270M's one KV head) a fixed
    one, since Gradio refuses a slider whose minimum equals its maximum."""
    return gr.Slider(minimum=0, maximum=max(count - 1, 1), value=value, step=1, interactive=count > 1)


def _example_text(ex: Example | None) -> str:
    """The example's document, or "" when it is missing or unreadable (the page still opens)."""
    if ex is None:
        return ""
    try:
        return ex.text()
    except DocumentError as exc:
        common.log.warning("example %s unreadable: %s", ex.id, exc)
        return ""
