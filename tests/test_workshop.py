"""A workshop on one server: the result store, shared computations, a fair compute slot, warming.

Structure, not timing: every stored answer is served without taking the
compute slot (even while it is held and others wait for it), identical
requests in flight compute once, no request is answered with another's
result, a new store on the same folder (a restart) keeps the results, a
damaged or foreign entry is computed again, the slot is shared round robin
between pages, a newer request supersedes its page's older one, a class
fits the queue and beyond it a clear "busy".
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvlab import cancellation, cli, models, results, scheduler
from kvlab.lab.spec import run_spec
from kvlab.lab.warm import SheetError, parse_sheet, read_sheet
from kvlab.memo import MISSING
from kvlab.models import EMBEDDED
from kvlab.results import ResultStore, RunKey

ROOT = Path(__file__).resolve().parent.parent


def key(**change) -> RunKey:
    fields = dict(
        model="gguf:abc",
        document="d" * 64,
        question="Who?",
        method="snapkv",
        options='{"window": 8}',
        ratio=10.0,
        max_new_tokens=48,
        code="0.1.0+test",
    )
    return RunKey(**{**fields, **change})


# --------------------------------------------------------------------------- the store


def test_every_field_of_a_key_changes_its_digest():
    base = key()
    changed = [
        key(model="gguf:abd"),
        key(document="e" * 64),
        key(question="Who? "),
        key(method="tova"),
        key(options='{"window": 9}'),
        key(ratio=10.5),
        key(max_new_tokens=47),
        key(code="0.1.0+other"),
    ]
    assert len({base.digest, *(k.digest for k in changed)}) == 1 + len(changed)
    assert key().digest == base.digest == hashlib.sha256(base.canonical().encode()).hexdigest()


def test_a_new_store_on_the_same_folder_finds_what_the_old_one_kept(tmp_path):
    first = ResultStore(tmp_path / "store")
    first.put(key(), {"answer": "Fergus", "errors": [0.1, 0.2]})
    restarted = ResultStore(tmp_path / "store")  # a restarted server: nothing in memory
    assert restarted.get(key()) == {"answer": "Fergus", "errors": [0.1, 0.2]}
    assert restarted.get(key(ratio=5.0)) is MISSING
    (entry,) = restarted.entries()
    assert entry[2].stat().st_mode & 0o077 == 0  # the folder is the server's own: others read nothing


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "foreign", "not an entry"])
def test_a_damaged_or_foreign_entry_is_ignored_removed_and_computed_again(tmp_path, damage):
    store = ResultStore(tmp_path)
    store.put(key(), "the right answer")
    path = store.path(key())
    raw = path.read_bytes()
    if damage == "flipped byte":
        path.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    elif damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "foreign":  # another configuration's intact entry under this key's name
        store.put(key(method="tova"), "another configuration's answer")
        path.write_bytes(store.path(key(method="tova")).read_bytes())
    else:
        path.write_bytes(b"hello")
    fresh = ResultStore(tmp_path)
    assert fresh.get(key()) is MISSING and not path.exists()
    value, how = fresh.serve(key(), lambda: "recomputed")
    assert (value, how) == ("recomputed", "computed") and ResultStore(tmp_path).get(key()) == "recomputed"


def test_a_write_that_fails_half_way_leaves_no_entry_and_no_temporary_file(tmp_path, monkeypatch):
    store = ResultStore(tmp_path)

    def crash(src, dst):  # the process dies between writing the temporary file and renaming it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results.os, "replace", crash)
    store.put(key(), "answer")
    assert store.get(key()) == "answer"  # still served from memory
    monkeypatch.undo()
    assert ResultStore(tmp_path).get(key()) is MISSING
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_least_recently_used_entries_go_past_the_byte_budget(tmp_path):
    store = ResultStore(tmp_path, max_bytes=10**9)
    for i, name in enumerate("abc"):
        store.put(key(question=name), name * 5000)
        results.os.utime(store.path(key(question=name)), (1000 + i, 1000 + i))  # a, then b, then c
    ResultStore(tmp_path).get(key(question="a"))  # read from disk: a becomes the most recently used
    one = store.path(key(question="a")).stat().st_size
    store.max_bytes = 3 * one  # room for three: the fourth pushes out the least recently used, b
    store.put(key(question="d"), "d" * 5000)
    left = {p.name for _, _, p in store.entries()}
    assert left == {store.path(key(question=q)).name for q in "acd"}


def test_an_unusable_folder_keeps_results_in_memory_and_serving_goes_on(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    store = ResultStore(blocker / "store")
    assert store.directory is None and "not usable" in caplog.text
    assert store.serve(key(), lambda: 42) == (42, "computed")
    assert store.serve(key(), lambda: 43) == (42, "stored")


def test_identical_requests_in_flight_compute_once(tmp_path, flight_waiters):
    store, made, got = ResultStore(tmp_path), [], []

    def make():
        made.append(1)
        assert flight_waiters.wait_for(9)  # every other request has joined this computation
        return "one answer"

    threads = [threading.Thread(target=lambda: got.append(store.serve(key(), make))) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert made == [1] and len(got) == 10
    assert sorted(how for _, how in got) == ["computed"] + ["shared"] * 9
    assert {value for value, _ in got} == {"one answer"}


@pytest.mark.slow  # the embedded model
def test_a_run_key_is_the_file_digest_of_the_model_and_follows_every_input(monkeypatch, embedded):
    text = "The ferry leaves at noon. The ferryman is called Fergus."
    first = run_spec(text, None, "snapkv", 10, "Who is the ferryman?", 48, {}, EMBEDDED).key()
    source = models.resolve_source(EMBEDDED)
    gguf = Path(source.location) / source.gguf_file
    assert first.model == "gguf:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert first.document == hashlib.sha256(text.encode()).hexdigest()
    assert run_spec(text, None, "snapkv", 10, " Who is the ferryman? ", 48, {}, EMBEDDED).key() == first  # as checked
    others = [
        run_spec(text, None, "snapkv", 10, "Who is the ferryman?", 48, {"window": 4}, EMBEDDED).key(),
        run_spec(text, None, "snapkv", 5, "Who is the ferryman?", 48, {}, EMBEDDED).key(),
        run_spec(text + " Fin.", None, "snapkv", 10, "Who is the ferryman?", 48, {}, EMBEDDED).key(),
        run_spec(text, None, "snapkv", 10, "Who is the ferryman?", 32, {}, EMBEDDED).key(),
    ]
    assert len({first.digest, *(k.digest for k in others)}) == 5


# --------------------------------------------------------------------------- the compute slot


def _queue(slot: scheduler.Slot, name: str, order: list, errors: list, **who) -> threading.Thread:
    """A request that takes the slot once (appending ``name`` to ``order``), started and queued before returning."""
    before = slot.waiting

    def work() -> None:
        try:
            with cancellation.scope(**who), slot.hold():
                order.append(name)
        except (cancellation.Cancelled, scheduler.Busy) as exc:
            errors.append((name, exc))

    thread = threading.Thread(target=work)
    thread.start()
    deadline = time.monotonic() + 30
    while slot.waiting == before and not errors and time.monotonic() < deadline:  # it has joined the line
        time.sleep(0.005)
    return thread


def _held(slot: scheduler.Slot) -> tuple[threading.Thread, threading.Event]:
    """A thread holding ``slot`` until the returned event is set."""
    go, taken = threading.Event(), threading.Event()

    def hold() -> None:
        with slot.hold():
            taken.set()
            go.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(30)
    return thread, go


def test_the_slot_goes_round_robin_between_pages():
    slot, order, errors = scheduler.Slot(), [], []
    holder, go = _held(slot)
    threads = [
        _queue(slot, name, order, errors, owner=owner)
        for name, owner in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C"), ("b2", "B")]
    ]
    go.set()
    for t in [holder, *threads]:
        t.join(30)
    # A's burst came first, yet B and C each get a turn before A's second request.
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3"] and not errors


def test_a_request_that_left_the_slot_takes_it_back_between_units():
    """A pick's answer decodes beside the others' after leaving the slot (kvlab.scheduler.may_leave); its
    next unit of work (a rival still to compute) must hold the slot again, even when nobody waits."""
    slot = scheduler.Slot()
    with cancellation.scope(handover=slot.handover) as scope, slot.hold(), scheduler.may_leave(slot):
        cancellation.leave_slot()
        assert not slot.busy
        cancellation.between_units("a unit done")
        assert slot.busy and scope.units == 1
    assert not slot.busy


def test_background_work_waits_while_any_visitor_waits():
    slot, order, errors = scheduler.Slot(), [], []
    holder, go = _held(slot)
    threads = [
        _queue(slot, "warming", order, errors, owner="warm", priority=cancellation.BACKGROUND),
        _queue(slot, "visitor", order, errors, owner="V"),
    ]
    go.set()
    for t in [holder, *threads]:
        t.join(30)
    assert order == ["visitor", "warming"]


def test_a_newer_request_of_a_page_supersedes_its_older_one_still_waiting():
    slot, order, errors = scheduler.Slot(), [], []
    holder, go = _held(slot)
    older = _queue(slot, "older", order, errors, owner="A", kind="run")
    other_kind = _queue(slot, "sweep", order, errors, owner="A", kind="compare")
    newer = _queue(slot, "newer", order, errors, owner="A", kind="run")
    go.set()
    for t in [holder, older, other_kind, newer]:
        t.join(30)
    assert sorted(order) == ["newer", "sweep"]
    ((name, exc),) = errors
    assert name == "older" and exc.reason == cancellation.SUPERSEDED and "newer request" in str(exc)


def test_a_class_fits_the_line_and_beyond_it_a_clear_busy():
    slot, order, errors = scheduler.Slot(max_waiting=3), [], []
    holder, go = _held(slot)
    threads = [_queue(slot, f"p{i}", order, errors, owner=f"P{i}") for i in range(4)]
    assert [name for name, _ in errors] == ["p3"] and isinstance(errors[0][1], scheduler.Busy)
    assert "busy" in str(errors[0][1]) and "answered at once" in str(errors[0][1])
    go.set()
    for t in [holder, *threads]:
        t.join(30)
    assert order == ["p0", "p1", "p2"]


def test_a_waiting_request_hears_its_place_in_line():
    slot, order, errors, heard = scheduler.Slot(), [], [], []
    holder, go = _held(slot)
    threads = [
        _queue(slot, "first", order, errors, owner="A"),
        _queue(slot, "second", order, errors, owner="B"),
        _queue(slot, "mine", order, errors, owner="C", on_wait=lambda ahead, s: heard.append(ahead)),
    ]
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    go.set()
    for t in [holder, *threads]:
        t.join(30)
    assert heard[0] == 3  # the request holding the slot and the two before it
    assert order == ["first", "second", "mine"] and heard == sorted(heard, reverse=True)


# --------------------------------------------------------------------------- sheets and settings


def test_a_sheet_reads_links_and_plain_lines():
    items = parse_sheet(
        "# a class\n\n"
        "?tab=explore&example=story&method=attention_matching&ratio=10\n"
        "http://127.0.0.1:7860/?tab=explore&example=contract&method=kvzip&ratio=5&question=Who+signed%3F\n"
        "snapkv:window=8 20 story Who kept the ledger?\n"
        "tova 5 patient_record\n"
    )
    assert [(i.line, i.method, i.ratio, i.example, i.options) for i in items] == [
        (3, "attention_matching", 10.0, "story", ()),
        (4, "kvzip", 5.0, "contract", ()),
        (5, "snapkv", 20.0, "story", (("window", 8),)),
        (6, "tova", 5.0, "patient_record", ()),
    ]
    assert items[1].question == "Who signed?" and items[2].question == "Who kept the ledger?"
    assert items[0].question == "Who was the ferryman?"  # the example's first question
    assert items[3].label == "tova at 5x on patient_record"


@pytest.mark.parametrize(
    "line, says",
    [
        ("nosuch 10 story", "line 1: unknown method 'nosuch'"),
        ("snapkv ten story", "line 1: 'ten' is not a compression ratio"),
        ("snapkv 10 nowhere", "line 1: example 'nowhere' is not bundled"),
        ("snapkv:wndow=8 10 story", "not knob=value"),
        ("snapkv 10", "expected METHOD RATIO EXAMPLE"),
        ("?tab=compare&example=story&methods=snapkv&ratios=5", "only Explore and Your pick links"),
        ("?tab=explore&example=story&method=snapkv&ratio=10&colour=red", "`colour` is not a parameter"),
        ("?tab=explore&example=story", "names an example and a ratio, an Explore link a method too"),
    ],
)
def test_a_bad_sheet_line_is_one_clear_line_and_exit_2(tmp_path, capsys, line, says):
    sheet = tmp_path / "sheet.txt"
    sheet.write_text(line + "\n")
    with pytest.raises(SheetError, match=says.replace("?", r"\?").replace("(", r"\(")):
        read_sheet(sheet)
    assert cli.main(["warm", str(sheet)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvlab: error: ") and says in err and "\n" not in err


def test_a_missing_or_empty_sheet_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["warm", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read the sheet" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("# nothing\n")
    assert cli.main(["warm", str(tmp_path / "empty.txt")]) == 2
    assert "names no configuration" in capsys.readouterr().err


def test_the_bundled_workshop_sheet_reads():
    items = read_sheet(ROOT / "assets" / "workshop.txt")
    story = [i for i in items if i.example == "story"]
    assert len(story) == 18 and len({(i.method, i.ratio) for i in story}) == 18
    assert (items[0].method, items[0].ratio) == ("attention_matching", 10.0)
    # The long example's runs, read by its own model (issue #58: a class opens it at once).
    long = [i for i in items if i.example == "time_machine"]
    assert {i.method for i in long} >= {"attention_matching", "snapkv", "kvzip"}
    assert {i.model for i in long} == {"gemma3-270m"} and {i.model for i in story} == {None}


def test_a_long_examples_lines_warm_with_its_own_model_unless_the_line_names_one():
    """An example read by its own model (kvlab.examples.Example.model) is warmed with it, as the page
    opens it with it; the other examples with the sheet's default model."""
    items = parse_sheet(
        "snapkv 10 time_machine\n?tab=explore&example=time_machine&method=kvzip&ratio=5\nsnapkv 10 story\n",
        default_model="embedded",
    )
    assert [i.model for i in items] == ["gemma3-270m", "gemma3-270m", "embedded"]


