"""One run of the lab, checked once: :class:`RunSpec`, made by :func:`run_spec` (the lab's input step).

A run is a document, a method with its knobs, a ratio, a question, an answer length and a model.
The front ends (the page's Run, a link, ``kvlab run``, ``kvlab warm``, Your pick's rivals,
Compare's rows) each turn their inputs into a RunSpec and hand that on; the lab reads a spec and
never checks an input again. Everything a run is known by is made from it: the result store's key
(:meth:`RunSpec.key`), the method it builds, the link that opens it (kvlab.lab.links.spec_link)
and the command line that runs it (:meth:`RunSpec.cli_args`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvlab import models
from kvlab.catalog import knob_text, method_text
from kvlab.lab.inputs import check_answer_length, check_question, check_ratio, document_text
from kvlab.methods import Method, get_method
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS
from kvlab.results import RunKey, code_identity, model_identity, options_text, text_digest


def method_knobs(method: Method) -> tuple[tuple[str, Any], ...]:
    """A method's knobs that differ from its defaults, (name, value) in field order: the same for a
    method however it was configured (by name, by preset, by every knob given at its default)."""
    options = method.options
    defaults = type(options)()
    return tuple(
        (f.name, getattr(options, f.name))
        for f in dataclasses.fields(options)
        if f.init and getattr(options, f.name) != getattr(defaults, f.name)
    )


@dataclass(frozen=True)
class RunSpec:
    """One checked run: the document's text, the method's name and its knobs (only those off their
    defaults, :func:`method_knobs`), the ratio, the question (stripped), the answer length and the
    model (None: the lab's default). Equal specs are the same run."""

    document: str
    method: str
    knobs: tuple[tuple[str, Any], ...]
    ratio: float
    question: str
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    model: str | None = None

    @property
    def options(self) -> dict[str, Any]:
        """The knobs as get_method's keyword arguments."""
        return dict(self.knobs)

    def build(self) -> Method:
        """The configured method."""
        return get_method(self.method, **self.options)

    def method_text(self) -> str:
        """``name:knob=value:...``: the method as ``kvlab bench``, a link and a sheet spell it."""
        return method_text(self.method, self.knobs)

    def key(self) -> RunKey:
        """The result store's key of this run (kvlab.results.RunKey). Needs no model loaded (the model's
        identity is its file's digest, cached per process), so a stored run is found before any model work."""
        return RunKey(
            model=model_identity(self.model),
            document=text_digest(self.document),
            question=self.question,
            method=self.method,
            options=options_text(self.build().options),
            ratio=self.ratio,
            max_new_tokens=self.max_new_tokens,
            code=code_identity(),
        )

    def with_method(self, method: str, options: dict[str, Any] | None = None) -> RunSpec:
        """The same run with another method (a pick's rival); MethodError if refused."""
        return self.for_method(get_method(method, **(options or {})))

    def for_method(self, method: Method) -> RunSpec:
        """The same run with a configured method (a sweep's row)."""
        return dataclasses.replace(self, method=method.name, knobs=method_knobs(method))

    def cli_args(self, doc_path: str) -> list[str]:
        """``kvlab run``'s arguments for this run, the document read from ``doc_path`` (a knob as its flag)."""
        args = ["run", "--doc", doc_path, "--method", self.method, "--ratio", f"{self.ratio!r}"]
        args += ["--question", self.question, "--max-new-tokens", str(self.max_new_tokens)]
        if self.model is not None:
            args += ["--model", self.model]
        for name, value in self.knobs:
            args += ["--" + name.replace("_", "-"), knob_text(value)]
        return args


def run_spec(
    text: str | None,
    file: str | None,
    method: str,
    ratio: object,
    question: str | None,
    max_new_tokens: object = DEFAULT_MAX_NEW_TOKENS,
    options: dict[str, Any] | None = None,
    model: str | None = None,
) -> RunSpec:
    """The lab's input step: every input of a run checked (before any model work) into a :class:`RunSpec`.

    text or file: the document (a file is read); options: the method's knobs by name; model: a spec the
    lab allows, or None. Raises InputError, DocumentError, MethodError or ModelLoadError with a message
    fit for the user.
    """
    question = check_question(question)
    length = check_answer_length(max_new_tokens)
    checked_ratio = check_ratio(ratio)
    document = document_text(text, file)
    built = get_method(method, **(options or {}))
    models.check_allowed(model or None)
    return RunSpec(document, built.name, method_knobs(built), checked_ratio, question, length, model or None)
