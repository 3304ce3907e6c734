"""The Gradio app: layout and callbacks. It calls the library and does no maths.

The page builds itself from :data:`kvlab.methods.REGISTRY`: the method menu,
the "Advanced" knobs (one input per field of each method's ``Options``
dataclass, shown for the selected method only) and the "Learn" tab. A method
registered later appears without any change here.

Endpoints (every event has an ``api_name``, so ``gradio_client`` can drive the app):

- ``/run``: (text, file, method, ratio, question, max_new_tokens, layer, head,
  model, intensity, and one keyword per knob named ``<method>__<field>``) ->
  summary, both answers, their word diff, five figures, the token-fate view; the plain
  function behind it is :func:`explore`. ``layer`` and ``head`` must lie in
  the sliders' range, which follows the model of the session's last run.
- ``/compare``: (text, file, methods, ratios, more_ratios, question,
  max_new_tokens, model) -> a sweep of every chosen method at every chosen
  ratio: a status line, the full cache's answer, three line charts against the
  ratio (attention-output error, mass error, answer log-perplexity), a table,
  and the results as CSV and JSON files; the plain function is :func:`compare`.
- ``/token_view``: (layer, head, intensity) -> the document coloured by token
  fate for that layer and KV head of the last run (kept per user in
  ``gr.State``), shaded by ``intensity`` (a value of INTENSITIES; default
  "score", the method's own score).
- ``/load_example``: (example id) -> document text, suggested questions, question.
- ``/pick_question``: (suggested question) -> question.
- ``/load_file``: (file) -> document text.
- ``/select_method``: (method) -> its description and which knobs show.

Models: the dropdown offers the default model (``KVLAB_MODEL``, else the
embedded SmolLM2) and every spec in ``KVLAB_MODELS`` (comma-separated: hub
ids, local directories, .gguf files); any other model is refused. A model is
loaded on first use; a failure is shown to the user and the server stays up.

On a ZeroGPU Space (the ``spaces`` package importable), the two heavy
functions, :func:`run_view` and :func:`sweep_view`, run under
``spaces.GPU``: they take and return only plain, picklable data (no model,
no cache), because ZeroGPU runs them in a forked worker process.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
import re
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import gradio as gr

from kvlab import figures
from kvlab.context import CONTEXTS, Context, Progress, no_progress
from kvlab.documents import DocumentError, Example, clean_text, load_examples, read_document
from kvlab.methods import REGISTRY, MethodError, get_method
from kvlab.methods.base import MAX_RATIO, MIN_RATIO
from kvlab.metrics import percentile_levels, question_attention
from kvlab.models import EMBEDDED, EMBEDDED_LABEL, LoadedModel, ModelLoadError, get_model
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS, Run, RunResult, run

if TYPE_CHECKING:
    import torch

try:  # ZeroGPU (Hugging Face Spaces): optional, never required
    import spaces  # type: ignore[import-not-found]
except ImportError:
    spaces = None

log = logging.getLogger("kvlab.app")

RATIO_MIN, RATIO_MAX, RATIO_DEFAULT = 2, 100, 10
MAX_NEW_TOKENS_MAX = 256
#: The method a first visit starts with.
PREFERRED_METHOD = "attention_matching"
#: Ratios offered by the Compare tab, and those ticked at first.
SWEEP_RATIOS = (2, 5, 10, 20, 50)
SWEEP_DEFAULT_RATIOS = (5, 10, 20, 50)
#: Methods ticked at first in the Compare tab (those registered).
SWEEP_DEFAULT_METHODS = ("attention_matching", "snapkv", "streaming_llm")
#: At most this many (method, ratio) runs per sweep.
MAX_SWEEP_POINTS = 100
#: What shades the token view: (label, value); the value names an entry of TokenFates.levels.
INTENSITIES = [("method's score", "score"), ("question's attention (full cache)", "question"), ("none", "none")]
INTENSITY_DEFAULT = "score"
#: What each intensity measures, for the view's legend.
INTENSITY_NOTES = {
    "score": "the method's own score of the token",
    "question": "the attention the question and the answer pay the token in the full cache",
}
# Placeholder geometry for the token-view sliders until a model is known.
_DEFAULT_LAYERS, _DEFAULT_KV_HEADS = 32, 8
# ZeroGPU time slots (seconds): one Explore run, and a sweep (per point, capped).
GPU_RUN_S = int(os.environ.get("KVLAB_GPU_DURATION", "120"))
GPU_SWEEP_BASE_S, GPU_SWEEP_POINT_S = 60, 15
GPU_MAX_S = int(os.environ.get("KVLAB_GPU_MAX_DURATION", "600"))

#: Formulas in the Learn tab: $$...$$ on their own line, $...$ inline.
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "$", "right": "$", "display": False}]
#: Requests waiting in the queue at most (more are refused with "queue full"), and how long
#: Gradio keeps uploaded and generated files (seconds).
QUEUE_SIZE = int(os.environ.get("KVLAB_QUEUE_SIZE", "20"))
FILE_CACHE_S = 3600

CSS = """
.kvlab-chip { padding: 1px 8px; margin-right: 4px; border: 1px solid #e5e7eb; border-radius: 6px; }
#kvlab-summary table { font-size: 0.92em; }
.kvlab-answer textarea { font-size: 1.02em; }
"""


class InputError(ValueError):
    """A missing or unusable input; the message is shown to the user as is."""


def on_gpu(duration: int | Callable[..., int]) -> Callable[[Callable], Callable]:
    """``spaces.GPU(duration=...)`` where the ``spaces`` package is importable (a ZeroGPU Space), else nothing."""

    def wrap(fn: Callable) -> Callable:
        if spaces is None:
            return fn
        return spaces.GPU(duration=duration)(fn)

    return wrap


# --------------------------------------------------------------------------- models


def model_choices(environ: typing.Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(label, spec) of every model the app offers; the first is the default.

    The default is ``KVLAB_MODEL`` (else the embedded model); the embedded model
    and every comma-separated spec of ``KVLAB_MODELS`` follow, without repeats.
    """
    env = os.environ if environ is None else environ
    default = (env.get("KVLAB_MODEL") or "").strip() or EMBEDDED
    extra = [s.strip() for s in (env.get("KVLAB_MODELS") or "").split(",") if s.strip()]
    out: list[tuple[str, str]] = []
    for spec in dict.fromkeys([default, EMBEDDED, *extra]):
        label = EMBEDDED_LABEL if spec == EMBEDDED else spec
        out.append((label + (" (default)" if spec == default else ""), spec))
    return out


# --------------------------------------------------------------------------- the plain functions


@dataclass
class Explored:
    """The last run of one user: the run, the decoded text of each context token, and what was reused.

    prefill_reused: the document's prefill came from the cache (an earlier run);
    full_answer_reused: so did the full cache's answer to this question;
    wall_s: the seconds this run took, end to end.
    """

    run: Run
    token_texts: list[str]
    expected: str | None = None
    query_aware: bool = False
    prefill_reused: bool = False
    full_answer_reused: bool = False
    wall_s: float = 0.0

    @property
    def n_layers(self) -> int:
        return self.run.ctx.lm.n_layers

    @property
    def n_kv_heads(self) -> int:
        return self.run.ctx.lm.n_kv_heads


def document_text(text: str | None, file: str | None) -> str:
    """The document to read: the text box when it holds text, else the uploaded file.

    Raises DocumentError (shown as is) when there is neither.
    """
    if text and text.strip():
        return clean_text(text)
    if file:
        return read_document(file)
    raise DocumentError(
        "There is no document: pick an example, paste some text or upload a .txt, .md or .pdf file."
    )


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text each token adds when the ids are decoded in order.

    Streaming detokenisation (decode a short window with and without the
    token, keep the difference) keeps leading spaces of SentencePiece tokens;
    a token that ends inside a multi-byte character gets "" and the character
    goes to the token completing it.
    """
    out: list[str] = []
    prefix_offset = read_offset = 0

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for i in range(len(ids)):
        prefix_text = decode(ids[prefix_offset:read_offset])
        new_text = decode(ids[prefix_offset : i + 1])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, i + 1
        else:
            out.append("")
    return out


def expected_answer(question: str, examples: list[Example]) -> str | None:
    """The gold answer when ``question`` is one of the bundled examples' questions."""
    q = question.strip().lower()
    for ex in examples:
        for question_, answer in zip(ex.questions, ex.answers):
            if question_.strip().lower() == q:
                return answer
    return None


def _check_question(question: str | None) -> str:
    question = (question or "").strip()
    if not question:
        raise InputError("The question is empty: type a question about the document (or pick a suggested one).")
    return question


def prepared_context(lm: LoadedModel, document: str, progress: Progress = no_progress) -> tuple[Context, bool]:
    """(the document's context for ``lm``, whether it was prefilled now) through the shared cache.

    The prefill runs only for a (model, document) pair not seen recently
    (kvlab.context.CONTEXTS); changing the method, ratio or question reuses it.
    """
    prefilled = False

    def on_prefill(fraction: float, desc: str) -> None:
        nonlocal prefilled
        prefilled = True
        progress(fraction, desc)

    return CONTEXTS.get(lm, document, on_prefill), prefilled


def _sub(progress: Progress, lo: float, width: float, label: str = "") -> Progress:
    return lambda f, desc: progress(lo + width * min(max(f, 0.0), 1.0), f"{label}{desc}")


def explore(
    text: str | None,
    file: str | None,
    method: str,
    ratio: float,
    question: str,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    options: dict[str, Any] | None = None,
    progress: Progress = no_progress,
    model: str | None = None,
) -> Explored:
    """One Explore run: read the document, prefill (cached), compress, answer twice, measure.

    Raises DocumentError (incl. ContextTooLong), MethodError, ModelLoadError or
    InputError with a message fit for the user.
    """
    start = time.perf_counter()
    question = _check_question(question)
    if max_new_tokens is None or int(max_new_tokens) < 1:
        raise InputError("The answer length must be at least 1 token.")
    document = document_text(text, file)
    method_obj = get_method(method, **(options or {}))
    progress(0.0, f"loading the model {model or ''} (the first use of a model takes a while)")
    lm = get_model(model or None)
    ctx, prefilled = prepared_context(lm, document, _sub(progress, 0.05, 0.35))
    answered = len(ctx.evaluations)
    result = run(
        ctx, method_obj, float(ratio), question, int(max_new_tokens), _sub(progress, 0.4, 0.6),
        record_importance=True,
    )
    texts = token_texts(lm.tokenizer, ctx.tokens.ids.tolist())
    return Explored(
        result, texts, expected_answer(question, _examples()), method_obj.uses_question(),
        prefill_reused=not prefilled,
        full_answer_reused=len(ctx.evaluations) == answered,
        wall_s=time.perf_counter() - start,
    )


def parse_ratios(selected: typing.Iterable[float | str] | None, more: str | None = None) -> list[float]:
    """The sweep's ratios: the ticked ones plus those typed (comma- or space-separated, "20" or "20x").

    Sorted, without repeats; raises InputError for anything that is not a
    ratio between kvlab's limits.
    """
    raw = [str(r) for r in (selected or [])] + [p for p in re.split(r"[,;\s]+", (more or "").strip()) if p]
    out: set[float] = set()
    for item in raw:
        try:
            value = float(item.strip().rstrip("xX"))
        except ValueError:
            raise InputError(f"{item!r} is not a compression ratio: type numbers such as 3, 8, 100") from None
        if not math.isfinite(value) or not (MIN_RATIO <= value <= MAX_RATIO):
            raise InputError(f"ratio {item} is out of range: use ratios from {MIN_RATIO:g} to {MAX_RATIO:g}")
        out.add(value)
    if not out:
        raise InputError("Pick at least one compression ratio to sweep.")
    return sorted(out)


@dataclass
class SweepError:
    """One (method, ratio) of a sweep that failed, and why."""

    method: str
    ratio: float
    message: str


@dataclass
class Sweep:
    """A Compare sweep: every (method, ratio) run on one document and question, in order."""

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


def compare(
    text: str | None,
    file: str | None,
    methods: list[str],
    ratios: list[float],
    question: str,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: Progress = no_progress,
    model: str | None = None,
) -> Sweep:
    """Every method in ``methods`` (default knobs) at every ratio, on one document and question.

    The prefill and the full cache's answer are computed once and shared. A
    (method, ratio) that fails is recorded in ``Sweep.errors`` and the sweep
    goes on; if every one fails, raises MethodError with the reasons.
    """
    start = time.perf_counter()
    if not methods:
        raise InputError("Pick at least one method to compare.")
    if not ratios:
        raise InputError("Pick at least one compression ratio to sweep.")
    points = len(methods) * len(ratios)
    if points > MAX_SWEEP_POINTS:
        raise InputError(f"{points} runs is too many for one sweep: pick at most {MAX_SWEEP_POINTS} (methods x ratios)")
    question = _check_question(question)
    document = document_text(text, file)
    chosen = [get_method(name) for name in methods]  # unknown names fail here, before any work
    progress(0.0, f"loading the model {model or ''} (the first use of a model takes a while)")
    lm = get_model(model or None)
    ctx, prefilled = prepared_context(lm, document, _sub(progress, 0.02, 0.18))
    errors: list[SweepError] = []
    done = 0
    results, aware = [], []
    for method_obj in chosen:
        for ratio in ratios:
            lo, width = 0.2 + 0.8 * done / points, 0.8 / points
            label = f"{method_obj.name} at {ratio:g}x ({done + 1}/{points}): "
            try:
                res = run(ctx, method_obj, float(ratio), question, int(max_new_tokens), _sub(progress, lo, width, label)).result
            except Exception as exc:  # noqa: BLE001 - one failing point must not lose the sweep
                if not isinstance(exc, (MethodError, ValueError)):
                    log.exception("sweep point failed (%s at %gx)", method_obj.name, ratio)
                errors.append(SweepError(method_obj.name, float(ratio), f"{type(exc).__name__}: {exc}"))
            else:
                results.append(res)
                aware.append(method_obj.uses_question())
            done += 1
    if not results:
        reasons = "; ".join(f"{e.method} at {e.ratio:g}x: {e.message}" for e in errors[:5])
        raise MethodError(f"every run of the sweep failed: {reasons}")
    first = results[0]
    return Sweep(
        model=first.model, question=question, doc_tokens=first.doc_tokens, context_tokens=first.context_tokens,
        answer_full=first.answer_full, logppl_full=first.logppl_full, prefill_s=first.prefill_s,
        prefill_reused=not prefilled, results=results, query_aware=aware, errors=errors,
        wall_s=time.perf_counter() - start,
    )


COMPARE_COLUMNS = [
    "method", "ratio", "query-aware", "memory ratio", "output error", "mass error",
    "log-ppl (full answer)", "compression s", "answer (compressed cache)",
]

#: The CSV export's columns: RunResult fields (plus the method's query-awareness).
EXPORT_FIELDS = [
    "model", "question", "method", "ratio", "query_aware", "doc_tokens", "context_tokens", "kept_tokens_mean",
    "bytes_full", "bytes_compressed", "memory_ratio", "attn_output_rel_err", "attn_mass_rel_err",
    "logppl_full", "logppl_compressed", "prefill_s", "compress_s", "answer_full_s", "answer_compressed_s",
    "answer_full", "answer_compressed",
]


def compare_rows(sweep: Sweep) -> list[list]:
    """The comparison table's rows (see COMPARE_COLUMNS), one per (method, ratio)."""
    return [
        [
            r.method,
            r.ratio,
            "yes" if a else "no",
            round(r.memory_ratio, 2),
            round(r.attn_output_rel_err, 4),
            round(r.attn_mass_rel_err, 4),
            round(r.logppl_compressed, 3),
            round(r.compress_s, 2),
            r.answer_compressed,
        ]
        for r, a in zip(sweep.results, sweep.query_aware)
    ]


def sweep_records(sweep: Sweep) -> list[dict[str, Any]]:
    """One flat record per run (the CSV rows): EXPORT_FIELDS of each RunResult."""
    out = []
    for r, aware in zip(sweep.results, sweep.query_aware):
        row = {**r.to_dict(), "query_aware": aware}
        out.append({k: row[k] for k in EXPORT_FIELDS})
    return out


def sweep_json(sweep: Sweep) -> dict[str, Any]:
    """The JSON export: the setting, every run's full RunResult (per-head errors included), and failures."""
    return {
        "kvlab": "compare",
        "model": sweep.model,
        "question": sweep.question,
        "doc_tokens": sweep.doc_tokens,
        "context_tokens": sweep.context_tokens,
        "answer_full": sweep.answer_full,
        "logppl_full": sweep.logppl_full,
        "prefill_s": sweep.prefill_s,
        "methods": list(dict.fromkeys(r.method for r in sweep.results)),
        "ratios": sorted({r.ratio for r in sweep.results}),
        "results": [{**r.to_dict(), "query_aware": a} for r, a in zip(sweep.results, sweep.query_aware)],
        "errors": [dataclasses.asdict(e) for e in sweep.errors],
    }


_EXPORT_DIR: Path | None = None
EXPORT_KEEP_S = 3600


def export_dir() -> Path:
    """A per-process folder for the CSV/JSON downloads; files older than an hour are removed."""
    global _EXPORT_DIR
    if _EXPORT_DIR is None or not _EXPORT_DIR.is_dir():
        _EXPORT_DIR = Path(tempfile.mkdtemp(prefix="kvlab_exports_"))
    now = time.time()
    for old in _EXPORT_DIR.iterdir():
        try:
            if now - old.stat().st_mtime > EXPORT_KEEP_S:
                old.unlink()
        except OSError:
            pass
    return _EXPORT_DIR


def write_exports(sweep: Sweep, folder: Path | None = None) -> tuple[str, str]:
    """Write the sweep as CSV and JSON files; returns their paths."""
    folder = folder or export_dir()
    stem = f"kvlab_compare_{time.strftime('%Y%m%d-%H%M%S')}_{os.urandom(3).hex()}"
    csv_path, json_path = folder / f"{stem}.csv", folder / f"{stem}.json"
    with csv_path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=EXPORT_FIELDS)
        writer.writeheader()
        writer.writerows(sweep_records(sweep))
    json_path.write_text(json.dumps(sweep_json(sweep), indent=1), encoding="utf-8")
    return str(csv_path), str(json_path)