PLAN_SHEET = ROOT / "assets" / "workshop-plan.txt"


def plan_links() -> list[str]:
    """The links of docs/workshop.md's 45-minute plan: its indented code lines that start with ``?tab=``."""
    text = (ROOT / "docs" / "workshop.md").read_text(encoding="utf-8")
    plan = text[text.index("## A 45-minute plan") : text.index("## The Space's settings")]
    return [line.strip() for line in plan.splitlines() if line.startswith("    ?tab=")]


def test_the_plans_four_links_are_on_its_sheet_and_open_the_page_configured():
    """Each link of the plan is a line of its sheet and opens its tab with what its query says set:
    Explore's method, knobs, ratio and question, or the Your pick tab's document, question and ratio."""
    import json
    from urllib.parse import parse_qsl

    from kvlab.lab import examples, links
    from kvlab.ui import page_links

    found = plan_links()
    assert len(found) == 4 and set(found) <= {line.strip() for line in PLAN_SHEET.read_text().splitlines()}
    pool = examples()
    choices = page_links.link_choices(pool, [EMBEDDED])
    for query in found:
        asked = dict(parse_qsl(query[1:]))
        link = links.parse_link(asked, choices)
        assert not link.notes, link.notes
        ex = next(e for e in pool if e.id == asked["example"])
        values = page_links.link_updates(link, ex, ex.text(), choices)
        got = dict(zip(["note", "tabs", "tab"], values[:3]))
        if asked["tab"] == "explore":  # the tab the page opens on: the load leaves the tabs alone
            assert got["tab"] == got["tabs"] == page_links.gr.update()
        else:
            assert got["tab"] == asked["tab"] and got["tabs"].selected == asked["tab"]
        if asked["tab"] == "pick":
            assert values[17:22] == (ex.id, ex.text(), values[5], asked["question"], float(asked["ratio"]))
            continue
        method, *pairs = asked["method"].split(":")
        assert values[7:9] == (method, float(asked["ratio"])) and values[6] == asked["question"]
        chosen = json.loads(values[22])  # the hidden box whose change sets the knob panel
        assert chosen["method"] == method
        assert {name: str(value) for name, value in chosen["knobs"].items()} == dict(p.split("=") for p in pairs)


