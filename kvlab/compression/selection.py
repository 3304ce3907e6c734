"""How a scoring method's scores become kept tokens: the selection wrappers' knobs
(:class:`SelectionOptions`, assembled from the stages kvlab.compression.wrappers declares, applied
by :func:`select`), each head's top-k and the gather.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import torch

from kvlab import learn_text
from kvlab.compression import wrappers
from kvlab.compression.budget_profiles import HeadBudgets
from kvlab.compression.options import MethodError, Options
from kvlab.compression.request import Request
from kvlab.compression.stage import Stage, stages
from kvlab.runtime.cache import DenseSegment, Segment, gather_tokens, template_segment

#: The selection wrappers, each module of kvlab.compression.wrappers one, in the order they run.
STAGES: list[Stage] = stages(wrappers.__name__, wrappers.__path__)
_BY_NAME = {stage.name: stage for stage in STAGES}


def _check_declarations(declared: list[Stage]) -> None:
    """TypeError for stages that cannot be assembled: a name or an order twice, an exclusion of no
    stage, a preset or a record of knobs not the stage's own (two stages' knobs of one name:
    make_dataclass's TypeError)."""
    names = [s.name for s in declared]
    for what, values in (("name", names), ("order", [s.order for s in declared])):
        if len(set(values)) < len(values):
            raise TypeError(f"two selection stages declare the same {what}: {values}")
    for stage in declared:
        own = {f.name for f in dataclasses.fields(stage.knobs)}
        if set(stage.excludes) - set(names) or set(stage.preset) - own or set(stage.records) - own:
            raise TypeError(f"selection stage {stage.name}: excludes, preset and records name stages and its own knobs")


def _stage_fields(stage: Stage) -> list[tuple[str, Any, dataclasses.Field]]:
    """The stage's knobs as make_dataclass takes them: name, resolved type, a field of the same default and metadata."""
    kinds = typing.get_type_hints(stage.knobs)
    return [
        (f.name, kinds[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(stage.knobs)
    ]


def _refuse_exclusions(self: Options) -> None:
    """Options' checks of each value, then each stage's exclusions (a one-line MethodError)."""
    Options.__post_init__(self)
    for stage in stages_on(self):
        for name, why in stage.excludes.items():
            other = _BY_NAME[name]
            if other.on(self):
                raise MethodError(
                    f"{other.setting(getattr(self, other.switch.name))} needs "
                    f"{stage.setting(stage.switch.default)}: {why}"
                )


_check_declarations(STAGES)
SelectionOptions = dataclasses.make_dataclass(
    "SelectionOptions",
    [f for stage in STAGES for f in _stage_fields(stage)],
    bases=(Options,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__post_init__": _refuse_exclusions,
        "__doc__": """The knobs every scoring method gets (:class:`EvictionMethod` whose scores mean importance):
    how its scores become kept tokens. Built from the stages of kvlab.compression.wrappers (:data:`STAGES`),
    their knobs in the stages' order; a stage on excludes the stages it declares (one-line MethodError).

    A scoring method's Options extend this class (the method's own knobs are listed first,
    kvlab.catalog.knobs); :func:`kvlab.compression.registry.register` checks it.
    """,
    },
)

#: Published configurations of any scoring method with one wrapper on (``kvlab bench --preset adakv``):
#: each stage's preset, under the stage's name.
SELECTION_PRESETS: dict[str, dict[str, Any]] = {stage.name: dict(stage.preset) for stage in STAGES}


def selection_learn() -> str:
    """The wrappers' Learn paragraph (kvlab.catalog puts it under every scoring method's text): its opening
    (kvlab/learn_text/selection_wrappers.md), then each stage's own text (the ``.md`` beside its module)
    in the stages' order."""
    texts = [learn_text.module_text(f"{wrappers.__name__}.{stage.name}") for stage in STAGES]
    return learn_text.page_text("selection_wrappers.md", stages=" ".join(texts))


def stages_on(options: Any) -> list[Stage]:
    """The stages ``options`` turn on, in their order; none for options without the wrappers' knobs."""
    return [stage for stage in STAGES if stage.on(options)] if isinstance(options, SelectionOptions) else []


def recorded(options: Any) -> dict[str, Any]:
    """The knob values the stored cache's meta records (each stage's ``records``); {} without the wrappers' knobs."""
    if not isinstance(options, SelectionOptions):
        return {}
    return {name: getattr(options, name) for stage in STAGES for name in stage.records}


def select(
    req: Request, scores: list[torch.Tensor], own: HeadBudgets, opts: Any
) -> tuple[list[torch.Tensor], HeadBudgets]:
    """The stages ``opts`` (a SelectionOptions) turn on applied to a method's scores and budgets, in their
    order: the allocation (AdaKV's from the method's scores, as kvpress's CriticalAdaKVPress; the model's
    profile; the global ranking), then CriticalKV's two stages with those budgets; or ChunkKV's chunks.

    scores: per layer [H_kv, T_doc]; own: the method's own budgets ([n_layers, H_kv]) -> the scores
    and budgets, changed. MethodError when a stage cannot apply (``budgets`` replacing an allocation
    the method makes itself: PyramidKV's pyramid, KVzip's pruning).
    """
    head = own
    for stage in stages_on(opts):
        if stage.scores is not None:
            scores, head = stage.scores(req, scores, head, opts)
    return scores, head


def keep_tokens(
    req: Request, layer: int, doc_index: torch.Tensor, lengths: torch.Tensor, fate: str = "kept"
) -> list[Segment]:
    """Segments for one layer keeping the template prefix plus chosen document tokens.

    doc_index: [H_kv, L] document-relative token indices, padded past each
    head's length; lengths: [H_kv].
    """
    ctx = req.ctx
    prefix = ctx.prefix_len
    keys, values = ctx.full.keys[layer], ctx.full.values[layer]
    segments: list[Segment] = [template_segment(keys, values, prefix)] if prefix else []
    index = doc_index.clamp(min=0) + prefix
    segments.append(
        DenseSegment.from_padded(gather_tokens(keys, index), gather_tokens(values, index), lengths, index, fate=fate)
    )
    return segments


def top_k_per_head(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each head's ``lengths[h]`` highest-scoring positions, ascending, padded with -1.

    scores: [H, T]; lengths: [H] -> [H, max(lengths)].
    """
    width, sentinel = int(lengths.max()), scores.shape[-1]
    top = torch.topk(scores.float(), k=width, dim=-1).indices
    lengths = lengths.to(scores.device)
    valid = torch.arange(width, device=scores.device).unsqueeze(0) < lengths.unsqueeze(1)
    # Sort each head's picks into reading order; the sentinel sorts past them.
    ordered = torch.sort(torch.where(valid, top, sentinel), dim=-1).values
    return ordered.masked_fill(ordered == sentinel, -1)
