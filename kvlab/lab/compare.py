"""A Compare sweep: several methods at several ratios on one document and question, on one model or several."""

from __future__ import annotations

import dataclasses
import logging
import time
import typing
from dataclasses import dataclass, field

from kvlab import cancellation, figures, limits
from kvlab import models as models_module
from kvlab.compression.budget_profiles import BUDGET_ALIASES, BUDGETS
from kvlab.compression.options import option_types
from kvlab.context import Progress, no_progress
from kvlab.lab.explore import prepared_context, sub_progress
from kvlab.lab.inputs import InputError, check_question_tokens, check_sweep
from kvlab.lab.spec import RunSpec, run_spec
from kvlab.methods import Method, MethodError, get_method
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS, RunResult, run

log = logging.getLogger("kvlab.lab")

#: At most this many (method, ratio) runs per sweep (``KVLAB_MAX_SWEEP``, read at import).
MAX_SWEEP_POINTS = limits.LIMITS.sweep_points


@dataclass
class SweepError:
    """One (method, ratio) of a sweep that failed, and why; model: its model's label on a sweep over several."""

    method: str
    ratio: float
    message: str
    model: str = ""


@dataclass
class Ceiling:
    """One model's side of a sweep: its full cache's answer (what its methods are measured against) and prefill.

    model: the model's label (``RunResult.model``); spec: how it was asked for (``--model``; "": the default).
    """

    model: str
    spec: str
    doc_tokens: int
    context_tokens: int
    answer_full: str
    logppl_full: float
    prefill_s: float
    prefill_reused: bool


@dataclass
class Sweep:
    """A Compare sweep: every (method, ratio) run on one document and question, in order, model after model.

    The top-level fields (model, doc_tokens, answer_full, ...) are the first
    model's; ``ceilings`` holds each model's own (one entry per model that ran),
    and each result names its model. stopped: when the request's time limit
    ended the sweep early, what was run and what was not (``results`` hold the
    runs done); "" otherwise.
    """

    model: str
    question: str
    doc_tokens: int
    context_tokens: int
    answer_full: str
    logppl_full: float
    prefill_s: float
    prefill_reused: bool
    results: list[RunResult] = field(default_factory=list)
    query_aware: list[bool] = field(default_factory=list)
    errors: list[SweepError] = field(default_factory=list)
    wall_s: float = 0.0
    stopped: str = ""
    ceilings: list[Ceiling] = field(default_factory=list)
    budgets: list[str] = field(default_factory=list)  # the budgets axis (BUDGETS values); empty: none


def sweep_label(sweep: "Sweep", r: RunResult) -> str:
    """A run's line and row name: its method, with the head budgets it used on a sweep with a budgets
    axis, and its model on a sweep over several models."""
    name = f"{r.method} [budgets={r.details['budgets']}]" if sweep.budgets and "budgets" in r.details else r.method
    return f"{name} · {r.model}" if len(sweep.ceilings) > 1 else name


def run_name(method: Method, axis: bool) -> str:
    """A sweep's name for a method run: its name, and on a budgets axis the ``budgets`` it ran with."""
    budgets = getattr(method.options, "budgets", None)
    return f"{method.name} [budgets={budgets}]" if axis and budgets is not None else method.name


def budget_variants(names: list[str], axis: typing.Sequence[str]) -> list[Method]:
    """Each method once per value of the budgets ``axis`` (kvlab.compression.budget_profiles.BUDGETS) it has,
    with that ``budgets`` knob; a method without the knob, or with none of the values, runs once with its
    defaults. No axis: each method with its defaults. InputError for a value not on the axis."""
    unknown = [v for v in axis if v not in BUDGETS]
    if unknown:
        raise InputError(f"unknown head budgets {', '.join(unknown)}; choose from {', '.join(BUDGETS)}")
    out: list[Method] = []
    for name in names:
        plain = get_method(name)
        choices = typing.get_args(option_types(type(plain.options)).get("budgets"))
        out += [get_method(name, budgets=v) for v in dict.fromkeys(axis) if v in choices] or [plain]
    return out


