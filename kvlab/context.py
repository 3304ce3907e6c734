"""A document read by a model: its tokens, its full cache, and recorded queries.

Preparing a context (the prefill) is the slow step; it is done once per
(model, document) and kept in a small in-process cache, so changing the
method, ratio or question never re-runs it.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvlab.documents import DocumentError
from kvlab.models import LoadedModel
from kvlab.prompts import ContextTokens, context_tokens
from kvlab.runtime.cache import FullKV
from kvlab.runtime.decode import prefill
from kvlab.runtime.hooks import QueryCapture

Progress = Callable[[float, str], None]

# Room left after the document for the question turn and the answer.
ANSWER_ROOM = 256


def no_progress(fraction: float, desc: str) -> None:
    """Default progress sink."""


@dataclass
class Context:
    """One document prepared for one model.

    queries: recorded post-RoPE query sets by source name, each a list over
    layers of [H, n, d] tensors; "context" (the prefill's own queries) is
    filled at once, other sources on first use (see kvlab.queries).
    """

    lm: LoadedModel
    text: str
    tokens: ContextTokens
    full: FullKV
    prefill_s: float
    queries: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # Held-out evaluation data per question (kvlab.pipeline.Evaluation); kept
    # apart from ``queries`` so it can never be picked as fitting queries.
    evaluations: dict[str, object] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
    full = prefill(
        lm, tokens.ids, capture, on_chunk=lambda done, total: progress(done / total, "prefill")
    )
    elapsed = time.perf_counter() - start
    return Context(lm, text, tokens, full, elapsed, queries={"context": capture.per_layer()})


class ContextStore:
    """Recently prepared contexts, keyed by (loaded model, document hash); thread-safe."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._items: OrderedDict[tuple[int, str], Context] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(lm: LoadedModel, text: str) -> tuple[int, str]:
        # The model object itself, not its name: two folders both called "model"
        # are different models. The stored Context holds ``lm``, so its id cannot
        # be reused by another object while the entry lives.
        return id(lm), hashlib.sha256(text.encode()).hexdigest()

    def get(self, lm: LoadedModel, text: str, progress: Progress = no_progress) -> Context:
        key = self.key(lm, text)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        ctx = prepare_context(lm, text, progress)
        with self._lock:
            self._items[key] = ctx
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return ctx


CONTEXTS = ContextStore()
