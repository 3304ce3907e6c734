"""The "Your pick" tab: a learner keeps sentences of the document by hand within the ratio's budget and
sees where the pick ranks among the methods (kvlab.lab.pick; the UI only calls the lab).

Endpoints (each event has an ``api_name``, so ``gradio_client`` can drive it):

- ``/pick_example``: (example id) -> document text, suggested questions, question.
- ``/pick_read``: (text, model, ratio) -> the sentences to tick, the counter line, the split kept for the page.
- ``/pick_count``: (the ticks, ratio) -> the counter line "picked N of B tokens (budget at Rx)".
- ``/pick``: (text, the ticks (``s<k>`` labels), ratio, question, model) -> the pick's answer marked,
  the full cache's answer, the ranking table and the pick's rank line.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import gradio as gr

from kvlab.documents import DocumentError
from kvlab.examples import Example
from kvlab.lab import pick, pick_examples, read_for_pick
from kvlab.lab.pick import PickDocument, Picked, keep_text, pick_specs, spans_of, tally, unstored
from kvlab.ui import common
from kvlab.ui.common import RATIO_DEFAULT, RATIO_MAX, RATIO_MIN, PickInputs

#: Characters of a sentence shown in its checkbox's label.
SHOWN_CHARS = 90
RANK_HEADERS = ["rank", "method", "right/wrong", "log-ppl", "bytes kept (of full)"]


def sentence_label(index: int, n_tokens: int, text: str) -> str:
    """A checkbox's label: ``s3 (12 tok): The head baker is ...``, the text on one line, shortened."""
    flat = " ".join(text.split())
    short = flat if len(flat) <= SHOWN_CHARS else flat[: SHOWN_CHARS - 1] + "\u2026"
    return f"s{index} ({n_tokens} tok): {short}"


def ranking_rows(picked: Picked) -> list[list[Any]]:
    """The ranking table's rows, best first; the pick is named "your pick"."""
    rows = []
    for r in picked.rows:
        verdict = "" if r.right is None else ("right" if r.right else "wrong")
        rows.append(
            [
                r.rank,
                "your pick" if r.is_pick else r.method,
                verdict,
                round(r.logppl_compressed, 3),
                f"{1 / r.memory_ratio:.1%}",  # the ratio is full / kept bytes
            ]
        )
    return rows


def rank_line(picked: Picked) -> str:
    """The Markdown line under the table: the pick's place, its tokens, what was not run or failed."""
    line = (
        f"**Your pick ranks {picked.rank_text}** at {picked.ratio:g}x, keeping {picked.pick_tokens} of the "
        f"{picked.budget} tokens allowed (`{picked.keep}`). Ranked by: {picked.rule}."
    )
    if picked.errors:
        line += " Could not run: " + "; ".join(f"{e.method} ({e.message})" for e in picked.errors) + "."
    if picked.stopped:
        line += f" {picked.stopped}"
    return line


def build_pick_tab(model: gr.Dropdown, examples: list[Example], specs: list[str]) -> PickInputs:
    """The tab ``gr.Tab("Your pick", id="pick")``, its widgets and events (inside an open ``gr.Tabs``),
    opening on the first example and its question; -> the tab and what a link sets. It lists a document's
    sentences to tick: it offers the examples any model reads, not a long one read by its own model."""
    with gr.Tab("Your pick", id="pick") as tab:
        return PickInputs(tab, *build_pick_widgets(model, pick_examples(examples), specs))


def build_pick_widgets(
    model: gr.Dropdown, examples: list[Example], specs: list[str]
) -> tuple[gr.Dropdown, gr.Textbox, gr.Dropdown, gr.Textbox, gr.Slider]:
    """The tab's widgets and events (inside its open ``gr.Tab``); -> (example, text, suggested, question,
    ratio), the widgets a link sets."""
    first = examples[0] if examples else None
    gr.Markdown(
        "Keep the sentences **you** think the question needs, within the ratio's budget, and see where your "
        "pick ranks among the compression methods at the same ratio on the same question."
    )
    with gr.Row(equal_height=False):
        with gr.Column(scale=5):
            example = gr.Dropdown(
                choices=[(ex.title, ex.id) for ex in examples],
                value=first.id if first else None,
                label="Bundled example",
                elem_id="kvlab-pick-example",
            )
            text = gr.Textbox(label="Document", value=_text_of(first), lines=6, max_lines=10, elem_id="kvlab-pick-text")
        with gr.Column(scale=4):
            suggested = gr.Dropdown(
                choices=list(first.questions) if first else [],
                value=first.questions[0] if first else None,
                label="Suggested questions",
                elem_id="kvlab-pick-suggested",
            )
            question = gr.Textbox(
                label="Question", value=first.questions[0] if first else "", elem_id="kvlab-pick-question"
            )
            ratio = gr.Slider(
                RATIO_MIN, RATIO_MAX, value=RATIO_DEFAULT, step=0.5, label="Ratio", elem_id="kvlab-pick-ratio"
            )
    split = gr.State(None)
    read = gr.Button("Split into sentences", size="sm", elem_id="kvlab-pick-read")
    counter = gr.Markdown("Split the document into sentences first.", elem_id="kvlab-pick-counter")
    ticks = gr.CheckboxGroup(choices=[], label="Sentences to keep", elem_id="kvlab-pick-sentences")
    run = gr.Button("Run my pick", variant="primary", elem_id="kvlab-pick-run")
    rank = gr.Markdown(elem_id="kvlab-pick-rank")
    with gr.Row():
        with gr.Column():
            mark_pick = gr.HTML(elem_id="kvlab-pick-mark")
            answer_pick = gr.Textbox(label="Your pick's answer", interactive=False, elem_id="kvlab-pick-answer")
        with gr.Column():
            mark_full = gr.HTML(elem_id="kvlab-pick-mark-full")
            answer_full = gr.Textbox(
                label="Full cache's answer (the ceiling)", interactive=False, elem_id="kvlab-pick-full"
            )
    table = gr.Dataframe(headers=RANK_HEADERS, interactive=False, elem_id="kvlab-pick-table")

    loaded = wire_document(examples, example, text, suggested, question)
    read_args = dict(fn=partial(on_read, specs=specs), inputs=[text, model, ratio], outputs=[ticks, counter, split])
    read.click(api_name="pick_read", **read_args)
    loaded.then(api_name=False, **read_args)  # a new example: its sentences at once
    ticks.change(on_count, [split, ticks, ratio], [counter], api_name="pick_count", queue=False)
    ratio.change(on_count, [split, ticks, ratio], [counter], api_name=False, queue=False)
    run.click(
        partial(on_run, specs=specs),
        [text, ticks, ratio, question, model],
        [mark_pick, answer_pick, mark_full, answer_full, table, rank],
        api_name="pick",
        concurrency_limit=common.COMPUTE_ADMITTED,
        concurrency_id="compute",
        show_progress_on=[rank],
    )
    return example, text, suggested, question, ratio


