"""A document read by a model: its tokens, its full cache, and what is derived from it.

Preparing a context (the prefill) is the slow step; it is done once per
(model, document) and kept in an in-process cache, so changing the method,
ratio or question never re-runs it. What runs then derive from the document
(recorded query sources, the full cache's answers, methods' scores) is kept
on the Context too, through :meth:`Context.cached`: one computation per key
even when requests race, without holding a lock other users need.

Memory is bounded two ways (limits in kvlab.limits): a document remembers at
most ``remembered_questions`` questions (the least recently used one's
entries go first), and kvlab.contexts.ContextStore holds a byte budget for all of
it (contexts and everything cached on them), evicting least recently used
entries, then whole contexts, when it is exceeded.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Hashable, TypeVar

from kvlab import cancel, limits
from kvlab.documents import DocumentError
from kvlab.memo import MISSING, compute_once, held_bytes
from kvlab.prompts import ContextTokens, context_tokens
from kvlab.runtime.cache import FullKV
from kvlab.runtime.decode import prefill
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.model import LoadedModel

T = TypeVar("T")
Progress = Callable[[float, str], None]

# Room left after the document for the question turn and the answer.
ANSWER_ROOM = 256


def no_progress(fraction: float, desc: str) -> None:
    """Default progress sink."""


@dataclass
class _Entry:
    """One cached value's bookkeeping: its bytes, and the question it belongs to (None: the document's)."""

    nbytes: int
    question: str | None


@dataclass
class Context:
    """One document prepared for one model, and what runs derived from it.

    queries: recorded post-RoPE query sets by source name, each a list over
    layers of [H, n, d] tensors, except the repeat passes ("repeat",
    "repeat:<instruction>"), each a kvlab.queries.RepeatPass (queries and the
    repeat tokens' own keys); "context" (the prefill's own queries) is filled
    at once, other sources on first use (see kvlab.queries).
    evaluations: held-out evaluation data per question (kvlab.pipeline.Evaluation);
    kept apart from ``queries`` so it can never be picked as fitting queries.
    memos: methods' ratio-independent scores (kvlab.compression.scoring.per_context), and
    what the token view shows the same for every run (each token's text, the question's
    attention levels: kvlab.lab.explore, kvlab.lab.fates).
    runs: stored caches per (method, options, ratio) and their answers per
    question (kvlab.pipeline.compressed, kvlab.pipeline.answered).
    Everything but "context" is added through :meth:`cached`, which bounds it:
    at most ``remembered`` questions, at most ``budget`` bytes in all.
    """

    lm: LoadedModel
    text: str
    tokens: ContextTokens
    full: FullKV
    prefill_s: float
    queries: dict[str, object] = field(default_factory=dict)  # values: see above (RepeatPass lives in kvlab.queries, which imports this module)
    evaluations: dict[str, object] = field(default_factory=dict)
    memos: dict[str, object] = field(default_factory=dict)
    #: Stored caches per method, options and ratio, and their answers per question (kvlab.pipeline).
    runs: dict[Hashable, object] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: Byte budget of this context with all it caches (None: unbounded); its store sets it.
    budget: int | None = None
    remembered: int = field(default_factory=lambda: limits.LIMITS.remembered_questions)
    #: Called after the context grew (its store re-checks its budget).
    on_grow: Callable[[], None] = field(default=lambda: None, repr=False)
    _entries: OrderedDict[tuple[str, Hashable], _Entry] = field(default_factory=OrderedDict, repr=False)
    _questions: OrderedDict[str, None] = field(default_factory=OrderedDict, repr=False)
    _flights: dict[Hashable, Future] = field(default_factory=dict, repr=False)
    _nbytes: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self._nbytes = self._count_bytes()

    def _count_bytes(self) -> int:
        # FullKV.stored (the keep-all view) is built on first use: count it as soon as it exists.
        return held_bytes([self.tokens, self.full, self.queries, self.evaluations, self.memos, self.runs])

    @property
    def nbytes(self) -> int:
        """Bytes this context keeps alive (as of its last change): cache, tokens and everything cached."""
        return self._nbytes

    @property
    def questions(self) -> list[str]:
        """The questions remembered, least recently used first."""
        with self.lock:
            return list(self._questions)

    def cached(self, store: str, key: Hashable, make: Callable[[], T], question: str | None = None) -> T:
        """``getattr(self, store)[key]``, made by ``make()`` once (see kvlab.memo.compute_once).

        store: "queries", "evaluations", "memos" or "runs"; question: the question the
        value belongs to; it is forgotten with that question when newer ones
        push it past ``remembered``. Least recently used values are dropped
        while the context is over its budget (never the one just made).
        """
        slot = (store, key)

        def find() -> object:
            if slot not in self._entries:
                return MISSING
            self._entries.move_to_end(slot)
            if question in self._questions:
                self._questions.move_to_end(question)
            return getattr(self, store)[key]

        def keep(value: T) -> None:
            getattr(self, store)[key] = value
            self._entries[slot] = _Entry(held_bytes(value), question)
            if question is not None:
                self._questions[question] = None
                self._questions.move_to_end(question)
            self._shrink(slot)

        value = compute_once(self.lock, self._flights, slot, find, make, keep)
        self.on_grow()
        return value

    def _shrink(self, newest: tuple[str, Hashable]) -> None:
        """Forget questions beyond ``remembered``, then old entries while over budget (under ``self.lock``)."""
        while len(self._questions) > max(1, self.remembered):
            oldest, _ = self._questions.popitem(last=False)
            for slot in [s for s, e in self._entries.items() if e.question == oldest]:
                self._drop(slot)
        total = self._count_bytes()
        while self.budget is not None and total > self.budget:
            slot = next((s for s in self._entries if s != newest), None)
            if slot is None:
                break
            total -= self._drop(slot)
        self._nbytes = self._count_bytes()

    def _drop(self, slot: tuple[str, Hashable]) -> int:
        entry = self._entries.pop(slot)
        del getattr(self, slot[0])[slot[1]]
        if entry.question is not None and all(e.question != entry.question for e in self._entries.values()):
            self._questions.pop(entry.question, None)
        return entry.nbytes

    def forget(self) -> None:
        """Drop every cached value: what remains is the cache, the tokens and the prefill's own queries."""
        with self.lock:
            for slot in list(self._entries):
                self._drop(slot)
            self._nbytes = self._count_bytes()

    @property
    def prefix_len(self) -> int:
        return self.tokens.prefix_len

    @property
    def length(self) -> int:
        return self.tokens.ids.numel()

    @property
    def doc_len(self) -> int:
        return self.tokens.doc_len


