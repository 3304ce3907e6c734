"""Bounded requests through a served app (gradio_client, loopback, the tiny random model).

Each step of work is slowed on purpose (the server's check "is the requester still there?", called at
every progress step, sleeps ``Steps.delay_s``), so that a run lasts long enough to be stopped; the checks
are counts of steps and server-side events, never a race against a clock:

- a request past ``KVLAB_MAX_REQUEST_S`` stops with a message, and the server answers the next request;
- a client that presses Stop (``/cancel``), or disconnects, stops the work at the next step: no step of
  work runs once the server knows;
- with a 40-run sweep running, another client's Explore run starts after at most one unit of the sweep
  (the measured wait and unit time are printed).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import pytest

gradio_client = pytest.importorskip("gradio_client")
httpx = pytest.importorskip("httpx")
from gradio_client.exceptions import AppError  # noqa: E402

from benchmarks.browser import serve_app  # noqa: E402
from conftest import cancel_when_known  # noqa: E402
from kvlab import cancellation, lab, limits, models  # noqa: E402
from kvlab.ui import common, explore_events  # noqa: E402

pytestmark = pytest.mark.slow  # a served app: left out of make test-fast

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(120))
QUESTION = "w5 w9"
SPEC = "tiny"
#: A 40-run sweep: two methods at twenty ratios (typed: the ticked ones are a fixed few).
SWEEP_METHODS, SWEEP_RATIOS = ["streaming_llm", "tova"], ", ".join(str(r) for r in range(2, 22))
FEW_RATIOS = "2, 3, 4, 5, 6"


class Steps:
    """The server's per-step check (kvlab.ui.common.requester_gone), slowed by ``delay_s`` and counted.

    after_gone: steps that ran after the check had once said the requester is gone (must stay 0);
    started: set at the first step of a request.
    """

    def __init__(self, real) -> None:
        self.real, self.delay_s, self.calls, self.after_gone = real, 0.0, 0, 0
        self.gone: str | None = None
        self.started = threading.Event()

    def __call__(self) -> str | None:
        from gradio.context import LocalContext

        if LocalContext.event_id.get(None) is None:
            # Work outside a request (a warming thread a server of another test module started, still running
            # in this process): not a step of the requests these tests stop.
            return self.real()
        self.started.set()
        self.calls += 1
        if self.gone is not None:
            self.after_gone += 1
        time.sleep(self.delay_s)
        why = self.real()
        if why is not None and self.gone is None:
            self.gone = why
        return why

    def reset(self, delay_s: float) -> None:
        self.delay_s, self.calls, self.after_gone, self.gone = delay_s, 0, 0, None
        self.started.clear()


class Stops(logging.Handler):
    """The server's log lines for stopped runs (kvlab.ui.common.guarded logs each), as they come."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "stopped" in record.getMessage():
            self.lines.append(record.getMessage())
            self.seen.set()

    def wait(self, timeout: float = 60) -> str:
        assert self.seen.wait(timeout), "the run never stopped"
        self.seen.clear()
        return self.lines[-1]


@pytest.fixture(scope="module")
def server(tiny):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "get_model", lambda spec=None: tiny)
        steps = Steps(common.requester_gone)
        mp.setattr(common, "requester_gone", steps)
        stops, logger = Stops(), logging.getLogger("kvlab.app")
        level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(stops)
        try:
            with serve_app(tiny, [(SPEC, SPEC)]) as url:
                yield url, steps, stops
        finally:
            logger.removeHandler(stops)
            logger.setLevel(level)


@pytest.fixture
def app(server, monkeypatch):
    url, steps, stops = server
    steps.reset(0.0)
    yield url, steps, stops
    assert common.COMPUTE.waiting == 0


def with_limit(monkeypatch, seconds: int) -> None:
    monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), "request_s": seconds}))


def explore_args(**kw) -> dict:
    return dict(
        text=DOC,
        method="streaming_llm",
        ratio=4,
        question=QUESTION,
        max_new_tokens=4,
        model=SPEC,
        api_name="/run",
        **kw,
    )


def answered_right(client) -> None:
    """The server answers a run as the lab does on its own (nothing half-kept from a stopped run got in)."""
    out = client.predict(**explore_args())
    expected = lab.explore(lab.run_spec(DOC, None, "streaming_llm", 4, QUESTION, 4, model=SPEC)).run.result
    full, compressed = (o["value"] if isinstance(o, dict) else o for o in out[1:3])
    assert (full, compressed) == (expected.answer_full, expected.answer_compressed)


def test_a_request_past_the_time_limit_stops_with_a_message_and_the_next_is_answered(app, monkeypatch):
    url, steps, stops = app
    with_limit(monkeypatch, 1)
    steps.reset(0.6)  # two steps pass the 1 s limit: a prefill chunk and the first decode step at least
    client = gradio_client.Client(url, verbose=False)
    with pytest.raises(AppError, match=r"Stopped after \d+ s because it ran past this server's time limit of 1 s"):
        client.predict(**explore_args())
    assert "time limit" in stops.wait() and steps.after_gone == 0
    with_limit(monkeypatch, 180)
    steps.reset(0.0)
    answered_right(client)


