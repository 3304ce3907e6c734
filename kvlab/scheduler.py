"""The compute slot: one holder at a time, shared fairly between the requests that wait for it.

:class:`Slot` is shared round robin between requesters (whoever was served least recently goes
first), background work (warming the result store) goes only when no visitor waits, a
requester's newer request of a kind supersedes their older one still waiting, and a waiting
request hears its place in line and an estimate of its wait (``Scope.on_wait``). A waiting
request is bounded like any other (:mod:`kvlab.cancellation`): stopped, it leaves the line.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Hashable, Iterator

from kvlab.cancellation import SUPERSEDED, VISITOR, Cancelled, Scope, current, wait

#: Weight of the newest hold in the slot's running estimate of one hold's cost.
COST_WEIGHT = 0.3


@contextmanager
def may_leave(slot: Slot) -> Iterator[None]:
    """Inside, holding ``slot``, the current request may give it up early (:func:`leave_slot`).

    For single runs only: a long job hands the slot over between its units
    (:func:`between_units`) and must hold it when it does.
    """
    s = current()
    if s is None:
        yield
        return
    s.leave = slot.release
    try:
        yield
    finally:
        s.leave = lambda: None


class Busy(Exception):
    """Too many requests wait for the compute slot already; the message is shown as is."""


@dataclass(eq=False)
class Ticket:
    """One request waiting for the slot: who asked, what kind of request, its priority, when."""

    owner: Hashable | None
    kind: str | None
    priority: int
    started: float  # when its request started (the newer of two requests supersedes the older)
    arrived: float = field(default_factory=time.monotonic)
    superseded: bool = False


class Slot:
    """The compute slot: one holder at a time, granted fairly (thread-safe).

    Grant order: visitors before background work; among them, the owner
    served least recently first (an owner never served goes before every
    owner served, so a newcomer never waits behind someone's burst), then
    arrival. Round robin rather than shortest-expected-first: a request's cost
    is not known before it runs (a stored cache, a reused prefill or a new
    fit differ a hundredfold), while round robin bounds each owner's wait by
    the number of other owners waiting, whatever they asked for.

    :meth:`hold` holds it for a block of work; :meth:`handover` (for
    ``Scope.handover``) gives it to whoever waits and queues again, so long
    jobs and single runs interleave unit by unit. A waiter checks its scope
    (:func:`wait`), so a stopped request leaves the line; a waiter whose owner
    asks again with a newer request of the same kind leaves it too (Cancelled,
    SUPERSEDED). max_waiting: more visitors than this waiting are refused (Busy).
    """

    def __init__(self, max_waiting: int | None = None) -> None:
        self._cond = threading.Condition()
        self._waiting: list[Ticket] = []  # arrival order
        self._holder: int | None = None  # the holding thread's ident
        self._held_since = 0.0
        #: When each owner was last granted the slot, oldest first (bounded: see _grant).
        self._served: OrderedDict[Hashable, float] = OrderedDict()
        self.max_waiting = max_waiting
        #: Running estimate of one hold's seconds (None before the first release).
        self.cost_s: float | None = None
        #: Grants so far (tests and benchmarks read it).
        self.grants = 0

    @property
    def waiting(self) -> int:
        """Requests queued for the slot now."""
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether a request holds the slot or waits for it (False: nothing is computing through it)."""
        with self._cond:
            return self._holder is not None or bool(self._waiting)

    @staticmethod
    def _who(ticket: Ticket) -> Hashable:
        return ticket if ticket.owner is None else ticket.owner

    def _rank(self, ticket: Ticket) -> tuple:
        """Grant order between owners: priority, then the owner served least recently, then arrival."""
        return ticket.priority, self._served.get(self._who(ticket), float("-inf")), ticket.arrived

    def _next(self) -> Ticket | None:
        """The waiting ticket granted next (under the lock)."""
        firsts: dict[Hashable, Ticket] = {}
        for t in self._waiting:  # arrival order: each owner's first ticket
            firsts.setdefault(self._who(t), t)
        return min(firsts.values(), key=self._rank, default=None)

    def _ahead(self, ticket: Ticket) -> int:
        """Waiting tickets granted before ``ticket`` if nobody else arrives (under the lock).

        Round robin within a priority: if ``ticket`` is its owner's k-th (from 0), every other
        owner of that priority gets k turns first, one more when it ranks before ``ticket``'s
        owner; every ticket of a higher priority goes first.
        """
        mine = self._who(ticket)
        queues: dict[Hashable, list[Ticket]] = {}
        for t in self._waiting:
            queues.setdefault(self._who(t), []).append(t)
        k = queues[mine].index(ticket)
        head = self._rank(queues[mine][0])
        ahead = k
        for who, queue in queues.items():
            if who == mine:
                continue
            first = queue[0]
            if first.priority < ticket.priority:
                ahead += len(queue)
            elif first.priority == ticket.priority:
                ahead += min(len(queue), k + (self._rank(first) < head))
        return ahead

    def _estimate(self, ahead: int) -> float | None:
        """Seconds until a ticket with ``ahead`` requests before it in line gets the slot (under the lock)."""
        if self.cost_s is None:
            return None
        left = max(0.0, self.cost_s - (time.monotonic() - self._held_since)) if self._holder is not None else 0.0
        return left + ahead * self.cost_s

    def acquire(self) -> float:
        """Wait for the slot (checking the current scope); returns the seconds waited.

        Raises Busy when ``max_waiting`` visitors wait already, Cancelled (SUPERSEDED) when a
        newer request of the same owner and kind arrives while this one waits.
        """
        s = current()
        ticket = Ticket(
            s.owner if s else None,
            s.kind if s else None,
            s.priority if s else VISITOR,
            s.start if s else time.monotonic(),
        )
        start = time.monotonic()
        with self._cond:
            visitors = sum(t.priority == VISITOR for t in self._waiting)
            if ticket.priority == VISITOR and self.max_waiting is not None and visitors >= self.max_waiting:
                raise Busy(
                    f"The lab is busy: {visitors} requests are waiting for its compute slot. Try again "
                    "in a minute; a configuration someone has run already is answered at once."
                )
            if ticket.owner is not None and ticket.kind is not None:
                for older in self._waiting:
                    if (older.owner, older.kind) == (ticket.owner, ticket.kind) and older.started < ticket.started:
                        older.superseded = True
            self._waiting.append(ticket)
            self._cond.notify_all()
        try:
            wait(lambda timeout: self._take(ticket, timeout, s))
        except BaseException:
            with self._cond:
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                self._cond.notify_all()
            raise
        return time.monotonic() - start  # not the request's work: wait() counted it as waiting

    def _take(self, ticket: Ticket, timeout: float, s: Scope | None) -> bool:
        def ready() -> bool:
            return ticket.superseded or (self._holder is None and self._next() is ticket)

        with self._cond:
            self._cond.wait_for(ready, timeout)
            if ticket.superseded:
                raise Cancelled(SUPERSEDED, s or Scope())
            if ready():
                self._grant(ticket)
                return True
            if s is None or s.on_wait is None:
                return False
            queued = self._ahead(ticket)
            ahead, estimate = queued + (self._holder is not None), self._estimate(queued)
        s.on_wait(ahead, estimate)
        return False

    def _grant(self, ticket: Ticket) -> None:
        """Give the slot to ``ticket`` (under the lock)."""
        self._waiting.remove(ticket)
        self._holder = threading.get_ident()
        self._held_since = time.monotonic()
        who = self._who(ticket)
        self._served.pop(who, None)
        self._served[who] = self._held_since
        while len(self._served) > 4096:  # owners long gone: forget the oldest
            self._served.popitem(last=False)
        self.grants += 1

    def release(self) -> None:
        """Free the slot if this thread holds it (after a stopped handover it does not)."""
        with self._cond:
            if self._holder == threading.get_ident():
                held = time.monotonic() - self._held_since
                self.cost_s = held if self.cost_s is None else (1 - COST_WEIGHT) * self.cost_s + COST_WEIGHT * held
                self._holder = None
                self._cond.notify_all()

    def handover(self) -> None:
        """Let whoever waits go first, then queue again behind them (nothing happens when nobody waits).

        A request that left the slot (its answer decoding beside the others', :func:`may_leave`) takes
        it back here, so its next unit of work computes holding it again."""
        with self._cond:
            if not self._waiting and self._holder == threading.get_ident():
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