def test_kvlab_warm_of_the_plans_sheet_stores_every_exercises_runs(tiny, tmp_path, monkeypatch):
    """On the tiny model standing in for the story: `kvlab warm` stores every configuration of the sheet,
    and afterwards a learner's pick at the pick exercise's ratio and question computes only the pick
    itself (its seven rivals come from the store)."""
    from kvlab.examples import Example
    from kvlab.lab import warm as warming

    picking = sys.modules["kvlab.lab.pick"]  # the module: kvlab.lab's ``pick`` is its function

    path = tmp_path / "story.txt"
    path.write_text(DOCS[120])
    pool = [Example("story", "Story", "story", path, (QUESTIONS,), ("w5",), (("w5",),))]
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    monkeypatch.setattr(warming, "examples", lambda: pool)
    items = read_sheet(PLAN_SHEET)
    assert cli.main(["warm", str(PLAN_SHEET)]) == 0
    assert all(results.store().get(warming.item_key(item)) is not MISSING for item in items)
    computed = []
    real = picking.explore
    monkeypatch.setattr(picking, "explore", lambda spec, *a: computed.append(spec.method) or real(spec, *a))
    exercise = next(item for item in items if item.method == "random")  # one of the pick link's rivals
    ranked = picking.pick(DOCS[120], None, "0-5", exercise.ratio, exercise.question)
    assert computed == ["manual"] and len(ranked.rows) == 1 + len(picking.DEFAULT_RIVALS)


