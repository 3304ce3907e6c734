"""Every limit the lab enforces, in one place, each set by an environment variable.

The limits exist so that one request cannot take the server's memory or its
only compute slot: they are checked before the work they bound (an upload's
bytes before it is read, a document's characters before it is tokenised, a
question's tokens before the prefill). docs/deployment.md's "Limits and bad input"
section lists them. Values are read once, when kvlab.limits is imported;
:func:`from_env` reads any mapping (tests pass their own). A value that is
not valid stops the program at that import with one line (``kvlab: error: ...``,
exit status 2), never a traceback. The settings that are not numbers (where
the result store lives, the sheet to warm it with) are read here too
(:func:`store_dir`, :func:`warm_sheet`).
"""

from __future__ import annotations

import os
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path

MIB = 1024 * 1024


class LimitConfigError(ValueError):
    """An environment variable holds something that is not a valid limit."""


@dataclass(frozen=True)
class Limits:
    """The lab's limits (:data:`ENV` names each one's environment variable).

    upload_bytes: largest uploaded file, checked before it is read;
    document_chars: longest document (pasted, or the text of an upload), checked before tokenising;
    question_chars / question_tokens: longest question (characters checked first, tokens before the prefill);
    new_tokens: longest answer a user may ask for;
    sweep_points: most (method, ratio) runs in one Compare sweep;
    remembered_questions: questions whose answers and queries a document keeps (least recently used go);
    cache_bytes: byte budget of everything cached for documents; 0 sizes it from the free RAM or VRAM;
    max_models: models kept loaded (least recently used are unloaded);
    generate_tokens: most tokens one Generate request may write;
    request_s: seconds one request of the app may hold the compute slot (kvlab.cancellation stops it then);
    prepare_s: seconds of work one document's preparation in the background may take (kvlab.lab.background);
    queue_size: requests that may wait for the compute slot (more are told the lab is busy);
    compute_admitted: heavy events Gradio starts at once (they wait for the compute slot, which
    serves them fairly; a stored answer is served without waiting at all);
    store_bytes: bytes of finished runs kept on disk (kvlab.results; least recently used go);
    gpu_run_s / gpu_max_s: a ZeroGPU Space's time slot for one run, and for the longest request;
    server_port: the port the app listens on (Gradio's own variable).
    """

    upload_bytes: int = 10 * MIB
    document_chars: int = 400_000
    question_chars: int = 2_000
    question_tokens: int = 256
    new_tokens: int = 256
    sweep_points: int = 100
    remembered_questions: int = 16
    cache_bytes: int = 0
    max_models: int = 2
    generate_tokens: int = 2048
    # A CPU Space answers an Explore run in well under a minute: three minutes is a long sweep.
    request_s: int = 180
    # Gemma 3 270M prepares a 32,000-token document for Attention Matching in about 400 s on an idle
    # 2-core CPU (docs/long-context.md): the model's whole window, with room for a busy machine.
    prepare_s: int = 1800
    # A workshop of thirty with three clicks each in flight fits; beyond it a clear "busy" line.
    queue_size: int = 100
    compute_admitted: int = 100
    store_bytes: int = 2 * 1024 * MIB
    gpu_run_s: int = 120
    gpu_max_s: int = 600
    server_port: int = 7860


