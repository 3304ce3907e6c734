"""Tests of the Attention Matching solvers (kvlab.compression.solvers).

Small seeded random problems; each test checks a property that fails if the
maths is wrong, not merely that the code runs.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvlab.compression.solvers.compact import compact_block
from kvlab.compression.solvers.keys import HighestAttn
from kvlab.compression.solvers.linalg import masked_gram
from kvlab.compression.solvers.nnls import box_nnls_gram, nnls, nnls_bias
from kvlab.compression.solvers.scores import mass_features, score_keys, select_highest_attn, streamed_mass
from kvlab.compression.solvers.values import fit_values
from kvlab.runtime.attention import attend, attention_logits
from solver_cases import gen, qkv

# --------------------------------------------------------------------------
# mass features, scores, selection
# --------------------------------------------------------------------------


def test_mass_features_matches_softmax_and_lse():
    q, k, _ = qkv()
    bias = torch.randn(3, 32, generator=gen(1))
    phi, z = mass_features(q, k, bias)
    logits = attention_logits(q, k, bias)
    assert torch.allclose(phi / z.unsqueeze(-1), torch.softmax(logits, -1), atol=1e-6)
    lse = logits.amax(-1) + z.log()
    assert torch.allclose(lse, torch.logsumexp(logits, -1), atol=1e-5)
    assert float(phi.max()) <= 1.0 + 1e-6  # the per-query shift


def test_mass_features_padding_equals_removing_the_key():
    q, k, _ = qkv(B=2, T=10)
    bias = torch.zeros(2, 10)
    bias[:, 3] = float("-inf")
    phi, z = mass_features(q, k, bias)
    keep = [j for j in range(10) if j != 3]
    phi_r, z_r = mass_features(q, k[:, keep])
    assert torch.all(phi[:, :, 3] == 0)
    assert torch.allclose(phi[:, :, keep], phi_r, atol=1e-6)
    assert torch.allclose(z, z_r, atol=1e-5)
    # a head made only of padding: zero mass, no NaN
    phi0, z0 = mass_features(q, k, torch.full((2, 10), float("-inf")))
    assert torch.all(phi0 == 0) and torch.all(z0 == 0)


def test_log2_bias_equals_duplicating_the_key():
    q, k, v = qkv(B=2, T=12)
    j = 5
    bias = torch.zeros(2, 12)
    bias[:, j] = math.log(2.0)
    got = attend(q, k, v, bias)
    dup = attend(q, torch.cat([k, k[:, j : j + 1]], 1), torch.cat([v, v[:, j : j + 1]], 1))
    assert torch.allclose(got.output, dup.output, atol=1e-5)
    assert torch.allclose(got.lse, dup.lse, atol=1e-5)
    phi_b, z_b = mass_features(q, k, bias)
    phi_d, z_d = mass_features(q, torch.cat([k, k[:, j : j + 1]], 1))
    # same block, same distribution of mass over the keys
    assert torch.allclose(phi_b[:, :, j] / z_b, 2 * phi_d[:, :, j] / z_d, atol=1e-6)


@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_score_keys_definitions(scoring):
    q, k, _ = qkv()
    bias = torch.zeros(3, 32)
    bias[0, 7] = float("-inf")
    a = torch.softmax(attention_logits(q, k, bias), -1)
    want = {"rms": a.square().mean(1).sqrt(), "mean": a.mean(1), "max": a.amax(1)}[scoring]
    got = score_keys(q, k, bias, scoring=scoring)
    assert got[0, 7] == float("-inf")
    mask = torch.isfinite(got)
    assert torch.allclose(got[mask], want[mask], atol=1e-6)


def test_select_highest_attn_is_sorted_and_prefix_consistent():
    scores = torch.randn(4, 50, generator=gen(2))
    idx = select_highest_attn(scores, 20)
    vals = scores.gather(1, idx)
    assert torch.all(vals[:, :-1] >= vals[:, 1:])
    assert torch.equal(idx[:, :7], select_highest_attn(scores, 7))
    assert torch.equal(vals[:, 0], scores.amax(1))


# --------------------------------------------------------------------------
# NNLS and bias
# --------------------------------------------------------------------------


def _objective(m, w, z):
    return (torch.bmm(m, w.unsqueeze(-1)).squeeze(-1) - z).square().sum(-1)


def _exact_nnls(m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Brute force over active sets (tiny t only): the true NNLS optimum value."""
    t = m.shape[-1]
    best = torch.full((m.shape[0],), float("inf"), dtype=torch.float64)
    m64, z64 = m.double(), z.double()
    for r in range(t + 1):
        for subset in itertools.combinations(range(t), r):
            w = torch.zeros(m.shape[0], t, dtype=torch.float64)
            if subset:
                cols = list(subset)
                sol = torch.linalg.lstsq(m64[:, :, cols], z64.unsqueeze(-1)).solution.squeeze(-1)
                w[:, cols] = sol
            ok = torch.all(w >= -1e-12, dim=-1)
            obj = _objective(m64, w.clamp_min(0), z64)
            best = torch.where(ok, torch.minimum(best, obj), best)
    return best


