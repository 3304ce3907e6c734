"""Many users at once, many questions in a row, and files that are not uploads.

- Load: 8 ``gradio_client`` sessions at once against the real app (embedded
  model, loopback only), each with its own document, method and question;
  each must get its own right answer, and the server's peak memory is
  reported (printed, and written to tests/artifacts/load.json).
- Mixed load: the same eight Explore clients beside a Generate request and a sweep, while a 20-run
  sweep is stopped mid-run (Stop): all the others answered, the stopped one runs no step once the
  server knows, the server goes idle within the request cap, memory stays within a stated bound.
- Soak: 200 distinct questions on one document (the tiny model, lab level);
  what the document keeps stays within its budget and the process does not grow.
- Files: every file input of the app refuses a path on the server.
"""

from __future__ import annotations

import gc
import json
import logging
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest
import torch

gradio_client = pytest.importorskip("gradio_client")
httpx = pytest.importorskip("httpx")

from benchmarks.browser import serve_app  # noqa: E402
from conftest import cancel_when_known  # noqa: E402
from kvlab import cancellation, lab, limits, models  # noqa: E402
from kvlab.context import prepare_context  # noqa: E402
from kvlab.context_store import CONTEXTS, ContextStore  # noqa: E402
from kvlab.pipeline import evaluation  # noqa: E402
from kvlab.queries import question_queries  # noqa: E402
from kvlab.tasks.marking import contains_match  # noqa: E402
from kvlab.ui import common  # noqa: E402

pytestmark = pytest.mark.load  # many concurrent requests against a served app: left out of make test-fast

ARTIFACTS = Path(__file__).parent / "artifacts"
WORDS = ["heron", "orange", "copper", "violet", "falcon", "pebble", "silver", "tiger"]
METHODS = ["streaming_llm", "snapkv", "tova", "h2o", "kivi", "streaming_llm", "snapkv", "tova"]
QUESTION = "What is the code word?"
SESSIONS = 8
LOAD_TIMEOUT_S = 100


def document(word: str, i: int) -> str:
    return (
        f"Note number {i + 1}, from the front desk. The code word is {word}. "
        "Please keep it private and tell it only to the staff."
    )


def shown(output: str | dict) -> str:
    """A textbox's text, whether the endpoint returned it or an update carrying it."""
    return output["value"] if isinstance(output, dict) else output


class PeakRSS:
    """The process's resident memory, sampled every 50 ms while in use; ``peak`` in bytes."""

    def __init__(self) -> None:
        self.peak = psutil.Process().memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, psutil.Process().memory_info().rss)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def app_url(embedded):
    with serve_app(embedded) as url:
        yield url


