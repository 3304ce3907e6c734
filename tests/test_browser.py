"""The app in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

Picks a bundled example, runs the default compression and checks what a user
sees (the right/wrong marks as coloured words); takes a screenshot (into the
test's temporary folder: ``make screenshot`` sets KVLAB_SCREENSHOT to
regenerate the README's assets/screenshot.png, and the pictures of "Your pick",
the mix's sliders and the heads' roles beside it); then runs a small sweep in the
Compare tab. Then links: a link opens the lab on its configuration, "Link to
this" gives the link back, a bad parameter gets a note. "Your pick" ranks a
learner's sentences; ``mix`` runs with a slider moved, and each head's role is
read off the token view's picker and the roles map. Never runs
`playwright install`. The browser helpers are shared with
`python -m benchmarks.app_speed` (benchmarks/browser.py).
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from urllib.parse import quote

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

from test_claims import stored_counts  # noqa: E402

from benchmarks.browser import chromium_page, chromium_path, mark_outputs, pick_method, serve_app, wait_for_run  # noqa: E402
from kvlab import lab, results  # noqa: E402
from kvlab.lab import claims  # noqa: E402
from kvlab.lab.head_roles import head_roles  # noqa: E402
from kvlab.lab.spec import run_spec  # noqa: E402
from kvlab.memo import MISSING  # noqa: E402
from kvlab.ui import default_method  # noqa: E402
from kvlab.ui.common import RATIO_DEFAULT  # noqa: E402
from kvlab.ui.compare import SWEEP_DEFAULT_METHODS, SWEEP_DEFAULT_RATIOS, SWEEP_RATIOS  # noqa: E402

#: Where the screenshot goes when regenerating the asset (``make screenshot``); else the test's tmp_path.
SCREENSHOT_ENV = "KVLAB_SCREENSHOT"
RUN_TIMEOUT_MS = 240_000

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="Debian's chromium is not installed (`make browser` or apt-get install chromium)",
    ),
]


@pytest.fixture(scope="module")
def app_url(embedded):
    with serve_app(embedded) as url:
        yield url


@pytest.fixture()
def page(tmp_path):
    with chromium_page(tmp_path / "chromium-profile") as page:
        yield page


def test_explore_then_compare_in_the_browser(app_url, page, tmp_path):
    """The first visit's Run, its answers, figures and token view; the methods' preparation; the
    screenshot; then a small sweep in the Compare tab."""
    examples = lab.examples()
    assert examples, "the bundled examples should load"
    example = examples[0]
    opens_on_the_first_example(page, app_url, example)
    run_shows_answers_figures_and_tokens(page, example)
    answers_are_marked_in_coloured_words(page, example)
    picking_a_method_prepares_only_document_work(page)
    take_screenshot(page, tmp_path)
    compare_sweeps_one_method_at_two_ratios(page)


def opens_on_the_first_example(page, app_url: str, example) -> None:
    """The page opens on the first example and its first question, prepared, with the defaults."""
    expect = sync_api.expect
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


def run_shows_answers_figures_and_tokens(page, example) -> None:
    """A short Run shows both answers, the error heatmap, the document's tokens and the summary."""
    expect = sync_api.expect
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


def answers_are_marked_in_coloured_words(page, example) -> None:
    """The first question has a gold answer: each answer is marked right or wrong, in words on a
    green or red ground (no emoji: Debian's Chromium has no emoji font and would draw a box)."""
    expect = sync_api.expect
    expect(page.locator("#kvlab-mark-full")).to_contain_text(f"(expected: {example.answers[0]})")
    for box in ("#kvlab-mark-full", "#kvlab-mark-compressed"):
        mark = page.locator(f"{box} .kvlab-mark")
        expect(mark).to_have_text(re.compile(r"^(right|wrong)$"))
        word = mark.inner_text()
        colour = mark.evaluate("el => getComputedStyle(el).backgroundColor")
        assert colour == {"right": "rgb(21, 128, 61)", "wrong": "rgb(185, 28, 28)"}[word], (word, colour)
        assert mark.bounding_box()["width"] > 20  # drawn as text, not an empty glyph


