"""An answer's time when something else runs on the same cores: `python -m benchmarks.contention`.

    python -m benchmarks.contention [--method snapkv] [--ratio 10] [--repeats 2] [--duties 0,30,100]

Why: in `benchmarks.app_speed` a compressed answer takes about 1.3-1.5x what
the same call takes alone. That benchmark's Chromium and the Gradio
server's own loops run on the same two cores as the model. PyTorch's CPU
operations run on OpenMP threads that meet at a barrier after every
operation. When another process takes a core from one of those threads for
a moment, every operation waits for it.

What it does: on the embedded model, the bundled story's document, compressed
with ``--method`` at ``--ratio``, answers the story's first question the way
the app does (:func:`kvlab.runtime.decode.greedy_from_draft` with the full
cache's answer as the draft, up to the app's 48 tokens). It answers
``--repeats`` times with 2 and with 1 intra-op threads, alternating. It does
this idle, then beside a competing process that keeps one core busy for a
share of each 10 ms (``--duties``, in percent; 100 is a busy loop).
Printed: the median answer time per setting and its ratio to the idle
2-thread time of the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvlab.context import prepare_context  # noqa: E402
from kvlab.examples import load_examples  # noqa: E402
from kvlab.methods import REGISTRY, Request, get_method  # noqa: E402
from kvlab.models import get_model  # noqa: E402
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS  # noqa: E402
from kvlab.prompts import question_tokens  # noqa: E402
from kvlab.runtime.decode import greedy, greedy_from_draft  # noqa: E402

PERIOD_S = 0.010  # the competitor's cycle: busy for duty x PERIOD_S, then asleep for the rest


@contextmanager
def competitor(duty: float) -> Iterator[None]:
    """A process busy ``duty`` (0-1) of every PERIOD_S on one core while inside; nothing for duty 0."""
    if duty <= 0:
        yield
        return
    busy, idle = duty * PERIOD_S, (1 - duty) * PERIOD_S
    loop = (
        "import time\n"
        "while True:\n"
        "    t = time.perf_counter()\n"
        f"    while time.perf_counter() - t < {busy!r}: pass\n"
        f"    time.sleep({idle!r})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", loop])
    try:
        time.sleep(0.2)  # started and spinning before the first answer
        yield
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="snapkv", help="the compressed cache's method (default snapkv)")
    parser.add_argument("--ratio", type=float, default=10.0, help="its compression ratio (default 10)")
    parser.add_argument("--repeats", type=int, default=2, help="answers per setting (default 2)")
    parser.add_argument(
        "--duties",
        default="0,30,100",
        help="the competitor's busy share of one core, in percent, comma-separated (default 0,30,100)",
    )
    args = parser.parse_args(argv)
    if args.method not in REGISTRY:
        parser.error(f"unknown method {args.method!r}; choose from {', '.join(sorted(REGISTRY))}")
    try:
        duties = [float(d) / 100 for d in args.duties.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--duties takes percentages, got {args.duties!r}")
    if not duties or any(not 0 <= d <= 1 for d in duties) or args.repeats < 1 or args.ratio < 1:
        parser.error("--duties must be percentages in 0-100, --repeats at least 1, --ratio at least 1")
    one, five, _ = os.getloadavg()
    print(f"load average {one:.2f}, {five:.2f} on {os.cpu_count()} CPUs", flush=True)

    lm = get_model()
    story = next(e for e in load_examples() if e.id == "story")
    ctx = prepare_context(lm, story.text())
    question = story.questions[0]
    prompt = question_tokens(lm.tokenizer, question)
    draft = greedy(lm, ctx.full.stored, prompt, DEFAULT_MAX_NEW_TOKENS).ids
    stored = get_method(args.method).compress(Request(ctx, args.ratio, question))
    print(
        f"{lm.name}; document {ctx.length:,} tokens; {args.method} at {args.ratio:g}x; question {question!r}; "
        f"the full cache's answer ({len(draft)} tokens) as the draft",
        flush=True,
    )

    threads = torch.get_num_threads()
    counts = sorted({threads, 1}, reverse=True)
    times: dict[tuple[float, int], list[float]] = {}
    written = set()
    try:
        greedy_from_draft(lm, stored, prompt, draft, DEFAULT_MAX_NEW_TOKENS)  # warm-up
        for duty in duties:
            with competitor(duty):
                for _ in range(args.repeats):
                    for n in counts:
                        torch.set_num_threads(n)
                        start = time.perf_counter()
                        answer = greedy_from_draft(lm, stored, prompt, draft, DEFAULT_MAX_NEW_TOKENS)
                        times.setdefault((duty, n), []).append(time.perf_counter() - start)
                        written.add(tuple(answer.generation.ids))
            print(
                f"competitor at {duty:.0%}: "
                + ", ".join(
                    f"{n} thread{'s' if n > 1 else ''} {statistics.median(times[(duty, n)]):.2f} s" for n in counts
                ),
                flush=True,
            )
    finally:
        torch.set_num_threads(threads)
    base = statistics.median(times[(duties[0], counts[0])])
    print(
        "\n| competitor (one core's share) | " + " | ".join(f"{n} thread{'s' if n > 1 else ''}" for n in counts) + " |"
    )
    print("|---|" + "---|" * len(counts))
    for duty in duties:
        cells = [
            f"{statistics.median(times[(duty, n)]):.2f} s ({statistics.median(times[(duty, n)]) / base:.2f}x)"
            for n in counts
        ]
        print(f"| {duty:.0%} | " + " | ".join(cells) + " |")
    print(
        f"\nthe same answer every time: {'yes' if len(written) == 1 else f'no ({len(written)} different)'}; "
        f"ratios against {counts[0]} threads with the competitor at {duties[0]:.0%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
