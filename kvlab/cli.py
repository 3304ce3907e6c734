"""`python -m kvlab ...`: the lab from a terminal, with numbers a script can read.

    python -m kvlab methods [--long]
    python -m kvlab run --doc PATH --method NAME --ratio R --question TEXT [--model M] [--json] [--save-cache FILE]
    python -m kvlab ask --cache FILE --question TEXT [--model M] [--json]
    python -m kvlab compare --doc PATH --methods A,B --ratios 2,5,10 --question TEXT --out DIR
                            [--model M | --models A,B]
    python -m kvlab generate --prompt TEXT | --doc PATH --question Q [--method M] [--budget KEYS] [--json]
    python -m kvlab warm SHEET [--model M]

Each method's knobs (the fields of its Options dataclass, reflected by
kvlab.catalog) are flags too, e.g. ``--window 32`` for SnapKV, and
``--preset NAME`` picks a method's published configuration;
``python -m kvlab run --help`` lists them. Bad arguments exit with status 2
and one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from kvlab.bounded.policies import bounded_policies
from kvlab.catalog import Knob, all_knobs, describe, methods_markdown, presets
from kvlab.compression.budget_profiles import budgets_text
from kvlab.compression.options import alias_of
from kvlab.compression.selection import SELECTION_PRESETS
from kvlab.methods import REGISTRY, MethodError, get_method
from kvlab.methods.families.am_recipe import queries_text

if typing.TYPE_CHECKING:  # the commands import kvlab.lab where they need it
    from kvlab.lab import RunSpec


class UsageError(Exception):
    """A bad command line; reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def knobs_by_flag() -> dict[str, list[Knob]]:
    """Every method knob by field name (one flag each), with the methods' knobs that share it."""
    out: dict[str, list[Knob]] = {}
    for knobs in all_knobs().values():
        for knob in knobs:
            out.setdefault(knob.name, []).append(knob)
    return out


def _flag_type(knob: Knob) -> Callable[[str], Any]:
    """argparse's ``type=`` for a knob: its conversion, failing with argparse's one-line error."""

    def parse(text: str) -> Any:
        try:
            return knob.convert(text)
        except MethodError:
            raise argparse.ArgumentTypeError(f"must be {knob.allowed}, got {text!r}") from None

    return parse


def _choice_type(knobs: list[Knob]) -> Callable[[str], str]:
    """argparse's ``type=`` for a knob of choices: an old spelling read as today's (its ``aliases``)."""
    return lambda text: next((today for k in knobs if (today := alias_of(k.field, text))), text)


def _flag_help(knobs: list[Knob]) -> str:
    defaults: dict[str, list[str]] = {}
    for k in knobs:
        defaults.setdefault(repr(k.default), []).append(k.method)
    default = "; ".join(f"default {d} for {', '.join(m)}" for d, m in defaults.items())
    allowed = "" if knobs[0].choices else f"{knobs[0].allowed}; "  # argparse lists the choices itself
    # A name two families share (budgets: AM's and the selection wrappers'): each help line once.
    return f"{'; '.join(dict.fromkeys(k.help for k in knobs))} ({allowed}{default})"


def add_method_options(parser: argparse.ArgumentParser) -> None:
    """The flags that configure a method: ``--preset`` and one per knob (values go to get_method)."""
    group = parser.add_argument_group("method options (each applies to the methods named)")
    names = sorted({p for m in REGISTRY for p in presets(m)})
    owners = ", ".join(m for m in sorted(REGISTRY) if presets(m))
    group.add_argument(
        "--preset",
        choices=names,
        default=None,
        help=f"a published configuration ({owners}); explicit options override it",
    )
    for name, knobs in knobs_by_flag().items():
        knob = knobs[0]
        # The union of the methods' choices; each method's Options refuses what is not its own.
        choices = list(dict.fromkeys(c for k in knobs for c in k.choices or ()))
        kind = (
            {"type": _choice_type(knobs), "choices": choices}
            if knob.choices
            else {"type": _flag_type(knob), "metavar": name.upper()}
        )
        group.add_argument(
            "--" + name.replace("_", "-"), dest="opt_" + name, default=None, help=_flag_help(knobs), **kind
        )


