"""Compression methods on a tiny random Llama: budgets, kept sets, invariants."""

from __future__ import annotations

import dataclasses
import pkgutil
import typing

import pytest
import torch

import kvlab.methods
from conftest import TINY_DOC
from kvlab.compression.budget_profiles import allocate, cap_shares
from kvlab.compression.interface import FAMILIES, Bf16Tolerance
from kvlab.compression.paper import Baseline, Paper
from kvlab.compression.solvers.compact import FitSettings, compact_block
from kvlab.context import prepare_context
from kvlab.methods import REGISTRY, MethodError, Request, get_method
from kvlab.methods.families.am_recipe import AMOptions, fitting_queries, reference_queries
from kvlab.methods.families.compaction import chunk_spans, compact_cache, split_budget
from kvlab.metrics import head_errors, percentile_levels, question_attention
from kvlab.pipeline import evaluation
from kvlab.queries import repeat_queries
from kvlab.runtime.attention import attend, group_queries
from kvlab.runtime.decode import extend, open_session

DOC = TINY_DOC
QUESTION = "w3 w5 w8"


# Methods without a per-token score of importance: they record none.
UNSCORED = {
    "kivi",
    "no_context",
    "random",
    "streaming_llm",
    "summarisation",
    "summary_am",
    "fp8_e4m3",
    "fp8_e5m2",
    "nvfp4",
    "fp4_e2m1",
    "turboquant",  # the engine formats evict the oldest tokens by default, as KIVI
    "simlayerkv",
    "cartridges",  # trained keys stand for no one token: nothing to score
}  # within a layer its scores are positions (initial + recent), as StreamingLLM's


@pytest.fixture(scope="module")
def ctx(tiny):
    return prepare_context(tiny, DOC)


def test_every_module_of_the_methods_package_registers_one_method_named_as_its_file():
    """Discovery (kvlab.compression.registry.discover): the package's files are the methods, one each;
    its subpackage of what the families share (kvlab.methods.families) registers none."""
    modules = list(pkgutil.iter_modules(kvlab.methods.__path__))
    files = sorted(info.name for info in modules if not info.ispkg)
    assert sorted(info.name for info in modules if info.ispkg) == ["families"]
    by_module: dict[str, list[str]] = {}
    for name, cls in REGISTRY.items():
        by_module.setdefault(cls.__module__, []).append(name)
    assert by_module == {f"kvlab.methods.{file}": [file] for file in files}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_declares_its_source_family_and_bf16_tolerance(name):
    cls = REGISTRY[name]
    assert isinstance(getattr(cls, "paper", None), (Paper, Baseline)), f"{name}: paper = Paper(...) or Baseline(...)"
    assert getattr(cls, "family", None) in FAMILIES, f"{name}: family is one of {', '.join(FAMILIES)}"
    assert getattr(cls, "bf16_tolerance", None) in typing.get_args(Bf16Tolerance), name
    # A baseline says it is one, and only a baseline.
    assert (cls.family == "baselines") == isinstance(cls.paper, Baseline), name


def fresh_logits(ctx, stored):
    return extend(ctx.lm, open_session(ctx.lm, stored), torch.tensor([5, 9, 11]))


# At ratio 1 these return the full cache before any fit: their keep-all case is checked through
# the fit itself (test_a_keep_all_fit_reproduces_the_block), their fit below ratio 1 after it.
FITTED = {"attention_matching", "summary_am"}


@pytest.mark.parametrize("name", sorted(set(REGISTRY) - FITTED))
def test_ratio_one_keeps_everything_and_reproduces_logits(ctx, name):
    if getattr(REGISTRY[name], "fixed_budget", False):
        pytest.skip("keeps a fixed amount whatever the ratio")
    stored = get_method(name).compress(Request(ctx, 1.0, QUESTION))
    assert stored.logical_len == ctx.length
    assert stored.kept_per_head().min() == ctx.length
    assert torch.allclose(fresh_logits(ctx, stored), fresh_logits(ctx, ctx.full.stored), atol=1e-4)


