"""The Compare tab: methods x ratios, in two modes.

- One question: a sweep on the Explore tab's document, question and model,
  or on several models (the same document and question on each, each with
  its own full cache). Endpoint ``/compare``: (text, file, methods, ratios,
  more_ratios, question, max_new_tokens, model, models) -> a status line,
  the full cache's answer (each model's), three line charts against the
  ratio (attention-output error, mass error, answer log-perplexity), a
  table, and the results as CSV and JSON files.
- Tasks with known answers: accuracy against the ratio, with the full
  cache's ceiling and no_context's floor. Endpoint ``/tasks``: (task, items,
  length, methods, ratios, more_ratios, model, haystack) -> kvlab.ui.tasks' views;
  ``/load_results``: (results*.jsonl files of ``kvlab bench``) -> the same views.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import gradio as gr

from kvlab.catalog import aware_tag, method_names
from kvlab.compression.budget_profiles import BUDGETS
from kvlab.lab import load_results, parse_ratios, run_tasks, write_exports
from kvlab.lab.inputs import MAX_RATIO, MIN_RATIO
from kvlab.lab.tasks import MAX_LIVE_ITEMS, MAX_LIVE_LENGTH, MIN_LENGTH
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS
from kvlab.tasks.datasets import data_dir
from kvlab.tasks.synthetic import books_dir
from kvlab.tasks.task_registry import TASKS
from kvlab.ui import common
from kvlab.ui.common import (
    GPU_MAX_S,
    USER_ERRORS,
    CompareInputs,
    DocumentInputs,
    as_gr_error,
    checked_model,
    guarded,
    on_gpu,
)
from kvlab.ui.present import COMPARE_COLUMNS, SweepView, compare_rows, sweep_status, sweep_view
from kvlab.ui.tasks import TaskOutputs, build_task_outputs, show

#: Ratios offered, and those ticked at first.
SWEEP_RATIOS = (2, 5, 10, 20, 50)
SWEEP_DEFAULT_RATIOS = (5, 10, 20, 50)
#: The head-budgets axis as the page names it (kvlab.compression.budget_profiles.BUDGETS).
BUDGET_LABELS = {
    "uniform": "uniform",
    "profile": "the model's profile",
    "document": "the document's own",
    "global": "one ranking across heads and layers",
}
#: Methods ticked at first (those registered).
SWEEP_DEFAULT_METHODS = ("attention_matching", "snapkv", "streaming_llm")
#: The live task set a visitor starts with: needles at several depths of ~1,000-token documents.
TASK_DEFAULT, TASK_ITEMS_DEFAULT, TASK_LENGTH_DEFAULT = "needle_grid", 5, 1000
#: Tasks that read the evaluation data (kvlab.tasks.datasets.data_dir), offered only where it is present.
DATA_TASKS = {"quality": "quality_examples.json", "hotpotqa": "hotpotqa_distractor_dev_sample100.json"}


def offered_haystacks() -> list[tuple[str, str]]:
    """(label, name) of the needle tasks' haystacks this server can build: the public-domain books
    only where the evaluation data holds them (kvlab.tasks.synthetic.books_dir)."""
    offered = [("a repeated noise line (RULER's)", "noise"), ("prose written for kvlab (no digits, no names)", "prose")]
    if any(books_dir().glob("*.txt")):
        offered.append(("public-domain books (their own numbers and names)", "books"))
    return offered


def offered_tasks() -> list[tuple[str, str]]:
    """(label, name) of the tasks this server can build."""
    return [
        (f"{name}: {spec.summary}", name)
        for name, spec in TASKS.items()
        if name not in DATA_TASKS or (data_dir() / DATA_TASKS[name]).is_file()
    ]


@on_gpu(duration=GPU_MAX_S)
def tasks_view(task, n, length, methods, ratios, model, progress=None, haystack="noise"):  # noqa: ANN001 - a ZeroGPU function
    """The heavy part of ``/tasks``: kvlab.lab.run_tasks (plain results come back)."""
    return run_tasks(
        task, n, methods, ratios, length, model, progress=progress or (lambda f, d: None), haystack=haystack
    )


@dataclass
class SweepChoices:
    """What both modes sweep: the methods, the ratios (ticked and typed) and the head budgets."""

    methods: gr.CheckboxGroup
    ratios: gr.CheckboxGroup
    more_ratios: gr.Textbox
    budgets: gr.CheckboxGroup


@dataclass
class QuestionWidgets:
    """The one-question mode: its column, the models, Run and Stop, and the sweep's results."""

    box: gr.Column
    models: gr.CheckboxGroup
    run: gr.Button
    stop: gr.Button
    status: gr.Markdown
    full: gr.Textbox
    err: gr.Plot
    mass: gr.Plot
    ppl: gr.Plot
    table: gr.Dataframe
    csv: gr.File
    json: gr.File


