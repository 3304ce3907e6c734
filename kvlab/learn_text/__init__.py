"""The Learn tab's prose, read from markdown files: no Learn text is a Python string.

Where a text lives (one rule):

- a method's or a selection wrapper's own text: the markdown file beside its module, named as the
  module (``kvlab/methods/snapkv.py`` -> ``kvlab/methods/snapkv.md``,
  ``kvlab/compression/wrappers/adakv.py`` -> ``kvlab/compression/wrappers/adakv.md``), read by
  :func:`module_text` (``Method.learn`` returns it);
- every other text of the page (``page.md``: the intro, "Where the budget goes", the head roles'
  entry, the wrappers' paragraph) and every fragment two texts share (``engine_format_evict.md``,
  ``fp8_scales.md``): a file of this package's folder, ``kvlab/learn_text/``, read by :func:`page_text`.

A file's final newline is not part of its text. A text may hold three directives, each replaced
where it stands (inside a sentence too):

- ``{{include NAME.md}}``: the text of ``kvlab/learn_text/NAME.md``, itself rendered: a fragment
  several texts use is included, never copied;
- ``{{finding NAME}}``: a measured figure, quoted word for word from the block ``NAME`` of the
  repository's ``docs/findings.md`` (its one place); where kvlab runs without its repository (an
  installed wheel has no ``docs/``), a link to that file instead;
- ``{{value NAME}}``: a value computed in code (a list of the shipped stages, a constant of the lab),
  given by the caller of :func:`render` / :func:`page_text`; a missing one is an error.

The files are package data (``pyproject.toml``), read through importlib.resources and kept once read.
"""

from __future__ import annotations

import functools
import importlib
import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from kvlab.paths import docs_dir

#: A directive: ``{{include NAME.md}}``, ``{{finding NAME}}`` or ``{{value NAME}}``.
DIRECTIVE = re.compile(r"\{\{(include|finding|value) ([\w.-]+)\}\}")
#: A block of docs/findings.md: its name, then its text (one paragraph), each marker on its own line.
FINDING = re.compile(r"^<!-- finding: ([\w-]+) -->\n(.*?)\n<!-- /finding -->$", re.S | re.M)
#: Where a finding points when the repository's docs/ is absent.
FINDINGS_DOC = "docs/findings.md"
#: How deep includes may nest (a file that includes itself, at any distance, is an error).
MAX_DEPTH = 8


class LearnTextError(LookupError):
    """A Learn text that cannot be rendered: no file, an include of no fragment, a finding docs/findings.md
    does not hold, a value the caller did not give."""


def module_text(module: str) -> str:
    """The Learn text of the module named ``module`` (a method's, a wrapper's): the ``.md`` file beside it,
    rendered (no values). LearnTextError when there is none."""
    return render(_module_file(module))


def page_text(name: str, **values: Any) -> str:
    """The page text or fragment ``name`` of ``kvlab/learn_text/``, rendered with ``values``."""
    return render(_page_file(name), values)


def render(text: str, values: dict[str, Any] | None = None, depth: int = 0) -> str:
    """``text`` with its directives replaced: includes (rendered in turn), findings, ``values``."""
    if depth > MAX_DEPTH:
        raise LearnTextError(f"Learn text includes nest deeper than {MAX_DEPTH}: an include loop?")
    given = values or {}

    def resolve(match: re.Match) -> str:
        kind, name = match.groups()
        if kind == "include":
            return render(_page_file(name), given, depth + 1)
        if kind == "finding":
            return finding(name)
        if name not in given:
            named = ", ".join(sorted(given)) or "none"
            raise LearnTextError(f"the Learn text needs the value {name!r}; given: {named}")
        return str(given[name])

    return DIRECTIVE.sub(resolve, text)


def finding(name: str) -> str:
    """The text of docs/findings.md's block ``name``, or a link to it where docs/ is absent."""
    folder = docs_dir()
    if folder is None or not (folder / "findings.md").is_file():
        return f"[measured: {FINDINGS_DOC}, {name}]({FINDINGS_DOC}#{name})"
    blocks = findings(folder / "findings.md")
    if name not in blocks:
        raise LearnTextError(f"{FINDINGS_DOC} has no finding {name!r}; it has: {', '.join(blocks)}")
    return blocks[name]


@functools.cache
def findings(path: Path) -> dict[str, str]:
    """The blocks of a findings file by name (their text, without the markers), in the file's order.

    LearnTextError for a name twice or a block of more than one paragraph (it is quoted inside a
    paragraph of the page).
    """
    blocks: dict[str, str] = {}
    for name, text in FINDING.findall(path.read_text(encoding="utf-8")):
        if name in blocks or not text.strip() or "\n\n" in text:
            raise LearnTextError(f"{path}: the finding {name!r} is named twice, empty or more than one paragraph")
        blocks[name] = text.strip()
    return blocks


@functools.cache
def _module_file(module: str) -> str:
    """The unrendered text of the ``.md`` file named as ``module``, in the module's folder."""
    loaded = importlib.import_module(module)
    stem = module.rpartition(".")[2]
    return _read(_folder(loaded) / f"{stem}.md", f"{module} has no Learn text: write {stem}.md beside its file")


@functools.cache
def _page_file(name: str) -> str:
    """The unrendered text of ``kvlab/learn_text/<name>``."""
    return _read(resources.files(__name__) / name, f"kvlab/learn_text/ has no {name}")


def _read(file: Traversable, missing: str) -> str:
    """The file's text without its final newline; LearnTextError ``missing`` when there is no such file."""
    if not file.is_file():
        raise LearnTextError(missing)
    return file.read_text(encoding="utf-8").removesuffix("\n")


def _folder(module: Any) -> Traversable:
    """The folder that holds ``module``'s file, as importlib.resources reads it.

    Python 3.12's ``resources.files(module)`` is this; 3.11 takes packages only. The module's loader's
    resource reader is the folder of the module's own file, which is not always its package's first
    folder (tests add methods from a folder appended to ``kvlab.methods.__path__``).
    """
    spec = module.__spec__
    get_reader = getattr(spec.loader, "get_resource_reader", None)
    reader = get_reader(spec.name) if get_reader else None
    return reader.files() if reader is not None else resources.files(module.__package__)
