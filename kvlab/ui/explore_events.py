"""The Explore tab's events: what each endpoint of kvlab.ui.explore does, and its wiring to the page's widgets."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import gradio as gr

from kvlab.catalog import options_from, prepares
from kvlab.documents import DocumentError
from kvlab.examples import Example
from kvlab.lab import InputError, Prepared, RunSpec, needle_test, needle_test_items, parse_ratios, run_spec
from kvlab.lab.head_roles import HeadRoles
from kvlab.lab.views import head_picker_label, head_role_line, with_served_note
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS
from kvlab.ui import common
from kvlab.ui.common import GPU_MAX_S, RATIO_DEFAULT, USER_ERRORS, as_gr_error, checked_model, guarded, on_gpu, served
from kvlab.ui.explore_widgets import (
    NEEDLE_DEPTHS,
    ChoiceWidgets,
    DocumentWidgets,
    NeedleWidgets,
    ResultWidgets,
    TokenWidgets,
)
from kvlab.ui.knobs import compose_js, method_panel, preset_updates
from kvlab.ui.present import INTENSITY_DEFAULT, TokenFates, drawn, run_view, token_view, token_view_for
from kvlab.ui.tasks import show


@on_gpu(duration=GPU_MAX_S)
def needle_view(text, file, methods, ratios, depths, model, progress=None):  # noqa: ANN001 - a ZeroGPU function
    """The heavy part of ``/needle_test``: kvlab.lab.needle_test (plain results come back)."""
    return needle_test(text, file, methods, ratios, depths, model, progress=progress or (lambda f, d: None))


def prepared_status(p: Prepared) -> str:
    """The line under the document once it is prepared."""
    prefill = f"prefill {p.prefill_s:.1f} s" + ("" if p.prefilled_now else " (already done)")
    answer = "" if p.answer_s is None else f"; the full cache's answer to the question in {p.answer_s:.1f} s"
    return (
        f"Ready: {p.doc_tokens:,} document tokens read by {p.model} ({prefill}; {p.method} prepared in "
        f"{p.method_s:.1f} s{answer}). Run reuses this work."
    )


def wire_document(
    examples: list[Example], doc: DocumentWidgets, choice: ChoiceWidgets, model: gr.Dropdown, specs: list[str]
) -> tuple[gr.events.Dependency, gr.events.Dependency]:
    """``/load_example``, ``/pick_question`` and ``/load_file``; returns the example's and the upload's events.
    An example read by its own model (a long one: kvlab.examples.Example.model) switches the model menu to it."""

    def on_example(example_id: str | None):
        ex = next((e for e in examples if e.id == example_id), None)
        if ex is None:
            return gr.Textbox(), gr.Dropdown(choices=[], value=None), gr.Textbox(), None, gr.skip()
        try:
            body = ex.text()
        except DocumentError as exc:
            raise as_gr_error(exc) from exc
        questions = gr.Dropdown(choices=list(ex.questions), value=ex.questions[0])
        return body, questions, ex.questions[0], None, common.example_model(ex, specs) or gr.skip()

    # .input, not .change: a link sets the menu with its own question (kvlab.ui.page_links), which .change would undo.
    loaded = doc.example.input(
        on_example,
        [doc.example],
        [doc.text, choice.suggested, choice.question, doc.upload, model],
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


def wire_method(choice: ChoiceWidgets) -> gr.Textbox:
    """``/select_method``, the preset menu and the knobs edited by hand; returns the hidden value whose change
    prepares a picked method."""
    # Set by a pick of a method that has document-only work (KVzip's pass), to a new value each
    # time: its change event prepares that method. Every Gradio event costs the browser CPU time
    # (about a second for this page on a 2-core machine), so the other picks send none.
    prepare_pick = gr.Textbox(visible=False)
    panel = choice.knobs

    def on_method(name: str):
        pick = f"{name}@{time.monotonic_ns()}" if prepares(name) else gr.skip()
        return (*method_panel(panel, name), pick)

    # A pick by the learner (a link sets the method and its panel itself, kvlab.ui.page_links): the knobs' values
    # emptied at once in the browser, so that a Run clicked before the panel follows sends the defaults.
    choice.method.input(None, None, [panel.values], js="() => ''", api_name=False, queue=False)
    choice.method.input(
        on_method, [choice.method], [*panel.outputs, prepare_pick], api_name="select_method", concurrency_limit=None
    )
    panel.preset.input(
        lambda method, preset: preset_updates(panel, method, preset),
        [choice.method, panel.preset],
        [*panel.slots, panel.values],
        api_name=False,
        concurrency_limit=None,
    )
    gr.on(
        [slot.input for slot in panel.slots],
        None,
        [choice.method, *panel.slots],
        [panel.values],
        js=compose_js(panel),
        api_name=False,
        queue=False,
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
        knobs=None,
        progress=gr.Progress(),
    ):
        if common.spaces is not None:  # ZeroGPU: nothing computed outside a GPU slot survives it
            return "The document is read when you click Run."
        try:
            # Computed by a background job with its own bound (common.prepared_first): this request only
            # waits, showing its progress; Stop and a closed page end the wait, not at once the job, which a
            # reload or a Run clicked meanwhile joins.
            with common.bounded(slot=None):
                (prepared,) = common.prepared_first(
                    common.document_input(text, file),
                    [(method, options_from(method, knobs))],
                    checked_model(model, specs),
                    question,
                    max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                    progress,
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
        inputs=[doc.text, doc.upload, choice.method, model, choice.question, choice.max_new, choice.knobs.values],
        outputs=[doc.status],
        preprocess=False,  # see wire_run
        # Requests here only wait for the background jobs, which take turns (kvlab.lab.background): a page
        # that comes back must not queue behind another page's wait.
        concurrency_limit=common.COMPUTE_ADMITTED,
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
        fates.roles,
        results.fit_row,
        results.bias,
        results.fit,
        results.divergence,
        results.roles,
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
            choice.knobs.values,
        ],
        run_outputs,
        api_name="run",
        # The inputs as the page sends them (the knobs' own checks convert them, kvlab.catalog.Knob.convert;
        # an upload comes as its FileData): Gradio's preprocessing hands each input to a worker thread,
        # which under thirty pages' load cost a stored run seconds of the interpreter's lock.
        preprocess=False,
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
        knobs=None,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        def checked() -> RunSpec:
            return run_spec(
                common.document_input(text, file),
                None,
                method,
                ratio,
                question,
                max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                options_from(method, knobs),
                checked_model(model, specs),
            )

        before: list[Prepared] = []  # what the run's own preparation did (its summary says so)

        def ready(spec: RunSpec) -> None:
            before.extend(
                common.prepared_first(
                    spec.document,
                    [(spec.method, spec.options)],
                    spec.model,
                    spec.question,
                    spec.max_new_tokens,
                    progress,
                    spec.ratio,
                )
            )

        stored, how, key = served(
            method,
            checked,
            lambda spec: run_view(spec, progress, tuple(before)),
            owner=common.session_of(request),
            kind="run",
            progress=progress,
            ready=ready,
        )
        yield from run_updates(stored, how, key.digest, layer, head, intensity, n_outputs)

    return on_run


def run_updates(stored, how, digest: str, layer, head, intensity, n_outputs: int) -> Iterator[tuple]:
    """The last stage of ``/run``: the ``n_outputs`` values of wire_run's outputs for the run served
    (``stored``, ``how``; ``digest``: its store key's), in one message: its figures were made with the run
    (kvlab.lab.views.FigureJSON), so a stored run costs the server no drawing."""
    view = with_served_note(stored, how)
    made = drawn(stored)
    fates = view.fates
    layer = min(max(int(layer or 0), 0), fates.n_layers - 1)
    head = min(max(int(head or 0), 0), fates.n_kv_heads - 1)
    line, html = token_view_for(digest, fates, layer, head, intensity)
    yield (
        *view.texts,
        *made.figures,
        index_slider(fates.n_layers, layer),
        index_slider(
            fates.n_kv_heads, head, head_picker_label(view.roles, layer), head_role_line(view.roles, layer, head)
        ),
        line,
        html,
        fates,
        view.roles,
        gr.Row(visible=made.fit is not None),
        *(made.fit or (None, None)),
        made.divergence,
        made.roles,
        *view.answer_marks,
    )


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
        document = functools.cache(lambda: common.document_input(text, file))  # an upload is read once

        def ready() -> None:  # each depth's document prepared in the background (a long one's prefills)
            spec, wanted = checked_model(model, specs), [(m, {}) for m in chosen]
            for item in needle_test_items(document(), None, depths):
                common.prepared_first(item.document, wanted, spec, None, DEFAULT_MAX_NEW_TOKENS, progress)

        run = guarded(
            ", ".join(chosen),
            lambda: needle_view(
                document(), None, chosen, parse_ratios([], ratios), depths, checked_model(model, specs), progress
            ),
            owner=common.session_of(request),
            kind="needle_test",
            progress=progress,
            ready=ready,
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


def wire_head_roles(fates: TokenWidgets) -> None:
    """The KV-head picker's label follows the picked layer (each head's role there) and its line under it
    the picked head (kvlab.lab.views.head_picker_label, head_role_line), from the last run's roles."""

    def on_pick(roles: HeadRoles | None, layer: int, head: int) -> gr.Slider:
        layer, head = int(layer or 0), int(head or 0)
        return gr.Slider(label=head_picker_label(roles, layer), info=head_role_line(roles, layer, head))

    gr.on(
        [fates.layer.input, fates.head.input],
        on_pick,
        [fates.roles, fates.layer, fates.head],
        [fates.head],
        api_name=False,
        show_progress="hidden",
        trigger_mode="always_last",
        concurrency_limit=None,
    )


def index_slider(count: int, value: int, label: str | None = None, info: str | None = None) -> gr.Slider:
    """A slider over 0..count-1 set to ``value``, with a new ``label`` and ``info`` when given; with one
    choice (Gemma 3 270M's one KV head) a fixed one, since Gradio refuses a slider whose minimum equals its maximum."""
    # Only what is given: an update sets every argument it names, None included (a blank label).
    texts = {k: v for k, v in (("label", label), ("info", info)) if v is not None}
    return gr.Slider(minimum=0, maximum=max(count - 1, 1), value=value, step=1, interactive=count > 1, **texts)
