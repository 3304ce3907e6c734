"""A document prepared in the background (kvlab.lab.background): joined not repeated, waited for without
counting against the waiter's time limit, bounded on its own, stopped once nobody waits, with progress.

The tiny random model; each step of a job's work is slowed on purpose (the checkpoint a job's work passes
at every prefill chunk, reference-pass chunk and decode step sleeps ``DELAY_S`` in the job's thread),
so that a job lasts long enough to be joined or stopped; the checks are counts of prefills and the
reasons things stopped, never a race against a clock.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvlab import cancellation, limits, models
from kvlab import context as context_module
from kvlab.context_store import CONTEXTS
from kvlab.documents import DocumentError
from kvlab.lab import background
from kvlab.lab.background import PREPARATIONS, PreparationStatus, duration, ensure_prepared, time_left
from kvlab.lab.inputs import document_text
from kvlab.methods import get_method
from kvlab.methods.attention_matching import AttentionMatching
from kvlab.pipeline import compressed
from kvlab.runtime import decode as decode_module

DOC = " ".join(f"w{(i * 5) % 50 + 3}" for i in range(150))
QUESTION = "w5 w9"
DELAY_S = 0.3
#: A Run's inputs through the served app's /run, but for its document.
RUN = dict(method="attention_matching", ratio=4, question=QUESTION, max_new_tokens=6, model="tiny")


class Slowed(list):
    """The documents prefilled, in order (``threads``: each one's thread); ``delay_s``: each step's sleep in a
    preparation's thread."""

    delay_s = DELAY_S

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[str, str] = {}


@pytest.fixture
def slowed(tiny, monkeypatch):
    """The tiny model for every spec; each checkpoint in a preparation's thread (prefill and reference-pass
    chunks, decode steps) sleeps ``delay_s``; the prefills counted; a waiter looks at its job every 20 ms."""
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    monkeypatch.setattr(cancellation, "POLL_S", 0.02)
    real = cancellation.checkpoint
    prefills = Slowed()

    def slow(step=None):
        if threading.current_thread().name == "kvlab-prepare":
            time.sleep(prefills.delay_s)
        real(step)

    monkeypatch.setattr(cancellation, "checkpoint", slow)
    monkeypatch.setattr(decode_module, "checkpoint", slow)
    real_prepare = context_module.prepare_context

    def counted(lm, text, progress=context_module.no_progress):
        prefills.append(text)
        prefills.threads[text] = threading.current_thread().name
        return real_prepare(lm, text, progress)

    monkeypatch.setattr(context_module, "prepare_context", counted)
    monkeypatch.setattr("kvlab.context_store.prepare_context", counted)
    yield prefills
    deadline = time.monotonic() + 30
    while PREPARATIONS._jobs and time.monotonic() < deadline:  # no job of this test left for the next
        time.sleep(0.05)
    assert not PREPARATIONS._jobs


def doc(tag: str) -> str:
    """A document no other test prepares (the context store is shared by the whole process)."""
    return f"{DOC} {tag} {tag}"


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    return t, out


def test_time_left_and_durations_by_hand():
    assert time_left(0.25, 10.0) == pytest.approx(30.0)  # a quarter in 10 s: three quarters in 30 s more
    assert time_left(1.0, 10.0) == 0.0
    assert time_left(0.01, 10.0) is None  # too little done to tell
    assert time_left(0.6, 20.0, since=0.5) == pytest.approx(80.0)  # a tenth in 20 s: four tenths in 80 s more
    assert time_left(0.5, 20.0, since=0.5) is None  # no progress measured
    assert duration(42.4) == "42 s" and duration(185) == "3 min 05 s"
    line = PreparationStatus(0.5, "repeat pass, 10/20 tokens", 65.0, 64.6).line()
    assert "repeat pass, 10/20 tokens" in line and "1 min 05 s so far" in line and "about 1 min 05 s left" in line
    assert "Waiting for another document" in PreparationStatus(0.0, "", 3.0, None, waiting=True).line()


def test_the_time_left_is_read_from_the_last_minutes_rate(monkeypatch):
    # Steps found done jump to half way at once (a method prepared by an earlier request), then the long step
    # moves 0.05 per 100 s: the rate is that step's, not the jump's (by hand: 0.45 left at 0.05 per 100 s is
    # 900 s; read from the start, 100 s for 0.55, it would be 82 s). Then it speeds up to 0.1 per 100 s: the
    # last minute's rate (0.35 left: 350 s; from the jump on, 0.15 in 200 s, it would be 467 s).
    clock = [0.0]
    monkeypatch.setattr(background.time, "monotonic", lambda: clock[0])
    job = background.Job("a document", None, lambda job: None, threading.Lock())
    job._waiting = False
    for t, fraction in [(0.1, 0.3), (0.2, 0.5), (100.2, 0.55)]:
        clock[0] = t
        job._progress(fraction, "a long step")
    assert job.status().left_s == pytest.approx(900.0)
    clock[0] = 200.2
    job._progress(0.65, "a long step")
    assert job.status().left_s == pytest.approx(350.0)
    clock[0] = 250.2  # counted down between reports
    assert job.status().left_s == pytest.approx(300.0)
    clock[0] = 1000.3  # run out with the work going on: no estimate until the next report
    assert job.status().left_s is None and "left" not in job.status().line()


def test_two_requests_for_one_document_share_one_prefill_and_see_its_progress(slowed):
    text = doc("shared")
    seen: list[PreparationStatus] = []
    first, out1 = in_thread(ensure_prepared, text, "attention_matching", None, "tiny", QUESTION, 6, seen.append)
    while PREPARATIONS.running(text, "tiny") is None and "value" not in out1:
        time.sleep(0.01)
    second, out2 = in_thread(ensure_prepared, text, "attention_matching", None, "tiny", QUESTION, 6)
    first.join(60)
    second.join(60)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    assert slowed.count(text) == 1  # one prefill for both
    assert out1["value"].prefilled_now and out2["value"] is out1["value"]  # the second hears what the job did
    steps = " | ".join(s.step for s in seen)
    assert "prefill" in steps and "repeat pass" in steps, steps  # the reference pass's chunks are reported too
    fractions = [s.fraction for s in seen if not s.waiting]
    assert fractions == sorted(fractions) and fractions[-1] <= 1.0
    assert PREPARATIONS.running(text, "tiny") is None  # the job closed once its wants were served


def test_waiting_for_a_preparation_is_not_the_waiters_work(slowed):
    # A request with a 1 s limit waits for a preparation longer than that, and is answered: the wait is not
    # its work (the job itself is bounded by KVLAB_MAX_PREPARE_S).
    text = doc("patient")
    start = time.monotonic()
    with cancellation.scope(1.0) as scope:
        prepared = ensure_prepared(text, "attention_matching", None, "tiny", QUESTION, 6)
        assert scope.reason() is None
    assert time.monotonic() - start > 1.0 and prepared.prefilled_now


def test_a_preparation_nobody_waits_for_stops(slowed, monkeypatch):
    monkeypatch.setattr(background, "GRACE_S", 0.3)
    text = doc("abandoned")
    job = closed_page(text)
    deadline = time.monotonic() + 30
    while PREPARATIONS.running(text, "tiny") is job and time.monotonic() < deadline:
        time.sleep(0.05)
    assert PREPARATIONS.running(text, "tiny") is None
    assert isinstance(job.error, cancellation.Cancelled) and job.error.reason == cancellation.UNWATCHED


def closed_page(text: str) -> background.Job:
    """A page's request waits for ``text``'s preparation, then its page is closed (its wait ends at its next
    look, stopped as GONE); returns the job it waited for."""
    gone = threading.Event()

    def wait_until_gone():
        with cancellation.scope(None, lambda: cancellation.GONE if gone.is_set() else None):
            return ensure_prepared(text, "attention_matching", None, "tiny", QUESTION, 6)

    waiter, out = in_thread(wait_until_gone)
    while PREPARATIONS.running(text, "tiny") is None:
        time.sleep(0.01)
    job = PREPARATIONS.running(text, "tiny")
    gone.set()
    waiter.join(30)
    assert isinstance(out.get("error"), cancellation.Cancelled) and out["error"].reason == cancellation.GONE
    return job


def test_a_reload_within_the_grace_joins_the_running_preparation(slowed, monkeypatch):
    monkeypatch.setattr(background, "GRACE_S", 30.0)
    text = doc("reloaded")
    job = closed_page(text)
    again = ensure_prepared(text, "attention_matching", None, "tiny", QUESTION, 6)  # the reloaded page
    assert slowed.count(text) == 1 and job.scope.reason() is None  # not started again
    assert again.doc_tokens > 100


def test_a_preparation_past_its_own_bound_stops_and_says_which_limit(slowed, monkeypatch):
    slowed.delay_s = 0.6  # the prefill's and the repeat pass's steps alone pass the 1 s bound
    monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), "prepare_s": 1}))
    with pytest.raises(cancellation.Cancelled, match="KVLAB_MAX_PREPARE_S") as info:
        ensure_prepared(doc("bounded"), "attention_matching", None, "tiny", QUESTION, 32)
    assert info.value.reason == cancellation.PREPARE_TIME


