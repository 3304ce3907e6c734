"""The Learn tab's prose is markdown, not Python (kvlab.learn_text): every registered method and wrapper has
its file, every directive of every file resolves, a measured figure is quoted from its one place
(docs/findings.md) or, without the repository's docs/, linked, and no module under kvlab/ holds a Learn
text as a string."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

from kvlab import learn_text
from kvlab.compression.selection import STAGES, selection_learn, wrappers
from kvlab.learn_text import DIRECTIVE, LearnTextError, findings, render
from kvlab.methods import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvlab"
FINDINGS = ROOT / "docs" / "findings.md"
#: The texts every file of kvlab/learn_text/ is reached from: the page, and the wrappers' paragraph.
ROOTS = {"page.md", "selection_wrappers.md"}
#: The ``{{value NAME}}``s the callers give: kvlab.ui.learn.page_values and kvlab.compression.selection.
VALUES = {"n_sink", "role_window", "retrieval_threshold", "methods", "stages"}
#: A name that holds a Learn text as prose: a module constant ``*_LEARN`` or ``LEARN_INTRO``.
PROSE_NAME = re.compile(r"_LEARN$|^LEARN_INTRO$")


def markdown_files() -> list[Path]:
    """Every markdown file under kvlab/: the Learn texts."""
    return sorted(PACKAGE.rglob("*.md"))


def holds_text(value: ast.expr) -> bool:
    """Whether an expression has a string in it (a literal or an f-string, alone or concatenated)."""
    return any(
        isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))
        for n in ast.walk(value)
    )


def assignments(statement: ast.stmt) -> list[tuple[str, ast.expr]]:
    """(name, value) of each plain name a statement assigns a value to."""
    if isinstance(statement, ast.Assign):
        return [(t.id, statement.value) for t in statement.targets if isinstance(t, ast.Name)]
    if isinstance(statement, ast.AnnAssign) and statement.value is not None and isinstance(statement.target, ast.Name):
        return [(statement.target.id, statement.value)]
    return []


def learn_prose(tree: ast.Module) -> list[str]:
    """Where a module holds Learn prose: a class attribute ``learn``, a ``learn=`` argument (a stage's) or a
    module constant named as a Learn text, whose value has a string in it."""
    found = [
        name for st in tree.body for name, value in assignments(st) if PROSE_NAME.search(name) and holds_text(value)
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found += [
                f"{node.name}.learn"
                for st in node.body
                for name, value in assignments(st)
                if name == "learn" and holds_text(value)
            ]
        if isinstance(node, ast.keyword) and node.arg == "learn" and holds_text(node.value):
            found.append("learn=")
    return found


def test_the_prose_check_sees_each_form_and_only_it() -> None:
    source = """
BUDGETS_LEARN = "## Where the budget goes"
LEARN_INTRO = "## What the lab shows" + ROLES
NOTE = "not a Learn text"
class A:
    learn = ("Keeps " f"{n} tokens")
class B:
    learn = LearnText()
STAGE = Stage(name="x", learn="sentences")
"""
    assert learn_prose(ast.parse(source)) == ["BUDGETS_LEARN", "LEARN_INTRO", "A.learn", "learn="]


def test_no_module_under_kvlab_holds_learn_prose() -> None:
    held = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = learn_prose(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            held[path.relative_to(ROOT).as_posix()] = found
    assert not held, f"Learn prose in Python (write it in the .md beside the module, kvlab.learn_text): {held}"


def test_every_registered_method_and_wrapper_has_its_markdown_file() -> None:
    for name, cls in REGISTRY.items():
        assert Path(inspect.getfile(cls)).with_suffix(".md").is_file(), name
        assert cls.learn.strip(), name
    for stage in STAGES:
        module = sys.modules[f"{wrappers.__name__}.{stage.name}"]
        assert Path(module.__file__).with_suffix(".md").is_file(), stage.name


def test_no_markdown_file_is_left_unread() -> None:
    """Each .md beside a method or a wrapper is a registered one's, and each file of kvlab/learn_text/ is
    the page, the wrappers' paragraph or included by a text."""
    assert {p.stem for p in (PACKAGE / "methods").glob("*.md")} == set(REGISTRY)
    assert {p.stem for p in (PACKAGE / "compression" / "wrappers").glob("*.md")} == {s.name for s in STAGES}
    included = {name for p in markdown_files() for kind, name in DIRECTIVE.findall(p.read_text()) if kind == "include"}
    assert {p.name for p in (PACKAGE / "learn_text").glob("*.md")} == ROOTS | included
    assert {p.parent for p in markdown_files()} == {
        PACKAGE / "methods",
        PACKAGE / "compression" / "wrappers",
        PACKAGE / "learn_text",
    }


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_every_directive_resolves(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    # A directive misspelt (a space too many, another word) would be shown as it is written.
    written = re.findall(r"\{\{\s*(?:include|finding|value)\b[^}]*\}\}", text)
    assert len(written) == len(DIRECTIVE.findall(text)), written
    for kind, name in DIRECTIVE.findall(text):
        if kind == "include":
            assert (PACKAGE / "learn_text" / name).is_file(), name
        elif kind == "finding":
            assert name in findings(FINDINGS), name
        else:
            assert name in VALUES, name


def test_the_page_quotes_every_finding_word_for_word_and_leaves_no_directive() -> None:
    pytest.importorskip("gradio")
    from kvlab.ui.learn import learn_markdown, page_values

    assert set(page_values()) | {"stages"} == VALUES
    page = learn_markdown()
    assert not re.search(r"\{\{(include|finding|value)\b", page)
    blocks = findings(FINDINGS)
    assert blocks and all(text in page for text in blocks.values())
    assert "20/20/19/6" in REGISTRY["attention_matching"].learn and "0.168 (mean)" in page


def test_each_finding_states_its_model_date_n_and_command() -> None:
    """What follows a block, up to the next heading, says where its figure comes from."""
    doc = FINDINGS.read_text(encoding="utf-8")
    for name in findings(FINDINGS):
        after = doc.split(f"<!-- finding: {name} -->", 1)[1].split("<!-- /finding -->", 1)[1]
        source = re.split(r"^#{2,3} ", after, maxsplit=1, flags=re.M)[0]
        assert "model" in source and "command" in source and re.search(r"\bn\b", source), name
        assert re.search(r"20\d\d-\d\d-\d\d", source), name


def test_without_the_repositorys_docs_a_finding_is_a_link(monkeypatch, tmp_path) -> None:
    """An installed wheel ships no docs/: the page links to docs/findings.md instead of failing."""
    for folder in (None, tmp_path):  # no docs/, or a docs/ without findings.md
        monkeypatch.setattr(learn_text, "docs_dir", lambda folder=folder: folder)
        text = REGISTRY["attention_matching"].learn
        assert "[measured: docs/findings.md, am-books](docs/findings.md#am-books)" in text
        assert "20/20/19/6" not in text


def test_a_method_with_no_file_and_a_directive_that_finds_nothing_are_errors() -> None:
    with pytest.raises(LearnTextError, match=r"kvlab.paths has no Learn text: write paths.md beside its file"):
        learn_text.module_text("kvlab.paths")
    for text in ("{{value nothing}}", "{{include nothing.md}}", "{{finding nothing}}"):
        with pytest.raises(LearnTextError, match="nothing"):
            render(text)
    assert render("the first {{value n}} tokens", {"n": 4}) == "the first 4 tokens"


def test_a_finding_is_one_paragraph_between_markers_on_their_own_lines(tmp_path) -> None:
    path = tmp_path / "findings.md"
    path.write_text("`<!-- finding: x -->` in prose\n\n<!-- finding: a -->\nOne\nparagraph.\n<!-- /finding -->\n")
    assert findings(path) == {"a": "One\nparagraph."}
    bad = tmp_path / "bad.md"
    bad.write_text("<!-- finding: a -->\nOne.\n\nTwo.\n<!-- /finding -->\n")
    with pytest.raises(LearnTextError, match="more than one paragraph"):
        findings(bad)


def test_the_wrappers_paragraph_is_each_stages_text_in_their_order() -> None:
    texts = [learn_text.module_text(f"{wrappers.__name__}.{stage.name}") for stage in STAGES]
    paragraph = selection_learn()
    assert paragraph.startswith("**Selection wrappers**") and paragraph.endswith(texts[-1])
    assert [paragraph.index(t) for t in texts] == sorted(paragraph.index(t) for t in texts)
