"""What a repeated or changed configuration reuses (kvlab.pipeline, kvlab.compression.interface): counted calls,
and the reused results against the same settings computed on a fresh context."""

from __future__ import annotations

import pytest
import torch

import kvlab.pipeline as pipeline
from kvlab.compression.interface import EvictionMethod, MethodScores
from kvlab.context import prepare_context
from kvlab.methods import REGISTRY, Request, get_method
from kvlab.pipeline import run
from kvlab.testing.device_suite import QUICK_OPTIONS

DOCUMENT = " ".join(f"w{(i * 11) % 60 + 2}" for i in range(48))
QUESTION, OTHER = "w5 w9 w13", "w7 w2"
SCORERS = sorted(name for name, cls in REGISTRY.items() if issubclass(cls, EvictionMethod))


def kept_indices(stored) -> list[list[list[int]]]:
    """Per layer and KV head, the original tokens a stored cache keeps (sorted)."""
    out = []
    for layer in stored.layers:
        heads = []
        for head in range(layer[0].lengths().numel()):
            heads.append(sorted(int(i) for seg in layer for i in seg.view().token_index[head].tolist() if i >= 0))
        out.append(heads)
    return out


@pytest.mark.parametrize("name", SCORERS)
def test_a_second_ratio_reuses_the_scores_and_selects_as_from_scratch(tiny, monkeypatch, name):
    cls = REGISTRY[name]
    calls = []
    own = cls.scores
    monkeypatch.setattr(cls, "scores", lambda self, req: calls.append(req.ratio) or own(self, req))
    method = get_method(name, **QUICK_OPTIONS.get(name, {}))
    ctx = prepare_context(tiny, DOCUMENT)
    method.compress(Request(ctx, 2.0, QUESTION))
    second = method.compress(Request(ctx, 6.0, QUESTION))
    # H2O's recent window is a share of the budget: its scores are remade (over kept heavy-hitter sums);
    # KVzip's scores are its shared reconstruction memo, read again at each ratio.
    assert calls == [2.0] if cls.keep_scores else set(calls) == {2.0, 6.0}
    fresh = method.compress(Request(prepare_context(tiny, DOCUMENT), 6.0, QUESTION))
    assert kept_indices(second) == kept_indices(fresh)


def test_kvzips_scores_are_held_once_and_its_reconstruction_runs_once(tiny, monkeypatch):
    import kvlab.methods.families.scorers as scorers

    passes = []
    real = scorers.repeat_pass
    monkeypatch.setattr(scorers, "repeat_pass", lambda *a, **kw: passes.append(1) or real(*a, **kw))
    ctx = prepare_context(tiny, DOCUMENT)
    for ratio in (2.0, 6.0):
        get_method("kvzip").compress(Request(ctx, ratio, QUESTION))
    assert passes == [1]
    score_memos = [k for k in ctx.memos if isinstance(k, (scorers.KVzipScores, MethodScores))]
    assert score_memos == [scorers.KVzipScores(4, scorers.KVzipOptions().instruction)]  # not a second copy per options


def counting(monkeypatch) -> dict[str, int]:
    """Counts of compressions and of answers written (the full cache's, and a stored cache's from its draft)."""
    counts = {"compress": 0, "greedy": 0}
    for name in ("greedy", "greedy_from_draft"):

        def counted(*args, _answer=getattr(pipeline, name), **kwargs):
            counts["greedy"] += 1
            return _answer(*args, **kwargs)

        monkeypatch.setattr(pipeline, name, counted)
    return counts


def counted_method(monkeypatch, counts: dict[str, int], name: str, **options):
    method = get_method(name, **options)
    compress = method.compress

    def counted(req):
        counts["compress"] += 1
        return compress(req)

    monkeypatch.setattr(method, "compress", counted)
    return method


def test_a_repeated_configuration_recomputes_nothing(tiny, monkeypatch):
    counts = counting(monkeypatch)
    method = counted_method(monkeypatch, counts, "snapkv")
    ctx = prepare_context(tiny, DOCUMENT)
    first = run(ctx, method, 4.0, QUESTION, max_new_tokens=6)
    greedy_after_first = counts["greedy"]  # the full cache's answer and the compressed one
    again = run(ctx, method, 4.0, QUESTION, max_new_tokens=6)
    assert counts["compress"] == 1 and counts["greedy"] == greedy_after_first
    assert again.compression_reused and again.answer_reused
    assert not (first.compression_reused or first.answer_reused)
    assert again.result.answer_compressed == first.result.answer_compressed
    assert again.result.per_head == first.result.per_head


