"""The real app, served and driven through its API with gradio_client (the embedded model)."""

from __future__ import annotations

import csv
import json
import pickle
import types

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client.exceptions import AppError  # noqa: E402

from benchmarks.browser import serve_app  # noqa: E402
from conftest import method_sections  # noqa: E402
from kvlab import catalog, lab  # noqa: E402
from kvlab.catalog import all_knobs  # noqa: E402
from kvlab.compression.interface import FAMILIES  # noqa: E402
from kvlab.context_store import CONTEXTS  # noqa: E402
from kvlab.figures.diff import DIFF_COMPRESSED, DIFF_FULL  # noqa: E402
from kvlab.methods import REGISTRY  # noqa: E402
from kvlab.models import EMBEDDED, EMBEDDED_LABEL, PACKAGED, installed_packaged  # noqa: E402
from kvlab.ui import common, default_method, present  # noqa: E402
from kvlab.ui.learn import learn_markdown  # noqa: E402

pytestmark = pytest.mark.slow  # a served app and the embedded model: left out of make test-fast

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
# Cheap methods keep the tests quick whatever else gets registered.
FAST = "streaming_llm" if "streaming_llm" in REGISTRY else default_method()
OTHER = "tova" if "tova" in REGISTRY else FAST
MISSING_MODEL = "/nonexistent/kvlab-missing-model.gguf"
#: What the API returns for an output an event leaves as it is (gr.skip()).
NO_CHANGE = {"__type__": "update"}


@pytest.fixture(scope="module")
def tiny_dir(embedded, tmp_path_factory):
    """A second model for the menu: a 2-layer random Llama with the embedded model's tokenizer, saved to disk."""
    from kvlab.testing.random_models import save_tiny_llama

    folder = tmp_path_factory.mktemp("models") / "kvlab-tiny-llama"
    tokenizer = embedded.tokenizer
    overrides = dict(vocab_size=len(tokenizer), max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id)
    return str(save_tiny_llama(folder, tokenizer, **overrides))


@pytest.fixture(scope="module")
def app_url(embedded, tiny_dir):
    models = [(EMBEDDED_LABEL, EMBEDDED), ("tiny", tiny_dir), ("missing", MISSING_MODEL)]
    with serve_app(embedded, models) as url:
        yield url


@pytest.fixture(scope="module")
def client(app_url):
    return gradio_client.Client(app_url, verbose=False)


def _run(client, text=DOCUMENT, method=FAST, **kw):
    args = dict(text=text, method=method, ratio=4, question=QUESTION, max_new_tokens=12, api_name="/run")
    return client.predict(**{**args, **kw})


def test_every_knob_gets_a_widget_of_its_type_in_the_panel():
    """The one knob panel shows each method's knobs, each in a widget of its own of its type: a Literal's
    exact choices, a slider over its declared bounds, a whole-number box for an int; every other slot
    hidden; each at its default, and the hidden box of values emptied (the defaults)."""
    import typing

    import gradio as gr

    from kvlab.ui.knobs import CUSTOM, build_panel, method_panel, preset_updates

    with gr.Blocks():
        panel = build_panel(sorted(REGISTRY), FAST, gr.Markdown())
    for name, knobs in all_knobs().items():
        info, preset, wrappers, *slots, box = method_panel(panel, name)
        assert box == "" and len(slots) == len(panel.slots) and info == catalog.method_info(name)
        assert preset["visible"] == bool(catalog.presets(name)), name
        # The wrappers' knobs in their fold, shown for the methods that take them, each method's own before it.
        assert wrappers["visible"] == any(k.wrapper for k in knobs), name
        assert all(panel.places[i].wrapper == k.wrapper for k, i in zip(knobs, panel.layout[name]))
        taken = panel.layout[name]
        assert len(set(taken)) == len(knobs)
        assert all(not slots[i]["visible"] for i in range(len(slots)) if i not in taken), name
        for knob, i in zip(knobs, taken):
            widget, shown = panel.slots[i], slots[i]
            field = REGISTRY[name].Options.__dataclass_fields__[knob.name]
            kind = typing.get_type_hints(REGISTRY[name].Options)[knob.name]
            assert shown["visible"] and shown["label"] == knob.name and shown["value"] == knob.default
            if typing.get_origin(kind) is typing.Literal:
                assert isinstance(widget, gr.Dropdown) and shown["choices"] == list(typing.get_args(kind))
            elif kind is bool:
                assert isinstance(widget, gr.Checkbox)
            elif field.metadata.get("slider"):
                assert isinstance(widget, gr.Slider)
                assert (shown["minimum"], shown["maximum"]) == (field.metadata["low"], field.metadata["high"])
            elif kind in (int, float):
                assert isinstance(widget, gr.Number) and (widget.precision == 0) == (kind is int)
            else:
                assert isinstance(widget, gr.Textbox)
        # A published configuration sets its knobs, the others back to their defaults; "as set below" nothing.
        for preset_name, chosen in catalog.presets(name).items():
            *shown, box = preset_updates(panel, name, preset_name)
            assert {shown[i]["label"]: shown[i]["value"] for i in taken} == {
                k.name: chosen.get(k.name, k.default) for k in knobs
            }
            assert json.loads(box) == chosen
        assert all(update == gr.update() for update in preset_updates(panel, name, CUSTOM))
    # The page opens on one method's knobs, drawn with the page (no event needed).
    for knob, i in zip(all_knobs()[FAST], panel.layout[FAST]):
        assert panel.slots[i].label == knob.name and panel.slots[i].visible


