"""Limits checked before work, bounded memory, one computation per key, error ids, upload paths, model LRU."""

from __future__ import annotations

import gc
import logging
import os
import threading
import types
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama
from kvlab import lab, limits, models, pipeline
from kvlab.context import Memo, prepare_context
from kvlab.context_store import CONTEXTS, ContextStore
from kvlab.documents import DocumentError
from kvlab.memo import held_bytes
from kvlab.queries import QuestionQueries, question_queries

DOC = " ".join(f"w{(i * 5) % 60 + 2}" for i in range(90))


@dataclass(frozen=True)
class Note(Memo):
    """A memo of the tests' own, named by ``name``."""

    name: object


def with_limits(monkeypatch, **changes) -> None:
    monkeypatch.setattr(limits, "LIMITS", limits.Limits(**{**vars(limits.LIMITS), **changes}))


def no_model(spec=None):
    pytest.fail("a model was loaded: the limit was checked after the work")


# --------------------------------------------------------------------------- limits


def test_limits_come_from_the_environment_and_bad_values_say_which():
    got = limits.from_env({"KVLAB_MAX_QUESTION_TOKENS": "64", "KVLAB_CACHE_BYTES": "1_000_000", "OTHER": "x"})
    assert got.question_tokens == 64 and got.cache_bytes == 1_000_000
    assert got.new_tokens == limits.Limits().new_tokens
    with pytest.raises(limits.LimitConfigError, match="KVLAB_MAX_SWEEP='lots' is not a whole number"):
        limits.from_env({"KVLAB_MAX_SWEEP": "lots"})
    with pytest.raises(limits.LimitConfigError, match="KVLAB_MAX_MODELS='0': use a number >= 1"):
        limits.from_env({"KVLAB_MAX_MODELS": "0"})
    assert set(limits.ENV) == set(vars(limits.Limits()))  # every limit has its variable


def test_a_long_pasted_document_is_refused_before_tokenising(monkeypatch):
    with_limits(monkeypatch, document_chars=50)
    monkeypatch.setattr(models, "get_model", no_model)
    monkeypatch.setattr(lab.inputs, "clean_text", lambda text: pytest.fail("the text was processed"))
    with pytest.raises(DocumentError, match="has 60 characters; the limit here is 50"):
        lab.explore(lab.run_spec("x" * 60, None, "streaming_llm", 2, "q"))


def test_an_uploads_text_is_held_to_the_same_limit(monkeypatch, tmp_path):
    with_limits(monkeypatch, document_chars=50)
    doc = tmp_path / "long.txt"
    doc.write_text("word " * 20, encoding="utf-8")
    with pytest.raises(DocumentError, match="limit here is 50"):
        lab.document_text(None, str(doc))


def test_an_upload_over_the_byte_limit_is_never_read(monkeypatch, tmp_path):
    from kvlab import documents

    monkeypatch.setattr(documents, "MAX_FILE_BYTES", 100)
    doc = tmp_path / "big.txt"
    doc.write_text("a" * 101, encoding="utf-8")
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("the file was read"))
    with pytest.raises(DocumentError, match="too large"):
        lab.document_text("", str(doc))


def test_question_and_answer_length_limits(monkeypatch, tiny):
    with_limits(monkeypatch, question_chars=30, question_tokens=3, new_tokens=8)
    monkeypatch.setattr(models, "get_model", no_model)
    with pytest.raises(lab.InputError, match="31 characters; ask in at most 30"):
        lab.explore(lab.run_spec(DOC, None, "streaming_llm", 2, "w" * 31))
    with pytest.raises(lab.InputError, match="limit here is 8"):
        lab.explore(lab.run_spec(DOC, None, "streaming_llm", 2, "w2", max_new_tokens=9))
    # Tokens need the model, and are counted before the prefill: four words are four tokens here.
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    monkeypatch.setattr(CONTEXTS, "get", lambda *a, **k: pytest.fail("prefilled"))
    with pytest.raises(lab.InputError, match="4 tokens long; ask in at most 3"):
        lab.explore(lab.run_spec(DOC, None, "streaming_llm", 2, "w2 w3 w4 w5", max_new_tokens=4))
    assert lab.inputs.check_question_tokens(tiny.tokenizer, "w2 w3 w4") == "w2 w3 w4"


