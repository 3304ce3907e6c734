"""The app in a real headless Chromium: shared by tests/test_browser.py and benchmarks/app_speed.py.

Serves the app on a free local port (:func:`serve_app`) and opens Debian's
``/usr/bin/chromium`` through Playwright (:func:`chromium_page`) with the
flags these machines need and a fresh profile. Never runs ``playwright
install``: set KVLAB_CHROMIUM to use another Chromium binary.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from kvlab.runtime.model import LoadedModel

CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1400, "height": 1000}


def chromium_path() -> str | None:
    """The Chromium binary to drive: KVLAB_CHROMIUM / /usr/bin/chromium, else `chromium` on PATH."""
    return CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_app(lm: LoadedModel | None = None, models: list[tuple[str, str]] | None = None) -> Iterator[str]:
    """Build, queue and launch the app on 127.0.0.1 and a free port; yields its URL, closes it after."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from kvlab import ui

    demo = ui.prepare(ui.build_app(lm, models))
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, **ui.launch_options())
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@contextmanager
def serve_process(command: list[str], cwd: Path, env: dict[str, str], log_path: Path, start_s: float) -> Iterator[str]:
    """Run ``command`` (``python app.py`` in some setting) as a server on ``env``'s GRADIO_SERVER_PORT;
    yields its URL once it answers, stops it after. RuntimeError, with the log's tail, when it exits
    or does not answer within ``start_s`` seconds."""
    import time

    import httpx

    url = f"http://127.0.0.1:{env['GRADIO_SERVER_PORT']}/"
    with open(log_path, "w", encoding="utf-8") as log:
        server = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the app exited ({server.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "config", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the app did not start in {start_s:g} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextmanager
def chromium_page(profile_dir: str | Path | None = None, viewport: dict[str, int] | None = None) -> Iterator[Any]:
    """A Playwright page in a headless Chromium with a fresh profile (``profile_dir``, else a temp dir)."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    if executable is None:
        raise RuntimeError("Debian's chromium is not installed (`make browser` or apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="kvlab_chromium_") as tmp, sync_playwright() as p:
        # A fresh profile: Playwright passes it as --user-data-dir.
        context = p.chromium.launch_persistent_context(
            user_data_dir=str(profile_dir or Path(tmp) / "profile"),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=viewport or VIEWPORT,
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


#: The Explore tab's plots, the time figure last: all must be drawn before a run counts as shown.
RUN_PLOTS = ("kvlab-err", "kvlab-mass", "kvlab-kept", "kvlab-memory", "kvlab-time")

_MARK_JS = """(ids) => {
  const old = {};
  for (const id of ids) {
    const gd = document.querySelector('#' + id + ' .js-plotly-plot');
    old[id] = gd ? gd.data : null;
  }
  window.__kvlabOldPlots = old;
  // The summary's own text, not its progress overlay (a sibling status tracker).
  const s = document.querySelector('#kvlab-summary [data-testid="markdown"]');
  window.__kvlabOldSummary = s ? s.innerText : '';
  // The page's own clock: the Run click as the page receives it, and when each wait below first holds.
  window.__kvlabClick = window.__kvlabAnswersAt = window.__kvlabShownAt = null;
  const run = document.querySelector('#kvlab-run');
  if (run) run.addEventListener('click', () => { window.__kvlabClick = performance.now(); }, \
{capture: true, once: true});
}"""

_ANSWERS_JS = """([method, ratio]) => {
  const s = document.querySelector('#kvlab-summary [data-testid="markdown"]');
  const text = s ? s.innerText : '';
  if (!text || text === window.__kvlabOldSummary) return false;
  if (!text.includes(method) || !text.includes('at ' + ratio + 'x')) return false;
  for (const sel of ['#kvlab-answer-full textarea', '#kvlab-answer-compressed textarea']) {
    const el = document.querySelector(sel);
    if (!el || !el.value.trim()) return false;
  }
  window.__kvlabAnswersAt = window.__kvlabAnswersAt || performance.now();
  return true;
}"""

_SHOWN_JS = (
    """([ids, method, ratio]) => {
  if (!("""
    + _ANSWERS_JS
    + """)([method, ratio])) return false;
  const old = window.__kvlabOldPlots || {};
  for (const id of ids) {
    const gd = document.querySelector('#' + id + ' .js-plotly-plot');
    if (!gd || !gd.data || !gd._fullLayout || gd.getBoundingClientRect().height < 100) return false;
  }
  // Every run's time figure is new (its title holds the run's total), and Gradio sets all
  // outputs in one update: once it is redrawn, so are the others (a figure equal to the
  // last one, e.g. the same keys per head, is not redrawn at all).
  const gd = document.querySelector('#' + ids[ids.length - 1] + ' .js-plotly-plot');
  if (old[ids[ids.length - 1]] && old[ids[ids.length - 1]] === gd.data) return false;
  window.__kvlabShownAt = window.__kvlabShownAt || performance.now();
  return true;
}"""
)


def mark_outputs(page: Any) -> None:
    """Remember the Explore tab's current summary and figures, so that :func:`wait_for_run` waits for new ones,
    and start the page's clock at the next click on Run (see :func:`since_click`)."""
    page.evaluate(_MARK_JS, list(RUN_PLOTS))


def wait_for_answers(page: Any, method: str, ratio: float, timeout_ms: float) -> None:
    """Wait until a new run of ``method`` at ``ratio`` has its summary and both answers on the page
    (the figures follow; see :func:`mark_outputs`). Checked every animation frame."""
    page.wait_for_function(_ANSWERS_JS, arg=[method, f"{ratio:g}"], polling="raf", timeout=timeout_ms)


def wait_for_run(page: Any, method: str, ratio: float, timeout_ms: float) -> None:
    """Wait until a run of ``method`` at ``ratio`` is shown: its summary, both answers, all five plots
    drawn and the time figure redrawn (see :func:`mark_outputs`)."""
    page.wait_for_function(_SHOWN_JS, arg=[list(RUN_PLOTS), method, f"{ratio:g}"], polling=100, timeout=timeout_ms)


def since_click(page: Any) -> tuple[float, float | None]:
    """Seconds on the page's own clock from the Run click (as the page received it, after
    :func:`mark_outputs`) to the answers, and to the last figure (None until :func:`wait_for_run` held)."""
    click, answers, shown = page.evaluate("() => [window.__kvlabClick, window.__kvlabAnswersAt, window.__kvlabShownAt]")
    if click is None or answers is None:
        raise RuntimeError("the page saw no click on Run after mark_outputs, or no answers yet")
    return (answers - click) / 1000, None if shown is None else (shown - click) / 1000


def time_breakdown(page: Any) -> dict[str, str]:
    """The stages of the page's "Time per stage" figure: stage -> its bar text (seconds, or "reused ...")."""
    return page.evaluate("""() => {
      const gd = document.querySelector('#kvlab-time .js-plotly-plot');
      if (!gd || !gd.data || !gd.data.length) return {};
      const t = gd.data[0], out = {};
      t.y.forEach((name, i) => { out[name] = Array.isArray(t.text) ? String(t.text[i]) : String(t.x[i]); });
      return out;
    }""")


def pick_method(page: Any, name: str) -> None:
    """Pick ``name`` in the Explore tab's method menu, as a user does, and wait until the menu shows it."""
    page.locator("#kvlab-method input").click()
    page.get_by_role("option", name=re.compile("^" + re.escape(name) + ":")).click()
    page.wait_for_function(
        "(n) => document.querySelector('#kvlab-method input').value.startsWith(n + ':')", arg=name, timeout=10_000
    )


def browser_cpu_s() -> float:
    """CPU seconds used so far by every Chromium process of this machine (user + system, from /proc).

    The benchmark's browser shares the machine with the server: what it spends on a click is
    time the model's threads may not get (on a Space the browser is the visitor's).
    """
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process has ended
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if "chrom" in name.lower():
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total
