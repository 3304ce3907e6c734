"""The Explore tab: one document, one method at one ratio, one question; everything measured.

Endpoints (each event has an ``api_name``, so ``gradio_client`` can drive it):

- ``/run``: (text, file, method, ratio, question, max_new_tokens, layer, head,
  model, intensity, knobs) ->
  summary, both answers, their word diff, five figures, the token-fate view, the heads' roles (a figure);
  ``layer`` and ``head`` must lie in the sliders' range, which follows the
  model of the session's last run. ``knobs``: the method's knobs that differ from
  their defaults, as a JSON object by knob name (``{"budgets": "uniform"}``, what
  the page sends) or as the command line spells them after the method's name
  (``budgets=uniform:max_queries=50000``); empty for the defaults.
- ``/prepare``: (text, file, method, model, question, max_new_tokens, knobs)
  -> a status line. Fired as soon as a document or question is chosen
  (example, upload, or the text or question box left), so that Run finds the
  prefill, the method's reference queries and the full cache's answer done.
- ``/token_view``: (layer, head, intensity) -> the document coloured by token
  fate for that layer and KV head of the session's last run.
- ``/load_example``: (example id) -> document text, suggested questions, question.
- ``/pick_question``: (suggested question) -> question.
- ``/load_file``: (file) -> document text.
- ``/select_method``: (method) -> its description, its preset menu, the knob panel relabelled
  to its knobs at their defaults, the knobs' (emptied) values, and (for a method with
  document-only work to do) the value whose change prepares it.
"""

from __future__ import annotations

import gradio as gr

from kvlab import figures
from kvlab.catalog import aware_tag, method_info, method_label, method_names
from kvlab.documents import DocumentError
from kvlab.examples import Example
from kvlab.lab import example_label
from kvlab.lab.tasks import MAX_DEPTHS
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS
from kvlab.ui import common
from kvlab.ui.common import RATIO_DEFAULT, RATIO_MAX, RATIO_MIN, DocumentInputs
from kvlab.ui.explore_events import (
    wire_document,
    wire_head_roles,
    wire_method,
    wire_needle,
    wire_prepare,
    wire_run,
    wire_token_view,
)
from kvlab.ui.explore_widgets import (
    MAX_NEW_TOKENS_MAX,
    NEEDLE_DEPTHS,
    NEEDLE_METHODS,
    NEEDLE_RATIOS,
    ChoiceWidgets,
    DocumentWidgets,
    NeedleWidgets,
    ResultWidgets,
    TokenWidgets,
)
from kvlab.ui.knobs import build_panel
from kvlab.ui.present import INTENSITIES, INTENSITY_DEFAULT, token_view
from kvlab.ui.tasks import build_task_outputs


def build_explore_tab(
    demo: gr.Blocks,
    model: gr.Dropdown,
    examples: list[Example],
    start_method: str,
    specs: list[str],
    n_layers: int,
    n_kv: int,
) -> DocumentInputs:
    """The Explore tab's widgets and events (inside an open ``gr.Tab``); returns the inputs other tabs share.

    The page opens on the first bundled example and its first question, so a
    visitor's first click on Run works.
    """
    methods = method_names()
    first = examples[0] if examples else None
    last = gr.State(None, time_to_live=3600)
    with gr.Row(equal_height=False):
        with gr.Column(scale=5):
            doc = build_document_column(examples, first)
        with gr.Column(scale=4):
            choice = build_choice_column(methods, start_method, first)
    results = build_results()
    fates = build_token_view(n_layers, n_kv)
    needle = build_needle_test(methods, start_method)

    loaded, uploaded = wire_document(examples, doc, choice, model, specs)
    prepare_pick = wire_method(choice)
    prepare_args = wire_prepare(doc, choice, model, start_method, specs, loaded, uploaded, prepare_pick)
    wire_run(doc, choice, results, fates, last, model, start_method, specs)
    wire_needle(doc, needle, model, specs)
    wire_token_view(last, fates)
    wire_head_roles(fates)
    # The page prepares the document it opens on after applying its link (kvlab.ui.page_links).
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
        choice.knobs,
    )


def build_document_column(examples: list[Example], first: Example | None) -> DocumentWidgets:
    """The example menu, the upload and the document's text, opening on ``first``."""
    example = gr.Dropdown(
        choices=[(example_label(ex), ex.id) for ex in examples],
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


def build_choice_column(methods: list[str], start_method: str, first: Example | None) -> ChoiceWidgets:
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
        method_knobs = build_panel(methods, start_method, info)
    with gr.Row():
        run_btn = gr.Button("Run", variant="primary", elem_id="kvlab-run", scale=4)
        stop_btn = gr.Button("Stop", variant="stop", elem_id="kvlab-stop", scale=1)
    return ChoiceWidgets(method, info, ratio, suggested, question, max_new, method_knobs, run_btn, stop_btn)


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
        roles_plot = gr.Plot(label="Head roles", elem_id="kvlab-roles")
    with gr.Row():
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
        roles_plot,
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
    return TokenWidgets(layer, head, intensity, counts, tokens, gr.State(None, time_to_live=3600))


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
                value=[m for m in dict.fromkeys([start_method, *NEEDLE_METHODS]) if m in methods],
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


def _example_text(ex: Example | None) -> str:
    """The example's document, or "" when it is missing or unreadable (the page still opens)."""
    if ex is None:
        return ""
    try:
        return ex.text()
    except DocumentError as exc:
        common.log.warning("example %s unreadable: %s", ex.id, exc)
        return ""