def test_nnls_reaches_the_exact_optimum_with_active_constraints():
    g = gen(3)
    m = torch.rand(4, 30, 5, generator=g)
    # a target that needs negative weights: LS alone would leave w >= 0
    w_true = torch.tensor([1.0, -0.7, 0.5, -0.3, 0.8]).expand(4, 5)
    z = torch.bmm(m, w_true.unsqueeze(-1)).squeeze(-1) + 0.05 * torch.rand(4, 30, generator=g)
    w = nnls(m, z, iters=2000)
    assert torch.all(w >= 0)
    assert torch.any(w == 0)  # some constraints are active
    exact = _exact_nnls(m, z)
    assert torch.allclose(_objective(m, w, z).double(), exact, rtol=1e-3, atol=1e-5)
    # and never worse than clamping the unconstrained solution at zero
    w_ls = torch.linalg.lstsq(m, z.unsqueeze(-1)).solution.squeeze(-1).clamp_min(0)
    assert torch.all(_objective(m, w, z) <= _objective(m, w_ls, z) + 1e-6)


def test_nnls_bias_bounds_recovery_and_padding():
    g = gen(4)
    m = torch.rand(3, 40, 6, generator=g)
    w_true = torch.exp(torch.empty(3, 6).uniform_(-2.5, 2.5, generator=g))
    z = torch.bmm(m, w_true.unsqueeze(-1)).squeeze(-1)
    beta = nnls_bias(m, z)
    assert torch.allclose(beta, w_true.log(), atol=1e-3)
    # out-of-box target: bounds hold and the fit beats the clamped start
    z_bad = z + 5.0 * torch.rand(3, 40, generator=g) * m[:, :, 0]
    beta = nnls_bias(m, z_bad, iters=50)
    assert torch.all(beta >= -3 - 1e-5) and torch.all(beta <= 3 + 1e-5)
    w_ls = torch.linalg.lstsq(m, z_bad.unsqueeze(-1)).solution.squeeze(-1)
    start = w_ls.clamp(math.exp(-3), math.exp(3))
    assert torch.all(_objective(m, beta.exp(), z_bad) <= _objective(m, start, z_bad) + 1e-5)
    # padding columns: -inf and no influence on the others
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[1, 4:] = False
    m_pad = m.clone()
    m_pad[1, :, 4:] = float("nan")  # garbage in padding must not leak
    beta_p = nnls_bias(m_pad, z, valid)
    assert torch.all(beta_p[1, 4:] == float("-inf"))
    beta_solo = nnls_bias(m[1:2, :, :4], z[1:2])
    assert torch.allclose(beta_p[1, :4], beta_solo[0], atol=1e-5)


