"""A method is one file and its Learn text: docs/architecture.md's example, written into the methods folder
and nothing else, appears everywhere a method does.

The example's code block and markdown block are read from docs/architecture.md itself (so the
documentation runs) and written as ``my_method.py`` and ``my_method.md`` into a folder of the
``kvlab.methods`` package: a temporary folder
appended to the package's ``__path__``, so that other test runs sharing this checkout never see it.
The package's own discovery (``kvlab.compression.registry.discover``, what
``kvlab/methods/__init__.py`` calls) then imports it like any method file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab.methods
from conftest import tiny_tokenizer
from kvlab import catalog
from kvlab.cli import build_parser, main
from kvlab.compression.registry import REGISTRY, discover
from kvlab.testing.random_models import save_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
NAME = "my_method"


def example_block(language: str) -> str:
    """The ``language`` block of docs/architecture.md's "Adding a method in one file"."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("## Adding a method in one file", 1)[1]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def add_folder(folder: Path) -> None:
    """What a methods file needs: be in the package's folders when discovery runs."""
    kvlab.methods.__path__.append(str(folder))
    discover(kvlab.methods.__name__, kvlab.methods.__path__)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("methods")
    (folder / f"{NAME}.py").write_text(example_block("python"), encoding="utf-8")
    (folder / f"{NAME}.md").write_text(example_block("markdown"), encoding="utf-8")
    add_folder(folder)
    yield folder
    kvlab.methods.__path__.remove(str(folder))
    REGISTRY.pop(NAME, None)
    sys.modules.pop(f"kvlab.methods.{NAME}", None)


def test_the_example_registers_under_its_file_name(folder):
    cls = REGISTRY[NAME]
    assert cls.__module__ == f"kvlab.methods.{NAME}"
    assert cls.family == "selection" and cls.paper.url


def test_kvlab_methods_lists_it(folder, capsys):
    assert main(["methods"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert any(line.split()[0] == NAME and REGISTRY[NAME].summary in line for line in lines)
    assert main(["methods", "--long"]) == 0
    assert f"#### `{NAME}`" in capsys.readouterr().out


def test_the_docs_table_has_its_row_in_its_family(folder):
    table = catalog.methods_table()
    selection = table.split("**Selection**", 1)[1].split("**Merging**", 1)[0]
    assert f"| `{NAME}` † | {REGISTRY[NAME].summary} | [A. Author, 2026](https://example.org/my-method) |" in selection


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A 2-layer random Llama with the tests' word tokenizer, saved as a model folder for ``--model``."""
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "tiny", tiny_tokenizer())


def test_kvlab_run_runs_it_with_its_knob(folder, tiny_folder, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"w{(i * 7) % 60 + 2}" for i in range(60)))
    code = main(
        [
            "run",
            "--doc",
            str(doc),
            "--method",
            NAME,
            "--ratio",
            "4",
            "--question",
            "w3 w5",
            "--window",
            "0",
            "--max-new-tokens",
            "2",
            "--model",
            str(tiny_folder),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    assert result["method"] == NAME and result["ratio"] == 4
    args = build_parser().parse_args(["run", "--doc", "d", "--method", NAME, "--ratio", "2", "--question", "q"])
    assert args.method == NAME


def test_the_apps_method_menu_offers_it(folder):
    gr = pytest.importorskip("gradio")
    from kvlab.ui.app import build_app

    demo = build_app(models=[("tiny", "unused-spec")])
    menus = [block for block in demo.blocks.values() if isinstance(block, gr.Dropdown) and block.label == "Method"]
    assert menus and all(NAME in [value for _, value in menu.choices] for menu in menus)


@pytest.mark.slow  # a second pytest, twice
def test_every_per_method_test_runs_it(folder):
    """A fresh pytest, whose only addition is the folder (a plugin does what :func:`add_folder` does
    before the tests are collected), collects the per-method tests with the new method and passes
    test_methods' on it."""
    plugin = folder / "add_my_method.py"
    plugin.write_text(
        "import kvlab.methods\n"
        "from kvlab.compression.registry import discover\n"
        f"kvlab.methods.__path__.append({str(folder)!r})\n"
        "discover(kvlab.methods.__name__, kvlab.methods.__path__)\n",
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    base = [sys.executable, "-m", "pytest", "-p", "add_my_method", "-p", "no:cacheprovider", "-q"]
    collected = subprocess.run(
        [*base, "--collect-only", "tests/test_methods.py", "tests/test_bf16.py", "tests/test_catalog.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    ids = [line for line in collected.stdout.splitlines() if NAME in line]
    for test in (
        "test_every_method_meets_its_budget",
        "test_ratio_one_keeps_everything_and_reproduces_logits",
        "test_importance_is_recorded_only_when_asked",
        "test_bf16_attention_error_stays_within_its_bound",
    ):
        assert any(test in line for line in ids), (test, ids)
    ran = subprocess.run(
        [*base, "tests/test_methods.py", "-k", NAME], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0 and " passed" in ran.stdout, ran.stdout[-2000:]
