"""Tasks with known answers, live: a small task set, a needle test on the user's document, or a bench's results.

The front ends show what these return (accuracy against ratio with the full
cache's ceiling and no_context's floor, needle heatmaps, the table); the
task definitions, the runner and the figures live in kvlab.tasks.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvlab import models
from kvlab.context import Progress, no_progress
from kvlab.lab.compare import MAX_SWEEP_POINTS
from kvlab.lab.explore import sub_progress
from kvlab.lab.inputs import InputError, document_text
from kvlab.methods import get_method
from kvlab.tasks.items import TaskError
from kvlab.tasks.registry import TASKS, build_items
from kvlab.tasks.runner import MethodSpec, SummaryRow, TaskResult, run_items, summarise
from kvlab.tasks.store import read_results
from kvlab.tasks.synthetic import needle_items

#: At most this many items in a live run (each item is a prefill: seconds on a CPU).
MAX_LIVE_ITEMS = 20
#: Document length bounds of a live synthetic task, in model tokens.
MIN_LENGTH, MAX_LIVE_LENGTH = 100, 4000
#: At most this many needle depths in a needle test.
MAX_DEPTHS = 9


@dataclass
class TaskRun:
    """Results of tasks with known answers, and their accuracy table.

    source: what produced them ("live: ...", "needle test", or the files loaded).
    """

    results: list[TaskResult]
    rows: list[SummaryRow] = field(default_factory=list)
    source: str = ""
    wall_s: float = 0.0

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(r.task for r in self.results))

    @property
    def methods(self) -> list[tuple[str, str]]:
        """(method, preset) of every compressing run, in first-seen order (not the full cache)."""
        return list(dict.fromkeys((r.method, r.preset) for r in self.results if r.ratio is not None))


def _specs(methods: Sequence[str], ratios: Sequence[float]) -> list[MethodSpec]:
    if not methods:
        raise InputError("Pick at least one method to compare.")
    if not ratios:
        raise InputError("Pick at least one compression ratio to sweep.")
    if len(methods) * len(ratios) > MAX_SWEEP_POINTS:
        raise InputError(f"{len(methods) * len(ratios)} runs per item is too many: pick at most {MAX_SWEEP_POINTS} (methods x ratios)")
    for name in methods:
        get_method(name)  # an unknown name fails here, before any work
    return [MethodSpec(name) for name in methods]


def run_tasks(
    task: str,
    n: int,
    methods: Sequence[str],
    ratios: Sequence[float],
    length: int = 1000,
    model: str | None = None,
    seed: int = 0,
    progress: Progress = no_progress,
) -> TaskRun:
    """``n`` items of ``task`` answered from the full cache, no_context and every method at every ratio."""
    start = time.perf_counter()
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    if not 1 <= int(n) <= MAX_LIVE_ITEMS:
        raise InputError(f"the number of items must be from 1 to {MAX_LIVE_ITEMS}, got {n}")
    if not MIN_LENGTH <= int(length) <= MAX_LIVE_LENGTH:
        raise InputError(f"the document length must be from {MIN_LENGTH} to {MAX_LIVE_LENGTH} tokens, got {length}")
    specs = _specs(methods, ratios)
    progress(0.0, "loading the model")
    lm = models.get_model(model or None)
    try:
        items = build_items(task, lm, int(n), seed, int(length))
    except TaskError as exc:
        raise InputError(str(exc)) from exc
    results = run_items(lm, items, specs, ratios, sub_progress(progress, 0.02, 0.98))
    return TaskRun(results, summarise(results), f"live: {task}, {len(items)} items", time.perf_counter() - start)


def needle_test(
    text: str | None,
    file: str | None,
    methods: Sequence[str],
    ratios: Sequence[float],
    depths: int = 3,
    model: str | None = None,
    seed: int = 0,
    progress: Progress = no_progress,
) -> TaskRun:
    """A number hidden at ``depths`` evenly spaced depths of the user's own document; which caches find it.

    Each depth is a document of its own (one prefill each).
    """
    start = time.perf_counter()
    if not 1 <= int(depths) <= MAX_DEPTHS:
        raise InputError(f"the number of depths must be from 1 to {MAX_DEPTHS}, got {depths}")
    document = document_text(text, file)
    specs = _specs(methods, ratios)
    spots = [0.5] if int(depths) == 1 else [i / (int(depths) - 1) for i in range(int(depths))]
    try:
        items = needle_items(document, spots, seed)
    except TaskError as exc:
        raise InputError(str(exc)) from exc
    progress(0.0, "loading the model")
    lm = models.get_model(model or None)
    results = run_items(lm, items, specs, ratios, sub_progress(progress, 0.02, 0.98))
    return TaskRun(results, summarise(results), f"needle test, {len(spots)} depths", time.perf_counter() - start)


def load_results(paths: Sequence[str]) -> TaskRun:
    """The results in ``kvlab bench`` JSONL files (e.g. uploaded); InputError when none holds any."""
    files = [Path(p) for p in paths if p]
    if not files:
        raise InputError("Upload one or more results*.jsonl files written by `kvlab bench`.")
    with tempfile.TemporaryDirectory(prefix="kvlab_results_") as tmp:
        # read_results reads a folder's results*.jsonl: lay the files out as one.
        for i, path in enumerate(files):
            if path.suffix != ".jsonl":
                raise InputError(f"{path.name} is not a .jsonl file written by `kvlab bench`")
            shutil.copyfile(path, Path(tmp) / f"results-{i}.jsonl")
        results = read_results(Path(tmp))
    if not results:
        raise InputError("No kvlab bench results found in the uploaded files.")
    return TaskRun(results, summarise(results), ", ".join(p.name for p in files))
