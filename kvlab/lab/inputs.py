"""What the user gives the lab, checked: the document, the question, ratios, methods, counts, models.

These are the one set of input checks every entry point runs before any
work (Explore, Compare, Tasks, the needle test, Generate and the CLI), each
against the limits of kvlab.limits. Every function here raises an error
whose message is fit to show as is (:class:`InputError`, or
kvlab.documents.DocumentError for documents; an unknown method name is
kvlab.methods.MethodError).
"""

from __future__ import annotations

import logging
import math
import os
import re
import typing

from kvlab import limits
from kvlab.compression.request import MAX_RATIO, MIN_RATIO
from kvlab.documents import DocumentError, clean_text, read_document
from kvlab.examples import Example, load_examples
from kvlab.methods import get_method
from kvlab.models import EMBEDDED, EMBEDDED_LABEL, PACKAGED, installed_packaged

log = logging.getLogger("kvlab.lab")


class InputError(ValueError):
    """A missing or unusable input; the message is shown to the user as is."""


def document_text(text: str | None, file: str | None) -> str:
    """The document to read: the text box when it holds text, else the uploaded file.

    Raises DocumentError (shown as is) when there is neither, or when it is
    longer than ``KVLAB_MAX_DOCUMENT_CHARS`` (checked before any tokenising;
    an upload's bytes are checked before it is read, by read_document).
    """
    if text is not None and not isinstance(text, str):
        raise DocumentError(f"The document must be text, got {type(text).__name__} {text!r:.40}.")
    if text and text.strip():
        return clean_text(check_document_length(text))
    if file:
        return check_document_length(read_document(file))
    raise DocumentError("There is no document: pick an example, paste some text or upload a .txt, .md or .pdf file.")


def check_document_length(text: str) -> str:
    """``text`` itself; DocumentError when it has more characters than ``KVLAB_MAX_DOCUMENT_CHARS``."""
    limit = limits.LIMITS.document_chars
    if len(text) > limit:
        raise DocumentError(f"The document has {len(text):,} characters; the limit here is {limit:,}: shorten it.")
    return text


def text_or_none(value: object, what: str) -> str | None:
    """``value`` when it is a text or None; InputError naming ``what`` otherwise (an API caller's number)."""
    if value is not None and not isinstance(value, str):
        raise InputError(f"The {what} must be text, got {type(value).__name__} {value!r:.40}.")
    return value


def check_question(question: str | None) -> str:
    """The question without surrounding blanks; InputError when there is none or it is too long.

    Only characters are counted here (no model needed); see :func:`check_question_tokens`.
    """
    question = (text_or_none(question, "question") or "").strip()
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


def whole_number(value: object, what: str) -> int:
    """``value`` as an int (a whole float or numeric text too); InputError naming ``what`` otherwise."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(f"The {what} must be a whole number, got {value!r}.") from None
    if not math.isfinite(number) or number != int(number):
        raise InputError(f"The {what} must be a whole number, got {value!r}.")
    return int(number)


def check_count(value: object, low: int, high: int, what: str) -> int:
    """``value`` as an int from ``low`` to ``high``; InputError naming ``what`` and the range otherwise."""
    number = whole_number(value, what)
    if number < low:
        raise InputError(f"The {what} must be at least {low:,}, got {number:,}.")
    if number > high:
        raise InputError(f"The {what} is {number:,}; the limit here is {high:,}.")
    return number


def check_answer_length(max_new_tokens: object) -> int:
    """The answer's token cap as an int; InputError below 1 or above ``KVLAB_MAX_NEW_TOKENS``."""
    return check_count(max_new_tokens, 1, limits.LIMITS.new_tokens, "answer length (new tokens)")


def check_new_tokens(max_new_tokens: object) -> int:
    """Generate's cap on written tokens as an int; InputError outside 1..``KVLAB_MAX_GENERATE_TOKENS``."""
    return check_count(max_new_tokens, 1, limits.LIMITS.generate_tokens, "number of new tokens")