def test_a_second_document_waits_its_turn(slowed):
    first_text, second_text = doc("first"), doc("second")
    seen: list[PreparationStatus] = []
    first, out1 = in_thread(ensure_prepared, first_text, "attention_matching", None, "tiny", QUESTION, 6)
    while (job := PREPARATIONS.running(first_text, "tiny")) is None or job.status().waiting:
        time.sleep(0.01)  # the first job has its turn
    second = ensure_prepared(second_text, "snapkv", None, "tiny", QUESTION, 6, seen.append)
    first.join(60)
    assert "value" in out1 and second.prefilled_now
    assert seen[0].waiting  # told it waits for the other document, not shown a stalled progress bar


@pytest.fixture
def compressions(monkeypatch) -> list[str]:
    """The thread of each Attention Matching compression, in order."""
    threads: list[str] = []
    real = AttentionMatching.compress

    def compress(self, req):
        threads.append(threading.current_thread().name)
        return real(self, req)

    monkeypatch.setattr(AttentionMatching, "compress", compress)
    return threads


def test_a_long_compression_is_made_by_the_job_and_the_run_finds_it(slowed, tiny, compressions):
    # An on-policy fit reads the reference text through the model (long work on a long document): with the
    # run's ratio, the job compresses too, in its own thread, and keeps the cache where the run looks for it.
    # An off-policy fit on prepared queries, or a selection, is the run's to make.
    text = doc("compressed")
    seen: list[PreparationStatus] = []
    prepared = ensure_prepared(text, "attention_matching", {"on_policy": True}, "tiny", QUESTION, 6, seen.append, 4)
    assert compressions == ["kvlab-prepare"] and prepared.compress_s is not None
    # Each layer's fit is reported as it starts, with the share done before it: rising, and short of the end.
    layers = [
        next(s.fraction for s in seen if s.step.endswith(f"on-policy: layer {layer + 1}"))
        for layer in range(tiny.n_layers)
    ]
    assert layers == sorted(set(layers)) and layers[-1] < 1.0, [(s.step, s.fraction) for s in seen]
    ctx = CONTEXTS.peek(tiny, document_text(text, None))
    on_policy = get_method("attention_matching", on_policy=True)
    _, reused = compressed(ctx, on_policy, 4, QUESTION, lambda f, d: None, record_importance=True)
    assert reused and compressions == ["kvlab-prepare"]  # not compressed again
    assert ensure_prepared(text, "attention_matching", None, "tiny", QUESTION, 6, ratio=4).compress_s is None
    assert ensure_prepared(text, "snapkv", None, "tiny", QUESTION, 6, ratio=4).compress_s is None
    assert compressions == ["kvlab-prepare"]


