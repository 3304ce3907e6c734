"""The runs behind the Claims section (kvlab.lab.claims): writes assets/claims.json.

    python -m benchmarks.claims                                   # the example runs and the chain, then the file
    python -m benchmarks.claims --books DIR [DIR ...] --keep examples generation    # the book studies' rows

On the embedded model, through the lab's own calls (what the page runs):

- the bundled examples' questions (kvlab.lab.explore, one run per question and configuration, each
  marked against the example's answers): the story at 10x with Attention Matching and Cartridges, the
  patient record with no context, summarisation and Attention Matching at 10x, and both with
  ``summary_am`` at 200x and summarisation at 10x; each run's full-cache answer marked too;
- a chain of additions (counting by sevens to 140) written with an unbounded cache and with online
  Attention Matching under a budget (kvlab.lab.generate), each number checked;
- the per-item rows of ``kvlab bench`` result folders (``--books``, in order: a later folder's row
  replaces an earlier one's for the same model, method, preset, ratio and item).

Progress goes to stderr; the file records the date, the machine and the commit. Then, per model, the
book rows as a table on stdout: right/n with its Wilson 95 % interval and the mean compression seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvlab.examples import load_examples
from kvlab.lab.claims import CLAIMS_FILE, MissingRuns, cell
from kvlab.lab.explore import explore
from kvlab.lab.generate import generate
from kvlab.lab.spec import run_spec

#: (example, method, knobs, ratio) run on every question of the example.
EXAMPLE_RUNS: tuple[tuple[str, str, dict[str, Any], float], ...] = (
    ("story", "attention_matching", {}, 10.0),
    ("story", "cartridges", {}, 10.0),
    ("story", "summarisation", {}, 10.0),
    ("story", "summary_am", {}, 200.0),
    ("patient_record", "no_context", {}, 10.0),
    ("patient_record", "summarisation", {}, 10.0),
    ("patient_record", "attention_matching", {}, 10.0),
    ("patient_record", "summary_am", {}, 200.0),
)
#: The chain: counting by sevens (each number the last plus STEP) from the four given to TARGET.
STEP, START, TARGET = 7, 28, 140
CHAIN_PROMPT = f"Count by sevens up to {TARGET}: 7, 14, 21, {START},"
CHAIN_BUDGET, CHAIN_TOKENS = 64, 200


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def example_rows() -> list[dict[str, Any]]:
    """Every configuration of :data:`EXAMPLE_RUNS` on each question of its example, plus one ``full``
    row per example and question (the full cache's answer, marked)."""
    examples = {e.id: e for e in load_examples()}
    rows, full = [], {}
    for name, method, knobs, ratio in EXAMPLE_RUNS:
        ex = examples[name]
        for question in ex.questions:
            spec = run_spec(ex.text(), None, method, ratio, question, options=knobs)
            done = explore(spec)
            r = done.run.result
            ratio_kept = None if method == "no_context" else ratio
            rows.append(
                {
                    "example": name,
                    "method": method,
                    "knobs": knobs,
                    "ratio": ratio_kept,
                    "question": question,
                    "full_right": done.full_right,
                    "right": done.compressed_right,
                    "compress_s": r.compress_s,
                    "bytes_full": r.bytes_full,
                    "bytes_compressed": r.bytes_compressed,
                }
            )
            full[(name, question)] = done.full_right
            log(
                f"{name} {method} {ratio:g}x: {question} -> "
                f"{'right' if done.compressed_right else 'wrong'} ({r.compress_s:.1f} s)"
            )
    rows += [
        {"example": name, "method": "full", "ratio": None, "question": q, "right": right, "compress_s": 0.0}
        for (name, q), right in full.items()
    ]
    return rows


def right_steps(text: str) -> int:
    """How many steps of the chain ``text`` writes right, in order: the numbers after the last given one
    (:data:`START`, where the text repeats it), each the one before plus :data:`STEP`, up to :data:`TARGET`."""
    numbers = [int(x) for x in re.findall(r"\d+", text)]
    if START in numbers:
        numbers = numbers[numbers.index(START) + 1 :]
    right = 0
    for got in numbers:
        if got != START + STEP * (right + 1) or START + STEP * right >= TARGET:
            break
        right += 1
    return right


def chain() -> dict[str, Any]:
    """The arithmetic chain written unbounded and by online Attention Matching at :data:`CHAIN_BUDGET`."""
    g = generate(prompt=CHAIN_PROMPT, methods=["online_am"], budget=CHAIN_BUDGET, max_new_tokens=CHAIN_TOKENS)
    by_name = {m.method: m.run for m in [g.reference, *g.runs]}
    out: dict[str, Any] = {
        "task": f"counting by {STEP}s from {START} to {TARGET}",
        "prompt": CHAIN_PROMPT,
        "steps": (TARGET - START) // STEP,
        "budget": CHAIN_BUDGET,
        "max_new_tokens": CHAIN_TOKENS,
    }
    for name in ("unbounded", "online_am"):
        run = by_name[name]
        out[name] = {"text": run.text, "right_steps": right_steps(run.text), "events": len(run.events)}
        log(f"chain {name}: {out[name]['right_steps']}/{out['steps']} steps, {out[name]['events']} compactions")
    return out


def book_rows(folders: list[Path]) -> list[dict[str, Any]]:
    """The per-item rows of ``kvlab bench`` result folders (their ``*.jsonl``), a later folder's row
    replacing an earlier one's for the same model, method, preset, ratio and item."""
    kept: dict[tuple, dict[str, Any]] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                r = json.loads(line)
                row = {k: r[k] for k in ("model", "method", "preset", "ratio", "correct", "compress_s")}
                row["item"] = r["item_id"]
                kept[(row["model"], row["method"], row["preset"], row["ratio"], row["item"])] = row
    return list(kept.values())


def book_table(rows: list[dict[str, Any]], model: str) -> str:
    """The book rows of ``model`` as a markdown grid: a line per method (and preset), a column per ratio,
    each cell "right/n [Wilson 95 %] mean compression seconds"; the full cache and no context first."""
    mine = [r for r in rows if r["model"] == model]
    ratios = sorted({r["ratio"] for r in mine if r["ratio"] is not None})
    labels = sorted({(r["method"], r["preset"]) for r in mine}, key=lambda m: (m[0] not in ("full", "no_context"), m))
    out = ["| method | " + " | ".join(f"{x:g}x" for x in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for method, preset in labels:
        cells = []
        for ratio in ratios:
            at = ratio if method not in ("full", "no_context") else None
            try:
                c = cell(mine, method=method, preset=preset, ratio=at)
            except MissingRuns:
                cells.append("-")
                continue
            seconds = "" if c.seconds is None else f" {c.seconds:.1f} s"
            cells.append(c.text() + seconds)
        out.append(f"| {method}{' ' + preset if preset else ''} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return done.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=CLAIMS_FILE)
    p.add_argument("--books", type=Path, nargs="*", default=[], help="kvlab bench result folders, oldest first")
    p.add_argument(
        "--keep",
        nargs="*",
        choices=("examples", "generation"),
        default=[],
        help="keep these runs from the file at --out instead of running them again (the books are read again)",
    )
    args = p.parse_args(argv)
    for folder in args.books:
        if not folder.is_dir():
            p.error(f"--books: no folder {folder}")
    old = json.loads(args.out.read_text(encoding="utf-8")) if args.keep and args.out.is_file() else {}
    kept = {part: old[part] for part in args.keep if part in old}
    data = {
        "made": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "commit": commit(),
        },
        "books": book_rows(args.books),
        "examples": kept.get("examples") or example_rows(),
        "generation": kept.get("generation") or chain(),
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    for model in dict.fromkeys(r["model"] for r in data["books"]):
        print(f"\n{model} (right/n [Wilson 95 %], mean compression seconds)\n\n{book_table(data['books'], model)}")
    log(f"wrote {args.out}: {len(data['books'])} book rows, {len(data['examples'])} example rows")


if __name__ == "__main__":
    main()