# --------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------


def test_fit_values_primal_exact():
    g = gen(5)
    x = torch.softmax(torch.randn(3, 40, 10, generator=g), -1)  # n > t
    cv_true = torch.randn(3, 10, 8, generator=g)
    cv = fit_values(x, torch.bmm(x, cv_true))
    assert torch.allclose(cv, cv_true, atol=1e-4)


def test_fit_values_dual_exact_and_minimum_norm():
    g = gen(6)
    x = torch.softmax(torch.randn(3, 8, 20, generator=g), -1)  # n < t
    cv_true = torch.randn(3, 20, 8, generator=g)
    y = torch.bmm(x, cv_true)
    cv = fit_values(x, y)
    assert torch.allclose(torch.bmm(x, cv), y, atol=1e-4)
    min_norm = torch.linalg.pinv(x.double()) @ y.double()
    assert torch.allclose(cv.double(), min_norm, atol=1e-3)


@pytest.mark.parametrize("n", [40, 8])
def test_fit_values_padding_matches_unpadded(n):
    g = gen(7)
    x = torch.softmax(torch.randn(2, n, 12, generator=g), -1)
    y = torch.randn(2, n, 4, generator=g)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, 9:] = False
    x_pad = x.clone()
    x_pad[0, :, 9:] = 7.0  # garbage in padding columns
    cv = fit_values(x_pad, y, valid)
    assert torch.all(cv[0, 9:] == 0)
    solo = fit_values(x[0:1, :, :9], y[0:1])
    assert torch.allclose(cv[0, :9], solo[0], atol=1e-4)


def test_fit_values_singular_gram_retries_with_larger_ridge():
    g = gen(8)
    x = torch.softmax(torch.randn(2, 30, 6, generator=g), -1)
    x[0, :, 5] = x[0, :, 4]  # duplicate column: x^T x exactly singular in head 0
    y = torch.randn(2, 30, 3, generator=g)
    cv = fit_values(x, y, ridge=0.0)
    assert torch.isfinite(cv).all()
    # the duplicated pair shares the weight; the fit is as good as without it
    ref = fit_values(x[0:1, :, :5], y[0:1])
    assert torch.allclose(torch.bmm(x[0:1], cv[0:1]), torch.bmm(x[0:1, :, :5], ref), atol=1e-3)
    # a well-posed head is untouched by its neighbour's retries
    assert torch.allclose(cv[1], fit_values(x[1:2], y[1:2], ridge=0.0)[0], atol=1e-5)