def test_stop_ends_the_work_at_its_next_step_and_the_server_goes_on(app):
    url, steps, stops = app
    steps.reset(0.05)
    client = gradio_client.Client(url, verbose=False)
    # A document of its own: runs another test made on DOC are kept (kvlab.pipeline.compressed) and
    # would come back at once, with no step of work to stop.
    job = client.submit(
        text=DOC + " w7 w7",
        methods=SWEEP_METHODS,
        ratios=[],
        more_ratios=FEW_RATIOS,
        question=QUESTION,
        max_new_tokens=4,
        model=SPEC,
        api_name="/compare",
    )
    assert steps.started.wait(60)
    cancel_when_known(job)
    line = stops.wait()
    assert "Stop was pressed" in line and steps.gone == cancellation.STOPPED and steps.after_gone == 0
    steps.reset(0.0)
    answered_right(client)


def test_a_client_that_disconnects_stops_within_one_step(app):
    url, steps, stops = app
    steps.reset(0.05)
    data = [
        DOC + " w8 w8",
        None,
        SWEEP_METHODS,
        [],
        FEW_RATIOS,
        QUESTION,
        4,
        SPEC,
        [],
        [],
    ]  # its own document, as above; no other models, no budgets axis
    with httpx.Client(timeout=60) as http:
        # What a browser tab does: join the queue, then listen to the session's stream.
        config = http.get(f"{url}config").json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "compare")
        joined = http.post(
            f"{url}gradio_api/queue/join", json={"data": data, "fn_index": fn_index, "session_hash": "kvlab-leaver"}
        )
        assert joined.status_code == 200, joined.text
        with http.stream("GET", f"{url}gradio_api/queue/data?session_hash=kvlab-leaver") as stream:
            assert steps.started.wait(60)
            next(stream.iter_lines())  # connected; leaving the block drops the connection mid-run
    line = stops.wait()
    assert "disconnected" in line and steps.gone == cancellation.GONE and steps.after_gone == 0
    steps.reset(0.0)
    answered_right(gradio_client.Client(url, verbose=False))


def test_another_clients_run_starts_within_one_unit_of_a_forty_run_sweep(app, monkeypatch):
    url, steps, _ = app
    steps.reset(0.01)
    ends, resumes, started = [], [], {}
    between = cancellation.between_units

    def timed_between(step=None):
        ends.append(time.monotonic())  # a unit of the sweep is done
        between(step)
        resumes.append(time.monotonic())

    run_view = explore_events.run_view

    def timed_run_view(*args, **kwargs):
        started["at"] = time.monotonic()
        return run_view(*args, **kwargs)

    hold, arrivals = common.COMPUTE.hold, []

    def timed_hold():
        # A request asks for the compute slot: after its document's preparation was waited for, outside it.
        arrivals.append(time.monotonic())
        return hold()

    monkeypatch.setattr(cancellation, "between_units", timed_between)
    monkeypatch.setattr(explore_events, "run_view", timed_run_view)
    monkeypatch.setattr(common.COMPUTE, "hold", timed_hold)
    sweeper, visitor = gradio_client.Client(url, verbose=False), gradio_client.Client(url, verbose=False)
    sweep = sweeper.submit(
        text=DOC,
        methods=SWEEP_METHODS,
        ratios=[],
        more_ratios=SWEEP_RATIOS,
        question=QUESTION,
        max_new_tokens=4,
        model=SPEC,
        api_name="/compare",
    )
    deadline = time.monotonic() + 300  # far above three units' time anywhere; a hang fails instead of waiting
    while len(ends) < 3:  # the sweep is well under way
        assert not sweep.done(), sweep.exception()
        assert time.monotonic() < deadline, f"the sweep finished {len(ends)} units in 300 s"
        time.sleep(0.01)
    asked = time.monotonic()
    visitor.predict(**explore_args())
    sweep.result(timeout=600)
    units = [b - a for a, b in zip(resumes, ends[1:])]  # each unit's own time, waits for the slot excluded
    arrived = arrivals[-1]  # the visitor's run reached the slot (the sweep's came first)
    during = sum(arrived < t < started["at"] for t in ends)
    print(
        f"\nfair slot: 40-run sweep, unit median {statistics.median(units) * 1000:.0f} ms "
        f"(max {max(units) * 1000:.0f} ms); the other client's run waited {(started['at'] - arrived) * 1000:.0f} ms "
        f"at the slot ({(started['at'] - asked) * 1000:.0f} ms from its request, Gradio's queue included), "
        f"{during} sweep unit(s) finishing meanwhile"
    )
    # The sweep asked for the slot once (it hands it over and takes it back between units), then the visitor.
    assert len(arrivals) == 2 and len(ends) == 39  # 40 runs: 39 boundaries, the sweep ran to its end
    assert during <= 1 and started["at"] < ends[-1]  # one unit at most, well before the sweep's end
