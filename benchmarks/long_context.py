"""How the lab's costs grow with the document: prefill, each method's preparation and compression, memory.

    python -m benchmarks.long_context --model gemma3-270m --lengths 2048,4096,8192,16384,32768
    python -m benchmarks.long_context --lengths 2048,4096,8192          # the embedded model
    python -m benchmarks.long_context --methods attention_matching --ratio 10 --json out.json

For each length, the first that many tokens of a public-domain book (the evaluation data's ``prose/``,
``--book``) are prepared as the page prepares a document (kvlab.context.prepare_context: the prefill,
timed), then the repeat pass (the reference text KVzip and Attention Matching read, timed on its own),
then for each method: the rest of its preparation (``Method.prepare``; nothing for these three once the
repeat pass is made) and its compression at ``--ratio``, each timed, with its peak resident
memory above the phase's start (benchmarks.memory_model.measure: Linux's high-water mark) and the
stored cache's bytes against the full cache's. The context is dropped between lengths.

Then, per cost, the exponent of a power law fitted by least squares on log-log over the lengths from
``--fit-from`` on (1: linear; 2: quadratic). Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed
tensors leave the resident set (as the memory test does), on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks.memory_model import measure
from kvlab.catalog import method_spec, method_text
from kvlab.compression.interface import Method
from kvlab.context import prepare_context
from kvlab.methods import Request, get_method
from kvlab.models import get_model
from kvlab.queries import repeat_pass
from kvlab.runtime.model import LoadedModel
from kvlab.tasks.synthetic import books_dir

QUESTION = "What is the passphrase?"


@dataclass
class Row:
    """One cost at one length: ``what`` (prefill, or method/phase), seconds, peak bytes above the start."""

    tokens: int
    what: str
    seconds: float
    peak_bytes: int
    cache_bytes: int | None = None


def book_prefix(lm: LoadedModel, book: str, n_tokens: int) -> str:
    """The first ``n_tokens`` tokens of the book ``book`` (a file of the prose folder) as text."""
    text = (books_dir() / book).read_text(encoding="utf-8")
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise SystemExit(f"{book} has {len(ids):,} tokens, fewer than {n_tokens:,}: choose another --book")
    return lm.tokenizer.decode(ids[:n_tokens])


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """The slope of log y against log x by least squares (None with fewer than two points)."""
    if len(xs) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    var = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / var


def one_length(
    lm: LoadedModel, text: str, n: int, methods: list[tuple[str, Method]], ratio: float, emit: Callable[[Row], None]
) -> None:
    """Every cost at one length (the context is freed when this returns)."""
    ctx, peak, seconds = measure(lambda: prepare_context(lm, text))
    emit(Row(n, "prefill", seconds, peak, ctx.full.stored.nbytes))
    # The repeat pass on its own: KVzip's and Attention Matching's preparation share it.
    _, peak, seconds = measure(lambda: repeat_pass(ctx))
    emit(Row(n, "repeat pass", seconds, peak))
    for label, method in methods:
        _, peak, seconds = measure(lambda: method.prepare(ctx))  # noqa: B023 - called at once
        emit(Row(n, f"{label} preparation", seconds, peak))
        question = QUESTION if method.uses_question() else None
        stored, peak, seconds = measure(lambda: method.compress(Request(ctx, ratio, question)))  # noqa: B023
        emit(Row(n, f"{label} compression", seconds, peak, stored.nbytes))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="embedded (default) or any model kvlab loads")
    p.add_argument("--lengths", default="2048,4096,8192", help="document lengths in tokens, comma-separated")
    p.add_argument(
        "--methods",
        default="snapkv,kvzip,attention_matching",
        help="comma-separated, or ';'-separated when a method carries knobs (name:knob=value:...)",
    )
    p.add_argument("--ratio", type=float, default=10.0)
    p.add_argument("--book", default="walden.txt", help="a file of the evaluation data's prose/ folder")
    p.add_argument("--fit-from", type=int, default=8192, help="fit exponents over the lengths from this one on")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and exponents here")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    lm = get_model(args.model)
    specs = [method_spec(entry) for entry in args.methods.split(";" if ";" in args.methods else ",")]
    methods = [(method_text(name, knobs), get_method(name, **dict(knobs))) for name, knobs in specs]
    print(f"model {lm.name}; {args.book}; ratio {args.ratio:g}; methods {args.methods}", flush=True)
    print(f"{'tokens':>7}  {'what':<34} {'seconds':>9} {'peak MiB':>9} {'cache MiB':>10}", flush=True)
    rows: list[Row] = []

    def emit(row: Row) -> None:
        rows.append(row)
        cache = "" if row.cache_bytes is None else f"{row.cache_bytes / 2**20:10.1f}"
        print(f"{row.tokens:>7}  {row.what:<34} {row.seconds:9.2f} {row.peak_bytes / 2**20:9.0f} {cache}", flush=True)

    with torch.inference_mode():
        for n in lengths:
            one_length(lm, book_prefix(lm, args.book, n), n, methods, args.ratio, emit)
    fits = {}
    for what in dict.fromkeys(r.what for r in rows):
        chosen = [r for r in rows if r.what == what and r.tokens >= args.fit_from]
        time_exp = exponent([r.tokens for r in chosen], [r.seconds for r in chosen])
        mem_exp = exponent([r.tokens for r in chosen], [max(r.peak_bytes, 1) for r in chosen])
        fits[what] = {"time": time_exp, "peak": mem_exp}
    print(f"\nexponents over {args.fit_from:,}+ tokens (1: linear, 2: quadratic)")
    for what, fit in fits.items():
        show = {k: "-" if v is None else f"{v:.2f}" for k, v in fit.items()}
        print(f"  {what:<34} time {show['time']:>5}  peak memory {show['peak']:>5}")
    if args.json:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "exponents": fits}, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
