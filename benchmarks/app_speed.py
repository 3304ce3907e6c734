"""How fast the app answers in a real browser: `python -m benchmarks.app_speed`.

Loads the embedded model (timed, but not counted), serves the app on a free
local port, opens it in headless Chromium (Debian's /usr/bin/chromium, the
helpers of benchmarks/browser.py) and picks the bundled ~2,000-token story.
The page prepares the story as soon as it is shown (prefill, then the
default method's reference queries, in the background). Then, each time
from the click on Run, two times: until the summary and both answers are on
the page, and until every figure of the run is drawn:

1. the first run, with the default method at the default ratio, once the
   page says the story is prepared (``--think S``: click S seconds after the
   story appears instead, waiting for whatever preparation is left);
2. the method changed, nothing else: each of ``--methods`` in turn (default
   snapkv; ``all`` for every method), then back to the default method; Run
   is clicked at once, or ``--pick-think S`` seconds after the method is
   picked (the page prepares the picked method in the background);
3. the ratio changed (to ``--ratio``, default 20);
4. the same configuration again;
5. a new question (the example's second) on the same document.

Prints each time with its target (the answers: first run <= 10 s; later
runs <= 3 s for eviction methods, <= 5 s for Attention Matching, <= 1.5 s
for a repeated configuration, on an idle 2-core machine), the stage
breakdown read from the page's "Time per stage" figure, the CPU time the
benchmark's Chromium spent from the pick (or the click) to the last figure
(it shares the machine's cores with the server), and the machine's load
average at the start and the end. Nothing is made smaller for the
benchmark: the answer length and every method knob are the app's defaults.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.browser import (  # noqa: E402
    browser_cpu_s,
    chromium_page,
    mark_outputs,
    pick_method,
    serve_app,
    since_click,
    time_breakdown,
    wait_for_answers,
    wait_for_run,
)

FIRST_TARGET_S, EVICTION_TARGET_S, AM_TARGET_S, REPEAT_TARGET_S = 10.0, 3.0, 5.0, 1.5
EXAMPLE_ID = "story"


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def _set_ratio(page, ratio: float) -> None:
    box = page.locator("#kvlab-ratio input[type=number]")
    box.fill(f"{ratio:g}")
    box.press("Tab")
    page.wait_for_function(
        "(r) => document.querySelector('#kvlab-ratio input[type=number]').value === r", arg=f"{ratio:g}", timeout=10_000
    )


def _timed_run(page, method: str, ratio: float, timeout_s: float) -> tuple[float, float, dict[str, str]]:
    """Click Run: (seconds to the answers, seconds to the last figure, the page's stage breakdown).

    Timed on the page's clock from the click event the page receives: Playwright's own checks
    before it clicks (the button visible, stable, scrolled into view) are not the app's time.
    """
    mark_outputs(page)
    page.locator("#kvlab-run").click()
    wait_for_answers(page, method, ratio, timeout_s * 1000)
    wait_for_run(page, method, ratio, timeout_s * 1000)
    answers, shown = since_click(page)
    return answers, shown, time_breakdown(page)


def _set_question(page, question: str) -> None:
    box = page.locator("#kvlab-question textarea, #kvlab-question input").first
    box.fill(question)
    box.press("Tab")


def _target(method: str, label: str) -> float:
    if label.startswith("1."):
        return FIRST_TARGET_S
    if label.startswith("4."):
        return REPEAT_TARGET_S
    return AM_TARGET_S if method.startswith("attention_matching") else EVICTION_TARGET_S


@dataclass
class Step:
    """One click of the benchmark: its label, and the method, ratio and question (None: unchanged) set before it."""

    label: str
    method: str
    ratio: float
    question: str | None = None


@dataclass
class Timed:
    """One click's times from the click: to the answers, to the last figure; and its target for the answers."""

    label: str
    answers: float
    drawn: float
    target: float


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods", default="snapkv", help="comma-separated methods for the method changes, or 'all' (default: snapkv)"
    )
    parser.add_argument("--ratio", type=float, default=20, help="the ratio of the ratio change (default: 20)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument(
        "--think",
        type=float,
        default=None,
        help="click the first Run this many seconds after the story appears "
        "(default: once the page says it is prepared)",
    )
    parser.add_argument(
        "--pick-think",
        type=float,
        default=0.0,
        help="seconds between picking a method and clicking Run (the page prepares the picked "
        "method's document-only work meanwhile, e.g. KVzip's pass; default 0)",
    )
    return parser.parse_args(argv)