# --------------------------------------------------------------------------- method knobs


@dataclass(frozen=True)
class Knob:
    """One field of one method's Options dataclass, as an input of the app."""

    method: str
    field: dataclasses.Field
    kind: Any

    @property
    def key(self) -> str:
        """The keyword of this knob in the ``/run`` endpoint: ``<method>__<field>``."""
        return re.sub(r"\W", "_", f"{self.method}__{self.field.name}")

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            return f.default_factory()  # type: ignore[misc]
        return None

    def component(self) -> gr.components.Component:
        help_text = self.field.metadata.get("help", "")
        info = f"{help_text} (default {self.default!r})".strip()
        label, kind, default = self.field.name, self.kind, self.default
        if typing.get_origin(kind) is typing.Literal:
            return gr.Dropdown(choices=list(typing.get_args(kind)), value=default, label=label, info=info)
        if kind is bool:
            return gr.Checkbox(value=bool(default), label=label, info=info)
        if kind is int:
            return gr.Number(value=default, precision=0, step=1, label=label, info=info)
        if kind is float:
            return gr.Number(value=default, step=0.01, label=label, info=info)
        return gr.Textbox(value="" if default is None else str(default), label=label, info=info)

    def convert(self, value: Any) -> Any:
        """The knob's value as its field's type (None when left empty)."""
        if value is None or (isinstance(value, str) and not value.strip() and self.kind is not str):
            return None
        kind = self.kind
        if kind is bool:
            return bool(value)
        if kind is int:
            if float(value) != int(float(value)):
                raise InputError(f"{self.method}: {self.field.name} must be a whole number, got {value}")
            return int(float(value))
        if kind is float:
            return float(value)
        return value