def test_a_started_server_stores_the_pages_first_run_before_anyone_clicks(tiny, tmp_path, monkeypatch):
    """The page opens on its first example, question, method and ratio: the start-up preparation leaves
    that Run's result in the store, under the key the page's Run computes for those widgets' values."""
    from kvlab.examples import Example
    from kvlab.lab import warm as warming
    from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS
    from kvlab.ui import app, explore, serve

    path = tmp_path / "tiny.txt"
    path.write_text(DOCS[60])
    pool = [Example("tiny", "Tiny", "story", path, (QUESTIONS,), ("w5",), (("w5",),))]
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    monkeypatch.setattr(serve, "bundled_examples", lambda: pool)
    monkeypatch.setattr(warming, "examples", lambda: pool)
    page_run = run_spec(
        DOCS[60], None, app.default_method(), explore.RATIO_DEFAULT, QUESTIONS, DEFAULT_MAX_NEW_TOKENS, {}, None
    ).key()
    assert results.store().get(page_run) is MISSING
    serve.warm_first_example(None).join(timeout=300)
    assert results.store().get(page_run) is not MISSING


@pytest.mark.slow  # a program started per setting
@pytest.mark.parametrize(
    "env, says",
    [
        ({"KVLAB_QUEUE_SIZE": "abc"}, "KVLAB_QUEUE_SIZE='abc' is not a whole number"),
        ({"KVLAB_COMPUTE_ADMITTED": "0"}, "KVLAB_COMPUTE_ADMITTED='0': use a number >= 1"),
        ({"KVLAB_GPU_DURATION": "2m"}, "KVLAB_GPU_DURATION='2m' is not a whole number"),
    ],
)
def test_a_bad_setting_stops_the_program_with_one_line(env, says):
    done = subprocess.run(
        [sys.executable, "-c", "import kvlab.ui.common"],
        env={**_env(), **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and done.stderr.strip() == f"kvlab: error: {says}"


@pytest.mark.slow  # the app's program in a subprocess
def test_the_app_refuses_a_warm_sheet_that_is_not_there_in_one_line():
    done = subprocess.run(
        [sys.executable, "app.py"],
        env={**_env(), "KVLAB_WARM": "/nonexistent/sheet.txt"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    lines = [ln for ln in done.stderr.splitlines() if "kvlab: error" in ln]
    assert done.returncode == 2 and lines == [
        "kvlab: error: KVLAB_WARM='/nonexistent/sheet.txt' is not a readable file "
        "(a workshop sheet: see docs/workshop.md)"
    ]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("KVLAB_")} | {
        "KVLAB_STORE_DIR": os.environ["KVLAB_STORE_DIR"],
        "GRADIO_SERVER_PORT": "1",
    }


# --------------------------------------------------------------------------- the app, ten participants


gradio_client = pytest.importorskip("gradio_client")

#: Three documents the tiny model reads (its words are w0..w61), of different lengths: each run's summary
#: names its document's length, so an answer sent to the wrong page shows.
DOCS = {n: " ".join(f"w{2 + (i * 7 + n) % 60}" for i in range(n)) for n in (60, 90, 120)}
QUESTIONS = "w5 w9 w11"


@pytest.fixture(scope="module")
def workshop_app(tiny):
    from benchmarks.browser import serve_app
    from kvlab.ui import present

    calls = []
    real = present.explore

    def counted(*args, **kwargs):  # every computation of a run, however it was asked for
        calls.append(args[:5])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "get_model", lambda spec=None: tiny)
        mp.setattr(present, "explore", counted)
        with serve_app(tiny) as url:
            yield url, calls


def _configs() -> tuple[tuple[str, dict], list[tuple[str, dict]]]:
    """The handed-out link and six further configurations (three documents x two methods)."""

    def args(n: int, method: str) -> dict:
        return {"text": DOCS[n], "method": method, "ratio": 2, "question": QUESTIONS, "max_new_tokens": 3}

    return ("link", args(60, "streaming_llm")), [
        (f"{m} on {n}", args(n, m)) for n in DOCS for m in ("streaming_llm", "tova")
    ]


@pytest.mark.slow  # a served app
def test_ten_participants_each_get_their_own_answer_and_each_configuration_computes_once(workshop_app):
    from benchmarks.workshop import simulate
    from kvlab.ui import common

    url, calls = workshop_app
    link, further = _configs()
    grants, before = common.COMPUTE.grants, len(calls)
    done = simulate(url, 10, link, further, clicks=3, spread_s=1.0, think_s=(0.0, 0.3), seed=1, limit_s=240)
    assert len(done) == 40 and [c.error for c in done if c.error] == []
    for c in done:  # nobody got another's result: the method, the ratio and the document's length are theirs
        assert c.ran == {"method": c.asked["method"], "ratio": 2.0, "doc_tokens": _length(c.label, link)}, c
    asked = {(c.asked["method"], _length(c.label, link)) for c in done}  # the link is "streaming_llm on 60"
    computed = [c for c in done if c.served == "computed"]
    # One computation per configuration asked, however many asked at once; every other answer was
    # stored or shared, and only the computations took the compute slot.
    assert len(calls) - before == len(asked) == len(computed)
    assert common.COMPUTE.grants - grants == len(asked)
    assert {c.served for c in done} <= {"computed", "stored", "shared"}

    # A restart: a new store on the same folder, nothing in memory. Every configuration is still there.
    results._store = None
    each = [cfg for cfg in further if (cfg[1]["method"], _length(cfg[0], link)) in asked]
    assert {c.served for c in _ask_each(url, each)} == {"stored"}
    assert len(calls) - before == len(asked) and common.COMPUTE.grants - grants == len(asked)

    # A damaged entry is never shown: it is computed again, to the same answer.
    (oldest, *_) = results.store().entries()
    oldest[2].write_bytes(oldest[2].read_bytes()[:-10])
    results._store = None
    redo = _ask_each(url, each)
    assert [c.served for c in redo].count("computed") == 1 and len(calls) - before == len(asked) + 1
    assert [c.ran for c in redo] == [c.ran for c in _ask_each(url, each)]


def _ask_each(url: str, configs: list[tuple[str, dict]]) -> list:
    """Every configuration once, in turn, from one page."""
    from gradio_client import Client

    from benchmarks.workshop import click

    client = Client(url, verbose=False)
    return [click(client, 0, "further", label, args) for label, args in configs]


def _length(label: str, link: tuple[str, dict]) -> int:
    return 60 if label == link[0] else int(label.rsplit(" ", 1)[1])


@pytest.mark.slow  # a served app
def test_a_stored_answer_is_served_while_the_slot_is_held_and_others_wait(workshop_app):
    from gradio_client import Client

    from kvlab.ui import common

    url, calls = workshop_app
    (_, stored_args), further = _configs()
    client = Client(url, verbose=False)
    client.predict(api_name="/run", **stored_args)  # computed (or stored already): kept now
    holder, go = _held(common.COMPUTE)
    waiting = []
    try:
        # More pages than Gradio used to admit at once wait for the slot with new configurations...
        for i in range(10):
            args = {**further[i % len(further)][1], "question": f"w{20 + i} w3"}
            job = Client(url, verbose=False).submit(api_name="/run", **args)
            waiting.append(job)
        deadline = time.monotonic() + 60
        while common.COMPUTE.waiting < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert common.COMPUTE.waiting == 10
        # ...and a stored configuration is answered all the same, without the slot.
        grants = common.COMPUTE.grants
        out = Client(url, verbose=False).predict(api_name="/run", **stored_args)
        assert "Served from the result store" in out[0] and common.COMPUTE.grants == grants
    finally:
        go.set()
        holder.join(30)
    for job in waiting:
        assert "Served from the result store" not in job.result(timeout=120)[0]


def test_a_served_figure_is_what_gradio_sends_for_the_plotly_figure():
    import gradio as gr

    from kvlab import figures
    from kvlab.ui.present import as_plot

    fig = figures.memory_figure(1000, 250, {"keys": 125, "values": 125})
    # gr.Plot's own postprocess of the figure, and of the figure serialised once in advance: the same.
    assert gr.Plot().postprocess(as_plot(fig.to_json())) == gr.Plot().postprocess(fig)


def test_a_stored_run_carries_its_figures_as_gradio_would_send_them(tiny, monkeypatch):
    """A run's figures are made with it and kept in the store: what a page is sent for a stored run is
    what gr.Plot sends for the figures built afresh from the run's numbers (kvlab.lab.views.run_figures),
    the heads' roles map included, and serving it builds no figure."""
    import pickle

    import gradio as gr

    from kvlab import figures, lab
    from kvlab.lab.views import present, run_figures
    from kvlab.ui import present as ui_present

    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    ex = lab.explore(lab.run_spec(DOCS[60], None, "attention_matching", 2, QUESTIONS, max_new_tokens=2))
    view = pickle.loads(pickle.dumps(present(ex)))  # what the result store keeps
    fresh = run_figures(view)
    roles = figures.roles_heatmap(view.roles.shares, view.roles.labels, view.roles.settings)
    built = []
    monkeypatch.setattr(figures, "error_heatmap", lambda *a, **k: built.append(a))  # serving builds nothing
    served = ui_present.drawn(view)
    sent = gr.Plot().postprocess
    assert [sent(f) for f in served.figures] == [sent(f) for f in fresh.main]
    assert [sent(f) for f in served.fit] == [sent(f) for f in fresh.fit]  # Attention Matching's fit figures
    assert sent(served.divergence) == sent(fresh.divergence) and sent(served.roles) == sent(roles)
    assert built == []


def test_a_token_view_is_made_once_per_configuration_layer_head_and_intensity(monkeypatch):
    from kvlab.ui import present

    made = []
    monkeypatch.setattr(
        present,
        "token_view",
        lambda view, layer, head, intensity: (
            made.append((view, layer, head, intensity)) or (f"line {layer}/{head}", f"html of {view}")
        ),
    )
    for _ in range(3):
        assert present.token_view_for("config A", "fates A", 2, 1, "score") == ("line 2/1", "html of fates A")
    assert present.token_view_for("config A", "fates A", 3, 1, "score") == ("line 3/1", "html of fates A")
    assert present.token_view_for("config B", "fates B", 2, 1, "score") == ("line 2/1", "html of fates B")
    assert made == [("fates A", 2, 1, "score"), ("fates A", 3, 1, "score"), ("fates B", 2, 1, "score")]


@pytest.mark.slow  # a served app
def test_a_run_comes_in_one_message_and_a_stored_one_with_the_same_page(workshop_app):
    from gradio_client import Client

    url, _ = workshop_app
    (_, args), _ = _configs()
    args = {**args, "question": "w31 w4"}  # a configuration no other test asks for

    def page() -> list:
        job = Client(url, verbose=False).submit(api_name="/run", **args)
        job.result(timeout=120)
        return job.outputs()

    first, again = page(), page()
    # Each page gets everything at once (the figures were made with the run); a later page of the same
    # configuration, served from the store, the same figures and token view.
    assert len(first) == 1 and len(again) == 1
    assert "Served from the result store" in again[0][0] and "Served from" not in first[0][0]
    assert again[0][1:] == first[0][1:]
