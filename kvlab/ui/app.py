"""The whole page: the model menu, then the Explore, Compare and Learn tabs; serving it.

The page builds itself from :data:`kvlab.methods.REGISTRY`: the method menu,
the "Advanced" knobs (one input per field of each method's ``Options``) and
the "Learn" tab. A method registered later appears without any change here.

Models: the menu offers the default model (``KVLAB_MODEL``, else the
embedded SmolLM2) and every spec in ``KVLAB_MODELS`` (comma-separated: hub
ids, local directories, .gguf files); any other model is refused. A model is
loaded on first use; a failure is shown to the user and the server stays up.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

import gradio as gr

from kvlab import limits
from kvlab.lab import examples as bundled_examples
from kvlab.lab import model_choices, prepare_document
from kvlab.methods import REGISTRY
from kvlab.methods.catalog import all_knobs, query_awareness
from kvlab.models import LoadedModel, ModelLoadError, get_model
from kvlab.ui import common
from kvlab.ui.common import CSS
from kvlab.ui.compare import build_compare_tab
from kvlab.ui.explore import build_explore_tab
from kvlab.ui.generate import build_generate_tab
from kvlab.ui.learn import build_learn_tab

log = logging.getLogger("kvlab.app")

#: The method a first visit starts with.
PREFERRED_METHOD = "attention_matching"
#: Requests waiting in the queue at most (more are refused with "queue full"), and how long
#: Gradio keeps uploaded and generated files (seconds).
QUEUE_SIZE = int(os.environ.get("KVLAB_QUEUE_SIZE", "20"))
FILE_CACHE_S = 3600
# Placeholder geometry for the token-view sliders until a model is known.
_DEFAULT_LAYERS, _DEFAULT_KV_HEADS = 32, 8


def default_method() -> str:
    """The method a first visit starts with: Attention Matching when registered,
    else the first (alphabetically) query-agnostic method, else the first one."""
    if PREFERRED_METHOD in REGISTRY:
        return PREFERRED_METHOD
    names = sorted(REGISTRY)
    return next((n for n in names if query_awareness(n) != "yes"), names[0])


def build_app(lm: LoadedModel | None = None, models: list[tuple[str, str]] | None = None) -> gr.Blocks:
    """The whole app.

    lm: the default model when already loaded (its name and geometry set the
    page's first state); models: (label, spec) choices of the model menu, the
    first being the default (default: kvlab.lab.model_choices, from the environment).
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
            choices=choices, value=specs[0], label="Model",
            info="Used by Explore and Compare; a model other than the default is loaded on first use",
            elem_id="kvlab-model", interactive=len(choices) > 1,
        )
        with gr.Tabs():
            with gr.Tab("Explore", id="explore"):
                inputs = build_explore_tab(
                    demo, model, bundled_examples(), all_knobs(), default_method(), specs,
                    lm.n_layers if lm else _DEFAULT_LAYERS, lm.n_kv_heads if lm else _DEFAULT_KV_HEADS,
                )
            with gr.Tab("Compare", id="compare"):
                build_compare_tab(inputs, specs)
            with gr.Tab("Generate", id="generate"):
                build_generate_tab(inputs, specs)
            with gr.Tab("Learn", id="learn"):
                build_learn_tab()
    return demo


def launch_options() -> dict[str, Any]:
    """The keyword arguments of ``launch()``: the style (Gradio 6: theme and css go there), the upload limit."""
    # Gradio refuses larger uploads itself, before they reach the disk.
    return {"theme": gr.themes.Soft(), "css": CSS, "max_file_size": limits.LIMITS.upload_bytes}


def prepare(demo: gr.Blocks) -> gr.Blocks:
    """Queue the app: one heavy computation at a time (``/run`` and ``/compare`` share one slot), so a
    small CPU Space stays responsive for the light events (examples, token view), which run beside it;
    at most QUEUE_SIZE requests wait. Each user's last run stays in their own session state."""
    return demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)


def warm_first_example(spec: str) -> threading.Thread | None:
    """Prepare the example the page opens on (prefill + the default method's reference queries) in a
    background thread, so that a visitor's first Run finds it done. None on ZeroGPU (nothing computed
    outside a GPU slot survives it) or without examples."""
    pool = bundled_examples()
    if common.spaces is not None or not pool:
        return None

    def work() -> None:
        try:
            p = prepare_document(pool[0].text(), None, default_method(), model=spec)
            log.info("first example prepared in %.1f s (%d tokens)", p.wall_s, p.doc_tokens)
        except Exception:  # noqa: BLE001 - a visitor's Run will do it and report any error
            log.exception("preparing the first example failed")

    thread = threading.Thread(target=work, name="kvlab-warm", daemon=True)
    thread.start()
    return thread


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
        warm_first_example(choices[0][1])
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