def method_knobs() -> dict[str, list[Knob]]:
    """Every registered method's knobs, by method name (sorted)."""
    out: dict[str, list[Knob]] = {}
    for name, cls in sorted(REGISTRY.items()):
        try:
            hints = typing.get_type_hints(cls.Options)
        except Exception:  # noqa: BLE001 - unresolvable annotation: fall back to the default's type
            hints = {}
        knobs = []
        for f in dataclasses.fields(cls.Options):
            if not f.init:
                continue
            kind = hints.get(f.name, f.type)
            if isinstance(kind, str) or kind is None:
                kind = type(f.default) if f.default is not dataclasses.MISSING else str
            knobs.append(Knob(name, f, kind))
        out[name] = knobs
    return out


def method_options(method: str, knobs: dict[str, list[Knob]], values: dict[str, Any]) -> dict[str, Any]:
    """The Options keyword arguments of ``method`` from the knob values keyed by ``Knob.key``."""
    opts = {}
    for knob in knobs.get(method, []):
        if knob.key in values:
            value = knob.convert(values[knob.key])
            if value is not None:
                opts[knob.field.name] = value
    return opts


def query_awareness(name: str) -> str:
    """"yes", "no", or "options" when only some knob settings make the method query-aware."""
    cls = REGISTRY[name]
    if cls.query_aware:
        return "yes"
    return "options" if cls.query_aware_when else "no"


def _aware_tag(name: str) -> str:
    return {"yes": "  [query-aware]", "options": "  [query-aware with some knobs]", "no": ""}[query_awareness(name)]


def method_label(name: str) -> str:
    return f"{name}: {REGISTRY[name].summary}{_aware_tag(name)}"


def default_method() -> str:
    """The method a first visit starts with: Attention Matching when registered,
    else the first (alphabetically) query-agnostic method, else the first one."""
    if PREFERRED_METHOD in REGISTRY:
        return PREFERRED_METHOD
    names = sorted(REGISTRY)
    return next((n for n in names if query_awareness(n) != "yes"), names[0])


def method_info(name: str) -> str:
    if name not in REGISTRY:
        return ""
    cls = REGISTRY[name]
    aware = {
        "yes": "**Query-aware**: the compression depends on your question (change the question, and the cache changes).",
        "no": "Query-agnostic: the same compressed cache serves any question.",
        "options": f"Query-agnostic with its default knobs; with {cls.query_aware_when} (see Advanced) it is "
        "**query-aware**, i.e. the compression then depends on your question.",
    }[query_awareness(name)]
    paper = f" Paper: *{cls.paper}*." if cls.paper else ""
    return f"{aware}{paper}"


# --------------------------------------------------------------------------- the Learn tab