def test_a_keep_all_fit_reproduces_the_block(ctx):
    """The solver asked to keep every key (t = T; the method itself skips this case): each key is
    kept once, the attention output on the fitting queries is the block's (the exact solution,
    beta = 0 and the original values, is available to the least squares), and with enough
    projected-gradient steps the bias fit gives back the block's attention mass."""
    scale = ctx.lm.head_dim**-0.5
    for layer, q in enumerate(reference_queries(ctx, AMOptions(), None)):
        grouped = fitting_queries(q, ctx.lm.n_kv_heads, AMOptions())
        keys, values = ctx.full.keys[layer], ctx.full.values[layer]
        fit = compact_block(grouped, keys, values, keys.shape[1], fit=FitSettings(nnls_iters=50))
        assert torch.equal(fit.index.sort(dim=-1).values, torch.arange(keys.shape[1]).expand_as(fit.index))
        logits = grouped.double() @ keys.double().transpose(1, 2) * scale
        compact = grouped.double() @ fit.keys.double().transpose(1, 2) * scale + fit.bias.double().unsqueeze(1)
        want = torch.softmax(logits, dim=-1) @ values.double()
        got = torch.softmax(compact, dim=-1) @ fit.values.double()
        torch.testing.assert_close(got, want, atol=5e-3 * float(want.abs().max()), rtol=0)  # float32 ridge solves
        assert (torch.logsumexp(compact, dim=-1) - torch.logsumexp(logits, dim=-1)).abs().max() < 0.01


def test_attention_matching_fit_is_the_least_squares_fit_of_the_blocks_output(ctx):
    """At 4x, per layer and KV head: the compact keys are original keys at their own positions
    (RoPE phases kept); the biases stay in the published [-3, 3] and cut the mass error of the
    same keys at beta = 0; the values give the fitting queries the output of a brute-force
    float64 ridge least-squares solve (the solvers' ridge convention: 1e-6 of the Gram's mean
    diagonal), a residual no larger than it, no smaller than the unridged optimum, and far below
    the kept keys' own values."""
    opts = AMOptions()
    am = get_method("attention_matching").compress(Request(ctx, 4.0))
    scale = ctx.lm.head_dim**-0.5
    for layer, q in enumerate(reference_queries(ctx, opts, None)):
        grouped = fitting_queries(q, ctx.lm.n_kv_heads, opts).double()
        view = am.layer_view(layer)
        keys, values = ctx.full.keys[layer].double(), ctx.full.values[layer].double()
        for head in range(ctx.lm.n_kv_heads):
            real = view.token_index[head] >= 0
            index = view.token_index[head, real]
            assert real.sum() == round(ctx.doc_len / 4)
            assert torch.equal(view.keys[head, real].double(), keys[head, index])
            bias, fitted = view.bias[head, real].double(), view.values[head, real].double()
            assert (bias.abs() <= 3 + 1e-6).all()
            logits = grouped[head] @ keys[head].T * scale  # [n, T]
            target = torch.softmax(logits, dim=-1) @ values[head]
            # Mass, each query measured against its largest logit (as the solvers weigh it).
            shift = logits.amax(dim=-1, keepdim=True)
            mass = torch.exp(logits - shift).sum(dim=-1)
            kept = torch.exp(logits[:, index] - shift)
            mass_error = lambda w: float((kept @ w - mass).norm() / mass.norm())  # noqa: E731
            assert mass_error(bias.exp()) < 0.6 * mass_error(torch.ones_like(bias))
            # Values.
            x = torch.softmax(grouped[head] @ keys[head, index].T * scale + bias, dim=-1)
            gram = x.T @ x
            ridge = 1e-6 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
            best = torch.linalg.solve(gram + ridge, x.T @ target)
            optimum = torch.linalg.lstsq(x, target).solution
            residual = lambda v: float((x @ v - target).norm())  # noqa: E731
            torch.testing.assert_close(x @ fitted, x @ best, atol=1e-2 * float(target.abs().max()), rtol=0)
            assert residual(optimum) - 1e-9 <= residual(fitted) <= 1.01 * residual(best)
            assert residual(fitted) < 0.05 * residual(values[head, index])