class ContextTooLong(DocumentError):
    """The document does not fit the model's context window."""


def check_fits(lm: LoadedModel, tokens: ContextTokens) -> None:
    limit = lm.max_context - ANSWER_ROOM
    if tokens.ids.numel() > limit:
        raise ContextTooLong(
            f"the document is {tokens.doc_len:,} tokens but {lm.name} reads at most "
            f"{limit - tokens.prefix_len:,} here ({lm.max_context:,}-token window, "
            f"{ANSWER_ROOM} kept for the question and answer): shorten it"
        )
    if tokens.doc_len == 0:
        raise DocumentError("the document has no tokens")


def prepare_context(lm: LoadedModel, text: str, progress: Progress = no_progress) -> Context:
    """Tokenise and prefill ``text``; record the prefill's queries as the "context" source."""
    tokens = context_tokens(lm.tokenizer, text)
    check_fits(lm, tokens)
    capture = QueryCapture(lm.n_layers)
    start = time.perf_counter()
    report = cancel.checked(progress)  # each chunk is a step a stopped request ends at
    full = prefill(
        lm, tokens.ids, capture, on_chunk=lambda done, total: report(done / total, f"prefill, {done:,}/{total:,} tokens")
    )
    elapsed = time.perf_counter() - start
    return Context(lm, text, tokens, full, elapsed, queries={"context": capture.per_layer()})
