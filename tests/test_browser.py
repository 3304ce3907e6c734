"""The app in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

Picks a bundled example, runs the default compression and checks what a user
sees; saves assets/screenshot.png for the README; then runs a small sweep in
the Compare tab. Never runs `playwright install`. The browser helpers are
shared with `python -m benchmarks.app_speed` (benchmarks/browser.py).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

from benchmarks.browser import chromium_page, chromium_path, mark_outputs, serve_app, wait_for_run  # noqa: E402
from kvlab import lab  # noqa: E402
from kvlab.ui import default_method  # noqa: E402
from kvlab.ui.compare import SWEEP_DEFAULT_METHODS, SWEEP_DEFAULT_RATIOS  # noqa: E402
from kvlab.ui.explore import RATIO_DEFAULT  # noqa: E402

SCREENSHOT = Path(__file__).resolve().parent.parent / "assets" / "screenshot.png"
RUN_TIMEOUT_MS = 240_000

pytestmark = pytest.mark.skipif(
    chromium_path() is None,
    reason="Debian's chromium is not installed (`make browser` or apt-get install chromium)",
)


@pytest.fixture(scope="module")
def app_url(embedded):
    with serve_app(embedded) as url:
        yield url


@pytest.fixture()
def page(tmp_path):
    with chromium_page(tmp_path / "chromium-profile") as page:
        yield page


def test_explore_then_compare_in_the_browser(app_url, page):
    expect = sync_api.expect
    examples = lab.examples()
    assert examples, "the bundled examples should load"
    example = examples[0]

    # The page opens on the first example and its first question: a first click on Run works.
    page.goto(app_url, wait_until="domcontentloaded")
    expect(page.locator("#kvlab-text textarea")).to_have_value(re.compile(r"\S{20,}"), timeout=20_000)
    expect(page.locator("#kvlab-question textarea, #kvlab-question input").first).to_have_value(
        example.questions[0], timeout=20_000
    )
    # ... and prepares it at once (prefill and the default method's reference queries).
    expect(page.locator("#kvlab-doc-status")).to_contain_text("Ready", timeout=RUN_TIMEOUT_MS)
    # The first visit starts with the default method at the default ratio, on the default model.
    expect(page.locator("#kvlab-method input")).to_have_value(re.compile("^" + re.escape(default_method())))
    expect(page.locator("#kvlab-model input")).to_have_value(re.compile(r"\(default\)"))

    # A short answer keeps the test quick.
    page.locator("#kvlab-advanced").get_by_text("Advanced", exact=True).first.click()
    length = page.locator("#kvlab-max-new input[type=number]")
    length.fill("16")
    length.press("Tab")

    mark_outputs(page)
    page.locator("#kvlab-run").click()
    wait_for_run(page, default_method(), RATIO_DEFAULT, RUN_TIMEOUT_MS)
    full = page.locator("#kvlab-answer-full textarea")
    compressed = page.locator("#kvlab-answer-compressed textarea")
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
    page.locator("#kvlab-advanced").get_by_text("Advanced", exact=True).first.click()
    page.wait_for_timeout(1500)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000

    # Compare: one cheap method at two ratios on the same document (its prefill is reused).
    page.get_by_role("tab", name="Compare").click()
    methods = page.locator("#kvlab-compare-methods")
    expect(methods).to_be_visible()
    for name in SWEEP_DEFAULT_METHODS:  # each checkbox's name is its value
        if name != "streaming_llm":
            methods.locator(f'input[name="{name}"]').uncheck()
    methods.locator('input[name="streaming_llm"]').check()
    ratios = page.locator("#kvlab-compare-ratios")
    for r in SWEEP_DEFAULT_RATIOS:
        if r not in (5, 10):
            ratios.locator(f'input[name="{r}"]').uncheck()
    page.locator("#kvlab-compare-run").click()
    expect(page.locator("#kvlab-compare-status")).to_contain_text("2 runs", timeout=RUN_TIMEOUT_MS)
    for plot in ("#kvlab-compare-err", "#kvlab-compare-mass", "#kvlab-compare-ppl"):
        expect(page.locator(f"{plot} .js-plotly-plot")).to_be_visible(timeout=30_000)
    expect(page.locator("#kvlab-compare-ppl")).to_contain_text("full cache")
    expect(page.locator("#kvlab-compare-table")).to_contain_text("streaming_llm")
    expect(page.locator("#kvlab-compare-csv")).to_contain_text(".csv")
    expect(page.locator("#kvlab-compare-json")).to_contain_text(".json")