def test_model_choices_come_from_the_environment():
    packaged = [(PACKAGED[spec].label, spec) for spec in installed_packaged()]  # `make setup` installs them
    assert lab.model_choices({}) == [(f"{EMBEDDED_LABEL} (default)", EMBEDDED), *packaged]
    env = {"KVLAB_MODEL": "/models/big.gguf", "KVLAB_MODELS": " Qwen/Qwen3-4B, /models/big.gguf,,/data/llama "}
    assert [spec for _, spec in lab.model_choices(env)] == [
        "/models/big.gguf",
        EMBEDDED,
        *[spec for _, spec in packaged],
        "Qwen/Qwen3-4B",
        "/data/llama",
    ]
    assert lab.model_choices(env)[0][0].endswith("(default)")


def test_ratios_are_parsed_and_checked():
    assert lab.parse_ratios([10, 2], "3, 20x 2") == [2.0, 3.0, 10.0, 20.0]
    for bad in ("abc", "0.5", "5000", "nan"):
        with pytest.raises(lab.InputError):
            lab.parse_ratios([], bad)
    with pytest.raises(lab.InputError, match="at least one"):
        lab.parse_ratios([], " ")


def test_learn_tab_explains_every_method():
    text = learn_markdown()
    sections = method_sections(text)
    assert sorted(sections) == sorted(REGISTRY) and text.count("#### `") == len(REGISTRY)  # each method once
    for name, cls in REGISTRY.items():
        family, section = sections[name]
        assert family == cls.family.capitalize(), name  # under its own family's heading
        assert len(cls.learn) > 80, f"{name} has no Learn text"
        assert cls.summary in section and cls.learn in section and str(cls.paper) in section, name
    headings = [line[4:] for line in text.split("## Methods", 1)[1].splitlines() if line.startswith("### ")]
    assert headings == [f.capitalize() for f in FAMILIES if any(c.family == f for c in REGISTRY.values())]
    # BeaconKV's details come from secondary summaries of the paper; its Learn text must say so.
    assert "secondary summaries" in REGISTRY["beaconkv"].learn
    for plot in (
        "Attention-output error",
        "Attention mass, full vs compressed",
        "Keys per head",
        "Memory",
        "Time per stage",
        "Token fates",
        "**intensity**",
        "log-ppl",
    ):
        assert plot in text


def test_gpu_functions_use_spaces_when_importable(monkeypatch):
    calls = []

    def gpu(duration):
        calls.append(duration)
        return lambda fn: types.SimpleNamespace(wrapped=fn)

    monkeypatch.setattr(common, "spaces", types.SimpleNamespace(GPU=gpu))
    f = lambda: 1  # noqa: E731
    assert common.on_gpu(30)(f).wrapped is f and calls == [30]
    monkeypatch.setattr(common, "spaces", None)
    assert common.on_gpu(30)(f) is f


