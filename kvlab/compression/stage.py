"""A selection wrapper as its module in kvlab.compression.wrappers declares it (:class:`Stage`), and
:func:`stages`, which finds them all.

A stage is a step between a scoring method's scores and its stored cache: it changes the scores
and the head budgets before each head's top-k, or the kept keys after the gather. It owns its knobs,
its place in the order, its preset and the stages it cannot run with; its Learn sentences are the
markdown file beside its module (kvlab.learn_text). kvlab.compression.selection assembles the stages
into the knobs every scoring method gets.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from kvlab.compression.discovery import discover

if TYPE_CHECKING:
    import torch

    from kvlab.compression.budget_profiles import HeadBudgets
    from kvlab.compression.request import Request
    from kvlab.runtime.cache import Segment
    from kvlab.runtime.model import LoadedModel


@dataclass(frozen=True)
class Stage:
    """One selection wrapper, as its module declares it.

    name: the stage's name, which is also its preset's (``kvlab bench --preset NAME``) and its module's:
        its Learn sentences are ``NAME.md`` beside the module (kvlab.compression.selection.selection_learn).
    order: where it runs among the stages, lowest first; its knobs are listed in that order too.
    knobs: a frozen dataclass of its knobs (:func:`kvlab.compression.options.knob` fields). The
        first is its switch: the stage is on when that knob is not at its default.
    preset: the knob values that turn it on as published.
    excludes: stage name -> why: while this stage is on, that one must be off; the refusal is one
        line, ``budgets=document needs granularity=token: <why>``.
    scores: (request, per layer [H_kv, T_doc] scores, the head budgets [n_layers, H_kv], the
        options) -> the scores and budgets for each head's top-k, when it is on.
    check: MethodError unless it can hold for the model; run before the scores (a refusal costs nothing).
    kept: (model, per layer the kept segments in reading order) -> (the layers with their kept
        keys moved to new positions, P: the position of the first token after the cache).
    records: knobs whose values the stored cache's meta records.
    """

    name: str
    order: int
    knobs: type
    preset: dict[str, Any]
    excludes: dict[str, str] = field(default_factory=dict)
    scores: Callable[[Request, list[torch.Tensor], HeadBudgets, Any], tuple[list[torch.Tensor], HeadBudgets]] | None = (
        None
    )
    check: Callable[[LoadedModel], None] | None = None
    kept: Callable[[LoadedModel, list[list[Segment]]], tuple[list[list[Segment]], int]] | None = None
    records: tuple[str, ...] = ()

    @property
    def switch(self) -> dataclasses.Field:
        """The knob that turns the stage on (the first of :attr:`knobs`)."""
        return dataclasses.fields(self.knobs)[0]

    def on(self, options: Any) -> bool:
        """Whether ``options`` (a SelectionOptions) turn the stage on: its switch is not at its default."""
        return getattr(options, self.switch.name) != self.switch.default

    def setting(self, value: Any) -> str:
        """The switch at ``value`` as the command line spells it: ``critical=true``, ``granularity=token``."""
        return f"{self.switch.name}={str(value).lower() if isinstance(value, bool) else value}"


def stages(package: str, path: Iterable[str]) -> list[Stage]:
    """Every module's ``STAGE`` in ``package`` (each module of its folders ``path`` imported), lowest
    order first. TypeError for a module that declares none (every module there is a wrapper), or a stage
    not named as its module (its Learn text is found by that name).
    """
    found = []
    for name in discover(package, path):
        module = importlib.import_module(f"{package}.{name}")
        if not isinstance(getattr(module, "STAGE", None), Stage):
            raise TypeError(f"{module.__name__} declares no STAGE (a kvlab.compression.stage.Stage)")
        if module.STAGE.name != name:
            raise TypeError(f"{module.__name__} declares the stage {module.STAGE.name!r}: name it as its file")
        found.append(module.STAGE)
    return sorted(found, key=lambda stage: stage.order)