def _text_of(ex: Example | None) -> str:
    """The example's document, or "" when it is missing or unreadable (the page still opens)."""
    try:
        return ex.text() if ex is not None else ""
    except DocumentError as exc:
        common.log.warning("example %s unreadable: %s", ex.id if ex else None, exc)
        return ""


def wire_document(
    examples: list[Example], example: gr.Dropdown, text: gr.Textbox, suggested: gr.Dropdown, question: gr.Textbox
) -> gr.events.Dependency:
    """``/pick_example`` (an example's text and questions) and the suggested question's choice; returns
    the example's event."""

    def on_example(example_id: str | None):  # noqa: ANN202 - gradio updates
        ex = next((e for e in examples if e.id == example_id), None)
        if ex is None:
            return gr.Textbox(), gr.Dropdown(choices=[], value=None), gr.Textbox()
        try:
            body = ex.text()
        except DocumentError as exc:
            raise common.as_gr_error(exc) from exc
        return body, gr.Dropdown(choices=list(ex.questions), value=ex.questions[0]), ex.questions[0]

    loaded = example.input(
        on_example, [example], [text, suggested, question], api_name="pick_example", concurrency_limit=None
    )
    suggested.input(lambda q: q or gr.Textbox(), [suggested], [question], api_name=False, queue=False)
    return loaded


def on_read(text: str, model: str | None, ratio: float, specs: list[str], progress=gr.Progress()):  # noqa: ANN001, B008
    """The document split into sentences: the checkboxes (none ticked), the counter, the split for the page."""
    with common.user_facing("splitting the document"):
        spec = common.checked_model(model, specs)
        doc = read_for_pick(text, None, spec, lambda f, desc: progress(f, desc=desc))
        choices = [(sentence_label(s.index, s.n_tokens, s.text), s.label) for s in doc.sentences]
        line, _ = tally(doc.sentences, [], ratio)
    return gr.CheckboxGroup(choices=choices, value=[]), line, doc


def on_count(doc: PickDocument | None, ticked: list[str] | None, ratio: float) -> str:
    """The counter line for the ticks (kvlab.lab.pick.tally); a hint before the document is split."""
    if doc is None:
        return "Split the document into sentences first."
    with common.user_facing("counting the pick"):
        return tally(doc.sentences, ticked or [], ratio)[0]


def on_run(  # noqa: ANN201 - gradio outputs
    text: str,
    ticked: list[str] | None,
    ratio: float,
    question: str,
    model: str | None,
    specs: list[str],
    request: gr.Request = None,  # type: ignore[assignment]
    progress=gr.Progress(),  # noqa: ANN001, B008
):
    """``/pick``: the pick run and ranked; a user's error (over the budget, no question) is one message."""
    ticked = ticked or []
    # Sentence labels in one order, runs joined, so that the same pick is the same stored run.
    plain = all(label[:1] == "s" and label[1:].isdigit() for label in ticked)
    keep = spans_of([int(label[1:]) for label in ticked]) if plain else keep_text(ticked)

    def work() -> Picked:
        spec = common.checked_model(model, specs)
        return pick(text, None, keep, ratio, question, progress=lambda f, desc: progress(f, desc=desc), model=spec)

    def ready() -> None:
        # The document, and the rivals' document-only work still to compute (a warmed class's are stored),
        # prepared in the background: a long text's prefill is not this request's work.
        mine, *rivals = pick_specs(text, keep, ratio, question, model=common.checked_model(model, specs))
        wanted = [(mine.method, mine.options), *((spec.method, spec.options) for spec in unstored(rivals))]
        common.prepared_first(mine.document, wanted, mine.model, mine.question, mine.max_new_tokens, progress)

    # The pick's answer decodes batched with the others' (leave): a class's picks overlap.
    picked = common.guarded(
        "your pick", work, owner=common.session_of(request), kind="pick", progress=progress, leave=True, ready=ready
    )
    run = picked.result
    mark_full, mark_pick = picked.view.answer_marks  # right or wrong as Explore marks them, when the gold is known
    return mark_pick, run.answer_compressed, mark_full, run.answer_full, ranking_rows(picked), rank_line(picked)
