"""No request can stall the lab: bounded work (kvlab.cancellation), the fair compute slot, and every entry point's
inputs checked before work (a hypothesis property over each one).

The app-level checks (a request past the time limit, Stop, a client that disconnects, a sweep sharing the
slot with another client's run) drive a served app through gradio_client: tests/test_bounded_app.py.
"""

from __future__ import annotations

import contextlib
import io
import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvlab import cancellation, lab, limits, models, scheduler  # noqa: E402
from kvlab.context import prepare_context  # noqa: E402
from kvlab.context_store import ContextStore  # noqa: E402
from kvlab.documents import DocumentError  # noqa: E402
from kvlab.memo import MISSING, compute_once  # noqa: E402
from kvlab.methods import MethodError  # noqa: E402
from kvlab.runtime.model import ModelLoadError  # noqa: E402

pytestmark = pytest.mark.slow  # hypothesis drives every lab entry point on many inputs: left out of make test-fast

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(120))
#: What an entry point may raise on bad input: the lab's error types, whose messages are shown as they are.
LAB_ERRORS = (lab.InputError, DocumentError, MethodError, ModelLoadError)


def stop_after(n_checkpoints: int, why: str = cancellation.TIME):
    """A scope's ``stopped`` that gives ``why`` from the n-th checkpoint on (a count, not a clock)."""
    calls = [0]

    def stopped() -> str | None:
        calls[0] += 1
        return why if calls[0] >= n_checkpoints else None

    return stopped


# --------------------------------------------------------------------------- checkpoints and scopes


def test_outside_a_request_checkpoints_do_nothing():
    for _ in range(3):
        cancellation.checkpoint("anything")
        cancellation.between_units("a unit")
    assert cancellation.current() is None


def test_a_request_past_its_time_limit_stops_at_its_next_step_naming_the_limit_and_the_step():
    with cancellation.scope(limit_s=0.0) as s, pytest.raises(cancellation.Cancelled) as caught:
        cancellation.checkpoint("prefill, 2,048/8,000 tokens")
    assert caught.value.reason == cancellation.TIME and s.steps == 1
    assert "time limit of 0 s per request (KVLAB_MAX_REQUEST_S) during: prefill, 2,048/8,000 tokens" in str(
        caught.value
    )
    assert cancellation.current() is None  # the scope ends with the block


@contextlib.contextmanager
def slot_held_elsewhere():
    """(a slot held by another thread, the event that makes it let go); let go and joined at the end."""
    slot, held, go = scheduler.Slot(), threading.Event(), threading.Event()

    def holder() -> None:
        with slot.hold():
            held.set()
            go.wait(60)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(60)
    try:
        yield slot, go
    finally:
        go.set()
        t.join()


def when_queued(slot: scheduler.Slot, then) -> threading.Thread:
    """A thread that calls ``then()`` once someone waits for ``slot``."""

    def watch() -> None:
        while slot.waiting == 0:
            threading.Event().wait(0.01)
        then()

    t = threading.Thread(target=watch)
    t.start()
    return t


def test_stop_and_disconnect_are_named_and_time_waiting_for_the_slot_is_not_work():
    for why, words in ((cancellation.STOPPED, "Stop was pressed"), (cancellation.GONE, "disconnected")):
        with cancellation.scope(stopped=stop_after(2, why)), pytest.raises(cancellation.Cancelled, match=words):
            cancellation.checkpoint()
            cancellation.checkpoint()
    with slot_held_elsewhere() as (slot, go), cancellation.scope(limit_s=3600) as s:
        watcher = when_queued(slot, go.set)
        waited = slot.acquire()
        slot.release()
        watcher.join()
        # The scope's clock left the wait out: all of it but the checks between the looks.
        assert waited > 0 and 0.5 * waited < s.waited_s <= waited


def test_a_wait_longer_than_the_time_limit_is_not_stopped_by_it(monkeypatch):
    # Waiting (for the slot, another request's computation, a preparation) is not work: a request with a
    # 0.2 s limit waits 0.5 s for the slot, looking at its stop flag every 0.05 s, and is not stopped;
    # its work after the wait is still bounded.
    monkeypatch.setattr(cancellation, "POLL_S", 0.05)
    with slot_held_elsewhere() as (slot, go), cancellation.scope(limit_s=0.2):
        release = threading.Timer(0.5, go.set)
        release.start()
        slot.acquire()
        slot.release()
        release.join()
        cancellation.checkpoint()  # not stopped: 0.5 s waited, next to no work
        threading.Event().wait(0.3)
        with pytest.raises(cancellation.Cancelled, match="time limit"):
            cancellation.checkpoint()


