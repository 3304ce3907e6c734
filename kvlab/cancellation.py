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
other failure of the computation that raised it (kvlab.memo.compute_once
resolves its future and keeps nothing); a request waiting on another's
computation that is cancelled computes it itself (see compute_once).

The compute slot these scopes wait for is :mod:`kvlab.scheduler`'s.
"""

from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator

#: Why a request stopped (Cancelled.reason); the last two stop a document's preparation in the background
#: (kvlab.lab.background): past its own bound, or once no page has waited for it for a while.
TIME, STOPPED, GONE, SUPERSEDED = "time", "stopped", "gone", "superseded"
PREPARE_TIME, UNWATCHED = "prepare_time", "unwatched"

_WHY = {
    TIME: "it ran past this server's time limit of {limit:g} s per request (KVLAB_MAX_REQUEST_S)",
    PREPARE_TIME: "it ran past this server's time limit of {limit:g} s for preparing a document (KVLAB_MAX_PREPARE_S)",
    UNWATCHED: "no page waited for it any more (each page that asked was closed or stopped)",
    STOPPED: "Stop was pressed",
    GONE: "its page or client disconnected",
    SUPERSEDED: "a newer request of the same kind from the same page replaced it while it waited",
}
#: A request's priority for the slot: visitors first; background work only when no visitor waits.
VISITOR, BACKGROUND = 0, 1
#: Seconds between two looks at the stop flag while waiting (for the slot, or another request's computation).
#: Every look wakes a thread that needs the interpreter's lock: with a class's worth of requests waiting,
#: looks every 0.1 s made answers served from the result store beside a computation five times slower
#: (p95 7.4 s against 1.5 s, benchmarks.workshop). A waiting request stopped is gone within this.
POLL_S = 0.5


@dataclass
class Scope:
    """One request's bounds.

    limit_s: seconds of work allowed (None: no limit); time spent waiting for
    the compute slot does not count. stopped(): a reason (STOPPED, GONE) once
    the requester is gone, else None. handover(): called between units (gives
    the slot away and takes it back; kvlab.scheduler.Slot.acquire pauses the scope's clock).
    last: the last progress step reported (what the stop message names);
    steps: checkpoints passed; units: units finished.
    owner: who asked (a page's session; None: nobody the slot tells apart), kind: the
    request's kind (a newer one of the same owner and kind supersedes this one while it
    waits for the slot), priority: VISITOR or BACKGROUND, on_wait(ahead, estimate_s): told
    while it waits for the slot how many requests go first and about how long that takes
    (None: no estimate yet). leave(): gives up the slot this request holds for good, when
    its holder allows it (:func:`kvlab.scheduler.may_leave`); :func:`leave_slot` calls it.
    over_time: the reason given once ``limit_s`` has passed (TIME, or PREPARE_TIME for a preparation);
    progress(fraction, step): where :func:`report` sends the steps of work deep inside (a reference
    pass's chunks) that no caller passes a progress sink to (None: nowhere; set by :func:`reporting`).
    """

    limit_s: float | None = None
    stopped: Callable[[], str | None] = lambda: None
    handover: Callable[[], None] = lambda: None
    owner: Hashable | None = None
    kind: str | None = None
    priority: int = VISITOR
    on_wait: Callable[[int, float | None], None] | None = None
    leave: Callable[[], None] = lambda: None
    over_time: str = TIME
    progress: Callable[[float, str], None] | None = None
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
            return self.over_time
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
    **who: object,
) -> Iterator[Scope]:
    """Bound the work done inside (in this thread and context) by ``limit_s`` and ``stopped``.

    who: the Scope's ``owner``, ``kind``, ``priority`` and ``on_wait`` (what the compute slot reads).
    """
    s = Scope(limit_s, stopped, handover, **who)  # type: ignore[arg-type]
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


def leave_slot() -> None:
    """The request's exclusive part is over: the compute slot goes to the next request now, and
    the rest of this one (its decode steps, batched with others', kvlab.runtime.batching) runs
    beside it. A no-op outside a scope, or where the slot's holder did not allow it
    (:func:`kvlab.scheduler.may_leave`)."""
    s = _SCOPE.get()
    if s is not None:
        leave, s.leave = s.leave, lambda: None
        leave()


def checked(progress: Callable[[float, str], None]) -> Callable[[float, str], None]:
    """A progress sink that is a checkpoint too (each report names the step reached)."""

    def report(fraction: float, desc: str) -> None:
        progress(fraction, desc)  # shown first: the step reached is what a stop there names
        checkpoint(desc)

    return report


def report(fraction: float, step: str) -> None:
    """A step of work deep inside a computation (a chunk of a reference pass): a checkpoint, and told to
    the scope's progress sink where one is set (:func:`reporting`); ``fraction`` is of that computation."""
    s = _SCOPE.get()
    if s is not None and s.progress is not None:
        s.progress(fraction, step)
    checkpoint(step)


@contextmanager
def reporting(progress: Callable[[float, str], None]) -> Iterator[None]:
    """Send the :func:`report` calls made inside to ``progress`` (within the current scope; a no-op outside one)."""
    s = _SCOPE.get()
    if s is None:
        yield
        return
    before, s.progress = s.progress, progress
    try:
        yield
    finally:
        s.progress = before


def wait(done: Callable[[float], bool]) -> None:
    """Call ``done(POLL_S)`` until it returns True, with a checkpoint before each call.

    ``done(timeout)`` waits at most ``timeout`` seconds for something (a lock,
    a future) and says whether it came; so a request that is stopped while it
    waits stops within POLL_S. The time spent in ``done`` is waiting, not work:
    it is added to the scope's ``waited_s`` as it passes, so a long wait never
    runs into the request's time limit.
    """
    s = _SCOPE.get()
    while True:
        checkpoint()
        start = time.monotonic()
        came = done(POLL_S)
        if s is not None:
            s.waited_s += time.monotonic() - start
        if came:
            return
