"""What every tab shares: user-facing errors, the ZeroGPU wrapper, page styling."""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Callable, TypeVar

import gradio as gr
from gradio import utils as gradio_utils

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
"""
# ZeroGPU time slots (seconds): one Explore run, and a sweep (per point, capped).
GPU_RUN_S = int(os.environ.get("KVLAB_GPU_DURATION", "120"))
GPU_SWEEP_BASE_S, GPU_SWEEP_POINT_S = 60, 15
GPU_MAX_S = int(os.environ.get("KVLAB_GPU_MAX_DURATION", "600"))

USER_ERRORS = (DocumentError, MethodError, ModelLoadError, InputError)


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
    }.get(type(exc), "Document problem" if isinstance(exc, DocumentError) else "Error")
    return gr.Error(str(exc), title=title, print_exception=False)


T = TypeVar("T")


def guarded(what: str, work: Callable[[], T]) -> T:
    """``work()``, with any failure turned into a message for the user: a user's error as it is
    (:func:`as_gr_error`), anything else logged with an id (:func:`unexpected`); the server stays up."""
    try:
        return work()
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
