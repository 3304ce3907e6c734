"""Accuracy on tasks with known answers, shown the same way wherever it appears.

The Compare tab's Tasks mode and the Explore tab's needle test both end in a
kvlab.lab.TaskRun; :func:`build_task_outputs` lays out its views (a status
line, accuracy against ratio with the full cache's ceiling and no_context's
floor, a needle heatmap per method, the table) and :func:`show` fills them.
A user keeps only the run's plain results (``gr.State``), so switching the
task or the method shown redraws without recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from kvlab.lab import TaskRun
from kvlab.tasks.report import accuracy_figure, needle_heatmap, run_label

TABLE_COLUMNS = ["task", "method", "ratio", "items", "accuracy", "agreement with full", "note"]


@dataclass
class TaskOutputs:
    """The widgets that show a TaskRun."""

    state: gr.State
    status: gr.Markdown
    task: gr.Dropdown
    accuracy: gr.Plot
    method: gr.Dropdown
    heatmap: gr.Plot
    table: gr.Dataframe

    @property
    def all(self) -> list:
        return [self.state, self.status, self.task, self.accuracy, self.method, self.heatmap, self.table]


def build_task_outputs(prefix: str) -> TaskOutputs:
    """The views of a TaskRun, with element ids ``kvlab-<prefix>-...``; wires their own redraws."""
    state = gr.State(None, time_to_live=3600)
    status = gr.Markdown(elem_id=f"kvlab-{prefix}-status")
    with gr.Row():
        task = gr.Dropdown(choices=[], label="Task shown", elem_id=f"kvlab-{prefix}-task", scale=1)
        method = gr.Dropdown(
            choices=[], label="Method shown in the needle heatmap", elem_id=f"kvlab-{prefix}-method", scale=1
        )
    with gr.Row():
        accuracy = gr.Plot(label="Accuracy vs ratio", elem_id=f"kvlab-{prefix}-accuracy")
        heatmap = gr.Plot(label="Needles found, by depth and ratio", elem_id=f"kvlab-{prefix}-heatmap")
    table = gr.Dataframe(
        headers=TABLE_COLUMNS, label="Accuracy table", interactive=False, wrap=True, elem_id=f"kvlab-{prefix}-table"
    )
    out = TaskOutputs(state, status, task, accuracy, method, heatmap, table)
    task.input(
        lambda run, t, m: (accuracy_figure(run.rows, t) if run else None, _heatmap(run, m, t)),
        [state, task, method],
        [accuracy, heatmap],
        api_name=False,
        concurrency_limit=None,
    )
    method.input(_heatmap, [state, method, task], [heatmap], api_name=False, concurrency_limit=None)
    return out


def _heatmap(run: TaskRun | None, label: str | None, task: str | None):
    """The needle heatmap of the method labelled ``label`` on ``task`` (None when that task has no depths)."""
    if run is None or not label or not any(r.depth is not None and r.task == task for r in run.results):
        return None
    for m, p in run.methods:
        if run_label(m, p) == label:
            return needle_heatmap(run.results, m, p, task)
    return None


def status_line(run: TaskRun) -> str:
    """What ran, the ceiling and floor per task, and how long it took."""
    parts = []
    for t in run.tasks:
        rows = [r for r in run.rows if r.task == t]
        full = next((r for r in rows if r.method == "full"), None)
        floor = next((r for r in rows if r.method == "no_context"), None)
        text = f"**{t}**: {rows[0].n if rows else 0} items"
        if full is not None:
            text += f", full cache (ceiling) {full.accuracy:.0%}"
        if floor is not None:
            text += f", no context (floor) {floor.accuracy:.0%}"
        note = next((r.note for r in rows if r.note), "")
        parts.append(text + (f" — {note}" if note else ""))
    took = f" in {run.wall_s:.0f} s" if run.wall_s else ""
    stopped = f"\n\n**{run.stopped}**" if run.stopped else ""
    return f"{len(run.results)} answers scored ({run.source}){took}. " + "; ".join(parts) + "." + stopped


def table_rows(run: TaskRun) -> list[list]:
    """The accuracy table's rows (see TABLE_COLUMNS)."""
    return [
        [
            r.task,
            run_label(r.method, r.preset),
            "-" if r.ratio is None else r.ratio,
            r.n,
            round(r.accuracy, 3),
            round(r.agreement, 3),
            r.note,
        ]
        for r in run.rows
    ]


def show(run: TaskRun) -> tuple:
    """The values of TaskOutputs.all for ``run``: the first task and the first method drawn."""
    task = run.tasks[0] if run.tasks else None
    labels = [run_label(m, p) for m, p in run.methods]
    has_depths = any(r.depth is not None for r in run.results)
    method = labels[0] if labels and has_depths else None
    return (
        run,
        status_line(run),
        gr.Dropdown(choices=run.tasks, value=task),
        accuracy_figure(run.rows, task) if task else None,
        gr.Dropdown(choices=labels if has_depths else [], value=method),
        _heatmap(run, method, task),
        {"headers": TABLE_COLUMNS, "data": table_rows(run)},
    )
