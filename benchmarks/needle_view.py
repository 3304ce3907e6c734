"""The app's task views in a real browser: Compare, Tasks, a `kvlab bench` results folder loaded, saved as a PNG.

    python -m benchmarks.needle_view --results benchmarks/results/tasks-2026-11-30 \
        [--method kvzip] [--task niah_single] [--out assets/needles.png]

Serves the app (benchmarks.browser), opens the Compare tab in headless
Chromium, switches to "Tasks with known answers", uploads the folder's
results*.jsonl files, picks the task and the heatmap's method, waits for the
accuracy chart and the needle heatmap, and saves the whole page.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.browser import chromium_page, serve_app

_DRAWN_JS = """([id, text]) => {
  const gd = document.querySelector('#' + id + ' .js-plotly-plot');
  if (!gd || !gd.data || !gd.data.length || !gd._fullLayout) return false;
  const title = (gd._fullLayout.title && gd._fullLayout.title.text) || '';
  return !text || title.includes(text);
}"""


def pick(page, elem_id: str, value: str) -> None:
    """Choose ``value`` in the Gradio dropdown ``elem_id``."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(value)
    page.get_by_role("option", name=value, exact=True).click()


def screenshot(results: Path, out: Path, method: str, task: str | None) -> None:
    files = sorted(str(p) for p in results.glob("results*.jsonl"))
    if not files:
        raise SystemExit(f"no results*.jsonl in {results}")
    with serve_app() as url, chromium_page() as page:
        page.goto(url, timeout=300_000)
        page.get_by_role("tab", name="Compare").click()
        page.get_by_label("Tasks with known answers: accuracy").check()
        page.locator("#kvlab-tasks-files input[type=file]").set_input_files(files)
        page.wait_for_function(_DRAWN_JS, arg=["kvlab-tasks-accuracy", ""], polling=500, timeout=300_000)
        if task:
            pick(page, "kvlab-tasks-task", task)
        pick(page, "kvlab-tasks-method", method)
        page.wait_for_function(_DRAWN_JS, arg=["kvlab-tasks-heatmap", method], polling=500, timeout=300_000)
        page.wait_for_timeout(1500)  # let plotly finish laying out
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="a folder written by kvlab bench")
    parser.add_argument("--method", default="kvzip", help="the method of the needle heatmap")
    parser.add_argument("--task", default=None, help="the task shown (default: the app's first)")
    parser.add_argument("--out", type=Path, default=Path("assets/needles.png"))
    args = parser.parse_args()
    screenshot(args.results, args.out, args.method, args.task)


if __name__ == "__main__":
    main()