# Notation shared by the notes below: T document tokens, ratio r, budget
# B = T / r keys per KV head, a_ij = softmax_j(q_i . k_j / sqrt(d)) the attention
# query i pays key j.
METHOD_NOTES: dict[str, str] = {
    "attention_matching": (
        "Instead of choosing which tokens to keep, Attention Matching *builds* a small cache that behaves "
        "like the big one. Each KV head's T document keys and values are replaced by t = T/r keys "
        "$C_k$ (a subset of the original keys), one scalar bias $\\beta_j$ per key, and refitted values "
        "$C_v$, so that for reference queries $q$ both the attention **mass** and the attention **output** "
        "of the block are preserved:\n\n"
        "$$\\sum_{j=1}^{t} e^{q\\cdot c_j/\\sqrt d+\\beta_j}\\approx\\sum_{j=1}^{T} e^{q\\cdot k_j/\\sqrt d},"
        "\\qquad \\operatorname{softmax}\\!\\Big(\\tfrac{qC_k^\\top}{\\sqrt d}+\\beta\\Big)C_v\\approx"
        "\\operatorname{softmax}\\!\\Big(\\tfrac{qK^\\top}{\\sqrt d}\\Big)V$$\n\n"
        "Matching both makes the compact block a drop-in replacement whatever is read after it. Three "
        "closed-form steps, no gradient descent: keep the keys the reference queries attend to most "
        "(RMS attention as in the published code; mean or max with `scoring`) or pick them by orthogonal matching pursuit, fit $w=e^{\\beta}$ by non-negative least squares on the mass "
        "($\\beta$ bounded to $[-3,3]$), then fit $C_v$ by least squares on the outputs. $e^{\\beta_j}$ reads as "
        "\"how many original keys' worth of mass key $j$ stands for\". The reference queries come, by "
        "default, from a *repeat-prefill*: the model is asked to repeat the document and its queries while "
        "re-reading it are recorded (your question is never used unless `query_source=question`)."
    ),
    "attention_topk": (
        "The key selection of Attention Matching on its own, as the paper's eviction baseline: keep the "
        "B keys the reference queries attend to most, $s_j=\\sqrt{\\tfrac1n\\sum_i a_{ij}^2}$ (RMS over the "
        "queries of the head's group by default; `scoring` as in `attention_matching`), with no bias and the original values. The gap between this and "
        "`attention_matching` is what fitting $\\beta$ and the values buys."
    ),
    "streaming_llm": (
        "Keeps the first few tokens (\"attention sinks\", which soak up attention in every layer) and the "
        "most recent ones: $\\text{keep}=\\{1..s\\}\\cup\\{T-(B-s)+1..T\\}$. It looks at positions only, never "
        "at attention, so it is the cheapest method and forgets everything in the middle of the document."
    ),
    "h2o": (
        "\"Heavy hitters\": tokens that received much attention while the document was read are likely to "
        "receive it again. A key's score is the attention it received from the prefill's own queries, "
        "averaged over the queries that could see it (causal) and over the query heads of its group, "
        "$s_j=\\tfrac{1}{T-j}\\sum_{i\\ge j}a_{ij}$; by default half of each head's budget is kept for the "
        "most recent tokens."
    ),
    "snapkv": (
        "The last queries of the prompt already show what the model will look for. Each token is scored by "
        "the attention of an observation window $W$ (the document's last 64 queries), averaged over the "
        "window and the query heads of its group and smoothed by 1-D average pooling: "
        "$s_j=\\operatorname{pool}_5\\big(\\tfrac{1}{|W|}\\sum_{i\\in W}a_{ij}\\big)$; top B per head, the window "
        "itself is kept. Here the window is the end of the document, so it is query-agnostic."
    ),
    "snapkv_question": (
        "SnapKV whose observation window is your question (read after the document): "
        "$s_j=\\operatorname{pool}_5\\big(\\tfrac{1}{|W|}\\sum_{i\\in W_{\\text{question}}}a_{ij}\\big)$. This is the "
        "setting of the SnapKV paper, where the question is at the end of the prompt: excellent for that "
        "question, but the cache must be rebuilt for every new question."
    ),
    "pyramidkv": (
        "SnapKV's scores with budgets that shrink linearly with depth: lower layers spread their attention "
        "widely and get more keys, upper layers focus and get fewer. With slope $\\beta$ the top layer keeps "
        "$B/\\beta$ keys per head and the bottom layer $2B-B/\\beta$; the mean over layers stays $B$."
    ),
    "tova": (
        "Token Omission Via Attention: the score is the attention the document's last token pays each token, "
        "averaged over all query heads of the layer, $s_j=\\tfrac1H\\sum_h a^{(h)}_{T j}$, so every KV head of "
        "a layer keeps the same tokens."
    ),
    "kvzip": (
        "Query-agnostic by construction: the model is asked to \"Repeat the previous context exactly\" and is "
        "teacher-forced through the document again; a token needed to rebuild the context is worth keeping. "
        "Score: the largest attention it receives from any reconstruction query and any query head of its "
        "group, $s_j=\\max_{i\\in\\text{repeat}}\\max_{g}a^{(g)}_{ij}$. Scores are pruned globally across all "
        "layers and heads, so heads keep different numbers of tokens."
    ),
    "expected_attention": (
        "Estimates the attention future queries will pay, without computing any attention matrix. The "
        "context's queries are summarised per head by their mean $\\mu$ and covariance $\\Sigma$; with "
        "$\\bar R$ the RoPE rotation averaged over the next positions, a Gaussian query gives "
        "$$\\hat a_j\\propto\\exp\\!\\Big(\\tfrac{k_j^\\top\\bar R\\mu}{\\sqrt d}+"
        "\\tfrac{k_j^\\top\\bar R\\Sigma\\bar R^\\top k_j}{2d}\\Big),\\qquad s_j=\\hat a_j\\,\\lVert v_j\\rVert$$ "
        "(softmax over the keys, times the size of what the key would contribute)."
    ),
    "kivi": (
        "Keeps every token but stores keys and values in 2, 4 or 8 bits. Asymmetric uniform quantisation per "
        "group, $\\hat x=s\\cdot\\operatorname{round}\\big(\\tfrac{x-z}{s}\\big)+z$ with $z=\\min$ and "
        "$s=\\tfrac{\\max-\\min}{2^b-1}$: keys per channel (groups of 32 tokens, because outliers live in "
        "channels), values per token. The memory is set by the bits, not by the ratio (the ratio only caps "
        "it, by evicting the oldest tokens if needed); codes, scales and zero points are really packed and "
        "counted."
    ),
    "beaconkv": (
        "Eviction guided by *beacon queries*: some decoding steps look far back (e.g. to an early plan) and "
        "their queries fall into a few clusters. Per head, a few past queries are chosen by farthest-point "
        "sampling (cosine distance) over the history of pre-RoPE queries (kept bounded by continual "
        "re-sampling) and rotated to the current position; a key's score is the largest attention it gets "
        "from the scoring set (16 recent + 16 beacon queries) and from any query head of its group, "
        "$s_j=\\max_{q\\in R\\cup\\mathcal B}\\max_g a^{(g)}_{qj}$. The template and a recent window are always "
        "kept. The paper's abstract is confirmed, but its details here come from **secondary summaries** "
        "(its code could not be read), so treat this as the best available reading."
    ),
    "beaconkv_mixed": (
        "The reading of BeaconKV in this project's source article: the tokens the beacons select (and a "
        "recent window) stay at full precision, all other tokens are stored at 4 or 2 bits (KIVI) or evicted. "
        "Here the ratio is a **memory** ratio: bytes stored ≈ full bytes / r, counting packed codes, scales "
        "and zero points. Like `beaconkv`, its details come from secondary summaries of the paper."
    ),
    "summarisation": (
        "A baseline outside the KV cache: the model writes a summary of about T/r tokens and the summary's "
        "cache replaces the document's. Cheap to store, but whatever the summary leaves out is gone, and "
        "writing it is slow on a CPU."
    ),
    "summary_am": (
        "Summarise, then compact: the model writes a summary, and Attention Matching compacts the summary's "
        "cache down to T/r keys per head (of the original document). The paper reports that this reaches "
        "very high ratios with the accuracy of the summary alone."
    ),
    "random": "A seeded random subset of B tokens per head: the floor any scoring rule has to beat.",
    "no_context": (
        "The floor: the document is dropped and only the chat template is kept, so the model answers from "
        "what it already knows. Compare any method with this and with the full cache (the ceiling)."
    ),
}