def test_the_sweep_limit_is_read_when_the_sweep_starts(monkeypatch):
    with_limits(monkeypatch, sweep_points=3)
    monkeypatch.setattr(models, "get_model", no_model)
    with pytest.raises(lab.InputError, match="4 runs is too many for one sweep: pick at most 3"):
        lab.compare(DOC, None, ["streaming_llm", "tova"], [2.0, 4.0], "w2")


# --------------------------------------------------------------------------- one computation per key


def test_racing_requests_compute_a_value_once_and_do_not_block_other_keys(tiny, flight_waiters):
    ctx = prepare_context(tiny, DOC)
    release, calls, got, released = threading.Event(), [], [], []

    def slow():
        calls.append("slow")
        released.append(release.wait(60))  # False: nobody released it, the guard ran out
        return [torch.ones(3)]

    threads = [threading.Thread(target=lambda: got.append(ctx.cached(Note("k"), slow))) for _ in range(3)]
    for t in threads:
        t.start()
    assert flight_waiters.wait_for(2)  # "k" is in flight, two requests wait on it
    # Meanwhile (the lock is free) another key is made and read; had it waited for "k", "k" would
    # have been let go by its guard running out, not by this test.
    assert ctx.cached(Note("other"), lambda: 7) == 7
    release.set()
    for t in threads:
        t.join()
    assert released == [True] and calls == ["slow"] and len(got) == 3 and all(g is got[0] for g in got)


def test_a_failure_reaches_every_waiter_and_nothing_is_kept(tiny, flight_waiters):
    ctx = prepare_context(tiny, DOC)
    errors, joined = [], []

    def failing():
        joined.append(flight_waiters.wait_for(1))  # fail only once the other request waits on it
        raise RuntimeError("no luck")

    def ask():
        try:
            ctx.cached(Note("k"), failing)
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert joined == [True] and errors == ["no luck", "no luck"] and Note("k") not in ctx.memos
    assert ctx.cached(Note("k"), lambda: 1) == 1