def test_a_sweeps_gpu_slot_grows_with_its_runs_and_is_capped(monkeypatch):
    # The rule: a base plus a share per (method, ratio), never above the cap. Hand-worked
    # with base 10 s, 3 s a run and a 50 s cap: 2 methods x 2 ratios -> 10 + 4 * 3 = 22 s;
    # 5 x 5 = 25 runs -> 85 s, capped to 50 s.
    monkeypatch.setattr(present, "GPU_SWEEP_BASE_S", 10)
    monkeypatch.setattr(present, "GPU_SWEEP_POINT_S", 3)
    monkeypatch.setattr(present, "GPU_MAX_S", 50)
    assert present.sweep_duration("t", None, ["a", "b"], [2, 5]) == 22
    assert present.sweep_duration("t", None, list("abcde"), [2, 3, 4, 5, 6]) == 50
    assert present.sweep_duration("t", None, [], []) == 13  # an empty sweep still gets one run's slot


def test_gpu_results_are_plain_picklable_data(embedded):
    # ZeroGPU runs the heavy functions in a forked worker and pickles what they return:
    # figures, texts and token fates only, never the model or a cache.
    view = present.run_view(lab.run_spec(DOCUMENT, None, FAST, 4, QUESTION, 8, {}, None))
    blob = pickle.dumps(view)
    assert len(blob) < 2_000_000 and b"LlamaForCausalLM" not in blob
    assert view.fates.n_layers == embedded.n_layers and view.fates.n_kv_heads == embedded.n_kv_heads
    # FAST has no per-token score; the question's attention is there for every method.
    assert set(view.fates.levels) == {"question"}
    assert len(view.fates.levels["question"][0][0]) == len(view.fates.token_texts)
    sweep = present.sweep_view(DOCUMENT, None, [FAST], [4.0], QUESTION, 8, None)
    assert b"LlamaForCausalLM" not in pickle.dumps(sweep)


def test_models_sharing_a_name_never_share_a_context(tiny):
    from conftest import tiny_llama

    other = tiny_llama(seed=1)  # also named "tiny-llama"
    text = "w1 w2 w3 w4 w5 w6 w7 w8"
    first, _ = lab.prepared_context(tiny, text)
    second, prefilled = lab.prepared_context(other, text)
    assert first.lm is tiny and second.lm is other and prefilled
    assert lab.prepared_context(tiny, text) == (first, False)


