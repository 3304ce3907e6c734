"""The one small interface every compression method implements, and its registry.

A method turns a prepared context into a stored cache at a ratio. Eviction
methods only say how much each token matters (score); the shared code keeps
the top of each head's budget and gathers their keys and values (the
"score, then top-k, then gather" shape of kvpress).

Ratio semantics, for every method: the chat template's prefix (system prompt
and turn header, a few dozen tokens) is always kept; the document's T tokens
are reduced to about T / ratio stored keys per KV head on average.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvlab.context import Context, Progress, no_progress
from kvlab.runtime.cache import CompressedKV, DenseSegment, Segment, gather_tokens, template_segment, token_importance

MIN_RATIO, MAX_RATIO = 1.0, 1000.0


class MethodError(ValueError):
    """A method was asked for something it cannot do; the message says why."""


def knob(default: Any, help: str, *, low: float | None = None, high: float | None = None, odd: bool = False) -> Any:
    """A dataclass field for one method knob: its default, its help line and what it allows.

    low / high: inclusive bounds of a number (None: open); odd: a whole number
    that must be odd (a centred pooling kernel).
    """
    return field(default=default, metadata={"help": help, "low": low, "high": high, "odd": odd})


def allowed(f: dataclasses.Field, kind: Any) -> str:
    """What a knob of type ``kind`` declared by ``f`` accepts, in words ("an odd whole number >= 1")."""
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(kind)))
    if kind is bool:
        return "true or false"
    if kind is str:
        return "a non-empty text"
    low, high = f.metadata.get("low"), f.metadata.get("high")
    noun = ("an odd whole number" if f.metadata.get("odd") else "a whole number") if kind is int else "a number"
    if low is not None and high is not None:
        return f"{noun} from {low:g} to {high:g}"
    if low is not None:
        return f"{noun} >= {low:g}"
    return f"{noun} <= {high:g}" if high is not None else noun


def _accepts(f: dataclasses.Field, kind: Any, value: Any) -> bool:
    if typing.get_origin(kind) is typing.Literal:
        return isinstance(value, str) and value in typing.get_args(kind)
    if kind is bool:
        return isinstance(value, bool)
    if kind is str:
        return isinstance(value, str) and bool(value.strip())
    if kind not in (int, float):
        return True  # no rule for other types
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)) or not math.isfinite(value):
        return False
    low, high = f.metadata.get("low"), f.metadata.get("high")
    if f.metadata.get("odd") and value % 2 == 0:
        return False
    return (low is None or value >= low) and (high is None or value <= high)


@functools.cache
def option_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of an Options dataclass (Literal kept; annotations are strings here)."""
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Options:
    """Base of every method's knobs: each field is checked on creation against its
    type (Literal choices included) and the bounds its :func:`knob` declares.

    A bad value raises MethodError naming the field, the value and what is
    allowed; get_method prefixes the method's name.
    """

    def __post_init__(self) -> None:
        kinds = option_types(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.init and not _accepts(f, kinds[f.name], value):
                raise MethodError(f"{f.name} must be {allowed(f, kinds[f.name])}, got {value!r}")


@dataclass(frozen=True)
class NoOptions(Options):
    """A method without knobs."""


@dataclass
class Request:
    """What a method is asked: compress ``ctx`` by ``ratio``.

    question: the user's question, for the methods (and query sources) that are
    explicitly query-aware; query-agnostic methods never read it.
    record_importance: also fill ``CompressedKV.importance`` (a diagnostic for
    the app's token view; off by default: it is per-token data nobody else reads).
    """

    ctx: Context
    ratio: float
    question: str | None = None
    progress: Progress = no_progress
    record_importance: bool = False

    def __post_init__(self) -> None:
        if not (MIN_RATIO <= self.ratio <= MAX_RATIO) or math.isnan(self.ratio):
            raise MethodError(f"ratio must be between {MIN_RATIO:g} and {MAX_RATIO:g}, got {self.ratio:g}")

    @property
    def doc_budget(self) -> int:
        """Document tokens kept per KV head on average: T / ratio, at least one."""
        return max(1, round(self.ctx.doc_len / self.ratio))

    def budgets(self) -> torch.Tensor:
        """[n_layers, H_kv] uniform per-head document budgets."""
        lm = self.ctx.lm
        return torch.full((lm.n_layers, lm.n_kv_heads), self.doc_budget, dtype=torch.long, device=lm.device)


class Method(ABC):
    """A KV-cache compression method. Subclasses set the class attributes and ``compress``."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line, shown by `python -m kvlab methods` and the app; no default values in prose
    #: The Learn text (markdown with $...$ formulas): idea and formula. The knob
    #: table and the paper are rendered from ``Options`` and ``paper``.
    learn: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    query_aware: ClassVar[bool] = False  # the compression always depends on the question
    query_aware_when: ClassVar[str] = ""  # or only with these options, e.g. "query_source=question"
    fixed_budget: ClassVar[bool] = False  # ignores the ratio (e.g. no context)
    Options: ClassVar[type] = NoOptions
    #: Named sets of option values (published configurations); get_method(name, preset=...).
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()

    def uses_question(self) -> bool:
        """Whether this instance (with its options) compresses for the question it is given."""
        return self.query_aware

    def prepare(self, ctx: Context) -> None:
        """Do the work that depends on the document alone (e.g. record reference queries) ahead of a run.

        Kept on ``ctx``, so a later ``compress`` finds it done (kvlab.lab.prepare_document
        calls this as soon as a document is chosen). Nothing by default.
        """

    @abstractmethod
    def compress(self, req: Request) -> CompressedKV:
        """Return the stored cache for ``req.ctx`` at ``req.ratio``."""


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
    segments.append(DenseSegment.from_padded(
        gather_tokens(keys, index), gather_tokens(values, index), lengths, index, fate=fate))
    return segments


def document_importance(req: Request, scores: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``CompressedKV.importance`` from document-token scores, or None unless the request records it.

    scores: per layer [H_kv, T_doc] -> per layer [H_kv, context length], NaN
    on the template prefix (kept whatever its score).
    """
    if not req.record_importance:
        return None
    ctx = req.ctx
    index = torch.arange(ctx.prefix_len, ctx.length, device=ctx.lm.device)
    return [token_importance(s, index.expand(s.shape[0], -1), ctx.length) for s in scores]


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


class EvictionMethod(Method):
    """Score every document token per layer and head; keep each head's top budget."""

    #: Whether the scores mean importance (recorded as ``CompressedKV.importance``);
    #: not for position or chance (StreamingLLM's recency, random scores).
    scores_are_importance: ClassVar[bool] = True
    #: Fewest document tokens a head keeps (0: a head may keep only the template).
    min_head_budget: ClassVar[int] = 1

    @abstractmethod
    def scores(self, req: Request) -> list[torch.Tensor]:
        """Per layer, [H_kv, T_doc] importance of each document token (higher = keep)."""

    def budgets(self, req: Request) -> torch.Tensor:
        """[n_layers, H_kv] document tokens kept per head; uniform unless overridden."""
        return req.budgets()

    def details(self) -> dict:
        """What the stored cache's meta (the run's JSON details) says besides the method's name."""
        return {}

    def compress(self, req: Request) -> CompressedKV:
        scores = self.scores(req)
        budgets = self.budgets(req).clamp(self.min_head_budget, req.ctx.doc_len)
        layers = [
            keep_tokens(req, i, top_k_per_head(s, budgets[i]), budgets[i])
            for i, s in enumerate(scores)
        ]
        importance = document_importance(req, scores) if self.scores_are_importance else None
        return CompressedKV(layers, req.ctx.length, meta={"method": self.name, **self.details()}, importance=importance)


REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by its ``name``."""
    if cls.name in REGISTRY:
        raise ValueError(f"method {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


def method_class(name: str) -> type[Method]:
    """The registered class of ``name``; MethodError listing the names when there is none."""
    if name not in REGISTRY:
        raise MethodError(f"unknown method {name!r}; choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def get_method(name: str, preset: str | None = None, **options: Any) -> Method:
    """Instantiate a registered method; options are fields of its Options dataclass.

    preset: one of the method's ``presets``, whose values the explicit options override.
    """
    cls = method_class(name)
    if preset is not None:
        if preset not in cls.presets:
            raise MethodError(f"{name} has no preset {preset!r}; it has: {', '.join(cls.presets) or 'none'}")
        options = {**cls.presets[preset], **options}
    known = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = set(options) - known
    if unknown:
        raise MethodError(f"{name} has no option(s) {', '.join(sorted(unknown))}; it takes: {', '.join(sorted(known)) or 'none'}")
    try:
        return cls(cls.Options(**options))
    except MethodError as exc:
        raise MethodError(f"{name}: {exc}") from None