def test_two_requests_for_one_question_answer_it_once(tiny, monkeypatch, flight_waiters):
    ctx = prepare_context(tiny, DOC)
    answers, joined = [], []
    greedy = pipeline.greedy

    def counted(*args, **kwargs):
        answers.append(1)
        joined.append(flight_waiters.wait_for(1))  # answer once the other request waits on it
        return greedy(*args, **kwargs)

    monkeypatch.setattr(pipeline, "greedy", counted)
    got = []
    threads = [threading.Thread(target=lambda: got.append(pipeline.evaluation(ctx, "w7 w8", 3))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert joined == [True] and len(answers) == 1 and got[0] is got[1]


# --------------------------------------------------------------------------- bounded memory


def test_held_bytes_counts_each_storage_once_and_a_view_as_its_storage():
    big = torch.zeros(100, 10)  # 4000 bytes
    small = torch.zeros(5, dtype=torch.float64)  # 40 bytes
    assert held_bytes([big[:1], {"again": big}, (small,), 3, "text"]) == 4000 + 40


def test_a_document_remembers_its_latest_questions_only(tiny, monkeypatch):
    with_limits(monkeypatch, remembered_questions=3)
    ctx = prepare_context(tiny, DOC)
    asked = [f"w{i} w{i + 1}" for i in range(10, 16)]
    for q in asked:
        pipeline.evaluation(ctx, q, 2)
        question_queries(ctx, q)
    pipeline.evaluation(ctx, asked[3], 2)  # used again: the most recent now
    assert ctx.questions == [asked[4], asked[5], asked[3]]
    assert [q for q in asked if pipeline.has_evaluation(ctx, q, 2)] == asked[3:]
    assert set(ctx.queries) == {"context", *(QuestionQueries(question=q) for q in asked[3:])}


def test_a_context_over_its_budget_drops_its_oldest_entries(tiny):
    ctx = prepare_context(tiny, DOC)
    one = torch.zeros(1000)  # 4000 bytes each
    ctx.budget = ctx.nbytes + 3 * 4000
    for i in range(6):
        ctx.cached(Note(i), lambda: one.clone())
    assert set(ctx.memos) == {Note(3), Note(4), Note(5)} and ctx.nbytes <= ctx.budget
    # What is kept is what it says: the cache, the tokens and queries, plus three memos.
    base = sum(
        t.untyped_storage().nbytes()
        for t in [*ctx.full.keys, *ctx.full.values, ctx.tokens.ids, *ctx.queries["context"]]
    )
    assert ctx.nbytes == base + 3 * 4000


def test_the_store_evicts_least_recently_used_contexts_by_bytes(tiny):
    docs = [DOC, DOC + " w3", DOC + " w3 w4"]
    size = prepare_context(tiny, DOC).nbytes
    store = ContextStore(budget=int(2.5 * size))
    first, second = store.get(tiny, docs[0]), store.get(tiny, docs[1])
    store.get(tiny, docs[0])  # used again: docs[1] is now the oldest
    store.get(tiny, docs[2])
    assert store.peek(tiny, docs[0]) is first and store.peek(tiny, docs[1]) is None
    assert store.nbytes <= store.budget
    # A context that grows past the budget pushes out the others, never itself.
    first.cached(Note("big"), lambda: torch.zeros(2 * size // 4))
    assert store.peek(tiny, docs[0]) is first and store.peek(tiny, docs[2]) is None
    del second


def test_the_default_budget_follows_free_memory_unless_set(monkeypatch):
    import psutil

    from kvlab import context_store

    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    with_limits(monkeypatch, cache_bytes=0)
    # A quarter of the RAM available at the moment it is asked (a fixed figure: free memory moves).
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=8_000_000_003))
    assert context_store.default_budget() == 2_000_000_000
    with_limits(monkeypatch, cache_bytes=12345)
    assert context_store.default_budget() == 12345


# --------------------------------------------------------------------------- models


def test_models_beyond_the_limit_are_unloaded_with_their_contexts(monkeypatch):
    with_limits(monkeypatch, max_models=1)
    monkeypatch.setattr(models, "_cache", type(models._cache)())
    monkeypatch.setattr(models, "load_model", lambda spec=None: tiny_llama(seed=len(spec)))
    first = models.get_model("model-a")
    assert models.get_model("model-a") is first
    CONTEXTS.get(first, DOC)
    key, gone = CONTEXTS.key(first, DOC), weakref.ref(first.model)
    del first
    second = models.get_model("model-bb")
    gc.collect()
    assert gone() is None and [lm.name for lm in models._cache.values()] == [second.name]
    assert key not in CONTEXTS._items


def test_trust_remote_code_is_never_enabled(monkeypatch):
    seen = []

    def record(location, **kwargs):
        seen.append(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", record)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", record)
    with pytest.raises(models.ModelLoadError, match="stop here"):
        models.load_model("some-org/some-model")
    assert seen and all(kw.get("trust_remote_code") is False for kw in seen)


def test_a_space_loads_only_allowed_models():
    space = {"SPACE_ID": "someone/kvlab", "KVLAB_MODELS": "HuggingFaceTB/SmolLM2-360M-Instruct"}
    models.check_allowed("embedded", space)
    models.check_allowed("HuggingFaceTB/SmolLM2-360M-Instruct", space)
    with pytest.raises(models.ModelLoadError, match="'/etc' is not allowed here"):
        models.check_allowed("/etc", space)
    listed = {"KVLAB_SPACE": "1", "KVLAB_ALLOWED_MODELS": "a/b, c/d"}
    assert models.allowed_models(listed) == {"a/b", "c/d"}
    with pytest.raises(models.ModelLoadError, match="not allowed"):
        models.check_allowed(None, {**listed, "KVLAB_MODEL": "x/y"})
    models.check_allowed("/anything", {})  # outside a Space, the operator chooses


# --------------------------------------------------------------------------- errors and uploads


def test_an_unexpected_error_is_logged_with_an_id_the_user_sees(caplog):
    from kvlab.ui import common

    try:
        raise KeyError("secret/server/path")
    except KeyError as exc:
        with caplog.at_level(logging.ERROR, logger="kvlab.app"):
            err = common.unexpected(exc, "snapkv")
    record = caplog.records[-1]
    ident = record.args[0]
    assert len(ident) == 8 and ident in str(err) and "KeyError" in str(err)
    assert "secret/server/path" not in str(err)
    assert record.exc_info and "secret/server/path" in caplog.text  # the traceback is in the log


def test_only_gradio_uploads_are_read_and_each_is_deleted(monkeypatch, tmp_path):
    from kvlab.ui import common

    uploads = tmp_path / "gradio"
    uploads.mkdir()
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(uploads))
    doc = uploads / "abc" / "notes.txt"
    doc.parent.mkdir()
    doc.write_text("The code word is heron.", encoding="utf-8")
    assert common.document_input("", str(doc)) == "The code word is heron." and not doc.exists()
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read", encoding="utf-8")
    (uploads / "link.txt").symlink_to(secret)
    for path in [
        str(secret),
        str(uploads / ".." / "secret.txt"),
        str(uploads / "link.txt"),
        "/etc/passwd",
        os.path.relpath(secret),
    ]:
        with pytest.raises(lab.InputError, match="not uploaded here"):
            common.read_upload(path)
    assert secret.read_text() == "do not read"
    assert common.document_input("typed text", str(secret)) == "typed text"  # text wins; the path is not touched


# --------------------------------------------------------------------------- locks and futures that cannot hang


def test_a_failing_keep_resolves_the_future_for_every_waiter():
    """compute_once: when ``keep`` raises, a caller waiting on the same key gets the error, not a hang."""
    from concurrent.futures import Future

    from kvlab.memo import MISSING, compute_once

    lock, flights = threading.Lock(), {}
    made, waiter_in = threading.Event(), threading.Event()
    outcome: list[object] = []

    def make() -> int:
        made.set()
        waiter_in.wait(5)  # the second caller is waiting on this key's future by now
        return 1

    def keep(value: int) -> None:
        raise MemoryError("injected: keeping the value failed")

    def second() -> None:
        made.wait(5)
        with lock:
            flight = flights[("k",)]
        assert isinstance(flight, Future)
        waiter_in.set()
        try:
            outcome.append(compute_once(lock, flights, ("k",), lambda: MISSING, make, keep))
        except MemoryError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=second, daemon=True)
    waiter.start()
    with pytest.raises(MemoryError):
        compute_once(lock, flights, ("k",), lambda: MISSING, make, keep)
    waiter.join(10)
    assert not waiter.is_alive(), "the second caller still waits on a future nobody resolves"
    assert len(outcome) == 1 and isinstance(outcome[0], MemoryError)
    assert flights == {}


