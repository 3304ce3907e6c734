"""Preparing documents in the background: one job per (model, document), bounded on its own, with its progress
and the time left, stopped once no page waits for it.

A long document's preparation (the prefill, a method's reference pass, the full cache's answer, and a
run's compression where the method's is long work: kvlab.lab.prepare.prepare_document) can take longer
than one request of the app may compute (``KVLAB_MAX_REQUEST_S``): a 32,000-token document on Gemma 3
270M takes about 400 s on a 2-core CPU.
So the page's requests do not compute it themselves: :func:`ensure_prepared` hands it to a background job and
waits for it, its wait counting against no request's time limit (it is waiting, not work), while
``on_status`` hears the job's progress and time left. A second request for the same document (a
reload, another visitor, Run clicked while the page prepares) joins the job instead of starting
it again; what the job makes is kept where runs find it (kvlab.context_store.CONTEXTS, and the
result store for self-study text), so a page that comes back after the job finished finds it done.

A job computes within ``KVLAB_MAX_PREPARE_S`` of work, and stops at its next step once no page has
waited for it for :data:`GRACE_S` (a reload, or a file uploaded again, comes back well within it).
Jobs take turns: one document is prepared at a time (two prefills at once on a small machine
each take twice as long, and hold two documents' memory).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from concurrent import futures
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvlab import cancellation, limits
from kvlab.lab.inputs import document_text
from kvlab.lab.prepare import Prepared, prepare_document
from kvlab.methods import get_method
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS

log = logging.getLogger("kvlab.app")

#: Seconds a preparation goes on once no page waits for it: long enough for a reload, or the same
#: file uploaded again, to find it running.
GRACE_S = 60.0
#: The progress fraction from which the time left is estimated (before it, too little is done to tell).
ESTIMATE_FROM = 0.03
#: Seconds of reports the rate of progress is read from: the last minute's, once there is one.
RATE_WINDOW_S = 60.0
#: A move of the progress within this many seconds of the last report is work found done (a method prepared
#: by an earlier request, a question already answered: its share passes in an instant); the rate is read from
#: after it, else it would make the long step after it look fast.
INSTANT_S = 1.0


@dataclass
class Want:
    """What one request asks of a document's preparation: ``method``'s document-only work (with its
    ``options``), the full cache's answer to ``question`` (None: none) and, with ``ratio``, the compression
    at that ratio where the method's is long work (kvlab.compression.interface.Method.long_compression)."""

    method: str
    options: dict[str, Any]
    question: str | None
    max_new_tokens: int
    ratio: float | None = None