@dataclass
class TaskWidgets:
    """The tasks mode: its column, the task and its sizes, Run and Stop, the results files and the views."""

    box: gr.Column
    task: gr.Dropdown
    items: gr.Slider
    length: gr.Slider
    haystack: gr.Dropdown
    run: gr.Button
    stop: gr.Button
    files: gr.File
    views: TaskOutputs


def build_compare_tab(inputs: DocumentInputs, specs: list[str]) -> CompareInputs:
    """The Compare tab's widgets and its ``/compare`` event (inside an open ``gr.Tab``); returns what a link sets."""
    gr.Markdown(
        "Every chosen method, with its default knobs, at every chosen ratio. **One question**: a sweep on the "
        "**document, question, answer length and model of the Explore tab** (the prefill and the full cache's "
        "answer are computed once and shared), measuring attention errors and the answer. **Tasks**: questions "
        "with known answers, scored, so you see whether the answer is still *right*; the full cache is the "
        "ceiling and no context the floor."
    )
    mode = gr.Radio(
        [("One question: attention errors and answers", "question"), ("Tasks with known answers: accuracy", "tasks")],
        value="question",
        label="Compare on",
        elem_id="kvlab-compare-mode",
    )
    choices = build_sweep_choices()
    question = build_question_mode(inputs.model, specs)
    tasks = build_tasks_mode()

    mode.change(
        lambda m: (gr.Column(visible=m == "question"), gr.Column(visible=m == "tasks")),
        [mode],
        [question.box, tasks.box],
        api_name=False,
        concurrency_limit=None,
    )
    wire_tasks(choices, tasks, inputs.model, specs)
    wire_sweep(inputs, choices, question, specs)
    return CompareInputs(choices.methods, choices.ratios, choices.more_ratios, question.models)


def build_sweep_choices() -> SweepChoices:
    """The methods (SWEEP_DEFAULT_METHODS ticked, those registered), the ratios and the head budgets."""
    methods = method_names()
    ticked = [m for m in SWEEP_DEFAULT_METHODS if m in methods] or methods[:3]
    with gr.Row():
        cmp_methods = gr.CheckboxGroup(
            choices=[(n + aware_tag(n), n) for n in methods],
            value=ticked,
            label="Methods",
            elem_id="kvlab-compare-methods",
            scale=3,
        )
        with gr.Column(scale=2):
            cmp_ratios = gr.CheckboxGroup(
                choices=[(f"{r}x", r) for r in SWEEP_RATIOS],
                value=list(SWEEP_DEFAULT_RATIOS),
                label="Compression ratios",
                elem_id="kvlab-compare-ratios",
            )
            cmp_more = gr.Textbox(
                label="More ratios",
                placeholder="e.g. 3, 8, 100",
                lines=1,
                info=f"Comma-separated, from {MIN_RATIO:g} to {MAX_RATIO:g}",
                elem_id="kvlab-compare-more",
            )
            cmp_budgets = gr.CheckboxGroup(
                choices=[(BUDGET_LABELS[v], v) for v in BUDGETS],
                value=[],
                label="Head budgets",
                info="None ticked: each method's default. Ticked: each method with a budgets knob once per value, "
                "at the same bytes",
                elem_id="kvlab-compare-budgets",
            )
    return SweepChoices(cmp_methods, cmp_ratios, cmp_more, cmp_budgets)


