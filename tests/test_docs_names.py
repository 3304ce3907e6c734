"""Every module, file and name that README.md and docs/*.md quote exists (the docs cannot drift from the tree).

Read from the documents' code spans and fenced blocks (tests/test_commands.py checks the commands):

- a path under the project (``kvlab/...``, ``benchmarks/...``, ``tests/...``, ``assets/...``, ``docs/...``,
  ``app.py``, ``Makefile`` ...): the file or folder is there (a ``*`` pattern: something matches);
- a dotted name ``kvlab.x.y`` / ``benchmarks.x``: its longest module prefix imports and the rest are
  attributes of it (``kvlab.runtime.model.LoadedModel.geometry``).
"""

from __future__ import annotations

import importlib
import re

import pytest
from test_commands import DOCUMENTS, ROOT, code_texts

FILES = {
    "app.py",
    "Makefile",
    "Dockerfile",
    "README.md",
    "pyproject.toml",
    "requirements.txt",
    "requirements-dev.txt",
    "requirements-model.txt",
    "setup.py",
    ".ci/run",
}
PATH = re.compile(r"(?<![\w./-])((?:kvlab|benchmarks|tests|assets|docs|\.ci)/[\w./*<>-]*[\w*/])")
#: Paths the docs name on purpose although the tree has no such file, and why.
HYPOTHETICAL = {
    "kvlab/methods/my_method.py": "architecture.md's example method (tests/test_add_a_method.py makes it)",
    "kvlab/methods/my_method.md": "the example method's Learn text (tests/test_add_a_method.py makes it)",
}
#: A dotted word with one of these endings is a file's name (``--out kvlab.json``), not a module.
FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".html", ".md", ".txt", ".png", ".py", ".gguf")
DOTTED = re.compile(r"(?<![\w./-])((?:kvlab|benchmarks)(?:\.[A-Za-z_]\w*)+)")


def quoted_names(text: str) -> tuple[set[str], set[str]]:
    """(paths, dotted names) in the document's code."""
    paths, dotted = set(), set()
    for code in code_texts(text):
        paths.update(m for m in PATH.findall(code) if "<" not in m)
        paths.update(w for w in re.findall(r"[\w./-]+", code) if w in FILES)
        dotted.update(d for d in DOTTED.findall(code) if not d.endswith(FILE_SUFFIXES))
    return paths, dotted


def path_exists(name: str) -> bool:
    name = name.rstrip("/")
    return any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a module's attribute path."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_reader_finds_paths_and_names() -> None:
    text = "See `kvlab/runtime/model.py` and `kvlab.runtime.model.LoadedModel`.\n```\npython app.py\n```\n"
    assert quoted_names(text) == ({"kvlab/runtime/model.py", "app.py"}, {"kvlab.runtime.model.LoadedModel"})
    assert resolves("kvlab.runtime.model.LoadedModel.geometry") and not resolves("kvlab.runtime.model.Nothing")
    assert (
        not resolves("kvlab.no_such_module") and path_exists("kvlab/runtime/*.py") and not path_exists("kvlab/nope.py")
    )


QUOTED = {path.name: quoted_names(path.read_text(encoding="utf-8")) for path in DOCUMENTS}


@pytest.mark.parametrize("doc", sorted(QUOTED))
def test_every_quoted_path_exists(doc: str) -> None:
    missing = sorted(p for p in QUOTED[doc][0] if not path_exists(p) and p not in HYPOTHETICAL)
    assert not missing, f"{doc} names paths that are not there: {', '.join(missing)}"


@pytest.mark.parametrize("doc", sorted(QUOTED))
def test_every_quoted_module_and_name_resolves(doc: str) -> None:
    missing = sorted(d for d in QUOTED[doc][1] if not resolves(d))
    assert not missing, f"{doc} names modules or attributes that do not exist: {', '.join(missing)}"


def test_the_architecture_table_names_every_module_and_package() -> None:
    """docs/architecture.md's "Where each concern lives" names each top-level module and package of kvlab."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text[text.index("## Where each concern lives") :]
    table = table[: table.index("\n## ", 1)]
    named = set(PATH.findall(table))
    kvlab = ROOT / "kvlab"
    parts = [f"kvlab/{p.name}" for p in kvlab.glob("*.py") if p.name != "__init__.py"]
    parts += [f"kvlab/{p.name}/" for p in kvlab.iterdir() if (p / "__init__.py").exists()]
    missing = sorted(p for p in parts if p not in named and not any(n.startswith(p) for n in named))
    assert not missing, f"docs/architecture.md's table does not name: {', '.join(missing)}"


def concerns_rows() -> list[tuple[str, list[str]]]:
    """docs/architecture.md's table of concerns: (what the row says, the paths of its last cell)."""
    rows = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        places = re.findall(r"`([\w./-]+)`", cells[-1]) if len(cells) == 2 else []
        if places and all(p.startswith(("kvlab/", "assets/", "benchmarks/")) for p in places):
            rows.append((cells[0], places))
    return rows


def test_the_concerns_tables_bare_file_names_are_in_their_rows_places():
    """A file the concerns table names without its folder (``beacon_core.py``) lies in one of its row's places
    (a folder of that row, or beside a file of it): the table once named files renamed long before."""
    rows = concerns_rows()
    assert len(rows) > 20
    for what, places in rows:
        folders = [ROOT / p if (ROOT / p).is_dir() else (ROOT / p).parent for p in places]
        for name in re.findall(r"`([\w-]+\.py)`", what):
            assert any(any(folder.rglob(name)) for folder in folders), (name, places)