@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_streamed_mass_matches_attention_in_chunks_of_three_queries(scoring):
    q, k, v = qkv(B=2, n=16, T=20, seed=21, q_scale=3.0)
    bias = torch.randn(2, 20, generator=gen(22))
    bias[1, 5:12] = float("-inf")  # padding in the middle of head 1
    shift, z, y, scores = streamed_mass(q, k, v, bias, scoring=scoring, block_elements=2 * 20 * 3)
    ref = attend(q, k, v, bias)
    torch.testing.assert_close(y, ref.output, rtol=1e-5, atol=1e-6)
    # The block's log-mass: shift + log z.
    torch.testing.assert_close(shift + z.log(), ref.lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shift, attention_logits(q, k, bias).amax(dim=-1))
    torch.testing.assert_close(scores, score_keys(q, k, bias, scoring=scoring), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_weighted_key_scores_equal_the_scores_over_repeated_queries(scoring):
    """A query of weight 2 counts as that query twice (max: weight 0 drops a query)."""
    q, k, v = qkv(B=2, n=10, T=14, seed=24)
    weights = torch.ones(2, 10)
    weights[:, 3] = 2.0
    weights[:, 7] = 0.0
    *_, got = streamed_mass(q, k, v, scoring=scoring, weights=weights, block_elements=2 * 14 * 4)
    copies = [0, 1, 2, 3, 3, 4, 5, 6, 8, 9] if scoring != "max" else [0, 1, 2, 3, 4, 5, 6, 8, 9]
    torch.testing.assert_close(got, score_keys(q[:, copies], k, scoring=scoring), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_highest_attn_fit_is_the_same_in_any_query_chunking(scoring):
    # Chunks of 5 queries against one chunk of all 48; both select what the dense scores rank first.
    q, k, v = qkv(B=3, n=48, T=40, seed=23)
    bias = torch.zeros(3, 40)
    bias[2, 30:] = float("-inf")
    budgets = torch.tensor([12, 7, 12])
    whole = compact_block(q, k, v, 12, bias=bias, budgets=budgets, keys=HighestAttn(scoring))
    chunked = compact_block(
        q, k, v, 12, bias=bias, budgets=budgets, keys=HighestAttn(scoring), block_elements=3 * 40 * 5
    )
    assert torch.equal(chunked.index, whole.index)
    expected = select_highest_attn(score_keys(q, k, bias, scoring=scoring), 12)
    assert torch.equal(whole.index[0], expected[0]) and torch.equal(whole.index[1, :7], expected[1, :7])
    torch.testing.assert_close(chunked.bias, whole.bias, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunked.values, whole.values, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(chunked.scores, whole.scores, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("ridge", [1e-2, 1e-1])
def test_nnls_bias_on_a_wide_design_equals_the_primal_gram_form(ridge):
    # 12 queries, 30 kept keys: nnls_bias takes the 12 x 12 dual; the 30 x 30 Gram
    # form is the reference. A ridge that keeps the rank-12 primal Gram well
    # conditioned in float32, so that the two forms must agree closely.
    g = gen(31)
    m = torch.rand(2, 12, 30, generator=g)
    z = (m @ torch.exp(2 * torch.randn(2, 30, 1, generator=g))).squeeze(-1)  # box constraints bind
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, 24:] = False
    lo, hi = math.exp(-3), math.exp(3)
    got = nnls_bias(m, z, valid, lo, hi, iters=3, ridge=ridge)
    gram, b, active, design = masked_gram(m, z, valid)
    w = box_nnls_gram(gram, b, active, lo, hi, 3, ridge, design, z)
    expected = w.log().masked_fill(~valid, float("-inf"))
    assert torch.isinf(got[1, 24:]).all()
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_product_of_one_column_equals_the_plain_product():
    """linalg.product computes a single column as a row times a matrix: the same numbers as the
    float64 product (within float32's dot-product error), for one column and for several."""
    from kvlab.compression.solvers.linalg import product

    g = gen(21)
    a = torch.randn(3, 40, 70, generator=g)
    for c in (1, 4):
        b = torch.randn(3, 70, c, generator=g)
        exact = a.double() @ b.double()
        bound = 70 * torch.finfo(torch.float32).eps * float((a.abs().double() @ b.abs().double()).max())
        out = product(a, b)
        assert out.shape == (3, 40, c)
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=bound)
        # a transposed view as the left factor (the rhs D^T z of the bias fit)
        torch.testing.assert_close(
            product(a.mT, a[..., :c]).double(), a.double().mT @ a[..., :c].double(), rtol=0, atol=bound
        )


def test_compact_attention_is_the_softmax_and_its_log_mass():
    """compact.compact_attention against torch.softmax and torch.logsumexp; a head with no real slot
    (every bias -inf) attends to nothing: weights 0 and log-mass -inf."""
    from kvlab.compression.solvers.compact import compact_attention

    q, k, _ = qkv()
    beta = torch.randn(3, k.shape[1], generator=gen(22))
    beta[1] = float("-inf")
    x, lse = compact_attention(q, k, beta, 0.125)
    logits = (q.double() * 0.125) @ k.double().mT + beta.double().unsqueeze(1)
    # float32 logits are within (d + 2) eps of the sum of the terms' sizes; a softmax weight moves by at
    # most twice a logit's error, and exp, the sum over T keys and the division add (T + 4) eps.
    eps, d, t = torch.finfo(torch.float32).eps, q.shape[-1], k.shape[1]
    sizes = (q.double().abs() * 0.125) @ k.double().abs().mT + beta.double().abs().nan_to_num(posinf=0).unsqueeze(1)
    logit_err = (d + 2) * eps * float(sizes[[0, 2]].max())
    torch.testing.assert_close(
        x[[0, 2]].double(), torch.softmax(logits[[0, 2]], -1), rtol=0, atol=2 * logit_err + (t + 4) * eps
    )
    torch.testing.assert_close(
        lse[[0, 2]].double(), torch.logsumexp(logits[[0, 2]], -1), rtol=0, atol=logit_err + (t + 4) * eps
    )
    assert not bool(x[1].any()) and bool((lse[1] == float("-inf")).all())


def test_attention_from_features_is_the_compact_softmax():
    """compact.attention_from_features (the compact attention from the bias fit's features) against
    a float64 softmax of ``q ck^T * scale + beta``: with an old bias, weighted rows (one weighted 0),
    a row whose chosen keys' features underflow (recomputed from the logits), and a head with no real
    slot (weights 0, log-mass -inf)."""
    from kvlab.compression.solvers.compact import attention_from_features
    from kvlab.compression.solvers.keys import MassFit

    q, k, _ = qkv(B=3, n=40, T=32)
    scale, t = 0.125, 12
    idx = torch.arange(t).expand(3, t)
    old = torch.randn(3, 32, generator=gen(23))
    k[0, t + 3] = 40.0 * q[0, 5]  # query 5 of head 0: one unchosen key dominates, the chosen underflow
    logits = attention_logits(q, k, old, scale)
    shift = logits.amax(-1)
    root_w = torch.rand(3, 40, generator=gen(24)) + 0.5
    root_w[2, 7] = 0.0
    old_s = old.gather(1, idx)
    features = (logits.gather(2, idx.unsqueeze(1).expand(3, 40, t)) - shift.unsqueeze(-1)).exp() * root_w.unsqueeze(-1)
    assert float(features[0, 5].sum()) < 1e-20  # the row really underflows
    beta = old_s + torch.randn(3, t, generator=gen(25)).clamp(-3, 3)
    beta[1] = float("-inf")
    valid = torch.ones(3, t, dtype=torch.bool)
    problem = MassFit(features, shift, old_s, valid, True, (-3.0, 3.0), 2, 1e-6)
    ck = k[:, :t]
    x, lse = attention_from_features(problem, beta, shift, root_w, lambda: (q, ck, scale))

    ref_logits = (q.double() * scale) @ ck.double().mT + beta.double().unsqueeze(1)
    # Each weight: the float32 logits (d + 2 eps of their terms' sizes), the shift and the bias
    # difference subtracted (2 eps of their sizes), exp and the row's sum and division ((t + 6) eps).
    eps, d = torch.finfo(torch.float32).eps, q.shape[-1]
    sizes = (q.double().abs() * scale) @ ck.double().abs().mT + old_s.double().abs().unsqueeze(1)
    sizes = sizes + shift.double().abs().unsqueeze(-1) + (beta - old_s).double().abs().unsqueeze(1)
    err = (d + 4) * eps * float(sizes[[0, 2]].max())
    torch.testing.assert_close(
        x[[0, 2]].double(), torch.softmax(ref_logits[[0, 2]], -1), rtol=0, atol=2 * err + (t + 6) * eps
    )
    torch.testing.assert_close(
        lse[[0, 2]].double(), torch.logsumexp(ref_logits[[0, 2]], -1), rtol=0, atol=err + (t + 6) * eps
    )
    assert not bool(x[1].any()) and bool((lse[1] == float("-inf")).all())
