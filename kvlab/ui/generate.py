"""The Generate tab: every bounded-cache method writing after one prompt, step by step.

Endpoint ``/generate``: (source, prompt, text, file, question, methods, budget,
max_new_tokens, model) -> a status table, the texts side by side, the cache
size while writing, the log-probabilities of the unbounded text, BeaconKV's beacons.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from kvlab.bounded.policies import bounded_policies, policy_class
from kvlab.figures.generation import beacon_figure, cache_size_figure, logprob_figure, texts_html
from kvlab.figures.plots import human_bytes
from kvlab.lab.generate import DEFAULT_GENERATE_TOKENS, MAX_GENERATE_TOKENS, Generated, generate
from kvlab.tasks.copying import copy_prompt, make_codes
from kvlab.ui import common
from kvlab.ui.common import DocumentInputs, GenerateInputs, checked_model, guarded

SOURCES = ("the prompt below", "the Explore tab's document and question")
#: The prompt the tab opens with: the copy task with 24 codes (about 120 tokens to write).
DEFAULT_PROMPT = copy_prompt(make_codes(24, 0))
COLUMNS = [
    "method",
    "first difference",
    "log-ppl of the unbounded text",
    "copy task F1",
    "in order",
    "shrinks",
    "most keys per head",
    "memory at the end",
    "tokens/s",
]


def generation_rows(g: Generated) -> list[list]:
    """One table row per method, the unbounded reference first."""
    rows = []
    for m in [g.reference, *g.runs]:
        rows.append(
            [
                m.label,
                "-" if m.divergence is None else m.divergence,
                round(m.logppl, 3),
                "-" if m.task is None else round(m.task.f1, 3),
                "-" if m.task is None else f"{m.task.in_order}/{m.task.n_codes}",
                len(m.run.events),
                m.run.max_size,
                human_bytes(m.run.nbytes[-1]) if m.run.nbytes else "-",
                round(m.run.tokens_per_s, 1),
            ]
        )
    return rows


def generation_figures(g: Generated) -> tuple:
    """The texts' HTML and the three figures of one Generated."""
    every = [g.reference, *g.runs]
    texts = texts_html([(m.label, m.same, m.rest) for m in every])
    size = cache_size_figure(
        {m.label: m.run.sizes for m in every},
        {m.label: m.run.nbytes for m in every},
        {m.label: [(e.step, e.before, e.after) for e in m.run.events] for m in every},
        g.budget,
    )
    logp = logprob_figure({m.label: m.forced for m in every}, {m.label: m.divergence for m in g.runs})
    beacon = next((m.run.beacons for m in g.runs if m.method == "beaconkv"), [])
    beacons = beacon_figure(
        [b.step for b in beacon], [b.tokens for b in beacon], [b.rows for b in beacon], g.prompt_tokens
    )
    return texts, size, logp, beacons


@dataclass
class GenerateWidgets:
    """The Generate tab's settings, its Generate and Stop, and the views of a generation."""

    source: gr.Radio
    methods: gr.CheckboxGroup
    prompt: gr.Textbox
    budget: gr.Number
    max_new: gr.Slider
    go: gr.Button
    stop: gr.Button
    status: gr.Markdown
    table: gr.Dataframe
    texts: gr.HTML
    size: gr.Plot
    logp: gr.Plot
    beacons: gr.Plot

    @property
    def outputs(self) -> list:
        """The outputs of ``/generate``, in its order."""
        return [self.status, self.table, self.texts, self.size, self.logp, self.beacons]


def build_generate_tab(inputs: DocumentInputs, specs: list[str]) -> GenerateInputs:
    """The Generate tab's widgets and its ``/generate`` event (inside an open ``gr.Tab``); returns what a link sets."""
    w = build_generate_widgets()
    wire_generate(inputs, specs, w)
    return GenerateInputs(w.source, w.methods, w.budget)