def picking_a_method_prepares_only_document_work(page) -> None:
    """Picking a method prepares it only when it has document-only work: SnapKV sends nothing (the
    status still names the last method prepared), KVzip's reconstruction pass runs at once."""
    expect = sync_api.expect
    status = page.locator("#kvlab-doc-status")
    expect(status).to_contain_text(f"{default_method()} prepared")
    pick_method(page, "snapkv")
    page.wait_for_timeout(2000)  # a preparation of an already-read document takes a fraction of this
    expect(status).to_contain_text(f"{default_method()} prepared")
    pick_method(page, "kvzip")
    expect(status).to_contain_text("kvzip prepared", timeout=RUN_TIMEOUT_MS)
    pick_method(page, default_method())


def take_screenshot(page, tmp_path: Path) -> None:
    """The page's picture (for the README when KVLAB_SCREENSHOT names where)."""
    # Fold "Advanced" away and let plotly finish drawing before the picture for the README.
    page.locator("#kvlab-advanced").get_by_text("Advanced", exact=True).first.click()
    page.wait_for_timeout(1500)
    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "screenshot.png")
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 10_000


def compare_sweeps_one_method_at_two_ratios(page) -> None:
    """Compare: one cheap method at two ratios on the same document (its prefill is reused)."""
    expect = sync_api.expect
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


def tab_is_open(page, name: str) -> None:
    sync_api.expect(page.get_by_role("tab", name=name)).to_have_attribute("aria-selected", "true", timeout=20_000)


def checked(group, values) -> set[str]:
    """The values of ``group``'s boxes that are ticked, among ``values``."""
    return {str(v) for v in values if group.locator(f'input[name="{v}"]').is_checked()}


def test_links_open_a_configuration_and_link_to_this_gives_it_back(app_url, page):
    """A link opens Compare on an example, question, methods and ratios; "Link to this" returns an
    equivalent link, which opens the same page; an Explore link sets its method and ratio."""
    expect = sync_api.expect
    story, contract = (next(e for e in lab.examples() if e.id == i) for i in ("story", "contract"))
    question = contract.questions[1]
    page.goto(
        f"{app_url}?tab=compare&example=contract&methods=snapkv,kvzip&ratios=2,7&question={quote(question)}",
        wait_until="domcontentloaded",
    )
    tab_is_open(page, "Compare")
    methods, ratios = page.locator("#kvlab-compare-methods"), page.locator("#kvlab-compare-ratios")

    def shows_the_link() -> None:
        expect(methods.locator('input[name="kvzip"]')).to_be_checked(timeout=20_000)
        assert checked(methods, ["snapkv", "kvzip", "streaming_llm", "attention_matching"]) == {"snapkv", "kvzip"}
        assert checked(ratios, SWEEP_RATIOS) == {"2"}
        expect(page.locator("#kvlab-compare-more textarea, #kvlab-compare-more input").first).to_have_value("7")
        expect(page.locator("#kvlab-question textarea, #kvlab-question input").first).to_have_value(question)
        expect(page.locator("#kvlab-text textarea")).to_have_value(re.compile(re.escape(contract.text()[:40])))
        expect(page.locator("#kvlab-link-note")).not_to_contain_text("partly")
        # The page prepares the linked document, not the default one.
        expect(page.locator("#kvlab-doc-status")).to_contain_text("Ready", timeout=RUN_TIMEOUT_MS)

    shows_the_link()
    page.locator("#kvlab-link-make").click()
    box = page.locator("#kvlab-link textarea, #kvlab-link input").first
    expect(box).to_have_value(re.compile(r"^http://127\.0\.0\.1:\d+/\?tab=compare&"), timeout=20_000)
    link = box.input_value()
    for part in ("example=contract", "methods=snapkv,kvzip", "ratios=2,7"):
        assert part in link, link

    page.goto(link, wait_until="domcontentloaded")
    tab_is_open(page, "Compare")
    shows_the_link()

    page.goto(
        f"{app_url}?example=story&method=kvzip&ratio=10&question={quote(story.questions[2])}&tab=explore",
        wait_until="domcontentloaded",
    )
    tab_is_open(page, "Explore")
    expect(page.locator("#kvlab-method input")).to_have_value(re.compile(r"^kvzip"), timeout=20_000)
    expect(page.locator("#kvlab-ratio input[type=number]")).to_have_value("10")
    expect(page.locator("#kvlab-question textarea, #kvlab-question input").first).to_have_value(story.questions[2])

    # A link with a method's knob sets that knob (through the load's hidden box: kvlab.ui.knobs.link_panel)
    # and prepares the method with it; the method's other knobs keep their defaults (a link names only
    # the knobs that differ from them).
    page.goto(
        f"{app_url}?tab=explore&example=story&method=attention_matching:budgets=uniform&ratio=5",
        wait_until="domcontentloaded",
    )
    expect(page.locator("#kvlab-method input")).to_have_value(re.compile(r"^attention_matching"), timeout=20_000)
    expect(page.locator("#kvlab-doc-status")).to_contain_text("Ready", timeout=RUN_TIMEOUT_MS)
    page.locator("#kvlab-link-make").click()  # "Link to this" reads the knobs the page holds
    expect(box).to_have_value(re.compile(r"method=attention_matching(%3A|:)budgets(%3D|=)uniform&"), timeout=20_000)


