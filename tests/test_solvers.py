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
from kvlab.compression.solvers.linalg import masked_gram
from kvlab.compression.solvers.nnls import box_nnls_gram, nnls, nnls_bias
from kvlab.compression.solvers.omp import omp_select
from kvlab.compression.solvers.scores import mass_features, score_keys, select_highest_attn, streamed_mass
from kvlab.compression.solvers.values import fit_values
from kvlab.runtime.attention import attend, attention_logits


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(B=3, n=64, T=32, d=16, dv=16, seed=0, q_scale=1.0):
    g = _gen(seed)
    q = torch.randn(B, n, d, generator=g) * q_scale
    k = torch.randn(B, T, d, generator=g)
    v = torch.randn(B, T, dv, generator=g)
    return q, k, v


def _rel_out_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())


def _mass_err(phi_sel: torch.Tensor, w: torch.Tensor, z: torch.Tensor) -> float:
    fit = torch.bmm(phi_sel, w.unsqueeze(-1)).squeeze(-1)
    return float(((fit - z) / z).abs().mean())


def _gather_cols(phi: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    B, n, _ = phi.shape
    return phi.gather(2, idx.clamp_min(0).unsqueeze(1).expand(B, n, idx.shape[-1]))


# --------------------------------------------------------------------------
# mass features, scores, selection
# --------------------------------------------------------------------------


def test_mass_features_matches_softmax_and_lse():
    q, k, _ = _qkv()
    bias = torch.randn(3, 32, generator=_gen(1))
    phi, z = mass_features(q, k, bias)
    logits = attention_logits(q, k, bias)
    assert torch.allclose(phi / z.unsqueeze(-1), torch.softmax(logits, -1), atol=1e-6)
    lse = logits.amax(-1) + z.log()
    assert torch.allclose(lse, torch.logsumexp(logits, -1), atol=1e-5)
    assert float(phi.max()) <= 1.0 + 1e-6  # the per-query shift


def test_mass_features_padding_equals_removing_the_key():
    q, k, _ = _qkv(B=2, T=10)
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
    q, k, v = _qkv(B=2, T=12)
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
    q, k, _ = _qkv()
    bias = torch.zeros(3, 32)
    bias[0, 7] = float("-inf")
    a = torch.softmax(attention_logits(q, k, bias), -1)
    want = {"rms": a.square().mean(1).sqrt(), "mean": a.mean(1), "max": a.amax(1)}[scoring]
    got = score_keys(q, k, bias, scoring=scoring)
    assert got[0, 7] == float("-inf")
    mask = torch.isfinite(got)
    assert torch.allclose(got[mask], want[mask], atol=1e-6)


def test_select_highest_attn_is_sorted_and_prefix_consistent():
    scores = torch.randn(4, 50, generator=_gen(2))
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
    g = _gen(3)
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
    g = _gen(4)
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
    g = _gen(5)
    x = torch.softmax(torch.randn(3, 40, 10, generator=g), -1)  # n > t
    cv_true = torch.randn(3, 10, 8, generator=g)
    cv = fit_values(x, torch.bmm(x, cv_true))
    assert torch.allclose(cv, cv_true, atol=1e-4)


def test_fit_values_dual_exact_and_minimum_norm():
    g = _gen(6)
    x = torch.softmax(torch.randn(3, 8, 20, generator=g), -1)  # n < t
    cv_true = torch.randn(3, 20, 8, generator=g)
    y = torch.bmm(x, cv_true)
    cv = fit_values(x, y)
    assert torch.allclose(torch.bmm(x, cv), y, atol=1e-4)
    min_norm = torch.linalg.pinv(x.double()) @ y.double()
    assert torch.allclose(cv.double(), min_norm, atol=1e-3)


@pytest.mark.parametrize("n", [40, 8])
def test_fit_values_padding_matches_unpadded(n):
    g = _gen(7)
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
    g = _gen(8)
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


# --------------------------------------------------------------------------
# OMP
# --------------------------------------------------------------------------


def test_omp_mass_error_decreases_with_t_and_beats_highest_attn():
    q, k, _ = _qkv(B=3, n=96, T=64, d=16, q_scale=1.5, seed=9)
    phi, z = mass_features(q, k)
    errs = []
    for t in (4, 8, 16, 32):
        idx, w = omp_select(phi, z, t)
        errs.append(_mass_err(_gather_cols(phi, idx), w, z))
        # prefix order: the first picks are the first ones of a longer run
        if t == 16:
            first = idx[:, :4]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    idx32, _ = omp_select(phi, z, 32)
    assert torch.equal(idx32[:, :4], first)
    # highest attention + bounded NNLS at the same t
    t = 8
    idx_h = select_highest_attn(score_keys(q, k), t)
    m_h = _gather_cols(phi, idx_h)
    err_h = _mass_err(m_h, nnls_bias(m_h, z, iters=50).exp(), z)
    assert errs[1] <= err_h * 1.05, (errs[1], err_h)


def test_omp_beats_highest_attn_on_redundant_keys():
    # 6 distinct keys; the most attended one appears 20 times. Top-t by score
    # fills the budget with its copies; OMP sees their mass is already
    # explained and spends the budget on the others.
    g = _gen(10)
    B, n, d = 2, 80, 8
    base = torch.randn(B, 6, d, generator=g)
    base[:, 0] *= 0.3
    copies = [20, 4, 4, 4, 4, 4]
    k = torch.cat([base[:, i : i + 1].expand(B, c, d) for i, c in enumerate(copies)], 1)
    q = torch.randn(B, n, d, generator=g) * 0.5 + 1.0 * base[:, :1]
    phi, z = mass_features(q, k)
    t = 6
    idx, w = omp_select(phi, z, t, keys_per_iter=1, refit_every=1)
    err_omp = _mass_err(_gather_cols(phi, idx), w, z)
    idx_h = select_highest_attn(score_keys(q, k), t)
    m_h = _gather_cols(phi, idx_h)
    err_h = _mass_err(m_h, nnls_bias(m_h, z, iters=50).exp(), z)
    assert err_omp < 1e-3 < err_h
    assert torch.allclose(w.sort(-1).values, torch.tensor([4.0] * 5 + [20.0]).expand(B, 6), rtol=1e-2)


def test_omp_drops_and_refills_consistently():
    q, k, _ = _qkv(B=2, n=48, T=40, d=8, q_scale=2.0, seed=11)
    phi, z = mass_features(q, k)
    t = 10
    # an aggressive drop threshold forces many drop/ban/refill rounds
    idx, w = omp_select(phi, z, t, drop_below=0.0)
    assert torch.all(idx >= 0)
    for b in range(2):
        assert len(set(idx[b].tolist())) == t
    # the incrementally updated Gram gives the same weights as a fresh NNLS
    w_fresh = nnls(_gather_cols(phi, idx), z)
    assert torch.allclose(w, w_fresh, rtol=1e-3, atol=1e-4)
    # drops really happened: the selection differs from a run without them
    idx_nodrop, _ = omp_select(phi, z, t, drop_below=None)
    assert not torch.equal(idx, idx_nodrop)
    # t = T: dropped keys are banned, the pool runs dry and the remaining
    # slots are filled from banned keys; every key still appears exactly once
    idx_all, w_all = omp_select(phi[:, :, :12], z, 12, drop_below=0.0)
    for b in range(2):
        assert sorted(idx_all[b].tolist()) == list(range(12))
    # All 12 keys of a near-singular design: the NNLS optimum's weights are not well
    # determined (they move by 1e-3 with the BLAS kernel), its objective is.
    design = _gather_cols(phi[:, :, :12], idx_all)
    fresh = nnls(design, z)
    assert torch.all(w_all >= 0)
    residual = lambda w: ((design @ w.unsqueeze(-1)).squeeze(-1) - z).norm(dim=-1)  # noqa: E731
    assert torch.allclose(residual(w_all), residual(fresh), rtol=1e-4)


def test_omp_respects_padding_keys():
    q, k, _ = _qkv(B=2, n=40, T=20, d=8, seed=12)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, ::2] = False  # head 0: 10 real keys
    bias = torch.zeros(2, 20).masked_fill(~valid, float("-inf"))
    phi, z = mass_features(q, k, bias)
    idx, w = omp_select(phi, z, 12, key_valid=valid)
    assert torch.all(idx[0, 10:] == -1) and torch.all(w[0, 10:] == 0)
    assert torch.all(valid[0, idx[0, :10]])
    assert torch.all(idx[1] >= 0)