def test_endpoints_have_names(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {
        "/run",
        "/compare",
        "/token_view",
        "/load_example",
        "/pick_question",
        "/load_file",
        "/select_method",
    } <= names


def test_run_gives_two_answers_and_figures(client, embedded):
    out = _run(client, layer=3, head=1, knobs=json.dumps({k.name: k.default for k in all_knobs()[FAST]}))
    summary, full, compressed, diff, err_plot = out[:5]
    assert full.strip() and compressed.strip()
    assert "at **4x**" in summary

    # The word diff holds both answers: shared words plus each side's own spell each answer again.
    def spelled(side):
        return "".join(part["token"] for part in diff if part["class_or_confidence"] in (None, side)).split()

    assert spelled(DIFF_FULL) == full.split() and spelled(DIFF_COMPRESSED) == compressed.split()
    assert err_plot and "plot" in str(err_plot)
    counts = out[11]
    assert counts.startswith("Layer 3, KV head 1:") and "template" in counts

    # The token view re-renders from the state kept for this client's session.
    line, tokens = client.predict(layer=embedded.n_layers - 1, head=0, api_name="/token_view")
    assert line.startswith(f"Layer {embedded.n_layers - 1}, KV head 0:")
    for fate in ("template", "kept", "evicted"):
        assert f'title="{fate}"' in tokens


def test_token_view_shades_by_the_chosen_intensity(client, embedded):
    _run(client, method=OTHER)  # a method that scores tokens
    last = embedded.n_layers - 1
    views = {
        value: client.predict(layer=last, head=0, intensity=value, api_name="/token_view")
        for _, value in present.INTENSITIES
    }
    line, tokens = views["score"]
    assert "Intensity: the method's own score" in line
    assert "intensity = the method&#x27;s own score" in tokens and 'title="kept, percentile ' in tokens
    line, tokens = views["question"]
    assert "Intensity: the attention the question" in line and 'title="kept, percentile ' in tokens
    line, tokens = views["none"]
    assert "Intensity" not in line and "percentile" not in tokens and 'title="kept"' in tokens
    assert all(len(tokens) < 400_000 for _, tokens in views.values())
    # A method without a score says so and shows no shading; the question's attention is always there.
    out = _run(client, method=FAST, intensity="score")
    assert "no per-token score" in out[11] and "percentile" not in out[12]
    _, tokens = client.predict(layer=last, head=0, intensity="question", api_name="/token_view")
    assert 'title="kept, percentile ' in tokens


def test_changing_the_method_reuses_the_prefill(client, embedded):
    # A document no other test reads: its first run prefills, the next ones must not.
    text = DOCUMENT + "The oven in the back room was built in 1931 and still bakes every loaf.\n"
    first = _run(client, text=text)
    assert "done now" in first[0]
    ctx = CONTEXTS.get(embedded, lab.document_text(text, None))  # cached: no prefill here
    second = _run(client, text=text, method=OTHER, ratio=8)
    assert "reused" in second[0] and f"Prefill {ctx.prefill_s:.2f} s" in second[0]
    assert CONTEXTS.get(embedded, lab.document_text(text, None)) is ctx
    assert "reused" in json.dumps(second[8])  # the time figure marks the prefill as reused


def test_empty_document_is_a_clear_error(client):
    with pytest.raises(AppError, match="no document"):
        client.predict(text="   ", method=FAST, question=QUESTION, api_name="/run")


def test_empty_question_is_a_clear_error(client):
    with pytest.raises(AppError, match="question is empty"):
        client.predict(text=DOCUMENT, method=FAST, question=" ", api_name="/run")


def test_unknown_method_is_a_clear_error(client):
    with pytest.raises(AppError, match="no_such_method"):
        client.predict(text=DOCUMENT, method="no_such_method", question=QUESTION, api_name="/run")


def test_knobs_the_method_does_not_have_or_allow_are_a_clear_error(client):
    """`/run`'s knobs, as JSON or as the command line spells them: a knob of another method, a value out of
    the knob's choices, text that is neither; each one line, and the server still answers after them."""
    for knobs, message in (
        ('{"max_queries": 64}', f"{FAST} has no knob 'max_queries'"),
        ("n_sink=many", "n_sink must be"),
        ("{not json", "not a JSON object"),
    ):
        with pytest.raises(AppError, match=message) as caught:
            _run(client, knobs=knobs)
        assert "\n" not in str(caught.value).strip(), knobs
    assert "at **4x**" in _run(client, knobs="n_sink=2")[0]


def test_model_not_offered_is_refused(client):
    with pytest.raises(AppError, match="not in the list of choices|not offered"):
        _run(client, model="some-org/some-model")


def test_model_that_fails_to_load_is_a_clear_error(client):
    with pytest.raises(AppError, match="GGUF file not found"):
        _run(client, model=MISSING_MODEL)
    # The server stays up and the default model still answers.
    assert _run(client)[2].strip()


def test_switching_models_keeps_each_models_prefill(app_url, embedded, tiny_dir):
    # A session of its own: after a run, the layer/head sliders (and so the values /run
    # accepts) follow that run's model, and the tiny model has fewer layers and heads.
    client = gradio_client.Client(app_url, verbose=False)
    text = DOCUMENT + "Biscuit the cat sleeps on the flour sacks.\n"
    assert "done now" in _run(client, text=text)[0]
    tiny = _run(client, text=text, model=tiny_dir, layer=9, head=embedded.n_kv_heads - 1)
    assert "kvlab-tiny-llama" in tiny[0] and "done now" in tiny[0]
    assert tiny[11].startswith("Layer 1, KV head 1:")  # clamped to the tiny model's 2 layers x 2 KV heads
    assert "reused" in _run(client, text=text, layer=0, head=0)[0]  # the embedded model's context is still cached
    assert "reused" in _run(client, text=text, model=tiny_dir, layer=0, head=0)[0]


def test_compare_sweeps_methods_and_ratios(client):
    status, full, err_plot, mass_plot, ppl_plot, table, csv_file, json_file = client.predict(
        text=DOCUMENT,
        methods=[FAST, OTHER],
        ratios=[2, 5],
        more_ratios="3",
        question=QUESTION,
        max_new_tokens=8,
        api_name="/compare",
    )
    pairs = [(FAST, 2), (FAST, 3), (FAST, 5), (OTHER, 2), (OTHER, 3), (OTHER, 5)]
    pairs = list(dict.fromkeys(pairs))
    assert "runs" in status and full.strip()
    assert [(row[0], row[1]) for row in table["data"]] == pairs
    assert err_plot and mass_plot and "full cache" in json.dumps(ppl_plot)
    with open(csv_file, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["method"], float(r["ratio"])) for r in rows] == pairs
    assert set(lab.EXPORT_FIELDS) == set(rows[0])
    data = json.loads(open(json_file, encoding="utf-8").read())
    assert [(r["method"], r["ratio"]) for r in data["results"]] == pairs
    assert data["logppl_full"] == pytest.approx(float(rows[0]["logppl_full"]))
    assert "attn_output_rel_err" in data["results"][0]["per_head"]