LEARN_INTRO = """\
## What the lab shows
A language model reads your document once (the *prefill*) and keeps, for every layer and every KV head, \
a key and a value vector per token: the **KV cache**. It grows with the document and is what limits how long \
a text a GPU can hold. A compression method keeps about *1/ratio* of the document's entries per head (the chat \
template's tokens are always kept) and the model answers your question from that smaller cache. The prefill \
is done once per document and model: changing the method, the ratio or the question reuses it.

Notation below: T document tokens, ratio r, budget B = T/r keys per KV head, d the head dimension, and \
$a_{ij}$ the attention query i pays key j:

$$a_{ij}=\\frac{e^{q_i\\cdot k_j/\\sqrt d}}{\\sum_{l} e^{q_i\\cdot k_l/\\sqrt d}}$$

### The Explore tab
- **Answers**: from the full cache and from the compressed cache, with their word-level differences \
(red: only in the full cache's answer; blue: only in the compressed cache's).
- **Attention-output error** (heatmap, layer x KV head): for queries the compressed cache never saw \
(your question's and the answer's, *held out*), how far each head's attention output moves, \
$\\lVert y_{\\text{compressed}}-y_{\\text{full}}\\rVert/\\lVert y_{\\text{full}}\\rVert$, averaged over the queries. \
0 is perfect; around 1 means the head's output is lost.
- **Attention mass, full vs compressed** (a line per layer, a heatmap per layer x KV head): \
$e^{\\mathrm{LSE}_{\\text{compressed}}-\\mathrm{LSE}_{\\text{full}}}$, the attention weight the compressed \
document draws as a share of what the full one draws (1x: the same; blue below, red above). It matters because \
the document competes with the tokens after it (question, answer) for attention: eviction loses mass, \
Attention Matching's biases put it back. The summary's *mass error* is $|\\text{ratio}-1|$, averaged.
- **Keys per head** (heatmap): how many keys each head stores; some methods give heads different budgets.
- **Memory**: bytes of the full cache and of the compressed one, stacked by what is stored (keys and \
values, biases, packed codes, scales).
- **Time per stage**: prefill, reference queries, compression, the two answers and the measurements; \
stages reused from an earlier run are marked *reused*.
- **Token fates**: for one layer and KV head, what happened to each token: kept, evicted, or another fate \
of the method (quantised, compacted, ...). The **intensity** shades each token by its percentile rank within \
the head, of the method's own score (methods without one show no shading) or of the attention the question \
and the answer pay it in the full cache: pale is low, strong is high (an evicted token on grey ranked high).

### The Compare tab
A sweep: every chosen method at every chosen ratio, with default knobs, on the Explore tab's document, \
question and model. Three line charts against the ratio (log scale), one line per method: the \
attention-output error, the attention-mass error, and the **log-perplexity** of the full cache's own answer \
$y$ when read from the compressed cache,

$$\\text{log-ppl}=-\\frac1m\\sum_{t=1}^{m}\\log p_{\\text{compressed}}(y_t\\mid\\text{question},y_{<t}),$$

with the full cache's value as a dashed reference line: the closer to it, the more the compressed cache \
behaves like the full one. The table and the CSV / JSON downloads hold every number.

## Methods
"""


def learn_markdown() -> str:
    """The "Learn" tab: what the lab measures, and every registered method with its idea, formula, paper and knobs.

    Methods with a written note (METHOD_NOTES) get it; any other registered
    method shows its one-line summary and its paper only.
    """
    lines = [LEARN_INTRO]
    for name, cls in sorted(REGISTRY.items()):
        tag = {"yes": " (query-aware)", "options": " (query-aware with some knobs)", "no": ""}[query_awareness(name)]
        lines.append(f"### `{name}`{tag}")
        lines.append(f"*{cls.summary}.*")
        if name in METHOD_NOTES:
            lines.append("\n" + METHOD_NOTES[name])
        if cls.paper:
            lines.append(f"\nPaper: *{cls.paper}*.")
        fields = [f for f in dataclasses.fields(cls.Options) if f.init]
        if fields:
            lines.append("\n| knob | default | what it does |\n|---|---|---|")
            for f in fields:
                default = f.default if f.default is not dataclasses.MISSING else ""
                lines.append(f"| `{f.name}` | `{default!r}` | {f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- presenting a run


def _examples() -> list[Example]:
    try:
        return load_examples()
    except DocumentError as exc:  # a broken manifest must not take the app down
        log.warning("examples unavailable: %s", exc)
        return []


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def summary_markdown(ex: Explored) -> str:
    r = ex.run.result
    prefix = r.context_tokens - r.doc_tokens
    agree = figures.answers_agree(r.answer_full, r.answer_compressed)
    verdict = (
        "The two answers are **identical**."
        if r.answer_full.strip() == r.answer_compressed.strip()
        else f"The answers **differ** (word overlap {agree:.0%})."
    )
    expected = f" Expected answer (from the example): **{ex.expected}**." if ex.expected else ""
    prefill = (
        f"Prefill {r.prefill_s:.2f} s: reused (cached from an earlier run on this document), not re-run."
        if ex.prefill_reused
        else f"Prefill {r.prefill_s:.2f} s (done now; reused by later runs on this document)."
    )
    return (
        f"**{r.method}**{' (query-aware: compressed for this question)' if ex.query_aware else ''} at **{r.ratio:g}x** on {r.doc_tokens:,} document tokens "
        f"(+ {prefix} chat-template tokens, always kept) with {r.model}: "
        f"{r.kept_tokens_mean:.1f} keys stored per head on average. {verdict}{expected}\n\n"
        "| | full cache | compressed cache |\n|---|---|---|\n"
        f"| memory | {_bytes(r.bytes_full)} | {_bytes(r.bytes_compressed)} ({r.memory_ratio:.1f}x smaller) |\n"
        f"| answer time | {r.answer_full_s:.2f} s{' (cached)' if ex.full_answer_reused else ''} | {r.answer_compressed_s:.2f} s |\n"
        f"| log-perplexity of the full cache's answer | {r.logppl_full:.3f} | {r.logppl_compressed:.3f} |\n\n"
        f"Attention error on held-out queries (mean over layers x KV heads): "
        f"output {r.attn_output_rel_err:.3f}, mass {r.attn_mass_rel_err:.3f}. "
        f"{prefill} Compression {r.compress_s:.2f} s; this run took {ex.wall_s:.1f} s in all."
    )


def stage_timings(ex: Explored) -> tuple[dict[str, float], dict[str, str]]:
    """(seconds per stage of this run, notes for stages reused from earlier runs) for the time figure.

    Stages: prefill, reference queries (when the method reports them in
    ``details["fit_s"]["queries"]``), compression, both answers, and the
    rest of the run (errors, log-perplexity, token texts). A reused stage
    counts 0 s and is labelled with the time it took when it ran.
    """
    r = ex.run.result
    fit = r.details.get("fit_s") if isinstance(r.details.get("fit_s"), dict) else {}
    queries_s = float(fit.get("queries", 0.0)) if fit else 0.0
    has_queries = bool(fit) and "queries" in fit
    timings: dict[str, float] = {}
    notes: dict[str, str] = {}
    timings["prefill"] = 0.0 if ex.prefill_reused else r.prefill_s
    if ex.prefill_reused:
        notes["prefill"] = f"reused ({r.prefill_s:.2f} s when run)"
    if has_queries:
        timings["reference queries"] = queries_s
    timings["compression" + (" (fit)" if has_queries else "")] = max(0.0, r.compress_s - queries_s)
    timings["answer, full cache"] = 0.0 if ex.full_answer_reused else r.answer_full_s
    if ex.full_answer_reused:
        notes["answer, full cache"] = f"reused ({r.answer_full_s:.2f} s when run)"
    timings["answer, compressed cache"] = r.answer_compressed_s
    timings["errors, log-ppl, other"] = max(0.0, ex.wall_s - sum(timings.values()))
    return timings, notes


def _level_bytes(per_layer: list[torch.Tensor]) -> list[list[bytes]]:
    """Per layer [H_kv, T] scores -> [layer][head] one level byte per token (kvlab.metrics.percentile_levels)."""
    return [[bytes(row.tolist()) for row in percentile_levels(scores)] for scores in per_layer]


@dataclass
class TokenFates:
    """What happened to every context token in every layer and KV head of a run: plain, light data.

    codes[layer][head] holds one byte per context token, an index into
    ``names`` (0: evicted). levels[source][layer][head] holds one byte per
    context token for each intensity source the run has ("score": the
    method's own score, absent for a method without one; "question": the
    question's attention over the full cache): 0 for a token without a
    score, else its percentile rank within the head (1-255). This is what the
    app keeps per user between runs (``gr.State``), instead of the run and its cache.
    """

    token_texts: list[str]
    names: list[str]
    codes: list[list[bytes]]
    levels: dict[str, list[list[bytes]]] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.codes)

    @property
    def n_kv_heads(self) -> int:
        return len(self.codes[0]) if self.codes else 0

    @classmethod
    def of(cls, ex: Explored) -> TokenFates:
        names, index = [figures.EVICTED], {figures.EVICTED: 0}
        n = len(ex.token_texts)
        codes = []
        for layer in range(ex.n_layers):
            row = []
            for head in range(ex.n_kv_heads):
                buf = bytearray(n)
                for i, fate in ex.run.stored.fates(layer, head).items():
                    if 0 <= i < n:
                        if fate not in index:
                            index[fate] = len(names)
                            names.append(fate)
                        buf[i] = index[fate]
                row.append(bytes(buf))
            codes.append(row)
        run = ex.run
        levels = {"question": _level_bytes(question_attention(run.evaluation.queries, run.ctx.full.keys))}
        if run.stored.importance is not None:
            levels["score"] = _level_bytes(run.stored.importance)
        return cls(ex.token_texts, names, codes, levels)

    def fates(self, layer: int, head: int) -> dict[int, str]:
        """Token index -> fate, for the tokens not evicted in one layer and KV head."""
        return {i: self.names[c] for i, c in enumerate(self.codes[layer][head]) if c}


