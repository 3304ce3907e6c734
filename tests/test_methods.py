"""Compression methods on a tiny random Llama: budgets, kept sets, invariants."""
from __future__ import annotations

import pytest
import torch

from kvlab.context import prepare_context
from kvlab.methods import REGISTRY, MethodError, Request, get_method
from kvlab.methods.attention_matching import compact_cache, AMOptions
from kvlab.methods.budgets import allocate, cap_shares
from kvlab.metrics import head_errors
from kvlab.pipeline import evaluation
from kvlab.queries import repeat_queries
from kvlab.runtime.decode import extend, open_session

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(96))
QUESTION = "w3 w5 w8"


@pytest.fixture(scope="module")
def ctx(tiny):
    return prepare_context(tiny, DOC)


def fresh_logits(ctx, stored):
    return extend(ctx.lm, open_session(ctx.lm, stored), torch.tensor([5, 9, 11]))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_ratio_one_keeps_everything_and_reproduces_logits(ctx, name):
    if getattr(REGISTRY[name], "fixed_budget", False):
        pytest.skip("keeps a fixed amount whatever the ratio")
    stored = get_method(name).compress(Request(ctx, 1.0, QUESTION))
    assert stored.logical_len == ctx.length
    assert stored.kept_per_head().min() == ctx.length
    assert torch.allclose(fresh_logits(ctx, stored), fresh_logits(ctx, ctx.full.stored), atol=1e-4)


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("ratio", [2.0, 8.0])
def test_every_method_meets_its_budget(ctx, name, ratio):
    if getattr(REGISTRY[name], "fixed_budget", False):
        pytest.skip("keeps a fixed amount whatever the ratio")
    stored = get_method(name).compress(Request(ctx, ratio, QUESTION))
    semantics = getattr(REGISTRY[name], "memory_ratio_semantics", None)
    if semantics:  # mixed precision: the ratio is met in bytes ("match") or caps them ("at_most")
        assert stored.nbytes <= ctx.full.nbytes / ratio
        if semantics == "match":
            assert stored.nbytes == pytest.approx(ctx.full.nbytes / ratio, rel=0.03)
        return
    kept = stored.kept_per_head()
    budget = round(ctx.doc_len / ratio)
    assert kept.float().mean().item() == pytest.approx(ctx.prefix_len + budget, abs=0.5)
    assert stored.nbytes < ctx.full.nbytes


def test_streaming_keeps_sinks_and_recent_window(ctx):
    stored = get_method("streaming_llm").compress(Request(ctx, 8.0))
    fates = stored.fates(0, 0)
    budget = round(ctx.doc_len / 8)
    expected = set(range(4)) | set(range(ctx.length - (budget - 4 + ctx.prefix_len), ctx.length))
    if ctx.prefix_len:
        expected = set(range(ctx.prefix_len)) | set(range(ctx.length - budget, ctx.length))
    assert set(fates) == expected


def test_eviction_keeps_the_top_scores(ctx):
    method = get_method("snapkv")
    req = Request(ctx, 4.0)
    scores = method.scores(req)
    stored = method.compress(req)
    budget = round(ctx.doc_len / 4)
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            kept = {i - ctx.prefix_len for i in stored.fates(layer, head) if i >= ctx.prefix_len}
            top = set(torch.topk(scores[layer][head], budget).indices.tolist())
            assert kept == top


def test_bad_ratio_and_unknown_options_are_refused(ctx):
    with pytest.raises(MethodError, match="ratio"):
        Request(ctx, 0.5)
    with pytest.raises(MethodError, match="no option"):
        get_method("snapkv", bogus=1)
    with pytest.raises(MethodError, match="unknown method"):
        get_method("nope")
    with pytest.raises(MethodError, match="question"):
        get_method("snapkv_question").compress(Request(ctx, 2.0, None))


def test_attention_matching_beats_its_own_key_selection(ctx):
    ev = evaluation(ctx, QUESTION, max_new_tokens=4)
    am = get_method("attention_matching").compress(Request(ctx, 4.0))
    topk = get_method("attention_topk").compress(Request(ctx, 4.0))
    am_err = head_errors(ctx.full.stored, am, ev.queries).mean_output
    topk_err = head_errors(ctx.full.stored, topk, ev.queries).mean_output
    assert am_err < topk_err
    assert set(am.meta["fit_s"]) == {"queries", "keys", "bias", "values"}
    assert len(am.meta["train_attn_output_rel_err"]) == ctx.lm.n_layers


@pytest.mark.parametrize("options", [
    {"key_selection": "omp"},
    {"scoring": "max"},
    {"chunk_size": 32},
    {"on_policy": True},
    {"query_source": "context"},
    {"query_source": "random", "max_queries": 64},
    {"query_source": "self_study", "self_study_tokens": 8},
])
def test_attention_matching_variants_run_and_help(ctx, options):
    ev = evaluation(ctx, QUESTION, max_new_tokens=4)
    stored = get_method("attention_matching", **options).compress(Request(ctx, 4.0))
    assert stored.kept_per_head().float().mean().item() == pytest.approx(ctx.prefix_len + ctx.doc_len / 4, abs=1)
    err = head_errors(ctx.full.stored, stored, ev.queries).mean_output
    assert 0 <= err < 1.0


def test_recompaction_takes_the_old_bias_into_account(ctx):
    """Compacting a compacted cache by 2x again lands near a direct 4x compaction,
    and far from what ignoring its bias would give."""
    q = repeat_queries(ctx)
    ev = evaluation(ctx, QUESTION, max_new_tokens=4)
    opts = AMOptions()
    L, H = ctx.lm.n_layers, ctx.lm.n_kv_heads
    half = compact_cache(ctx.full.stored, q, torch.full((L, H), ctx.doc_len // 2), opts, ctx.prefix_len)
    quarter = compact_cache(half, q, torch.full((L, H), ctx.doc_len // 4), opts, ctx.prefix_len)
    direct = compact_cache(ctx.full.stored, q, torch.full((L, H), ctx.doc_len // 4), opts, ctx.prefix_len)
    e_twice = head_errors(ctx.full.stored, quarter, ev.queries).mean_output
    e_direct = head_errors(ctx.full.stored, direct, ev.queries).mean_output
    assert e_twice < 2 * e_direct + 0.05


def test_budget_allocation_keeps_total_and_caps():
    shares = torch.tensor([[10.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    capped = cap_shares(shares)
    assert capped.mean().item() == pytest.approx(1.0, abs=1e-6)
    assert capped.max() <= 9.0 and capped.min() >= 1 / 7 - 1e-9
    budgets = allocate(shares, per_head=20, length=100)
    assert int(budgets.sum()) == 20 * 6
    assert budgets.min() >= 1 and budgets.max() <= 100