def test_a_new_question_reuses_a_query_agnostic_cache_only(tiny, monkeypatch):
    counts = counting(monkeypatch)
    ctx = prepare_context(tiny, DOCUMENT)
    agnostic = counted_method(monkeypatch, counts, "tova")
    run(ctx, agnostic, 4.0, QUESTION, max_new_tokens=6)
    other = run(ctx, agnostic, 4.0, OTHER, max_new_tokens=6)
    assert counts["compress"] == 1 and other.compression_reused and not other.answer_reused
    aware = counted_method(monkeypatch, counts, "snapkv_question")
    run(ctx, aware, 4.0, QUESTION, max_new_tokens=6)
    asked = run(ctx, aware, 4.0, OTHER, max_new_tokens=6)
    assert counts["compress"] == 3 and not asked.compression_reused
    # What was reused is what a fresh context computes for the new question.
    fresh = run(prepare_context(tiny, DOCUMENT), get_method("tova"), 4.0, OTHER, max_new_tokens=6)
    assert other.result.answer_compressed == fresh.result.answer_compressed
    assert torch.allclose(
        torch.tensor(other.result.per_head["attn_output_rel_err"]),
        torch.tensor(fresh.result.per_head["attn_output_rel_err"]),
    )


def test_a_method_changed_reuses_the_full_caches_side_of_the_errors(tiny, monkeypatch):
    # The full cache's attention for the question's queries is computed for the first run only;
    # the next method's errors are still what a fresh context measures for it.
    calls = []
    own = pipeline.reference_attention
    monkeypatch.setattr(pipeline, "reference_attention", lambda *a, **k: calls.append(1) or own(*a, **k))
    ctx = prepare_context(tiny, DOCUMENT)
    run(ctx, get_method("tova"), 4.0, QUESTION, max_new_tokens=6)
    second = run(ctx, get_method("snapkv"), 4.0, QUESTION, max_new_tokens=6)
    assert len(calls) == 1
    fresh = run(prepare_context(tiny, DOCUMENT), get_method("snapkv"), 4.0, QUESTION, max_new_tokens=6)
    for key in ("attn_output_rel_err", "attn_mass_rel_err", "attn_mass_ratio"):
        assert torch.allclose(torch.tensor(second.result.per_head[key]), torch.tensor(fresh.result.per_head[key]))


def test_kept_runs_count_in_the_context_budget_and_go_least_recent_first(tiny, monkeypatch):
    counts = counting(monkeypatch)
    method = counted_method(monkeypatch, counts, "snapkv")
    ctx = prepare_context(tiny, DOCUMENT)
    before = ctx.nbytes
    first = run(ctx, method, 2.0, QUESTION, max_new_tokens=6)
    assert ctx.nbytes >= before + first.stored.nbytes
    # Room for what the context holds now and one more stored cache, not two.
    ctx.budget = ctx.nbytes + first.stored.nbytes // 2
    run(ctx, method, 3.0, QUESTION, max_new_tokens=6)
    assert ctx.nbytes <= ctx.budget
    again = run(ctx, method, 2.0, QUESTION, max_new_tokens=6)
    assert not again.compression_reused and counts["compress"] == 3


def test_preparing_with_a_question_answers_it_before_the_run(tiny, monkeypatch):
    """The background preparation also answers the page's question from the full cache: the Run then
    writes only the compressed cache's answer, and the full answer is the one a fresh context gives."""
    from kvlab import lab, models

    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    text = DOCUMENT + " w3 w4"
    prepared = lab.prepare_document(text, None, "tova", question=QUESTION, max_new_tokens=6)
    assert prepared.answer_s is not None
    counts = counting(monkeypatch)
    ex = lab.explore(lab.run_spec(text, None, "tova", 4, QUESTION, max_new_tokens=6))
    assert ex.full_answer_reused and counts["greedy"] == 1  # the compressed cache's answer only
    fresh = run(prepare_context(tiny, text), get_method("tova"), 4.0, QUESTION, max_new_tokens=6)
    assert ex.run.result.answer_full == fresh.result.answer_full
    # A question a run would refuse is left for the run to report.
    assert lab.prepare_document(text, None, "tova", question="  ", max_new_tokens=6).answer_s is None