def token_view(
    view: TokenFates | None, layer: int, head: int, intensity: str = INTENSITY_DEFAULT
) -> tuple[str, str]:
    """(counts line, the document as HTML coloured by token fate) for one layer and KV head of a run.

    intensity: a value of INTENSITIES; tokens are shaded by that source's
    levels when the run has them, and the counts line says when it has not.
    """
    if view is None or not view.codes:
        return "Run a compression first: the document will appear here, coloured by what happened to each token.", ""
    layer = min(max(int(layer), 0), view.n_layers - 1)
    head = min(max(int(head), 0), view.n_kv_heads - 1)
    fates = view.fates(layer, head)
    n = len(view.token_texts)
    counts = figures.fate_counts(n, fates)
    parts = ", ".join(f"{c:,} {fate}" for fate, c in sorted(counts.items(), key=lambda kv: -kv[1]))
    line = f"Layer {layer}, KV head {head}: {parts} (of {n:,} context tokens)."
    levels, note = view.levels.get(intensity), None
    if levels is not None:
        note = INTENSITY_NOTES[intensity]
        line += f" Intensity: {note}, as a percentile within this head."
    elif intensity == "score":
        line += " This method has no per-token score: shown without intensity."
    segments = figures.fate_segments(view.token_texts, fates, levels=None if levels is None else levels[layer][head])
    return line, figures.bits_strip_html(n, fates) + figures.fate_html(segments, intensity=note)


@dataclass
class RunView:
    """Everything ``/run`` shows for one run, as plain picklable data (no model, no cache).

    outputs: summary, full answer, compressed answer, word diff, and the
    error, mass, kept, memory and time figures.
    """

    outputs: tuple
    fates: TokenFates
    fit_figures: tuple | None = None  # Attention Matching: bias histogram, fitting vs evaluation error


def present(ex: Explored) -> RunView:
    """The figures and texts of one finished run."""
    r = ex.run.result
    timings, notes = stage_timings(ex)
    return RunView(
        (
            summary_markdown(ex),
            r.answer_full,
            r.answer_compressed,
            figures.word_diff(r.answer_full, r.answer_compressed),
            figures.error_heatmap(r.per_head),
            figures.mass_heatmap(r.per_head),
            figures.kept_heatmap(r.per_head),
            figures.memory_figure(r.bytes_full, r.bytes_compressed, r.memory_breakdown),
            figures.time_figure(timings, notes, total=ex.wall_s),
        ),
        TokenFates.of(ex),
        fit_figures(ex),
    )


def fit_figures(ex: Explored) -> tuple | None:
    """Attention Matching's inner workings, when the run has them."""
    r = ex.run.result
    train = r.details.get("train_attn_output_rel_err")
    if train is None:
        return None
    return (
        figures.bias_histogram(ex.run.fitted_biases()),
        figures.fit_vs_eval_figure(train, r.per_head["attn_output_rel_err"]),
    )


@on_gpu(duration=GPU_RUN_S)
def run_view(
    text: str | None,
    file: str | None,
    method: str,
    ratio: float,
    question: str,
    max_new_tokens: int,
    options: dict[str, Any],
    model: str | None,
    progress: Progress = no_progress,
) -> RunView:
    """The heavy part of ``/run`` (a ZeroGPU function on Spaces): :func:`explore`, then :func:`present`.

    ``progress`` may be a ``gr.Progress`` (it is picklable; a lambda would not be).
    """
    return present(explore(text, file, method, ratio, question, max_new_tokens, options, progress, model))


@dataclass
class SweepView:
    """Everything ``/compare`` computes, as plain picklable data: the sweep and its three charts."""

    sweep: Sweep
    charts: tuple


def sweep_charts(sweep: Sweep) -> tuple:
    """(output error, mass error, log-perplexity) against the ratio, one line per method."""
    points = [
        {"method": r.method, "ratio": r.ratio, "output": r.attn_output_rel_err,
         "mass": r.attn_mass_rel_err, "logppl": r.logppl_compressed}
        for r in sweep.results
    ]
    return (
        figures.sweep_figure(points, "output", "Attention-output error vs ratio (held-out queries)", "relative error"),
        figures.sweep_figure(points, "mass", "Attention-mass error vs ratio (held-out queries)", "relative error"),
        figures.sweep_figure(
            points, "logppl", "Log-perplexity of the full cache's answer vs ratio", "log-perplexity (nats/token)",
            reference=sweep.logppl_full, reference_label="full cache",
        ),
    )


def _sweep_duration(text, file, methods, ratios, *args, **kwargs) -> int:  # noqa: ANN001 - spaces' signature
    points = max(1, len(methods or []) * len(ratios or []))
    return int(min(GPU_MAX_S, GPU_SWEEP_BASE_S + GPU_SWEEP_POINT_S * points))


@on_gpu(duration=_sweep_duration)
def sweep_view(
    text: str | None,
    file: str | None,
    methods: list[str],
    ratios: list[float],
    question: str,
    max_new_tokens: int,
    model: str | None,
    progress: Progress = no_progress,
) -> SweepView:
    """The heavy part of ``/compare`` (a ZeroGPU function on Spaces): :func:`compare` and its charts."""
    sweep = compare(text, file, methods, ratios, question, max_new_tokens, progress, model)
    return SweepView(sweep, sweep_charts(sweep))


def sweep_status(sweep: Sweep) -> str:
    methods = list(dict.fromkeys(r.method for r in sweep.results))
    ratios = sorted({r.ratio for r in sweep.results})
    prefill = "reused from an earlier run" if sweep.prefill_reused else f"{sweep.prefill_s:.1f} s, done now"
    text = (
        f"**{len(sweep.results)} runs**: {len(methods)} method(s) x {len(ratios)} ratio(s) "
        f"({', '.join(f'{r:g}x' for r in ratios)}) on {sweep.doc_tokens:,} document tokens with {sweep.model}, "
        f"in {sweep.wall_s:.1f} s (prefill {prefill}). Full cache's log-perplexity of its own answer: "
        f"{sweep.logppl_full:.3f}."
    )
    if sweep.errors:
        text += "\n\n**Failed** (left out of the charts): " + "; ".join(
            f"{e.method} at {e.ratio:g}x ({e.message})" for e in sweep.errors
        )
    return text


USER_ERRORS = (DocumentError, MethodError, ModelLoadError, InputError)


def _as_gr_error(exc: Exception) -> gr.Error:
    title = {
        ModelLoadError: "Model not available",
        MethodError: "Method problem",
        InputError: "Missing input",
    }.get(type(exc), "Document problem" if isinstance(exc, DocumentError) else "Error")
    return gr.Error(str(exc), title=title, print_exception=False)


def _unexpected(exc: Exception, method: str) -> gr.Error:
    log.exception("run failed (%s)", method)
    return gr.Error(
        f"The run with {method} failed: {type(exc).__name__}: {exc}. Try other knobs or another method.",
        title="Run failed", print_exception=False,
    )


# --------------------------------------------------------------------------- the app