def test_a_published_configuration_sets_the_knob_panel_and_another_method_relabels_it(app_url, page):
    """Attention Matching's preset menu sets the preset's knobs in the panel and in what Run and "Link to this"
    read; a pick of KVzip relabels the panel to KVzip's knobs at their defaults, shows the selection
    wrappers' fold, and the link then carries no knob (the first method's are gone)."""
    from kvlab.catalog import knobs

    expect = sync_api.expect
    name = "AM-HighestAttnKeys-ss-plus-repeat"
    page.goto(app_url, wait_until="domcontentloaded")
    expect(page.locator("#kvlab-doc-status")).to_contain_text("Ready", timeout=RUN_TIMEOUT_MS)
    page.locator("#kvlab-advanced").get_by_text("Advanced", exact=True).first.click()
    if default_method() != "attention_matching":
        pick_method(page, "attention_matching")
    page.locator("#kvlab-preset input").click()
    page.get_by_role("option", name=name).click()
    expect(page.get_by_label("on_policy", exact=True)).to_be_checked(timeout=20_000)
    page.locator("#kvlab-link-make").click()
    box = page.locator("#kvlab-link textarea, #kvlab-link input").first
    expect(box).to_have_value(re.compile(r"on_policy(%3D|=)true", re.IGNORECASE), timeout=20_000)
    for knob in ("self_study_weight", "max_queries"):
        assert knob in box.input_value(), box.input_value()

    pick_method(page, "kvzip")
    expect(page.get_by_label("on_policy", exact=True)).to_have_count(0, timeout=20_000)
    for knob in knobs("kvzip"):
        if not knob.wrapper:
            expect(page.get_by_text(knob.name, exact=True).first).to_be_visible()
    expect(page.get_by_text("Selection wrappers", exact=False).first).to_be_visible()
    page.locator("#kvlab-link-make").click()
    expect(box).to_have_value(re.compile(r"method=kvzip&"), timeout=20_000)
    assert "max_queries" not in box.input_value() and "on_policy" not in box.input_value()


