"""Attention Matching's retrieval knobs (issue #22), each against an independent computation.

- the anchored ridge (``value_anchor``) against a direct float64 solve of
  ``argmin ||X V - Y||^2 + lambda ||V - V_S||^2``, in the primal and the dual regime;
- the bias-only fit (``value_fit=original``): the stored values are the kept
  tokens' own, and the block's attention equals softmax attention over those
  original values with the fitted beta;
- query weights: a weight of 2 is the query counted twice;
- the union of KVzip's and HighestAttnKeys' keys: each part is the top of its own ranking;
- self-study queries mixed in and their validation;
- exact tokens inside the fit (issue #33, ``exact_share``): all exact is the block itself or eviction,
  and with some exact keys the biases and values are the brute-force box least squares of the residual
  mass and the least squares of the residual output; in the method, the exact keys are KVzip's own;
- document budgets (``budgets=document``): the concentration against the entropy by hand, the total
  kept, more keys to more concentrated heads.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvlab.compression.solvers.compact import FitSettings, compact_block
from kvlab.compression.solvers.keys import OMP, ExactFirst, GivenScores, GivenScoresUnion, HighestAttn
from kvlab.compression.solvers.scores import score_keys
from kvlab.context import prepare_context
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.families.am_recipe import AMOptions, concentration, document_budgets, fitting_queries, mixed_queries
from kvlab.methods.families.scorers import KVzipOptions, kvzip_scores
from kvlab.queries import repeat_queries, self_study_queries
from kvlab.runtime.attention import attend

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(96))


@pytest.fixture(scope="module")
def ctx(tiny):
    return prepare_context(tiny, DOC)


def _qkv(B: int, n: int, T: int, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, n, d, generator=gen) * 2.0,
        torch.randn(B, T, d, generator=gen),
        torch.randn(B, T, d, generator=gen),
    )


def _compact_attention(q, cb):
    """X = softmax(q Ck^T / sqrt(d) + beta), written out here (float64)."""
    logits = q.double() @ cb.keys.double().transpose(1, 2) / math.sqrt(q.shape[-1]) + cb.bias.double().unsqueeze(1)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("n", [64, 6])  # more queries than kept keys (primal), fewer (dual)
@pytest.mark.parametrize("lam", [1e-2, 1.0])
def test_anchored_ridge_is_the_direct_solve_toward_the_kept_values(n, lam):
    q, k, v = _qkv(B=2, n=n, T=30, seed=1)
    t = 10
    cb = compact_block(q, k, v, t, fit=FitSettings(value_anchor=lam))
    x = _compact_attention(q, cb)  # [B, n, t]
    y = torch.softmax(q.double() @ k.double().transpose(1, 2) / 4.0, dim=-1) @ v.double()
    own = v.double().gather(1, cb.index.unsqueeze(-1).expand(-1, -1, v.shape[-1]))
    gram = x.transpose(1, 2) @ x
    # lambda is relative: times the Gram's mean diagonal.
    scale = torch.diagonal(gram, dim1=-2, dim2=-1).mean(-1).view(-1, 1, 1)
    eye = torch.eye(t, dtype=torch.float64)
    direct = torch.linalg.solve(gram + lam * scale * eye, x.transpose(1, 2) @ y + lam * scale * own)
    torch.testing.assert_close(cb.values.double(), direct, rtol=2e-3, atol=2e-4)


def test_a_key_no_query_reads_keeps_its_own_value_under_the_anchor():
    # Keys far from every query (a needle that few queries read): their fitted values stay the originals.
    q, k, v = _qkv(B=1, n=4, T=12, seed=2)
    k[0, :3] = -50.0 * q[0].mean(0) / q[0].mean(0).norm()  # attention to them underflows for every query
    key_scores = torch.zeros(1, 12)
    key_scores[0, :6] = 1.0  # keep the three unread keys and three others
    anchored = compact_block(q, k, v, 6, keys=GivenScores(key_scores), fit=FitSettings(value_anchor=1e-3))
    plain = compact_block(q, k, v, 6, keys=GivenScores(key_scores))
    unread = anchored.index[0] < 3
    assert int(unread.sum()) == 3
    torch.testing.assert_close(anchored.values[0, unread], v[0, anchored.index[0, unread]], rtol=1e-4, atol=1e-5)
    # The published fit pulls them toward 0 instead (the minimum-norm solution).
    assert float(plain.values[0, unread].abs().max()) < 1e-3


def test_bias_only_keeps_the_original_values_and_attends_over_them():
    q, k, v = _qkv(B=3, n=40, T=24, seed=3)
    budgets = torch.tensor([8, 5, 8])
    cb = compact_block(q, k, v, 8, budgets=budgets, fit=FitSettings(value_fit="original"))
    fitted = compact_block(q, k, v, 8, budgets=budgets)
    assert torch.equal(cb.index, fitted.index)
    torch.testing.assert_close(cb.bias, fitted.bias)  # beta does not depend on the values
    real = cb.index >= 0
    original = v.gather(1, cb.index.clamp_min(0).unsqueeze(-1).expand(-1, -1, v.shape[-1]))
    assert torch.equal(cb.values[real], original[real])
    # The compact block's output: softmax attention with beta over the original values (eager, float64).
    eager = _compact_attention(q, cb) @ torch.where(real.unsqueeze(-1), original, 0).double()
    torch.testing.assert_close(attend(q, cb.keys, cb.values, cb.bias).output.double(), eager, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="value_fit"):
        FitSettings(value_fit="zero")


@pytest.mark.parametrize("key_selection", [HighestAttn(), OMP()], ids=["highest_attn", "omp"])
def test_a_query_of_weight_two_is_that_query_counted_twice(key_selection):
    q, k, v = _qkv(B=2, n=20, T=24, seed=4)
    weights = torch.ones(2, 20)
    weights[:, 5] = 2.0
    copies = list(range(20)) + [5]
    weighted = compact_block(q, k, v, 8, query_weights=weights, keys=key_selection)
    repeated = compact_block(q[:, copies], k, v, 8, keys=key_selection)
    assert torch.equal(weighted.index, repeated.index)
    torch.testing.assert_close(weighted.bias, repeated.bias, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(weighted.values, repeated.values, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="query_weights"):
        compact_block(q, k, v, 8, query_weights=-weights)


def test_the_union_takes_each_rankings_top_keys():
    q, k, v = _qkv(B=2, n=30, T=40, seed=5)
    outside = torch.randn(2, 40, generator=torch.Generator().manual_seed(6))
    budgets = torch.tensor([10, 7])
    cb = compact_block(q, k, v, 10, budgets=budgets, keys=GivenScoresUnion(outside, 0.5))
    attention = score_keys(q, k)
    for h, t in enumerate(budgets.tolist()):
        first = math.ceil(0.5 * t)
        chosen = set(cb.index[h, :t].tolist())
        from_outside = set(outside[h].topk(first).indices.tolist())
        assert from_outside <= chosen
        rest = attention[h].clone()
        rest[list(from_outside)] = float("-inf")
        assert chosen - from_outside == set(rest.topk(t - first).indices.tolist())


def test_mixed_queries_are_both_sources_capped_and_weighted(ctx):
    opts = AMOptions(self_study_weight=0.5, self_study_tokens=8, max_queries=40)
    rep, ss = repeat_queries(ctx)[0], self_study_queries(ctx, 8)[0]
    grouped, weights = mixed_queries(rep, ss, ctx.lm.n_kv_heads, opts)
    first = fitting_queries(rep, ctx.lm.n_kv_heads, opts)
    assert torch.equal(grouped[:, : first.shape[1]], first)
    assert torch.equal(grouped[:, first.shape[1] :], fitting_queries(ss, ctx.lm.n_kv_heads, opts))
    assert bool((weights[:, : first.shape[1]] == 1).all()) and bool((weights[:, first.shape[1] :] == 0.5).all())


def test_self_study_and_on_policy_combine_in_the_sweep(ctx):
    """The paper's recipe, self-study with the repeat and re-read on-policy, runs (once refused): each
    layer fits on the repeat's queries and self-study's, each capped (the per-head counts), each
    self-study conversation read on its own after the document through the layers fitted before."""
    from kvlab.queries import self_study

    opts = {"on_policy": True, "self_study_weight": 2.0, "self_study_tokens": 8, "max_queries": 60}
    stored = get_method("attention_matching", **opts).compress(Request(ctx, 4.0))
    g = ctx.lm.n_heads // ctx.lm.n_kv_heads
    n_repeat = repeat_queries(ctx)[0].shape[1]
    n_study = sum(turn.numel() for turn in self_study(ctx, 8).turns)
    assert stored.meta["queries_per_head"] == [min(60, g * n_repeat) + min(60, g * n_study)] * ctx.lm.n_layers
    assert int(stored.kept_per_head().max()) <= round(ctx.doc_len / 4) + ctx.prefix_len
    # Without self-study the same sweep fits on fewer queries, to another cache.
    plain = get_method("attention_matching", on_policy=True, max_queries=60).compress(Request(ctx, 4.0))
    assert plain.meta["queries_per_head"] == [min(60, g * n_repeat)] * ctx.lm.n_layers
    assert not torch.equal(plain.layer_view(1).values, stored.layer_view(1).values)


def test_self_study_text_is_kept_in_the_result_store_and_read_back_the_same(ctx, monkeypatch):
    """A document's self-study conversations are generated once and kept (kvlab.results): a new context of
    the same document (a restart, another process) reads them back instead of generating, and its queries
    are the same."""
    from kvlab import queries

    first = queries.self_study(prepare_context(ctx.lm, ctx.text), 8)  # generated: this test's store is empty
    monkeypatch.setattr(queries, "greedy", lambda *a, **k: pytest.fail("generated again"))
    again = queries.self_study(prepare_context(ctx.lm, ctx.text), 8)
    assert [t.tolist() for t in again.turns] == [t.tolist() for t in first.turns]
    for layer, q in enumerate(first.queries):
        assert torch.equal(again.queries[layer], q)


def test_the_retrieval_knobs_compress_within_budget_and_refuse_contradictions(ctx):
    budget = round(ctx.doc_len / 4)
    for options in (
        {"value_fit": "original"},
        {"value_anchor": 0.1},
        {"self_study_weight": 1.0, "self_study_tokens": 8},
        {"key_selection": "kvzip_union"},
        {"key_selection": "kvzip", "value_fit": "original"},
    ):
        stored = get_method("attention_matching", **options).compress(Request(ctx, 4.0))
        assert int(stored.kept_per_head().max()) <= budget + ctx.prefix_len, options
    original = get_method("attention_matching", value_fit="original").compress(Request(ctx, 4.0))
    for layer in range(ctx.lm.n_layers):
        view = original.layer_view(layer)
        for h in range(ctx.lm.n_kv_heads):
            real = view.token_index[h] >= 0
            tokens = view.token_index[h, real]
            assert torch.equal(view.values[h, real], ctx.full.values[layer][h, tokens])
    union = get_method("attention_matching", key_selection="kvzip_union").compress(Request(ctx, 4.0))
    scores = kvzip_scores(Request(ctx, 4.0), KVzipOptions())
    for layer in range(ctx.lm.n_layers):
        view = union.layer_view(layer)
        for h in range(ctx.lm.n_kv_heads):
            kept = set(view.token_index[h][view.token_index[h] >= 0].tolist())
            top = scores[layer][h].topk(math.ceil(0.5 * budget)).indices + ctx.prefix_len
            assert set(top.tolist()) <= kept
    for bad, match in (
        ({"value_fit": "original", "value_anchor": 0.1}, "value_anchor"),
        ({"self_study_weight": 1.0, "query_source": "self_study"}, "self_study_weight"),
        ({"kvzip_share": 1.5}, "kvzip_share"),
        ({"value_anchor": -1.0}, "value_anchor"),
    ):
        with pytest.raises(MethodError, match=match):
            get_method("attention_matching", **bad)


def test_the_retrieval_knobs_stay_on_the_models_device(monkeypatch: pytest.MonkeyPatch):
    """Under kvlab.testing.fake_cuda: no op of the new paths mixes devices (see tests/test_device_mixing.py)."""
    from kvlab.context_store import CONTEXTS
    from kvlab.runtime.model import LoadedModel
    from kvlab.testing.device_suite import DOCUMENT, suite_model
    from kvlab.testing.fake_cuda import FAKE_DEVICE, fake_cuda, to_fake_cuda

    monkeypatch.setenv("KVLAB_KERNELS", "torch")
    lm = suite_model(name="fake-cuda-am-knobs")
    to_fake_cuda(lm.model)
    lm = LoadedModel(lm.name, lm.model, lm.tokenizer, FAKE_DEVICE, lm.dtype)
    try:
        with fake_cuda() as mode:
            ctx = CONTEXTS.get(lm, DOCUMENT)
            for options in (
                {"value_fit": "original", "key_selection": "kvzip_union"},
                {"value_anchor": 0.1, "self_study_weight": 0.5, "self_study_tokens": 8},
                {"on_policy": True, "self_study_weight": 0.5, "self_study_tokens": 8},
            ):
                get_method("attention_matching", **options).compress(Request(ctx, 4.0, record_importance=True))
        assert mode.on_cuda > 0
    finally:
        CONTEXTS.forget(lm)


# --- exact tokens inside the fit (issue #33) ------------------------------------------------------


def _exact_block(seed: int = 0, T: int = 10, n: int = 40, d: int = 4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, d, generator=g, dtype=torch.float64).float()
    k = torch.randn(1, T, d, generator=g, dtype=torch.float64).float()
    v = torch.randn(1, T, 3, generator=g, dtype=torch.float64).float()
    order = torch.randn(1, T, generator=g, dtype=torch.float64).float()  # the exact keys' ranking
    return q, k, v, order


def test_exact_share_one_at_full_budget_is_the_block_itself():
    q, k, v, order = _exact_block()
    out = compact_block(q, k, v, k.shape[1], keys=ExactFirst(HighestAttn(), 1.0, order))
    assert bool(out.exact.all())
    assert torch.equal(out.values, v.gather(1, out.index.unsqueeze(-1).expand(-1, -1, 3)))
    assert torch.equal(out.bias, torch.zeros_like(out.bias))
    ref = attend(q.double(), k.double(), v.double())
    got = attend(q.double(), out.keys.double(), out.values.double(), out.bias.double())
    assert torch.allclose(got.output, ref.output, atol=1e-6) and torch.allclose(got.lse, ref.lse, atol=1e-6)


def test_exact_share_one_below_the_budget_is_eviction_by_the_exact_scores():
    q, k, v, order = _exact_block(1)
    out = compact_block(q, k, v, 4, keys=ExactFirst(HighestAttn(), 1.0, order))
    assert set(out.index[0].tolist()) == set(order[0].topk(4).indices.tolist())
    assert torch.equal(out.values, v.gather(1, out.index.unsqueeze(-1).expand(-1, -1, 3)))
    assert torch.equal(out.bias, torch.zeros_like(out.bias))


def _box_lstsq(m: torch.Tensor, z: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """argmin ||m w - z|| with lo <= w <= hi by brute force over every active set (each weight at a bound
    or free): the feasible stationary point of least cost. m [n, p] float64, p small."""
    best, best_cost = None, float("inf")
    for choice in itertools.product((0, 1, 2), repeat=m.shape[1]):  # 0: at lo, 1: at hi, 2: free
        w = torch.tensor([lo if c == 0 else hi for c in choice], dtype=torch.float64)
        free = [i for i, c in enumerate(choice) if c == 2]
        if free:
            fixed = [i for i in range(m.shape[1]) if i not in free]
            rhs = z - m[:, fixed] @ w[fixed]
            w[free] = torch.linalg.lstsq(m[:, free], rhs.unsqueeze(-1)).solution.squeeze(-1)
        if bool((w >= lo - 1e-12).all()) and bool((w <= hi + 1e-12).all()):
            cost = float((m @ w - z).square().sum())
            if cost < best_cost:
                best, best_cost = w, cost
    return best


def test_exact_keys_fit_only_the_residual_brute_force():
    """One head: 2 exact keys of 5 slots (share 0.4) by the given ranking, 3 compact keys chosen by RMS
    attention among the rest; the biases are the box-bounded least squares of the residual mass, the
    values the least squares of the residual output, recomputed here in float64 from the definitions."""
    q, k, v, order = _exact_block(2)
    out = compact_block(
        q, k, v, 5, keys=ExactFirst(HighestAttn(), 0.4, order), fit=FitSettings(nnls_iters=400, ridge=0.0)
    )
    qd, kd, vd = q[0].double(), k[0].double(), v[0].double()
    s = qd @ kd.T / math.sqrt(4)  # [n, T]
    exact = order[0].topk(2).indices.tolist()
    a = torch.softmax(s, -1)
    rms = a.square().mean(0).sqrt()
    rms[exact] = -1
    compact = rms.topk(3).indices.tolist()
    assert out.exact[0].tolist() == [True, True, False, False, False]
    assert set(out.index[0, :2].tolist()) == set(exact) and set(out.index[0, 2:].tolist()) == set(compact)
    # The mass, as the solver weighs it: each query's equation scaled by its largest logit's exp.
    phi = torch.exp(s - s.max(-1, keepdim=True).values)
    residual = phi.sum(-1) - phi[:, exact].sum(-1)
    cols = out.index[0, 2:].tolist()
    w = _box_lstsq(phi[:, cols], residual, math.exp(-3), math.exp(3))
    assert torch.allclose(out.bias[0, 2:].double(), w.log(), atol=1e-3)
    assert torch.equal(out.bias[0, :2], torch.zeros(2))
    # The values: the block's output minus the exact keys' part, under the softmax over every slot.
    beta = out.bias[0].double()
    x = torch.softmax(qd @ kd[out.index[0]].T / math.sqrt(4) + beta, -1)  # [n, 5]
    target = a @ vd - x[:, :2] @ vd[out.index[0, :2]]
    cv = torch.linalg.lstsq(x[:, 2:], target).solution
    assert torch.allclose(out.values[0, 2:].double(), cv, atol=1e-4)
    assert torch.equal(out.values[0, :2], v[0, out.index[0, :2]])


def test_exact_share_refuses_omp_and_the_union():
    _, _, _, order = _exact_block()
    with pytest.raises(ValueError, match="ranking by one score"):
        ExactFirst(OMP(), 0.5)
    with pytest.raises(ValueError, match="ranking by one score"):
        ExactFirst(GivenScoresUnion(order, 0.5), 0.5)


def test_exact_tokens_in_the_method_are_kvzips_own_keys_and_values(ctx):
    """exact_share with exact_keys=kvzip: each head's first round(share x budget) stored keys are its best by
    KVzip's scores, with the full cache's own keys and values and no bias; the total is the budget's."""
    am = get_method("attention_matching", exact_share=0.5, exact_keys="kvzip")
    req = Request(ctx, 4.0)
    stored = am.compress(req)
    scores = kvzip_scores(req, KVzipOptions())
    n_exact = math.floor(0.5 * req.doc_budget + 0.5)
    for layer in range(ctx.lm.n_layers):
        kept, compacted = [seg for seg in stored.layers[layer] if seg.fate in ("kept", "compacted")]
        assert kept.fate == "kept" and kept.bias is None
        view = kept.view()
        for head in range(ctx.lm.n_kv_heads):
            best = scores[layer][head].topk(n_exact).indices + ctx.prefix_len
            assert set(view.token_index[head].tolist()) == set(best.tolist())
            index = view.token_index[head]
            assert torch.equal(view.keys[head], ctx.full.keys[layer][head, index])
            assert torch.equal(view.values[head], ctx.full.values[layer][head, index])
        assert torch.equal(
            kept.lengths() + compacted.lengths(),
            torch.full((ctx.lm.n_kv_heads,), req.doc_budget, device=kept.lengths().device),
        )