def check_prompt(prompt: str) -> str:
    """``prompt`` without surrounding blanks; InputError when empty, DocumentError over ``KVLAB_MAX_DOCUMENT_CHARS``."""
    prompt = (text_or_none(prompt, "prompt") or "").strip()
    if not prompt:
        raise InputError("The prompt is empty: type a prompt (or write after the Explore tab's document).")
    limit = limits.LIMITS.document_chars
    if len(prompt) > limit:
        raise InputError(f"The prompt has {len(prompt):,} characters; the limit here is {limit:,}: shorten it.")
    return prompt


def check_window(lm: typing.Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """InputError, before any work, when a prompt and the tokens to write exceed the model's window.

    lm: a kvlab.runtime.model.LoadedModel (its name and ``max_context``).
    """
    window = lm.max_context
    if prompt_tokens + max_new_tokens > window:
        raise InputError(
            f"The prompt is {prompt_tokens:,} tokens and {max_new_tokens:,} new tokens were asked, but {lm.name} "
            f"reads at most {window:,} tokens in all (its window): shorten the prompt or write fewer tokens."
        )


def check_ratio(ratio: object) -> float:
    """One compression ratio as a float; InputError outside kvlab's range (MIN_RATIO..MAX_RATIO)."""
    try:
        value = float(ratio)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(f"{ratio!r} is not a compression ratio: use a number such as 4") from None
    if not math.isfinite(value) or not MIN_RATIO <= value <= MAX_RATIO:
        raise InputError(f"ratio {ratio} is out of range: use ratios from {MIN_RATIO:g} to {MAX_RATIO:g}")
    return value


def check_sweep(
    methods: typing.Sequence[str] | None, ratios: typing.Sequence[object] | None
) -> tuple[list[str], list[float]]:
    """(methods, ratios) of a sweep (Compare, Tasks, the needle test): known, in range, at most
    ``KVLAB_MAX_SWEEP`` runs.

    InputError when either list is empty, a ratio is out of range or methods x
    ratios is over the limit; MethodError for an unknown method (before any
    model is loaded).
    """
    methods = list(methods or [])
    if not methods:
        raise InputError("Pick at least one method to compare.")
    if not ratios:
        raise InputError("Pick at least one compression ratio to sweep.")
    points, limit = len(methods) * len(ratios), limits.LIMITS.sweep_points
    if points > limit:
        raise InputError(f"{points} runs is too many for one sweep: pick at most {limit} (methods x ratios)")
    checked = [check_ratio(r) for r in ratios]
    for name in methods:
        get_method(name)
    return methods, checked


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

    The default is ``KVLAB_MODEL`` (else the embedded model); the embedded model,
    the installed packaged ones (kvlab.models.PACKAGED) and every comma-separated
    spec of ``KVLAB_MODELS`` follow, without repeats.
    """
    env = os.environ if environ is None else environ
    default = (env.get("KVLAB_MODEL") or "").strip() or EMBEDDED
    extra = [s.strip() for s in (env.get("KVLAB_MODELS") or "").split(",") if s.strip()]
    out: list[tuple[str, str]] = []
    for spec in dict.fromkeys([default, EMBEDDED, *installed_packaged(), *extra]):
        out.append((model_label(spec) + (" (default)" if spec == default else ""), spec))
    return out


def model_label(spec: str) -> str:
    """A model's name in menus: the embedded or a packaged model's label, else its spec."""
    return EMBEDDED_LABEL if spec == EMBEDDED else PACKAGED[spec].label if spec in PACKAGED else spec


def example_label(ex: Example) -> str:
    """An example in the menus: its title, its length and, for one read by its own model, that model."""
    length = f"~{ex.tokens:,} tokens" if ex.tokens else ""
    reader = f"read by {model_label(ex.model)}" if ex.model else ""
    detail = ", ".join(part for part in (length, reader) if part)
    return f"{ex.title} ({detail})" if detail else ex.title


def pick_examples(offered: typing.Sequence[Example]) -> list[Example]:
    """The examples of ``offered`` that Your pick lists: those any model reads (it lists a document's
    sentences to tick, too many in a long one read by its own model)."""
    return [ex for ex in offered if ex.model is None]


def offered_examples(specs: typing.Sequence[str]) -> list[Example]:
    """The bundled examples a page offering the models ``specs`` can read: those read by any model, and
    those whose own model is offered (a long example is left out where its model is not)."""
    return [ex for ex in examples() if ex.model is None or ex.model in specs]
