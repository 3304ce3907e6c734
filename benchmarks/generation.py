"""Generation under a bounded cache on the embedded model: the copy task at several budgets.

    python -m benchmarks.generation [--new-tokens 1000] [--budgets 128,256,512] [--codes N]
    python -m benchmarks.generation --screenshot assets/generate.png [--new-tokens 120] [--budgets 64]

The prompt is the copy task (kvlab.tasks.copying) with enough codes for about
``--new-tokens`` written tokens. The unbounded cache writes once per budget
(lab.generate runs it as the reference); each row gives a method's first
difference from the unbounded text, the log-perplexity of that text under its
cache (teacher-forced), the task's F1 and codes copied in order, and its tokens
per second. Rows are printed as soon as a budget is done. ``--screenshot`` instead
serves the app, runs its Generate tab (default prompt and budget) in headless
Chromium (benchmarks.browser) and saves the page.
"""

from __future__ import annotations

import argparse
import time

from kvlab.lab.generate import generate, generation_record
from kvlab.tasks.copying import codes_for_tokens, copy_prompt, make_codes


def screenshot(path: str, new_tokens: int, budget: int | None) -> None:
    """The Generate tab after one run with its default prompt (and budget, unless given), saved as a PNG at ``path``."""
    from gradio import networking

    from benchmarks.browser import chromium_page, serve_app
    from kvlab.models import get_model

    # Gradio probes its own URL with a 3 s timeout before serving; on a busy CPU the probe
    # fails though the server is up, so the page load below does the waiting instead.
    networking.url_ok = lambda url: True
    with serve_app(get_model()) as url, chromium_page() as page:
        page.goto(url, timeout=300_000)
        page.get_by_role("tab", name="Generate").click()
        page.locator("#kvlab-gen-max-new input[type=number]").fill(str(new_tokens))
        page.locator("#kvlab-gen-max-new input[type=number]").press("Enter")
        if budget:
            page.locator("#kvlab-gen-budget input").fill(str(budget))
        page.locator("#kvlab-gen-run").click()
        page.wait_for_function(
            "() => { const gd = document.querySelector('#kvlab-gen-beacons .js-plotly-plot');"
            " return gd && gd.data && gd.data.length > 0; }",
            polling=500,
            timeout=30 * 60 * 1000,
        )
        page.wait_for_timeout(1500)  # let plotly finish laying out
        page.screenshot(path=path, full_page=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=1000)
    parser.add_argument("--budgets", default="128,256,512")
    parser.add_argument("--codes", type=int, default=None, help="codes in the list (default: new tokens / 5)")
    parser.add_argument("--screenshot", default=None, help="save the Generate tab after one run to this PNG instead")
    args = parser.parse_args()
    if args.screenshot:
        screenshot(args.screenshot, args.new_tokens, int(args.budgets) if args.budgets.isdigit() else None)
        return
    codes = make_codes(args.codes or codes_for_tokens(args.new_tokens), seed=0)
    start = time.perf_counter()
    print(f"copy task: {len(codes)} codes; up to {args.new_tokens} new tokens", flush=True)
    print(
        f"{'budget':>6} {'method':<16} {'diverges at':>11} {'log-ppl':>8} {'task F1':>8} {'in order':>9} "
        f"{'shrinks':>7} {'max keys':>8} {'tok/s':>6}",
        flush=True,
    )
    for budget in (int(b) for b in args.budgets.split(",")):
        g = generate(prompt=copy_prompt(codes), budget=budget, max_new_tokens=args.new_tokens)
        record = generation_record(g)
        for m in record["methods"]:
            diverges = "-" if m["divergence"] is None else str(m["divergence"])
            print(
                f"{budget:>6} {m['method']:<16} {diverges:>11} {m['logppl']:>8.3f} {m['task_f1']:>8.3f} "
                f"{m['task_in_order']:>5}/{len(codes):<3} {m['events']:>7} {m['max_keys']:>8} "
                f"{m['tokens_per_s']:>6.1f}",
                flush=True,
            )
        print(
            f"  (prompt {g.prompt_tokens} tokens, unbounded wrote {len(g.reference.run.ids)}; {g.wall_s:.0f} s)",
            flush=True,
        )
    print(f"wall time {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