def test_concentration_against_the_entropy_by_hand():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 7, 4, generator=gen), torch.randn(2, 9, 4, generator=gen)
    got = concentration(q, k, scale=0.5, rows=3)  # chunks of 3 queries: 3 + 3 + 1
    a = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.5, -1)
    entropy = -(a * a.log()).sum(-1).mean(-1)
    assert torch.allclose(got.double(), math.log(9) - entropy, atol=1e-5)
    # Zero queries attend evenly: no concentration; a query far along one key reads that key alone.
    assert torch.allclose(concentration(torch.zeros(1, 2, 4), k[:1]), torch.zeros(1), atol=1e-6)
    sharp = concentration(k[:1, :1] * 200.0, k[:1])
    assert float(sharp) > math.log(9) - 1e-3


def test_document_budgets_move_keys_to_concentrated_heads_and_keep_the_total(ctx):
    req = Request(ctx, 4.0)
    queries = repeat_queries(ctx)
    opts = AMOptions(budgets="document")
    budgets = document_budgets(ctx, queries, opts, req.doc_budget)
    assert int(budgets.sum()) == req.doc_budget * ctx.lm.n_layers * ctx.lm.n_kv_heads
    focus = torch.stack(
        [
            concentration(
                fitting_queries(q, ctx.lm.n_kv_heads, opts),
                ctx.full.keys[i][:, ctx.prefix_len :],
                ctx.lm.geometry[i].scaling,
            )
            for i, q in enumerate(queries)
        ]
    ).flatten()
    flat = budgets.flatten().cpu()
    # More concentrated, never fewer keys (rounding aside: at most one).
    for i in range(flat.numel()):
        for j in range(flat.numel()):
            if focus[i] > focus[j]:
                assert flat[i] >= flat[j] - 1
    stored = get_method("attention_matching", budgets="document").compress(req)
    assert torch.equal(stored.kept_per_head().cpu() - ctx.prefix_len, flat.view_as(budgets.cpu()))


def test_exact_and_document_options_are_validated():
    with pytest.raises(MethodError, match="exact_share"):
        AMOptions(exact_share=0.5, key_selection="omp")
    with pytest.raises(MethodError, match="exact_share"):
        AMOptions(exact_share=1.5)
    with pytest.raises(MethodError, match="budgets=document"):
        AMOptions(budgets="document", on_policy=True)