def test_a_bad_link_opens_the_defaults_with_a_note(app_url, page):
    """Unknown names and out-of-range numbers are dropped with a note; what is valid still applies."""
    expect = sync_api.expect
    page.goto(f"{app_url}?tab=generate&methods=h2o,nosuch&budget=-3&colour=red", wait_until="domcontentloaded")
    note = page.locator("#kvlab-link-note")
    expect(note).to_contain_text("partly understood", timeout=20_000)
    for part in ("nosuch", "budget", "colour"):
        expect(note).to_contain_text(part)
    tab_is_open(page, "Generate")
    gen = page.locator("#kvlab-gen-methods")
    expect(gen.locator('input[name="h2o"]')).to_be_checked()
    expect(gen.locator('input[name="streaming_llm"]')).not_to_be_checked()
    expect(page.locator("#kvlab-gen-budget input")).to_have_value("0")  # the default budget stays

    page.goto(f"{app_url}?tab=nowhere&method=nosuch&ratio=abc", wait_until="domcontentloaded")
    expect(note).to_contain_text("nowhere", timeout=20_000)
    tab_is_open(page, "Explore")
    expect(page.locator("#kvlab-method input")).to_have_value(re.compile("^" + re.escape(default_method())))
    expect(page.locator("#kvlab-ratio input[type=number]")).to_have_value(str(RATIO_DEFAULT))


#: A short document for "Your pick" (a quick run of every rival): two short sentences hold the answer.
PICK_DOCUMENT = (
    "The lighthouse keeper is named Ada.\n"
    "The harbour road runs along the old stone wall past the fish market and the ferry office.\n"
    "Ada keeps a grey cat.\n"
    "Every spring the town paints the benches on the promenade in bright blue and white stripes.\n"
)


def test_a_learner_ticks_two_sentences_runs_and_sees_the_rank(app_url, page, tmp_path):
    """The "Your pick" tab: the document split into sentences, two ticked within the budget (the
    counter follows), Run, and the pick's place among the methods."""
    expect = sync_api.expect
    page.goto(app_url, wait_until="domcontentloaded")
    page.get_by_role("tab", name="Your pick").click()
    page.locator("#kvlab-pick-text textarea").fill(PICK_DOCUMENT)
    page.locator("#kvlab-pick-question textarea, #kvlab-pick-question input").first.fill("Who is the keeper?")
    ratio = page.locator("#kvlab-pick-ratio input[type=number]")
    ratio.fill("2")
    ratio.press("Tab")
    page.locator("#kvlab-pick-read").click()
    sentences = page.locator("#kvlab-pick-sentences")
    expect(sentences.locator('input[name="s3"]')).to_be_visible(timeout=RUN_TIMEOUT_MS)
    counter = page.locator("#kvlab-pick-counter")
    expect(counter).to_contain_text("picked 0 of")
    sentences.locator('input[name="s0"]').check()
    sentences.locator('input[name="s2"]').check()
    expect(counter).to_contain_text(re.compile(r"picked [1-9]\d* of \d+ tokens \(budget at 2x\)"))
    page.locator("#kvlab-pick-run").click()
    expect(page.locator("#kvlab-pick-rank")).to_contain_text(
        re.compile(r"Your pick ranks \d+(st|nd|rd|th) of 8"), timeout=RUN_TIMEOUT_MS
    )
    expect(page.locator("#kvlab-pick-table")).to_contain_text("your pick")
    take_asset(page, tmp_path, "pick.png", [page.locator("#kvlab-pick-text"), page.locator("#kvlab-pick-table")])


