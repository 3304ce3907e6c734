"""`python -m kvlab bench`: tasks with known answers over methods and ratios, resumable and shardable.

    python -m kvlab bench --tasks niah_single,needle_grid --methods snapkv,attention_matching \\
        --ratios 2,5,10 --limit 10 --seed 0 --out runs/bench [--shard 1/4] [--preset AM-OMP]
    python -m kvlab bench --tasks examples --methods attention_matching:self_study_weight=4 --out runs/am
    python -m kvlab bench --tasks niah_single --haystack prose --needle-values code --out runs/prose
    python -m kvlab bench --tasks niah_single --haystack books --needle-values mixed --limit 24 --out runs/books
    python -m kvlab bench --report runs/bench      # rebuild the CSV and HTML from the JSONL alone

Results go to OUT/results*.jsonl, one line per (task, item, method, ratio,
preset and knob overrides); a rerun skips what is there, and shards (separate files) merge in
the report. The full cache (ceiling) and no_context (floor) always run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

from kvlab import messages
from kvlab.catalog import method_spec
from kvlab.lab.inputs import parse_ratios
from kvlab.methods import REGISTRY
from kvlab.tasks.items import TaskError
from kvlab.tasks.synthetic import HAYSTACKS, VALUE_SHAPES
from kvlab.tasks.task_registry import DEFAULT_LENGTH, TASKS


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on the CLI's subparsers."""
    p = subparsers.add_parser(
        "bench", help="accuracy on tasks with known answers, per method and ratio (JSONL, CSV, HTML)"
    )
    p.add_argument(
        "--tasks",
        default="niah_single,needle_grid",
        help=f"comma-separated: {', '.join(TASKS)} (default niah_single,needle_grid)",
    )
    p.add_argument(
        "--methods",
        default="",
        help="comma-separated method names, each optionally with knob overrides as "
        "name:knob=value:knob=value (the full cache and no_context always run)",
    )
    p.add_argument("--ratios", default="2,5,10,20", help="comma-separated compression ratios (default 2,5,10,20)")
    p.add_argument("--limit", type=int, default=10, help="items per task (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic items and shuffles (default 0)")
    p.add_argument(
        "--length",
        type=int,
        default=DEFAULT_LENGTH,
        help=f"synthetic document length in model tokens (default {DEFAULT_LENGTH})",
    )
    p.add_argument(
        "--haystack",
        choices=HAYSTACKS,
        default="noise",
        help="the needle tasks' filler: noise (one repeated line, RULER's noise; default), prose "
        "(the bundled essay text, written with no digits or names) or books (public-domain books from "
        "$KVLAB_DATA/prose, their own numbers, dates and names the distractors)",
    )
    p.add_argument(
        "--needle-values",
        choices=VALUE_SHAPES,
        default="number",
        help="the needles' values: number (7 digits; default), code (4821-violet), name (a person's) "
        "or mixed (the three in turn, item by item)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="embedded (default), a .gguf file, a local directory or a hub id; also KVLAB_MODEL",
    )
    p.add_argument("--out", default=None, help="results folder (JSONL, results.csv, summary.csv, report.html)")
    p.add_argument("--shard", default=None, help="K/N: run only items i with i %% N == K-1 (its own JSONL file)")
    p.add_argument("--preset", default="", help="comma-separated presets, each run for the methods that have it")
    p.add_argument("--report", default=None, metavar="DIR", help="only rebuild DIR's CSV and HTML from its JSONL files")
    return p


def method_specs(methods: list[str], presets: list[str]) -> list:
    """One spec per method entry (``name`` or ``name:knob=value:...``), or per (entry, preset)
    for the methods that have the presets asked."""
    from kvlab.tasks.runner import FULL, MethodSpec

    specs = []
    for entry in methods:
        if entry == FULL:
            continue
        name, options = method_spec(entry)  # MethodError names the method, knob or value refused
        own = [p for p in presets if p in getattr(REGISTRY[name], "presets", {})]
        specs += [MethodSpec(name, p, options) for p in own] or [MethodSpec(name, options=options)]
    unused = [p for p in presets if not any(s.preset == p for s in specs)]
    if unused:
        raise TaskError(f"no method given has preset(s) {', '.join(unused)}")
    return specs


def _progress_bar() -> tuple[Callable[[float, str], None], Callable[[], None]]:
    """A progress sink on stderr (tqdm when installed) and its closer."""
    try:
        from tqdm import tqdm
    except ImportError:
        last = [-1]

        def line(fraction: float, desc: str) -> None:
            step = int(fraction * 20)  # a line every 5 %, never one per result
            if step != last[0]:
                last[0] = step
                print(f"[{fraction:4.0%}] {desc}", file=sys.stderr)

        return line, lambda: None
    bar = tqdm(total=1000, file=sys.stderr, unit="‰", bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}")

    def update(fraction: float, desc: str) -> None:
        bar.update(round(fraction * 1000) - bar.n)
        bar.set_postfix_str(desc, refresh=False)

    return update, bar.close


def cmd_bench(args: argparse.Namespace) -> int:
    """Run (or only report) a bench; raises TaskError/MethodError on bad arguments."""
    from kvlab.tasks.report import write_report

    if args.report is not None:
        out = Path(args.report)
        if not any(out.glob("results*.jsonl")):
            raise TaskError(f"no results*.jsonl in {out}")
        rows = write_report(out)
        print(f"{len(rows)} table rows; wrote {out / 'results.csv'}, {out / 'summary.csv'}, {out / 'report.html'}")
        return 0
    if args.out is None:
        raise TaskError("--out DIR is required (or --report DIR)")
    if args.limit < 1:
        raise TaskError("--limit must be at least 1")
    tasks = _csv(args.tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise TaskError(messages.unknown("task", unknown, TASKS))
    ratios = parse_ratios([], args.ratios)
    specs = method_specs(_csv(args.methods), _csv(args.preset))
    from kvlab.tasks.store import ResultWriter, Shard, read_results, results_path

    shard = Shard.parse(args.shard) if args.shard else None
    for spec in specs:
        spec.instantiate()  # refuse a bad method or preset before the model loads

    from kvlab.models import get_model
    from kvlab.tasks.runner import group_by_document, run_items
    from kvlab.tasks.task_registry import build_items

    out = Path(args.out)
    lm = get_model(args.model)
    items = [
        it
        for t in tasks
        for it in build_items(t, lm, args.limit, args.seed, args.length, args.haystack, args.needle_values)
    ]
    if shard is not None:
        # Whole documents go to one shard, so each document is prefilled once across the shards.
        items = [it for group in shard.select(group_by_document(items)) for it in group]
    done = {r.key for r in read_results(out)} if out.exists() else set()
    progress, close = _progress_bar()
    start = time.perf_counter()
    try:
        with ResultWriter(results_path(out, shard)) as writer:
            new = run_items(lm, items, specs, ratios, progress, done, writer.write)
    finally:
        close()
    rows = write_report(out)
    print(
        f"{len(new)} new results ({len(items)} items, {time.perf_counter() - start:.0f}s); "
        f"{len(rows)} table rows; wrote {out / 'report.html'}"
    )
    return 0
