"""Every limit the lab enforces, in one place, each set by an environment variable.

The limits exist so that one request cannot take the server's memory or its
only compute slot: they are checked before the work they bound (an upload's
bytes before it is read, a document's characters before it is tokenised, a
question's tokens before the prefill). docs/deployment.md's "Limits and bad input"
section lists them. Values are read once, when kvlab.limits is imported;
:func:`from_env` reads any mapping (tests pass their own).
"""
from __future__ import annotations

import os
import typing
from dataclasses import dataclass, fields

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
    request_s: seconds one request of the app may hold the compute slot (kvlab.cancel stops it then).
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
}


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


#: The limits in force (tests may replace it with monkeypatch).
LIMITS: Limits = from_env()