def test_compare_runs_the_same_sweep_on_each_model_ticked(client, tiny_dir):
    """Models as an axis: each model's runs named by it, each with its own full cache (ceiling)."""
    status, full, _err, _mass, _ppl, table, _csv, json_file = client.predict(
        text=DOCUMENT,
        methods=[FAST],
        ratios=[2],
        more_ratios="",
        question=QUESTION,
        max_new_tokens=4,
        models=[EMBEDDED, tiny_dir],
        api_name="/compare",
    )
    labels = [row[0] for row in table["data"]]
    assert labels == [f"{FAST} · {EMBEDDED_LABEL}", f"{FAST} · kvlab-tiny-llama"]
    assert "own full cache" in status and len(full.splitlines()) == 2
    data = json.loads(open(json_file, encoding="utf-8").read())
    assert [c["spec"] for c in data["ceilings"]] == [EMBEDDED, tiny_dir]
    assert [r["model"] for r in data["results"]] == [c["model"] for c in data["ceilings"]]
    # A model the menu does not offer is refused before any work (by the menu's own list of choices).
    with pytest.raises(AppError, match="not in the list of choices"):
        client.predict(
            text=DOCUMENT,
            methods=[FAST],
            ratios=[2],
            more_ratios="",
            question=QUESTION,
            models=["/elsewhere"],
            api_name="/compare",
        )


def test_compare_bad_ratio_is_a_clear_error(client):
    with pytest.raises(AppError, match="not a compression ratio"):
        client.predict(
            text=DOCUMENT, methods=[FAST], ratios=[], more_ratios="lots", question=QUESTION, api_name="/compare"
        )


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
        text="",
        file=gradio_client.handle_file(str(doc)),
        method=FAST,
        ratio=4,
        question=QUESTION,
        max_new_tokens=12,
        api_name="/run",
    )
    assert out[1].strip() and out[2].strip()


def test_binary_file_is_a_clear_error(client, tmp_path):
    bad = tmp_path / "noise.txt"
    bad.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(AppError, match="binary"):
        client.predict(gradio_client.handle_file(str(bad)), api_name="/load_file")


def test_load_example_fills_text_and_questions(client):
    examples = lab.examples()
    assert examples, "the bundled examples should load"
    text, suggested, question, _, model = client.predict(examples[0].id, api_name="/load_example")
    assert len(text) > 1000
    assert question == examples[0].questions[0]
    assert model == NO_CHANGE  # an example any model reads leaves the model menu as it is


def test_a_long_example_switches_the_model_to_its_own_where_the_page_offers_it(embedded):
    """The long example (issue #58) is read by Gemma 3 270M: picking it sets the model menu to that model
    (then the page prepares it with that model); a page that does not offer the model does not list it."""
    (long,) = [ex for ex in lab.examples() if ex.model is not None]
    assert long.model in installed_packaged()  # make setup installs it
    assert long not in lab.offered_examples([EMBEDDED])
    with serve_app(embedded, [(EMBEDDED_LABEL, EMBEDDED), ("Gemma", long.model)]) as url:
        client = gradio_client.Client(url, verbose=False)
        text, _, question, _, model = client.predict(long.id, api_name="/load_example")
        assert (text, question, model) == (long.text(), long.questions[0], long.model)
        *_, model = client.predict("story", api_name="/load_example")
        assert model == NO_CHANGE  # back to a short example: the menu keeps the visitor's model


