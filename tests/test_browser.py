"""The app in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

Picks a bundled example, runs a compression and checks what a user sees;
saves assets/screenshot.png for the README. Never runs `playwright install`.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

from kvlab import ui  # noqa: E402

CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium")
SCREENSHOT = Path(__file__).resolve().parent.parent / "assets" / "screenshot.png"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
RUN_TIMEOUT_MS = 240_000

pytestmark = pytest.mark.skipif(
    not (Path(CHROMIUM).exists() or shutil.which("chromium")),
    reason="Debian's chromium is not installed (`make browser` or apt-get install chromium)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(embedded):
    demo = ui.prepare(ui.build_app(embedded))
    port = _free_port()
    demo.launch(
        prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
        **ui.launch_options(),
    )
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture()
def page(tmp_path):
    with sync_api.sync_playwright() as p:
        # A fresh profile: Playwright passes it as --user-data-dir.
        context = p.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def test_explore_an_example_in_the_browser(app_url, page):
    expect = sync_api.expect
    examples = ui._examples()
    assert examples, "the bundled examples should load"
    example = examples[0]

    page.goto(app_url, wait_until="domcontentloaded")
    page.locator("#kvlab-example input").click()
    page.get_by_role("option", name=re.compile(re.escape(example.title))).click()
    expect(page.locator("#kvlab-text textarea")).to_have_value(re.compile(r"\S{20,}"), timeout=20_000)
    expect(page.locator("#kvlab-question textarea, #kvlab-question input").first).to_have_value(
        example.questions[0], timeout=20_000
    )

    # A short answer keeps the test quick.
    page.get_by_text("Advanced").first.click()
    length = page.locator("#kvlab-max-new input[type=number]")
    length.fill("16")
    length.press("Tab")

    page.locator("#kvlab-run").click()
    full = page.locator("#kvlab-answer-full textarea")
    compressed = page.locator("#kvlab-answer-compressed textarea")
    expect(compressed).to_have_value(re.compile(r"\S"), timeout=RUN_TIMEOUT_MS)
    expect(full).to_have_value(re.compile(r"\S"))
    assert full.is_visible() and compressed.is_visible()

    heatmap = page.locator("#kvlab-err .js-plotly-plot")
    expect(heatmap).to_be_visible(timeout=30_000)
    box = heatmap.bounding_box()
    assert box is not None and box["height"] > 100, box

    tokens = page.locator("#kvlab-tokens")
    expect(tokens).to_be_visible()
    expect(tokens).to_contain_text(example.text()[:30].split("\n")[0], timeout=30_000)
    expect(page.locator("#kvlab-summary")).to_contain_text("keys stored per head")

    # Fold "Advanced" away and let plotly finish drawing before the picture for the README.
    page.get_by_text("Advanced").first.click()
    page.wait_for_timeout(1500)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000