# --------------------------------------------------------------------------
# compact_block
# --------------------------------------------------------------------------


@pytest.mark.parametrize("selection", ["highest_attn", "omp"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_keep_all_reproduces_attention(selection, with_bias):
    q, k, v = _qkv(B=3, n=64, T=32, seed=13)
    bias = torch.empty(3, 32).uniform_(-2, 2, generator=_gen(14)) if with_bias else None
    ref = attend(q, k, v, bias)
    cb = compact_block(q, k, v, 32, bias=bias, key_selection=selection)
    got = attend(q, cb.keys, cb.values, cb.bias)
    assert torch.allclose(got.output, ref.output, atol=1e-4)
    assert torch.allclose(got.lse, ref.lse, atol=1e-4)
    if bias is not None:  # re-compaction carries the old bias into beta
        assert torch.allclose(cb.bias, bias.gather(1, cb.index), atol=1e-3)
    assert set(cb.timings) == {"keys", "bias", "values"}


def test_budgets_pad_with_minus_inf_and_match_solo_compaction():
    q, k, v = _qkv(B=3, n=64, T=32, seed=15)
    t = 8
    budgets = torch.tensor([8, 5, 0])
    cb = compact_block(q, k, v, t, budgets=budgets)
    assert cb.lengths.tolist() == [8, 5, 0]
    assert torch.all(cb.bias[1, 5:] == float("-inf")) and torch.all(cb.index[1, 5:] == -1)
    assert torch.all(cb.bias[2] == float("-inf")) and torch.all(cb.index[2] == -1)
    assert torch.all(cb.values[1, 5:] == 0) and torch.isfinite(cb.values).all()
    assert torch.isfinite(cb.bias[0]).all() and torch.all(cb.index[0] >= 0)
    # padded head 1 = head 1 compacted alone at its budget
    solo = compact_block(q[1:2], k[1:2], v[1:2], 5)
    assert torch.equal(cb.index[1, :5], solo.index[0])
    assert torch.allclose(cb.bias[1, :5], solo.bias[0], atol=1e-5)
    assert torch.allclose(cb.values[1, :5], solo.values[0], atol=1e-4)
    # and as a cache block the padding slots are absent keys
    a = attend(q[1:2], cb.keys[1:2], cb.values[1:2], cb.bias[1:2])
    b = attend(q[1:2], solo.keys, solo.values, solo.bias)
    assert torch.allclose(a.output, b.output, atol=1e-4) and torch.allclose(a.lse, b.lse, atol=1e-4)


def test_budgets_with_omp_refit_the_cut_heads():
    q, k, v = _qkv(B=2, n=64, T=32, seed=16)
    cb = compact_block(q, k, v, 8, budgets=torch.tensor([8, 4]), key_selection="omp")
    full = compact_block(q, k, v, 8, key_selection="omp")
    assert torch.equal(cb.index[:, :4], full.index[:, :4])  # OMP order is a prefix
    assert torch.all(cb.bias[1, 4:] == float("-inf"))
    phi, z = mass_features(q[1:2], k[1:2])
    m = _gather_cols(phi, cb.index[1:2, :4])
    # the cut head's weights are refitted on its own 4 keys, not OMP's 8-key ones
    assert _mass_err(m, cb.bias[1:2, :4].exp(), z) <= _mass_err(m, full.bias[1:2, :4].exp(), z)


def test_padding_keys_in_the_input_block_are_never_selected():
    q, k, v = _qkv(B=2, n=64, T=32, seed=17)
    bias = torch.zeros(2, 32)
    bias[0, 10:] = float("-inf")  # head 0 has only 10 real keys
    for selection in ("highest_attn", "omp"):
        cb = compact_block(q, k, v, 16, bias=bias, key_selection=selection)
        assert cb.lengths.tolist() == [10, 16]
        assert torch.all(cb.index[0, :10] < 10) and torch.all(cb.index[0, 10:] == -1)
        ref = attend(q, k, v, bias)
        got = attend(q, cb.keys, cb.values, cb.bias)
        # head 0 keeps all its real keys: exact
        assert torch.allclose(got.output[0], ref.output[0], atol=1e-4)
        assert torch.allclose(got.lse[0], ref.lse[0], atol=1e-4)


@pytest.mark.parametrize("selection", ["highest_attn", "omp"])
def test_compaction_beats_plain_top_t(selection):
    q, k, v = _qkv(B=4, n=128, T=64, d=16, q_scale=1.5, seed=18)
    t = 16
    ref = attend(q, k, v)
    cb = compact_block(q, k, v, t, key_selection=selection)
    got = attend(q, cb.keys, cb.values, cb.bias)
    idx = select_highest_attn(score_keys(q, k), t)
    kk = k.gather(1, idx.unsqueeze(-1).expand(-1, -1, k.shape[-1]))
    vv = v.gather(1, idx.unsqueeze(-1).expand(-1, -1, v.shape[-1]))
    base = attend(q, kk, vv)
    err_am, err_base = _rel_out_err(got.output, ref.output), _rel_out_err(base.output, ref.output)
    assert err_am < 0.8 * err_base, (err_am, err_base)
    mass_am = float((torch.exp(got.lse - ref.lse) - 1).abs().mean())
    mass_base = float((torch.exp(base.lse - ref.lse) - 1).abs().mean())
    assert mass_am < 0.5 * mass_base, (mass_am, mass_base)


def test_low_precision_inputs():
    q, k, v = _qkv(B=2, n=64, T=32, seed=19)
    cb = compact_block(q.bfloat16(), k.bfloat16(), v.bfloat16(), 32)
    assert cb.keys.dtype == torch.bfloat16 and cb.values.dtype == torch.bfloat16
    assert cb.bias.dtype == torch.float32
    ref = attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    got = attend(q.bfloat16(), cb.keys, cb.values, cb.bias)
    assert torch.allclose(got.output, ref.output, atol=3e-2)
    assert torch.allclose(got.lse, ref.lse, atol=1e-3)



@pytest.mark.parametrize(("selection", "beta"), [("highest_attn", 3.0), ("omp", math.log(64))])
def test_beta_is_bounded_as_published(selection, beta):
    """64 copies of one key compacted to one: its exact weight is 64, beta = log 64 ~ 4.16.
    The published HighestAttnKeys configuration bounds beta to [-3, 3], so it stops at 3;
    OMP's bound is 7 (keys below -7 dropped), so it keeps the exact log 64."""
    q, k, v = _qkv(B=2, n=32, T=64, d=16, seed=20)
    k = k[:, :1].expand(-1, 64, -1).contiguous()
    cb = compact_block(q, k, v, 1, key_selection=selection)
    assert torch.allclose(cb.bias, torch.full((2, 1), beta), atol=1e-3)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_omp_with_fewer_slots_than_keys_per_iter(t):
    """A budget below keys_per_iter (a high ratio on a short block) fills exactly t slots
    with distinct keys, weighted by their NNLS fit."""
    q, k, _ = _qkv(B=2, n=40, T=24, d=8, seed=21)
    phi, z = mass_features(q, k)
    idx, w = omp_select(phi, z, t, keys_per_iter=4)
    assert idx.shape == (2, t) and all(len(set(row.tolist())) == t for row in idx) and bool((idx >= 0).all())
    assert torch.allclose(w, nnls(_gather_cols(phi, idx), z), rtol=1e-3, atol=1e-4)


def test_given_key_scores_pick_the_keys_and_the_fit_stays_highest_attn():
    """key_scores equal to an eager RMS score reproduce the default compaction; other
    scores pick their own top-t, and the values are still the least-squares optimum."""
    q, k, v = _qkv(B=2, n=64, T=32, seed=22)
    t = 8
    a = torch.softmax(q @ k.transpose(1, 2) / k.shape[-1] ** 0.5, dim=-1)  # [B, n, T]
    default = compact_block(q, k, v, t)
    given = compact_block(q, k, v, t, key_scores=a.square().mean(dim=1).sqrt())
    assert torch.equal(given.index, default.index)
    assert torch.allclose(given.bias, default.bias, atol=1e-6) and torch.allclose(given.values, default.values, atol=1e-5)

    scores = torch.rand(2, 32, generator=_gen(23))
    cb = compact_block(q, k, v, t, key_scores=scores)
    for b in range(2):
        assert set(cb.index[b].tolist()) == set(scores[b].argsort(descending=True)[:t].tolist())
    assert cb.bias.min() >= -3.0 - 1e-6 and cb.bias.max() <= 3.0 + 1e-6  # the HighestAttnKeys bounds
    x = torch.softmax(q @ cb.keys.transpose(1, 2) / k.shape[-1] ** 0.5 + cb.bias.unsqueeze(1), dim=-1)
    y = a @ v
    best = torch.linalg.lstsq(x.double(), y.double()).solution.float()
    assert torch.allclose(cb.values, best, atol=1e-3)
    with pytest.raises(ValueError, match="key_scores"):
        compact_block(q, k, v, t, key_scores=scores, key_selection="omp")


@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_streamed_mass_matches_attention_in_chunks_of_three_queries(scoring):
    q, k, v = _qkv(B=2, n=16, T=20, seed=21, q_scale=3.0)
    bias = torch.randn(2, 20, generator=_gen(22))
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
    q, k, v = _qkv(B=2, n=10, T=14, seed=24)
    weights = torch.ones(2, 10)
    weights[:, 3] = 2.0
    weights[:, 7] = 0.0
    *_, got = streamed_mass(q, k, v, scoring=scoring, weights=weights, block_elements=2 * 14 * 4)
    copies = [0, 1, 2, 3, 3, 4, 5, 6, 8, 9] if scoring != "max" else [0, 1, 2, 3, 4, 5, 6, 8, 9]
    torch.testing.assert_close(got, score_keys(q[:, copies], k, scoring=scoring), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_highest_attn_fit_is_the_same_in_any_query_chunking(scoring):
    # Chunks of 5 queries against one chunk of all 48; both select what the dense scores rank first.
    q, k, v = _qkv(B=3, n=48, T=40, seed=23)
    bias = torch.zeros(3, 40)
    bias[2, 30:] = float("-inf")
    budgets = torch.tensor([12, 7, 12])
    whole = compact_block(q, k, v, 12, bias=bias, budgets=budgets, scoring=scoring)
    chunked = compact_block(q, k, v, 12, bias=bias, budgets=budgets, scoring=scoring, block_elements=3 * 40 * 5)
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
    gen = _gen(31)
    m = torch.rand(2, 12, 30, generator=gen)
    z = (m @ torch.exp(2 * torch.randn(2, 30, 1, generator=gen))).squeeze(-1)  # box constraints bind
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, 24:] = False
    lo, hi = math.exp(-3), math.exp(3)
    got = nnls_bias(m, z, valid, lo, hi, iters=3, ridge=ridge)
    gram, b, active, design = masked_gram(m, z, valid)
    w = box_nnls_gram(gram, b, active, lo, hi, 3, ridge, design, z)
    expected = w.log().masked_fill(~valid, float("-inf"))
    assert torch.isinf(got[1, 24:]).all()
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("key_selection", ["highest_attn", "omp"])  # the streamed and the dense path
def test_a_head_that_sees_only_padding_fits_to_zeros_not_nans(key_selection):
    """z = 0 for every query of a head whose keys are all padding: its outputs are 0, never 0/0;
    the other heads are fitted as if it were not there (compared with each fitted alone)."""
    q, k, v = _qkv(B=2, n=24, T=16, seed=21)
    bias = torch.zeros(2, 16)
    bias[1] = float("-inf")
    shift, z, y, _ = streamed_mass(q, k, v, bias)
    assert torch.isfinite(y).all() and bool((y[1] == 0).all()) and bool((z[1] == 0).all())
    eager = torch.softmax(q[0] @ k[0].T / 4.0, dim=-1) @ v[0]  # head dim 16: scale 1/4
    assert torch.allclose(y[0], eager, atol=1e-5)
    both = compact_block(q, k, v, 6, bias=bias, key_selection=key_selection)
    alone = compact_block(q[:1], k[:1], v[:1], 6, bias=bias[:1], key_selection=key_selection)
    assert torch.isfinite(both.values).all() and torch.isfinite(both.keys).all()
    assert torch.allclose(both.values[0], alone.values[0], atol=1e-5)


def test_a_factorisation_that_never_succeeds_is_counted_for_its_head():
    """ridge_factor: a head whose Gram cannot be factorised at any ridge (here +inf on its
    diagonal) solves to 0 and is counted against that head only, while a fit is running."""
    from kvlab.compression.solvers.linalg import FALLBACKS, ridge_factor

    g = torch.randn(3, 6, 4, generator=_gen(30))
    gram = g.transpose(-1, -2) @ g
    gram[1, 2, 2] = float("inf")
    counts = torch.zeros(3, dtype=torch.long)
    token = FALLBACKS.set(counts)
    try:
        _, ok = ridge_factor(gram, torch.ones(3, 4), 1e-6)
    finally:
        FALLBACKS.reset(token)
    assert ok.tolist() == [True, False, True]
    assert counts.tolist() == [0, 1, 0]


def test_non_finite_results_are_replaced_and_counted_per_head():
    """A NaN key in head 1 poisons that head's fit only: its values are replaced (and counted),
    the other heads' fits are those of the same batch fitted without the NaN.

    The reference is the same batch shape without the NaN (not the heads fitted alone): a batch
    of another size takes another BLAS path, whose float32 rounding differs by CPU. The tolerance
    is the forward-error bound of the value fit, a least squares through its normal equations:
    n * eps * cond(X)^2 relative to the values, X = the compact attention weights of the head.
    """
    q, k, v = _qkv(B=3, n=24, T=16, seed=5)
    clean = compact_block(q, k, v, 6)
    k[1, 3] = float("nan")
    block = compact_block(q, k, v, 6)
    assert block.nonfinite[1] > 0 and block.nonfinite[[0, 2]].tolist() == [0, 0]
    assert block.fallbacks.tolist() == [0, 0, 0]
    assert torch.isfinite(block.values).all()
    for b in (0, 2):
        assert torch.equal(block.index[b], clean.index[b])
        x = torch.softmax(q[b].double() @ clean.keys[b].double().T / math.sqrt(16) + clean.bias[b].double(), -1)
        scale = float(clean.values[b].abs().max())
        tol = q.shape[1] * torch.finfo(torch.float32).eps * float(torch.linalg.cond(x)) ** 2 * scale
        assert float((block.values[b] - clean.values[b]).abs().max()) <= tol


def test_a_degenerate_head_duplicate_keys_and_zero_queries_fits_its_output():
    """All-zero queries over one key repeated: attention is uniform, the output is the mean value;
    the compact block must give that output (computed here by hand), with nothing to report."""
    q, k, v = _qkv(B=1, n=12, T=16, seed=6)
    q.zero_()
    k[0] = k[0, :1].expand(16, -1).clone()
    block = compact_block(q, k, v, 4)
    assert block.fallbacks.tolist() == [0] and block.nonfinite.tolist() == [0]
    weights = torch.softmax(q[0] @ block.keys[0].T / 4.0 + block.bias[0], dim=-1)
    assert torch.allclose(weights @ block.values[0], v[0].mean(0).expand(12, -1), atol=1e-4)


def test_the_run_names_the_heads_whose_fit_fell_back():
    from types import SimpleNamespace

    from kvlab.pipeline import RunResult

    details = {"solver_fallbacks": [[0, 0], [0, 2]], "nonfinite_replaced": [[5, 0], [0, 0]]}
    line = RunResult.numerics_warning.fget(SimpleNamespace(details=details))
    assert line == ("Warning: a solve fell back to zeros in 1 head(s): layer 1 head 1; "
                    "non-finite values were replaced in 1 head(s): layer 0 head 0.")
    assert RunResult.numerics_warning.fget(SimpleNamespace(details={"solver_fallbacks": [[0]]})) is None


def test_blocked_gram_and_its_lower_triangle_solve_as_the_plain_product():
    """Past 2 x GRAM_BLOCK columns the Gram is formed by blocks (lower triangle, mirrored unless only the
    factorisation reads it): equal to ``D^T D``, and the ridge solve equals float64 least squares
    within float32's normal-equations error (n eps cond(D)^2 of the solution)."""
    from kvlab.compression.solvers.linalg import GRAM_BLOCK, gram_matrix, ridge_lstsq

    g = _gen(11)
    m = 2 * GRAM_BLOCK + 37
    d = torch.randn(2, 3 * m, m, generator=g)
    y = torch.randn(2, 3 * m, 5, generator=g)
    plain = d.double().mT @ d.double()
    # A float32 dot product of n terms is within n eps sum |a_i b_i| of the exact one.
    bound = d.shape[1] * torch.finfo(torch.float32).eps * float((d.abs().double().mT @ d.abs().double()).max())
    torch.testing.assert_close(gram_matrix(d).double(), plain, rtol=0, atol=bound)
    lower = gram_matrix(d, lower_only=True)
    assert torch.equal(lower.tril(), gram_matrix(d).tril())
    assert not bool(lower[:, :GRAM_BLOCK, 2 * GRAM_BLOCK :].any())  # above the diagonal blocks: never filled
    x = ridge_lstsq(d, y, torch.ones(2, m), 1e-12)
    ref = torch.linalg.lstsq(d.double(), y.double()).solution
    cond = float(torch.linalg.cond(d.double()).max())
    assert float((x.double() - ref).abs().max()) <= 3 * m * torch.finfo(torch.float32).eps * cond**2 * float(ref.abs().max())
