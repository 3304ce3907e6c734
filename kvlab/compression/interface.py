"""The one small interface every compression method implements.

A method turns a prepared context into a stored cache at a ratio. Eviction
methods only say how much each token matters (score); the shared code keeps
the top of each head's budget and gathers their keys and values (the
"score, then top-k, then gather" shape of kvpress).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Literal

import torch

from kvlab import learn_text
from kvlab.compression.budget_profiles import BUDGET_SOURCES, HeadBudgets
from kvlab.compression.options import NoOptions
from kvlab.compression.paper import Baseline, Paper
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions, keep_tokens, recorded, select, stages_on, top_k_per_head
from kvlab.compression.stage import Stage
from kvlab.context import Context, Memo
from kvlab.runtime.cache import CompressedKV, keep_windows, token_importance

#: The map of the field (issue #34): what a method does to the cache. docs/methods.md, the Learn tab
#: and ``kvlab methods`` group the methods by it, in this order.
Family = Literal["selection", "merging", "channel", "quantisation", "engine formats", "compaction", "baselines"]
FAMILIES: dict[str, str] = {
    "selection": "keep some tokens, drop the rest (a score per token, then each head's top budget)",
    "merging": "fold the dropped tokens into the kept ones",
    "channel": "drop key or value channels instead of tokens",
    "quantisation": "keep every token in fewer bits",
    "engine formats": "the KV-cache formats serving engines ship",
    "compaction": "build a smaller cache that behaves like the full one (fitted keys, biases, values)",
    "baselines": "reference points every method must beat",
}
#: How far bf16 may move a method's attention-output error from float32's (tests/test_bf16.py holds
#: the bounds and their derivation): ``fit`` a least-squares fit absorbs the rounding; ``same_tokens``
#: bf16 keeps the same tokens (or picks them without near ties); ``code_flips`` 2- to 8-bit codes,
#: where a value rounded across a code boundary moves a whole step; ``near_ties`` scores within a few
#: bf16 roundings of each other, so bf16 swaps some kept tokens.
Bf16Tolerance = Literal["fit", "same_tokens", "code_flips", "near_ties"]


class LearnText:
    """``Method.learn``: a class's Learn text, read from the markdown file named as its module, beside it
    (``kvlab/methods/snapkv.md`` for ``kvlab.methods.snapkv``); a method class holds no prose."""

    def __get__(self, instance: object, owner: type) -> str:
        return learn_text.module_text(owner.__module__)


class Method(ABC):
    """A KV-cache compression method. Subclasses set the class attributes and ``compress``."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line, shown by `python -m kvlab methods` and the app; no default values in prose
    #: The Learn text (markdown with $...$ formulas): idea and formula, read from the ``.md`` file beside
    #: the class's module (kvlab.learn_text). The knob table and the paper are rendered from ``Options``
    #: and ``paper``.
    learn = LearnText()
    #: Where the method comes from (rendered in the Learn text and docs/methods.md).
    paper: ClassVar[Paper | Baseline]
    family: ClassVar[Family]
    bf16_tolerance: ClassVar[Bf16Tolerance]
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

    def long_compression(self) -> bool:
        """Whether this instance's compression is long work of its own (it trains a cache, writes a summary
        or reads text through the model): on a long document longer than one request of the app may
        compute, so the app does it in the document's background preparation (kvlab.lab.background).
        False by default: a selection or a fit on prepared queries takes seconds."""
        return False

    @abstractmethod
    def compress(self, req: Request) -> CompressedKV:
        """Return the stored cache for ``req.ctx`` at ``req.ratio``."""


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


def context_scores(
    req: Request, score_layer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: ``score_layer(keys, values)`` of the whole context ([H_kv, N, d] each
    -> [H_kv, N]; a scorer whose windows or partitions count from the context's first token), cut to
    the document."""
    ctx = req.ctx
    return [score_layer(k, v)[:, ctx.prefix_len :] for k, v in zip(ctx.full.keys, ctx.full.values)]


@dataclass(frozen=True)
class MethodScores(Memo):
    """Where :meth:`EvictionMethod.kept_scores` keeps a method's scores: its name and options,
    and the question for a query-aware instance (None: they serve every question)."""

    method: str
    options: Hashable


class EvictionMethod(Method):
    """Score every document token per layer and head; keep each head's top budget."""

    #: Whether the scores mean importance (recorded as ``CompressedKV.importance``);
    #: not for position or chance (StreamingLLM's recency, random scores).
    scores_are_importance: ClassVar[bool] = True
    #: Fewest document tokens a head keeps (0: a head may keep only the template).
    min_head_budget: ClassVar[int] = 1
    #: Whether :meth:`kept_scores` keeps :meth:`scores` on the context: true for scores the same at
    #: every ratio; false for scores that follow the ratio, and for scores that already are a memo of
    #: parts several methods share (each under its own kvlab.context.Memo), which are not kept twice.
    keep_scores: ClassVar[bool] = True

    @abstractmethod
    def scores(self, req: Request) -> list[torch.Tensor]:
        """Per layer, [H_kv, T_doc] importance of each document token (higher = keep)."""

    def head_budgets(self, req: Request) -> torch.Tensor:
        """[n_layers, H_kv] document tokens kept per head; uniform unless overridden."""
        return req.uniform_budgets()

    def allocation(self) -> tuple[str, str] | None:
        """A method whose :meth:`head_budgets` are its own allocation: (its name, one line on what the
        budgets follow), which the ``budgets`` knob must not replace; None for uniform budgets."""
        return None

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
        if not self.keep_scores:
            return self.scores(req)
        question = req.question if self.uses_question() else None
        return req.ctx.cached(MethodScores(self.name, self.options, question=question), lambda: self.scores(req))

    def key_stages(self) -> list[Stage]:
        """The selection stages that move this instance's kept keys (key re-rotation,
        kvlab.compression.wrappers.key_rerotation): those its options turn on. A method with a knob of
        its own for one (StreamingLLM's ``rerotate``) overrides this."""
        return [stage for stage in stages_on(self.options) if stage.kept is not None]

    def compress(self, req: Request) -> CompressedKV:
        wrapped = self.options if isinstance(self.options, SelectionOptions) else None
        moves = self.key_stages()
        for stage in moves:
            if stage.check is not None:
                stage.check(req.ctx.lm)  # before the scores: a refusal costs nothing
        scores = self.kept_scores(req)
        mode, source = self.allocation() or ("uniform", BUDGET_SOURCES["uniform"])
        head = HeadBudgets(self.head_budgets(req).clamp(self.min_head_budget, req.ctx.doc_len), mode, source)
        if wrapped is not None:
            scores, head = select(req, scores, head, wrapped)
        budgets = head.budgets
        layers = [keep_tokens(req, i, top_k_per_head(s, budgets[i]), budgets[i]) for i, s in enumerate(scores)]
        shift = 0
        for stage in moves:
            layers, after = stage.kept(req.ctx.lm, layers)
            shift = req.ctx.length - after
        importance = document_importance(req, scores) if self.scores_are_importance else None
        meta = {"method": self.name, **self.details(), **head.meta(), **recorded(self.options)}
        meta.update(rerotate=bool(moves))
        return CompressedKV(layers, req.ctx.length, meta=meta, importance=importance, position_shift=shift)


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
