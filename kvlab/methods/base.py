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
from typing import Any, Callable, ClassVar, Literal

import torch

from kvlab.context import Context, Progress, no_progress
from kvlab.methods.adakv import adakv_budgets, safeguard
from kvlab.methods.chunkkv import chunk_ranks
from kvlab.methods.criticalkv import critical_scores, output_projection, projected_value_norm
from kvlab.runtime.cache import (
    CompressedKV, DenseSegment, Segment, gather_tokens, keep_windows, template_segment, token_importance,
)

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


@dataclass(frozen=True)
class SelectionOptions(Options):
    """The knobs every scoring method gets (:class:`EvictionMethod` whose scores mean importance):
    how its scores become kept tokens. One module each does the maths:
    kvlab.methods.adakv, kvlab.methods.chunkkv, kvlab.methods.criticalkv.
    """

    budgets: Literal["uniform", "adakv"] = knob(
        "uniform", "uniform (the method's own per-head budgets) or adakv (a layer's budget shared among its heads by "
        "their scores, stored ragged)")
    alpha_safeguard: float = knob(
        0.2, "adakv: fewest tokens a head keeps, as a share of the mean per-head budget", low=0.0, high=1.0)
    granularity: Literal["token", "chunk"] = knob(
        "token", "token, or chunk (ChunkKV: keep whole chunks of consecutive tokens, the same in every head)")
    chunk_size: int = knob(10, "chunk: tokens per chunk", low=1)
    critical: bool = knob(
        False, "CriticalKV: after a first stage by the method's scores, reweight by the value's norm through o_proj")
    first_stage_ratio: float = knob(
        0.5, "critical: share of each head's budget chosen by the method's own scores", low=0.0, high=1.0)
    critical_epsilon: float = knob(1e-4, "critical: added to the scores before the reweighting", low=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        # ChunkKV picks chunks by one score shared by the heads: head budgets (AdaKV) and per-head
        # first-stage picks (CriticalKV) have no meaning there.
        if self.granularity == "chunk" and self.budgets == "adakv":
            raise MethodError("budgets=adakv needs granularity=token: ChunkKV keeps the same chunks in every head")
        if self.granularity == "chunk" and self.critical:
            raise MethodError("critical=true needs granularity=token: ChunkKV keeps the same chunks in every head")


#: Published configurations of any scoring method with one wrapper on (``kvlab bench --preset adakv``).
SELECTION_PRESETS: dict[str, dict[str, Any]] = {
    "adakv": {"budgets": "adakv"},
    "chunkkv": {"granularity": "chunk"},
    "criticalkv": {"critical": True},
}

SELECTION_LEARN = (
    "**Selection wrappers** (knobs shared by every scoring method). `budgets=adakv` (AdaKV): a layer's budget "
    "is shared among its heads by one top-k over all their scores, each head keeping at least `alpha_safeguard` "
    "of the mean, and the heads are stored ragged, so the bytes are those of the kept tokens. "
    "`granularity=chunk` (ChunkKV): chunks of `chunk_size` tokens scored by their mean, "
    "$\\bar s_c=\\tfrac{1}{|c|}\\sum_{j\\in c}\\sum_h s^{(h)}_j$, whole chunks kept, the same in every head. "
    "`critical=true` (CriticalKV): each head keeps a `first_stage_ratio` share of its budget by $s_j$, the rest by "
    "$(s_j+\\epsilon)\\,\\lVert v_j W_o^{(h)}\\rVert_1$, what the value adds to the layer's output."
)


def select(
    req: Request, scores: list[torch.Tensor], budgets: torch.Tensor, opts: SelectionOptions
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The wrappers applied to a method's scores and budgets: AdaKV's allocation (from the method's
    scores, as kvpress's CriticalAdaKVPress), then CriticalKV's two stages with those budgets;
    or ChunkKV's chunks alone.

    scores: per layer [H_kv, T_doc]; budgets: [n_layers, H_kv] -> the same, changed.
    """
    ctx = req.ctx
    if opts.budgets == "adakv":
        n_heads = budgets.shape[1]
        budgets = torch.stack([
            adakv_budgets(s, int(b.sum()), safeguard(int(b.sum()), n_heads, opts.alpha_safeguard))
            for s, b in zip(scores, budgets)
        ])
    if opts.critical:
        scores = [
            critical_scores(s, projected_value_norm(ctx.full.values[i][:, ctx.prefix_len :],
                                                    output_projection(ctx.lm.model, i)),
                            budgets[i], opts.first_stage_ratio, opts.critical_epsilon)
            for i, s in enumerate(scores)
        ]
    if opts.granularity == "chunk":
        scores = [chunk_ranks(s, opts.chunk_size) for s in scores]
    return scores, budgets


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

    @classmethod
    def prepares(cls) -> bool:
        """Whether the method has document-only work to do ahead of a run (it overrides :meth:`prepare`).

        The app prepares a method when it is picked only then: for the others a round trip
        would cost the browser (and, on one machine, the server beside it) time for nothing.
        """
        return cls.prepare is not Method.prepare

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


def context_scores(req: Request, score_layer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: ``score_layer(keys, values)`` of the whole context ([H_kv, N, d] each
    -> [H_kv, N]; a scorer whose windows or partitions count from the context's first token), cut to
    the document."""
    ctx = req.ctx
    return [score_layer(k, v)[:, ctx.prefix_len :] for k, v in zip(ctx.full.keys, ctx.full.values)]


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
    #: Whether :meth:`scores` is the same at every ratio (then kept per context, :meth:`kept_scores`).
    ratio_free_scores: ClassVar[bool] = True

    @abstractmethod
    def scores(self, req: Request) -> list[torch.Tensor]:
        """Per layer, [H_kv, T_doc] importance of each document token (higher = keep)."""

    def budgets(self, req: Request) -> torch.Tensor:
        """[n_layers, H_kv] document tokens kept per head; uniform unless overridden."""
        return req.budgets()

    def details(self) -> dict:
        """What the stored cache's meta (the run's JSON details) says besides the method's name."""
        return {}

    @classmethod
    def selects(cls) -> bool:
        """Whether the selection wrappers (:class:`SelectionOptions`) apply: scores that mean importance."""
        return cls.scores_are_importance

    def kept_scores(self, req: Request) -> list[torch.Tensor]:
        """:meth:`scores`, computed once per context, options and (for a query-aware instance) question
        when they do not depend on the ratio, so that a second ratio only re-selects. Kept in
        ``ctx.memos`` within the context's byte budget; nothing downstream changes them in place."""
        if not self.ratio_free_scores:
            return self.scores(req)
        question = req.question if self.uses_question() else None
        key = ("scores", self.name, self.options, question)
        return req.ctx.cached("memos", key, lambda: self.scores(req), question)

    def compress(self, req: Request) -> CompressedKV:
        scores = self.kept_scores(req)
        budgets = self.budgets(req).clamp(self.min_head_budget, req.ctx.doc_len)
        if isinstance(self.options, SelectionOptions):
            scores, budgets = select(req, scores, budgets, self.options)
        layers = [
            keep_tokens(req, i, top_k_per_head(s, budgets[i]), budgets[i])
            for i, s in enumerate(scores)
        ]
        importance = document_importance(req, scores) if self.scores_are_importance else None
        meta = {"method": self.name, **self.details()}
        if isinstance(self.options, SelectionOptions):
            meta.update(budgets=self.options.budgets, granularity=self.options.granularity, critical=self.options.critical)
        return CompressedKV(layers, req.ctx.length, meta=meta, importance=importance)


REGISTRY: dict[str, type[Method]] = {}


def with_selection(cls: type[EvictionMethod]) -> None:
    """Give a scoring method the wrappers' knobs and presets: its ``Options`` becomes a subclass of
    its own and :class:`SelectionOptions` (the method's knobs first), reachable for pickle as
    ``<module>.<Method>.Options``."""
    own = cls.Options
    options = dataclasses.make_dataclass(own.__name__, [], bases=(SelectionOptions, own), frozen=True)
    options.__module__, options.__qualname__ = cls.__module__, f"{cls.__qualname__}.Options"
    options.__doc__ = own.__doc__
    cls.Options = options
    cls.presets = {**cls.presets, **SELECTION_PRESETS}


def keeping_windows(compress: Callable[[Method, Request], CompressedKV]) -> Callable[[Method, Request], CompressedKV]:
    """``compress`` whose caches of the request's document keep every sliding-window layer as the model
    does (its window; kvlab.runtime.cache.keep_windows): a method compresses the full-attention layers
    only. A cache of another text (a summary, the template alone) was read by the model itself, its
    window layers' keys consecutive tokens that the window mask reads as the model would."""

    @functools.wraps(compress)
    def compress_full_layers(self: Method, req: Request) -> CompressedKV:
        stored = compress(self, req)
        return keep_windows(stored, req.ctx.full) if stored.logical_len == req.ctx.length else stored

    compress_full_layers.keeps_windows = True  # type: ignore[attr-defined]
    return compress_full_layers


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by its ``name`` (a scoring method with the wrappers' knobs;
    its caches keep the model's sliding windows, :func:`keeping_windows`)."""
    if cls.name in REGISTRY:
        raise ValueError(f"method {cls.name!r} registered twice")
    if issubclass(cls, EvictionMethod) and cls.selects():
        with_selection(cls)
    if not getattr(cls.compress, "keeps_windows", False):
        cls.compress = keeping_windows(cls.compress)
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
