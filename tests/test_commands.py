"""Every command that README.md and docs/*.md quote exists, with the flags they give it.

Commands are read from the documents' code (fenced blocks, with ``\\``
continuations joined, and inline code spans):

- ``make TARGET``: a target of the Makefile;
- ``kvlab SUB`` / ``python -m kvlab SUB``: ``--help`` runs (exit 0), and every
  ``--flag`` the quote gives appears in that help;
- ``python -m benchmarks.X`` / ``python -m kvlab.X`` / ``python benchmarks/x.py``:
  the same.

``--help`` runs in this process (``runpy``, ``sys.argv`` set), so the heavy
imports are paid once, not once per command.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?<![\w/.-])make ([a-z][\w-]*)")
# `kvlab SUB`, `python -m kvlab SUB`, `python -m benchmarks.X`, `python -m kvlab.X`, `python benchmarks/x.py`.
COMMAND = re.compile(
    r"(?:(?<![\w/.-])(?:python3? -m )?kvlab (?P<sub>[a-z]+)\b"
    r"|python3? -m (?P<module>(?:benchmarks|kvlab)\.[\w.]+)"
    r"|python3? (?P<script>benchmarks/\w+\.py))(?P<rest>[^`#|]*)"
)
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def code_texts(text: str) -> list[str]:
    """The document's code: each fenced shell block's logical lines (continuations joined; Python blocks are
    not commands), then each inline span."""
    out = []
    for language, block in FENCE.findall(text):
        if language.strip() == "python":
            continue
        out.extend(line for line in block.replace("\\\n", " ").splitlines() if line.strip())
    prose = FENCE.sub("", text)
    out.extend(SPAN.findall(prose))
    return out


def quoted_commands(text: str) -> tuple[set[str], dict[tuple[str, str], set[str]]]:
    """(make targets, {(kind, name): flags given anywhere}) quoted in ``text``."""
    targets, commands = set(), {}
    for code in code_texts(text):
        targets.update(MAKE.findall(code))
        for m in COMMAND.finditer(code):
            kind = next(k for k in ("sub", "module", "script") if m.group(k))
            flags = commands.setdefault((kind, m.group(kind)), set())
            flags.update(f for f in FLAG.findall(m.group("rest")) if f != "--help")
    return targets, commands


def help_text(kind: str, name: str) -> str:
    """What ``--help`` prints for the command, run in this process; fails unless it exits 0."""
    argv, target = {
        "sub": (["kvlab", name, "--help"], ("module", "kvlab")),
        "module": ([name, "--help"], ("module", name)),
        "script": ([name, "--help"], ("path", str(ROOT / name))),
    }[kind]
    out = io.StringIO()
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            if target[0] == "module":
                runpy.run_module(target[1], run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(target[1], run_name="__main__")
    finally:
        sys.argv = saved
    assert exit_.value.code in (0, None), f"{' '.join(argv)} exited {exit_.value.code}"
    return out.getvalue()


def all_quoted() -> tuple[set[str], dict[tuple[str, str], set[str]]]:
    targets, commands = set(), {}
    for path in DOCUMENTS:
        t, c = quoted_commands(path.read_text(encoding="utf-8"))
        targets |= t
        for key, flags in c.items():
            commands.setdefault(key, set()).update(flags)
    return targets, commands


TARGETS, COMMANDS = all_quoted()


def test_the_parser_reads_commands_the_way_they_are_quoted() -> None:
    text = (
        "Run `make run`, then\n\n```python\nfrom kvlab import lab\n```\n\n"
        "```\nkvlab run --doc a.txt \\\n    --ratio 10   # a comment --not-a-flag\n"
        "python -m benchmarks.methods --ratios 4\n```\n\nand `python benchmarks/kvpress_peer.py --side kvlab`; "
        "not kvlab alone, nor `kvlab.lab`, nor `cmake install`.\n"
    )
    targets, commands = quoted_commands(text)
    assert targets == {"run"}
    assert commands == {
        ("sub", "run"): {"--doc", "--ratio"},
        ("module", "benchmarks.methods"): {"--ratios"},
        ("script", "benchmarks/kvpress_peer.py"): {"--side"},
    }


def test_the_documents_quote_the_main_commands() -> None:
    assert {"run", "test", "screenshot"} <= TARGETS
    assert {("sub", "run"), ("sub", "bench"), ("module", "benchmarks.attention_matching")} <= set(COMMANDS)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_make_target_exists(target: str) -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"`make {target}` is quoted but not in the Makefile"


@pytest.mark.parametrize("kind, name", sorted(COMMANDS), ids=lambda v: str(v))
def test_quoted_command_runs_help_and_knows_its_flags(kind: str, name: str) -> None:
    text = help_text(kind, name)
    unknown = sorted(f for f in COMMANDS[(kind, name)] if f not in text)
    assert not unknown, f"{name}: quoted with {', '.join(unknown)}, which --help does not list"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_anchor_follows_github() -> None:
    assert (
        anchor("The app's speed (`python -m benchmarks.app_speed`)") == "the-apps-speed-python--m-benchmarksapp_speed"
    )


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_relative_links_lead_somewhere(path: Path) -> None:
    """Every relative link (a file, a file#heading or #heading) of README and docs exists."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif fragment and dest.suffix == ".md":
            headings = {anchor(m) for m in re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), re.M)}
            if fragment not in headings:
                broken.append(target)
    assert not broken, f"{path.name}: {', '.join(broken)}"