def test_a_slow_model_load_does_not_block_a_loaded_model(monkeypatch):
    """models.get_model: loading model B holds only B's lock; a request for loaded model A returns at once."""
    monkeypatch.setattr(models, "_cache", type(models._cache)())
    release, loading = threading.Event(), threading.Event()

    def load(spec=None):
        if spec == "model-b":
            loading.set()
            release.wait(30)
        return tiny_llama(seed=len(spec))

    monkeypatch.setattr(models, "load_model", load)
    first = models.get_model("model-a")
    slow = threading.Thread(target=models.get_model, args=("model-b",), daemon=True)
    slow.start()
    assert loading.wait(10)
    got: list[object] = []
    fast = threading.Thread(target=lambda: got.append(models.get_model("model-a")), daemon=True)
    fast.start()
    fast.join(10)
    blocked = fast.is_alive()
    release.set()
    slow.join(30)
    assert not blocked, "a request for a loaded model waited for another model's load"
    assert got == [first]


def test_the_keep_all_view_is_built_once_when_threads_race(monkeypatch):
    """FullKV.stored: threads asking at once share one build (no second copy, not even briefly)."""
    from kvlab.runtime import cache as cache_module
    from kvlab.runtime.decode import prefill

    full = prefill(tiny_llama(), torch.arange(2, 30))
    builders: set[int] = set()
    both_in = threading.Barrier(2, timeout=2)
    from_padded = cache_module.DenseSegment.from_padded.__func__

    def meeting_point(cls, *args, **kwargs):
        builders.add(threading.get_ident())
        try:
            both_in.wait()  # a second builder meets the first here, if the code lets it in
        except threading.BrokenBarrierError:
            pass
        return from_padded(cls, *args, **kwargs)

    monkeypatch.setattr(cache_module.DenseSegment, "from_padded", classmethod(meeting_point))
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(full.stored)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(builders) == 1, "two threads built the keep-all view"
    assert len(seen) == 2 and seen[0] is seen[1]