def test_the_slot_is_granted_in_arrival_order_and_a_handover_lets_waiters_go_first():
    slot, order = scheduler.Slot(), []
    go = threading.Event()

    def job(name: str, units: int) -> None:
        with cancellation.scope(handover=slot.handover), slot.hold():
            for unit in range(units):
                order.append(f"{name}{unit}")
                if name == "sweep" and unit == 0:
                    go.wait(60)  # the two single runs queue behind the sweep's first unit
                cancellation.between_units()

    sweep = threading.Thread(target=job, args=("sweep", 3))
    sweep.start()
    while not order:
        threading.Event().wait(0.01)
    singles = []
    for name in ("a", "b"):
        singles.append(threading.Thread(target=job, args=(name, 1)))
        singles[-1].start()
        while slot.waiting < len(singles):  # each has joined the queue before the next starts
            threading.Event().wait(0.01)
    go.set()
    for t in [sweep, *singles]:
        t.join(60)
    # Both single runs ran at the sweep's first unit boundary, in the order they came; then the sweep went on.
    assert order == ["sweep0", "a0", "b0", "sweep1", "sweep2"]


def test_a_request_stopped_while_it_waits_for_the_slot_leaves_the_queue():
    with slot_held_elsewhere() as (slot, _):
        with cancellation.scope(stopped=stop_after(3, cancellation.GONE)), pytest.raises(cancellation.Cancelled):
            slot.acquire()
        assert slot.waiting == 0
    with slot.hold():  # and the slot is free for the next one
        assert slot.busy


# --------------------------------------------------------------------------- shared caches stay consistent


