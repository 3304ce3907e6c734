"""Bounded requests: a time limit and a stop flag per request, checked at every progress step.

A front end opens a :func:`scope` around one request's work. The work calls
:func:`checkpoint` at each step of progress (a decode step, a prefill chunk,
a solver layer) and :func:`between_units` between the units of a long job
(a sweep's runs, a task set's answers). Either raises :class:`Cancelled`
once the scope's time limit has passed or its requester is gone (``stopped``
names why: the user pressed Stop, the page was closed); between units the
scope may also hand the compute slot to someone else (``handover``). Outside
any scope both are no-ops, so the library, the CLI and the tests run as before.

Cancelled is raised only at those points, so shared caches see it like any
other failure of the computation that raised it (kvlab.context.compute_once
resolves its future and keeps nothing); a request waiting on another's
computation that is cancelled computes it itself (see compute_once).

:class:`Slot` is the compute slot: one holder at a time, handed over in
arrival order, so a single run waits at most one unit of someone's sweep.
"""
from __future__ import annotations

import contextvars
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

#: Why a request stopped (Cancelled.reason).
TIME, STOPPED, GONE = "time", "stopped", "gone"

_WHY = {
    TIME: "it ran past this server's time limit of {limit:g} s per request (KVLAB_MAX_REQUEST_S)",
    STOPPED: "Stop was pressed",
    GONE: "its page or client disconnected",
}
#: Seconds between two looks at the stop flag while waiting (for the slot, or another request's computation).
POLL_S = 0.1


@dataclass
class Scope:
    """One request's bounds.

    limit_s: seconds of work allowed (None: no limit); time spent waiting for
    the compute slot does not count. stopped(): a reason (STOPPED, GONE) once
    the requester is gone, else None. handover(): called between units (gives
    the slot away and takes it back; Slot.acquire pauses the scope's clock).
    last: the last progress step reported (what the stop message names);
    steps: checkpoints passed; units: units finished.
    """

    limit_s: float | None = None
    stopped: Callable[[], str | None] = lambda: None
    handover: Callable[[], None] = lambda: None
    start: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    last: str = ""
    steps: int = 0
    units: int = 0

    @property
    def elapsed_s(self) -> float:
        """Seconds of work so far (waits for the slot excluded)."""
        return time.monotonic() - self.start - self.waited_s

    def reason(self) -> str | None:
        """Why the work must stop now (TIME, STOPPED, GONE), or None."""
        why = self.stopped()
        if why is not None:
            return why
        if self.limit_s is not None and self.elapsed_s > self.limit_s:
            return TIME
        return None


class Cancelled(Exception):
    """A request stopped before its end; the message says why and how far it got (shown as is).

    reason: TIME, STOPPED or GONE; why: the reason in words; step: the last
    step reported before it stopped; elapsed_s: seconds of work done.
    Nothing it was computing is kept: every shared cache discards it like a failure.
    """

    def __init__(self, reason: str, scope: Scope):
        self.reason, self.step, self.elapsed_s = reason, scope.last, scope.elapsed_s
        self.why = _WHY[reason].format(limit=scope.limit_s or 0)
        where = f" during: {scope.last}" if scope.last else ""
        super().__init__(
            f"Stopped after {self.elapsed_s:.0f} s because {self.why}{where}. What this request was computing "
            "is not shown and was not kept; nothing else changed, so the same request can run again."
        )


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("kvlab_cancel_scope", default=None)


def current() -> Scope | None:
    """The scope of the request running in this context, or None."""
    return _SCOPE.get()


@contextmanager
def scope(
    limit_s: float | None = None,
    stopped: Callable[[], str | None] = lambda: None,
    handover: Callable[[], None] = lambda: None,
) -> Iterator[Scope]:
    """Bound the work done inside (in this thread and context) by ``limit_s`` and ``stopped``."""
    s = Scope(limit_s, stopped, handover)
    token = _SCOPE.set(s)
    try:
        yield s
    finally:
        _SCOPE.reset(token)


def checkpoint(step: str | None = None) -> None:
    """Raise Cancelled when the current request must stop; ``step`` names the work reached (progress text)."""
    s = _SCOPE.get()
    if s is None:
        return
    if step:
        s.last = step
    s.steps += 1
    why = s.reason()
    if why is not None:
        raise Cancelled(why, s)


def between_units(step: str | None = None) -> None:
    """A unit of a long job is done: check, let waiting requests take the slot, check again."""
    s = _SCOPE.get()
    if s is None:
        return
    checkpoint(step)
    s.units += 1
    s.handover()
    checkpoint()


def checked(progress: Callable[[float, str], None]) -> Callable[[float, str], None]:
    """A progress sink that is a checkpoint too (each report names the step reached)."""

    def report(fraction: float, desc: str) -> None:
        checkpoint(desc)
        progress(fraction, desc)

    return report


def wait(done: Callable[[float], bool]) -> None:
    """Call ``done(POLL_S)`` until it returns True, with a checkpoint before each call.

    ``done(timeout)`` waits at most ``timeout`` seconds for something (a lock,
    a future) and says whether it came; so a request that is stopped while it
    waits stops within POLL_S.
    """
    while True:
        checkpoint()
        if done(POLL_S):
            return


class Slot:
    """The compute slot: one holder at a time, granted in arrival order (FIFO, thread-safe).

    :meth:`hold` holds it for a block of work; :meth:`handover` (for
    ``Scope.handover``) gives it to whoever waits and queues again, so long
    jobs and single runs interleave unit by unit. A waiter checks its scope
    (:func:`wait`), so a stopped request leaves the queue.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._holder: int | None = None  # the holding thread's ident
        #: Grants so far (tests and benchmarks read it).
        self.grants = 0

    @property
    def waiting(self) -> int:
        """Requests queued for the slot now."""
        with self._cond:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        """Whether a request holds the slot or waits for it (False: nothing is computing through it)."""
        with self._cond:
            return self._holder is not None or bool(self._queue)

    def acquire(self) -> float:
        """Wait for the slot in arrival order (checking the current scope); returns the seconds waited."""
        ticket = object()
        start = time.monotonic()
        with self._cond:
            self._queue.append(ticket)
        try:
            wait(lambda timeout: self._take(ticket, timeout))
        except BaseException:
            with self._cond:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                self._cond.notify_all()
            raise
        waited = time.monotonic() - start
        s = _SCOPE.get()
        if s is not None:  # the time limit counts work, not waiting
            s.waited_s += waited
        return waited

    def _take(self, ticket: object, timeout: float) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._holder is None and self._queue[0] is ticket, timeout):
                return False
            self._queue.popleft()
            self._holder = threading.get_ident()
            self.grants += 1
            return True

    def release(self) -> None:
        """Free the slot if this thread holds it (after a stopped handover it does not)."""
        with self._cond:
            if self._holder == threading.get_ident():
                self._holder = None
                self._cond.notify_all()

    def handover(self) -> None:
        """Let whoever waits go first, then queue again behind them (nothing happens when nobody waits)."""
        with self._cond:
            if not self._queue:
                return
        self.release()
        self.acquire()

    @contextmanager
    def hold(self) -> Iterator[float]:
        """Hold the slot inside (yields the seconds waited for it); released on any exit."""
        waited = self.acquire()
        try:
            yield waited
        finally:
            self.release()
