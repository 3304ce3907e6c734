"""A bounded-cache policy is one file: docs/architecture.md's example, written into the policies folder
and nothing else, appears everywhere a policy does, and is gone once the file is.

The example's code block is read from docs/architecture.md itself (so the documentation runs) and
written as ``my_policy.py`` into a folder of the ``kvlab.bounded.policies`` package: a temporary folder
appended to the package's ``__path__``, so that other test runs sharing this checkout never see it.
The package's own discovery (``kvlab.compression.registry.discover``, what
``kvlab/bounded/policies/__init__.py`` calls) then imports it like any policy file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_add_a_method import tiny_folder  # noqa: F401  (a fixture: a 2-layer random Llama saved as a model folder)

import kvlab.bounded.policies
from kvlab.bounded.loop import run_policy
from kvlab.bounded.policies import POLICIES, bounded_policies, make_policy
from kvlab.bounded.policy_registry import policies_table
from kvlab.cli import build_parser, main
from kvlab.compression.registry import discover

ROOT = Path(__file__).resolve().parent.parent
NAME = "my_policy"
PROMPT = torch.tensor([(i * 5) % 60 + 2 for i in range(40)])


def example_code() -> str:
    """The python block of docs/architecture.md's "Adding a policy in one file"."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("### Adding a policy in one file", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def add_folder(folder: Path) -> None:
    """What a policy file needs: be in the package's folders when discovery runs."""
    kvlab.bounded.policies.__path__.append(str(folder))
    discover(kvlab.bounded.policies.__name__, kvlab.bounded.policies.__path__)


def method_help() -> str:
    """The help of ``kvlab generate --method``: the CLI's list of the policies."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.help for a in subparsers.choices["generate"]._actions if "--method" in a.option_strings)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policies")
    (folder / f"{NAME}.py").write_text(example_code(), encoding="utf-8")
    add_folder(folder)
    yield folder
    kvlab.bounded.policies.__path__.remove(str(folder))
    POLICIES.pop(NAME, None)
    sys.modules.pop(f"kvlab.bounded.policies.{NAME}", None)
    # Removed, it is offered nowhere any more.
    assert NAME not in bounded_policies() and NAME not in method_help() and f"`{NAME}`" not in policies_table()


def test_the_example_registers_under_its_file_name(folder):
    cls = POLICIES[NAME]
    assert cls.__module__ == f"kvlab.bounded.policies.{NAME}"
    assert NAME in bounded_policies() and cls.label == "Most recent only"


def test_it_keeps_the_most_recent_tokens_by_hand(folder, tiny):
    """Read one token a pass: once full, each pass evicts the oldest key, so the last ``budget``
    positions read stay and there is one shrink per token read past the budget."""
    budget, n_new = 24, 20
    policy = make_policy(NAME, tiny, budget, protected=4)
    run = run_policy(policy, PROMPT, n_new, chunk=1, stop=False)
    fed = PROMPT.numel() + n_new - 1  # the last written token is never read back
    assert len(run.events) == fed - budget
    for layer in range(tiny.n_layers):
        assert policy.k_pos[layer].tolist() == [list(range(fed - budget, fed))] * tiny.n_kv_heads


def test_kvlab_generate_offers_it_and_runs_it(folder, tiny_folder, capsys, own_models):  # noqa: F811
    assert NAME in method_help()
    args = build_parser().parse_args(["generate", "--prompt", "w2 w3", "--method", NAME])
    assert args.method == NAME
    prompt = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(40))  # 40 tokens and the template's: past the budget
    code = main(
        [
            "generate",
            "--prompt",
            prompt,
            "--method",
            NAME,
            "--budget",
            "24",
            "--max-new-tokens",
            "4",
            "--model",
            str(tiny_folder),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    record = json.loads(out)
    assert [m["method"] for m in record["methods"]] == ["unbounded", NAME]
    ours = record["methods"][1]
    assert ours["max_keys"] <= 24 < record["methods"][0]["max_keys"] and ours["events"] > 0


def test_the_apps_generate_tab_offers_it(folder):
    gr = pytest.importorskip("gradio")
    from kvlab.ui.app import build_app

    demo = build_app(models=[("tiny", "unused-spec")])
    boxes = [
        block
        for block in demo.blocks.values()
        if isinstance(block, gr.CheckboxGroup) and block.label == "Bounded-cache methods"
    ]
    assert len(boxes) == 1 and ("Most recent only", NAME) in [tuple(c) for c in boxes[0].choices]


def test_the_docs_table_has_its_row(folder):
    cls = POLICIES[NAME]
    assert f"| `{NAME}` | {cls.label} | {cls.summary} |" in policies_table().splitlines()


@pytest.mark.slow  # a second pytest
def test_every_per_policy_test_runs_it(folder):
    """A fresh pytest, whose only addition is the folder (a plugin does what :func:`add_folder` does
    before the tests are collected), runs tests/test_generate.py's per-policy tests on the new policy."""
    plugin = folder / "add_my_policy.py"
    plugin.write_text(
        "import kvlab.bounded.policies\n"
        "from kvlab.compression.registry import discover\n"
        f"kvlab.bounded.policies.__path__.append({str(folder)!r})\n"
        "discover(kvlab.bounded.policies.__name__, kvlab.bounded.policies.__path__)\n",
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "add_my_policy",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "tests/test_generate.py",
            "-k",
            NAME,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    for test in (
        "test_the_cache_never_exceeds_its_budget",
        "test_with_room_for_everything_every_method_is_plain_greedy",
    ):
        assert f"PASSED tests/test_generate.py::{test}[{NAME}]" in ran.stdout, (test, ran.stdout[-2000:])
