"""Every task by name, and one call that builds a task's items for a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvlab import messages
from kvlab.runtime.model import LoadedModel
from kvlab.tasks import datasets, synthetic
from kvlab.tasks.copying import copy_codes
from kvlab.tasks.items import TaskError, TaskItem, token_counter

DEFAULT_LENGTH = 2000
"""Synthetic document length in model tokens: about 2,000 on the embedded model (RULER uses 4k and up)."""


@dataclass(frozen=True)
class TaskSpec:
    """A task: how to build ``n`` items, whether its documents are sized by ``length``, and
    whether it takes the needle options (``haystack``, ``values``)."""

    name: str
    summary: str
    sized: bool
    build: Callable[..., list[TaskItem]]
    needles: bool = False


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("niah_single", "one number hidden in noise (RULER niah_single)", True, synthetic.niah_single, True),
        TaskSpec(
            "niah_multikey",
            "four keyed numbers in noise, one asked (RULER niah_multikey)",
            True,
            synthetic.niah_multikey,
            True,
        ),
        TaskSpec(
            "niah_multivalue",
            "one key with four numbers, all asked (RULER niah_multivalue)",
            True,
            synthetic.niah_multivalue,
            True,
        ),
        TaskSpec(
            "variable_tracking",
            "a chain of variable assignments, all asked (RULER vt)",
            True,
            synthetic.variable_tracking,
        ),
        TaskSpec("needle_grid", "single needles at depths 0, 25, 50, 75, 100 %", True, synthetic.needle_grid, True),
        TaskSpec(
            "quality",
            "QuALITY four-way multiple choice by option log-likelihood (shared data)",
            False,
            datasets.quality,
        ),
        TaskSpec("hotpotqa", "HotpotQA distractor setting, token F1 (shared data)", False, datasets.hotpotqa),
        TaskSpec("examples", "the bundled examples' suggested questions", False, datasets.examples),
        TaskSpec(
            "copy_codes",
            "copy a list of codes back: a long answer, token F1 (the Generate tab's task)",
            True,
            copy_codes,
        ),
    )
}


def build_items(
    task: str,
    lm: LoadedModel,
    n: int,
    seed: int = 0,
    length: int = DEFAULT_LENGTH,
    haystack: synthetic.Haystack = "noise",
    values: synthetic.ValueShape = "number",
) -> list[TaskItem]:
    """Up to ``n`` items of ``task``; synthetic documents are at most ``length`` tokens of ``lm``'s tokenizer.

    haystack, values: the needle tasks' filler and value shape (synthetic.HAYSTACKS,
    synthetic.VALUE_SHAPES); another task refuses anything but the defaults
    rather than silently ignoring them.
    """
    if task not in TASKS:
        raise TaskError(messages.unknown("task", task, TASKS))
    if n < 1:
        raise TaskError("the number of items must be at least 1")
    spec = TASKS[task]
    needle_options = {"haystack": haystack, "values": values}
    if not spec.needles and (haystack, values) != ("noise", "number"):
        needles = ", ".join(t for t, s in TASKS.items() if s.needles)
        raise TaskError(f"{task} has no haystack or needle values to choose; only {needles} do")
    if spec.sized:
        if length < 16:
            raise TaskError(f"length must be at least 16 tokens, got {length}")
        options = needle_options if spec.needles else {}
        return spec.build(token_counter(lm.tokenizer), n, seed, length, **options)
    return spec.build(n, seed)