def test_a_learner_mixes_scores_then_reads_each_heads_role(app_url, page, tmp_path, embedded):
    """Explore with ``mix``: its w_recency slider moved by keyboard, Run, the answers and a summary naming mix
    (the run stored under the slider's weight, not the default one); then each KV head's role, in the token
    view's picker label and under it once the picker moves, against kvlab.lab.head_roles on the same document
    and question, and the roles map drawn."""
    expect = sync_api.expect
    example = lab.examples()[0]
    page.goto(app_url, wait_until="domcontentloaded")
    expect(page.locator("#kvlab-question textarea, #kvlab-question input").first).to_have_value(
        example.questions[0], timeout=20_000
    )
    # The page's own opening work done (its link applied, then the document prepared) before the learner acts.
    expect(page.locator("#kvlab-doc-status")).to_contain_text("Ready", timeout=RUN_TIMEOUT_MS)
    page.locator("#kvlab-advanced").get_by_text("Advanced", exact=True).first.click()
    length = page.locator("#kvlab-max-new input[type=number]")
    length.fill("16")
    length.press("Tab")
    pick_method(page, "mix")
    recency = page.get_by_label("range slider for w_recency")
    recency.focus()
    for _ in range(10):  # 1.0 -> 0.5 in the knob's steps of 0.05, as a keyboard user moves it
        recency.press("ArrowLeft")
    expect(page.get_by_label("number input for w_recency")).to_have_value("0.5")

    mark_outputs(page)
    page.locator("#kvlab-run").click()
    wait_for_run(page, "mix", RATIO_DEFAULT, RUN_TIMEOUT_MS)
    summary = re.compile(rf"mix at {RATIO_DEFAULT:g}x .* keys stored per head")
    expect(page.locator("#kvlab-summary")).to_contain_text(summary)
    for box in ("#kvlab-answer-full textarea", "#kvlab-answer-compressed textarea"):
        expect(page.locator(box)).to_have_value(re.compile(r"\S"))
    model = lab.model_choices()[0][1]
    stored = [  # the store holds the run of the slider's weight, and no run of the default weights
        results.store().get(
            run_spec(example.text(), None, "mix", RATIO_DEFAULT, example.questions[0], 16, o, model).key()
        )
        for o in ({"w_recency": 0.5}, {})
    ]
    assert stored[0] is not MISSING and stored[1] is MISSING, stored_runs("mix")
    assert len(stored_runs("mix")) == 1
    # The mix's weights as set, and the run's summary and answers.
    weights = [page.locator("#kvlab-method"), page.get_by_label("range slider for w_knorm")]
    answers = [page.locator("#kvlab-summary"), page.locator("#kvlab-answer-compressed")]
    take_asset(page, tmp_path, "mix.png", weights, answers)

    ctx, _ = lab.prepared_context(embedded, example.text())
    roles = head_roles(ctx, example.questions[0])
    picker = page.locator("#kvlab-head")
    expect(picker).to_contain_text(re.compile(r"KV head \(layer \d+: 0 (retrieval|streaming) \d+%"), timeout=30_000)
    layer_slider = page.locator("#kvlab-layer input[type=range]")
    layer_slider.press("Home")  # layer 0, then 1: the picker's label follows the layer
    layer_slider.press("ArrowRight")
    expect(picker).to_contain_text("KV head (layer 1: 0 ")
    layer_text, heads = re.search(r"KV head \(layer (\d+): ([^)]*)\)", picker.inner_text()).groups()
    layer, shown = int(layer_text), re.findall(r"(\d+) (\w+) (\d+)%", heads)
    assert [(int(h), role) for h, role, _ in shown] == list(enumerate(roles.labels[layer])), (heads, roles.labels)
    for (_, _, percent), share in zip(shown, roles.shares[layer]):
        assert abs(int(percent) - 100 * share) <= 0.5 + 1e-6, (heads, roles.shares[layer])
    picker.locator("input[type=range]").press("ArrowRight")  # KV head 1: its role in a line under the picker
    expect(picker).to_contain_text(f"layer {layer}, head 1: {roles.labels[layer][1]}, ")
    roles_map = page.locator("#kvlab-roles .js-plotly-plot")  # [KV head][layer]: % beyond, marked R or S
    expect(roles_map).to_be_visible()
    percents, marks = roles_map.evaluate("gd => [gd.data[0].z, gd.data[0].text]")
    assert marks == [[row[h][0].upper() for row in roles.labels] for h in range(len(roles.labels[0]))]
    by_head = [100 * row[h] for h in range(len(marks)) for row in roles.shares]
    assert [p for row in percents for p in row] == pytest.approx(by_head, abs=1e-4)
    figures = [page.locator("#kvlab-kept"), page.locator("#kvlab-roles")]
    picker_row = [page.locator("#kvlab-layer"), page.locator("#kvlab-intensity")]
    take_asset(page, tmp_path, "head-roles.png", figures, picker_row)