@dataclass
class _Request:
    """A checked sweep request: the models (specs; None: the default), the head-budgets axis, and every
    run (kvlab.lab.spec.RunSpec: method variant, ratio, model), model after model, all on one document,
    question and answer length."""

    specs: list[str | None]
    axis: list[str]
    runs: list[RunSpec]

    @property
    def per_model(self) -> int:
        """(method, ratio) runs on each model."""
        return len(self.runs) // len(self.specs)

    @property
    def question(self) -> str:
        return self.runs[0].question


@dataclass
class _Tally:
    """A sweep so far: the runs done (counted, failed or not), their results, and each model's ceiling."""

    results: list[RunResult] = field(default_factory=list)
    aware: list[bool] = field(default_factory=list)
    errors: list[SweepError] = field(default_factory=list)
    ceilings: list[Ceiling] = field(default_factory=list)
    done: int = 0
    stopped: str = ""


def _check_request(
    text: str | None,
    file: str | None,
    methods: list[str],
    ratios: list[float],
    question: str,
    max_new_tokens: int,
    model: str | None,
    models: typing.Sequence[str] | None,
    budgets: typing.Sequence[str],
) -> _Request:
    """:func:`compare`'s arguments checked (InputError for a bad one, the sweep's size first), each run
    made from one checked spec."""
    methods, ratios = check_sweep(methods, ratios)
    specs: list[str | None] = list(dict.fromkeys(s.strip() for s in models or [] if s.strip())) or [model or None]
    axis = list(dict.fromkeys(BUDGET_ALIASES.get(b, b) for b in budgets))  # an old spelling read as today's
    chosen = budget_variants(methods, axis)
    points = len(chosen) * len(ratios) * len(specs)
    if points > MAX_SWEEP_POINTS:
        raise InputError(
            f"{points} runs is too many for one sweep: pick at most {MAX_SWEEP_POINTS} "
            "(methods x head budgets x ratios x models)"
        )
    first = run_spec(text, file, chosen[0].name, ratios[0], question, max_new_tokens, model=specs[0])
    runs = [
        dataclasses.replace(first.for_method(m), ratio=r, model=spec) for spec in specs for m in chosen for r in ratios
    ]
    return _Request(specs, axis, runs)


def compare(
    text: str | None,
    file: str | None,
    methods: list[str],
    ratios: list[float],
    question: str,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: Progress = no_progress,
    model: str | None = None,
    models: typing.Sequence[str] | None = None,
    budgets: typing.Sequence[str] = (),
) -> Sweep:
    """Every method in ``methods`` (default knobs) at every ratio, on one document and question.

    budgets: a third axis, head budgets (:func:`budget_variants`): each method that has a ``budgets``
    knob runs once per value, labelled with it (:func:`run_name`).

    models: model specs to run the same sweep on, one after another (the same
    document and question; each model its own prefill and full-cache answer,
    :class:`Ceiling`); None or empty: ``model`` alone. Per model the prefill
    and the full cache's answer are computed once and shared. A (method,
    ratio) that fails is recorded in ``Sweep.errors`` and the sweep goes on;
    if every one fails, raises MethodError with the reasons. Each run is a
    unit of the request (kvlab.cancellation.between_units): others' runs may take
    the compute slot in between, and when the time limit passes after at
    least one run, the sweep returns what it has (``stopped`` says what was
    not run); stopped otherwise, it raises kvlab.cancellation.Cancelled.
    """
    start = time.perf_counter()
    request = _check_request(text, file, methods, ratios, question, max_new_tokens, model, models, budgets)
    tally = _Tally()
    for k, spec in enumerate(request.specs):
        _sweep_model(request, k, spec, tally, progress)
        if tally.stopped:
            break
    if not tally.results:
        reasons = "; ".join(f"{e.method} at {e.ratio:g}x: {e.message}" for e in tally.errors[:5])
        raise MethodError(f"every run of the sweep failed: {reasons}")
    top = tally.ceilings[0]
    return Sweep(
        model=top.model,
        question=request.question,
        doc_tokens=top.doc_tokens,
        context_tokens=top.context_tokens,
        answer_full=top.answer_full,
        logppl_full=top.logppl_full,
        prefill_s=top.prefill_s,
        prefill_reused=top.prefill_reused,
        results=tally.results,
        query_aware=tally.aware,
        errors=tally.errors,
        wall_s=time.perf_counter() - start,
        stopped=tally.stopped,
        ceilings=tally.ceilings,
        budgets=request.axis,
    )