def build_app(lm: LoadedModel | None = None, models: list[tuple[str, str]] | None = None) -> gr.Blocks:
    """The whole app.

    lm: the default model when already loaded (its name and geometry set the
    page's first state); models: (label, spec) choices of the model menu, the
    first being the default (default: :func:`model_choices`, from the environment).
    """
    examples = _examples()
    knobs = method_knobs()
    methods = sorted(REGISTRY)
    start_method = default_method()
    choices = list(models) if models is not None else model_choices()
    specs = [spec for _, spec in choices]
    if lm is not None:  # the loaded default model's own name
        choices[0] = (f"{lm.name} (default)", specs[0])
    n_layers = lm.n_layers if lm else _DEFAULT_LAYERS
    n_kv = lm.n_kv_heads if lm else _DEFAULT_KV_HEADS
    sweep_methods = [m for m in SWEEP_DEFAULT_METHODS if m in REGISTRY] or methods[:3]

    with gr.Blocks(title="kvlab: KV-cache compression lab", delete_cache=(FILE_CACHE_S, FILE_CACHE_S)) as demo:
        last = gr.State(None, time_to_live=3600)
        gr.Markdown(
            "# kvlab: a lab for KV-cache compression\n"
            "Give a language model a document and a question; compress its KV cache with a method "
            "at a ratio; compare the answers, the memory, the time and the attention errors, "
            "and see which tokens each head kept. The **Learn** tab explains every method and plot."
        )
        model = gr.Dropdown(
            choices=choices, value=specs[0], label="Model",
            info="Used by Explore and Compare; a model other than the default is loaded on first use",
            elem_id="kvlab-model", interactive=len(choices) > 1,
        )
        with gr.Tabs():
            with gr.Tab("Explore", id="explore"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=5):
                        example = gr.Dropdown(
                            choices=[
                                (f"{ex.title}" + (f" (~{ex.tokens:,} tokens)" if ex.tokens else ""), ex.id)
                                for ex in examples
                            ],
                            value=None,
                            label="Bundled example",
                            info="Fills the document and offers questions about it",
                            elem_id="kvlab-example",
                        )
                        upload = gr.File(
                            label="Upload a document (.txt, .md, .pdf)",
                            file_types=[".txt", ".md", ".pdf"],
                            type="filepath",
                            height=110,
                            elem_id="kvlab-file",
                        )
                        text = gr.Textbox(
                            label="Document",
                            placeholder="Paste a document here, upload a file or pick an example.",
                            lines=9,
                            max_lines=16,
                            elem_id="kvlab-text",
                        )
                    with gr.Column(scale=4):
                        method = gr.Dropdown(
                            choices=[(method_label(n), n) for n in methods],
                            value=start_method,
                            label="Method",
                            elem_id="kvlab-method",
                        )
                        info = gr.Markdown(method_info(start_method))
                        ratio = gr.Slider(
                            RATIO_MIN, RATIO_MAX, value=RATIO_DEFAULT, step=1,
                            label="Compression ratio",
                            info="The document's tokens are reduced to about 1/ratio per KV head",
                            elem_id="kvlab-ratio",
                        )
                        suggested = gr.Dropdown(
                            choices=[], value=None, label="Suggested questions",
                            info="From the bundled example", elem_id="kvlab-suggested",
                        )
                        question = gr.Textbox(
                            label="Question", placeholder="Ask something the document answers.",
                            lines=1, elem_id="kvlab-question",
                        )
                        with gr.Accordion("Advanced", open=False, elem_id="kvlab-advanced"):
                            max_new = gr.Slider(
                                1, MAX_NEW_TOKENS_MAX, value=DEFAULT_MAX_NEW_TOKENS, step=1,
                                label="Answer length (max new tokens)", elem_id="kvlab-max-new",
                            )
                            groups, knob_inputs = [], {}
                            for name in methods:
                                with gr.Column(visible=name == start_method, min_width=160) as group:
                                    gr.Markdown(f"Knobs of **{name}**" if knobs[name] else f"**{name}** has no knobs.")
                                    for pair in range(0, len(knobs[name]), 2):
                                        with gr.Row():
                                            for knob in knobs[name][pair : pair + 2]:
                                                knob_inputs[knob.key] = knob.component()
                                groups.append(group)
                        run_btn = gr.Button("Run", variant="primary", elem_id="kvlab-run")

                summary = gr.Markdown(elem_id="kvlab-summary")
                with gr.Row():
                    answer_full = gr.Textbox(
                        label="Answer from the full cache", lines=3, interactive=False,
                        elem_id="kvlab-answer-full", elem_classes="kvlab-answer",
                    )
                    answer_comp = gr.Textbox(
                        label="Answer from the compressed cache", lines=3, interactive=False,
                        elem_id="kvlab-answer-compressed", elem_classes="kvlab-answer",
                    )
                diff = gr.HighlightedText(
                    label="Differences (word diff)", color_map=figures.DIFF_COLORS,
                    show_legend=True, show_inline_category=False, elem_id="kvlab-diff",
                )
                with gr.Row():
                    err_plot = gr.Plot(label="Attention-output error", elem_id="kvlab-err")
                    mass_plot = gr.Plot(label="Attention mass, full vs compressed", elem_id="kvlab-mass")
                with gr.Row():
                    kept_plot = gr.Plot(label="Keys per head", elem_id="kvlab-kept")
                    mem_plot = gr.Plot(label="Memory", elem_id="kvlab-memory")
                    time_plot = gr.Plot(label="Time", elem_id="kvlab-time")
                with gr.Row(visible=False) as fit_row:
                    bias_plot = gr.Plot(label="Fitted biases", elem_id="kvlab-bias")
                    fit_plot = gr.Plot(label="Fitting vs evaluation queries", elem_id="kvlab-fit")
                gr.Markdown("### The document, coloured by token fate, shaded by importance")
                with gr.Row():
                    layer = gr.Slider(0, n_layers - 1, value=n_layers // 2, step=1, label="Layer", elem_id="kvlab-layer")
                    head = gr.Slider(0, n_kv - 1, value=0, step=1, label="KV head", elem_id="kvlab-head")
                    intensity = gr.Radio(
                        INTENSITIES, value=INTENSITY_DEFAULT, label="Intensity",
                        info="Shade each token by its percentile within the head", elem_id="kvlab-intensity",
                    )
                counts = gr.Markdown(token_view(None, 0, 0)[0])
                tokens = gr.HTML(elem_id="kvlab-tokens", label="Token fates")

            with gr.Tab("Compare", id="compare"):
                gr.Markdown(
                    "A **sweep**: every chosen method, with its default knobs, at every chosen ratio, on the "
                    "**document, question, answer length and model of the Explore tab**. The prefill and the "
                    "full cache's answer are computed once and shared. Each run takes a few seconds on a CPU."
                )
                with gr.Row():
                    cmp_methods = gr.CheckboxGroup(
                        choices=[(n + _aware_tag(n).replace("  [", " (").replace("]", ")"), n) for n in methods],
                        value=sweep_methods, label="Methods", elem_id="kvlab-compare-methods", scale=3,
                    )
                    with gr.Column(scale=2):
                        cmp_ratios = gr.CheckboxGroup(
                            choices=[(f"{r}x", r) for r in SWEEP_RATIOS], value=list(SWEEP_DEFAULT_RATIOS),
                            label="Compression ratios", elem_id="kvlab-compare-ratios",
                        )
                        cmp_more = gr.Textbox(
                            label="More ratios", placeholder="e.g. 3, 8, 100", lines=1,
                            info=f"Comma-separated, from {MIN_RATIO:g} to {MAX_RATIO:g}",
                            elem_id="kvlab-compare-more",
                        )
                cmp_go = gr.Button("Run the sweep", variant="primary", elem_id="kvlab-compare-run")
                cmp_status = gr.Markdown(elem_id="kvlab-compare-status")
                cmp_full = gr.Textbox(label="Answer from the full cache", interactive=False, elem_id="kvlab-compare-full")
                with gr.Row():
                    cmp_err = gr.Plot(label="Attention-output error vs ratio", elem_id="kvlab-compare-err")
                    cmp_mass = gr.Plot(label="Attention-mass error vs ratio", elem_id="kvlab-compare-mass")
                    cmp_ppl = gr.Plot(label="Log-perplexity vs ratio", elem_id="kvlab-compare-ppl")
                cmp_table = gr.Dataframe(
                    headers=COMPARE_COLUMNS, label="Results", interactive=False, wrap=True,
                    column_widths=["13%", "6%", "7%", "8%", "8%", "8%", "9%", "8%", "33%"],
                    elem_id="kvlab-compare-table",
                )
                with gr.Row():
                    cmp_csv = gr.File(label="Results as CSV", interactive=False, height=90,
                                      elem_id="kvlab-compare-csv")
                    cmp_json = gr.File(label="Results as JSON (with per-head errors)", interactive=False, height=90,
                                       elem_id="kvlab-compare-json")

            with gr.Tab("Learn", id="learn"):
                gr.Markdown(learn_markdown(), latex_delimiters=LATEX, elem_id="kvlab-learn")

        # ---------------------------------------------------------------- events
        def on_example(example_id: str | None):
            ex = next((e for e in examples if e.id == example_id), None)
            if ex is None:
                return gr.Textbox(), gr.Dropdown(choices=[], value=None), gr.Textbox(), None
            try:
                body = ex.text()
            except DocumentError as exc:
                raise _as_gr_error(exc) from exc
            first = ex.questions[0]
            return body, gr.Dropdown(choices=list(ex.questions), value=first), first, None

        example.change(
            on_example, [example], [text, suggested, question, upload],
            api_name="load_example", concurrency_limit=None,
        )

        def on_pick(q: str | None):
            return q or gr.Textbox()

        suggested.input(on_pick, [suggested], [question], api_name="pick_question", concurrency_limit=None)

        def on_upload(path: str | None):
            if not path:
                return gr.Textbox()
            try:
                return read_document(path)
            except DocumentError as exc:
                raise _as_gr_error(exc) from exc

        upload.upload(on_upload, [upload], [text], api_name="load_file", concurrency_limit=4)

        def on_method(name: str):
            return (method_info(name), *[gr.Column(visible=n == name) for n in methods])

        method.change(on_method, [method], [info, *groups], api_name="select_method", concurrency_limit=None)

        run_outputs = [
            summary, answer_full, answer_comp, diff, err_plot, mass_plot, kept_plot, mem_plot,
            time_plot, layer, head, counts, tokens, last, fit_row, bias_plot, fit_plot,
        ]

        def on_run(text=None, file=None, method=start_method, ratio=RATIO_DEFAULT, question=None,
                   max_new_tokens=DEFAULT_MAX_NEW_TOKENS, layer=0, head=0, model=None,
                   intensity=INTENSITY_DEFAULT, progress=gr.Progress(), **knob_values):
            try:
                opts = method_options(method, knobs, knob_values)
                load_model_checked(model)
                view = run_view(
                    text, file, method, ratio, question, int(max_new_tokens or DEFAULT_MAX_NEW_TOKENS),
                    opts, model, progress,
                )
            except USER_ERRORS as exc:
                raise _as_gr_error(exc) from exc
            except (TypeError, ValueError) as exc:  # e.g. an Options dataclass refusing a value
                raise gr.Error(f"{method}: {exc}", title="Bad option", print_exception=False) from exc
            except Exception as exc:  # noqa: BLE001 - say what failed; the server stays up
                raise _unexpected(exc, method) from exc
            fates = view.fates
            layer = min(max(int(layer or 0), 0), fates.n_layers - 1)
            head = min(max(int(head or 0), 0), fates.n_kv_heads - 1)
            line, html = token_view(fates, layer, head, intensity)
            return (
                *view.outputs,
                gr.Slider(minimum=0, maximum=fates.n_layers - 1, value=layer, step=1),
                gr.Slider(minimum=0, maximum=fates.n_kv_heads - 1, value=head, step=1),
                line,
                html,
                fates,
                gr.Row(visible=view.fit_figures is not None),
                *(view.fit_figures or (None, None)),
            )

        def load_model_checked(spec: str | None) -> None:
            """Refuse a model not offered before any heavy work (the GPU function loads it)."""
            spec = (spec or "").strip() or specs[0]
            if spec not in specs:
                raise InputError(f"the model {spec!r} is not offered here; choose one of: {', '.join(specs)}")

        run_btn.click(
            on_run,
            [text, upload, method, ratio, question, max_new, layer, head, model, intensity],
            run_outputs,
            inputs_kwargs=knob_inputs,
            api_name="run",
            concurrency_limit=1,
            concurrency_id="compute",
            # One progress bar where the answers will appear: an animated overlay on
            # every output costs a CPU machine's browser (and the server beside it) time.
            show_progress_on=[summary, answer_full, answer_comp],
        )

        def on_compare(text=None, file=None, methods=None, ratios=None, more_ratios="", question=None,
                       max_new_tokens=DEFAULT_MAX_NEW_TOKENS, model=None, progress=gr.Progress()):
            chosen = list(methods or [])
            try:
                load_model_checked(model)
                parsed = parse_ratios(ratios, more_ratios)
                view = sweep_view(
                    text, file, chosen, parsed, question, int(max_new_tokens or DEFAULT_MAX_NEW_TOKENS),
                    model, progress,
                )
            except USER_ERRORS as exc:
                raise _as_gr_error(exc) from exc
            except Exception as exc:  # noqa: BLE001 - say what failed; the server stays up
                raise _unexpected(exc, ", ".join(chosen)) from exc
            sweep = view.sweep
            csv_path, json_path = write_exports(sweep)
            full = f"{sweep.answer_full}  (log-perplexity {sweep.logppl_full:.3f})"
            return (
                sweep_status(sweep),
                full,
                *view.charts,
                {"headers": COMPARE_COLUMNS, "data": compare_rows(sweep)},
                csv_path,
                json_path,
            )

        cmp_go.click(
            on_compare,
            [text, upload, cmp_methods, cmp_ratios, cmp_more, question, max_new, model],
            [cmp_status, cmp_full, cmp_err, cmp_mass, cmp_ppl, cmp_table, cmp_csv, cmp_json],
            api_name="compare",
            concurrency_limit=1,
            concurrency_id="compute",
        )

        def on_view(view: TokenFates | None, layer: int, head: int, intensity: str = INTENSITY_DEFAULT):
            return token_view(view, layer, head, intensity)

        gr.on(
            [layer.input, head.input, intensity.input], on_view, [last, layer, head, intensity], [counts, tokens],
            api_name="token_view", show_progress="minimal", trigger_mode="always_last",
            concurrency_limit=4,
        )

    return demo


def launch_options() -> dict[str, Any]:
    """The keyword arguments of ``launch()`` that style the app (Gradio 6: theme and css go there)."""
    return {"theme": gr.themes.Soft(), "css": CSS}


def prepare(demo: gr.Blocks) -> gr.Blocks:
    """Queue the app: one heavy computation at a time (``/run`` and ``/compare`` share one slot), so a
    small CPU Space stays responsive for the light events (examples, token view), which run beside it;
    at most QUEUE_SIZE requests wait. Each user's last run stays in their own session state."""
    return demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)


def main() -> None:
    """Load the default model (logged), build the app and serve it on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    lm = None
    choices = model_choices()
    log.info("loading the default model (%s)...", choices[0][1])
    try:
        lm = get_model(choices[0][1])
        log.info("model ready: %s (%d layers, %d KV heads)", lm.name, lm.n_layers, lm.n_kv_heads)
    except ModelLoadError as exc:  # the app still starts; a run shows the error
        log.error("%s", exc)
    if len(choices) > 1:
        log.info("other models offered (loaded on first use): %s", ", ".join(spec for _, spec in choices[1:]))
    demo = prepare(build_app(lm, choices))
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        **launch_options(),
    )


__all__ = [
    "Explored", "InputError", "Knob", "RunView", "Sweep", "SweepView", "TokenFates", "build_app", "compare",
    "document_text", "explore", "launch_options", "main", "method_knobs", "method_options",
    "model_choices", "parse_ratios", "prepare", "present", "run_view", "sweep_view", "token_texts",
    "token_view", "write_exports",
]