def test_a_document_too_long_is_refused_and_the_job_ends(slowed, tiny):
    too_long = " ".join(f"w{i % 50 + 3}" for i in range(tiny.max_context + 10))
    with pytest.raises(DocumentError, match="shorten it"):
        ensure_prepared(too_long, "snapkv", None, "tiny")
    assert PREPARATIONS.running(too_long, "tiny") is None


@pytest.mark.slow  # a served app: left out of make test-fast
def test_the_page_prepares_in_the_background_a_reload_joins_it_and_run_waits_for_it(slowed, tiny, monkeypatch):
    # Through the API the page uses: /prepare starts the preparation, the page is reloaded while it runs
    # (its request cancelled, as a closed page's is), the reloaded page's /prepare joins the same job (one
    # prefill), and a Run of Attention Matching clicked at once waits for it and answers; every wait shows
    # the job's progress, and no request is cut off at its time limit (here 1 s, shorter than the job).
    gradio_client = pytest.importorskip("gradio_client")
    from benchmarks.browser import serve_app
    from conftest import cancel_when_known

    monkeypatch.setattr(background, "GRACE_S", 60.0)
    monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), "request_s": 1}))
    text = doc("served")
    prepare = dict(text=text, method="attention_matching", model="tiny", question=QUESTION, max_new_tokens=6)
    with serve_app(tiny, [("tiny", "tiny")]) as url:
        first = gradio_client.Client(url, verbose=False)
        job = first.submit(api_name="/prepare", **prepare)
        while PREPARATIONS.running(text, "tiny") is None:
            time.sleep(0.01)
        running = PREPARATIONS.running(text, "tiny")
        cancel_when_known(job)  # the page reloaded
        reloaded = gradio_client.Client(url, verbose=False)
        waiting = reloaded.submit(api_name="/prepare", **prepare)
        run = reloaded.submit(text=text, **RUN, api_name="/run")
        shown: set[str] = set()  # the progress lines both waits showed
        while not (waiting.done() and run.done()):
            for j in (waiting, run):
                shown.update(p.desc or "" for p in j.status().progress_data or [])
            time.sleep(0.02)
        status, out = waiting.result(), run.result()
    assert status.startswith("Ready:"), status
    assert slowed.count(text) == 1 and running.error is None  # the reload joined the job; nothing restarted it
    assert "attention_matching" in out[0] and "Prefill" in out[0]
    assert any("Preparing the document in the background" in line for line in shown), shown


