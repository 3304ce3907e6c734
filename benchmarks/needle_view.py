"""Needles in a real browser: the app's task views with a `kvlab bench` folder loaded, or one needle traced.

    python -m benchmarks.needle_view --results benchmarks/results/tasks-2026-11-30 \
        [--method kvzip] [--task niah_single] [--out assets/needles.png]
    python -m benchmarks.needle_view --item 0 --haystack prose --method attention_matching:self_study_weight=4 \
        --ratio 5 [--task niah_single] [--needle-values number] [--seed 0] [--length 1500] \
        [--json trace.json] [--html trace.html] [--out assets/needle-trace.png] [--table]

With ``--results``: serves the app (benchmarks.browser), opens the Compare
tab in headless Chromium, switches to "Tasks with known answers", uploads the
folder's results*.jsonl files, picks the task and the heatmap's method, waits
for the accuracy chart and the needle heatmap, and saves the whole page.

With ``--item``: builds that item of the task (as ``kvlab bench`` does, same
seed, length, haystack and value shape), compresses its document with the
method at the ratio, and follows the needle sentence's tokens through the
compression (kvlab.lab.fates.trace_needle): each token's fate per layer and
KV head, its share of the held-out queries' attention in the full and the
compressed cache, and the log-probability of each token of the full cache's
answer under both. Writes the trace as JSON, the figure
(kvlab.figures.needle_figure) as HTML and as a PNG drawn by headless
Chromium, and with ``--table`` prints it as markdown.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

from benchmarks.browser import chromium_page, serve_app
from kvlab.tasks.synthetic import HAYSTACKS, VALUE_SHAPES

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


def needle_span(document: str, value: str) -> str:
    """The sentence of ``document`` that holds ``value`` (the needle), from its start to the value's full stop."""
    found = re.search(r"[^.!?\n]*" + re.escape(value) + r"\.?", document)
    if found is None:
        raise ValueError(f"the value {value!r} is not in the item's document")
    return found.group(0).strip()


def trace(args: argparse.Namespace) -> dict:
    """The ``--item`` mode's trace, as plain data (NeedleTrace.to_dict plus the item's identity).
    ValueError (TaskError, MethodError) for a task, method, knob value or item that does not exist."""
    from kvlab.bench_command import method_specs
    from kvlab.context import prepare_context
    from kvlab.lab.fates import trace_needle
    from kvlab.methods import Request
    from kvlab.models import get_model
    from kvlab.tasks.runner import item_prompt_ids
    from kvlab.tasks.task_registry import build_items

    lm = get_model()
    spec = method_specs([args.method], [])[0]
    items = build_items(
        args.task or "niah_single", lm, args.item + 1, args.seed, args.length, args.haystack, args.needle_values
    )
    if len(items) <= args.item:
        raise ValueError(f"{args.task or 'niah_single'} has {len(items)} items, no item {args.item}")
    item = items[args.item]
    ctx = prepare_context(lm, item.document)
    stored = spec.instantiate().compress(Request(ctx, args.ratio, item.question))
    out = trace_needle(
        ctx,
        stored,
        item_prompt_ids(lm, item),
        needle_span(item.document, item.answers[0]),
        item.answers[0],
        item.max_new_tokens,
        args.method,
        args.ratio,
    ).to_dict()
    if not any(out["answer_value"]):
        raise ValueError(
            f"the full cache's answer {out['answer_full']!r} misses the needle "
            f"{item.answers[0]!r}: nothing to follow; choose another item"
        )
    return {
        "item_id": item.item_id,
        "depth": item.depth,
        "haystack": args.haystack,
        "model": lm.name,
        "doc_tokens": ctx.doc_len,
        **out,
    }


def draw(data: dict, out: Path | None, html_path: Path | None) -> None:
    """The trace's figure as HTML (plotly inlined: no network) and as a PNG of that page in headless Chromium."""
    from kvlab.figures.needle import needle_figure

    page_html = needle_figure(data).to_html(include_plotlyjs=True, full_html=True)
    if html_path:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(page_html, encoding="utf-8")
        print(f"wrote {html_path}")
    if out:
        with tempfile.TemporaryDirectory() as tmp, chromium_page(viewport={"width": 1400, "height": 1200}) as page:
            source = Path(tmp) / "trace.html"
            source.write_text(page_html, encoding="utf-8")
            page.goto(source.as_uri())
            page.wait_for_function(
                "() => { const gd = document.querySelector('.js-plotly-plot'); return gd && gd._fullLayout; }",
                timeout=60_000,
            )
            page.wait_for_timeout(500)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--results", type=Path, help="a folder written by kvlab bench: screenshot the app's Tasks view")
    mode.add_argument("--item", type=int, help="trace the needle of this item (0-based) of the task")
    parser.add_argument(
        "--method",
        default="kvzip",
        help="the method of the needle heatmap; with --item, name[:knob=value...] as in kvlab bench",
    )
    parser.add_argument(
        "--task", default=None, help="the task shown (default: the app's first; with --item niah_single)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the PNG (default assets/needles.png; with --item none unless given)"
    )
    parser.add_argument("--ratio", type=float, default=5.0, help="with --item: the compression ratio (default 5)")
    parser.add_argument("--haystack", choices=HAYSTACKS, default="noise", help="with --item: the filler")
    parser.add_argument(
        "--needle-values", choices=VALUE_SHAPES, default="number", help="with --item: the needle value's shape"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", type=int, default=1500, help="with --item: document tokens at most (default 1500)")
    parser.add_argument("--json", type=Path, default=None, help="with --item: write the trace here")
    parser.add_argument("--html", type=Path, default=None, help="with --item: write the figure's HTML here")
    parser.add_argument("--table", action="store_true", help="with --item: print the trace as markdown tables")
    args = parser.parse_args()
    if args.results is not None:
        screenshot(args.results, args.out or Path("assets/needles.png"), args.method, args.task)
        return
    if args.item < 0 or args.ratio < 1:
        parser.error("--item must be 0 or more and --ratio at least 1")
    try:
        data = trace(args)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.table:
        from kvlab.figures.needle import needle_table

        print(needle_table(data))
    print(f"full: {data['answer_full']!r}; compressed: {data['answer_compressed']!r}")
    draw(data, args.out, args.html)


if __name__ == "__main__":
    main()
