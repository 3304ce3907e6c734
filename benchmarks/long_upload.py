"""A long document uploaded through the page's API, prepared in the background, reloaded meanwhile, then run.

    python -m benchmarks.long_upload                          # Gemma 3 270M, 32,000 tokens of Walden
    python -m benchmarks.long_upload --tokens 16000 --reload-after 30
    python -m benchmarks.long_upload --tokens 16000 --needle-depths 2     # then the page's needle test
    python -m benchmarks.long_upload --tokens 16000 --knobs on_policy=true:self_study_weight=1:max_queries=50000

What a visitor of a CPU Space does with a long document, through the API the page itself calls
(gradio_client on a server started here): ``/load_file`` uploads the file, ``/prepare`` (which the
page chains after an upload) starts the document's preparation for Attention Matching in the
background (kvlab.lab.background); after ``--reload-after`` seconds the page is reloaded (its request
cancelled, as a closed tab's is) and the reloaded page's ``/prepare`` joins the same preparation;
then Run (``/run``, Attention Matching at ``--ratio``, with ``--knobs`` as the page's knobs box holds them:
the paper's recipe's compression is long work the background job does too) is clicked at once and waits
for it. Printed:
each progress line the waiting pages showed (with the seconds since the upload), whether the reload
joined the running preparation (the prefills counted), every request's outcome (none may be cut off
at ``KVLAB_MAX_REQUEST_S``), the time from upload to answer against the prefill's own time (measured in
the same run), and the full and compressed caches' answers to the needle test's question about a number
hidden at 40% depth (kvlab.tasks.synthetic.needle_items; the document is the first ``--tokens`` tokens of
a public-domain book of the evaluation data's prose/ folder, ``$KVLAB_DATA``).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from benchmarks.browser import serve_app
from benchmarks.long_context import book_prefix
from kvlab import context_store
from kvlab.lab import background
from kvlab.models import GEMMA3_270M, get_model
from kvlab.tasks.marking import contains_match
from kvlab.tasks.synthetic import needle_items

DEPTH = 0.4


class Shown:
    """Prints each progress line the given gradio_client jobs show, once, with the seconds since ``start``."""

    def __init__(self, start: float) -> None:
        self.start, self.lines = start, set()

    def say(self, line: str) -> None:
        print(f"  {time.monotonic() - self.start:7.1f} s  {line}", flush=True)

    def watch(self, *jobs) -> None:  # noqa: ANN002 - gradio_client jobs
        for job in jobs:
            for update in job.status().progress_data or []:
                line = update.desc or ""
                if line and line not in self.lines:
                    self.lines.add(line)
                    self.say(line)


def visit(url: str, path: Path, question: str, args: argparse.Namespace) -> tuple[str, bool, str, tuple, float]:
    """A visitor's long upload: upload, prepare, reload after ``args.reload_after`` s, prepare again and Run
    at once. Returns (the document as the page read it, whether the reload joined the running preparation,
    the reloaded page's /prepare status, /run's outputs, seconds from the upload to the answer)."""
    import gradio_client

    start = time.monotonic()
    shown = Shown(start)
    page = gradio_client.Client(url, verbose=False)
    body = page.predict(gradio_client.handle_file(str(path)), api_name="/load_file")
    prepare = dict(
        text=body, method=args.method, model=args.model, question=question, max_new_tokens=24, knobs=args.knobs
    )
    first = page.submit(api_name="/prepare", **prepare)
    while time.monotonic() - start < args.reload_after and not first.done():
        shown.watch(first)
        time.sleep(1.0)
    job = background.PREPARATIONS.running(body, args.model)
    first.cancel()
    shown.say("the page reloads (its /prepare cancelled)")
    reloaded = gradio_client.Client(url, verbose=False)
    again = reloaded.submit(api_name="/prepare", **prepare)
    run = reloaded.submit(
        text=body,
        method=args.method,
        ratio=args.ratio,
        question=question,
        max_new_tokens=24,
        model=args.model,
        knobs=args.knobs,
        api_name="/run",
    )
    joined = job is not None and background.PREPARATIONS.running(body, args.model) is job
    while not (again.done() and run.done()):
        shown.watch(again, run)
        time.sleep(1.0)
    status, out = again.result(), run.result()
    return body, joined, status, out, time.monotonic() - start


def needle_test(url: str, body: str, args: argparse.Namespace) -> None:
    """The page's needle test on the uploaded document (each depth's document prepared in the background
    first): its progress lines, its status line and time, the found-or-not of every run."""
    import gradio_client

    start = time.monotonic()
    shown = Shown(start)
    shown.say(f"the needle test: {args.needle_depths} depths, {args.needle_methods} at {args.ratio:g}x")
    job = gradio_client.Client(url, verbose=False).submit(
        text=body,
        methods=args.needle_methods.split(","),
        ratios=f"{args.ratio:g}",
        depths=args.needle_depths,
        model=args.model,
        api_name="/needle_test",
    )
    while not job.done():
        shown.watch(job)
        time.sleep(1.0)
    out = job.result()
    print(f"\nneedle test: {out[0].splitlines()[0][:300]} ({time.monotonic() - start:.1f} s)")
    table = out[5]
    for row in table["data"]:
        print("  " + " | ".join(str(cell) for cell in row)[:200])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=GEMMA3_270M)
    p.add_argument("--tokens", type=int, default=32000, help="the document's length in the model's tokens")
    p.add_argument("--book", default="walden.txt", help="a file of the evaluation data's prose/ folder")
    p.add_argument("--method", default="attention_matching")
    p.add_argument("--ratio", type=float, default=10.0)
    p.add_argument("--knobs", default="", help="the method's knobs, knob=value:knob=value (as the page's knobs box)")
    p.add_argument("--reload-after", type=float, default=60.0, help="seconds after the upload the page reloads")
    p.add_argument(
        "--needle-depths",
        type=int,
        default=0,
        help="then run the page's needle test on the document at this many depths (0: not)",
    )
    p.add_argument("--needle-methods", default="snapkv", help="the needle test's methods, comma-separated")
    args = p.parse_args(argv)

    lm = get_model(args.model)
    # The needle test's own needle (the page's needle test puts the same kind in the user's document).
    (needle,) = needle_items(book_prefix(lm, args.book, args.tokens), [DEPTH], seed=0)
    prefills: list[float] = []
    real_prepare = context_store.prepare_context

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the store's own call
        prefills.append(time.monotonic())
        return real_prepare(*args, **kwargs)

    context_store.prepare_context = counted
    method = f"{args.method}:{args.knobs}" if args.knobs else args.method
    print(f"{lm.name}; {args.book}, {args.tokens:,} tokens + a needle at {DEPTH:.0%}; {method} at {args.ratio:g}x")
    with tempfile.TemporaryDirectory() as tmp, serve_app(lm, [(lm.name, args.model)]) as url:
        path = Path(tmp) / "long.txt"
        path.write_text(needle.document, encoding="utf-8")
        body, joined, status, out, total = visit(url, path, needle.question, args)
        ctx = context_store.CONTEXTS.peek(lm, body)
        if args.needle_depths:
            needle_test(url, body, args)
    full, compressed = (o["value"] if isinstance(o, dict) else o for o in out[1:3])
    answers = needle.answers
    print(f"\nreload joined the running preparation: {'yes' if joined else 'no'}; prefills run: {len(prefills)}")
    print(f"/prepare after the reload: {status}")
    print(f"/run: {out[0].splitlines()[0][:400]}")
    timing = re.search(r"Prefill [^\n]*? in all\.", out[0])
    print(f"/run's timings: {timing.group(0) if timing else '(not in its summary)'}")
    print(f"question: {needle.question} (expected {answers[0]})")
    print(f"full cache's answer: {full!r} ({'right' if contains_match(full, answers) else 'wrong'})")
    print(f"compressed answer:   {compressed!r} ({'right' if contains_match(compressed, answers) else 'wrong'})")
    if ctx is not None:
        budget = context_store.CONTEXTS.budget
        print(f"the document's context holds {ctx.nbytes / 2**30:.2f} GiB of a {budget / 2**30:.2f} GiB budget")
        print(f"upload to answer: {total:.1f} s = {total / ctx.prefill_s:.2f} x the prefill's {ctx.prefill_s:.1f} s")
    else:
        print(f"upload to answer: {total:.1f} s")


if __name__ == "__main__":
    main()