@pytest.mark.slow  # a served app: left out of make test-fast
def test_the_needle_test_and_your_pick_prepare_their_documents_in_the_background(slowed, tiny, monkeypatch):
    # The needle test's documents (one per depth) and Your pick's are prefilled by the background job, not
    # inside the request (here limited to 1 s, shorter than the slowed preparation).
    gradio_client = pytest.importorskip("gradio_client")
    from benchmarks.browser import serve_app

    monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), "request_s": 1}))
    with serve_app(tiny, [("tiny", "tiny")]) as url:
        client = gradio_client.Client(url, verbose=False)
        text = doc("needles")
        out = client.predict(
            text=text, methods=["streaming_llm"], ratios="4", depths=2, model="tiny", api_name="/needle_test"
        )
        assert "needle test, 2 depths" in out[0] and "Stopped" not in out[0], out[0]
        # Each depth's own document (the needle inserted at its start, at its end), prefilled once, in the background.
        assert len(slowed) == 2 and {slowed.threads[t] for t in slowed} == {"kvlab-prepare"}, slowed.threads
        monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), "request_s": 180}))
        picked = doc("picked")
        client.predict(text=picked, ticked=[], ratio=4, question=QUESTION, model="tiny", api_name="/pick")
        assert slowed.threads[picked] == "kvlab-prepare"


@pytest.mark.slow  # a served app: left out of make test-fast
def test_a_runs_long_compression_is_made_in_the_background(slowed, tiny, compressions, monkeypatch):
    # A Run of on-policy Attention Matching under a 1 s request limit, its preparation's steps slowed past it:
    # the compression is made by the background job (its thread), the Run waits for it and answers, and its
    # summary counts the compression as this run's (not "reused").
    gradio_client = pytest.importorskip("gradio_client")
    from benchmarks.browser import serve_app

    monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), "request_s": 1}))
    text = doc("long compression")
    with serve_app(tiny, [("tiny", "tiny")]) as url:
        client = gradio_client.Client(url, verbose=False)
        out = client.predict(text=text, **RUN, knobs="on_policy=true", api_name="/run")
    assert compressions == ["kvlab-prepare"], compressions
    summary = out[0]
    assert "Stopped" not in summary and "on-policy" in summary, summary
    assert "Compression" in summary and "(reused" not in summary, summary