@dataclass(frozen=True)
class PreparationStatus:
    """A preparation as a waiting page sees it.

    fraction: of the current request's preparation (0-1); step: the step reached; elapsed_s: seconds
    since the job started (its wait for its turn included); left_s: seconds left, from the rate of
    progress so far (None: too early to tell); waiting: the job waits for another document's turn.
    """

    fraction: float
    step: str
    elapsed_s: float
    left_s: float | None
    waiting: bool = False

    def line(self) -> str:
        """One line for the page's progress bar."""
        if self.waiting:
            return "Waiting for another document's preparation to finish (one is prepared at a time)."
        left = "" if self.left_s is None else f", about {duration(self.left_s)} left"
        return f"Preparing the document in the background: {self.step} ({duration(self.elapsed_s)} so far{left})."


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``: a duration as a page shows it."""
    seconds = max(int(round(seconds)), 0)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


def time_left(fraction: float, elapsed_s: float, since: float = 0.0) -> float | None:
    """Seconds left at the rate measured: the work went from ``since`` to ``fraction`` (of the whole) in
    ``elapsed_s``; None below ESTIMATE_FROM, or with no progress measured."""
    if fraction < ESTIMATE_FROM or fraction <= since:
        return None
    return elapsed_s * (1.0 - min(fraction, 1.0)) / (fraction - since)


class Job:
    """One document's preparation for one model, in a thread of its own, serving its wants in order.

    Each want's future resolves with its kvlab.lab.prepare.Prepared, or the exception that ended it:
    a user's error ends that want only; a stop (kvlab.cancellation.Cancelled: past the bound, or
    nobody waiting) ends every want the job holds, and is kept as ``error`` (and logged). Once its last
    want is served the job closes (:meth:`add` refuses new wants) and ``on_end(job)`` is called.
    """

    def __init__(self, document: str, model: str | None, on_end: Callable[[Job], None], turn: threading.Lock):
        self.document, self.model, self._on_end, self._turn = document, model, on_end, turn
        self._lock = threading.Lock()
        self._wants: deque[tuple[Want, Future]] = deque()
        self._closed = False
        self._watchers, self._unwatched_since = 0, time.monotonic()
        self.started = time.monotonic()
        self._fraction, self._step, self._waiting = 0.0, "starting", True
        #: (time, fraction) of the current want's reports: its start (or the last instant move, INSTANT_S),
        #: then each change; the first is the newest at least RATE_WINDOW_S old (the rate's base).
        self._reports: deque[tuple[float, float]] = deque([(self.started, 0.0)])
        self.scope: cancellation.Scope | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvlab-prepare", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, want: Want) -> Future | None:
        """Queue ``want``; its future, or None when the job has closed (start another). A want equal to one
        not yet served shares its future: a reloaded page hears what the first page's preparation did."""
        with self._lock:
            if self._closed:
                return None
            same = next((f for w, f in self._wants if w == want), None)
            if same is not None:
                return same
            future: Future = Future()
            self._wants.append((want, future))
            return future

    @contextmanager
    def watch(self) -> Iterator[None]:
        """A page waits for this job inside (the job stops GRACE_S after the last one left)."""
        with self._lock:
            self._watchers += 1
        try:
            yield
        finally:
            with self._lock:
                self._watchers -= 1
                self._unwatched_since = time.monotonic()

    def nobody_waits(self) -> str | None:
        """cancellation.UNWATCHED once no page has waited for GRACE_S, else None (the job's scope's ``stopped``)."""
        with self._lock:
            alone = self._watchers == 0 and time.monotonic() - self._unwatched_since >= GRACE_S
        return cancellation.UNWATCHED if alone else None

    def status(self) -> PreparationStatus:
        with self._lock:
            now = time.monotonic()
            fraction, step, waiting = self._fraction, self._step, self._waiting
            # The rate as of the last report, counted down since: between two reports (a prefill chunk of
            # a long document takes seconds) the estimate falls instead of growing with the wait. Once it has
            # run out with the work going on, it was wrong: none is shown until the next report.
            (base_t, base_f), (last_t, last_f) = self._reports[0], self._reports[-1]
            left = None if waiting else time_left(last_f, last_t - base_t, base_f)
            if left is not None:
                left = left - (now - last_t) if left > now - last_t else None
            return PreparationStatus(fraction, step, now - self.started, left, waiting)

    def _progress(self, fraction: float, step: str) -> None:
        with self._lock:
            if fraction != self._fraction:
                now = time.monotonic()
                if now - self._reports[-1][0] < INSTANT_S:
                    self._reports = deque([(now, fraction)])
                else:
                    self._reports.append((now, fraction))
                while len(self._reports) > 2 and self._reports[1][0] <= now - RATE_WINDOW_S:
                    self._reports.popleft()
            self._fraction, self._step = fraction, step

    def _next(self) -> tuple[Want, Future] | None:
        with self._lock:
            if not self._wants:
                self._closed = True
                return None
            self._fraction = 0.0
            self._reports = deque([(time.monotonic(), 0.0)])
            return self._wants[0]

    def _serve(self, want: Want) -> Prepared:
        return prepare_document(
            self.document,
            None,
            want.method,
            want.options,
            self.model,
            self._progress,
            want.question,
            want.max_new_tokens,
            want.ratio,
        )

    def _fail_all(self, exc: BaseException) -> None:
        log.info("a document's preparation (%s) ended: %s", self.model or "the default model", exc)
        with self._lock:
            self.error = exc
            self._closed = True
            pending, self._wants = list(self._wants), deque()
        for _, future in pending:
            future.set_exception(exc)

    def _run(self) -> None:
        limit = limits.LIMITS.prepare_s
        try:
            with cancellation.scope(
                limit, self.nobody_waits, owner="preparation", kind="prepare", over_time=cancellation.PREPARE_TIME
            ) as scope:
                self.scope = scope
                cancellation.wait(lambda timeout: self._turn.acquire(timeout=timeout))  # not counted as work
                try:
                    with self._lock:
                        self._waiting = False
                    while (item := self._next()) is not None:
                        want, future = item
                        try:
                            value = self._serve(want)
                        except cancellation.Cancelled:
                            raise
                        except Exception as exc:  # noqa: BLE001 - this want's error (its page says it); the job goes on
                            with self._lock:
                                self._wants.popleft()
                            future.set_exception(exc)
                            continue
                        with self._lock:
                            self._wants.popleft()
                        future.set_result(value)
                finally:
                    self._turn.release()
        except BaseException as exc:  # noqa: BLE001 - a stop (or worse) ends every want; their pages say why
            self._fail_all(exc)
        finally:
            self._on_end(self)


