"""How fast the app answers in a real browser: `python -m benchmarks.app_speed`.

Loads the embedded model (timed, but not counted), serves the app on a free
local port, opens it in headless Chromium (Debian's /usr/bin/chromium, the
helpers of benchmarks/browser.py) and picks the bundled ~2,000-token story.
Then, each time from the click on Run until both answers and all five plots
of the run are on the page:

1. the first run, with the default method at the default ratio. The page
   prepares the story as soon as it is shown (prefill, then the default
   method's reference queries, in the background); with ``--think S`` the
   visitor clicks Run S seconds after the page has the story (default 0: at
   once, so the run waits for whatever preparation is left);
2. the method changed (to snapkv, by default), nothing else;
3. the ratio changed (to 20, by default), nothing else.

Prints the three times, the stage breakdown read from the page's "Time per
stage" figure, the targets (first run <= 30 s, later runs <= 10 s, on an idle
2-core machine) and the machine's load average at the start and the end.
Nothing is made smaller for the benchmark: the answer length and every
method knob are the app's defaults.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.browser import chromium_page, mark_outputs, serve_app, time_breakdown, wait_for_run  # noqa: E402

FIRST_TARGET_S, CHANGE_TARGET_S = 30.0, 10.0
EXAMPLE_ID = "story"


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def _pick_method(page, name: str) -> None:
    page.locator("#kvlab-method input").click()
    page.get_by_role("option", name=re.compile("^" + re.escape(name) + ":")).click()
    page.wait_for_function(
        "(n) => document.querySelector('#kvlab-method input').value.startsWith(n + ':')", arg=name, timeout=10_000
    )


def _set_ratio(page, ratio: float) -> None:
    box = page.locator("#kvlab-ratio input[type=number]")
    box.fill(f"{ratio:g}")
    box.press("Tab")
    page.wait_for_function(
        "(r) => document.querySelector('#kvlab-ratio input[type=number]').value === r", arg=f"{ratio:g}", timeout=10_000
    )


def _timed_run(page, method: str, ratio: float, timeout_s: float) -> tuple[float, dict[str, str]]:
    mark_outputs(page)
    start = time.perf_counter()
    page.locator("#kvlab-run").click()
    wait_for_run(page, method, ratio, timeout_s * 1000)
    elapsed = time.perf_counter() - start
    return elapsed, time_breakdown(page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="snapkv", help="the method of the second run (default: snapkv)")
    parser.add_argument("--ratio", type=float, default=20, help="the ratio of the third run (default: 20)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument("--question", default=None,
                        help="ask this instead of the example's first question (to compare runs across versions)")
    parser.add_argument("--think", type=float, default=0.0,
                        help="seconds between the story appearing and the first click on Run (default 0)")
    args = parser.parse_args(argv)

    from kvlab import lab
    from kvlab.models import get_model
    from kvlab.ui import default_method
    from kvlab.ui.explore import RATIO_DEFAULT

    print(f"start: {_load()}", flush=True)
    start = time.perf_counter()
    lm = get_model()
    print(f"model loaded in {time.perf_counter() - start:.1f} s: {lm.name} (not counted)", flush=True)
    example = next((e for e in lab.examples() if e.id == EXAMPLE_ID), None)
    if example is None:
        print(f"the bundled example {EXAMPLE_ID!r} is missing", file=sys.stderr)
        return 2
    method0, ratio0 = default_method(), float(RATIO_DEFAULT)
    runs = [
        (f"1. first run: {method0} at {ratio0:g}x", method0, ratio0, FIRST_TARGET_S),
        (f"2. method changed: {args.method} at {ratio0:g}x", args.method, ratio0, CHANGE_TARGET_S),
        (f"3. ratio changed: {args.method} at {args.ratio:g}x", args.method, args.ratio, CHANGE_TARGET_S),
    ]
    results = []
    with serve_app(lm) as url, chromium_page() as page:
        page.goto(url, wait_until="domcontentloaded")
        page.locator("#kvlab-example input").click()
        page.get_by_role("option", name=re.compile(re.escape(example.title))).click()
        page.wait_for_function(
            "(q) => { const el = document.querySelector('#kvlab-question textarea, #kvlab-question input');"
            " return el && el.value === q && document.querySelector('#kvlab-text textarea').value.length > 1000; }",
            arg=example.questions[0], timeout=30_000,
        )
        shown = page.locator("#kvlab-method input").input_value()
        print(f"example: {example.title} (~{example.tokens:,} tokens); question: {args.question or example.questions[0]!r}")
        print(f"page starts with method {shown.split(':')[0]!r} at {page.locator('#kvlab-ratio input[type=number]').input_value()}x")
        if args.question:
            box = page.locator("#kvlab-question textarea, #kvlab-question input").first
            box.fill(args.question)
            box.press("Tab")
        shown_at = time.perf_counter()
        if args.think > 0:
            time.sleep(args.think)
        status = page.locator("#kvlab-doc-status").inner_text() if page.locator("#kvlab-doc-status").count() else ""
        print(f"clicking Run {time.perf_counter() - shown_at:.1f} s after the story appeared; "
              f"document status then: {status.strip() or '(none)'!r}")
        for i, (label, method, ratio, target) in enumerate(runs):
            if i == 1:
                _pick_method(page, method)
            elif i == 2:
                _set_ratio(page, ratio)
            elapsed, stages = _timed_run(page, method, ratio, args.timeout)
            results.append((label, elapsed, target, stages))
            verdict = "ok" if elapsed <= target else "MISSED"
            print(f"{label}: {elapsed:.1f} s (target <= {target:.0f} s: {verdict})", flush=True)
            print("   stages (from the page's time figure): "
                  + "; ".join(f"{name}: {text}" for name, text in stages.items()), flush=True)
    print(f"end: {_load()}")
    print("summary: " + ", ".join(f"{elapsed:.1f} s" for _, elapsed, _, _ in results)
          + " (first run, method change, ratio change)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