def build_question_mode(model: gr.Dropdown, specs: list[str]) -> QuestionWidgets:
    """The one-question mode's column (shown at first): the models to sweep (among ``model``'s choices,
    offered when ``specs`` has several), Run and Stop, the status, the full cache's answer, the charts,
    the table and the files."""
    with gr.Column(visible=True) as question_box:
        cmp_models = gr.CheckboxGroup(
            choices=list(model.choices),
            value=[],
            label="Models",
            info="None ticked: the model chosen above. Several: the same sweep on each, each with its own full cache",
            elem_id="kvlab-compare-models",
            visible=len(specs) > 1,
        )
        with gr.Row():
            cmp_go = gr.Button("Run the sweep", variant="primary", elem_id="kvlab-compare-run", scale=4)
            cmp_stop = gr.Button("Stop", variant="stop", elem_id="kvlab-compare-stop", scale=1)
        cmp_status = gr.Markdown(elem_id="kvlab-compare-status")
        cmp_full = gr.Textbox(label="Answer from the full cache", interactive=False, elem_id="kvlab-compare-full")
        with gr.Row():
            cmp_err = gr.Plot(label="Attention-output error vs ratio", elem_id="kvlab-compare-err")
            cmp_mass = gr.Plot(label="Attention-mass error vs ratio", elem_id="kvlab-compare-mass")
            cmp_ppl = gr.Plot(label="Log-perplexity vs ratio", elem_id="kvlab-compare-ppl")
        cmp_table = gr.Dataframe(
            headers=COMPARE_COLUMNS,
            label="Results",
            interactive=False,
            wrap=True,
            column_widths=["13%", "5%", "6%", "7%", "7%", "8%", "7%", "8%", "7%", "32%"],
            elem_id="kvlab-compare-table",
        )
        with gr.Row():
            cmp_csv = gr.File(label="Results as CSV", interactive=False, height=90, elem_id="kvlab-compare-csv")
            cmp_json = gr.File(
                label="Results as JSON (with per-head errors)",
                interactive=False,
                height=90,
                elem_id="kvlab-compare-json",
            )
    return QuestionWidgets(
        question_box,
        cmp_models,
        cmp_go,
        cmp_stop,
        cmp_status,
        cmp_full,
        cmp_err,
        cmp_mass,
        cmp_ppl,
        cmp_table,
        cmp_csv,
        cmp_json,
    )


def build_tasks_mode() -> TaskWidgets:
    """The tasks mode's column (hidden at first): the task, its items, length and haystack, Run and Stop,
    the upload of ``kvlab bench`` results, and the views of a run."""
    with gr.Column(visible=False) as tasks_box:
        with gr.Row():
            task = gr.Dropdown(
                offered_tasks(), value=TASK_DEFAULT, label="Task", elem_id="kvlab-tasks-task-pick", scale=3
            )
            items = gr.Slider(
                1,
                MAX_LIVE_ITEMS,
                value=TASK_ITEMS_DEFAULT,
                step=1,
                label="Items",
                info="Each item is a document of its own: one prefill each",
                elem_id="kvlab-tasks-items",
            )
            length = gr.Slider(
                MIN_LENGTH,
                MAX_LIVE_LENGTH,
                value=TASK_LENGTH_DEFAULT,
                step=50,
                label="Document length (model tokens)",
                elem_id="kvlab-tasks-length",
            )
            haystack = gr.Dropdown(
                offered_haystacks(),
                value="noise",
                label="Needles hidden in",
                info="Needle tasks only: among identical lines a needle is easy to keep; real books hold numbers "
                "and names of their own",
                elem_id="kvlab-tasks-haystack",
                scale=1,
            )
        with gr.Row():
            tasks_go = gr.Button("Run the tasks", variant="primary", elem_id="kvlab-tasks-run", scale=4)
            tasks_stop = gr.Button("Stop", variant="stop", elem_id="kvlab-tasks-stop", scale=1)
        results_files = gr.File(
            label="Or show results written by `kvlab bench` (its results*.jsonl files)",
            file_count="multiple",
            file_types=[".jsonl"],
            type="filepath",
            height=90,
            elem_id="kvlab-tasks-files",
        )
        views = build_task_outputs("tasks")
    return TaskWidgets(tasks_box, task, items, length, haystack, tasks_go, tasks_stop, results_files, views)


