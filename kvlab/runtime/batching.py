"""The passes of concurrent answers run as one batched pass (continuous batching, as serving engines do).

A decode step of a small model on a CPU costs what reading its weights costs
(SmolLM2-135M: about 0.5 GB of float32 per token, some 60 ms on two cores),
whatever the few hundred keys of a compressed cache add. Several requests
answering at once (a workshop's participants, each with their own method and
ratio) can share that read: :class:`StepBatcher` gathers the passes that
sessions submit from their own threads (a token, or a prompt and a draft) and
runs them as one :func:`kvlab.runtime.lean.lean_forward_many` pass, each
sequence attending to its own cache. A lone session's pass runs at once, so
the library and the CLI decode as before.

Batching changes which kernels compute a row (a matrix product instead of a
matrix-vector one), so logits may differ in the last bits from a lone step's:
the same near-tie caveat as checking a draft in one pass
(kvlab.runtime.decode.greedy_from_draft); the tests compare the two.
"""

from __future__ import annotations

import copy
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from kvlab.runtime.lean import LeanItem, LeanModel, lean_forward_many

#: Most sequences in one batched pass (each adds its own attention call per layer).
MAX_BATCH = 16
#: Longest a step waits for the other joined sessions' steps before its batch runs without them (s).
GATHER_S = 0.003


@dataclass(eq=False)
class _Step:
    """One submitted step: its inputs, then its logits [keep, V] or the error its pass raised.

    done: set when the logits (or the error) are in, or when this step's thread is to lead the
    next batch (``lead``).
    """

    item: LeanItem
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class StepBatcher:
    """Passes of the sessions that joined, run together (thread-safe).

    A session decodes inside :meth:`joined` and calls :meth:`step` for each
    pass (a token; a prompt and a draft). One thread at a time leads: it
    waits until every joined session has a step in (or ``gather_s`` has
    passed), runs them as one pass, hands each its logits, and makes the
    first step submitted meanwhile the next leader. The others sleep on their
    own step's event, so a pass is not slowed by threads waking to look
    (each needs the interpreter's lock). Statistics for tests and benchmarks:
    ``passes`` and ``rows`` (sequences) so far, ``widest`` the largest batch.
    """

    def __init__(self, lean: LeanModel, max_batch: int = MAX_BATCH, gather_s: float = GATHER_S) -> None:
        self.lean, self.max_batch, self.gather_s = lean, max_batch, gather_s
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # the leader waits here for the joined sessions' steps
        self._joined = 0
        self._pending: list[_Step] = []
        self._leader: _Step | None = None
        self.passes = self.rows = self.widest = 0

    def __deepcopy__(self, memo: dict) -> StepBatcher:
        """A copied model's batcher (``copy.deepcopy`` of a model that has answered): a new one over the copied
        lean model, with its own lock and nobody joined; locks and waiting sessions are not state to copy."""
        return StepBatcher(copy.deepcopy(self.lean, memo), self.max_batch, self.gather_s)

    @contextmanager
    def joined(self) -> Iterator[None]:
        """Decode inside: the passes of the sessions inside are batched together."""
        with self._lock:
            self._joined += 1
        try:
            yield
        finally:
            with self._lock:
                self._joined -= 1
                self._arrived.notify()  # the leader may be waiting for this session's step

    def step(self, item: LeanItem) -> torch.Tensor:
        """Run ``item`` (one sequence's tokens, appending to its cache) in the next batch; its logits [keep, V]."""
        step = _Step(item)
        with self._lock:
            self._pending.append(step)
            if self._leader is None:
                self._leader, step.lead = step, True
            else:
                self._arrived.notify()
        if not step.lead:
            step.done.wait()
        if step.lead:
            self._lead()
        if step.error is not None:
            raise step.error
        return step.logits

    def _lead(self) -> None:
        """Gather, run one batch (the leader's own step first in it), hand the lead on."""
        with self._lock:
            deadline = time.monotonic() + self.gather_s
            while len(self._pending) < self._joined and time.monotonic() < deadline:
                self._arrived.wait(deadline - time.monotonic())
            batch = self._pending[: self.max_batch]
            del self._pending[: len(batch)]
        try:
            with torch.inference_mode():
                logits = lean_forward_many(self.lean, [s.item for s in batch])
            for s, out in zip(batch, logits):
                s.logits = out
        except BaseException as exc:  # noqa: BLE001 - every step of the pass hears it, in its own thread
            for s in batch:
                s.error = exc
        finally:
            with self._lock:
                self.passes, self.rows = self.passes + 1, self.rows + len(batch)
                self.widest = max(self.widest, len(batch))
                following = self._pending[0] if self._pending else None
                self._leader = following
                if following is not None:
                    following.lead = True
            for s in batch:
                s.lead = False
                s.done.set()
            if following is not None:
                following.done.set()


_LOCK = threading.Lock()


def batcher(lean: LeanModel) -> StepBatcher:
    """The one batcher of a lean model (kept on it: every session of that model shares it)."""
    with _LOCK:
        found = getattr(lean, "_kvlab_batcher", None)
        if found is None:
            found = lean._kvlab_batcher = StepBatcher(lean)
        return found