def build_generate_widgets() -> GenerateWidgets:
    """The tab's introduction, its settings (the prompt, the methods, the budget, the length), Generate and
    Stop, then the status, the table, the texts and the figures."""
    gr.Markdown(
        "**Compression while the model writes.** The unbounded cache writes first; then each chosen method "
        "writes after the same prompt with at most *budget* keys per KV head, shrinking its cache as it goes, "
        "and re-reads the unbounded text to score it token by token. The prompt opens on the copy task "
        "(a list of codes to copy back: a cache that drops part of the list loses those codes)."
    )
    with gr.Row():
        source = gr.Radio(list(SOURCES), value=SOURCES[0], label="Write after", elem_id="kvlab-gen-source", scale=2)
        offered = bounded_policies()
        methods = gr.CheckboxGroup(
            [(policy_class(m).label, m) for m in offered],
            value=offered,
            label="Bounded-cache methods",
            elem_id="kvlab-gen-methods",
            scale=3,
        )
    prompt = gr.Textbox(value=DEFAULT_PROMPT, lines=6, max_lines=12, label="Prompt", elem_id="kvlab-gen-prompt")
    with gr.Row():
        budget = gr.Number(
            value=0,
            precision=0,
            minimum=0,
            label="Budget (keys per KV head; 0: a quarter of the unbounded length)",
            elem_id="kvlab-gen-budget",
        )
        max_new = gr.Slider(
            1,
            MAX_GENERATE_TOKENS,
            value=DEFAULT_GENERATE_TOKENS,
            step=1,
            label="New tokens at most",
            elem_id="kvlab-gen-max-new",
        )
    with gr.Row():
        go_button = gr.Button("Generate", variant="primary", elem_id="kvlab-gen-run", scale=4)
        stop_button = gr.Button("Stop", variant="stop", elem_id="kvlab-gen-stop", scale=1)
    status = gr.Markdown(elem_id="kvlab-gen-status")
    table = gr.Dataframe(headers=COLUMNS, label="Per method", interactive=False, elem_id="kvlab-gen-table")
    texts = gr.HTML(elem_id="kvlab-gen-texts")
    with gr.Row():
        size_plot = gr.Plot(label="Cache size while writing", elem_id="kvlab-gen-size")
        logp_plot = gr.Plot(label="Log-probability of the unbounded text", elem_id="kvlab-gen-logp")
    beacon_plot = gr.Plot(label="BeaconKV's beacons", elem_id="kvlab-gen-beacons")
    return GenerateWidgets(
        source,
        methods,
        prompt,
        budget,
        max_new,
        go_button,
        stop_button,
        status,
        table,
        texts,
        size_plot,
        logp_plot,
        beacon_plot,
    )


def wire_generate(inputs: DocumentInputs, specs: list[str], w: GenerateWidgets) -> None:
    """``/generate`` on Generate, and Stop."""

    def on_generate(
        source_=SOURCES[0],
        prompt_="",
        text=None,
        file=None,
        question=None,
        methods_=None,
        budget_=0,
        max_new_=DEFAULT_GENERATE_TOKENS,
        model=None,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        chosen = list(methods_ or [])
        use_prompt = source_ != SOURCES[1]
        g = guarded(
            "generation",
            lambda: generate(
                prompt=prompt_ if use_prompt else None,
                document=None if use_prompt else common.document_input(text, file),
                question=None if use_prompt else question,
                methods=chosen,
                budget=budget_ or None,
                max_new_tokens=max_new_ or DEFAULT_GENERATE_TOKENS,
                model=checked_model(model, specs),
                progress=progress,
            ),
            owner=common.session_of(request),
            kind="generate",
            progress=progress,
        )
        summary = (
            f"**{g.model}**: {g.prompt_tokens} prompt tokens, {len(g.reference.run.ids)} written by the "
            f"unbounded cache; budget **{g.budget}** keys per KV head; {g.wall_s:.1f} s in all."
        )
        return (summary, {"headers": COLUMNS, "data": generation_rows(g)}, *generation_figures(g))

    generating = w.go.click(
        on_generate,
        [w.source, w.prompt, inputs.text, inputs.upload, inputs.question, w.methods, w.budget, w.max_new, inputs.model],
        w.outputs,
        api_name="generate",
        concurrency_limit=common.COMPUTE_ADMITTED,
        concurrency_id="compute",
    )
    w.stop.click(None, None, None, cancels=[generating], api_name=False)