@pytest.mark.parametrize("name", ["attention_matching", "summary_am"])
def test_near_ratio_one_the_fitted_cache_still_reproduces_its_reference(ctx, name):
    """At ratio 1 the solver and the summariser are skipped (the full cache is returned);
    here they run. Attention Matching one step below ratio 1 must stay as close to the full
    cache as its exact solution (far closer than evicting the same few keys); summary + AM
    must stay close to a fresh prefill of its own summary."""
    ratio = ctx.doc_len / (ctx.doc_len - 6)
    stored = get_method(name).compress(Request(ctx, ratio))
    assert stored.meta["fit_s"]["values"] > 0  # the value fit ran
    if name == "attention_matching":
        reference = ctx.full.stored
        evicted = get_method("attention_topk").compress(Request(ctx, ratio))
        bound = (fresh_logits(ctx, evicted) - fresh_logits(ctx, reference)).abs().max().item() / 10
    else:
        reference = prepare_context(ctx.lm, stored.meta["summary"]).full.stored
        assert stored.logical_len == reference.logical_len
        bound = 0.05 * fresh_logits(ctx, reference).abs().max().item()
    assert (fresh_logits(ctx, stored) - fresh_logits(ctx, reference)).abs().max().item() < bound


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("ratio", [2.0, 8.0])
def test_every_method_meets_its_budget(ctx, name, ratio):
    if getattr(REGISTRY[name], "fixed_budget", False):
        pytest.skip("keeps a fixed amount whatever the ratio")
    assert_meets_budget(ctx, name, ratio, get_method(name).compress(Request(ctx, ratio, QUESTION)))


def assert_meets_budget(ctx, name, ratio, stored):
    """``stored``, method ``name``'s cache of ``ctx`` at ``ratio``, keeps its budget (also used by
    tests/test_architectures.py)."""
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


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_a_document_no_longer_than_the_observation_window_is_still_compressed(tiny, name):
    """40 tokens, no template, a 64-token window: every token is in the window, none is left to pool
    (this crashed in avg_pool1d on an empty row); the cache still keeps the budget."""
    short = prepare_context(tiny, " ".join(f"w{i % 60}" for i in range(40)))
    assert short.prefix_len == 0 and short.doc_len <= get_method(name).options.window
    assert_meets_budget(short, name, 2.0, get_method(name).compress(Request(short, 2.0, None)))


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        # 96 tokens, no template; 8x keeps 12: the 4 sinks and the 8 newest.
        ("ctx", set(range(4)) | set(range(88, 96))),
        # A 2-token template, then the same 96: the template (2 of the 4 sinks) stays outside the
        # budget of 12, which keeps the document's first 2 tokens (the other sinks) and its 10 newest.
        ("templated", set(range(4)) | set(range(88, 98))),
    ],
)
def test_streaming_keeps_sinks_and_recent_window(request, context, expected):
    ctx = request.getfixturevalue(context)
    stored = get_method("streaming_llm").compress(Request(ctx, 8.0))
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            assert set(stored.fates(layer, head)) == expected


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


@pytest.mark.parametrize(
    "options",
    [
        {"key_selection": "omp"},
        {"scoring": "max"},
        {"compaction_chunk": 32},
        {"on_policy": True},
        {"query_source": "context"},
        {"query_source": "random", "max_queries": 64},
        {"query_source": "self_study", "self_study_tokens": 8},
    ],
)
def test_attention_matching_variants_beat_eviction_on_the_same_queries(ctx, options):
    """Each variant meets the budget and cuts the held-out error of keeping the keys its
    own reference queries attend to most (attention_topk with the same query knobs) by far."""
    ev = evaluation(ctx, QUESTION, max_new_tokens=4)
    stored = get_method("attention_matching", **options).compress(Request(ctx, 4.0))
    assert stored.kept_per_head().float().mean().item() == pytest.approx(ctx.prefix_len + ctx.doc_len / 4, abs=1)
    shared = {
        k: v
        for k, v in options.items()
        if k in {f.name for f in dataclasses.fields(REGISTRY["attention_topk"].Options)}
    }
    evicted = get_method("attention_topk", **shared).compress(Request(ctx, 4.0))
    err = head_errors(ctx.full.stored, stored, ev.queries).mean_output
    err_evicted = head_errors(ctx.full.stored, evicted, ev.queries).mean_output
    assert err < 0.25 * err_evicted


