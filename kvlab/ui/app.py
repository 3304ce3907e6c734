"""The whole page: the model menu, then the Explore, Your pick, Compare, Generate and Learn tabs (its links:
kvlab.ui.page_links; serving it: kvlab.ui.serve).

The page builds itself from the registered methods (kvlab.catalog, the UI's door to them): the method menu,
the "Advanced" knobs (a panel relabelled to the fields of the picked method's ``Options``) and
the "Learn" tab. A method registered later appears without any change here.

Models: the menu offers the default model (``KVLAB_MODEL``, else the
embedded SmolLM2) and every spec in ``KVLAB_MODELS`` (comma-separated: hub
ids, local directories, .gguf files); any other model is refused. A model is
loaded on first use; a failure is shown to the user and the server stays up.
"""

from __future__ import annotations

import gradio as gr

from kvlab.catalog import method_names, query_awareness
from kvlab.lab import model_choices, offered_examples
from kvlab.runtime.model import LoadedModel
from kvlab.ui.compare import build_compare_tab
from kvlab.ui.explore import build_explore_tab
from kvlab.ui.generate import build_generate_tab
from kvlab.ui.learn import build_learn_tab
from kvlab.ui.page_links import follow_tabs, link_choices, wire_links
from kvlab.ui.pick import build_pick_tab

#: The method a first visit starts with.
PREFERRED_METHOD = "attention_matching"
#: How long Gradio keeps uploaded and generated files (s).
FILE_CACHE_S = 3600
# Placeholder geometry for the token-view sliders until a model is known.
_DEFAULT_LAYERS, _DEFAULT_KV_HEADS = 32, 8


def default_method() -> str:
    """The method a first visit starts with: Attention Matching when registered,
    else the first (alphabetically) query-agnostic method, else the first one."""
    names = method_names()
    if PREFERRED_METHOD in names:
        return PREFERRED_METHOD
    return next((n for n in names if query_awareness(n) != "yes"), names[0])


def build_app(
    lm: LoadedModel | None = None, models: list[tuple[str, str]] | None = None, notice: str = ""
) -> gr.Blocks:
    """The whole app.

    lm: the default model when already loaded (its name and geometry set the
    page's first state); models: (label, spec) choices of the model menu, the
    first being the default (default: kvlab.lab.model_choices, from the environment);
    notice: a line under the model menu (which model serves the page, when not the usual one).
    """
    choices = list(models) if models is not None else model_choices()
    specs = [spec for _, spec in choices]
    if lm is not None:  # the loaded default model's own name
        choices[0] = (f"{lm.name} (default)", specs[0])
    with gr.Blocks(title="kvlab: KV-cache compression lab", delete_cache=(FILE_CACHE_S, FILE_CACHE_S)) as demo:
        gr.Markdown(
            "# kvlab: a lab for KV-cache compression\n"
            "Give a language model a document and a question; compress its KV cache with a method "
            "at a ratio; compare the answers, the memory, the time and the attention errors, "
            "and see which tokens each head kept. The **Learn** tab explains every method and plot."
        )
        model = gr.Dropdown(
            choices=choices,
            value=specs[0],
            label="Model",
            info="Used by every tab; a model other than the default is loaded on first use",
            elem_id="kvlab-model",
            interactive=len(choices) > 1,
        )
        gr.Markdown(notice, visible=bool(notice), elem_id="kvlab-model-notice")
        link_note = gr.Markdown(elem_id="kvlab-link-note")
        examples = offered_examples(specs)
        tab = gr.State("explore")
        with gr.Tabs() as tabs:
            with gr.Tab("Explore", id="explore") as explore_tab:
                inputs = build_explore_tab(
                    demo,
                    model,
                    examples,
                    default_method(),
                    specs,
                    lm.n_layers if lm else _DEFAULT_LAYERS,
                    lm.n_kv_heads if lm else _DEFAULT_KV_HEADS,
                )
            picking = build_pick_tab(model, examples, specs)  # its own gr.Tab("Your pick", id="pick")
            with gr.Tab("Compare", id="compare") as compare_tab:
                sweep = build_compare_tab(inputs, specs)
            with gr.Tab("Generate", id="generate") as generate_tab:
                writing = build_generate_tab(inputs, specs)
            with gr.Tab("Learn", id="learn") as learn_tab:
                build_learn_tab()
        with gr.Row(equal_height=True):
            link_button = gr.Button("Link to this", size="sm", scale=0, min_width=140, elem_id="kvlab-link-make")
            link_box = gr.Textbox(
                label="Link to this page's settings",
                interactive=False,
                lines=1,
                buttons=["copy"],
                info="Opens the lab on the current tab, example, question, method(s) and ratio(s)",
                elem_id="kvlab-link",
                scale=5,
            )
        follow_tabs(tab, (explore_tab, picking.tab, compare_tab, generate_tab, learn_tab))
        wire_links(
            demo,
            link_choices(examples, specs),
            examples,
            specs,
            inputs,
            picking,
            sweep,
            writing,
            tabs,
            tab,
            link_note,
            link_button,
            link_box,
        )
    return demo
