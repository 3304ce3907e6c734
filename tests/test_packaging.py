"""The installable package: what a wheel of this checkout holds, and the `kvlab` console script."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow  # builds a wheel and installs a console script: left out of make test-fast

ROOT = Path(__file__).resolve().parents[1]
# What pyproject.toml and setup.py read to build kvlab.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "requirements.txt", "kvlab", "assets")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """A wheel built from a copy of the checkout (the build never writes into the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [built] = (tmp / "dist").glob("kvlab-*.whl")
    return zipfile.ZipFile(built)


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    [path] = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_wheel_holds_every_module_of_the_checkout(wheel: zipfile.ZipFile) -> None:
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvlab").rglob("*.py")}
    assert modules <= set(wheel.namelist())


def test_wheel_holds_the_examples_and_budget_profiles_as_kvlab_assets(wheel: zipfile.ZipFile) -> None:
    wanted = [*(ROOT / "assets" / "examples").iterdir(), *(ROOT / "assets" / "budgets").glob("*.json")]
    assert len(wanted) >= 5  # the manifest, three documents, a profile
    names = set(wheel.namelist())
    for path in wanted:
        name = "kvlab/" + path.relative_to(ROOT).as_posix()
        assert name in names, name
        assert wheel.read(name) == path.read_bytes(), name


def test_wheel_holds_every_learn_text(wheel: zipfile.ZipFile) -> None:
    """The Learn tab's markdown (kvlab.learn_text): each method's and wrapper's beside its module, the page's."""
    texts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvlab").rglob("*.md")}
    assert {"kvlab/methods/snapkv.md", "kvlab/compression/wrappers/adakv.md", "kvlab/learn_text/page.md"} <= texts
    assert texts <= set(wheel.namelist())


def test_wheel_requires_exactly_requirements_txt(wheel: zipfile.ZipFile) -> None:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    pinned = {str(Requirement(line)) for line in lines if line.strip() and not line.startswith("#")}
    metadata = _dist_info(wheel, "METADATA").splitlines()
    required = {str(Requirement(line.split(":", 1)[1])) for line in metadata if line.startswith("Requires-Dist:")}
    assert required == pinned


def test_wheel_declares_the_kvlab_console_script(wheel: zipfile.ZipFile) -> None:
    entry_points = _dist_info(wheel, "entry_points.txt")
    section = entry_points.split("[console_scripts]", 1)[1]
    assert "kvlab = kvlab.cli:main" in section


def _console_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("kvlab")
    if not script.is_file():
        pytest.fail(f"no `kvlab` script beside {sys.executable}: kvlab is not installed (run `make setup`)")
    return subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=180)


def test_console_script_lists_methods_from_any_folder(tmp_path: Path) -> None:
    proc = _console_script("methods", cwd=tmp_path)  # not the checkout: the installed package
    assert proc.returncode == 0, proc.stderr
    assert "attention_matching" in proc.stdout and "streaming_llm" in proc.stdout


def test_console_script_exits_with_the_clis_status(tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A short note.")
    proc = _console_script(
        "run", "--doc", str(doc), "--method", "snapkv", "--ratio", "0.5", "--question", "q", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "ratio" in proc.stderr
