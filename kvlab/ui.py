"""The Gradio app: layout and callbacks. It calls the library and does no maths.

The page builds itself from :data:`kvlab.methods.REGISTRY`: the method menu,
the "Advanced" knobs (one input per field of each method's ``Options``
dataclass, shown for the selected method only) and the "Learn" tab. A method
registered later appears without any change here.

Endpoints (every event has an ``api_name``, so ``gradio_client`` can drive the app):

- ``/run``: (text, file, method, ratio, question, max_new_tokens, layer, head,
  and one keyword per knob named ``<method>__<field>``) -> summary, both
  answers, their word diff, five figures, the token-fate view; the plain
  function behind it is :func:`explore`.
- ``/compare``: (text, file, methods, ratio, question, max_new_tokens) -> the
  full cache's answer, a table with one row per method, two bar charts.
- ``/token_view``: (layer, head) -> the document coloured by token fate for
  that layer and KV head of the last run (kept per user in ``gr.State``).
- ``/load_example``: (example id) -> document text, suggested questions, question.
- ``/pick_question``: (suggested question) -> question.
- ``/load_file``: (file) -> document text.
- ``/select_method``: (method) -> its description and which knobs show.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import typing
from dataclasses import dataclass
from typing import Any

import gradio as gr

from kvlab import figures
from kvlab.context import CONTEXTS, Progress, no_progress
from kvlab.documents import DocumentError, Example, clean_text, load_examples, read_document
from kvlab.methods import REGISTRY, MethodError, get_method
from kvlab.models import LoadedModel, ModelLoadError, get_model
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS, Run, RunResult, run

log = logging.getLogger("kvlab.app")

RATIO_MIN, RATIO_MAX, RATIO_DEFAULT = 2, 100, 10
MAX_NEW_TOKENS_MAX = 256
# Placeholder geometry for the token-view sliders until a model is known.
_DEFAULT_LAYERS, _DEFAULT_KV_HEADS = 32, 8

CSS = """
.kvlab-chip { padding: 1px 8px; margin-right: 4px; border: 1px solid #e5e7eb; border-radius: 6px; }
#kvlab-summary table { font-size: 0.92em; }
.kvlab-answer textarea { font-size: 1.02em; }
"""


class InputError(ValueError):
    """A missing or unusable input; the message is shown to the user as is."""


# --------------------------------------------------------------------------- the plain function


@dataclass
class Explored:
    """The last run of one user: the run, and the decoded text of each context token."""

    run: Run
    token_texts: list[str]
    expected: str | None = None
    query_aware: bool = False

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
    question = (question or "").strip()
    if not question:
        raise InputError("The question is empty: type a question about the document (or pick a suggested one).")
    if max_new_tokens is None or int(max_new_tokens) < 1:
        raise InputError("The answer length must be at least 1 token.")
    document = document_text(text, file)
    method_obj = get_method(method, **(options or {}))
    progress(0.0, "loading the model")
    lm = get_model(model)
    ctx = CONTEXTS.get(lm, document, lambda f, desc: progress(0.05 + 0.35 * f, desc))
    result = run(
        ctx,
        method_obj,
        float(ratio),
        question,
        int(max_new_tokens),
        lambda f, desc: progress(0.4 + 0.6 * min(max(f, 0.0), 1.0), desc),
    )
    texts = token_texts(lm.tokenizer, ctx.tokens.ids.tolist())
    return Explored(result, texts, expected_answer(question, _examples()), bool(method_obj.query_aware))


COMPARE_COLUMNS = [
    "method", "query-aware", "answer (compressed cache)", "memory ratio", "output error",
    "mass error", "log-ppl (full answer)", "compression s",
]


def compare(
    text: str | None,
    file: str | None,
    methods: list[str],
    ratio: float,
    question: str,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: Progress = no_progress,
    model: str | None = None,
) -> list[RunResult]:
    """Every method in ``methods`` (default knobs) on one document, question and ratio.

    The prefill and the full cache's answer are computed once and shared.
    """
    if not methods:
        raise InputError("Pick at least one method to compare.")
    question = (question or "").strip()
    if not question:
        raise InputError("The question is empty: type a question about the document (or pick a suggested one).")
    document = document_text(text, file)
    chosen = [get_method(name) for name in methods]
    progress(0.0, "loading the model")
    lm = get_model(model)
    ctx = CONTEXTS.get(lm, document, lambda f, desc: progress(0.05 + 0.25 * f, desc))
    results = []
    for i, method_obj in enumerate(chosen):
        lo, width = 0.3 + 0.7 * i / len(chosen), 0.7 / len(chosen)
        results.append(
            run(
                ctx, method_obj, float(ratio), question, int(max_new_tokens),
                lambda f, desc, lo=lo, name=method_obj.name: progress(
                    lo + width * min(max(f, 0.0), 1.0), f"{name}: {desc}"
                ),
            ).result
        )
    return results


def compare_rows(results: list[RunResult], aware: list[bool] | None = None) -> list[list]:
    """The comparison table's rows (see COMPARE_COLUMNS); ``aware``: each run's method instance's query_aware."""
    aware = aware if aware is not None else [query_awareness(r.method) == "yes" for r in results]
    return [
        [
            r.method,
            "yes" if a else "no",
            r.answer_compressed,
            round(r.memory_ratio, 2),
            round(r.attn_output_rel_err, 4),
            round(r.attn_mass_rel_err, 4),
            round(r.logppl_compressed, 3),
            round(r.compress_s, 2),
        ]
        for r, a in zip(results, aware)
    ]


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
    """"yes", "no", or "options" when it depends on the method's knobs.

    ``query_aware`` is a class attribute for most methods, and a property of
    the instance for methods whose knobs decide it (e.g. a query source);
    such a method is reported by the value of a default instance and "options".
    """
    cls = REGISTRY[name]
    if isinstance(inspect.getattr_static(cls, "query_aware", False), property):
        try:
            return "yes" if cls().query_aware else "options"
        except Exception:  # noqa: BLE001 - a method that cannot build its defaults
            return "options"
    return "yes" if cls.query_aware else "no"


def _aware_tag(name: str) -> str:
    return {"yes": "  [query-aware]", "options": "  [query-aware with some knobs]", "no": ""}[query_awareness(name)]


def method_label(name: str) -> str:
    return f"{name}: {REGISTRY[name].summary}{_aware_tag(name)}"


def default_method() -> str:
    """The first (alphabetically) query-agnostic method, else the first one."""
    names = sorted(REGISTRY)
    return next((n for n in names if query_awareness(n) != "yes"), names[0])


def method_info(name: str) -> str:
    if name not in REGISTRY:
        return ""
    cls = REGISTRY[name]
    aware = {
        "yes": "**Query-aware**: the compression depends on your question (change the question, and the cache changes).",
        "no": "Query-agnostic: the same compressed cache serves any question.",
        "options": "Query-agnostic with its default knobs; some knob settings (see Advanced) make it "
        "**query-aware**, i.e. the compression then depends on your question.",
    }[query_awareness(name)]
    paper = f" Paper: *{cls.paper}*." if cls.paper else ""
    return f"{aware}{paper}"


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
    return (
        f"**{r.method}**{' (query-aware: compressed for this question)' if ex.query_aware else ''} at **{r.ratio:g}x** on {r.doc_tokens:,} document tokens "
        f"(+ {prefix} chat-template tokens, always kept) with {r.model}: "
        f"{r.kept_tokens_mean:.1f} keys stored per head on average. {verdict}{expected}\n\n"
        "| | full cache | compressed cache |\n|---|---|---|\n"
        f"| memory | {_bytes(r.bytes_full)} | {_bytes(r.bytes_compressed)} ({r.memory_ratio:.1f}x smaller) |\n"
        f"| answer time | {r.answer_full_s:.2f} s | {r.answer_compressed_s:.2f} s |\n"
        f"| log-perplexity of the full cache's answer | {r.logppl_full:.3f} | {r.logppl_compressed:.3f} |\n\n"
        f"Attention error on held-out queries (mean over layers x KV heads): "
        f"output {r.attn_output_rel_err:.3f}, mass {r.attn_mass_rel_err:.3f}. "
        f"Prefill {r.prefill_s:.2f} s (cached per document), compression {r.compress_s:.2f} s."
    )


def token_view(ex: Explored | None, layer: int, head: int) -> tuple[str, str]:
    """(counts line, the document as HTML coloured by token fate) for one layer and KV head of a run."""
    if ex is None:
        return "Run a compression first: the document will appear here, coloured by what happened to each token.", ""
    layer = min(max(int(layer), 0), ex.n_layers - 1)
    head = min(max(int(head), 0), ex.n_kv_heads - 1)
    fates = ex.run.stored.fates(layer, head)
    counts = figures.fate_counts(len(ex.token_texts), fates)
    parts = ", ".join(f"{n:,} {fate}" for fate, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    line = f"Layer {layer}, KV head {head}: {parts} (of {len(ex.token_texts):,} context tokens)."
    return line, figures.fate_html(figures.fate_segments(ex.token_texts, fates))


def present(ex: Explored, layer: int, head: int) -> tuple:
    """The outputs of ``/run`` for one finished run (see ``build_app``'s ``run_outputs``)."""
    r = ex.run.result
    layer = min(max(int(layer), 0), ex.n_layers - 1)
    head = min(max(int(head), 0), ex.n_kv_heads - 1)
    counts, tokens = token_view(ex, layer, head)
    timings = {
        "prefill (once per document)": r.prefill_s,
        "compression": r.compress_s,
        "answer, full cache": r.answer_full_s,
        "answer, compressed cache": r.answer_compressed_s,
    }
    return (
        summary_markdown(ex),
        r.answer_full,
        r.answer_compressed,
        figures.word_diff(r.answer_full, r.answer_compressed),
        figures.error_heatmap(r.per_head),
        figures.mass_heatmap(r.per_head),
        figures.kept_heatmap(r.per_head),
        figures.memory_figure(r.bytes_full, r.bytes_compressed, r.memory_breakdown),
        figures.time_figure(timings),
        gr.Slider(minimum=0, maximum=ex.n_layers - 1, value=layer, step=1),
        gr.Slider(minimum=0, maximum=ex.n_kv_heads - 1, value=head, step=1),
        counts,
        tokens,
        ex,
    )


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


def learn_markdown() -> str:
    """The "Learn" tab: what the lab measures, and every registered method with its knobs."""
    lines = [
        "## What the lab shows",
        "A language model reads your document once (the *prefill*) and keeps, for every layer and "
        "every KV head, a key and a value vector per token: the **KV cache**. It is what grows "
        "with the document and limits how long a text a GPU can hold. A compression method keeps "
        "about *1/ratio* of the document's entries per head (the chat template's tokens are always "
        "kept) and the model answers your question from that smaller cache.",
        "",
        "- **Answers**: the answer from the full cache and from the compressed cache, with their "
        "word-level differences.",
        "- **Attention-output relative error**: for queries the compressed cache never saw (your "
        "question's and the answer's), how far each head's attention output moves, "
        "‖y_compressed − y_full‖ / ‖y_full‖.",
        "- **Attention-mass relative error**: how much of the attention mass the cached block "
        "should receive is lost or gained.",
        "- **Keys stored per head**: methods may give heads different budgets.",
        "- **Token fates**: for one layer and head, what happened to each token: kept, evicted, "
        "or another fate of the method (quantised, merged, ...).",
        "",
        "## Methods",
    ]
    for name, cls in sorted(REGISTRY.items()):
        lines.append(f"### `{name}`" + {"yes": " (query-aware)", "options": " (query-aware with some knobs)", "no": ""}[query_awareness(name)])
        lines.append(cls.summary + ".")
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


def build_app(lm: LoadedModel | None = None) -> gr.Blocks:
    """The whole app. ``lm``, when given, sets the model name and the token-view sliders' range."""
    examples = _examples()
    knobs = method_knobs()
    methods = sorted(REGISTRY)
    start_method = default_method()
    n_layers = lm.n_layers if lm else _DEFAULT_LAYERS
    n_kv = lm.n_kv_heads if lm else _DEFAULT_KV_HEADS
    model_name = lm.name if lm else "the configured model (loaded on the first run)"

    with gr.Blocks(title="kvlab: KV-cache compression lab") as demo:
        last = gr.State(None, time_to_live=3600)
        gr.Markdown(
            "# kvlab: a lab for KV-cache compression\n"
            f"Give {model_name} a document and a question; compress its KV cache with a method "
            "at a ratio; compare the answers, the memory, the time and the attention errors, "
            "and see which tokens each head kept."
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
                    mass_plot = gr.Plot(label="Attention-mass error", elem_id="kvlab-mass")
                with gr.Row():
                    kept_plot = gr.Plot(label="Keys per head", elem_id="kvlab-kept")
                    mem_plot = gr.Plot(label="Memory", elem_id="kvlab-memory")
                    time_plot = gr.Plot(label="Time", elem_id="kvlab-time")
                gr.Markdown("### The document, coloured by token fate")
                with gr.Row():
                    layer = gr.Slider(0, n_layers - 1, value=n_layers // 2, step=1, label="Layer", elem_id="kvlab-layer")
                    head = gr.Slider(0, n_kv - 1, value=0, step=1, label="KV head", elem_id="kvlab-head")
                counts = gr.Markdown(token_view(None, 0, 0)[0])
                tokens = gr.HTML(elem_id="kvlab-tokens", label="Token fates")

            with gr.Tab("Compare", id="compare"):
                gr.Markdown(
                    "Run several methods, with their default knobs, on the **document, question and answer length "
                    "of the Explore tab** at one ratio. The prefill and the full cache's answer are shared."
                )
                with gr.Row():
                    cmp_methods = gr.CheckboxGroup(
                        choices=[(n + _aware_tag(n).replace("  [", " (").replace("]", ")"), n) for n in methods],
                        value=list(methods), label="Methods", elem_id="kvlab-compare-methods", scale=3,
                    )
                    cmp_ratio = gr.Slider(
                        RATIO_MIN, RATIO_MAX, value=RATIO_DEFAULT, step=1, label="Compression ratio",
                        elem_id="kvlab-compare-ratio", scale=2,
                    )
                cmp_go = gr.Button("Compare", variant="primary", elem_id="kvlab-compare-run")
                cmp_full = gr.Textbox(label="Answer from the full cache", interactive=False)
                cmp_table = gr.Dataframe(
                    headers=COMPARE_COLUMNS, label="Results", interactive=False, wrap=True,
                    column_widths=["15%", "9%", "31%", "9%", "9%", "9%", "9%", "9%"],
                    elem_id="kvlab-compare-table",
                )
                with gr.Row():
                    cmp_err = gr.Plot(label="Attention-output error by method", elem_id="kvlab-compare-err")
                    cmp_ppl = gr.Plot(label="Log-perplexity by method", elem_id="kvlab-compare-ppl")

            with gr.Tab("Learn", id="learn"):
                gr.Markdown(learn_markdown())

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
            time_plot, layer, head, counts, tokens, last,
        ]

        def on_run(text=None, file=None, method=start_method, ratio=RATIO_DEFAULT, question=None,
                   max_new_tokens=DEFAULT_MAX_NEW_TOKENS, layer=0, head=0,
                   progress=gr.Progress(), **knob_values):
            try:
                opts = method_options(method, knobs, knob_values)
                ex = explore(
                    text, file, method, ratio, question, int(max_new_tokens or DEFAULT_MAX_NEW_TOKENS),
                    opts, lambda f, desc: progress(f, desc=desc),
                )
            except USER_ERRORS as exc:
                raise _as_gr_error(exc) from exc
            except (TypeError, ValueError) as exc:  # e.g. an Options dataclass refusing a value
                raise gr.Error(f"{method}: {exc}", title="Bad option", print_exception=False) from exc
            except Exception as exc:  # noqa: BLE001 - say what failed; the server stays up
                raise _unexpected(exc, method) from exc
            return present(ex, layer, head)

        run_btn.click(
            on_run,
            [text, upload, method, ratio, question, max_new, layer, head],
            run_outputs,
            inputs_kwargs=knob_inputs,
            api_name="run",
            concurrency_limit=1,
            concurrency_id="compute",
        )

        def on_compare(text=None, file=None, methods=None, ratio=RATIO_DEFAULT, question=None,
                       max_new_tokens=DEFAULT_MAX_NEW_TOKENS, progress=gr.Progress()):
            try:
                results = compare(
                    text, file, list(methods or []), ratio, question,
                    int(max_new_tokens or DEFAULT_MAX_NEW_TOKENS), lambda f, desc: progress(f, desc=desc),
                )
            except USER_ERRORS as exc:
                raise _as_gr_error(exc) from exc
            except Exception as exc:  # noqa: BLE001 - say what failed; the server stays up
                raise _unexpected(exc, ", ".join(methods or [])) from exc
            rows = [
                {"method": r.method, "output error": r.attn_output_rel_err, "log-ppl": r.logppl_compressed}
                for r in results
            ]
            full = f"{results[0].answer_full}  (log-perplexity {results[0].logppl_full:.3f})"
            return (
                full,
                {"headers": COMPARE_COLUMNS, "data": compare_rows(results)},
                figures.compare_figure(rows, "output error", f"Attention-output error at {ratio:g}x"),
                figures.compare_figure(
                    rows, "log-ppl", f"Log-perplexity of the full cache's answer at {ratio:g}x "
                    f"(full cache: {results[0].logppl_full:.3f})",
                ),
            )

        cmp_go.click(
            on_compare,
            [text, upload, cmp_methods, cmp_ratio, question, max_new],
            [cmp_full, cmp_table, cmp_err, cmp_ppl],
            api_name="compare",
            concurrency_limit=1,
            concurrency_id="compute",
        )

        def on_view(ex: Explored | None, layer: int, head: int):
            return token_view(ex, layer, head)

        gr.on(
            [layer.input, head.input], on_view, [last, layer, head], [counts, tokens],
            api_name="token_view", show_progress="minimal", trigger_mode="always_last",
            concurrency_limit=4,
        )

    return demo


def launch_options() -> dict[str, Any]:
    """The keyword arguments of ``launch()`` that style the app (Gradio 6: theme and css go there)."""
    return {"theme": gr.themes.Soft(), "css": CSS}


def prepare(demo: gr.Blocks) -> gr.Blocks:
    """Queue the app: one heavy computation at a time (a small CPU Space stays responsive)."""
    return demo.queue(default_concurrency_limit=1)


def main() -> None:
    """Load the model (logged), build the app and serve it on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    lm = None
    log.info("loading the model (%s)...", os.environ.get("KVLAB_MODEL") or "embedded default")
    try:
        lm = get_model()
        log.info("model ready: %s (%d layers, %d KV heads)", lm.name, lm.n_layers, lm.n_kv_heads)
    except ModelLoadError as exc:  # the app still starts; a run shows the error
        log.error("%s", exc)
    demo = prepare(build_app(lm))
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        **launch_options(),
    )


__all__ = [
    "Explored", "InputError", "Knob", "build_app", "document_text", "explore", "launch_options",
    "main", "method_knobs", "method_options", "prepare", "present", "token_texts", "token_view",
]
