"""The gradio-free lab layer: one preparation per document, sweeps and their exports, the CLI's compare."""

from __future__ import annotations

import csv
import json
import threading

import pytest
import torch

from kvlab import context_store as contexts_module
from kvlab import lab, models
from kvlab import queries as queries_module
from kvlab.cli import main
from kvlab.context import prepare_context
from kvlab.context_store import ContextStore
from kvlab.methods import REGISTRY, Request

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(120))


def test_racing_requests_share_one_preparation(tiny, monkeypatch, flight_waiters):
    # Users (or a background preparation and a Run) ask for the same document at once: one
    # prefill runs, every request gets its context. The prefill holds until the two other
    # requests wait on it, so they really race it (no sleep that hopes they do).
    calls, joined = [], []

    def slow_prepare(lm, text, progress=None):
        calls.append(text)
        joined.append(flight_waiters.wait_for(2))
        return prepare_context(lm, text)

    monkeypatch.setattr(contexts_module, "prepare_context", slow_prepare)
    store = ContextStore(capacity=2)
    got = []
    threads = [threading.Thread(target=lambda: got.append(store.get(tiny, DOC))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert joined == [True] and len(calls) == 1 and len(got) == 3 and all(c is got[0] for c in got)
    assert store.peek(tiny, DOC) is got[0] and store.peek(tiny, DOC + " w3") is None


def test_a_failed_preparation_reaches_every_waiter_and_is_not_kept(tiny, monkeypatch, flight_waiters):
    attempts, joined = [], []

    def failing_once(lm, text, progress=None):
        attempts.append(text)
        if len(attempts) == 1:
            joined.append(flight_waiters.wait_for(1))  # fail only once the other request waits on it
            raise RuntimeError("disk on fire")
        return prepare_context(lm, text)

    monkeypatch.setattr(contexts_module, "prepare_context", failing_once)
    store = ContextStore()
    errors = []

    def ask():
        try:
            store.get(tiny, DOC)
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert joined == [True] and errors == ["disk on fire", "disk on fire"] and len(attempts) == 1
    assert store.get(tiny, DOC).lm is tiny and len(attempts) == 2  # the next request tries again


def test_preparing_a_document_records_the_methods_queries(tiny, monkeypatch):
    # After prepare_document, a Run of Attention Matching finds the prefill and its repeat-prefill
    # queries done: neither runs again (both are made to fail if they do).
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    text = DOC + " w9 w8 w7"
    prepared = lab.prepare_document(text, None, "attention_matching")
    assert prepared.prefilled_now and prepared.doc_tokens > 100
    monkeypatch.setattr(contexts_module, "prepare_context", lambda *a, **k: pytest.fail("prefilled again"))
    monkeypatch.setattr(queries_module, "_session_after", lambda *a, **k: pytest.fail("repeat pass recorded again"))
    ex = lab.explore(lab.run_spec(text, None, "attention_matching", 4, "w5 w6", max_new_tokens=2))
    assert ex.prefill_reused and ex.run.result.method == "attention_matching"
    assert not lab.prepare_document(text, None, "attention_matching").prefilled_now


def test_preparing_kvzip_scores_the_document_so_a_run_only_selects(tiny, monkeypatch):
    # KVzip's reconstruction pass and its scoring are document-only: after prepare_document
    # a Run at any ratio does neither again, and keeps the tokens a fresh context's Run keeps.
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    text = DOC + " w4 w4 w9"
    lab.prepare_document(text, None, "kvzip")
    import kvlab.methods.families.scorers as scorers_module

    monkeypatch.setattr(queries_module, "_session_after", lambda *a, **k: pytest.fail("reconstruction pass again"))
    monkeypatch.setattr(scorers_module, "received_attention", lambda *a, **k: pytest.fail("scored again"))
    ex = lab.explore(lab.run_spec(text, None, "kvzip", 4, "w5 w6", max_new_tokens=2))
    monkeypatch.undo()
    fresh = REGISTRY["kvzip"]().compress(Request(prepare_context(tiny, text), 4.0))
    assert [seg.view().token_index.tolist() for layer in ex.run.stored.layers for seg in layer] == [
        seg.view().token_index.tolist() for layer in fresh.layers for seg in layer
    ]


def kept_keys(ctx) -> list[set]:
    """What a context holds: the keys of its recorded queries, memos, kept runs and evaluations."""
    return [set(store) for store in (ctx.queries, ctx.memos, ctx.runs, ctx.evaluations)]


def test_a_method_says_it_prepares_exactly_when_its_preparation_does_work(tiny):
    # The app prepares a picked method only when it says it prepares: for every method, what its
    # preparation leaves on a fresh context is checked instead.
    text = DOC + " w3 w1 w4"
    for name in sorted(REGISTRY):
        ctx = prepare_context(tiny, text)
        before = kept_keys(ctx)
        REGISTRY[name]().prepare(ctx)
        assert REGISTRY[name].prepares() == (kept_keys(ctx) != before), name
    assert REGISTRY["kvzip"].prepares() and REGISTRY["attention_matching"].prepares()


def test_a_sweep_keeps_going_past_a_failing_point_and_exports_every_run(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    methods = ["streaming_llm", "tova"]
    original = REGISTRY["tova"].compress

    def fails_at_three(self, req):
        if req.ratio == 3:
            raise ValueError("no good at 3x")
        return original(self, req)

    monkeypatch.setattr(REGISTRY["tova"], "compress", fails_at_three)
    # A document of its own: another test's runs on DOC may be kept (kvlab.pipeline.compressed).
    sweep = lab.compare(DOC + " w3 w3 w3", None, methods, [2.0, 3.0], "w5 w6", max_new_tokens=3)
    assert [(r.method, r.ratio) for r in sweep.results] == [
        ("streaming_llm", 2.0),
        ("streaming_llm", 3.0),
        ("tova", 2.0),
    ]
    assert [(e.method, e.ratio) for e in sweep.errors] == [("tova", 3.0)] and "no good" in sweep.errors[0].message
    csv_path, json_path = lab.write_exports(sweep, tmp_path, stem="sweep")
    with open(csv_path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    data = json.loads(open(json_path, encoding="utf-8").read())
    assert [(r["method"], float(r["ratio"])) for r in rows] == [(r.method, r.ratio) for r in sweep.results]
    assert [float(r["bytes_compressed"]) for r in rows] == [r["bytes_compressed"] for r in data["results"]]
    # Bytes are those of the stored caches: keeping half of the document stores fewer bytes than a third more.
    assert float(rows[1]["bytes_compressed"]) < float(rows[0]["bytes_compressed"]) < float(rows[0]["bytes_full"])
    assert data["errors"] == [{"method": "tova", "ratio": 3.0, "message": "ValueError: no good at 3x", "model": ""}]


def test_a_sweep_refuses_bad_input_before_any_work(tiny, monkeypatch):
    monkeypatch.setattr(models, "get_model", lambda spec=None: pytest.fail("loaded a model"))
    with pytest.raises(lab.InputError, match="at least one method"):
        lab.compare(DOC, None, [], [2.0], "q")
    with pytest.raises(lab.InputError, match="too many"):
        lab.compare(DOC, None, ["streaming_llm"] * 11, [float(r) for r in range(2, 12)], "q")
    with pytest.raises(lab.InputError, match="question is empty"):
        lab.compare(DOC, None, ["streaming_llm"], [2.0], "  ")


@pytest.mark.slow  # the embedded model
def test_cli_compare_writes_a_sweep(embedded, tmp_path, capsys):
    doc = tmp_path / "notes.txt"
    doc.write_text("The lighthouse keeper is called Ada Vance. She keeps a red boat named Puffin.\n" * 8)
    out = tmp_path / "out"
    code = main(
        [
            "compare",
            "--doc",
            str(doc),
            "--methods",
            "streaming_llm,tova",
            "--ratios",
            "2,4",
            "--question",
            "What is the boat called?",
            "--max-new-tokens",
            "6",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    with open(out / "compare.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["method"], float(r["ratio"])) for r in rows] == [
        ("streaming_llm", 2.0),
        ("streaming_llm", 4.0),
        ("tova", 2.0),
        ("tova", 4.0),
    ]
    data = json.loads((out / "compare.json").read_text())
    assert data["question"] == "What is the boat called?" and len(data["results"]) == 4
    assert "compare.csv" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--doc", "x.txt", "--methods", "", "--ratios", "2", "--question", "q", "--out", "o"], "method"),
        (
            ["compare", "--doc", "x.txt", "--methods", "tova", "--ratios", "two", "--question", "q", "--out", "o"],
            "ratio",
        ),
        (["compare", "--doc", "x.txt", "--methods", "nope", "--ratios", "2", "--question", "q", "--out", "o"], "nope"),
    ],
)
def test_cli_compare_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize(
    "reference, other, expected",
    [([5, 6, 7], [5, 6, 7], None), ([5, 6, 7], [5, 9, 7], 1), ([5, 6, 7], [5, 6], 2), ([5], [5, 6], 1), ([], [], None)],
)
def test_first_divergence_by_hand(reference, other, expected):
    from kvlab.pipeline import first_divergence

    assert first_divergence(reference, other) == expected


def test_answer_log_probabilities_follow_the_full_answer(tiny, tiny_eager, monkeypatch):
    # The reference is independent of kvlab's cache and decode loop: transformers' own eager
    # attention over the whole token sequence at once (template + document, question, answer),
    # teacher-forced, each answer token read off the logits of the position before it.
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    ex = lab.explore(lab.run_spec(DOC, None, "streaming_llm", 1.0, "w5 w6", max_new_tokens=5))
    r, ev = ex.run.result, ex.run.evaluation
    assert len(r.answer_tokens) == len(r.answer_logprobs_full) == len(r.answer_logprobs_compressed) == 5
    ids = torch.cat([ex.run.ctx.tokens.ids.cpu(), ev.question_ids.cpu(), torch.tensor(ev.answer.ids)])
    with torch.no_grad():
        logp = torch.log_softmax(tiny_eager.model(ids[None]).logits[0].double(), dim=-1)
    before = logp[ids.numel() - 6 : -1]  # the logits that predict each of the 5 answer tokens
    assert ev.answer.ids == before.argmax(dim=-1).tolist()  # the answer is the greedy one
    eager = before.gather(1, torch.tensor(ev.answer.ids).unsqueeze(1)).squeeze(1)
    assert r.answer_logprobs_full == pytest.approx(eager.tolist(), abs=1e-5)
    # At ratio 1 nothing is evicted: the compressed cache scores the same answer the same way.
    assert r.answer_logprobs_compressed == pytest.approx(eager.tolist(), abs=1e-5)
    assert r.first_divergence is None
    squeezed = lab.explore(lab.run_spec(DOC, None, "streaming_llm", 30.0, "w5 w6", max_new_tokens=5)).run.result
    assert squeezed.answer_logprobs_full == pytest.approx(eager.tolist(), abs=1e-5)  # the full cache's, again
    assert squeezed.answer_logprobs_compressed != pytest.approx(eager.tolist(), abs=1e-4)
