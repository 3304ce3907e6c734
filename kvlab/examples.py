"""The bundled example documents: ``assets/examples``, described by ``examples.json``
(:func:`load_examples`), each with short factual questions and their gold answers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvlab.documents import DocumentError, read_document
from kvlab.paths import assets_dir


def default_examples_root() -> Path:
    """Return the bundled ``assets/examples`` folder (installed or in a checkout)."""
    return assets_dir() / "examples"


@dataclass(frozen=True)
class Example:
    """A bundled example document with short factual questions and gold answers.

    Attributes:
        id: Stable identifier, e.g. ``"story"``.
        title: Human-readable title for the UI.
        kind: Kind of document, e.g. ``"story"``, ``"contract"``, ``"medical record"``.
        path: Absolute path of the document file.
        questions: Short factual questions about the document.
        answers: The gold answer to each question, in the same order as ``questions``
            (the first of its aliases: what the UI shows as the expected answer).
        aliases: Every accepted form of each answer (``answers[i] == aliases[i][0]``),
            for scorers such as :func:`kvlab.tasks.marking.contains_match`.
        tokens: Length of the cleaned document in its model's tokens (SmolLM2's when
            ``model`` is None), without special tokens (None if unknown).
        model: The model the example is read by (its spec, kvlab.models), for a document
            longer than the default model's window; None: any model.
        source: Where the text comes from (a public-domain book's author, title and
            edition); None: written for kvlab.
    """

    id: str
    title: str
    kind: str
    path: Path
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    aliases: tuple[tuple[str, ...], ...]
    tokens: int | None = None
    model: str | None = None
    source: str | None = None

    def text(self) -> str:
        """Return the document's cleaned text (read with :func:`read_document`)."""
        return read_document(self.path)


def _is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _str_list(entry: dict, key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key)
    if not isinstance(value, list) or not value or not all(_is_text(v) for v in value):
        raise DocumentError(f"{where}: '{key}' must be a non-empty list of non-empty strings.")
    return tuple(value)


def _answer_aliases(entry: dict, where: str) -> tuple[tuple[str, ...], ...]:
    """Each of ``entry["answers"]`` as its aliases: a string is one alias, a list several."""
    value = entry.get("answers")
    groups = [[a] if isinstance(a, str) else a for a in value] if isinstance(value, list) else []
    if groups and all(isinstance(g, list) and g and all(_is_text(a) for a in g) for g in groups):
        return tuple(tuple(g) for g in groups)
    raise DocumentError(
        f"{where}: 'answers' must be a non-empty list whose items are non-empty strings "
        "or non-empty lists of them (aliases, the first shown as the answer)."
    )


def load_examples(root: Path | None = None) -> list[Example]:
    """Load the bundled examples described by ``examples.json``.

    Args:
        root: Folder holding ``examples.json`` and the documents it names; defaults to
            :func:`default_examples_root`.

    Returns:
        The examples, in the order of the manifest.

    Raises:
        DocumentError: if the manifest is missing or malformed, an id is repeated, a
            file is missing or lies outside ``root``, or questions and answers differ
            in number.
    """
    root = Path(root) if root is not None else default_examples_root()
    manifest = root / "examples.json"
    try:
        raw = json.loads(manifest.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DocumentError(f"No examples manifest found at {manifest}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DocumentError(f"Could not read {manifest}: {exc}") from exc
    if not isinstance(raw, list):
        raise DocumentError(f"{manifest} must contain a JSON list of examples.")

    base = root.resolve()
    examples: list[Example] = []
    seen: set[str] = set()
    for index, entry in enumerate(raw):
        where = f"{manifest.name} entry {index}"
        if not isinstance(entry, dict):
            raise DocumentError(f"{where}: expected an object.")
        for key in ("id", "title", "file", "kind"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise DocumentError(f"{where}: '{key}' must be a non-empty string.")
        ex_id = entry["id"]
        where = f"{manifest.name} entry {index} ('{ex_id}')"
        if ex_id in seen:
            raise DocumentError(f"{where}: duplicate id.")
        seen.add(ex_id)

        path = (base / entry["file"]).resolve()
        if not path.is_relative_to(base):
            raise DocumentError(f"{where}: file '{entry['file']}' lies outside {base}.")
        if not path.is_file():
            raise DocumentError(f"{where}: file '{entry['file']}' not found.")

        questions = _str_list(entry, "questions", where)
        aliases = _answer_aliases(entry, where)
        answers = tuple(group[0] for group in aliases)
        if len(questions) != len(answers):
            raise DocumentError(f"{where}: {len(questions)} questions but {len(answers)} answers.")
        tokens = entry.get("tokens")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise DocumentError(f"{where}: 'tokens' must be a non-negative integer.")
        for key in ("model", "source"):
            if key in entry and not _is_text(entry[key]):
                raise DocumentError(f"{where}: '{key}', when given, must be a non-empty string.")

        examples.append(
            Example(
                id=ex_id,
                title=entry["title"],
                kind=entry["kind"],
                path=path,
                questions=questions,
                answers=answers,
                tokens=tokens,
                aliases=aliases,
                model=entry.get("model"),
                source=entry.get("source"),
            )
        )
    return examples
