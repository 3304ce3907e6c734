"""A document read by a model: its tokens, its full cache, and what is derived from it.

Preparing a context (the prefill) is the slow step; it is done once per
(model, document) and kept in an in-process cache, so changing the method,
ratio or question never re-runs it. What runs then derive from the document
(recorded query sources, the full cache's answers, methods' scores) is kept
on the Context too, through :meth:`Context.cached`: one computation per key
even when requests race, without holding a lock other users need. Each kind
of value has its own key class (a :class:`Memo`), defined beside its user.

Memory is bounded two ways (limits in kvlab.limits): a document remembers at
most ``remembered_questions`` questions (the least recently used one's
entries go first), and kvlab.context_store.ContextStore holds a byte budget for all of
it (contexts and everything cached on them), evicting least recently used
entries, then whole contexts, when it is exceeded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Literal, TypeVar

from kvlab import cancellation, limits
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


#: The Context dicts a Memo's value may live in.
Store = Literal["queries", "evaluations", "memos", "runs"]


@dataclass(frozen=True)
class Memo:
    """The key of one value kept on a Context (:meth:`Context.cached`).

    One small frozen dataclass per kind of value, defined beside its user; its
    fields are everything the value depends on (two keys of different classes
    never match). store: the Context dict the value lives in (a class
    attribute); question: the question the value belongs to, part of the key
    (None: the document's): the value is forgotten with that question.
    """

    store: ClassVar[Store] = "memos"
    question: str | None = field(default=None, kw_only=True)


@dataclass
class Context:
    """One document prepared for one model, and what runs derived from it.

    The four dicts hold their values by :class:`Memo` key (the store its class names):
    queries: recorded post-RoPE query sets, each a list over layers of [H, n, d]
    tensors (kvlab.queries.QuestionQueries, SelfStudyQueries), or a
    kvlab.queries.RepeatPass (queries and the tokens' own keys:
    kvlab.queries.RepeatQueries, kvlab.methods.finch.FinchPass); besides them,
    under "context", the prefill's own queries, filled at once.
    evaluations: the full cache's answer and held-out queries per question
    (kvlab.pipeline.EvaluationKey); kept apart from ``queries`` so it can never
    be picked as fitting queries.
    memos: methods' ratio-independent scores (kvlab.compression.interface.MethodScores,
    and parts several methods share, each under its own key beside its user:
    kvlab.methods.families.scorers.KVzipScores, H2OScores, ...), the full cache's
    attention of a question (kvlab.pipeline.ReferenceAttention), and what the token
    view shows the same for every run (kvlab.lab.explore.TokenTexts,
    kvlab.lab.fates.QuestionLevels).
    runs: stored caches per (method, options, ratio) and their answers per
    question (kvlab.pipeline.StoredCache, StoredAnswer).
    Everything but "context" is added through :meth:`cached`, which bounds it:
    at most ``remembered`` questions, at most ``budget`` bytes in all.
    """

    lm: LoadedModel
    text: str
    tokens: ContextTokens
    full: FullKV
    prefill_s: float
    queries: dict[str | Memo, object] = field(
        default_factory=dict
    )  # values: see above (RepeatPass lives in kvlab.queries, which imports this module)
    evaluations: dict[Memo, object] = field(default_factory=dict)
    memos: dict[Memo, object] = field(default_factory=dict)
    runs: dict[Memo, object] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: Byte budget of this context with all it caches (None: unbounded); its store sets it.
    budget: int | None = None
    remembered: int = field(default_factory=lambda: limits.LIMITS.remembered_questions)
    #: Called after the context grew (its store re-checks its budget).
    on_grow: Callable[[], None] = field(default=lambda: None, repr=False)
    #: Each cached value's key and its bytes, least recently used first.
    _entries: OrderedDict[Memo, int] = field(default_factory=OrderedDict, repr=False)
    _questions: OrderedDict[str, None] = field(default_factory=OrderedDict, repr=False)
    _flights: dict[Memo, Future] = field(default_factory=dict, repr=False)
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

    def cached(self, memo: Memo, make: Callable[[], T]) -> T:
        """The value kept under ``memo``, made by ``make()`` once (see kvlab.memo.compute_once).

        It lives in the dict ``memo.store`` names; it is forgotten with
        ``memo.question`` when newer questions push that past ``remembered``.
        Least recently used values are dropped while the context is over its
        budget (never the one just made).
        """
        store, question = getattr(self, memo.store), memo.question

        def find() -> object:
            if memo not in self._entries:
                return MISSING
            self._entries.move_to_end(memo)
            if question in self._questions:
                self._questions.move_to_end(question)
            return store[memo]

        def keep(value: T) -> None:
            store[memo] = value
            self._entries[memo] = held_bytes(value)
            if question is not None:
                self._questions[question] = None
                self._questions.move_to_end(question)
            self._shrink(memo)

        value = compute_once(self.lock, self._flights, memo, find, make, keep)
        self.on_grow()
        return value

    def holds(self, memo: Memo) -> bool:
        """Whether a value is kept under ``memo`` now (:meth:`cached` would reuse it)."""
        with self.lock:
            return memo in self._entries

    def _shrink(self, newest: Memo) -> None:
        """Forget questions beyond ``remembered``, then old entries while over budget (under ``self.lock``)."""
        while len(self._questions) > max(1, self.remembered):
            oldest, _ = self._questions.popitem(last=False)
            for memo in [m for m in self._entries if m.question == oldest]:
                self._drop(memo)
        total = self._count_bytes()
        dropped = False
        while self.budget is not None and total > self.budget:
            memo = next((m for m in self._entries if m != newest), None)
            if memo is None:
                break
            total -= self._drop(memo)
            dropped = True
        # An entry's own bytes may be shared with others (views of the full cache): count again after a drop.
        self._nbytes = self._count_bytes() if dropped else total

    def _drop(self, memo: Memo) -> int:
        nbytes = self._entries.pop(memo)
        del getattr(self, memo.store)[memo]
        if memo.question is not None and all(m.question != memo.question for m in self._entries):
            self._questions.pop(memo.question, None)
        return nbytes

    def forget(self) -> None:
        """Drop every cached value: what remains is the cache, the tokens and the prefill's own queries."""
        with self.lock:
            for memo in list(self._entries):
                self._drop(memo)
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
    report = cancellation.checked(progress)  # each chunk is a step a stopped request ends at
    full = prefill(
        lm,
        tokens.ids,
        capture,
        on_chunk=lambda done, total: report(done / total, f"prefill, {done:,}/{total:,} tokens"),
    )
    elapsed = time.perf_counter() - start
    return Context(lm, text, tokens, full, elapsed, queries={"context": capture.per_layer()})
