"""The bench's outputs from its results: CSV tables, plotly figures, one self-contained HTML page.

Figures take plain results and summary rows (no model), so the app can draw
them from a live run or from a results folder alike.
"""

from __future__ import annotations

import csv
import html
import math
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import plotly.graph_objects as go
import plotly.io as pio

from kvlab import figures
from kvlab.tasks.runner import FLOOR, FULL, SummaryRow, TaskResult, summarise
from kvlab.tasks.store import read_results


def run_label(method: str, preset: str) -> str:
    """A method's name with its preset, as figures and tables show it."""
    return f"{method} [{preset}]" if preset else method


def accuracy_figure(rows: Sequence[SummaryRow], task: str) -> go.Figure:
    """Accuracy against ratio on ``task``, one line per method, the full cache (ceiling) and no_context
    (floor) marked."""
    mine = [r for r in rows if r.task == task]
    points = [
        {"method": run_label(r.method, r.preset), "ratio": r.ratio, "accuracy": r.accuracy}
        for r in mine
        if r.ratio is not None
    ]
    ceiling = next((r.accuracy for r in mine if r.method == FULL), None)
    note = next((r.note for r in mine if r.note), "")
    title = f"{task}: accuracy against compression" + (f"<br><sup>{note}</sup>" if note else "")
    fig = figures.sweep_figure(points, "accuracy", title, "accuracy", reference=ceiling, reference_label="full cache")
    floor = next((r.accuracy for r in mine if r.method == FLOOR), None)
    ratios = sorted({p["ratio"] for p in points})
    if floor is not None and ratios:
        fig.add_trace(
            go.Scatter(
                x=[ratios[0], ratios[-1]],
                y=[floor, floor],
                mode="lines+markers" if len(ratios) == 1 else "lines",
                name=f"no context ({floor:.3g})",
                line=dict(color="#9ca3af", dash="dot", width=1.5),
                hovertemplate="no context: %{y:.4g}<extra></extra>",
            )
        )
    fig.update_yaxes(range=[0, 1.05])
    return fig


def needle_heatmap(results: Iterable[TaskResult], method: str, preset: str = "", task: str | None = None) -> go.Figure:
    """Mean score by needle depth (rows) and ratio (columns) for one method, on the results
    of ``task`` (default: every task) that have a depth.

    The full cache is the first column, so a method's losses read against it.
    """
    cells: dict[tuple[float, str], list[float]] = defaultdict(list)
    ratios: set[float] = set()
    for r in results:
        if r.depth is None or (task is not None and r.task != task):
            continue
        if r.method == FULL:
            cells[(r.depth, "full")].append(r.score)
        elif r.method == method and r.preset == preset and r.ratio is not None:
            cells[(r.depth, f"{r.ratio:g}x")].append(r.score)
            ratios.add(r.ratio)
    depths = sorted({d for d, _ in cells})
    columns = ["full"] + [f"{x:g}x" for x in sorted(ratios)]
    z = [[_mean_or_nan(cells.get((d, c), [])) for c in columns] for d in depths]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=columns,
            y=[f"{d:.0%}" for d in depths],
            zmin=0.0,
            zmax=1.0,
            colorscale="RdYlGn",
            colorbar=dict(title=dict(text="accuracy")),
            xgap=1,
            ygap=1,
            hovertemplate="depth %{y}, %{x}: %{z:.2f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=dict(text=f"needles found: {run_label(method, preset)}" + (f" on {task}" if task else "")),
        xaxis=dict(title=dict(text="cache"), type="category"),
        yaxis=dict(title=dict(text="needle depth"), type="category"),
        height=figures.FIGURE_HEIGHT,
        template="plotly_white",
        margin=dict(l=70, r=20, t=60, b=50),
    )
    return fig