def wire_tasks(choices: SweepChoices, tasks: TaskWidgets, model: gr.Dropdown, specs: list[str]) -> None:
    """``/tasks`` on its Run, its Stop, and ``/load_results`` on an upload of results files."""

    def on_tasks(
        task=TASK_DEFAULT,
        items=TASK_ITEMS_DEFAULT,
        length=TASK_LENGTH_DEFAULT,
        methods=None,
        ratios=None,
        more_ratios="",
        model=None,
        haystack="noise",
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        chosen = list(methods or [])
        run = guarded(
            ", ".join(chosen),
            lambda: tasks_view(
                task,
                items,
                length,
                chosen,
                parse_ratios(ratios, more_ratios),
                checked_model(model, specs),
                progress,
                haystack or "noise",
            ),
            owner=common.session_of(request),
            kind="tasks",
            progress=progress,
        )
        return show(run)

    tasks_run = tasks.run.click(
        on_tasks,
        [
            tasks.task,
            tasks.items,
            tasks.length,
            choices.methods,
            choices.ratios,
            choices.more_ratios,
            model,
            tasks.haystack,
        ],
        tasks.views.all,
        api_name="tasks",
        concurrency_limit=common.COMPUTE_ADMITTED,
        concurrency_id="compute",
    )
    tasks.stop.click(None, None, None, cancels=[tasks_run], api_name=False)

    def on_results(paths):
        try:
            return show(load_results(paths if isinstance(paths, list) else [paths]))
        except USER_ERRORS as exc:
            raise as_gr_error(exc) from exc

    tasks.files.upload(on_results, [tasks.files], tasks.views.all, api_name="load_results", concurrency_limit=4)


def sweep_outputs(view: SweepView) -> tuple:
    """``/compare``'s outputs for a finished sweep: its status, the full cache's answers, the three charts,
    the table, and the CSV and JSON files it was written to."""
    sweep = view.sweep
    csv_path, json_path = write_exports(sweep)
    return (
        sweep_status(sweep) + (f"\n\n**{sweep.stopped}**" if sweep.stopped else ""),
        "\n".join(
            f"{c.model + ': ' if len(sweep.ceilings) > 1 else ''}{c.answer_full}  (log-perplexity {c.logppl_full:.3f})"
            for c in sweep.ceilings
        ),
        *view.charts,
        {"headers": COMPARE_COLUMNS, "data": compare_rows(sweep)},
        csv_path,
        json_path,
    )


def wire_sweep(inputs: DocumentInputs, choices: SweepChoices, question: QuestionWidgets, specs: list[str]) -> None:
    """``/compare`` on the sweep's Run (on the Explore tab's document, question and model), and its Stop."""

    def on_compare(
        text=None,
        file=None,
        methods=None,
        ratios=None,
        more_ratios="",
        question=None,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
        model=None,
        models=None,
        budgets=None,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        chosen = list(methods or [])
        document = functools.cache(lambda: common.document_input(text, file))  # an upload is read once
        view = guarded(
            ", ".join(chosen),
            lambda: sweep_view(
                document(),
                None,
                chosen,
                parse_ratios(ratios, more_ratios),
                question,
                max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                checked_model(model, specs),
                progress,
                models=[checked_model(m, specs) for m in models or []],
                budgets=list(budgets or []),
            ),
            owner=common.session_of(request),
            kind="compare",
            progress=progress,
            ready=lambda: common.prepared_first(
                document(),
                [(name, {}) for name in chosen],
                checked_model(model, specs),
                question,
                max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                progress,
            ),
        )
        return sweep_outputs(view)

    sweep_run = question.run.click(
        on_compare,
        [
            inputs.text,
            inputs.upload,
            choices.methods,
            choices.ratios,
            choices.more_ratios,
            inputs.question,
            inputs.max_new,
            inputs.model,
            question.models,
            choices.budgets,
        ],
        [
            question.status,
            question.full,
            question.err,
            question.mass,
            question.ppl,
            question.table,
            question.csv,
            question.json,
        ],
        api_name="compare",
        concurrency_limit=common.COMPUTE_ADMITTED,
        concurrency_id="compute",
    )
    question.stop.click(None, None, None, cancels=[sweep_run], api_name=False)
