"""`python -m kvlab ...`: the lab from a terminal, with numbers a script can read.

    python -m kvlab methods
    python -m kvlab run --doc PATH --method NAME --ratio R --question TEXT [--model M] [--json]

Each method's knobs (the fields of its Options dataclass) are flags too,
e.g. ``--window 32`` for SnapKV; ``python -m kvlab run --help`` lists them.
Bad arguments exit with status 2 and one line on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any, Sequence

from kvlab.methods import REGISTRY, MethodError, get_method
from kvlab.methods.base import MAX_RATIO, MIN_RATIO


class UsageError(Exception):
    """A bad command line; reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def option_fields() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every method knob by flag name, with the methods that take it."""
    out: dict[str, tuple[dataclasses.Field, list[str]]] = {}
    for name, cls in sorted(REGISTRY.items()):
        for f in dataclasses.fields(cls.Options):
            out.setdefault(f.name, (f, []))[1].append(name)
    return out


def _field_type(f: dataclasses.Field) -> Any:
    kind = f.type if not isinstance(f.type, str) else type(f.default)
    if typing.get_origin(kind) is typing.Literal:
        return str
    return {bool: _bool}.get(kind, kind) if kind in (int, float, str, bool) else str


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m kvlab", description="kvlab: KV-cache compression lab")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("methods", help="list the registered methods, one line each")
    run = sub.add_parser("run", help="compress a document's cache and compare answers and errors")
    run.add_argument("--doc", required=True, help="document: .txt, .md or .pdf")
    run.add_argument("--method", required=True, help="a name from `python -m kvlab methods`")
    run.add_argument("--ratio", type=float, required=True, help="compression ratio of the document's tokens (>= 1)")
    run.add_argument("--question", required=True, help="the question asked after the document")
    run.add_argument("--model", default=None, help="embedded (default), a .gguf file, a local directory or a hub id; also KVLAB_MODEL")
    run.add_argument("--max-new-tokens", type=int, default=48, help="answer length cap (default 48)")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    sweep = sub.add_parser("budgets", help="sensitivity sweep -> non-uniform Attention Matching budgets for a model")
    sweep.add_argument("--model", default=None, help="as for run")
    sweep.add_argument("--doc", default=None, help="document (default: the bundled story, with its questions)")
    sweep.add_argument("--question", action="append", default=None, help="a question (repeatable; default: the example's)")
    sweep.add_argument("--ratio", type=float, default=20.0, help="baseline compression ratio of every head (default 20)")
    sweep.add_argument("--boost", type=float, default=4.0, help="budget multiplier of the head under test (default 4)")
    knobs = run.add_argument_group("method options (each applies to the methods named)")
    for name, (f, methods) in option_fields().items():
        help_text = f.metadata.get("help", "")
        knobs.add_argument(
            "--" + name.replace("_", "-"),
            dest="opt_" + name,
            metavar=name.upper(),
            type=_field_type(f),
            default=None,
            help=f"{help_text} (default {f.default!r}; {', '.join(methods)})",
        )
    return parser


def _method_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def cmd_methods() -> int:
    width = max(map(len, REGISTRY))
    for name, cls in sorted(REGISTRY.items()):
        flag = " [query-aware]" if cls.query_aware else ""
        if cls.query_aware_when:
            flag = f" [query-aware with {cls.query_aware_when}]"
        print(f"{name:<{width}}  {cls.summary}{flag}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from kvlab.context import CONTEXTS
    from kvlab.documents import read_document
    from kvlab.models import get_model
    from kvlab.pipeline import run

    if not args.question.strip():
        raise UsageError("--question is empty")
    if not (MIN_RATIO <= args.ratio <= MAX_RATIO):
        raise UsageError(f"--ratio must be between {MIN_RATIO:g} and {MAX_RATIO:g}, got {args.ratio:g}")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    try:
        method = get_method(args.method, **_method_options(args))
    except (MethodError, TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    text = read_document(args.doc)
    lm = get_model(args.model)
    progress = (lambda f, desc: None) if args.json else _stderr_progress
    ctx = CONTEXTS.get(lm, text, progress)
    result = run(ctx, method, args.ratio, args.question, args.max_new_tokens, progress).result
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        _print_summary(result)
    return 0


def cmd_budgets(args: argparse.Namespace) -> int:
    from kvlab.context import CONTEXTS
    from kvlab.documents import load_examples, read_document
    from kvlab.models import get_model
    from kvlab.pipeline import evaluation
    from kvlab.sweep import save_profile, sensitivity_sweep

    if args.ratio < 2 or args.boost <= 1:
        raise UsageError("--ratio must be >= 2 and --boost > 1")
    if args.doc is None:
        example = next(e for e in load_examples() if e.kind == "story")
        text, questions, doc = example.text(), args.question or list(example.questions), example.path.name
    else:
        if not args.question:
            raise UsageError("--question is required (at least once) with --doc")
        text, questions, doc = read_document(args.doc), args.question, args.doc
    lm = get_model(args.model)
    ctx = CONTEXTS.get(lm, text, _stderr_progress)
    evaluations = [evaluation(ctx, q, 24) for q in questions]
    sweep = sensitivity_sweep(ctx, evaluations, args.ratio, args.boost, progress=_stderr_progress)
    path = save_profile(ctx, sweep, args.ratio, args.boost, doc)
    print(f"baseline loss {sweep.loss_base:.4f}; shares min {sweep.shares.min():.2f}, max {sweep.shares.max():.2f}; "
          f"{sweep.seconds:.0f}s; written to {path}")
    return 0


def _stderr_progress(fraction: float, desc: str) -> None:
    print(f"[{fraction:4.0%}] {desc}", file=sys.stderr)


def _print_summary(r: Any) -> None:
    print(f"model           {r.model}")
    print(f"method          {r.method} at {r.ratio:g}x  ({r.doc_tokens} document tokens, {r.kept_tokens_mean:.1f} kept per head)")
    print(f"memory          {r.bytes_full:,} B full -> {r.bytes_compressed:,} B compressed ({r.memory_ratio:.2f}x)")
    print(f"time            prefill {r.prefill_s:.2f}s, compression {r.compress_s:.2f}s")
    print(f"attention error output {r.attn_output_rel_err:.4f}, mass {r.attn_mass_rel_err:.4f} (mean over layers x heads)")
    print(f"answer log-ppl  full {r.logppl_full:.4f}, compressed {r.logppl_compressed:.4f}")
    print(f"answer (full)        {r.answer_full}")
    print(f"answer (compressed)  {r.answer_compressed}")


def main(argv: Sequence[str] | None = None) -> int:
    from kvlab.documents import DocumentError
    from kvlab.models import ModelLoadError

    try:
        args = build_parser().parse_args(argv)
        commands = {"methods": lambda a: cmd_methods(), "run": cmd_run, "budgets": cmd_budgets}
        return commands[args.command](args)
    except UsageError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
    except (DocumentError, ModelLoadError, MethodError) as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (DocumentError, MethodError)) else 1
