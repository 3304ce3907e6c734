"""What the user gives the lab, checked: the document, the question, ratios, models.

Every function here raises an error whose message is fit to show as is
(:class:`InputError`, or kvlab.documents.DocumentError for documents).
"""
from __future__ import annotations

import logging
import math
import os
import re
import typing

from kvlab import limits
from kvlab.documents import DocumentError, Example, clean_text, load_examples, read_document
from kvlab.methods.base import MAX_RATIO, MIN_RATIO
from kvlab.models import EMBEDDED, EMBEDDED_LABEL

log = logging.getLogger("kvlab.lab")


class InputError(ValueError):
    """A missing or unusable input; the message is shown to the user as is."""


def document_text(text: str | None, file: str | None) -> str:
    """The document to read: the text box when it holds text, else the uploaded file.

    Raises DocumentError (shown as is) when there is neither, or when it is
    longer than ``KVLAB_MAX_DOCUMENT_CHARS`` (checked before any tokenising;
    an upload's bytes are checked before it is read, by read_document).
    """
    if text and text.strip():
        return clean_text(check_document_length(text))
    if file:
        return check_document_length(read_document(file))
    raise DocumentError(
        "There is no document: pick an example, paste some text or upload a .txt, .md or .pdf file."
    )


def check_document_length(text: str) -> str:
    """``text`` itself; DocumentError when it has more characters than ``KVLAB_MAX_DOCUMENT_CHARS``."""
    limit = limits.LIMITS.document_chars
    if len(text) > limit:
        raise DocumentError(
            f"The document has {len(text):,} characters; the limit here is {limit:,}: shorten it."
        )
    return text


def check_question(question: str | None) -> str:
    """The question without surrounding blanks; InputError when there is none or it is too long.

    Only characters are counted here (no model needed); see :func:`check_question_tokens`.
    """
    question = (question or "").strip()
    if not question:
        raise InputError("The question is empty: type a question about the document (or pick a suggested one).")
    limit = limits.LIMITS.question_chars
    if len(question) > limit:
        raise InputError(f"The question has {len(question):,} characters; ask in at most {limit:,}.")
    return question


def check_question_tokens(tokenizer: typing.Any, question: str) -> str:
    """``question`` itself; InputError when it has more tokens than ``KVLAB_MAX_QUESTION_TOKENS``.

    Call it once the model is loaded and before the prefill: a long question
    would hold the compute slot while it is read and answered.
    """
    limit = limits.LIMITS.question_tokens
    n = len(tokenizer(question, add_special_tokens=False)["input_ids"])
    if n > limit:
        raise InputError(f"The question is {n:,} tokens long; ask in at most {limit:,} tokens.")
    return question


def check_answer_length(max_new_tokens: int | float | None) -> int:
    """The answer's token cap as an int; InputError below 1 or above ``KVLAB_MAX_NEW_TOKENS``."""
    if max_new_tokens is None or int(max_new_tokens) < 1:
        raise InputError("The answer length must be at least 1 token.")
    limit = limits.LIMITS.new_tokens
    if int(max_new_tokens) > limit:
        raise InputError(f"The answer length is {int(max_new_tokens):,} tokens; the limit here is {limit:,}.")
    return int(max_new_tokens)


def parse_ratios(selected: typing.Iterable[float | str] | None, more: str | None = None) -> list[float]:
    """The sweep's ratios: the ticked ones plus those typed (comma- or space-separated, "20" or "20x").

    Sorted, without repeats; raises InputError for anything that is not a
    ratio between kvlab's limits.
    """
    raw = [str(r) for r in (selected or [])] + [p for p in re.split(r"[,;\s]+", (more or "").strip()) if p]
    out: set[float] = set()
    for item in raw:
        try:
            value = float(item.strip().rstrip("xX"))
        except ValueError:
            raise InputError(f"{item!r} is not a compression ratio: type numbers such as 3, 8, 100") from None
        if not math.isfinite(value) or not (MIN_RATIO <= value <= MAX_RATIO):
            raise InputError(f"ratio {item} is out of range: use ratios from {MIN_RATIO:g} to {MAX_RATIO:g}")
        out.add(value)
    if not out:
        raise InputError("Pick at least one compression ratio to sweep.")
    return sorted(out)


def examples() -> list[Example]:
    """The bundled examples; empty (and logged) when the manifest is broken, so a front end still starts."""
    try:
        return load_examples()
    except DocumentError as exc:
        log.warning("examples unavailable: %s", exc)
        return []


def expected_answer(question: str, pool: list[Example] | None = None) -> tuple[str, ...] | None:
    """The gold answer's aliases when ``question`` is one of the bundled examples' questions, else None."""
    q = question.strip().lower()
    for ex in examples() if pool is None else pool:
        for question_, answer in zip(ex.questions, ex.answers):
            if question_.strip().lower() == q:
                return (answer,) if isinstance(answer, str) else tuple(answer)
    return None


def model_choices(environ: typing.Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(label, spec) of every model the lab offers; the first is the default.

    The default is ``KVLAB_MODEL`` (else the embedded model); the embedded model
    and every comma-separated spec of ``KVLAB_MODELS`` follow, without repeats.
    """
    env = os.environ if environ is None else environ
    default = (env.get("KVLAB_MODEL") or "").strip() or EMBEDDED
    extra = [s.strip() for s in (env.get("KVLAB_MODELS") or "").split(",") if s.strip()]
    out: list[tuple[str, str]] = []
    for spec in dict.fromkeys([default, EMBEDDED, *extra]):
        label = EMBEDDED_LABEL if spec == EMBEDDED else spec
        out.append((label + (" (default)" if spec == default else ""), spec))
    return out