def stored_runs(method: str) -> list[dict]:
    """The keys of ``method``'s runs in this test's result store, read from its entries' headers (the
    document, model and code shortened): what a failing check on the store reports."""
    directory = results.store().directory
    found = []
    for path in sorted(directory.glob(f"*/*{results.SUFFIX}")) if directory is not None else []:
        if path.name.startswith("."):  # an entry being written
            continue
        header = path.read_bytes().split(b"\n", 2)[1]  # after kvlab.results' magic line
        key = json.loads(json.loads(header)["key"])
        if key["method"] == method:
            found.append({**key, "document": key["document"][:8], "model": key["model"][:8], "code": key["code"][-8:]})
    return found


def take_asset(page, tmp_path: Path, name: str, *parts: list) -> None:
    """A picture named ``name``: each of ``parts`` (a list of elements) clipped to its elements' joint box, the
    parts one under the other; beside KVLAB_SCREENSHOT's file when that is set (the README's assets, ``make
    screenshot``), else in the test's tmp_path."""
    from PIL import Image

    page.wait_for_timeout(500)  # plotly's last redraw
    page.evaluate("window.scrollTo(0, 0)")  # the boxes below then in the page's coordinates, as full_page clips
    pictures = []
    for elements in parts:
        boxes = [e.bounding_box() for e in elements]
        x, y = max(min(b["x"] for b in boxes) - 8, 0), max(min(b["y"] for b in boxes) - 8, 0)
        right, bottom = (max(b[at] + b[size] for b in boxes) + 8 for at, size in (("x", "width"), ("y", "height")))
        clip = {"x": x, "y": y, "width": right - x, "height": bottom - y}
        pictures.append(Image.open(io.BytesIO(page.screenshot(clip=clip, full_page=True))))
    sheet = Image.new("RGB", (max(p.width for p in pictures), sum(p.height for p in pictures)), "white")
    for i, picture in enumerate(pictures):
        sheet.paste(picture, (0, sum(p.height for p in pictures[:i])))
    folder = Path(os.environ[SCREENSHOT_ENV]).parent if os.environ.get(SCREENSHOT_ENV) else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    sheet.save(folder / name, optimize=True)
    assert (folder / name).stat().st_size > 10_000


def test_the_claims_show_each_stored_figure_a_verdict_and_how_to_reproduce_it(app_url, page):
    """Learn's Claims section: one block per claim, each with its measured figure, a verdict and a command
    (and a link where the page can open it); the figures hold the counts of the stored rows
    (assets/claims.json), counted by the test itself."""
    expect = sync_api.expect
    page.goto(app_url + "?tab=learn", wait_until="domcontentloaded")
    blocks = page.locator("#kvlab-claims .kvlab-claim")
    expect(blocks).to_have_count(len(claims.CLAIMS), timeout=60_000)
    for claim in claims.CLAIMS:
        block = page.locator(f"#kvlab-claim-{claim.id}")
        for part in ("figure", "verdict", "command"):
            expect(block.locator(f".kvlab-claim-{part}")).to_have_text(re.compile(r"\S{3,}"))
        expect(block.locator(".kvlab-claim-verdict")).not_to_have_text("Not checked yet.")
        if claim.link:
            assert block.get_by_role("link", name="open it on this page").get_attribute("href").endswith(claim.link)
    for claim_id, expected in stored_counts(claims.load()):
        expect(page.locator(f"#kvlab-claim-{claim_id} .kvlab-claim-figure")).to_contain_text(expected)