def test_a_stopped_leader_resolves_its_future_keeps_nothing_and_its_waiter_computes_the_value(flight_waiters):
    lock, flights, kept, made, results = threading.Lock(), {}, {}, [], []
    find = lambda: kept.get("k", MISSING)  # noqa: E731
    keep = lambda value: kept.__setitem__("k", value)  # noqa: E731
    leading = threading.Event()

    def make_then_stop():
        leading.set()
        assert flight_waiters.wait_for(1)  # another request waits on this computation
        with cancellation.scope(stopped=stop_after(1, cancellation.STOPPED)):
            cancellation.checkpoint("half way")  # the leader's own request stops here, mid-computation

    def leader() -> None:
        try:
            compute_once(lock, flights, "k", find, make_then_stop, keep)
        except cancellation.Cancelled as exc:
            results.append(("leader", exc.reason))

    def waiter() -> None:
        leading.wait(60)
        results.append(("waiter", compute_once(lock, flights, "k", find, lambda: made.append(1) or 42, keep)))

    threads = [threading.Thread(target=leader), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # The leader's stop reached the leader only; the waiter made the value itself, once, and it was kept.
    assert sorted(results) == [("leader", cancellation.STOPPED), ("waiter", 42)]
    assert made == [1] and kept == {"k": 42} and flights == {}


def test_a_run_stopped_mid_prefill_keeps_no_context_and_the_next_run_prepares_it(tiny):
    store = ContextStore(budget=1 << 30)
    with (
        cancellation.scope(stopped=stop_after(1, cancellation.GONE)),
        pytest.raises(cancellation.Cancelled, match="prefill"),
    ):
        store.get(tiny, DOC)
    assert store.peek(tiny, DOC) is None and not store._flights
    assert store.get(tiny, DOC).length == prepare_context(tiny, DOC).length


def test_a_sweep_past_its_time_limit_returns_the_runs_done_and_names_those_not_run(tiny, monkeypatch):
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    full = lab.compare(DOC, None, ["streaming_llm"], [2, 4, 8], "w2 w3", max_new_tokens=3)
    units = []
    with cancellation.scope(
        stopped=lambda: cancellation.TIME if len(units) >= 2 else None, handover=lambda: units.append(1)
    ):
        cut = lab.compare(DOC, None, ["streaming_llm"], [2, 4, 8], "w2 w3", max_new_tokens=3)
    # Two runs, each as the uncut sweep's (an independent sweep on the same inputs); the third named as not run.
    assert [r.ratio for r in cut.results] == [2, 4]
    assert [r.answer_compressed for r in cut.results] == [r.answer_compressed for r in full.results[:2]]
    assert "2 of 3 runs done; not run: streaming_llm at 8x" in cut.stopped and not full.stopped


def test_a_stopped_sweep_with_nothing_done_says_so_and_stop_never_returns_partial_results(tiny, monkeypatch):
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    fresh = " ".join(f"w{(i * 11) % 60 + 2}" for i in range(90))  # nothing of it computed yet
    with (
        cancellation.scope(stopped=stop_after(1, cancellation.TIME)),
        pytest.raises(cancellation.Cancelled, match="time limit"),
    ):
        lab.compare(fresh, None, ["streaming_llm"], [2, 4], "w2 w3", max_new_tokens=3)
    units = []
    with cancellation.scope(stopped=lambda: cancellation.STOPPED if units else None, handover=lambda: units.append(1)):
        with pytest.raises(cancellation.Cancelled, match="Stop was pressed"):
            lab.compare(fresh, None, ["streaming_llm"], [2, 4], "w2 w3", max_new_tokens=3)


# --------------------------------------------------------------------------- every entry point's inputs


def small_limits(monkeypatch) -> None:
    """Limits small enough that hypothesis reaches both sides of each often."""
    monkeypatch.setattr(
        limits,
        "LIMITS",
        limits.Limits(
            **{
                **vars(limits.LIMITS),
                "document_chars": 3000,
                "question_chars": 60,
                "question_tokens": 6,
                "new_tokens": 6,
                "generate_tokens": 24,
                "sweep_points": 4,
            }
        ),
    )


def tiny_words(low: int, high: int) -> st.SearchStrategy[str]:
    """Text of ``low``..``high`` of the tiny model's words (one token each)."""
    return st.lists(st.integers(2, 61), min_size=low, max_size=high).map(lambda ids: " ".join(f"w{i}" for i in ids))


#: Bad values of every kind: missing, blank, garbage text, huge, out of range, not numbers, NaN.
junk = st.one_of(
    st.none(),
    st.just(""),
    st.just("   "),
    st.text(max_size=12),
    st.just("x" * 3001),
    st.integers(-3, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(2.5),
)
FAST = ["streaming_llm", "snapkv", "tova", "no_context", "kivi"]
good = {
    "text": tiny_words(20, 150),
    "question": tiny_words(1, 4),
    "method": st.sampled_from(FAST),
    "methods": st.lists(st.sampled_from(FAST), min_size=1, max_size=2, unique=True),
    "ratio": st.one_of(st.integers(1, 50), st.floats(1, 50), st.just("4")),
    "ratios": st.lists(st.integers(1, 50), min_size=1, max_size=2, unique=True),
    "max_new": st.integers(1, 6),
    "options": st.none(),
}
bad = {
    **{name: junk for name in ("text", "question", "method", "ratio", "max_new")},
    "text": st.one_of(junk, tiny_words(300, 700)),  # past the tiny model's window, too
    "question": st.one_of(junk, tiny_words(7, 30)),  # past the question's token limit
    "methods": st.one_of(st.just([]), st.lists(junk.map(str), min_size=1, max_size=2), st.just(FAST)),
    "ratios": st.one_of(st.just([]), st.lists(junk, min_size=1, max_size=2), st.just([2, 3, 4, 5, 6])),
    "options": st.dictionaries(st.sampled_from(["n_sink", "window", "nope"]), junk, min_size=1, max_size=2),
}
CHECKED = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def drawn(data: st.DataObject, names: list[str], valid: dict | None = None, invalid: dict | None = None) -> dict:
    """Valid values of ``names``, then at most one of them replaced by a bad one (so both outcomes are common)."""
    valid, invalid = {**good, **(valid or {})}, {**bad, **(invalid or {})}
    values = {name: data.draw(valid[name], label=name) for name in names}
    broken = data.draw(st.sampled_from([None, *names]), label="broken")
    if broken is not None:
        values[broken] = data.draw(invalid[broken], label=f"bad {broken}")
    return values


def answers_or_refuses(call) -> object:
    """``call()``'s result, or None when it raised one of the lab's errors with a one-line message.

    Bounded: a generous time limit around it turns an unbounded run into a failure.
    """
    with cancellation.scope(limit_s=60):
        try:
            got = call()
        except cancellation.Cancelled as exc:
            pytest.fail(f"an input was accepted that ran without bound: {exc}")
        except LAB_ERRORS as exc:
            message = str(exc)
            assert message and "\n" not in message and "Traceback" not in message, message
            hypothesis.event(f"refused: {type(exc).__name__}")
            return None
    hypothesis.event("answered")
    return got


@pytest.fixture
def lab_on_tiny(tiny, monkeypatch):
    small_limits(monkeypatch)
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    return tiny


@CHECKED
@given(data=st.data())
def test_explore_answers_or_refuses_any_input(lab_on_tiny, data):
    v = drawn(data, ["text", "method", "ratio", "question", "max_new", "options"])
    got = answers_or_refuses(
        lambda: lab.explore(
            lab.run_spec(v["text"], None, v["method"], v["ratio"], v["question"], v["max_new"], v["options"])
        )
    )
    assert got is None or got.run.result.ratio == float(v["ratio"])


@CHECKED
@given(data=st.data())
def test_compare_answers_or_refuses_any_input(lab_on_tiny, data):
    v = drawn(data, ["text", "methods", "ratios", "question", "max_new"])
    got = answers_or_refuses(
        lambda: lab.compare(v["text"], None, v["methods"], v["ratios"], v["question"], v["max_new"])
    )
    assert got is None or len(got.results) + len(got.errors) == len(v["methods"]) * len(v["ratios"])


@CHECKED
@given(data=st.data())
def test_tasks_answer_or_refuse_any_input(lab_on_tiny, data):
    v = drawn(
        data,
        ["task", "n", "length", "methods", "ratios"],
        valid={"task": st.just("needle_grid"), "n": st.integers(1, 2), "length": st.integers(100, 200)},
        invalid={
            "task": st.one_of(junk.map(str), st.just("quality")),
            "n": st.one_of(junk, st.just(21)),
            "length": st.one_of(junk, st.just(99), st.just(4001)),
        },
    )
    got = answers_or_refuses(lambda: lab.run_tasks(v["task"], v["n"], v["methods"], v["ratios"], v["length"]))
    assert got is None or got.results


@CHECKED
@given(data=st.data())
def test_the_needle_test_answers_or_refuses_any_input(lab_on_tiny, data):
    v = drawn(
        data,
        ["text", "methods", "ratios", "depths"],
        valid={"depths": st.integers(1, 2)},
        invalid={"depths": st.one_of(junk, st.just(10))},
    )
    got = answers_or_refuses(lambda: lab.needle_test(v["text"], None, v["methods"], v["ratios"], v["depths"]))
    assert got is None or got.results


@CHECKED
@given(data=st.data())
def test_generate_answers_or_refuses_any_input(lab_on_tiny, data):
    gen_methods = st.lists(st.sampled_from(["h2o", "beaconkv", "online_am"]), min_size=1, max_size=2, unique=True)
    v = drawn(
        data,
        ["prompt", "gen_methods", "budget", "max_new"],
        valid={
            "prompt": tiny_words(5, 60),
            "gen_methods": gen_methods,
            "budget": st.one_of(st.none(), st.integers(40, 80)),
            "max_new": st.integers(1, 24),
        },
        invalid={
            "prompt": st.one_of(junk.filter(lambda x: x is None or isinstance(x, str)), tiny_words(490, 600)),
            "gen_methods": st.one_of(st.just([]), st.lists(st.text(max_size=6), min_size=1, max_size=2)),
            "budget": st.one_of(junk, st.integers(-2, 8)),
            "max_new": st.one_of(junk, st.just(25)),
        },
    )
    # No prompt: the document path (the tiny words' document and question) in place of the prompt.
    document, question = data.draw(tiny_words(20, 100), label="document"), data.draw(tiny_words(1, 4), label="question")
    got = answers_or_refuses(
        lambda: lab.generate(v["prompt"], document, None, question, v["gen_methods"], v["budget"], v["max_new"])
    )
    assert got is None or len(got.runs) == len(v["gen_methods"])


@CHECKED
@given(data=st.data())
def test_the_cli_answers_or_refuses_any_input_in_one_line(lab_on_tiny, tmp_path_factory, data):
    from kvlab.cli import main

    v = drawn(data, ["text", "method", "ratio", "question", "max_new"])
    doc = tmp_path_factory.mktemp("doc") / "doc.txt"
    doc.write_text(v["text"] if isinstance(v["text"], str) else "", encoding="utf-8")
    argv = [
        "run",
        "--doc",
        str(doc),
        "--method",
        str(v["method"]),
        "--ratio",
        str(v["ratio"]),
        "--question",
        str(v["question"]),
        "--max-new-tokens",
        str(v["max_new"]),
        "--json",
    ]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), cancellation.scope(limit_s=60):
        code = main(argv)
    hypothesis.event(f"exit {code}")
    if code == 0:
        assert out.getvalue().startswith("{")
    else:
        line = err.getvalue().strip()
        assert code == 2 and line.startswith("kvlab: error:") and "\n" not in line, (code, err.getvalue())
