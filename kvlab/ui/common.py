"""What every tab shares: user-facing errors, the compute slot and each request's bounds, the ZeroGPU wrapper,
page styling.

The compute slot: every heavy event (``/run``, ``/compare``, ``/tasks``,
``/needle_test``, ``/generate``) runs its work through :func:`guarded`,
which holds :data:`COMPUTE` (one computation at a time, granted in arrival
order) inside a kvlab.cancel scope: the work stops at its next progress step
once it has computed for ``KVLAB_MAX_REQUEST_S``, once Stop is pressed (the
tabs' Stop buttons cancel the event) or once its page or client disconnects
(:func:`requester_gone`). A long job (a sweep, a task set, Generate's
methods) hands the slot over between its units, so others' single runs
interleave with it. Gradio admits up to :data:`COMPUTE_ADMITTED` heavy events
at once for that (they wait for the slot, not in Gradio's queue).
"""
from __future__ import annotations

import logging
import os
import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import gradio as gr
from gradio import utils as gradio_utils

from kvlab import cancel, limits
from kvlab.documents import DocumentError, read_document
from kvlab.lab import InputError
from kvlab.methods import MethodError
from kvlab.models import ModelLoadError

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
GPU_RUN_S = int(os.environ.get("KVLAB_GPU_DURATION", "120"))
GPU_SWEEP_BASE_S, GPU_SWEEP_POINT_S = 60, 15
GPU_MAX_S = int(os.environ.get("KVLAB_GPU_MAX_DURATION", "600"))

USER_ERRORS = (DocumentError, MethodError, ModelLoadError, InputError, cancel.Cancelled)
#: Heavy events Gradio starts at once (its concurrency limit of "compute"); they queue for COMPUTE in order.
COMPUTE_ADMITTED = int(os.environ.get("KVLAB_COMPUTE_ADMITTED", "8"))
#: The one compute slot of this server.
COMPUTE = cancel.Slot()


@dataclass
class DocumentInputs:
    """The Explore tab's inputs that the other tabs read too, and what the page's links set
    (kvlab.ui.links): the example menu, its suggested questions, the method and ratio, and
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


@dataclass
class CompareInputs:
    """The Compare tab's widgets that a link sets."""

    methods: gr.CheckboxGroup
    ratios: gr.CheckboxGroup
    more_ratios: gr.Textbox


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


def document_input(text: str | None, file: str | None) -> str | None:
    """What the lab reads as the document: the text box when it holds text, else the upload's text
    (:func:`read_upload`); None when there is neither (the lab says so). The lab never sees a path."""
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
        cancel.Cancelled: "Stopped",
    }.get(type(exc), "Document problem" if isinstance(exc, DocumentError) else "Error")
    return gr.Error(str(exc), title=title, print_exception=False)


T = TypeVar("T")


def requester_gone() -> str | None:
    """Why the Gradio event running in this thread must stop (cancel.STOPPED, cancel.GONE), or None.

    Gradio runs a handler in a worker thread that it cannot interrupt: Stop
    (``cancels=``, or a client's ``/cancel``) only takes the event off the
    queue's running jobs, and a closed page or client only marks it not
    alive. The work reads both here at each step. None outside an event.
    """
    from gradio.context import LocalContext

    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
    queue = getattr(blocks, "_queue", None)
    if queue is None or event_id is None:
        return None
    for job in list(queue.active_jobs):
        for event in job or []:
            if event._id == event_id:
                return None if event.alive else cancel.GONE
    return cancel.STOPPED


@contextmanager
def bounded(slot: cancel.Slot | None = COMPUTE) -> Iterator[cancel.Scope]:
    """A request's bounds (``KVLAB_MAX_REQUEST_S``, Stop, a disconnect), holding ``slot`` inside (None: no slot)."""
    handover = slot.handover if slot is not None else (lambda: None)
    with cancel.scope(limits.LIMITS.request_s, requester_gone, handover) as scope:
        if slot is None:
            yield scope
            return
        with slot.hold():
            yield scope


def guarded(what: str, work: Callable[[], T]) -> T:
    """``work()`` holding the compute slot within the request's bounds (:func:`bounded`), with any failure
    turned into a message for the user: a user's error or a stop as it is (:func:`as_gr_error`), anything
    else logged with an id (:func:`unexpected`); the server stays up."""
    try:
        with bounded():
            return work()
    except cancel.Cancelled as exc:
        log.info("a run with %s stopped: %s", what, exc)
        raise as_gr_error(exc) from exc
    except USER_ERRORS as exc:
        raise as_gr_error(exc) from exc
    except Exception as exc:  # noqa: BLE001 - say what failed; the server stays up
        raise unexpected(exc, what) from exc


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
        title="Run failed", print_exception=False,
    )
