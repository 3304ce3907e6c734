"""The real app, served and driven through its API with gradio_client (the embedded model)."""
from __future__ import annotations

import dataclasses
import socket

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client.exceptions import AppError  # noqa: E402

from kvlab import ui  # noqa: E402
from kvlab.methods import REGISTRY  # noqa: E402

DOCUMENT = """\
Harbor Street Bakery: staff notes for the spring season

The bakery opens at seven in the morning from Tuesday to Sunday and stays closed on Mondays.
The head baker is Rosalind Fairweather, who has worked at Harbor Street for eleven years.
Our best-selling bread is the rye sourdough called Grey Gull; we bake forty loaves of it each day.
The cinnamon knots come out of the oven at ten o'clock, and they usually sell out before noon.
Deliveries of flour arrive every Thursday from the Millbrook mill, which is run by Peter Ash.
The new espresso machine, bought in March, is an Italian model named the Vesuvio Duo.
Staff may take one free coffee per shift and a loaf of day-old bread on Sundays.
If the walk-in fridge alarm sounds, call the repair company Coldline at once; the code for the back door is 4417.
Customers with nut allergies should be told that the almond croissants are made on the same bench as everything else.
The bakery's cat, a ginger tom named Biscuit, must never be allowed into the kitchen.
"""
QUESTION = "What is the name of the head baker?"
# A cheap method keeps the test quick whatever else gets registered.
FAST = "streaming_llm" if "streaming_llm" in REGISTRY else ui.default_method()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(embedded):
    demo = ui.prepare(ui.build_app(embedded))
    port = _free_port()
    demo.launch(
        prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
        **ui.launch_options(),
    )
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def client(app_url):
    return gradio_client.Client(app_url, verbose=False)


def test_knobs_follow_the_registry():
    # Every registered method's Options fields are knobs named <method>__<field>, typed back.
    knobs = ui.method_knobs()
    assert set(knobs) == set(REGISTRY)
    for name, cls in REGISTRY.items():
        fields = [f.name for f in dataclasses.fields(cls.Options) if f.init]
        assert [k.field.name for k in knobs[name]] == fields
    name, knob = next((n, k) for n, ks in knobs.items() for k in ks if k.kind is int)
    other = next((k for n, ks in knobs.items() if n != name for k in ks), None)
    values = {knob.key: 7.0, **({other.key: other.default} if other else {})}
    assert ui.method_options(name, knobs, values) == {knob.field.name: 7}


def test_endpoints_have_names(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/run", "/compare", "/token_view", "/load_example", "/pick_question", "/load_file", "/select_method"} <= names


def test_run_gives_two_answers_and_figures(client, embedded):
    out = client.predict(
        text=DOCUMENT, method=FAST, ratio=4, question=QUESTION,
        max_new_tokens=12, layer=3, head=1, api_name="/run",
        **{k.key: k.default for k in ui.method_knobs()[FAST]},  # knobs are keyword parameters
    )
    summary, full, compressed, diff, err_plot = out[:5]
    assert full.strip() and compressed.strip()
    assert "at **4x**" in summary
    assert diff is not None
    assert err_plot and "plot" in str(err_plot)
    counts = out[11]
    assert counts.startswith("Layer 3, KV head 1:") and "template" in counts

    # The token view re-renders from the state kept for this client's session.
    line, tokens = client.predict(layer=embedded.n_layers - 1, head=0, api_name="/token_view")
    assert line.startswith(f"Layer {embedded.n_layers - 1}, KV head 0:")
    for fate in ("template", "kept", "evicted"):
        assert f'title="{fate}"' in tokens


def test_empty_document_is_a_clear_error(client):
    with pytest.raises(AppError, match="no document"):
        client.predict(text="   ", method=FAST, question=QUESTION, api_name="/run")


def test_empty_question_is_a_clear_error(client):
    with pytest.raises(AppError, match="question is empty"):
        client.predict(text=DOCUMENT, method=FAST, question=" ", api_name="/run")


def test_unknown_method_is_a_clear_error(client):
    with pytest.raises(AppError, match="no_such_method"):
        client.predict(text=DOCUMENT, method="no_such_method", question=QUESTION, api_name="/run")


def test_compare_gives_one_row_per_method(client):
    full, table, err_plot, ppl_plot = client.predict(
        text=DOCUMENT, methods=[FAST], ratio=4, question=QUESTION, max_new_tokens=12,
        api_name="/compare",
    )
    assert full.strip()
    assert [row[0] for row in table["data"]] == [FAST]
    assert err_plot and ppl_plot


def test_too_long_document_is_a_clear_error(client, embedded):
    # Tokenised and refused before any prefill: cheap.
    long_text = "The bakery opens at seven. " * (embedded.max_context // 5)
    with pytest.raises(AppError, match="shorten it"):
        client.predict(text=long_text, method=FAST, question=QUESTION, api_name="/run")


def test_uploaded_file_is_read_and_run(client, tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text(DOCUMENT, encoding="utf-8")
    assert client.predict(gradio_client.handle_file(str(doc)), api_name="/load_file").startswith("Harbor Street")
    # With an empty text box the file is the document (same text: the prefill is reused).
    out = client.predict(
        text="", file=gradio_client.handle_file(str(doc)), method=FAST, ratio=4, question=QUESTION,
        max_new_tokens=12, api_name="/run",
    )
    assert out[1].strip() and out[2].strip()


def test_binary_file_is_a_clear_error(client, tmp_path):
    bad = tmp_path / "noise.txt"
    bad.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(AppError, match="binary"):
        client.predict(gradio_client.handle_file(str(bad)), api_name="/load_file")


def test_load_example_fills_text_and_questions(client):
    examples = ui._examples()
    assert examples, "the bundled examples should load"
    text, suggested, question, _ = client.predict(examples[0].id, api_name="/load_example")
    assert len(text) > 1000
    assert question == examples[0].questions[0]
