"""What every tab shares: user-facing errors, the compute slot and each request's bounds, the ZeroGPU wrapper,
page styling.

The compute slot: every heavy event (``/run``, ``/compare``, ``/tasks``,
``/needle_test``, ``/generate``) runs its work through :func:`guarded`,
which holds :data:`COMPUTE` (one computation at a time, shared fairly between
pages: kvlab.scheduler.Slot) inside a kvlab.cancellation scope: the work stops at its
next progress step once it has computed for ``KVLAB_MAX_REQUEST_S``, once Stop
is pressed (the tabs' Stop buttons cancel the event) or once its page or
client disconnects (:func:`requester_gone`); a page's newer request of the
same kind replaces its older one still waiting. A long job (a sweep, a task
set, Generate's methods) hands the slot over between its units, so others'
single runs interleave with it. Gradio admits up to :data:`COMPUTE_ADMITTED`
heavy events at once (they wait for the slot, where each page hears its place
in line, not in Gradio's queue). Explore's run goes through :func:`served`
instead: a configuration already computed is answered from the result store
(kvlab.results) without the slot, and identical runs in flight share one
computation.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import gradio as gr
from gradio import utils as gradio_utils

from kvlab import cancellation, limits, results, scheduler
from kvlab.documents import DocumentError, read_document
from kvlab.examples import Example
from kvlab.lab import InputError, PreparationStatus, Prepared, RunSpec, ensure_prepared
from kvlab.methods import MethodError
from kvlab.runtime.model import ModelLoadError
from kvlab.ui.knobs import KnobPanel

try:  # ZeroGPU (Hugging Face Spaces): optional, never required
    import spaces  # type: ignore[import-not-found]
except ImportError:
    spaces = None

log = logging.getLogger("kvlab.app")

#: Formulas in the Learn tab: $$...$$ on their own line, $...$ inline.
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "$", "right": "$", "display": False}]
CSS = """
.kvlab-chip { padding: 1px 8px; margin-right: 4px; border: 1px solid #e5e7eb; border-radius: 6px; }
#kvlab-summary table { font-size: 0.92em; }
.kvlab-answer textarea { font-size: 1.02em; }
.kvlab-mark { font-weight: 700; padding: 0 6px; border-radius: 4px; color: #fff; }
.kvlab-mark-right { background: #15803d; }
.kvlab-mark-wrong { background: #b91c1c; }
"""
# ZeroGPU time slots (seconds): one Explore run, and a sweep (per point, capped).
#: The compression ratio's slider on every tab that has one (Explore, Your pick): bounds and first value.
RATIO_MIN, RATIO_MAX, RATIO_DEFAULT = 2, 100, 10
GPU_RUN_S = limits.LIMITS.gpu_run_s
GPU_SWEEP_BASE_S, GPU_SWEEP_POINT_S = 60, 15
GPU_MAX_S = limits.LIMITS.gpu_max_s

USER_ERRORS = (DocumentError, MethodError, ModelLoadError, InputError, cancellation.Cancelled, scheduler.Busy)
#: Heavy events Gradio starts at once (its concurrency limit of "compute"); they wait for COMPUTE.
COMPUTE_ADMITTED = limits.LIMITS.compute_admitted
#: The one compute slot of this server; more than KVLAB_QUEUE_SIZE visitors waiting are told it is busy.
COMPUTE = scheduler.Slot(max_waiting=limits.LIMITS.queue_size)
#: Seconds between two updates of a waiting page's place in line (unless the place changes).
WAIT_REPORT_S = 1.0


@dataclass
class DocumentInputs:
    """The Explore tab's inputs that the other tabs read too, and what the page's links set
    (kvlab.lab.links): the example menu, its suggested questions, the method and ratio, and
    ``prepare``, the keyword arguments of the event that prepares the document shown."""

    text: gr.Textbox
    upload: gr.File
    question: gr.Textbox
    max_new: gr.Slider
    model: gr.Dropdown
    example: gr.Dropdown
    suggested: gr.Dropdown
    method: gr.Dropdown
    ratio: gr.Slider
    prepare: dict
    knobs: KnobPanel  # the method's description, preset menu, knob slots and the knobs' values (kvlab.ui.knobs)


@dataclass
class PickInputs:
    """The Your pick tab and the widgets a link sets."""

    tab: gr.Tab
    example: gr.Dropdown
    text: gr.Textbox
    suggested: gr.Dropdown
    question: gr.Textbox
    ratio: gr.Slider


@dataclass
class CompareInputs:
    """The Compare tab's widgets that a link sets."""

    methods: gr.CheckboxGroup
    ratios: gr.CheckboxGroup
    more_ratios: gr.Textbox
    models: gr.CheckboxGroup


@dataclass
class GenerateInputs:
    """The Generate tab's widgets that a link sets."""

    source: gr.Radio
    methods: gr.CheckboxGroup
    budget: gr.Number


def checked_model(spec: str | None, specs: list[str]) -> str:
    """The model spec to use; refuses one not offered, before any heavy work (the run loads it)."""
    spec = (spec or "").strip() or specs[0]
    if spec not in specs:
        raise InputError(f"the model {spec!r} is not offered here; choose one of: {', '.join(specs)}")
    return spec


def example_model(ex: Example | None, specs: list[str]) -> str | None:
    """The model an example is read by (kvlab.examples.Example.model) when this page offers it; None: the
    page's model stays."""
    return ex.model if ex is not None and ex.model in specs else None


def upload_folder() -> Path:
    """Where Gradio keeps uploaded files (``GRADIO_TEMP_DIR``, else <tmp>/gradio), resolved."""
    return Path(gradio_utils.get_upload_folder()).resolve()


def read_upload(path: str) -> str:
    """The document in an uploaded file, read only from Gradio's upload folder and deleted after reading.

    Raises InputError for any other path (symbolic links are followed first,
    so one cannot point outside), DocumentError for an unreadable document.
    """
    real = Path(path).resolve()
    if not real.is_relative_to(upload_folder()):
        raise InputError("That file was not uploaded here: only files uploaded through the page are read.")
    try:
        return read_document(real)
    finally:
        real.unlink(missing_ok=True)


def document_input(text: str | None, file: str | dict | None) -> str | None:
    """What the lab reads as the document: the text box when it holds text, else the upload's text
    (:func:`read_upload`); None when there is neither (the lab says so). The lab never sees a path.

    file: the upload's path, or its FileData as an event sends it unprocessed (``preprocess=False``:
    Gradio has already checked that it lies in its upload folder).
    """
    if isinstance(file, dict):
        file = file.get("path")
    if (text and text.strip()) or not file:
        return text
    return read_upload(file)


def on_gpu(duration: int | Callable[..., int]) -> Callable[[Callable], Callable]:
    """``spaces.GPU(duration=...)`` where the ``spaces`` package is importable (a ZeroGPU Space), else nothing."""

    def wrap(fn: Callable) -> Callable:
        if spaces is None:
            return fn
        return spaces.GPU(duration=duration)(fn)

    return wrap


def as_gr_error(exc: Exception) -> gr.Error:
    """A user's error (bad document, method, model or input) as a titled message."""
    title = {
        ModelLoadError: "Model not available",
        MethodError: "Method problem",
        InputError: "Missing input",
        cancellation.Cancelled: "Stopped",
        scheduler.Busy: "Busy",
    }.get(type(exc), "Document problem" if isinstance(exc, DocumentError) else "Error")
    return gr.Error(str(exc), title=title, print_exception=False)


T = TypeVar("T")


#: Seconds an event must stay not alive before its work stops as GONE: a client's Stop closes its
#: stream as well as taking the event off the running jobs, in either order; within this the Stop is
#: seen, and the stop is reported as what it was.
GONE_GRACE_S = 1.0
_not_alive_since: OrderedDict[str, float] = OrderedDict()


def requester_gone() -> str | None:
    """Why the Gradio event running in this thread must stop (cancellation.STOPPED, cancellation.GONE), or None.

    Gradio runs a handler in a worker thread that it cannot interrupt: Stop
    (``cancels=``, or a client's ``/cancel``) only takes the event off the
    queue's running jobs, and a closed page or client only marks it not
    alive (for GONE_GRACE_S first: see there). The work reads both here at
    each step. None outside an event.
    """
    from gradio.context import LocalContext

    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
    queue = getattr(blocks, "_queue", None)
    if queue is None or event_id is None:
        return None
    for job in list(queue.active_jobs):
        for event in job or []:
            if event._id == event_id:
                if event.alive:
                    return None
                now = time.monotonic()
                first = _not_alive_since.setdefault(event_id, now)
                while len(_not_alive_since) > 1024:  # events that ended within their grace: forget the oldest
                    _not_alive_since.popitem(last=False)
                return cancellation.GONE if now - first >= GONE_GRACE_S else None
    _not_alive_since.pop(event_id, None)
    return cancellation.STOPPED


def session_of(request: gr.Request | None) -> str | None:
    """The page a request comes from (its Gradio session), the owner the compute slot tells apart."""
    return getattr(request, "session_hash", None) if request is not None else None


def wait_report(progress: Callable[..., Any] | None) -> Callable[[int, float | None], None] | None:
    """A Scope.on_wait that shows a waiting page its place in line on its progress bar.

    Sent when the place changes, else at most every WAIT_REPORT_S: each
    update is an event the browser draws.
    """
    if progress is None:
        return None
    last: list = [None, 0.0]

    def report(ahead: int, estimate_s: float | None) -> None:
        now = time.monotonic()
        if ahead == last[0] and now - last[1] < WAIT_REPORT_S:
            return
        last[:] = [ahead, now]
        about = "" if estimate_s is None else f", about {estimate_s:.0f} s"
        progress(
            0.0,
            desc=f"Waiting for the compute slot: {ahead} request(s) before this one{about}. "
            "A configuration someone has run already is answered at once.",
        )

    return report


@contextmanager
def bounded(
    slot: scheduler.Slot | None = COMPUTE,
    owner: str | None = None,
    kind: str | None = None,
    progress: Callable[..., Any] | None = None,
) -> Iterator[cancellation.Scope]:
    """A request's bounds (``KVLAB_MAX_REQUEST_S``, Stop, a disconnect), holding ``slot`` inside (None: no slot).

    owner, kind: the page and the kind of request (what the slot shares fairly, and what a newer
    request replaces); progress: where the page hears its place in line while it waits.
    """
    handover = slot.handover if slot is not None else (lambda: None)
    with cancellation.scope(
        limits.LIMITS.request_s, requester_gone, handover, owner=owner, kind=kind, on_wait=wait_report(progress)
    ) as scope:
        if slot is None:
            yield scope
            return
        with slot.hold():
            yield scope


@contextmanager
def user_facing(what: str) -> Iterator[None]:
    """Any failure inside turned into a message for the user: a user's error or a stop as it is
    (:func:`as_gr_error`), anything else logged with an id (:func:`unexpected`); the server stays up."""
    try:
        yield
    except cancellation.Cancelled as exc:
        log.info("a run with %s stopped: %s", what, exc)
        raise as_gr_error(exc) from exc
    except USER_ERRORS as exc:
        raise as_gr_error(exc) from exc
    except gr.Error:
        raise
    except Exception as exc:  # noqa: BLE001 - say what failed; the server stays up
        raise unexpected(exc, what) from exc


def prepared_first(
    text: str | None,
    methods: list[tuple[str, dict[str, Any]]],
    model: str,
    question: str | None,
    max_new_tokens: int,
    progress: Callable[..., Any] | None,
    ratio: float | None = None,
) -> tuple[Prepared, ...]:
    """The document prepared for each (method, options) of ``methods`` and ``question`` answered from
    its full cache, by a background job (kvlab.lab.ensure_prepared), waited for with its progress and
    time left on the page and outside the compute slot: a long document's preparation is not bounded
    by one request's time limit. With ``ratio`` (a Run's), a method whose compression is long work (a
    trained cache, a summary, an on-policy fit) is compressed by the job too. On ZeroGPU nothing is done
    here (nothing computed outside a GPU slot survives it: the run prepares the document itself). Returns
    what each preparation did (none on ZeroGPU)."""
    if spaces is not None:
        return ()

    def show(status: PreparationStatus) -> None:
        if progress is not None:
            progress(status.fraction, desc=status.line())

    return tuple(
        ensure_prepared(text, method, options, model, question, max_new_tokens, on_status=show, ratio=ratio)
        for method, options in methods
    )


def guarded(
    what: str,
    work: Callable[[], T],
    owner: str | None = None,
    kind: str | None = None,
    progress: Callable[..., Any] | None = None,
    leave: bool = False,
    ready: Callable[[], object] | None = None,
) -> T:
    """``work()`` holding the compute slot within the request's bounds (:func:`bounded`), failures
    shown to the user (:func:`user_facing`). leave: a run of ``work`` leaves the slot once its answer
    decodes (batched with the others', as :func:`served`'s), and a later unit of ``work`` takes it back
    (kvlab.cancellation.between_units). ready: called first, within the same bounds but before the slot
    is taken (:func:`prepared_first`)."""
    with user_facing(what):
        if ready is not None:
            with bounded(slot=None, owner=owner, kind=kind, progress=progress):
                ready()
        with bounded(owner=owner, kind=kind, progress=progress) as scope:
            with scheduler.may_leave(COMPUTE) if leave else nullcontext(scope):
                return work()


def served(
    what: str,
    checked: Callable[[], RunSpec],
    work: Callable[[RunSpec], T],
    owner: str | None = None,
    kind: str | None = None,
    progress: Callable[..., Any] | None = None,
    ready: Callable[[RunSpec], object] | None = None,
) -> tuple[T, results.Served, results.RunKey]:
    """(``work(spec)``'s value, how it was served, the run's store key) through the result store
    (kvlab.results), ``spec = checked()``.

    ``checked()`` checks the inputs into a run spec (kvlab.lab.RunSpec), whose key names the
    configuration; a stored one is answered at once, without the compute slot; one being computed for
    another page is waited for and shared; else ``work(spec)`` runs holding the slot (fairly, its place
    in line shown) and its value is stored; ``ready(spec)`` first, before the slot is taken (the document's
    preparation, :func:`prepared_first`). Within the request's bounds, failures shown to the user as in
    :func:`guarded`.
    """

    def shared() -> None:
        if progress is not None:
            progress(0.0, desc="The same configuration is being computed for another page: this one gets that result.")

    with user_facing(what), bounded(slot=None, owner=owner, kind=kind, progress=progress):
        spec = checked()
        key = spec.key()

        def compute() -> T:
            if ready is not None:
                ready(spec)
            # A run leaves the slot once its answer decodes step by step (batched with the other runs
            # decoding then): the next page's compression starts meanwhile.
            with COMPUTE.hold(), scheduler.may_leave(COMPUTE):
                return work(spec)

        value, how = results.store().serve(key, compute, on_share=shared)
        return value, how, key


def error_id() -> str:
    """A short random id that ties what a user is told to the server's log entry."""
    return secrets.token_hex(4)


def unexpected(exc: Exception, what: str) -> gr.Error:
    """An unexpected failure: logged with its traceback under a fresh id; the user is told what failed and the id.

    The exception's own message stays in the log: it may name server paths or internals.
    """
    ident = error_id()
    log.error("error %s: the run with %s failed", ident, what, exc_info=exc)
    return gr.Error(
        f"The run with {what} failed ({type(exc).__name__}, error id {ident}; the server's log has the "
        "details). Try other knobs or another method.",
        title="Run failed",
        print_exception=False,
    )