def test_eight_sessions_at_once_each_get_their_own_answer(app_url):
    results: dict[int, dict] = {}

    # Each its own session, opened before the load starts (opening one reads the API description).
    clients = [gradio_client.Client(app_url, verbose=False) for _ in range(SESSIONS)]

    def session(i: int) -> None:
        start = time.perf_counter()
        try:
            out = clients[i].predict(
                text=document(WORDS[i], i),
                method=METHODS[i],
                ratio=2,
                question=QUESTION,
                max_new_tokens=10,
                api_name="/run",
            )
            results[i] = {"full": shown(out[1]), "compressed": shown(out[2]), "s": time.perf_counter() - start}
        except Exception as exc:  # noqa: BLE001 - counted as a failure below
            results[i] = {"error": f"{type(exc).__name__}: {exc}", "s": time.perf_counter() - start}

    with PeakRSS() as rss:
        start = time.perf_counter()
        threads = [threading.Thread(target=session, args=(i,)) for i in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(LOAD_TIMEOUT_S)
        wall = time.perf_counter() - start
    failures = {i: r["error"] for i, r in results.items() if "error" in r}
    latencies = sorted(r["s"] for r in results.values())
    figures = {
        "requests": SESSIONS,
        "answered": len(results),
        "failures": len(failures),
        "wall_s": round(wall, 2),
        "p50_s": round(statistics.median(latencies), 2) if latencies else None,
        "p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 2) if latencies else None,
        "peak_rss_mib_during_load": round(rss.peak / 2**20, 1),
        "peak_rss_mib_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print("\nload test:", json.dumps(figures))
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "load.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    assert len(results) == SESSIONS and not failures, failures
    assert wall < LOAD_TIMEOUT_S
    for i, r in results.items():
        # Its own word, and nobody else's: sessions never see each other's documents.
        assert contains_match(r["full"], (WORDS[i],)), (i, r)
        assert not any(contains_match(r["full"], (w,)) for w in WORDS if w != WORDS[i]), (i, r)


@pytest.fixture
def one_thread():
    """Torch on one thread: for the tiny model's small matrices, handing work to other threads of a busy
    machine costs far more than the maths (about 25x here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_two_hundred_questions_keep_one_documents_memory_bounded(tiny, monkeypatch, one_thread):
    remembered = 8
    monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), "remembered_questions": remembered}))
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    doc = " ".join(f"w{(i * 11) % 60 + 2}" for i in range(200))
    asked = [f"w{2 + i % 60} w{2 + (i // 60) % 60} w{2 + (i * 7) % 60}" for i in range(200)]
    assert len(set(asked)) == 200

    def ask(ctx, question: str) -> None:
        # What a run keeps per question: the full cache's answer and the question's queries.
        evaluation(ctx, question, 2)
        question_queries(ctx, question)

    # The budget: the document plus five questions' worth, so that it binds before the count does
    # (the first question also builds the full cache's keep-all view).
    probe = prepare_context(tiny, doc)
    base = probe.nbytes
    ask(probe, "w2 w3")
    first = probe.nbytes
    ask(probe, "w3 w4")
    budget = first + 4 * (probe.nbytes - first)
    store = ContextStore(budget=budget)
    # The module, not kvlab.lab's function of the same name.
    monkeypatch.setattr(sys.modules["kvlab.lab.explore"], "CONTEXTS", store)
    process = psutil.Process()
    # Every tenth question is a whole run by a method that keeps something per question.
    runs = [("streaming_llm", {}), ("snapkv_question", {}), ("beaconkv", {"beacon_source": "question"})]
    sizes, rss, tensors = [], [], []
    start = time.perf_counter()
    for i, question in enumerate(asked):
        if i % 10 == 0:
            method, options = runs[(i // 10) % len(runs)]
            ctx = lab.explore(lab.run_spec(doc, None, method, 4, question, max_new_tokens=2, options=options)).run.ctx
        else:
            ask(ctx, question)
        if i in (109, 199):  # the same phase of the cycle of runs (9 questions after a snapkv_question run)
            rss.append(process.memory_info().rss)
            gc.collect()
            tensors.append(sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)))
        sizes.append(ctx.nbytes)
    elapsed = time.perf_counter() - start
    print(
        f"\nsoak: {len(asked)} questions in {elapsed:.1f} s; document bytes: prepared {base:,}, "
        f"max {max(sizes):,}, after the last {sizes[-1]:,} (budget {budget:,}); "
        f"RSS after question 110 {rss[0] / 2**20:.1f} MiB, after 200 {rss[1] / 2**20:.1f} MiB; "
        f"live tensors {tensors[0]} and {tensors[1]}"
    )
    assert max(sizes) <= budget and store.nbytes <= budget
    assert 1 <= len(ctx.questions) <= remembered and set(ctx.questions) <= set(asked[-remembered:])
    assert max(sizes[100:]) <= max(sizes[:100])  # no growth in the second half
    assert len(asked) == 200 and tensors[1] <= tensors[0]  # nothing accumulates from cycle to cycle


# -------------------------------------------------------------------------- a mixed load, with a client stopped mid-run


class StepsAfterGone:
    """The server's per-step check (kvlab.ui.common.requester_gone), counting steps a request ran after it
    was once told its requester is gone (must stay 0), per request (kvlab.cancellation scope)."""

    def __init__(self, real) -> None:
        self.real, self.after_gone, self.gone, self.calls = real, 0, [], 0
        self.started = threading.Event()

    def __call__(self) -> str | None:
        scope = cancellation.current()
        self.calls += 1
        self.started.set()
        if any(s is scope for s in self.gone):
            self.after_gone += 1
        why = self.real()
        if why is not None:
            self.gone.append(scope)
        return why


def mixed_calls(clients: list) -> list[tuple[str, Callable[[], object]]]:
    """(name, call returning what the client shows) for SESSIONS Explore runs, a Generate and a sweep."""

    def explore(i: int) -> object:
        out = clients[i].predict(
            text=document(WORDS[i], i),
            method=METHODS[i],
            ratio=2,
            question=QUESTION,
            max_new_tokens=10,
            api_name="/run",
        )
        return shown(out[1])

    def generate() -> object:
        return clients[SESSIONS].predict(
            source_="the prompt below",
            prompt_="Write the word heron three times.",
            methods_=["h2o"],
            budget_=48,
            max_new_=24,
            api_name="/generate",
        )[0]

    def sweep() -> object:
        return clients[SESSIONS + 1].predict(
            text=document("copper", 50),
            methods=["streaming_llm", "tova"],
            ratios=[2, 5],
            more_ratios="",
            question=QUESTION,
            max_new_tokens=10,
            api_name="/compare",
        )[1]

    return [(f"explore {i}", lambda i=i: explore(i)) for i in range(SESSIONS)] + [
        ("generate", generate),
        ("sweep", sweep),
    ]


def run_at_once(calls: list[tuple[str, Callable[[], object]]], stopper) -> dict[str, object]:
    """Every call in its own thread, ``stopper`` cancelled once they started: name -> result or exception."""
    results: dict[str, object] = {}

    def guarded_call(name: str, work: Callable[[], object]) -> None:
        try:
            results[name] = work()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            results[name] = exc

    threads = [threading.Thread(target=guarded_call, args=call) for call in calls]
    for t in threads:
        t.start()
    cancel_when_known(stopper)
    for t in threads:
        t.join(4 * LOAD_TIMEOUT_S)
    return results


def test_explore_clients_beside_a_generate_and_sweeps_with_one_stopped_mid_run(app_url, monkeypatch, caplog):
    """Eight Explore clients, a Generate and a sweep at once, while a 20-run sweep is stopped mid-run: every
    other client gets its answer, the stopped one runs no step once the server knows, the compute slot goes
    idle within the request cap and then runs no step, and the documents' caches stay within their budget."""
    steps = StepsAfterGone(common.requester_gone)
    monkeypatch.setattr(common, "requester_gone", steps)
    caplog.set_level(logging.INFO, logger="kvlab.app")
    process = psutil.Process()
    clients = [gradio_client.Client(app_url, verbose=False) for _ in range(SESSIONS + 3)]
    # One of each request first: what the first use of each path allocates once is not the load's.
    clients[0].predict(
        text=document("warm", 98), method=METHODS[0], ratio=2, question=QUESTION, max_new_tokens=10, api_name="/run"
    )
    clients[0].predict(
        source_="the prompt below", prompt_="Say hello.", methods_=["h2o"], budget_=48, max_new_=8, api_name="/generate"
    )
    rss_before = process.memory_info().rss
    steps.started.clear()
    stopper = clients[-1].submit(
        text=document("lantern", 99),
        methods=METHODS[:4],
        ratios=[2, 5, 10, 20, 50],
        more_ratios="",
        question=QUESTION,
        max_new_tokens=10,
        api_name="/compare",
    )
    assert steps.started.wait(LOAD_TIMEOUT_S)
    results = run_at_once(mixed_calls(clients), stopper)
    failures = {k: v for k, v in results.items() if isinstance(v, Exception)}
    assert len(results) == SESSIONS + 2 and not failures, failures
    for i in range(SESSIONS):
        assert contains_match(results[f"explore {i}"], (WORDS[i],)), (i, results[f"explore {i}"])
    assert "prompt tokens" in results["generate"] and "copper" in results["sweep"]
    # The stopped sweep: logged as stopped by Stop, and not one step of it once the server knew.
    assert any("Stop was pressed" in r.getMessage() for r in caplog.records), "the stopped sweep never stopped"
    assert steps.after_gone == 0
    # Idle within the cap: nobody holds or waits for the compute slot, and the process computes nothing.
    deadline = time.monotonic() + limits.LIMITS.request_s
    while common.COMPUTE.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not common.COMPUTE.busy
    cpu, calls = sum(process.cpu_times()[:2]), steps.calls
    time.sleep(1.0)
    idle_cpu_s, steps_when_idle = sum(process.cpu_times()[:2]) - cpu, steps.calls - calls
    grown = process.memory_info().rss - rss_before
    print(
        f"\nmixed load: {len(results)} answered beside a stopped 20-run sweep; CPU over 1 s once idle "
        f"{idle_cpu_s:.2f} s; RSS grew {grown / 2**20:.0f} MiB; "
        f"contexts {CONTEXTS.nbytes / 2**20:.1f} MiB of a {CONTEXTS.budget / 2**20:.0f} MiB budget"
    )
    assert steps_when_idle == 0  # no compute step once idle (CPU time and RSS above are printed, not judged)
    assert CONTEXTS.nbytes <= CONTEXTS.budget


# --------------------------------------------------------------------------- files that are not uploads


SERVER_FILES = ["/etc/passwd", "../../README.md", str(Path(__file__).resolve().parent.parent / "README.md")]


def call(url: str, api: str, data: list) -> tuple[str, str]:
    """(event, payload) of one raw call of ``api``: what any HTTP client can send, no upload step."""
    with httpx.Client(timeout=60) as http:
        event = http.post(f"{url}gradio_api/call/{api}", json={"data": data})
        if event.status_code != 200:
            return "refused", event.text
        lines = http.get(f"{url}gradio_api/call/{api}/{event.json()['event_id']}").text.splitlines()
    kinds = [line.split(":", 1)[1].strip() for line in lines if line.startswith("event:")]
    payloads = [line.split(":", 1)[1].strip() for line in lines if line.startswith("data:")]
    return kinds[-1], payloads[-1]


def file_data(path: str) -> dict:
    return {"path": path, "meta": {"_type": "gradio.FileData"}}


@pytest.mark.parametrize("path", SERVER_FILES)
def test_no_file_input_reads_a_server_file(app_url, path):
    secrets = ("root:", "kvlab: a lab for KV-cache compression")
    client = gradio_client.Client(app_url, verbose=False)
    run_params = [
        p["parameter_name"]
        for p in client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/run"]["parameters"]
    ]
    attempts = {"load_file": [file_data(path)]}
    run_args = {"text": "", "file": file_data(path), "method": "streaming_llm", "question": QUESTION}
    attempts["run"] = [run_args.get(name) for name in run_params]
    for api, data in attempts.items():
        kind, payload = call(app_url, api, data)
        assert kind != "complete" and not any(s in payload for s in secrets), (api, kind, payload[:200])