#: Environment variable of each limit.
ENV: dict[str, str] = {
    "upload_bytes": "KVLAB_MAX_UPLOAD_BYTES",
    "document_chars": "KVLAB_MAX_DOCUMENT_CHARS",
    "question_chars": "KVLAB_MAX_QUESTION_CHARS",
    "question_tokens": "KVLAB_MAX_QUESTION_TOKENS",
    "new_tokens": "KVLAB_MAX_NEW_TOKENS",
    "sweep_points": "KVLAB_MAX_SWEEP",
    "remembered_questions": "KVLAB_MAX_QUESTIONS",
    "cache_bytes": "KVLAB_CACHE_BYTES",
    "max_models": "KVLAB_MAX_MODELS",
    "generate_tokens": "KVLAB_MAX_GENERATE_TOKENS",
    "request_s": "KVLAB_MAX_REQUEST_S",
    "prepare_s": "KVLAB_MAX_PREPARE_S",
    "queue_size": "KVLAB_QUEUE_SIZE",
    "compute_admitted": "KVLAB_COMPUTE_ADMITTED",
    "store_bytes": "KVLAB_STORE_BYTES",
    "gpu_run_s": "KVLAB_GPU_DURATION",
    "gpu_max_s": "KVLAB_GPU_MAX_DURATION",
    "server_port": "GRADIO_SERVER_PORT",
}
#: Settings whose value is a path: where finished runs are kept, and a sheet to warm them with.
STORE_DIR, WARM = "KVLAB_STORE_DIR", "KVLAB_WARM"
#: The value of KVLAB_STORE_DIR that keeps finished runs in memory only.
STORE_OFF = "off"
#: A Hugging Face Space's persistent storage, when the Space has it.
SPACE_DATA = Path("/data")


def from_env(environ: typing.Mapping[str, str] | None = None) -> Limits:
    """The limits with every variable of :data:`ENV` that is set applied.

    A value is a whole number (``_`` allowed as a separator); only
    ``cache_bytes`` may be 0. Raises LimitConfigError naming the variable.
    """
    env = os.environ if environ is None else environ
    values: dict[str, int] = {}
    for f in fields(Limits):
        name = ENV[f.name]
        raw = (env.get(name) or "").strip()
        if not raw:
            continue
        try:
            value = int(raw.replace("_", ""))
        except ValueError:
            raise LimitConfigError(f"{name}={raw!r} is not a whole number") from None
        lowest = 0 if f.name == "cache_bytes" else 1
        if value < lowest:
            raise LimitConfigError(f"{name}={raw!r}: use a number >= {lowest}")
        values[f.name] = value
    return Limits(**values)


def store_dir(environ: typing.Mapping[str, str] | None = None) -> Path | None:
    """Where finished runs are kept on disk (kvlab.results), or None for memory only.

    ``KVLAB_STORE_DIR`` when set ("off": memory only); else a Space's
    persistent ``/data`` when it exists, else the user's cache folder
    (``$XDG_CACHE_HOME``, else ``~/.cache``), each under ``kvlab/results``.
    """
    env = os.environ if environ is None else environ
    raw = (env.get(STORE_DIR) or "").strip()
    if raw.lower() == STORE_OFF:
        return None
    if raw:
        return Path(raw).expanduser()
    if SPACE_DATA.is_dir() and os.access(SPACE_DATA, os.W_OK):
        return SPACE_DATA / "kvlab" / "results"
    cache = (env.get("XDG_CACHE_HOME") or "").strip()
    return (Path(cache) if cache else Path.home() / ".cache") / "kvlab" / "results"


def warm_sheet(environ: typing.Mapping[str, str] | None = None) -> Path | None:
    """The workshop sheet the server warms its store with at start-up (``KVLAB_WARM``), or None.

    Raises LimitConfigError when it names no readable file.
    """
    env = os.environ if environ is None else environ
    raw = (env.get(WARM) or "").strip()
    if not raw:
        return None
    path = Path(raw).expanduser()
    if not path.is_file() or not os.access(path, os.R_OK):
        raise LimitConfigError(f"{WARM}={raw!r} is not a readable file (a workshop sheet: see docs/workshop.md)")
    return path


def _at_start() -> Limits:
    """The limits of this process; a bad value ends it here with one line (exit status 2)."""
    try:
        return from_env()
    except LimitConfigError as exc:
        sys.stderr.write(f"kvlab: error: {exc}\n")
        raise SystemExit(2) from None


#: The limits in force (tests may replace it with monkeypatch).
LIMITS: Limits = _at_start()