def test_chunks_cover_the_document_and_share_each_heads_budget_in_proportion():
    """Chunked compaction (``compaction_chunk``): spans of the chunk size, the last one shorter, and each
    head's budget shared by the chunks' lengths, worked by hand: 10 keys over chunks of 40/40/20 tokens
    are 4/4/2; 7 keys (2.8/2.8/1.4 in proportion) round up to 3/3 and the last takes the 1 left."""
    assert chunk_spans(100, 40) == [(0, 40), (40, 80), (80, 100)]
    assert chunk_spans(100, 0) == chunk_spans(100, 100) == chunk_spans(100, 4096) == [(0, 100)]
    shares = split_budget(torch.tensor([10, 7]), chunk_spans(100, 40), 100)
    assert [s.tolist() for s in shares] == [[4, 3], [4, 3], [2, 1]]


def test_fitting_queries_are_the_groups_queries_seeded_subsample():
    torch.manual_seed(0)
    q = torch.randn(4, 10, 16)  # 4 query heads over 2 KV heads, 10 queries each
    opts = AMOptions(max_queries=7, seed=3)
    got = fitting_queries(q, 2, opts)
    keep = torch.randperm(20, generator=torch.Generator().manual_seed(3))[:7].sort().values
    for kv in range(2):
        group = torch.cat([q[2 * kv], q[2 * kv + 1]])  # the two query heads that read KV head kv
        assert torch.equal(got[kv], group[keep])
    whole = torch.stack([torch.cat([q[0], q[1]]), torch.cat([q[2], q[3]])])
    assert torch.equal(fitting_queries(q, 2, AMOptions(max_queries=20)), whole)  # under the cap: every query


def test_attention_topk_keeps_what_attention_matching_selects_from_the_same_subsample(ctx):
    """Both draw the same query subsample in every layer, so HighestAttnKeys keeps the same keys;
    and those are the top scores over an independently drawn subsample."""
    opts = {"max_queries": 16, "seed": 5}
    req = Request(ctx, 4.0)
    am = get_method("attention_matching", **opts).compress(req)
    topk = get_method("attention_topk", **opts).compress(req)
    budget = round(ctx.doc_len / 4)
    for layer, q in enumerate(reference_queries(ctx, AMOptions(), None)):
        grouped = group_queries(q, ctx.lm.n_kv_heads)
        keep = torch.randperm(grouped.shape[1], generator=torch.Generator().manual_seed(5))[:16]
        sub = grouped[:, keep]
        keys = ctx.full.keys[layer][:, ctx.prefix_len :]
        weights = torch.softmax(sub @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5, dim=-1)  # [H_kv, 16, T]
        rms = weights.pow(2).mean(dim=1).sqrt()
        for head in range(ctx.lm.n_kv_heads):
            expected = set((torch.topk(rms[head], budget).indices + ctx.prefix_len).tolist())
            assert set(am.fates(layer, head)) == expected
            assert set(topk.fates(layer, head)) == expected


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


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_importance_is_recorded_only_when_asked_and_only_by_scoring_methods(ctx, name):
    stored = get_method(name).compress(Request(ctx, 4.0, QUESTION, record_importance=True))
    if name in UNSCORED:
        assert stored.importance is None
        return
    assert len(stored.importance) == ctx.lm.n_layers
    for imp in stored.importance:
        assert imp.shape == (ctx.lm.n_kv_heads, ctx.length) and imp.dtype == torch.float32
        assert not torch.isnan(imp).any()  # every document token has a score (no template here)
    plain = get_method(name).compress(Request(ctx, 4.0, QUESTION))
    # A diagnostic: not asked, not there; never stored bytes, never in the details.
    assert plain.importance is None and "importance" not in stored.meta
    assert plain.nbytes == stored.nbytes and plain.breakdown() == stored.breakdown()