def _sweep_model(request: _Request, k: int, spec: str | None, tally: _Tally, progress: Progress) -> None:
    """The sweep's runs on its ``k``-th model (``spec``), added to ``tally``, and that model's
    :class:`Ceiling` once one run succeeded; ``tally.stopped`` set when the time limit cut it short."""
    points, per_model = len(request.runs), request.per_model
    share = 1.0 / len(request.specs)
    base = k * share
    progress(base, f"loading the model {spec or ''} (the first use of a model takes a while)")
    lm = models_module.get_model(spec)
    check_question_tokens(lm.tokenizer, request.question)
    ctx, prefilled = prepared_context(
        lm, request.runs[0].document, sub_progress(progress, base + 0.02 * share, 0.16 * share)
    )
    first: RunResult | None = None
    for point in (p for p in request.runs[tally.done :] if p.model == spec):
        done, method_obj, ratio = tally.done, point.build(), point.ratio
        name = run_name(method_obj, bool(request.axis))
        label = f"{name} at {ratio:g}x ({done + 1}/{points}){f' on {lm.name}' if len(request.specs) > 1 else ''}: "
        at = base + share * (0.2 + 0.8 * (done - k * per_model) / per_model)
        point_progress = sub_progress(progress, at, 0.8 * share / per_model, label)
        try:
            if done:
                cancellation.between_units(f"{done} of {points} runs done")
            res = run(ctx, method_obj, ratio, point.question, point.max_new_tokens, point_progress).result
        except cancellation.Cancelled as exc:
            if exc.reason != cancellation.TIME or not tally.results:
                raise
            tally.stopped = not_run(exc, done, [(p.build(), p.ratio) for p in request.runs[done:]])
            break
        except Exception as exc:  # noqa: BLE001 - one failing point must not lose the sweep
            if not isinstance(exc, (MethodError, ValueError)):
                log.exception("sweep point failed (%s at %gx)", method_obj.name, ratio)
            tally.errors.append(
                SweepError(
                    name, float(ratio), f"{type(exc).__name__}: {exc}", lm.name if len(request.specs) > 1 else ""
                )
            )
        else:
            tally.results.append(res)
            tally.aware.append(method_obj.uses_question())
            first = first or res
        finally:
            tally.done += 1
    if first is not None:
        tally.ceilings.append(
            Ceiling(
                first.model,
                spec or "",
                first.doc_tokens,
                first.context_tokens,
                first.answer_full,
                first.logppl_full,
                first.prefill_s,
                not prefilled,
            )
        )


def not_run(exc: cancellation.Cancelled, done: int, left: list[tuple[Method, float]]) -> str:
    """What a sweep cut short by its time limit tells the user: the runs done, and those not run."""
    names = ", ".join(f"{m.name} at {r:g}x" for m, r in left[:8]) + (" and more" if len(left) > 8 else "")
    return (
        f"Stopped after {exc.elapsed_s:.0f} s because {exc.why}: {done} of {done + len(left)} runs done; "
        f"not run: {names}."
    )


def sweep_charts(sweep: Sweep) -> tuple:
    """(output error, mass error, log-perplexity) against the ratio, one line per method (and model).

    The full cache's log-perplexity is drawn as a reference on a one-model sweep; on several models each
    has its own (the status line lists them), so none is drawn."""
    points = [
        {
            "method": sweep_label(sweep, r),
            "ratio": r.ratio,
            "output": r.attn_output_rel_err,
            "mass": r.attn_mass_rel_err,
            "logppl": r.logppl_compressed,
        }
        for r in sweep.results
    ]
    one_model = len(sweep.ceilings) <= 1
    return (
        figures.sweep_figure(points, "output", "Attention-output error vs ratio (held-out queries)", "relative error"),
        figures.sweep_figure(points, "mass", "Attention-mass error vs ratio (held-out queries)", "relative error"),
        figures.sweep_figure(
            points,
            "logppl",
            "Log-perplexity of the full cache's answer vs ratio",
            "log-perplexity (nats/token)",
            reference=sweep.logppl_full if one_model else None,
            reference_label="full cache",
        ),
    )
