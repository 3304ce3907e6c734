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
from typing import Callable, Sequence

from kvlab import cancellation, messages, models
from kvlab.context import Context, Progress, no_progress, prepare_context
from kvlab.lab.explore import prepared_context, sub_progress
from kvlab.lab.inputs import InputError, check_count, check_sweep, document_text
from kvlab.runtime.model import LoadedModel
from kvlab.tasks.items import TaskError, TaskItem
from kvlab.tasks.runner import MethodSpec, Plan, SummaryRow, TaskResult, run_items, summarise
from kvlab.tasks.store import read_results
from kvlab.tasks.synthetic import needle_items
from kvlab.tasks.task_registry import TASKS, build_items

#: At most this many items in a live run (each item is a prefill: seconds on a CPU).
MAX_LIVE_ITEMS = 20
#: Document length bounds of a live synthetic task, in model tokens.
MIN_LENGTH, MAX_LIVE_LENGTH = 100, 4000
#: At most this many needle depths in a needle test.
MAX_DEPTHS = 9


@dataclass
class TaskRun:
    """Results of tasks with known answers, and their accuracy table.

    source: what produced them ("live: ...", "needle test", or the files loaded);
    stopped: when the request's time limit ended the run early, what was
    answered and what was not; "" otherwise.
    """

    results: list[TaskResult]
    rows: list[SummaryRow] = field(default_factory=list)
    source: str = ""
    wall_s: float = 0.0
    stopped: str = ""

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(r.task for r in self.results))

    @property
    def methods(self) -> list[tuple[str, str]]:
        """(method, preset) of every compressing run, in first-seen order (not the full cache)."""
        return list(dict.fromkeys((r.method, r.preset) for r in self.results if r.ratio is not None))


def answered(
    lm: LoadedModel,
    items: Sequence[TaskItem],
    methods: list[str],
    ratios: list[float],
    progress: Progress,
    context_of: Callable[[LoadedModel, str], Context] = prepare_context,
) -> tuple[list[TaskResult], str]:
    """(results, stopped) of kvlab.tasks.runner.run_items (``context_of``: how a document is read), each
    answer a unit of the request.

    Between answers others' runs may take the compute slot
    (kvlab.cancellation.between_units). When the time limit passes after some
    answers, those come back with ``stopped`` saying how many were not
    given; stopped otherwise, kvlab.cancellation.Cancelled is raised.
    """
    results: list[TaskResult] = []

    def unit(fraction: float, desc: str) -> None:
        cancellation.between_units(desc)
        progress(fraction, desc)

    try:
        specs = [MethodSpec(name) for name in methods]
        run_items(lm, items, specs, ratios, unit, on_result=results.append, context_of=context_of)
    except cancellation.Cancelled as exc:
        if exc.reason != cancellation.TIME or not results:
            raise
        total = len(items) * (1 + len(Plan.of([MethodSpec(name) for name in methods], ratios).runs))
        return results, (
            f"Stopped after {exc.elapsed_s:.0f} s because {exc.why}: {len(results)} of {total} "
            f"answers given; the other {total - len(results)} were not run."
        )
    return results, ""


def run_tasks(
    task: str,
    n: int,
    methods: Sequence[str],
    ratios: Sequence[float],
    length: int = 1000,
    model: str | None = None,
    seed: int = 0,
    progress: Progress = no_progress,
    haystack: str = "noise",
) -> TaskRun:
    """``n`` items of ``task`` answered from the full cache, no_context and every method at every ratio.

    haystack: the needle tasks' filler (kvlab.tasks.synthetic.HAYSTACKS: a repeated noise line, prose
    written for kvlab, or public-domain books); another task refuses anything but "noise" (InputError).
    """
    start = time.perf_counter()
    if task not in TASKS:
        raise InputError(messages.unknown("task", task, TASKS))
    n = check_count(n, 1, MAX_LIVE_ITEMS, "number of items")
    length = check_count(length, MIN_LENGTH, MAX_LIVE_LENGTH, "document length (model tokens)")
    methods, ratios = check_sweep(methods, ratios)
    progress(0.0, "loading the model")
    lm = models.get_model(model or None)
    try:
        items = build_items(task, lm, n, int(seed), length, haystack=haystack)  # type: ignore[arg-type]
    except TaskError as exc:
        raise InputError(str(exc)) from exc
    results, stopped = answered(lm, items, methods, ratios, sub_progress(progress, 0.02, 0.98))
    label = f"{task} on a {haystack} haystack" if TASKS[task].needles else task
    return TaskRun(
        results, summarise(results), f"live: {label}, {len(items)} items", time.perf_counter() - start, stopped
    )


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

    Each depth is a document of its own (one prefill each), read through the lab's shared store of
    contexts (kvlab.context_store.CONTEXTS): the page prepares them in the background first
    (:func:`needle_documents`, kvlab.lab.ensure_prepared), so a long document's prefills are not this
    request's work.
    """
    start = time.perf_counter()
    methods, ratios = check_sweep(methods, ratios)
    items = needle_test_items(text, file, depths, seed)
    progress(0.0, "loading the model")
    lm = models.get_model(model or None)

    def shared(lm: LoadedModel, document: str) -> Context:
        # Cleaned as every document the page reads (the background preparation's key): a needle at the
        # end leaves a trailing space that would make it another document.
        return prepared_context(lm, document_text(document, None))[0]

    results, stopped = answered(lm, items, methods, ratios, sub_progress(progress, 0.02, 0.98), shared)
    return TaskRun(
        results, summarise(results), f"needle test, {len(items)} depths", time.perf_counter() - start, stopped
    )


def needle_test_items(text: str | None, file: str | None, depths: int = 3, seed: int = 0) -> list[TaskItem]:
    """The needle test's items (:func:`needle_test`): one document per depth, each with its needle and question.
    Raises InputError for a bad count of depths or a document the needle cannot go into."""
    depths = check_count(depths, 1, MAX_DEPTHS, "number of depths")
    spots = [0.5] if depths == 1 else [i / (depths - 1) for i in range(depths)]
    try:
        return needle_items(document_text(text, file), spots, seed)
    except TaskError as exc:
        raise InputError(str(exc)) from exc


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