@pytest.mark.parametrize("name", ["snapkv", "h2o", "attention_matching"])
def test_kept_tokens_are_the_most_important(templated, name):
    ctx = templated
    stored = get_method(name).compress(Request(ctx, 4.0, QUESTION, record_importance=True))
    budget, prefix = round(ctx.doc_len / 4), ctx.prefix_len
    for layer, imp in enumerate(stored.importance):
        assert imp.shape == (ctx.lm.n_kv_heads, ctx.length)
        assert torch.isnan(imp[:, :prefix]).all() and not torch.isnan(imp[:, prefix:]).any()
        for head in range(ctx.lm.n_kv_heads):
            kept = {i for i in stored.fates(layer, head) if i >= prefix}
            top = set((torch.topk(imp[head, prefix:], budget).indices + prefix).tolist())
            assert kept == top


def test_attention_matching_with_omp_still_scores_every_document_token(templated):
    stored = get_method("attention_matching", key_selection="omp", compaction_chunk=32).compress(
        Request(templated, 4.0, record_importance=True)
    )
    for imp in stored.importance:
        assert torch.isnan(imp[:, : templated.prefix_len]).all()
        assert torch.isfinite(imp[:, templated.prefix_len :]).all() and (imp[:, templated.prefix_len :] >= 0).all()


def test_question_attention_is_a_softmax_over_the_cache():
    torch.manual_seed(0)
    q, k = torch.randn(4, 3, 16), torch.randn(2, 5, 16)  # 4 query heads over 2 KV heads, 3 queries, 5 keys
    (weights,) = question_attention([q], [k])
    direct = torch.softmax(q @ k.repeat_interleave(2, dim=0).transpose(1, 2) / 4.0, dim=-1)  # [4, 3, 5]
    assert torch.allclose(weights, direct.reshape(2, 2 * 3, 5).mean(dim=1), atol=1e-6)


def test_question_attention_on_the_document_is_its_share_of_the_mass(templated):
    ctx, prefix = templated, templated.prefix_len
    ev = evaluation(ctx, QUESTION, max_new_tokens=4)
    for q, k, weights in zip(ev.queries, ctx.full.keys, question_attention(ev.queries, ctx.full.keys)):
        assert weights.shape == (ctx.lm.n_kv_heads, ctx.length)
        assert torch.allclose(weights.sum(dim=-1), torch.ones(ctx.lm.n_kv_heads), atol=1e-5)
        grouped = q.reshape(ctx.lm.n_kv_heads, -1, q.shape[-1])
        share = torch.exp(attend(grouped, k[:, prefix:], k[:, prefix:]).lse - attend(grouped, k, k).lse)
        doc = weights[:, prefix:].sum(dim=-1)
        assert (doc <= 1 + 1e-6).all() and torch.allclose(doc, share.mean(dim=-1), atol=1e-5)


def test_percentile_levels_rank_within_each_head():
    nan = float("nan")
    scores = torch.tensor([[0.1, 5.0, nan, 0.1, 1e9], [nan, nan, nan, nan, nan], [3.0, 2.0, 1.0, 0.0, float("inf")]])
    levels = percentile_levels(scores)
    assert levels.dtype == torch.uint8
    first = levels[0].tolist()
    assert first[2] == 0 and first[0] == first[3] and 0 < first[0] < first[1] < first[4] <= 255  # ties share a level
    assert levels[1].tolist() == [0] * 5
    # Ranks, not values: five distinct scores spread evenly, (rank + 1/2) / 5 of the byte range.
    assert levels[2].tolist() == [179, 128, 77, 26, 230]


def test_percentile_levels_of_many_heads_match_counts_token_by_token():
    # Layers and heads at once, with many ties, unscored tokens and an infinite score: each level
    # against the token's own counts of scored values below and up to it (in float32, as stored).
    scores = torch.randint(0, 6, (2, 3, 40), generator=torch.Generator().manual_seed(0)).float()
    scores[0, 1, ::3] = float("nan")
    scores[1, 2] = float("nan")
    scores[1, 0, 5] = float("inf")
    levels = percentile_levels(scores)
    assert levels.shape == scores.shape
    for row, got in zip(scores.reshape(-1, 40).tolist(), levels.reshape(-1, 40).tolist()):
        valid = [v for v in row if v == v]
        for v, level in zip(row, got):
            if v != v:
                assert level == 0
                continue
            counts = sum(u < v for u in valid) + sum(u <= v for u in valid)
            p = torch.tensor(counts, dtype=torch.float32) / (2 * len(valid))
            assert level == min(255, 1 + int(torch.floor(p * 255))), (row, v)