def test_tasks_mode_scores_answers_against_known_ones(client, tmp_path):
    # One short needle document, one cheap method at one ratio: the views come back filled,
    # with the full cache (ceiling) and no context (floor) in the table.
    status, task, accuracy, method, heatmap, table = client.predict(  # the per-user state is not returned
        task="needle_grid", items=1, length=150, methods=[FAST], ratios=[2], more_ratios="", api_name="/tasks"
    )
    assert "needle_grid" in status and "ceiling" in status and "floor" in status
    rows = {(r[1], r[2]) for r in table["data"]}
    assert {("full", "-"), ("no_context", "-"), (FAST, 2)} <= rows
    assert accuracy and heatmap and "needles found" in json.dumps(heatmap)


def test_tasks_mode_hides_needles_in_prose_when_asked(client):
    status, task, *_ = client.predict(
        task="needle_grid",
        items=1,
        length=150,
        methods=[FAST],
        ratios=[2],
        more_ratios="",
        haystack="prose",
        api_name="/tasks",
    )
    assert "needle_grid on a prose haystack" in status and task["value"] == "needle_grid[prose]"
    with pytest.raises(AppError, match="has no haystack or needle values to choose"):
        client.predict(
            task="copy_codes",
            items=1,
            length=150,
            methods=[FAST],
            ratios=[2],
            more_ratios="",
            haystack="prose",
            api_name="/tasks",
        )


def test_tasks_mode_loads_a_bench_results_file(client, tiny, tmp_path):
    # Results written by the bench runner (tiny model, in-process) load into the same views.
    from kvlab.tasks.runner import MethodSpec, run_items
    from kvlab.tasks.store import ResultWriter, results_path
    from kvlab.tasks.synthetic import needle_items

    items = needle_items("w3 w4 w5. w6 w7 w8. w9 w10 w11.", [0.0, 1.0])
    with ResultWriter(results_path(tmp_path)) as writer:
        written = run_items(tiny, items, [MethodSpec(FAST)], [2.0], on_result=writer.write)
    out = client.predict([gradio_client.handle_file(str(results_path(tmp_path)))], api_name="/load_results")
    status, table = out[0], out[5]
    assert f"{len(written)} answers scored" in status
    assert sorted((r[1], r[2]) for r in table["data"]) == sorted(
        {(r.method, "-" if r.ratio is None else r.ratio) for r in written}
    )


def test_needle_test_on_the_users_document(client):
    out = client.predict(text=DOCUMENT, methods=[FAST], ratios="2", depths=2, api_name="/needle_test")
    status, table = out[0], out[5]
    assert "needle test, 2 depths" in status
    assert {r[1] for r in table["data"]} == {"full", "no_context", FAST}
    with pytest.raises(AppError, match="depths|minimum value 1"):
        client.predict(text=DOCUMENT, methods=[FAST], ratios="2", depths=0, api_name="/needle_test")


def test_prepare_then_run_reuses_the_prefill(client):
    text = DOCUMENT + "The flour store is in the cellar under the shop.\n"
    status = client.predict(text=text, method=FAST, api_name="/prepare")
    assert status.startswith("Ready:")
    assert "reused" in _run(client, text=text)[0]


def test_answers_are_marked_right_or_wrong_when_the_gold_answer_is_known(client):
    # A bundled example's question: the gold answer is known, so both answers get a mark, judged by
    # whether they contain it (kvlab.tasks.marking.contains_match, checked here by hand).
    example = lab.examples()[0]
    out = _run(client, text=example.text(), question=example.questions[0], method=FAST, ratio=2, max_new_tokens=24)
    full, compressed, mark_full, mark_comp = out[1], out[2], out[-2], out[-1]
    gold = example.answers[0]
    assert ("right" in mark_full) == (gold.lower() in full.lower()) and f"expected: {gold}" in mark_full
    assert ("right" in mark_comp) == (gold.lower() in compressed.lower())
    # A question of the user's own: no gold answer, no mark.
    plain = _run(client)
    assert plain[-2] == "" and plain[-1] == ""