def method_from_args(name: str, args: argparse.Namespace) -> Any:
    """The method ``name`` configured by the flags of :func:`add_method_options` (UsageError if refused)."""
    options = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    try:
        return get_method(name, preset=args.preset, **options)
    except MethodError as exc:
        raise UsageError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m kvlab", description="kvlab: KV-cache compression lab")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_methods_parser(sub)
    run = _add_run_parser(sub)
    _add_compare_parser(sub)
    _add_budgets_parser(sub)
    _add_generate_parser(sub)
    _add_warm_parser(sub)
    add_method_options(run)
    from kvlab.bench_command import add_parser as add_bench_parser

    add_bench_parser(sub)
    from kvlab.cache_command import add_parser as add_ask_parser

    add_ask_parser(sub)
    return parser


def _add_methods_parser(sub: Any) -> None:
    """The ``methods`` subcommand."""
    methods = sub.add_parser("methods", help="list the registered methods, one line each")
    methods.add_argument(
        "--long", action="store_true", help="every method's full text: idea, formula, paper, presets, knobs"
    )


def _add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``run`` subcommand (its method knobs are added by :func:`build_parser`)."""
    run = sub.add_parser("run", help="compress a document's cache and compare answers and errors")
    run.add_argument("--doc", required=True, help="document: .txt, .md or .pdf")
    run.add_argument("--method", required=True, help="a name from `python -m kvlab methods`")
    run.add_argument("--ratio", type=float, required=True, help="compression ratio of the document's tokens (>= 1)")
    run.add_argument("--question", required=True, help="the question asked after the document")
    run.add_argument(
        "--model",
        default=None,
        help="embedded (default), a .gguf file, a local directory or a hub id; also KVLAB_MODEL",
    )
    run.add_argument("--max-new-tokens", type=int, default=48, help="answer length cap (default 48)")
    run.add_argument("--json", action="store_true", help="print one JSON object (progress stays on stderr)")
    run.add_argument(
        "--save-cache",
        default=None,
        metavar="FILE",
        help="also write the compressed cache to FILE (safetensors), for `kvlab ask --cache FILE`",
    )
    return run


def _add_compare_parser(sub: Any) -> None:
    """The ``compare`` subcommand."""
    compare = sub.add_parser("compare", help="a sweep: every method (default knobs) at every ratio -> CSV and JSON")
    compare.add_argument("--doc", required=True, help="document: .txt, .md or .pdf")
    compare.add_argument("--methods", required=True, help="comma-separated names from `python -m kvlab methods`")
    compare.add_argument("--ratios", required=True, help="comma-separated compression ratios, e.g. 2,5,10")
    compare.add_argument("--question", required=True, help="the question asked after the document")
    compare.add_argument("--out", required=True, help="folder for compare.csv and compare.json (created if needed)")
    compare.add_argument("--model", default=None, help="as for run")
    compare.add_argument(
        "--models",
        default=None,
        help="comma-separated models, the same sweep on each (each its own full cache), e.g. embedded,gemma3-270m",
    )
    compare.add_argument("--max-new-tokens", type=int, default=48, help="answer length cap (default 48)")
    compare.add_argument(
        "--budgets",
        default=None,
        help="a third axis, head budgets: comma-separated from uniform, profile (the model's), "
        "document (the document's own), global (one ranking across heads and layers); each "
        "method with a budgets knob runs once per value",
    )


def _add_budgets_parser(sub: Any) -> None:
    """The ``budgets`` subcommand."""
    sweep = sub.add_parser(
        "budgets",
        help="sensitivity sweep -> a model's head-budget profile (Attention Matching's "
        "default budgets, budgets=profile)",
    )
    sweep.add_argument("--model", default=None, help="as for run")
    sweep.add_argument("--doc", default=None, help="document (default: the bundled story, with its questions)")
    sweep.add_argument(
        "--question", action="append", default=None, help="a question (repeatable; default: the example's)"
    )
    sweep.add_argument(
        "--ratio", type=float, default=20.0, help="baseline compression ratio of every head (default 20)"
    )
    sweep.add_argument("--boost", type=float, default=4.0, help="budget multiplier of the head under test (default 4)")
    sweep.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="folder for the profile (default: KVLAB_BUDGETS_DIR or ~/.cache/kvlab/budgets, where the lab looks first)",
    )


def _add_generate_parser(sub: Any) -> None:
    """The ``generate`` subcommand."""
    gen = sub.add_parser("generate", help="write after a prompt with every bounded-cache method (or those named)")
    gen_source = gen.add_mutually_exclusive_group(required=True)
    gen_source.add_argument("--prompt", default=None, help="the prompt (one user turn)")
    gen_source.add_argument("--doc", default=None, help="a document (.txt, .md or .pdf), then --question")
    gen.add_argument("--question", default=None, help="the question asked after --doc")
    gen.add_argument("--method", default="all", help=f"comma-separated: {', '.join(bounded_policies())}, or all")
    gen.add_argument(
        "--budget", type=int, default=None, help="keys per KV head (default: a quarter of the unbounded length)"
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=200, help="tokens written at most (default 200, at most 2048)"
    )
    gen.add_argument("--model", default=None, help="as for run")
    gen.add_argument("--json", action="store_true", help="print one JSON object (progress stays on stderr)")


def _add_warm_parser(sub: Any) -> None:
    """The ``warm`` subcommand."""
    warm = sub.add_parser("warm", help="compute a workshop sheet's configurations into the result store (resumable)")
    warm.add_argument(
        "sheet", help="a file of Explore links or METHOD RATIO EXAMPLE [QUESTION] lines (docs/workshop.md)"
    )
    warm.add_argument("--model", default=None, help="the model of lines that name none (default: the lab's default)")


def cmd_methods(args: argparse.Namespace) -> int:
    if args.long:
        print(methods_markdown())
        return 0
    width = max(map(len, REGISTRY))
    for name in sorted(REGISTRY):
        print(describe(name, width=width))
    print(
        f"\nSelection wrappers, knobs of every scoring method, each a preset ({', '.join(SELECTION_PRESETS)}): "
        "kvlab methods --long"
    )
    return 0


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """``kvlab run``'s arguments as the lab's run spec (kvlab.lab.RunSpec; the inverse of its ``cli_args``)."""
    from kvlab.lab import run_spec

    method = method_from_args(args.method, args)  # the flags and the preset
    options = {f.name: getattr(method.options, f.name) for f in dataclasses.fields(method.options)}
    return run_spec(None, args.doc, method.name, args.ratio, args.question, args.max_new_tokens, options, args.model)


def cmd_run(args: argparse.Namespace) -> int:
    from kvlab.lab import explore

    spec = spec_from_args(args)  # every input checked before any work
    method = spec.build()
    if args.save_cache is not None:
        from kvlab.cache_command import check_save_path, save_run_cache

        save_to = check_save_path(args.save_cache)
    # Progress on stderr with --json too: the JSON is stdout's alone, and a Cartridges training runs minutes.
    progress = _stderr_progress
    # The lab's own run (kvlab.lab.explore): the same checks and the same path as the app's Explore.
    explored = explore(spec, progress)
    result = explored.run.result
    if args.save_cache is not None:
        path = save_run_cache(explored.run, method, save_to, args.model)
        print(
            f"compressed cache written to {path} ({result.bytes_compressed:,} B stored): "
            f"kvlab ask --cache {path} --question ...",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        _print_summary(result)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kvlab import lab

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        ratios = lab.parse_ratios([], args.ratios)
        for name in methods:
            get_method(name)  # an unknown name fails here, before the model loads
        if args.models is not None and args.model is not None:
            raise lab.InputError("give --model or --models, not both")
        models = None if args.models is None else [m.strip() for m in args.models.split(",") if m.strip()]
        if models is not None and not models:
            raise lab.InputError("--models names no model (comma-separated, e.g. embedded,gemma3-270m)")
        budgets = [b.strip() for b in (args.budgets or "").split(",") if b.strip()]
        sweep = lab.compare(
            None,
            args.doc,
            methods,
            ratios,
            args.question,
            args.max_new_tokens,
            _stderr_progress,
            args.model,
            models,
            budgets,
        )
    except lab.InputError as exc:
        raise UsageError(str(exc)) from exc
    csv_path, json_path = lab.write_exports(sweep, args.out, stem="compare")
    several = len(sweep.ceilings) > 1
    width = max([20] + [len(lab.sweep_label(sweep, r)) for r in sweep.results] + [len(e.method) for e in sweep.errors])
    print(
        f"{'model':<34} " * several + f"{'method':<{width}} {'ratio':>6} {'memory':>7} {'out err':>8} {'weighted':>8} "
        f"{'log-ppl':>8}  answer"
    )
    for r in sweep.results:
        print(
            f"{r.model[:34]:<34} " * several + f"{lab.sweep_label(sweep, r):<{width}} {r.ratio:>6g} "
            f"{r.memory_ratio:>6.1f}x {r.attn_output_rel_err:>8.4f} {r.attn_output_rel_err_weighted:>8.4f} "
            f"{r.logppl_compressed:>8.3f}  {r.answer_compressed[:60]!r}"
        )
    for e in sweep.errors:
        print(f"{e.model[:34]:<34} " * several + f"{e.method:<{width}} {e.ratio:>6g}  failed: {e.message}")
    for c in sweep.ceilings:
        print(
            f"full cache's answer{f' ({c.model})' if several else ''}: {c.answer_full!r} (log-ppl {c.logppl_full:.3f})"
        )
    print(f"{sweep.wall_s:.1f} s")
    print(f"written: {csv_path}, {json_path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvlab.lab.generate import generate, generation_record
    from kvlab.lab.inputs import InputError

    if args.doc is not None and not (args.question or "").strip():
        raise UsageError("--doc needs --question")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty")
    methods = None if args.method == "all" else [m.strip() for m in args.method.split(",") if m.strip()]
    try:
        g = generate(
            args.prompt,
            None,
            args.doc,
            args.question,
            methods,
            args.budget,
            args.max_new_tokens,
            args.model,
            _stderr_progress,  # stderr: --json's object is stdout's alone
        )
    except (InputError, MethodError) as exc:
        raise UsageError(str(exc)) from exc
    record = generation_record(g)
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"{g.model}: {g.prompt_tokens} prompt tokens, budget {g.budget} keys per head, {g.wall_s:.1f} s")
    print(
        f"{'method':<16} {'diverges':>8} {'log-ppl':>8} {'task F1':>8} "
        f"{'shrinks':>7} {'max keys':>8} {'tok/s':>6}  text"
    )
    for m in record["methods"]:
        diverges = "-" if m["divergence"] is None else m["divergence"]
        task = "-" if m["task_f1"] is None else f"{m['task_f1']:.3f}"
        print(
            f"{m['method']:<16} {diverges:>8} {m['logppl']:>8.3f} {task:>8} {m['events']:>7} {m['max_keys']:>8} "
            f"{m['tokens_per_s']:>6.1f}  {m['text'][:50]!r}"
        )
    return 0


def cmd_budgets(args: argparse.Namespace) -> int:
    from kvlab.context_store import CONTEXTS
    from kvlab.documents import read_document
    from kvlab.examples import load_examples
    from kvlab.lab.budget_sweep import save_profile, sensitivity_sweep
    from kvlab.models import get_model
    from kvlab.pipeline import evaluation

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
    path = save_profile(ctx, sweep, args.ratio, args.boost, doc, None if args.out is None else Path(args.out))
    print(
        f"baseline loss {sweep.loss_base:.4f}; shares min {sweep.shares.min():.2f}, max {sweep.shares.max():.2f}; "
        f"{sweep.seconds:.0f}s; written to {path}"
    )
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    """Fill the result store (kvlab.results) with every configuration of a sheet; 1 when one failed."""
    from kvlab import results
    from kvlab.lab.warm import read_sheet, warm

    items = read_sheet(args.sheet, args.model)  # every line checked before any work
    store = results.store()
    where = store.directory or "memory only: nothing will outlive this command (see KVLAB_STORE_DIR)"
    print(f"warming {len(items)} configuration(s) into {where}", file=sys.stderr)

    def report(i: int, w: Any) -> None:
        what = {
            "stored": "stored already",
            "computed": f"computed in {w.seconds:.1f} s",
            "shared": "computed by another request",
        }.get(w.outcome, f"FAILED: {w.error}")
        print(f"[{i + 1}/{len(items)}] line {w.item.line}: {w.item.label}: {what}", file=sys.stderr)

    done = warm(items, store, report)
    failed = sum(w.outcome == "failed" for w in done)
    computed = sum(w.outcome == "computed" for w in done)
    print(
        f"done: {computed} computed, {len(done) - computed - failed} stored already, {failed} failed", file=sys.stderr
    )
    return 1 if failed else 0


def _stderr_progress(fraction: float, desc: str) -> None:
    print(f"[{fraction:4.0%}] {desc}", file=sys.stderr)


def _print_summary(r: Any) -> None:
    print(f"model           {r.model}")
    print(
        f"method          {r.method} at {r.ratio:g}x  "
        f"({r.doc_tokens} document tokens, {r.kept_tokens_mean:.1f} kept per head)"
    )
    print(f"memory          {r.bytes_full:,} B full -> {r.bytes_compressed:,} B compressed ({r.memory_ratio:.2f}x)")
    if budgets := budgets_text(r.details):
        print(f"budgets         {budgets}")
    if queries := queries_text(r.details):
        print(f"queries         {queries}")
    if "compressed_layers" in r.details:  # a hybrid model: the ratio is met in its full-attention layers
        d = r.details
        print(
            f"  full layers   {d['compressed_layers_bytes_full']:,} B -> {d['compressed_layers_bytes_compressed']:,} B "
            f"({d['compressed_layers_memory_ratio']:.2f}x) in layers {d['compressed_layers']}; the window layers "
            f"{d['window_layers_bytes']:,} B -> {d['window_layers_bytes_compressed']:,} B"
        )
    print(f"time            prefill {r.prefill_s:.2f}s, compression {r.compress_s:.2f}s")
    print(
        f"attention error output {r.attn_output_rel_err:.4f}, mass {r.attn_mass_rel_err:.4f} (mean over layers x heads)"
    )
    print(f"answer log-ppl  full {r.logppl_full:.4f}, compressed {r.logppl_compressed:.4f}")
    print(f"answer (full)        {r.answer_full}")
    print(f"answer (compressed)  {r.answer_compressed}")
    if r.numerics_warning:
        print(r.numerics_warning)


def main(argv: Sequence[str] | None = None) -> int:
    from kvlab.documents import DocumentError
    from kvlab.lab.inputs import InputError
    from kvlab.runtime.cache_file import CacheFileError
    from kvlab.runtime.model import ModelLoadError
    from kvlab.tasks.items import TaskError

    try:
        args = build_parser().parse_args(argv)
        from kvlab.bench_command import cmd_bench
        from kvlab.cache_command import cmd_ask

        commands = {
            "methods": cmd_methods,
            "run": cmd_run,
            "compare": cmd_compare,
            "budgets": cmd_budgets,
            "generate": cmd_generate,
            "bench": cmd_bench,
            "warm": cmd_warm,
            "ask": cmd_ask,
        }
        return commands[args.command](args)
    except UsageError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
    except (DocumentError, ModelLoadError, MethodError, TaskError, InputError, CacheFileError) as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (DocumentError, MethodError, TaskError, InputError, CacheFileError)) else 1