def _steps(method0: str, ratio0: float, changes: list[str], ratio: float, question: str) -> list[Step]:
    """The clicks, in order (the module's docstring): ``changes`` the methods picked in turn, ``ratio`` the
    ratio changed to, ``question`` the new question."""
    steps = [Step(f"1. first run: {method0} at {ratio0:g}x", method0, ratio0)]
    steps += [Step(f"2. method changed: {m} at {ratio0:g}x", m, ratio0) for m in changes if m != method0]
    steps += [Step(f"2. method changed back: {method0} at {ratio0:g}x", method0, ratio0)]
    steps += [
        Step(f"3. ratio changed: {method0} at {ratio:g}x", method0, ratio),
        Step(f"4. same configuration again: {method0} at {ratio:g}x", method0, ratio),
        Step(f"5. new question: {method0} at {ratio:g}x", method0, ratio, question),
    ]
    return steps


def _open_example(page, url: str, example, think: float | None, timeout_s: float) -> None:
    """Open the app, pick ``example`` and wait until it is shown, then until the page says it is prepared
    (``think`` None) or ``think`` seconds."""
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#kvlab-example input").click()
    page.get_by_role("option", name=re.compile(re.escape(example.title))).click()
    page.wait_for_function(
        "(q) => { const el = document.querySelector('#kvlab-question textarea, #kvlab-question input');"
        " return el && el.value === q && document.querySelector('#kvlab-text textarea').value.length > 1000; }",
        arg=example.questions[0],
        timeout=30_000,
    )
    print(f"example: {example.title} (~{example.tokens:,} tokens); question: {example.questions[0]!r}")
    shown_at = time.perf_counter()
    if think is None:
        page.wait_for_function(
            "() => { const s = document.querySelector('#kvlab-doc-status');"
            " return s && s.innerText.includes('Ready'); }",
            polling=200,
            timeout=timeout_s * 1000,
        )
    else:
        time.sleep(think)
    status = page.locator("#kvlab-doc-status").inner_text() if page.locator("#kvlab-doc-status").count() else ""
    print(
        f"clicking Run {time.perf_counter() - shown_at:.1f} s after the story appeared; "
        f"document status then: {status.strip() or '(none)'!r}"
    )


def _click_steps(page, steps: list[Step], pick_think: float, timeout_s: float) -> list[Timed]:
    """Each step's click timed, printed as it ends; the page starts at the first step's method and ratio."""
    results = []
    shown_method, shown_ratio = steps[0].method, steps[0].ratio
    for step in steps:
        cpu_start = browser_cpu_s()
        if step.method != shown_method:
            pick_method(page, step.method)
            time.sleep(pick_think)
        if step.ratio != shown_ratio:
            _set_ratio(page, step.ratio)
        if step.question is not None:
            _set_question(page, step.question)
        shown_method, shown_ratio = step.method, step.ratio
        answers, drawn, stages = _timed_run(page, step.method, step.ratio, timeout_s)
        target = _target(step.method, step.label)
        results.append(Timed(step.label, answers, drawn, target))
        verdict = "ok" if answers <= target else "MISSED"
        print(
            f"{step.label}: answers {answers:.1f} s (target <= {target:g} s: {verdict}), last figure {drawn:.1f} s; "
            f"Chromium's CPU from the pick to the last figure {browser_cpu_s() - cpu_start:.1f} s",
            flush=True,
        )
        print(
            "   stages (from the page's time figure): " + "; ".join(f"{name}: {text}" for name, text in stages.items()),
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)

    from kvlab import lab
    from kvlab.methods import REGISTRY
    from kvlab.models import get_model
    from kvlab.ui import default_method
    from kvlab.ui.common import RATIO_DEFAULT

    print(f"start: {_load()}", flush=True)
    start = time.perf_counter()
    lm = get_model()
    print(f"model loaded in {time.perf_counter() - start:.1f} s: {lm.name} (not counted)", flush=True)
    example = next((e for e in lab.examples() if e.id == EXAMPLE_ID), None)
    if example is None:
        print(f"the bundled example {EXAMPLE_ID!r} is missing", file=sys.stderr)
        return 2
    method0, ratio0 = default_method(), float(RATIO_DEFAULT)
    changes = sorted(REGISTRY) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in changes if m not in REGISTRY]
    if unknown:
        print(f"unknown method(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    steps = _steps(method0, ratio0, changes, args.ratio, example.questions[1])
    with serve_app(lm) as url, chromium_page() as page:
        _open_example(page, url, example, args.think, args.timeout)
        results = _click_steps(page, steps, args.pick_think, args.timeout)
    print(f"end: {_load()}")
    print("\n| click | answers on the page | last figure | target (answers) |\n|---|---|---|---|")
    for r in results:
        print(f"| {r.label} | {r.answers:.1f} s | {r.drawn:.1f} s | <= {r.target:g} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
