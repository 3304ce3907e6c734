"""The documents prepared recently: one Context per (model, document), shared by every user, within a byte budget."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Hashable

import psutil
import torch

from kvlab import limits
from kvlab.context import Context, Progress, no_progress, prepare_context
from kvlab.memo import compute_once, recently_used
from kvlab.models import on_unload, pick_device
from kvlab.runtime.model import LoadedModel


def default_budget() -> int:
    """The byte budget of cached contexts: ``KVLAB_CACHE_BYTES``, else sized from free memory now.

    Half the free memory of the GPU the models run on, or a quarter of the
    available RAM on a CPU (the rest is for models, runs and other programs).
    """
    if limits.LIMITS.cache_bytes:
        return limits.LIMITS.cache_bytes
    device, _ = pick_device()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free // 2
    return psutil.virtual_memory().available // 4


class ContextStore:
    """Recently prepared contexts, keyed by (loaded model, document hash); thread-safe.

    A document being prepared is in flight: a second request for it (a Run
    clicked while the lab prepares the document in the background, or two
    users on one document) waits for that preparation instead of repeating it.

    budget: bytes for all contexts with everything cached on them (default:
    :func:`default_budget`, sized on first use); the least recently used
    contexts go while it is exceeded, but never the last one, which is bounded
    by the same budget on its own (:meth:`Context.cached`). capacity: at most
    this many contexts as well (None: bytes only).
    """

    def __init__(self, capacity: int | None = None, budget: int | None = None):
        self.capacity = capacity
        self._budget = budget
        self._items: OrderedDict[tuple[int, str], Context] = OrderedDict()
        self._flights: dict[Hashable, Future] = {}
        self._lock = threading.Lock()

    @property
    def budget(self) -> int:
        if self._budget is None:
            self._budget = default_budget()
        return self._budget

    @property
    def nbytes(self) -> int:
        """Bytes held by the contexts kept (as of their last change)."""
        with self._lock:
            return sum(ctx.nbytes for ctx in self._items.values())

    @staticmethod
    def key(lm: LoadedModel, text: str) -> tuple[int, str]:
        # The model object itself, not its name: two folders both called "model"
        # are different models. The stored Context holds ``lm``, so its id cannot
        # be reused by another object while the entry lives.
        return id(lm), hashlib.sha256(text.encode()).hexdigest()

    def peek(self, lm: LoadedModel, text: str) -> Context | None:
        """The prepared context, or None when it is not ready (never prepares)."""
        with self._lock:
            return self._items.get(self.key(lm, text))

    def get(self, lm: LoadedModel, text: str, progress: Progress = no_progress) -> Context:
        """The context of ``text`` for ``lm``: cached, awaited if in flight, else prepared now.

        ``progress`` hears the prefill only when this call runs it.
        """
        key = self.key(lm, text)
        budget = self.budget  # sized outside the lock: it may ask the GPU

        def keep(ctx: Context) -> None:
            ctx.budget, ctx.on_grow = budget, lambda: self.grew(key)
            self._items[key] = ctx
            self._trim()

        return compute_once(
            self._lock,
            self._flights,
            key,
            lambda: recently_used(self._items, key),
            lambda: prepare_context(lm, text, progress),
            keep,
        )

    def grew(self, key: tuple[int, str]) -> None:
        """A context grew while in use: it becomes the most recently used, and the others go if need be."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            self._trim()

    def _trim(self) -> None:
        def over() -> bool:
            too_many = self.capacity is not None and len(self._items) > self.capacity
            return too_many or sum(ctx.nbytes for ctx in self._items.values()) > self.budget

        while len(self._items) > 1 and over():
            self._items.popitem(last=False)

    def forget(self, lm: LoadedModel) -> None:
        """Drop every context of ``lm`` (its model is being unloaded)."""
        with self._lock:
            for key in [k for k, ctx in self._items.items() if ctx.lm is lm]:
                del self._items[key]


CONTEXTS = ContextStore()
on_unload(CONTEXTS.forget)  # an unloaded model's contexts go with it