class Preparations:
    """The documents being prepared, one job per (model, document); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], Job] = {}
        self._turn = threading.Lock()

    @staticmethod
    def key(document: str, model: str | None) -> tuple[str, str]:
        return model or "", hashlib.sha256(document.encode()).hexdigest()

    def submit(self, document: str, model: str | None, want: Want) -> tuple[Job, Future]:
        """The job preparing ``document`` for ``model`` (joined, else started) and ``want``'s future in it."""
        key = self.key(document, model)
        with self._lock:
            job = self._jobs.get(key)
            future = job.add(want) if job is not None else None
            if future is None:
                job = self._jobs[key] = Job(document, model, self._ended, self._turn)
                future = job.add(want)
                assert future is not None  # a job not started yet is open
                job.start()
        return job, future

    def running(self, document: str, model: str | None) -> Job | None:
        """The job preparing ``document`` for ``model`` now, or None."""
        with self._lock:
            return self._jobs.get(self.key(document, model))

    def _ended(self, job: Job) -> None:
        with self._lock:
            key = self.key(job.document, job.model)
            if self._jobs.get(key) is job:
                del self._jobs[key]


PREPARATIONS = Preparations()


def ensure_prepared(
    text: str | None,
    method: str,
    options: dict[str, Any] | None = None,
    model: str | None = None,
    question: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    on_status: Callable[[PreparationStatus], None] | None = None,
    ratio: float | None = None,
) -> Prepared:
    """``text`` prepared for ``method`` (and ``question`` answered from the full cache; with ``ratio``, a long
    compression made) by a background job, waited for: what kvlab.lab.prepare.prepare_document does,
    without the caller computing it.

    The document and the method are checked here first (their errors raised at once, as prepare_document's);
    the wait ends when the caller's request is stopped (kvlab.cancellation.wait) and is not counted as
    its work. ``on_status(status)`` hears the job's progress about every kvlab.cancellation.POLL_S.
    Raises what the job raised for this want (kvlab.cancellation.Cancelled when it was stopped).
    """
    document = document_text(text, None)
    get_method(method, **(options or {}))
    want = Want(method, dict(options or {}), question, max_new_tokens, ratio)
    job, future = PREPARATIONS.submit(document, model, want)

    def done(timeout: float) -> bool:
        if on_status is not None:
            on_status(job.status())
        return futures.wait([future], timeout).done

    with job.watch():
        cancellation.wait(done)  # counted as waiting, not as the caller's work
    return future.result()