def _mean_or_nan(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def write_csv(path: Path, records: Sequence[dict]) -> None:
    """One CSV row per record (the keys of the first record are the columns)."""
    with Path(path).open("w", newline="", encoding="utf-8") as f:
        if not records:
            return
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


_TABLE_COLUMNS = (
    "task",
    "method",
    "ratio",
    "n",
    "accuracy",
    "accuracy_low",
    "accuracy_high",
    "exact",
    "agreement",
    "f1",
    "gold_logprob",
    "accuracy_norm",
    "note",
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return html.escape(str(value))


def table_html(rows: Sequence[SummaryRow]) -> str:
    """The accuracy table as an HTML table (the ratio of the full cache and no_context is "-")."""
    head = "".join(f"<th>{c}</th>" for c in _TABLE_COLUMNS)
    body = []
    for r in rows:
        d = r.to_dict() | {"method": run_label(r.method, r.preset)}
        body.append("<tr>" + "".join(f"<td>{_cell(d[c])}</td>" for c in _TABLE_COLUMNS) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def table_markdown(rows: Sequence[SummaryRow]) -> str:
    """Per task, a Markdown grid: one line per method, one column per ratio, cells "right/n [low, high]"
    (the items answered right and the accuracy's Wilson 95 % interval; "accuracy (n) [low, high]"
    for partial scores).

    The full cache (the ceiling) and no_context (the floor) come first, with their
    score in every column; a task whose ceiling is below 60 % carries the note.
    """
    out = []
    for task in dict.fromkeys(r.task for r in rows):
        mine = [r for r in rows if r.task == task]
        ratios = sorted({r.ratio for r in mine if r.ratio is not None})
        cells: dict[str, dict[float | None, SummaryRow]] = defaultdict(dict)
        for r in mine:
            cells[run_label(r.method, r.preset)][r.ratio] = r
        note = next((r.note for r in mine if r.note), "")
        # Only ratio-free runs (the ceiling and floor alone): one accuracy column.
        columns = ratios or [None]
        out += [
            f"**{task}**" + (f" ({note})" if note else ""),
            "",
            "| method | " + " | ".join("accuracy" if x is None else f"{x:g}x" for x in columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for label, by_ratio in cells.items():
            fixed = by_ratio.get(None)  # the full cache and no_context ignore the ratio
            row = [fixed or by_ratio.get(x) for x in columns]
            out.append(f"| {label} | " + " | ".join("-" if r is None else markdown_cell(r) for r in row) + " |")
        out.append("")
    return "\n".join(out)


def markdown_cell(row: SummaryRow) -> str:
    """One cell of :func:`table_markdown`: "20/24 [.63, .93]", or "0.83 (24) [.63, .93]" when the
    scores are partial (the accuracy is not a count of right items)."""
    interval = f"[{row.accuracy_low:.2f}, {row.accuracy_high:.2f}]"
    count = row.accuracy * row.n
    if abs(count - round(count)) < 1e-9 and abs(row.exact - row.accuracy) < 1e-9:
        return f"{round(count)}/{row.n} {interval}"
    return f"{row.accuracy:.2f} ({row.n}) {interval}"


def report_html(results: Sequence[TaskResult], title: str = "kvlab bench") -> str:
    """A self-contained page (plotly.js embedded): accuracy curves per task, needle heatmaps per method, the table."""
    rows = summarise(results)
    figs = [accuracy_figure(rows, task) for task in dict.fromkeys(r.task for r in rows)]
    methods = dict.fromkeys((r.method, r.preset) for r in results if r.ratio is not None)
    for task in dict.fromkeys(r.task for r in results if r.depth is not None):
        figs += [needle_heatmap(results, m, p, task) for m, p in methods]
    parts = [pio.to_html(f, full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)]
    models = ", ".join(sorted({r.model for r in results})) or "-"
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ddd;padding:4px 8px;text-align:right}th{background:#f3f4f6}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>model: {html.escape(models)}; {len(results)} results. Accuracy is the task's score "
        "(contains match, fraction of values found, token F1 or option accuracy); agreement is with "
        "the full cache's answer.</p>" + "".join(parts) + "<h2>Table</h2>" + table_html(rows) + "</body></html>"
    )


def write_report(out: Path) -> list[SummaryRow]:
    """Rebuild results.csv, summary.csv, report.html and table.md in ``out`` from its JSONL files alone."""
    out = Path(out)
    results = read_results(out)
    rows = summarise(results)
    write_csv(out / "results.csv", [r.to_dict() for r in results])
    write_csv(out / "summary.csv", [r.to_dict() for r in rows])
    (out / "report.html").write_text(report_html(results), encoding="utf-8")
    (out / "table.md").write_text(table_markdown(rows), encoding="utf-8")
    return rows