def test_mass_ratio_is_the_share_of_the_full_mass(ctx):
    """Keeping every key draws the full mass (ratio 1); evicting loses mass, and the
    ratio is the evicted cache's attention mass over the full one's, query by query."""
    ev = evaluation(ctx, QUESTION, max_new_tokens=2)
    full = ctx.full.stored
    assert torch.allclose(head_errors(full, full, ev.queries).mass_ratio, torch.ones(1), atol=1e-5)
    half = get_method("streaming_llm").compress(Request(ctx, 2.0))
    errors = head_errors(full, half, ev.queries)
    assert (errors.mass_ratio < 1).all() and (errors.mass_ratio > 0).all()
    # Evicting only removes mass: the relative error is exactly 1 - ratio.
    assert torch.allclose(errors.mass, 1 - errors.mass_ratio, atol=1e-5)
    q = ev.queries[0]
    kept, every = half.layer_view(0), full.layer_view(0)
    grouped = group_queries(q, kept.keys.shape[0])
    share = torch.exp(
        attend(grouped, kept.keys, kept.values, bias=kept.bias).lse
        - attend(grouped, every.keys, every.values, bias=every.bias).lse
    )
    assert torch.allclose(errors.mass_ratio[0], share.mean(-1), atol=1e-5)


def test_attention_matching_with_kvzip_keys_keeps_kvzips_keys_and_fits_them(templated):
    """key_selection=kvzip keeps, in every head, what KVzip keeps with the same uniform budget;
    the values are then the solver's ridge least-squares fit of the block's output on the
    reference queries (at least as good as a plain ridge solve, far better than the kept
    keys' own values)."""
    ctx = templated
    am = get_method("attention_matching", key_selection="kvzip").compress(Request(ctx, 4.0))
    kvzip = get_method("kvzip", prune="head").compress(Request(ctx, 4.0))
    prefix = ctx.prefix_len
    for layer, q in enumerate(reference_queries(ctx, AMOptions(), None)):
        grouped = fitting_queries(q, ctx.lm.n_kv_heads, AMOptions())
        view = am.layer_view(layer)
        for head in range(ctx.lm.n_kv_heads):
            assert set(am.fates(layer, head)) == set(kvzip.fates(layer, head))
            doc = view.token_index[head] >= prefix
            keys, values, bias = view.keys[head, doc], view.values[head, doc], view.bias[head, doc]
            full_keys = ctx.full.keys[layer][head, prefix:]
            scale = keys.shape[-1] ** -0.5
            y = torch.softmax(grouped[head] @ full_keys.T * scale, dim=-1) @ ctx.full.values[layer][head, prefix:]
            x = torch.softmax(grouped[head] @ keys.T * scale + bias, dim=-1)
            gram = (x.T @ x).double()
            ridge = 1e-6 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
            best = torch.linalg.solve(gram + ridge, (x.T @ y).double()).float()
            own = ctx.full.values[layer][head, view.token_index[head, doc]]
            residual = lambda v: float((x @ v - y).norm())  # noqa: E731
            assert residual(values) <= 1.05 * residual(best) + 1e-4
            assert residual(values) < 0.5 * residual(own)


def test_attention_matching_reports_its_numerics_for_every_layer_and_head(ctx):
    """The run's details carry, per layer and KV head, the solves that fell back and the
    non-finite results replaced: zero everywhere on a well-posed fit, never absent."""
    stored = get_method("attention_matching").compress(Request(ctx, 4.0, None))
    shape = [[0] * ctx.lm.n_kv_heads for _ in range(ctx.lm.n_layers)]
    assert stored.meta["solver_fallbacks"] == shape
    assert stored.meta["nonfinite_replaced"] == shape
